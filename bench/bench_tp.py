"""What the TP-aligned row-parallel linear costs (`trl_roundalign.engine.tp`, issue 27 part 5), against `F.linear`.

One row-parallel layer (`o_proj`, `down_proj`) of SmolLM2-135M and of a 1.5B model (Qwen2.5-1.5B's widths: hidden
1536, intermediate 8960), `tokens` rows of input, no bias (neither family has one there):

- `f_linear`: `F.linear`, what the trainer computes without TP alignment;
- `tp2`: `tp.row_parallel_linear(x, w, None, 2)`, two bf16 partial GEMMs over the K halves summed in fp32 and
  rounded once (plain GEMMs, `rows=0`), what exact mode computes against a TP=2 vLLM-CPU engine;
- `tp2_blocks64`: the same with the GEMMs in row blocks of 64 (`rows=64`), as on an Intel AMX CPU where the engine
  computes in row blocks (`trl_roundalign.engine.gemm`);
- on a GPU also `triton_tp2`: the one-pass Triton kernel (`trl_roundalign.ops.triton.row_parallel`).

Forward (no autograd) and forward + backward (the ordinary GEMM gradient for x and W), medians of interleaved
rounds (`harness`: one torch thread, process CPU time on a CPU, wall clock on a GPU), and memory of one forward +
backward above the inputs (`harness.measure_memory`: peak, held after forward, saved for backward).

Usage: `python bench/bench_tp.py [--tokens 512] [--repeats 9] [--quick] [--out DIR]`; results appended to
`bench_tp.json`/`.csv` under `--out` (default bench/results/), read in docs/cost.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

from trl_roundalign import tp  # noqa: E402

# (model, layer): (N, K) of the weight.
SHAPES = {
    ("SmolLM2-135M", "o_proj"): (576, 576),
    ("SmolLM2-135M", "down_proj"): (576, 1536),
    ("1.5B", "o_proj"): (1536, 1536),
    ("1.5B", "down_proj"): (1536, 8960),
}


def impls(dev: torch.device) -> dict:
    ways = {
        "f_linear": lambda x, w: F.linear(x, w),
        "tp2": lambda x, w: tp.row_parallel_linear(x, w, None, 2, rows=0),
    }
    if dev.type == "cpu":
        ways["tp2_blocks64"] = lambda x, w: tp.row_parallel_linear(x, w, None, 2, rows=64)
    else:
        from trl_roundalign.ops.triton.row_parallel import row_parallel_linear_triton

        ways["triton_tp2"] = lambda x, w: row_parallel_linear_triton(x, w, None, 2)
    return ways


def one_shape(ways: dict, model: str, layer: str, n: int, k: int, tokens: int, repeats: int, dev) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, k, generator=g).bfloat16().to(dev)
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16().to(dev)
    dy = torch.randn(tokens, n, generator=g).bfloat16().to(dev)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()

    def fwd(fn):
        def call():
            with torch.no_grad():
                fn(x, w)
        return call

    def fwd_bwd(fn):
        def call():
            xr.grad = wr.grad = None
            fn(xr, wr).backward(dy)
        return call

    t_f = harness.time_interleaved({i: fwd(f) for i, f in ways.items()}, dev, warmup=2, repeats=repeats)
    t_fb = harness.time_interleaved({i: fwd_bwd(f) for i, f in ways.items()}, dev, warmup=2, repeats=repeats)
    clock = harness.primary_clock(dev)
    out = []
    for impl, fn in ways.items():
        xr.grad = wr.grad = None
        mem = harness.measure_memory(lambda fn=fn: fn(xr, wr), lambda y: y.backward(dy), dev)
        out.append({
            "model": model, "layer": layer, "n": n, "k": k, "tokens": tokens, "impl": impl,
            "fwd_ms": 1e3 * harness.median(t_f[impl][clock]),
            "fwd_bwd_ms": 1e3 * harness.median(t_fb[impl][clock]),
            "fwd_ratio": harness.paired_ratio(t_f[impl][clock], t_f["f_linear"][clock]),
            "fwd_bwd_ratio": harness.paired_ratio(t_fb[impl][clock], t_fb["f_linear"][clock]),
            "peak_mib": mem["peak"] / 2**20, "held_mib": mem["held"] / 2**20, "saved_mib": mem["saved"] / 2**20,
        })
    return out


def measure(shapes: dict, tokens: int, repeats: int, dev: torch.device) -> list[dict]:
    ways = impls(dev)
    out = []
    for (model, layer), (n, k) in shapes.items():
        out += one_shape(ways, model, layer, n, k, tokens, repeats, dev)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=None, help="rows of input (default 512 on a CPU, 8192 on a GPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 9; --quick 2)")
    p.add_argument("--quick", action="store_true", help="smoke test: one shape, 64 tokens, 2 rounds")
    p.add_argument("--out", default=None)
    p.add_argument("--no-save", action="store_true")
    a = p.parse_args(argv)
    dev = harness.device()
    note = harness.set_cpu_threads(None, dev)
    tokens = 64 if a.quick else (a.tokens or (512 if dev.type == "cpu" else 8192))
    repeats = a.repeats or (2 if a.quick else 9)
    shapes = {("SmolLM2-135M", "down_proj"): SHAPES["SmolLM2-135M", "down_proj"]} if a.quick else SHAPES
    results = measure(shapes, tokens, repeats, dev)
    from trl_roundalign.engine.gemm import cpu_kind

    kind = cpu_kind() if dev.type == "cpu" else None
    cols = [("model", "model"), ("layer", "layer"), ("impl", "impl"), ("fwd_ms", "fwd ms"), ("fwd_ratio", "x F.linear"),
            ("fwd_bwd_ms", "fwd+bwd ms"), ("fwd_bwd_ratio", "x F.linear"), ("peak_mib", "peak MiB"),
            ("held_mib", "held MiB")]
    shown = [{k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in r.items()} for r in results]
    print(f"{harness.device_description(dev)}; cpu_kind={kind}; {note}; {tokens} tokens, {repeats} rounds")
    print(harness.format_table(shown, cols))
    if not a.no_save:
        settings = {"tokens": tokens, "repeats": repeats, "quick": a.quick, "threads": note, "cpu_kind": kind}
        print(harness.append_results("bench_tp", harness.environment(dev), settings, results, a.out))


if __name__ == "__main__":
    main()
