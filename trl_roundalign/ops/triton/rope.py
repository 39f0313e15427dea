"""RoPE (neox halves) and Qwen3's q/k-norm + RoPE, rope mode `"fp32"` / q/k-norm `"fp32-fused"`.

Each row is `[x1 | x2 | pass]` with `x1`, `x2` the halves of the rotary part (`rd = cos.shape[-1]`,
`h = rd / 2`); element `j` pairs with `j + h` (first half) or `j - h` (second half), and `c`, `s` are
`cos[..., j mod h]`, `sin[..., j mod h]` upcast from the 16-bit table (what the reference reads from
Hugging Face's duplicated halves). Forward, one rounding:
`o1 = r(f(x1) c - f(x2) s)`, `o2 = r(f(x2) c + f(x1) s)`, pass-through dims copied.
`qk_norm_rope` rotates `x̂(x) * f(w)` (fp32, never rounded) instead of `f(x)`.

cos/sin: any layout that broadcasts to `x[..., :rd]` (Hugging Face's `[b, 1, s, rd]` against
`[b, heads, s, head_dim]`); the kernels read them through a per-row offset into the contiguous table
instead of materialising the broadcast. `x` is made contiguous (a copy when it is not).

Backward: the transposed rotation in fp32 (`dx1 = g1 c + g2 s`, `dx2 = g2 c - g1 s`), rounded once;
for `qk_norm_rope` it feeds, unrounded, the norm's derivative with the saved `x`, `w` and fp32 `rstd`;
`dw` is accumulated in fp32 per program, summed, then rounded. cos and sin get no gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._numerics import (
    ARITH_EAGER,
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
)

__all__ = ["qk_norm_rope_triton", "rope_triton"]


@triton.jit
def _rotate(v, vp, c, s, first, in_rot, TRANSPOSE: tl.constexpr):
    """`v c - vp s` (first half) / `v c + vp s` (second half), signs swapped for the transpose; `v` outside."""
    vc = v * c
    ps = vp * s
    if TRANSPOSE:
        rot = tl.where(first, vc + ps, vc - ps)
    else:
        rot = tl.where(first, vc - ps, vc + ps)
    return tl.where(in_rot, rot, v)


@triton.jit
def _rope_layout(COS, SIN, CS_OFF, rows, row_mask, cols, d, rd, INTERPRET: tl.constexpr):
    """Per-element pairing (`partner`), masks, and the fp32 `c`, `s` of a `[rows, cols]` tile."""
    h = rd // 2
    first = cols < h
    in_rot = cols < rd
    partner = tl.where(first, cols + h, cols - h)
    half_col = tl.where(first, cols, cols - h)
    col_mask = cols < d
    mask = row_mask[:, None] & col_mask[None, :]
    rot_mask = row_mask[:, None] & in_rot[None, :]
    cs_off = tl.load(CS_OFF + rows, mask=row_mask, other=0)
    cs_idx = cs_off[:, None] + half_col[None, :]
    c = load_fp32(COS + cs_idx, rot_mask, INTERPRET)
    s = load_fp32(SIN + cs_idx, rot_mask, INTERPRET)
    return partner, first[None, :], in_rot[None, :], mask, rot_mask, c, s


@triton.jit
def _rope_kernel(
    X,
    COS,
    SIN,
    CS_OFF,
    Y,
    n_rows,
    d,
    rd,
    stride_x,
    stride_y,
    TRANSPOSE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    cols = tl.arange(0, BLOCK_D)
    partner, first, in_rot, mask, rot_mask, c, s = _rope_layout(
        COS, SIN, CS_OFF, rows, row_mask, cols, d, rd, INTERPRET
    )
    base = X + rows[:, None] * stride_x
    v = load_fp32(base + cols[None, :], mask, INTERPRET)
    vp = load_fp32(base + partner[None, :], rot_mask, INTERPRET)
    out = _rotate(v, vp, c, s, first, in_rot, TRANSPOSE)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], round_to(out, Y.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _qk_norm_rope_fwd_kernel(
    X,
    W,
    COS,
    SIN,
    CS_OFF,
    Y,
    RSTD,
    n_rows,
    d,
    rd,
    inv_d,
    eps,
    stride_x,
    stride_y,
    LANES: tl.constexpr,
    LOG2_LANES: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERPRET: tl.constexpr,
    ARITH: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < n_rows
    cols = tl.arange(0, BLOCK_D)
    partner, first, in_rot, mask, rot_mask, c, s = _rope_layout(
        COS, SIN, CS_OFF, rows, row_mask, cols, d, rd, INTERPRET
    )
    base = X + rows[:, None] * stride_x
    v = load_fp32(base + cols[None, :], mask, INTERPRET)
    vp = load_fp32(base + partner[None, :], rot_mask, INTERPRET)
    if LANES == 0:
        sum_sq = tl.sum(v * v, axis=1)
    else:
        sum_sq = lane_sum_of_squares(
            X, X, rows, row_mask, stride_x, stride_x, d, 0, LANES, LOG2_LANES, BLOCK_ROWS, INTERPRET
        )
    rstd = norm_rstd(sum_sq, d, inv_d, eps, INTERPRET, ARITH)[:, None]
    w = load_fp32(W + cols, cols < d, INTERPRET)[None, :]
    wp = load_fp32(W + partner, cols < rd, INTERPRET)[None, :]
    # q̂ = x̂ * f(w) for the element and for its partner: the same fp32 operations, so the same bits.
    y = (v * rstd) * w
    yp = (vp * rstd) * wp
    out = _rotate(y, yp, c, s, first, in_rot, False)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], round_to(out, Y.dtype.element_ty, INTERPRET), mask=mask)
    tl.store(RSTD + rows, tl.reshape(rstd, [BLOCK_ROWS]), mask=row_mask)


@triton.jit
def _qk_norm_rope_bwd_kernel(
    DO,
    X,
    W,
    COS,
    SIN,
    CS_OFF,
    RSTD,
    DX,
    DW_PARTIAL,
    n_rows,
    d,
    rd,
    stride_do,
    stride_x,
    stride_dx,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < d
    w = load_fp32(W + cols, col_mask, INTERPRET)[None, :]
    d_f = tl.cast(d, tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for block in range(pid, tl.cdiv(n_rows, BLOCK_ROWS), n_programs):
        rows = (block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        row_mask = rows < n_rows
        partner, first, in_rot, mask, rot_mask, c, s = _rope_layout(
            COS, SIN, CS_OFF, rows, row_mask, cols, d, rd, INTERPRET
        )
        g_base = DO + rows[:, None] * stride_do
        g = load_fp32(g_base + cols[None, :], mask, INTERPRET)
        gp = load_fp32(g_base + partner[None, :], rot_mask, INTERPRET)
        dy = _rotate(g, gp, c, s, first, in_rot, True)
        v = load_fp32(X + rows[:, None] * stride_x + cols[None, :], mask, INTERPRET)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)[:, None]
        xhat = v * rstd
        dxhat = dy * w
        dot = tl.div_rn(tl.sum(dxhat * xhat, axis=1), d_f)[:, None]
        dx = rstd * (dxhat - xhat * dot)
        tl.store(
            DX + rows[:, None] * stride_dx + cols[None, :], round_to(dx, DX.dtype.element_ty, INTERPRET), mask=mask
        )
        dw += tl.sum(dy * xhat, axis=0)
    tl.store(DW_PARTIAL + pid * d + cols, dw, mask=col_mask)


def _cos_sin_rows(x_shape: torch.Size, cos: torch.Tensor, sin: torch.Tensor):
    """Contiguous `cos`, `sin` and, per row of an `x_shape` tensor, the offset of its entries in them."""
    rd = cos.shape[-1]
    cos_c, sin_c = cos.contiguous(), sin.contiguous()
    index_dtype = torch.int32 if cos_c.numel() < 2**31 else torch.int64
    if rd == 0:  # nothing rotates: every row reads nothing
        return cos_c, sin_c, torch.zeros(x_shape[:-1].numel(), dtype=index_dtype, device=cos.device)
    starts = torch.arange(cos_c.numel() // rd, dtype=index_dtype, device=cos.device) * rd
    offsets = starts.view(cos_c.shape[:-1]).expand(x_shape[:-1]).reshape(-1).contiguous()
    return cos_c, sin_c, offsets


def _rope_launch(src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool, arith: int) -> torch.Tensor:
    d, rd = src.shape[-1], cos.shape[-1]
    src2 = src.contiguous().view(-1, d)
    out = torch.empty(src.shape, dtype=src.dtype, device=src.device)
    out2 = out.view(-1, d)
    n_rows = src2.shape[0]
    cos_c, sin_c, offsets = _cos_sin_rows(src.shape, cos, sin)
    block_rows, block_d = row_block(d)
    if n_rows:
        _rope_kernel[(triton.cdiv(n_rows, block_rows),)](
            src2,
            cos_c,
            sin_c,
            offsets,
            out2,
            n_rows,
            d,
            rd,
            src2.stride(0),
            out2.stride(0),
            TRANSPOSE=transpose,
            BLOCK_ROWS=block_rows,
            BLOCK_D=block_d,
            INTERPRET=INTERPRET,
            **launch_options(block_rows * block_d, arith),
        )
    return out


class RopeFunction(torch.autograd.Function):
    """`r(rotate(f(x)))`; saves `cos` and `sin` only."""

    @staticmethod
    def forward(ctx, x, cos, sin, arith):
        ctx.save_for_backward(cos, sin)
        return _rope_launch(x, cos, sin, transpose=False, arith=arith)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rope_launch(grad, cos, sin, transpose=True, arith=ARITH_EAGER), None, None, None


class QkNormRopeFunction(torch.autograd.Function):
    """`r(rotate(x̂(x) * f(w)))` with no rounding in between; saves `x`, `w`, `rstd`, `cos`, `sin`."""

    @staticmethod
    def forward(ctx, x, weight, eps, cos, sin, lanes, arith):
        d, rd = x.shape[-1], cos.shape[-1]
        x2 = x.contiguous().view(-1, d)
        n_rows = x2.shape[0]
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        out2 = out.view(-1, d)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        cos_c, sin_c, offsets = _cos_sin_rows(x.shape, cos, sin)
        if lanes is not None and (lanes < 1 or lanes & (lanes - 1)):
            raise ValueError(f"reduction lanes must be a power of two, got {lanes}.")
        lanes_c = lanes or 0
        block_rows, block_d = row_block(d, lanes_c)
        if n_rows:
            _qk_norm_rope_fwd_kernel[(triton.cdiv(n_rows, block_rows),)](
                x2,
                weight,
                cos_c,
                sin_c,
                offsets,
                out2,
                rstd,
                n_rows,
                d,
                rd,
                fp32_scalar(1.0 / fp32_scalar(d)),
                fp32_scalar(eps),
                x2.stride(0),
                out2.stride(0),
                LANES=lanes_c,
                LOG2_LANES=max(lanes_c.bit_length() - 1, 0),
                BLOCK_ROWS=block_rows,
                BLOCK_D=block_d,
                INTERPRET=INTERPRET,
                ARITH=arith,
                **launch_options(block_rows * block_d, arith),
            )
        ctx.save_for_backward(x2, weight, rstd, cos, sin)
        ctx.shape = x.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        x2, weight, rstd, cos, sin = ctx.saved_tensors
        n_rows, d = x2.shape
        rd = cos.shape[-1]
        grad2 = grad.contiguous().view(-1, d)
        dx = torch.empty(ctx.shape, dtype=x2.dtype, device=x2.device)
        dx2 = dx.view(-1, d)
        cos_c, sin_c, offsets = _cos_sin_rows(ctx.shape, cos, sin)
        block_rows, block_d = row_block(d)
        n_programs = grid_programs(triton.cdiv(n_rows, block_rows), x2)
        dw_partial = torch.zeros((n_programs, d), dtype=torch.float32, device=x2.device)
        if n_rows:
            _qk_norm_rope_bwd_kernel[(n_programs,)](
                grad2,
                x2,
                weight,
                cos_c,
                sin_c,
                offsets,
                rstd,
                dx2,
                dw_partial,
                n_rows,
                d,
                rd,
                grad2.stride(0),
                x2.stride(0),
                dx2.stride(0),
                BLOCK_ROWS=block_rows,
                BLOCK_D=block_d,
                INTERPRET=INTERPRET,
                **launch_options(block_rows * block_d),
            )
        return dx, dw_partial.sum(dim=0).to(weight.dtype), None, None, None, None, None


def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, gpu_kernels: str = "inductor") -> torch.Tensor:
    """RoPE rotated in fp32 and rounded once, Triton kernels (inputs checked by `trl_roundalign.ops.rope`).

    `gpu_kernels`: the forward's device arithmetic (`_numerics.arith_for`): Inductor's lets `x1 c - x2 s`
    contract into an FMA, as Inductor's code of vLLM's `x1 * cos - x2 * sin` does; the backward is eager.
    """
    check_launchable(x, cos, sin)
    return RopeFunction.apply(x, cos, sin, arith_for(gpu_kernels))


def qk_norm_rope_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lanes: int | None,
    gpu_kernels: str = "inductor",
) -> torch.Tensor:
    """Qwen3's q/k-norm + RoPE as one region with one rounding, Triton kernels (`gpu_kernels` as `rope_triton`)."""
    check_launchable(x, weight, cos, sin)
    return QkNormRopeFunction.apply(x, weight.contiguous(), float(eps), cos, sin, lanes, arith_for(gpu_kernels))
