"""RMSNorm and residual add + RMSNorm (the aligned `"fp32"` norm): one rounding, after the weight.

With `v` the normalised row (`f(x)`; `s = f(res) + f(x)` for the fp32 residual stream; `f(r(s))` for
the rounded residual), `rstd = 1 / sqrt(sum(v^2) / n + eps)` and the output is `r(v * rstd * f(w))`,
as in `trl_roundalign.ops.rms_norm` (`_RMSNormRef`, `_AddRMSNormRef`, `_AddRMSNormRoundRef`).
`sum(v^2)` is a `tl.sum` (any order) when `lanes` is None, else Inductor's CPU order over `lanes`
lanes (`_numerics.lane_sum_of_squares`).

Backward: the reference's fp32 derivative from the saved `v` (16-bit `x`, the fp32 sum, or the rounded
residual) and the fp32 `rstd` per row: `dx = rstd * (dy w - x̂ * sum(dy w x̂) / n)`, plus the incoming
gradient of the returned residual for the add variants, rounded once per gradient tensor; `dw` is
accumulated in fp32 per program (`[programs, n]` partial sums), summed, then rounded to `w`'s dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._numerics import (
    INTERPRET,
    arith_for,
    check_launchable,
    fp32_scalar,
    grid_programs,
    lane_sum_of_squares,
    launch_options,
    load_fp32,
    norm_rstd,
    round_to,
    row_block,
    to_fp32,
)

__all__ = ["add_rms_norm_triton", "rms_norm_triton"]

# How the normalised row is formed from the inputs (constexpr MODE of the kernels).
_PLAIN, _ADD_FP32, _ADD_ROUND = 0, 1, 2


@triton.jit
def _rms_norm_fwd_kernel(
    X,
    R,
    W,
    Y,
    RES_OUT,
    RSTD,
    n_rows,
    n,
    inv_n,
    eps,
    stride_x,
    stride_r,
    stride_y,
    stride_res,
    MODE: tl.constexpr,
    LANES: tl.constexpr,
    LOG2_LANES: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
    ARITH: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    cols = tl.arange(0, BLOCK_N)
    mask = row_mask[:, None] & (cols < n)[None, :]
    v = load_fp32(X + rows[:, None] * stride_x + cols[None, :], mask, INTERPRET)
    if MODE != 0:
        # s = f(res) + f(x): the residual first, as the reference adds.
        v = load_fp32(R + rows[:, None] * stride_r + cols[None, :], mask, INTERPRET) + v
        stored = round_to(v, RES_OUT.dtype.element_ty, INTERPRET)
        tl.store(RES_OUT + rows[:, None] * stride_res + cols[None, :], stored, mask=mask)
        if MODE == 2:
            v = to_fp32(stored, INTERPRET)
    if LANES == 0:
        sum_sq = tl.sum(v * v, axis=1)
    else:
        sum_sq = lane_sum_of_squares(
            X, R, rows, row_mask, stride_x, stride_r, n, MODE, LANES, LOG2_LANES, BLOCK_ROWS, INTERPRET
        )
    rstd = norm_rstd(sum_sq, n, inv_n, eps, INTERPRET, ARITH)
    w = load_fp32(W + cols, cols < n, INTERPRET)
    y = (v * rstd[:, None]) * w[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], round_to(y, Y.dtype.element_ty, INTERPRET), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _rms_norm_bwd_kernel(
    DY,
    V,
    W,
    RSTD,
    DRES_IN,
    DX,
    DR,
    DW_PARTIAL,
    n_rows,
    n,
    stride_dy,
    stride_v,
    stride_dres,
    stride_dx,
    stride_dr,
    HAS_DRES_IN: tl.constexpr,
    HAS_DR: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n
    w = load_fp32(W + cols, col_mask, INTERPRET)
    n_f = tl.cast(n, tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for block in range(pid, tl.cdiv(n_rows, BLOCK_ROWS), n_programs):
        rows = (block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        dy = load_fp32(DY + rows[:, None] * stride_dy + cols[None, :], mask, INTERPRET)
        v = load_fp32(V + rows[:, None] * stride_v + cols[None, :], mask, INTERPRET)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        xhat = v * rstd[:, None]
        dxhat = dy * w[None, :]
        dot = tl.div_rn(tl.sum(dxhat * xhat, axis=1), n_f)
        dx = rstd[:, None] * (dxhat - xhat * dot[:, None])
        if HAS_DRES_IN:
            dx = dx + load_fp32(DRES_IN + rows[:, None] * stride_dres + cols[None, :], mask, INTERPRET)
        tl.store(
            DX + rows[:, None] * stride_dx + cols[None, :], round_to(dx, DX.dtype.element_ty, INTERPRET), mask=mask
        )
        if HAS_DR:
            tl.store(
                DR + rows[:, None] * stride_dr + cols[None, :], round_to(dx, DR.dtype.element_ty, INTERPRET), mask=mask
            )
        dw += tl.sum(dy * xhat, axis=0)
    tl.store(DW_PARTIAL + pid * n + cols, dw, mask=col_mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as a 2-D `[rows, n]` tensor with unit column stride (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _lanes_meta(lanes: int | None) -> tuple[int, int]:
    if lanes is None:
        return 0, 0
    if lanes < 1 or lanes & (lanes - 1):
        raise ValueError(f"reduction lanes must be a power of two, got {lanes}.")
    return lanes, lanes.bit_length() - 1


def _forward(x, residual, weight, eps, lanes, mode: int, res_dtype: torch.dtype | None, arith: int):
    """Launch the forward kernel; returns `(y, new_residual or None, rstd)`, `y` and the residual in `x`'s shape."""
    n = x.shape[-1]
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    n_rows = x2.shape[0]
    y = torch.empty(x.shape, dtype=weight.dtype, device=x.device)
    res_out = torch.empty(x.shape, dtype=res_dtype, device=x.device) if mode != _PLAIN else y
    y2, res2 = y.view(-1, n), res_out.view(-1, n)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    lanes_c, log2_lanes = _lanes_meta(lanes)
    block_rows, block_n = row_block(n, lanes_c)
    if n_rows:
        _rms_norm_fwd_kernel[(triton.cdiv(n_rows, block_rows),)](
            x2,
            r2,
            weight,
            y2,
            res2,
            rstd,
            n_rows,
            n,
            fp32_scalar(1.0 / fp32_scalar(n)),
            fp32_scalar(eps),
            x2.stride(0),
            r2.stride(0),
            y2.stride(0),
            res2.stride(0),
            MODE=mode,
            LANES=lanes_c,
            LOG2_LANES=log2_lanes,
            BLOCK_ROWS=block_rows,
            BLOCK_N=block_n,
            INTERPRET=INTERPRET,
            ARITH=arith,
            **launch_options(block_rows * block_n, arith),
        )
    return y, (res_out if mode != _PLAIN else None), rstd


def _backward(dy, v, weight, rstd, dres_in, dx_dtype: torch.dtype, dr_dtype: torch.dtype | None):
    """Launch the backward kernel; returns `(dx, dr or None, dw)`, `dx` and `dr` in `v`'s shape."""
    n = v.shape[-1]
    v2, dy2 = _rows(v), _rows(dy)
    n_rows = v2.shape[0]
    dres2 = _rows(dres_in) if dres_in is not None else dy2
    dx = torch.empty(v.shape, dtype=dx_dtype, device=v.device)
    dr = torch.empty(v.shape, dtype=dr_dtype, device=v.device) if dr_dtype is not None else dx
    dx2, dr2 = dx.view(-1, n), dr.view(-1, n)
    block_rows, block_n = row_block(n)
    n_programs = grid_programs(triton.cdiv(n_rows, block_rows), v)
    dw_partial = torch.zeros((n_programs, n), dtype=torch.float32, device=v.device)
    if n_rows:
        _rms_norm_bwd_kernel[(n_programs,)](
            dy2,
            v2,
            weight,
            rstd,
            dres2,
            dx2,
            dr2,
            dw_partial,
            n_rows,
            n,
            dy2.stride(0),
            v2.stride(0),
            dres2.stride(0),
            dx2.stride(0),
            dr2.stride(0),
            HAS_DRES_IN=dres_in is not None,
            HAS_DR=dr_dtype is not None,
            BLOCK_ROWS=block_rows,
            BLOCK_N=block_n,
            INTERPRET=INTERPRET,
            **launch_options(block_rows * block_n),
        )
    dw = dw_partial.sum(dim=0).to(weight.dtype)
    return dx, (dr if dr_dtype is not None else None), dw


class RMSNormFunction(torch.autograd.Function):
    """`r(x̂(x) * f(w))` in `w`'s dtype; saves `x`, `w` and the fp32 `rstd` per row."""

    @staticmethod
    def forward(ctx, x, weight, eps, lanes, arith):
        y, _, rstd = _forward(x, None, weight, eps, lanes, _PLAIN, None, arith)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, _, dw = _backward(dy, x, weight, rstd, None, x.dtype, None)
        return dx, dw, None, None, None


class AddRMSNormFunction(torch.autograd.Function):
    """fp32 residual stream: `(r(x̂(s) * f(w)), s)` with `s = f(res) + f(x)` returned in fp32; saves `s`."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, lanes, arith):
        y, s, rstd = _forward(x, residual, weight, eps, lanes, _ADD_FP32, torch.float32, arith)
        ctx.save_for_backward(s, weight, rstd)
        ctx.dtypes = (x.dtype, residual.dtype)
        return y, s

    @staticmethod
    def backward(ctx, dy, ds_out):
        s, weight, rstd = ctx.saved_tensors
        x_dtype, res_dtype = ctx.dtypes
        dx, dr, dw = _backward(dy, s, weight, rstd, ds_out, x_dtype, res_dtype)
        return dx, dr, dw, None, None, None


class AddRMSNormRoundFunction(torch.autograd.Function):
    """Rounded residual: `(r(x̂(r(s)) * f(w)), r(s))`, `r(s)` in `x`'s dtype; saves `r(s)`."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, lanes, arith):
        y, new_res, rstd = _forward(x, residual, weight, eps, lanes, _ADD_ROUND, x.dtype, arith)
        ctx.save_for_backward(new_res, weight, rstd)
        ctx.res_dtype = residual.dtype
        return y, new_res

    @staticmethod
    def backward(ctx, dy, ds_out):
        new_res, weight, rstd = ctx.saved_tensors
        dx, dr, dw = _backward(dy, new_res, weight, rstd, ds_out, new_res.dtype, ctx.res_dtype)
        return dx, dr, dw, None, None, None


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, lanes: int | None, gpu_kernels: str = "inductor"
) -> torch.Tensor:
    """Aligned RMSNorm, Triton kernels; output in `weight`'s dtype (inputs checked by `trl_roundalign.ops`).

    `gpu_kernels`: the forward's device arithmetic (`_numerics.arith_for`); the backward is eager arithmetic.
    """
    check_launchable(x, weight)
    return RMSNormFunction.apply(x, weight.contiguous(), float(eps), lanes, arith_for(gpu_kernels))


def add_rms_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    lanes: int | None,
    fp32_residual: bool,
    gpu_kernels: str = "inductor",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add + aligned RMSNorm, Triton kernels: `(normed, new_residual)`.

    `fp32_residual=True`: the new residual is the fp32 sum `f(residual) + f(x)`, never rounded.
    `False`: it is `r(f(residual) + f(x))` in `x`'s dtype, and the variance is taken from it.
    """
    check_launchable(x, residual, weight)
    fn = AddRMSNormFunction if fp32_residual else AddRMSNormRoundFunction
    return fn.apply(x, residual, weight.contiguous(), float(eps), lanes, arith_for(gpu_kernels))
