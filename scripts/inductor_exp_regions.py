"""Whether the regions that compute `exp` eagerly (the SwiGLU's silu and Qwen3.5's sigmoid output gate) give the bits of
the same lines compiled by this machine's Inductor, whose vectorised `exp` is not eager `torch.exp`'s
(`ops._common.inductor_exp`; Qwen3.5's gated output norm needed it). Prints the elements that differ over 60 batches of
2,000 x 512 bf16 inputs at scales 1-5.

    python scripts/inductor_exp_regions.py    # docs/results/<kind>/qwen3_5-exact.txt records its answer
"""

from __future__ import annotations

import torch

from trl_roundalign import ops


def main() -> None:
    torch.manual_seed(1)

    def silu_mul(g, u):
        gf = g.float()
        return (gf / (gf.neg().exp() + 1) * u.float()).to(torch.bfloat16)

    def sigmoid_gate(x, g):
        return (x.float() * (1.0 / (g.float().neg().exp() + 1.0))).to(torch.bfloat16)

    csw, csg = torch.compile(silu_mul, dynamic=True), torch.compile(sigmoid_gate, dynamic=True)
    total = swiglu_diff = gate_diff = 0
    for t in range(60):
        g = (torch.randn(2000, 512) * (1 + t % 5)).bfloat16()
        u = torch.randn(2000, 512).bfloat16()
        swiglu_diff += int((csw(g, u) != ops.swiglu(g, u, profile="vllm-compiled")).sum())
        gate_diff += int((csg(u, g) != ops.sigmoid_gate(u, g, profile="vllm-compiled")).sum())
        total += g.numel()
    print(f"elements {total}: swiglu differs on {swiglu_diff}, sigmoid gate on {gate_diff}")


if __name__ == "__main__":
    main()
