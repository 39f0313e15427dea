"""Is this machine's bf16 GEMM batch-invariant at the project's models' shapes, and is the row-block schedule?

For each model's linear shapes as the engine computes them (`models.linear_shapes`: q/k/v and gate/up fused, o, down,
lm_head), `gemm.measure_batch_invariance` multiplies random bf16 rows once as a whole (1024 rows) and as their first
M rows for every M of `gemm.row_counts(1024)` (1-32, then steps of ~7%), and each of the first 128 rows alone (a
decode step with one running sequence), with plain `F.linear` and with row blocks of 64 and 128; fused shapes are
also compared with their parts. A shape is variant if any call gives any other bit.

Run: `.venv/bin/python scripts/batch_invariance.py [--rows 1024] [--out DIR]`. Writes DIR/batch_invariance.{md,json}
(default docs/results/<cpu kind>: amx, avx512 or avx2, as `gemm.cpu_kind()` names this machine).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from _results import cpu_model, write_table  # noqa: E402

from trl_roundalign.engine import gemm, set_offline_defaults  # noqa: E402
from trl_roundalign.models import linear_shapes  # noqa: E402

set_offline_defaults(ROOT / ".cache")


def configs() -> dict:
    from transformers import AutoConfig

    from trl_roundalign.local_models import peaked_qwen3, smollm2_135m, tiny_model

    return {
        "smollm2-135m": AutoConfig.from_pretrained(str(smollm2_135m())),
        "peaked-qwen3": AutoConfig.from_pretrained(str(peaked_qwen3())),
        "tiny-qwen3": AutoConfig.from_pretrained(str(tiny_model("qwen3"))),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    out = Path(a.out) if a.out else ROOT / "docs" / "results" / gemm.cpu_kind()
    rows, lines = [], [
        f"Batch invariance of bf16 linear layers on {cpu_model()} ({gemm.cpu_kind()}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads), M = 1..{a.rows}:", "",
        "| model | layer | K x N | plain F.linear | row blocks of 64 | row blocks of 128 |", "|---|---|---|---|---|---|",
    ]
    t0 = time.time()
    for model, cfg in configs().items():
        shapes = linear_shapes(cfg)
        reports = {b: gemm.measure_batch_invariance(shapes, a.rows, block_rows=b) for b in (0, 64, 128)}
        for i, name in enumerate(shapes):
            res = {b: r.shapes[i] for b, r in reports.items()}
            first = res[0]
            cells = ["invariant" if r.invariant else r.describe().split(": ", 1)[1] for r in res.values()]
            lines.append(f"| {model} | {name} | {first.k} x {'+'.join(map(str, first.n))} | " + " | ".join(cells) + " |")
            rows.append({"model": model, "layer": name, "k": first.k, "n": list(first.n),
                         **{f"block_rows_{b}": {
                             "invariant": r.invariant, "variant_rows": gemm._ranges(r.variant_rows),
                             "worst_fraction": r.worst_fraction, "fused_differs": r.fused_differs,
                             "rows_tried": r.rows_tried} for b, r in res.items()}})
    meta = {"cpu": cpu_model(), "kind": gemm.cpu_kind(), "flags": gemm._cpu_flags(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "max_rows": a.rows, "seconds": round(time.time() - t0, 1)}
    write_table(out, "batch_invariance", "scripts/batch_invariance.py", meta, lines, rows)


if __name__ == "__main__":
    main()
