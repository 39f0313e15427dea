"""Memory and time of fp32 gradient accumulation (`MasterWeightsOptimizer`) against bf16 accumulation.

Each mode runs in a fresh process (peak RSS is per process): a bf16 model of `--layers` square Linear
layers (`--width`), SGD (stateless, so the memory above the baseline is gradients and activations) on fp32 masters, `--accumulation` micro-batches per step, `--steps` steps.

- `fp32`: the shipped path: each micro-batch's bf16 gradient is added into the master's fp32 `.grad` by a
  post-accumulate hook and freed;
- `bf16`: the path before it (hooks removed, `legacy_step`): micro-batch gradients accumulate in the bf16
  `p.grad` and the step makes an fp32 copy of all of them.

Reported: peak RSS above the model + masters baseline (MiB), i.e. what the gradients (and activations) add, against the bytes per parameter each path holds, and the median step time (s).
Usage: `python bench/bench_accumulation.py [--width 1024 --layers 8 --accumulation 8 --steps 3] [--out DIR]`.
Writes `bench_accumulation.json` under `--out` (default bench/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def legacy_step(opt) -> None:
    """The step before fp32 accumulation: an fp32 copy of every bf16 gradient, made at step time."""
    import torch

    with torch.no_grad():
        for p, m in zip(opt._model_params, opt.masters):
            m.grad = p.grad.float()
        opt.inner.step()
        for p, m in zip(opt._model_params, opt.masters):
            p.copy_(m)


def run_mode(mode: str, width: int, layers: int, accumulation: int, steps: int) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from trl_roundalign.trainer.masters import MasterWeightsOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]).to(torch.bfloat16)
    # Stateless SGD, so the baseline (model + masters) and the peak differ by the gradients and activations only.
    opt = MasterWeightsOptimizer(list(model.parameters()), torch.optim.SGD, lr=1e-6)
    if mode == "bf16":
        opt.remove_hooks()
    x = torch.randn(8, width).to(torch.bfloat16)
    with torch.no_grad():
        model(x)  # activations of one forward
    baseline = _rss_mib()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for _ in range(accumulation):
            model(x).float().square().mean().backward()
        if mode == "bf16":
            legacy_step(opt)
        else:
            opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in model.parameters())
    return {
        "mode": mode,
        "params": params,
        "peak_rss_above_baseline_mib": round(_rss_mib() - baseline, 1),
        "step_s_median": statistics.median(times),
        "peak_rss_above_baseline_bytes_per_param": round((_rss_mib() - baseline) * 2**20 / params, 2),
        "grad_bytes_per_param_during_accumulation": 4 if mode == "fp32" else 2,
        "grad_bytes_per_param_at_step": 4 if mode == "fp32" else 6,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--accumulation", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mode", choices=["fp32", "bf16"], help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args(argv)
    if a.mode:
        print(json.dumps(run_mode(a.mode, a.width, a.layers, a.accumulation, a.steps)))
        return 0
    sys.path.insert(0, str(ROOT / "bench"))
    import torch
    from harness import environment  # noqa: E402

    rows = []
    for mode in ("bf16", "fp32"):
        cmd = [sys.executable, __file__, "--mode", mode, "--width", str(a.width), "--layers", str(a.layers),
               "--accumulation", str(a.accumulation), "--steps", str(a.steps)]  # fmt: skip
        # A fixed mmap threshold: glibc then maps every large tensor and unmaps it when freed, so the peak RSS
        # follows the live tensors instead of the heap's high-water mark.
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout.strip().splitlines()[-1]
        rows.append(json.loads(out))
        print(rows[-1])
    result = {"environment": environment(torch.device("cpu")), "config": vars(a), "rows": rows}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "bench_accumulation.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
