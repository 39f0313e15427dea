"""The mismatch callback's per-step work at scale: `--ranks` processes (gloo, this machine) x `--tokens` each.

Per rank and step, what `MismatchCallback` does: `mismatch_sums` of the step's completion tokens (`record`),
the cross-process `reduce_across_processes` (an all-gather of each rank's statistics) and `finalize`. The
statistics a rank sends have a bounded size (scalars, one sum per sequence, a sparse histogram of |Δ|), which
the table reports with the time (median over `--repeats`, the slowest rank).

The share of a step: against a lower bound of a GRPO step at that scale, the forward + backward of the same
tokens on a 1.5B-parameter policy at an H200's dense bf16 peak (6 x params x tokens / 989 TFLOP/s); real
steps also generate, so they are longer and the share smaller.

Usage: `python bench/bench_callback_scale.py [--ranks 8] [--tokens 65536] [--seq-len 1024] [--out DIR]`.
Writes `bench_callback_scale.json` under `--out` (default bench/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
H200_BF16_DENSE_FLOPS = 989e12
POLICY_PARAMS = 1.5e9


def _worker(rank: int, world: int, init_file: str, tokens: int, seq_len: int, repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    from trl_roundalign import metrics

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    b = tokens // seq_len
    infer = -torch.rand(b, seq_len, generator=g) * 6
    train = infer + torch.randn(b, seq_len, generator=g) * 1e-3
    ties = torch.rand(b, seq_len, generator=g) < 0.3  # bit-identical tokens, as an aligned run has
    train[ties] = infer[ties]
    mask = torch.ones(b, seq_len)
    rows = []
    for _ in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        local = metrics.mismatch_sums(train, infer, mask)
        t1 = time.perf_counter()
        total = metrics.reduce_across_processes(local)
        t2 = time.perf_counter()
        metrics.finalize(total)
        t3 = time.perf_counter()
        rows.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
    rows = rows[1:]  # the first round warms up
    result = {
        "rank": rank,
        "record_ms": 1e3 * statistics.median(r[0] for r in rows),
        "reduce_ms": 1e3 * statistics.median(r[1] for r in rows),
        "finalize_ms": 1e3 * statistics.median(r[2] for r in rows),
        "total_ms": 1e3 * statistics.median(r[3] for r in rows),
        "payload_bytes": len(pickle.dumps(local)),
        "histogram_buckets": int(local.abs_diff_buckets.numel()),
        "merged_buckets": int(total.abs_diff_buckets.numel()),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args(argv)
    import torch
    import torch.multiprocessing as mp

    sys.path.insert(0, str(ROOT / "bench"))
    from harness import environment

    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.start_processes(
            _worker, args=(a.ranks, init_file, a.tokens, a.seq_len, a.repeats, tmp), nprocs=a.ranks, start_method="spawn"
        )
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(a.ranks)]
    slowest = max(ranks, key=lambda r: r["total_ms"])
    step_floor_ms = 1e3 * 6 * POLICY_PARAMS * a.tokens / H200_BF16_DENSE_FLOPS
    summary = {
        "ranks": a.ranks,
        "tokens_per_rank": a.tokens,
        "callback_ms_slowest_rank": round(slowest["total_ms"], 2),
        "record_ms": round(slowest["record_ms"], 2),
        "reduce_ms": round(slowest["reduce_ms"], 2),
        "finalize_ms": round(slowest["finalize_ms"], 2),
        "payload_bytes_per_rank": max(r["payload_bytes"] for r in ranks),
        "merged_histogram_buckets": slowest["merged_buckets"],
        "step_floor_ms_1p5b_h200": round(step_floor_ms, 1),
        "pct_of_step_floor": round(100 * slowest["total_ms"] / step_floor_ms, 3),
    }
    print(json.dumps(summary, indent=1))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    payload = {"environment": environment(torch.device("cpu")), "config": vars(a), "summary": summary, "ranks": ranks}
    (Path(a.out) / "bench_callback_scale.json").write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
