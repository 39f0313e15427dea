"""The TP-aligned row-parallel linear as vLLM's CUDA custom all-reduce sums it, in one kernel.

A TP=k engine's row-parallel layer (`o_proj`, `down_proj`): rank r computes the bf16 GEMM of its contiguous K
slice, `p_r = r(x_r W_r^T [+ b if r == 0])` (fp32 accumulation inside, one rounding), and the one-stage custom
all-reduce (csrc/custom_all_reduce.cuh, `cross_device_reduce_1stage`) upcasts the partials and adds them in
rank order 0..k-1 in fp32, rounding once:

    y = r(((f(p_0) + f(p_1)) + f(p_2)) + ...)

`row_parallel_linear_triton` computes that per output tile in one pass: for r = 0..k-1 (unrolled), one fp32
`tl.dot` accumulator over slice r, rounded to bf16 and widened back, added to a running fp32 sum; one final
rounding at the store. Registers hold two fp32 tiles (the slice's accumulator and the sum), never k full-size
partial tensors in memory (the PyTorch form, `trl_roundalign.engine.tp.row_parallel_linear`, materializes each).
The backward is the ordinary GEMM gradient (as `trl_roundalign.engine.tp`), not part of the bitwise claim.

What is exact and what is not (read from sources, not run on a GPU): the reduction and the roundings are
the engine's; each slice's fp32 accumulation is `tl.dot`'s order, not cuBLAS's, so a partial can differ from
the engine's shard GEMM by the accumulation order alone. Inputs whose products and sums are exact in fp32
(small integers) make every order agree, which is how the tests check the structure bit for bit; on other
inputs the kernel matches the PyTorch form within the flips that GEMM order gives (tests/ops/test_gpu_ops.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._numerics import INTERPRET, check_launchable, round_to, to_fp32

__all__ = ["row_parallel_linear_triton"]

# Tiles: the interpreter runs programs one after another (few, large ones); a GPU wants mma-sized tiles.
_BLOCKS = (32, 32, 32) if INTERPRET else (64, 64, 64)


@triton.jit
def _row_parallel_fwd_kernel(
    X, W, B, Y, M, N, K_SHARD,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    TP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_m = rm < M
    mask_n = rn < N
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in tl.static_range(TP):
        # Rank r's GEMM: fp32 accumulation over its slice [r * K_SHARD, (r + 1) * K_SHARD).
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K_SHARD, BLOCK_K):
            kin = (k0 + rk) < K_SHARD
            kk = r * K_SHARD + k0 + rk
            x = tl.load(X + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                        mask=mask_m[:, None] & kin[None, :], other=0.0)
            w = tl.load(W + rn[None, :] * stride_wn + kk[:, None] * stride_wk,
                        mask=kin[:, None] & mask_n[None, :], other=0.0)
            if INTERPRET:  # the interpreter's bf16 dot multiplies the raw bits: upcast (exactly) first
                acc = tl.dot(to_fp32(x, INTERPRET), to_fp32(w, INTERPRET), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
        if HAS_BIAS and r == 0:  # the bias is in rank 0's GEMM epilogue (fp32, before its rounding)
            b = to_fp32(tl.load(B + rn, mask=mask_n, other=0.0), INTERPRET)
            acc = acc + b[None, :]
        # The partial as rank r stores it (one rounding), then upcast exactly, as the all-reduce reads it.
        part = to_fp32(round_to(acc, tl.bfloat16, INTERPRET), INTERPRET)
        if r == 0:
            total = part
        else:
            total = total + part  # fp32, rank order 0..k-1
    y = round_to(total, Y.dtype.element_ty, INTERPRET)
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :] * stride_yn, y, mask=mask_m[:, None] & mask_n[None, :])


def _forward(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: int) -> torch.Tensor:
    m, k = x2.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=weight.dtype, device=x2.device)
    if m == 0:
        return y
    bm, bn, bk = _BLOCKS
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _row_parallel_fwd_kernel[grid](
        x2, weight, bias if bias is not None else weight, y, m, n, k // tp,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
        TP=tp, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, INTERPRET=INTERPRET,
        **({} if INTERPRET else {"num_warps": 4, "num_stages": 3}),
    )
    return y


class _RowParallelTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, tp):
        y = _forward(x.reshape(-1, x.shape[-1]), weight, bias, tp)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        from ...engine.tp import linear_grads

        return (*linear_grads(ctx, grad), None)


def row_parallel_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: int
) -> torch.Tensor:
    """`x @ weight.T + bias` as a TP=`tp` engine's row-parallel layer with the one-stage custom all-reduce computes
    it: `tp` bf16 partials over contiguous K slices (bias in the first), summed in fp32 in rank order, one rounding.

    bf16 `x` (..., K) and `weight` (N, K); `bias` (N,) or None. Differentiable (the ordinary GEMM gradient)."""
    if weight.dtype != torch.bfloat16 or x.dtype != torch.bfloat16:
        raise TypeError(f"bf16 inputs expected (the engine's partials are bf16); got {x.dtype}, {weight.dtype}")
    if weight.shape[1] % tp or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"inner dimension {x.shape[-1]} / {weight.shape[1]} does not split into {tp} equal shards")
    check_launchable(x)
    return _RowParallelTriton.apply(x, weight, bias, tp)
