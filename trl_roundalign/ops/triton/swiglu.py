"""SwiGLU, profile mode `"fp32"`: `r(silu(f(g)) * f(u))` with `silu(g) = g / (exp(-g) + 1)`, one rounding.

Forward and backward are elementwise kernels over the flattened tensors. The backward is the exact
fp32 derivative of the reference (`trl_roundalign.ops.swiglu.swiglu_backward_fp32`), from the saved
16-bit inputs, rounded once per gradient: `dg = do * u * s * (1 + g * (1 - s))`, `du = do * silu(g)`,
`s = 1 / (exp(-g) + 1)`.

`exp`: the argument is always `-f(g)` for a 16-bit `g`, so it takes one of 65536 values. On a GPU the
kernel calls `libdevice.exp` (`__nv_expf`, what CUDA's `expf` and so torch's eager `exp` run). Under
the CPU interpreter `tl.exp` is numpy's float32 `exp`, which differs from torch's CPU `exp` by 1-2
ulp on 3153 of the 65536 inputs (4.8%); written with it, the kernel's bf16 outputs differ from the
reference on 2e-6 of N(0, 3) gates (fp16: 2.6e-5) and on 0.7% of all bf16 gates with |g| < 30. So
the interpreter reads `exp(-f(g))` from a 65536-entry table computed by `torch.exp` on the tensor's
device: the function the reference calls, tabulated over its whole input space, and 0 mismatches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._numerics import (
    ARITH_EAGER,
    INTERPRET,
    arith_for,
    check_launchable,
    fdiv,
    launch_options,
    load_fp32,
    round_to,
    to_fp32,
)

__all__ = ["swiglu_triton"]

_BLOCK = 1 << 16 if INTERPRET else 1024
_EXP_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _exp_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.exp(-f(v))` for every 16-bit pattern `v` of `dtype`, indexed by the pattern (fp32)."""
    key = (dtype, device)
    if key not in _EXP_TABLES:
        patterns = torch.arange(65536, dtype=torch.int32, device=device).to(torch.int16)
        _EXP_TABLES[key] = torch.exp(-patterns.view(dtype).float()).contiguous()
    return _EXP_TABLES[key]


@triton.jit
def _exp_neg(g16, gf, EXP_TABLE, EXP_FROM_TABLE: tl.constexpr):
    """`exp(-f(g))` in fp32: from the tabulated torch values (interpreter) or libdevice (GPU)."""
    if EXP_FROM_TABLE:
        idx = g16.to(tl.uint16, bitcast=True).to(tl.int32)
        return tl.load(EXP_TABLE + idx)
    else:
        return libdevice.exp(-gf)


@triton.jit
def _swiglu_fwd_kernel(
    G,
    U,
    Y,
    EXP_TABLE,
    n,
    BLOCK: tl.constexpr,
    EXP_FROM_TABLE: tl.constexpr,
    INTERPRET: tl.constexpr,
    ARITH: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g16 = tl.load(G + offs, mask=mask, other=0.0)
    gf = to_fp32(g16, INTERPRET)
    uf = load_fp32(U + offs, mask, INTERPRET)
    silu = fdiv(gf, _exp_neg(g16, gf, EXP_TABLE, EXP_FROM_TABLE) + 1.0, ARITH)
    tl.store(Y + offs, round_to(silu * uf, Y.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    DO, G, U, DG, DU, EXP_TABLE, n, BLOCK: tl.constexpr, EXP_FROM_TABLE: tl.constexpr, INTERPRET: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g16 = tl.load(G + offs, mask=mask, other=0.0)
    gf = to_fp32(g16, INTERPRET)
    uf = load_fp32(U + offs, mask, INTERPRET)
    go = load_fp32(DO + offs, mask, INTERPRET)
    sig = tl.div_rn(1.0, _exp_neg(g16, gf, EXP_TABLE, EXP_FROM_TABLE) + 1.0)
    silu = gf * sig
    dg = go * uf * sig * (1.0 + gf * (1.0 - sig))
    du = go * silu
    tl.store(DG + offs, round_to(dg, DG.dtype.element_ty, INTERPRET), mask=mask)
    tl.store(DU + offs, round_to(du, DU.dtype.element_ty, INTERPRET), mask=mask)


def _launch(kernel, *tensors: torch.Tensor, n: int, exp_table: torch.Tensor, arith: int | None = None) -> None:
    grid = (triton.cdiv(n, _BLOCK),)
    extra = {} if arith is None else {"ARITH": arith}
    kernel[grid](
        *tensors,
        exp_table,
        n,
        BLOCK=_BLOCK,
        EXP_FROM_TABLE=INTERPRET,
        INTERPRET=INTERPRET,
        **extra,
        **launch_options(_BLOCK, ARITH_EAGER if arith is None else arith),
    )


def _table_for(gate: torch.Tensor) -> torch.Tensor:
    # On a GPU the table pointer is never read: pass any fp32 tensor on the device.
    return _exp_table(gate.dtype, gate.device) if INTERPRET else gate.new_empty(1, dtype=torch.float32)


class SwiGLUFunction(torch.autograd.Function):
    """`r(silu(f(g)) * f(u))`; saves the 16-bit `gate` and `up` only (as given: strided views stay views)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, arith: int) -> torch.Tensor:
        gate_c, up_c = gate.contiguous(), up.contiguous()
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        n = gate_c.numel()
        if n:
            _launch(_swiglu_fwd_kernel, gate_c, up_c, out, n=n, exp_table=_table_for(gate_c), arith=arith)
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        gate_c, up_c, grad_c = gate.contiguous(), up.contiguous(), grad.contiguous()
        dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        du = torch.empty(up.shape, dtype=up.dtype, device=up.device)
        n = gate_c.numel()
        if n:
            _launch(_swiglu_bwd_kernel, grad_c, gate_c, up_c, dg, du, n=n, exp_table=_table_for(gate_c))
        return dg, du, None


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor, gpu_kernels: str = "inductor") -> torch.Tensor:
    """SwiGLU with one rounding, Triton kernels (inputs already checked by `trl_roundalign.ops.swiglu`).

    `gpu_kernels`: the forward's device arithmetic, `"inductor"` (compiled engines) or `"eager"`
    (`_numerics.arith_for`); the backward always computes the eager arithmetic.
    """
    check_launchable(gate, up)
    return SwiGLUFunction.apply(gate, up, arith_for(gpu_kernels))
