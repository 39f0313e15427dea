"""Where along the depth the mismatch arises (`trl-roundalign analyze MODEL --per-layer`).

For every condition the Hugging Face model's values after each layer are compared with the engine's:
the attention output and the MLP output of each layer (the two sublayers) and the residual stream after
each layer, then the final norm's output. The statistic is the relative L2 difference over all tokens of
all scored sequences, `||h - h_engine|| / ||h_engine||`, with the largest absolute difference and the
fraction of values that are bit-identical.

The engine's values: vLLM's compiled graph does not expose its intermediate tensors (the decoder layers run
inside one Inductor graph, or pieces split at attention, with no module boundary left to hook). The reference
is the exact mode, the forward that reproduces that graph operation for operation; its log-probs are checked
bit for bit against the engine's prefill log-probs of the same sequences in the same analysis
(`reference_bit_identical`, the fraction of completion tokens whose log-prob is bit-identical). Where that
fraction is 1.0, every intermediate the exact mode computes is the engine's value up to the choice of
which of them the engine materialises; below 1.0 the table says how far the reference itself is from the
engine. Without an exact mode (an eager or GPU engine) `--per-layer` refuses.

The residual stream is compared as the value the next layer reads: under the fp32-stream profiles the
unrounded fp32 sum, under default BF16 Hugging Face's bf16 stream. A condition's stream differing from the
reference only by that final rounding shows as about 2**-9 relative.

Outputs: `per_layer.csv` (one row per condition, layer and point) and `per_layer.png` (stream and sublayers by
layer, one line per condition), and `summary.json["per_layer"]`.
"""

from __future__ import annotations

import csv
import functools
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from ..engine.gemm import PLAIN, GemmSchedule

__all__ = ["POINTS", "LayerRecorder", "per_layer_differences", "plot_per_layer", "write_per_layer_csv"]

POINTS = ("attention", "mlp", "stream")  # per decoder layer; the final norm is point "final_norm"
CSV_FIELDS = ("condition", "layer", "point", "rel_l2", "max_abs", "frac_bit_identical", "elements")


def _position(layer: int, point: str) -> tuple[int, int]:
    """Forward order: a layer's attention, MLP and stream, then the final norm (the layer after the last)."""
    return layer, POINTS.index(point) if point in POINTS else len(POINTS)


def _tensor(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple | list) else out


class LayerRecorder:
    """Forward hooks on a decoder stack: each layer's attention, MLP and output, and the final norm's output.

    `store()` keeps one forward's values (fp32) as the reference; `compare(name)` accumulates a condition's
    differences from the stored reference; `rows()` returns the statistics. Hooks stay on the modules through
    `apply_roundalign` / `revert_roundalign` (patching replaces `forward`, not the module); `close()` removes them.
    """

    def __init__(self, model: torch.nn.Module):
        from ..models import find_backbone

        backbone = find_backbone(model)
        self.num_layers = len(backbone.layers)
        self._handles = []
        for i, layer in enumerate(backbone.layers):
            self._handles.append(layer.self_attn.register_forward_hook(functools.partial(self._hook, (i, "attention"))))
            self._handles.append(layer.mlp.register_forward_hook(functools.partial(self._hook, (i, "mlp"))))
            self._handles.append(layer.register_forward_hook(functools.partial(self._hook, (i, "stream"))))
        self._handles.append(backbone.norm.register_forward_hook(functools.partial(self._hook, (self.num_layers, "final_norm"))))
        self._mode: str | None = None
        self._name: str | None = None
        self._reference: dict[tuple[int, str], torch.Tensor] = {}
        self._sums: dict[str, dict[tuple[int, str], list[float]]] = {}

    def _hook(self, key, module, args, out):
        if self._mode is None:
            return
        value = _tensor(out).detach().float().reshape(-1)
        if self._mode == "store":
            self._reference[key] = value.clone()
            return
        ref = self._reference[key]
        diff = value - ref
        acc = self._sums.setdefault(self._name, {}).setdefault(key, [0.0, 0.0, 0.0, 0, 0])
        acc[0] += float(diff.double().square().sum())
        acc[1] += float(ref.double().square().sum())
        acc[2] = max(acc[2], float(diff.abs().max())) if diff.numel() else acc[2]
        acc[3] += int((value.view(torch.int32) == ref.view(torch.int32)).sum())
        acc[4] += value.numel()

    def store(self):
        """The next forward is the reference."""
        self._reference.clear()
        self._mode, self._name = "store", None
        return self

    def compare(self, name: str):
        """The next forward is condition `name`, compared with the stored reference."""
        self._mode, self._name = "compare", name
        return self

    def stop(self) -> None:
        self._mode = None

    def rows(self) -> list[dict]:
        out = []
        for name, sums in self._sums.items():
            for (layer, point), (d2, r2, max_abs, same, n) in sorted(sums.items(), key=lambda kv: _position(*kv[0])):
                out.append({
                    "condition": name, "layer": layer, "point": point,
                    "rel_l2": math.sqrt(d2 / r2) if r2 > 0 else float("nan"), "max_abs": max_abs,
                    "frac_bit_identical": same / n if n else float("nan"), "elements": n,
                })  # fmt: skip
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._reference.clear()


def per_layer_differences(
    model_path,
    sequences: Sequence[Sequence[int]],
    conditions: Sequence,
    *,
    reference: str = "exact",
    reduction_lanes: Sequence[int] | None = None,
    attention_block_size: int | None = None,
    backend: str | None = None,
    progress: bool = False,
    engine_max_model_len: int | None = None,
    gemm_schedule: GemmSchedule = PLAIN,
    tensor_parallel: int = 1,
) -> list[dict]:
    """Rows of `per_layer.csv`: each condition's values after every layer against the reference condition's.

    Sequence by sequence (only one sequence's reference values are held): the reference forward, then each
    condition's, each under its own patches, one sequence at a time (no padding, positions from 0 as vLLM's).

    Raises:
        ValueError: no condition named `reference` (the exact mode is needed: see the module docstring).
    """
    from transformers import AutoModelForCausalLM

    from .conditions import apply_condition

    by_name = {c.name: c for c in conditions}
    if reference not in by_name:
        raise ValueError(
            "--per-layer compares each layer with the exact mode (the engine's compiled graph, reproduced operation "
            "for operation; the engine's own intermediate values cannot be read): it needs a vLLM-CPU compiled "
            "engine and --exact auto/on."
        )
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    recorder = LayerRecorder(model)
    order = [by_name[reference]] + [c for c in conditions if c.name != reference]
    iterator = sequences
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(sequences, desc="per-layer differences", unit="sequence")
    try:
        with torch.no_grad():
            for seq in iterator:
                ids = torch.tensor([list(seq)], dtype=torch.long)
                for i, cond in enumerate(order):
                    apply_condition(model, cond, reduction_lanes, attention_block_size, backend, engine_max_model_len, gemm_schedule,
                                    tensor_parallel)
                    (recorder.store() if i == 0 else recorder.compare(cond.name))
                    model(input_ids=ids, use_cache=False)
                    recorder.stop()
                # the reference against itself: the hooks' own check (must be all zero, all bit-identical)
                apply_condition(model, order[0], reduction_lanes, attention_block_size, backend, engine_max_model_len, gemm_schedule,
                                tensor_parallel)
                recorder.compare(reference)
                model(input_ids=ids, use_cache=False)
                recorder.stop()
    finally:
        from ..patching import revert_roundalign

        revert_roundalign(model)
        rows = recorder.rows()
        recorder.close()
    names = [c.name for c in conditions]
    return sorted(rows, key=lambda r: names.index(r["condition"]))  # stable: each condition's rows keep their order


def write_per_layer_csv(rows: Sequence[dict], path: str | Path) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r[k] for k in CSV_FIELDS})


def plot_per_layer(rows: Sequence[dict], path: str | Path, *, title: str = "") -> None:
    """Three panels by layer (residual stream and final norm, attention output, MLP output), a line per condition."""
    from .._extras import agg_pyplot

    plt = agg_pyplot("analysis", "the analyze report's figures")
    from matplotlib.ticker import MaxNLocator

    names = list(dict.fromkeys(r["condition"] for r in rows))
    # A condition equal to the reference everywhere (the exact mode) has no point on a log axis: named in the title.
    zero = [n for n in names if all(r["rel_l2"] == 0 for r in rows if r["condition"] == n)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    panels = (("stream", "residual stream after the layer"), ("attention", "attention output"), ("mlp", "MLP output"))
    for ax, (point, label) in zip(axes, panels):
        for name in names:
            if name in zero:
                continue
            wanted = (point, "final_norm") if point == "stream" else (point,)
            pts = [(r["layer"], r["rel_l2"]) for r in rows if r["condition"] == name and r["point"] in wanted]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=name)
        ax.set_yscale("log")
        ax.set_xlabel("layer" + (" (last point: the final norm)" if point == "stream" else ""))
        ax.set_title(label, fontsize=10)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("relative L2 difference from the engine\n(lower is better)")
    axes[0].legend(fontsize=8)
    if zero:
        title = (title + "\n" if title else "") + f"{', '.join(zero)}: bit-identical to the reference at every point"
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
