"""RoPE region (neox halves), and Qwen3's q/k-norm + RoPE as one region.

`x = [x1 | x2 | pass]` with `x1`, `x2` the two halves of the rotary part (rotary dim `rd <= head_dim`),
`c = cos[..., :rd/2]`, `s = sin[..., :rd/2]` (Hugging Face's layout duplicates the halves; vLLM's
bf16 cos/sin table is bit-identical to Hugging Face's bf16 cos/sin).

- rope `"fp32"` (`vllm-compiled`, `vllm-eager*`): `o1 = r(f(x1) f(c) - f(x2) f(s))`,
  `o2 = r(f(x2) f(c) + f(x1) f(s))`, one rounding. The cos/sin values are the bf16 table upcast:
  an fp32 table is *not* aligned.
- rope `"fp32-trunc"` (`vllm-eager-cpu-avx2`): the same fp32 rotation, truncated to bf16 (vLLM-CPU's
  AVX2 kernel library converts that way; `trl-roundalign probe --enforce-eager` on an AVX2 CPU: 100% identical, 50.74% with rounding).
- rope `"hf"` (`none`): `x * cos + rotate_half(x) * sin` in bf16: three roundings.
- `qk_norm_rope` under q/k-norm `"fp32-fused"` (`vllm-compiled`): `q̂ = x̂(q) * f(w)` stays fp32 and
  feeds the rotation; the only rounding is the final one. `"round-once"` (`vllm-eager` CUDA)
  rounds `r(x̂ w)` first; `"hf"` uses Hugging Face's `r(w r(x̂))`.

Backward: the transposed rotation in fp32 (`dx1 = do1 c + do2 s`, `dx2 = do2 c - do1 s`), chained
through the norm's exact derivative for `qk_norm_rope`, rounded once per gradient tensor. cos and
sin get no gradient (Hugging Face computes them under `no_grad`).
"""

from __future__ import annotations

import torch

from ..profiles import Profile
from ._common import (
    check_norm_weight,
    check_tensor,
    hf_rms_norm,
    norm_backward_fp32,
    norm_forward_fp32,
    norm_lanes,
    resolve,
)
from .rms_norm import rms_norm

__all__ = ["qk_norm_rope", "rope"]


def _halves(cos: torch.Tensor, sin: torch.Tensor, rd: int):
    return cos[..., : rd // 2].float(), sin[..., : rd // 2].float()


def rotate_fp32(xf: torch.Tensor, c: torch.Tensor, s: torch.Tensor, rd: int) -> torch.Tensor:
    """Rotate the first `rd` dims of fp32 `xf` by fp32 `c`, `s` (each `rd/2` wide); pass the rest."""
    h = rd // 2
    x1, x2 = xf[..., :h], xf[..., h:rd]
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    return torch.cat((o1, o2, xf[..., rd:]), dim=-1)


def unrotate_fp32(gf: torch.Tensor, c: torch.Tensor, s: torch.Tensor, rd: int) -> torch.Tensor:
    """The transposed rotation (the gradient of `rotate_fp32` with respect to its input)."""
    h = rd // 2
    g1, g2 = gf[..., :h], gf[..., h:rd]
    d1 = g1 * c + g2 * s
    d2 = g2 * c - g1 * s
    return torch.cat((d1, d2, gf[..., rd:]), dim=-1)


def _reduce_to(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Sum broadcast dims so a gradient matches the input shape."""
    if grad.shape == shape:
        return grad
    while grad.dim() > len(shape):
        grad = grad.sum(0)
    for i, n in enumerate(shape):
        if n == 1 and grad.shape[i] != 1:
            grad = grad.sum(i, keepdim=True)
    return grad


def truncate_to_bf16(xf: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 by dropping the low 16 bits (round toward zero), as vLLM-CPU's AVX2 kernels convert."""
    return (xf.contiguous().view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)


class _RopeRef(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, truncate=False):
        rd = cos.shape[-1]
        c, s = _halves(cos, sin, rd)
        ctx.save_for_backward(cos, sin)
        ctx.x_shape = x.shape
        out = rotate_fp32(x.float(), c, s, rd)
        if truncate:
            if x.dtype != torch.bfloat16:
                raise TypeError(f"the truncating RoPE (vllm-eager-cpu-avx2) is defined for bf16, got {x.dtype}.")
            return truncate_to_bf16(out)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        rd = cos.shape[-1]
        c, s = _halves(cos, sin, rd)
        dx = unrotate_fp32(grad.float(), c, s, rd)
        return _reduce_to(dx, ctx.x_shape).to(grad.dtype), None, None, None


class _QkNormRopeRef(torch.autograd.Function):
    """`r(rotate(x̂(x) * f(w)))` with no rounding in between."""

    @staticmethod
    def forward(ctx, x, weight, eps, cos, sin, lanes):
        rd = cos.shape[-1]
        c, s = _halves(cos, sin, rd)
        y, rstd = norm_forward_fp32(x.float(), weight, eps, lanes)
        ctx.save_for_backward(x, weight, rstd, cos, sin)
        return rotate_fp32(y, c, s, rd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd, cos, sin = ctx.saved_tensors
        rd = cos.shape[-1]
        c, s = _halves(cos, sin, rd)
        dy = _reduce_to(unrotate_fp32(grad.float(), c, s, rd), x.shape)
        dx, dw = norm_backward_fp32(dy, x.float(), weight, rstd)
        return dx.to(x.dtype), dw.to(weight.dtype), None, None, None, None


def _hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's `apply_rotary_pos_emb` for one tensor (partial rotary: the rest passes)."""
    rd = cos.shape[-1]
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    h = rd // 2
    rotated = torch.cat((-x_rot[..., h:], x_rot[..., :h]), dim=-1)
    out = (x_rot * cos) + (rotated * sin)
    return out if rd == x.shape[-1] else torch.cat((out, x_pass), dim=-1)


def _check_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    check_tensor("cos", cos, x.dtype)
    check_tensor("sin", sin, x.dtype)
    if cos.shape != sin.shape:
        raise TypeError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape.")
    rd = cos.shape[-1]
    if rd % 2 or rd > x.shape[-1]:
        raise TypeError(
            f"cos/sin last dim {rd} must be even and at most x's head dim {x.shape[-1]} (partial rotary allowed)."
        )
    try:
        torch.broadcast_shapes(x[..., :rd].shape, cos.shape)
    except RuntimeError:
        raise TypeError(
            f"cos/sin {tuple(cos.shape)} do not broadcast to x {tuple(x.shape)}; use Hugging Face's layout "
            "(e.g. cos.unsqueeze(1) for x in [batch, heads, seq, head_dim])."
        ) from None
    if torch.broadcast_shapes(x[..., :rd].shape, cos.shape) != x[..., :rd].shape:
        raise TypeError(f"cos/sin {tuple(cos.shape)} would broadcast x {tuple(x.shape)} to a larger shape.")


def rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    profile: str | Profile = "vllm-compiled",
    backend: str | None = None,
) -> torch.Tensor:
    """Rotary position embedding (neox halves) of `x`, rounded per `profile`.

    Args:
        x: `[..., head_dim]`, bf16/fp16.
        cos: Hugging Face layout: `[..., rotary_dim]`, same dtype, halves duplicated, broadcastable
            to `x[..., :rotary_dim]`; `rotary_dim < head_dim` rotates only the first dims.
        sin: like `cos`.
        profile: rounding profile name.
        backend: `"triton"`, `"torch"` or `None`. The Triton backend expands `cos`/`sin` and makes
            `x` contiguous (copies).

    Returns:
        Tensor of `x`'s shape and dtype.
    """
    check_tensor("x", x)
    _check_rope(x, cos, sin)
    prof, backend = resolve(profile, backend, x, cos, sin)
    if prof.rope == "hf":
        return _hf_rope(x, cos, sin)
    if prof.rope == "fp32-trunc":
        return _RopeRef.apply(x, cos, sin, True)  # a CPU engine's reading: the PyTorch reference only
    if backend == "triton":
        from .triton.rope import rope_triton

        return rope_triton(x, cos, sin, prof.gpu_kernels)
    return _RopeRef.apply(x, cos, sin)


def qk_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    profile: str | Profile = "vllm-compiled",
    backend: str | None = None,
    reduction_lanes: int | None = None,
) -> torch.Tensor:
    """Qwen3's per-head RMSNorm followed by RoPE, as one region.

    Args:
        x: `[..., head_dim]` (one row per head), bf16/fp16.
        weight: the q_norm/k_norm weight `[head_dim]`.
        eps: the norm's epsilon.
        cos: see `rope`.
        sin: see `rope`.
        profile: under `vllm-compiled` nothing is rounded between the norm and the rotation.
        backend: `"triton"`, `"torch"` or `None`.
        reduction_lanes: see `trl_roundalign.ops.rms_norm`.

    Returns:
        Tensor of `x`'s shape and dtype.
    """
    check_tensor("x", x)
    check_tensor("weight", weight, x.dtype)
    check_norm_weight(x, weight)
    _check_rope(x, cos, sin)
    prof, backend = resolve(profile, backend, x, weight, cos, sin)
    lanes = norm_lanes(prof, reduction_lanes) if prof.qk_norm != "hf" else None
    if prof.qk_norm == "fp32-fused":
        if backend == "triton":
            from .triton.rope import qk_norm_rope_triton

            return qk_norm_rope_triton(x, weight, eps, cos, sin, lanes, prof.gpu_kernels)
        return _QkNormRopeRef.apply(x, weight, float(eps), cos, sin, lanes)
    if prof.qk_norm == "round-once":
        normed = rms_norm(x, weight, eps, profile=prof, backend=backend, reduction_lanes=reduction_lanes)
    else:
        normed = hf_rms_norm(x, weight, eps)
    return rope(normed, cos, sin, profile=prof, backend=backend)
