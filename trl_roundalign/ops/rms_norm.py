"""RMSNorm and residual-add + RMSNorm regions.

Rounding per profile (docs/numerics.md), with `x̂(z) = f(z) * rstd`, `rstd = 1 / sqrt(sum(f(z)^2) / n + eps)`:

- norm `"fp32"` (`vllm-compiled`, `vllm-eager` CUDA): output `r(x̂ * f(w))`, one rounding.
- norm `"hf"` (`none`, `vllm-eager-cpu`): output `r(f(w) * f(r(x̂)))`, Hugging Face's two roundings.
- residual `"fp32"` (`vllm-compiled`): the residual stream is an fp32 running sum,
  `s = f(res) + f(x)`, never rounded; the norm reads `s` and `add_rms_norm` returns `s` (fp32), so
  a caller chains sublayers exactly as vLLM's compiled graph does.
- residual `"layer"` (`vllm-compiled-piecewise`): inside `add_rms_norm` (the post-attention add) as
  `"fp32"`; the once-per-layer rounding happens where the stream enters a layer (the input-norm add,
  `trl_roundalign.models.decoder`), whose norm reads the fp32 sum.
- residual `"round"` (`none`, `vllm-eager*`): `res = r(f(res) + f(x))` after every sublayer. The
  norm reads the rounded sum (`norm_reads="rounded"`: Hugging Face, vLLM's CUDA kernel) or the fp32
  sum before rounding (`norm_reads="sum"`: vLLM-CPU eager, whose fused add+norm stores `r(s)` but
  normalises `s`).

`sum(f(z)^2)` is summed in torch's order, or, with `reduction_lanes=L` (profile
`vllm-compiled-exact`), in the order of Inductor's C++ code on the engine's CPU: element `i` into
lane `i % L` in sequence, then a halving tree over the lanes. The engine picks `L` per fused kernel
(32 for most norms of the models measured, 16 where the norm is fused with the materialisation of
the fp32 residual); read it from the engine's compile cache (`trl_roundalign.engine`).

Backward (aligned modes): the exact derivative of the fp32 function, in fp32, from the saved
inputs (bf16 `x` or the fp32 sum, `w`, and the fp32 `rstd` per row), rounded once per gradient
tensor: `dw = Σ_rows dy * x̂`, `dx = rstd * (dy*w - x̂ * mean(dy*w*x̂))`; for `add_rms_norm` the
gradient reaching the sum is `dx + d(new_residual)`, handed to both inputs.
"""

from __future__ import annotations

import torch

from ..profiles import Profile
from ._common import (
    check_norm_weight,
    check_residual,
    check_tensor,
    hf_rms_norm,
    norm_backward_fp32,
    norm_forward_fp32,
    norm_lanes,
    resolve,
)

__all__ = ["add_rms_norm", "rms_norm"]


class _RMSNormRef(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, lanes):
        y, rstd = norm_forward_fp32(x.float(), weight, eps, lanes)
        ctx.save_for_backward(x, weight, rstd)
        return y.to(weight.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = norm_backward_fp32(dy.float(), x.float(), weight, rstd)
        return dx.to(x.dtype), dw.to(weight.dtype), None, None


class _AddRMSNormRef(torch.autograd.Function):
    """fp32 residual stream: returns `(r(x̂(s) w), s)` with `s = f(res) + f(x)` in fp32."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, lanes):
        s = residual.float() + x.float()
        y, rstd = norm_forward_fp32(s, weight, eps, lanes)
        ctx.save_for_backward(s, weight, rstd)
        ctx.dtypes = (x.dtype, residual.dtype)
        return y.to(weight.dtype), s

    @staticmethod
    def backward(ctx, dy, ds_out):
        s, weight, rstd = ctx.saved_tensors
        ds, dw = norm_backward_fp32(dy.float(), s, weight, rstd)
        if ds_out is not None:
            ds = ds + ds_out.float()
        x_dtype, res_dtype = ctx.dtypes
        return ds.to(x_dtype), ds.to(res_dtype), dw.to(weight.dtype), None, None


class _AddRMSNormRoundRef(torch.autograd.Function):
    """Rounded residual, one-rounding norm (vLLM's CUDA fused_add_rms_norm): `(r(x̂(r(s)) w), r(s))`."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, lanes):
        new_res = (residual.float() + x.float()).to(x.dtype)
        y, rstd = norm_forward_fp32(new_res.float(), weight, eps, lanes)
        ctx.save_for_backward(new_res, weight, rstd)
        ctx.res_dtype = residual.dtype
        return y.to(weight.dtype), new_res

    @staticmethod
    def backward(ctx, dy, ds_out):
        new_res, weight, rstd = ctx.saved_tensors
        ds, dw = norm_backward_fp32(dy.float(), new_res.float(), weight, rstd)
        if ds_out is not None:
            ds = ds + ds_out.float()
        return ds.to(new_res.dtype), ds.to(ctx.res_dtype), dw.to(weight.dtype), None, None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    profile: str | Profile = "vllm-compiled",
    backend: str | None = None,
    reduction_lanes: int | None = None,
) -> torch.Tensor:
    """RMSNorm without residual (layer-0 input norm, q/k-norm, final norm), rounded per `profile`.

    Args:
        x: `[..., hidden]` in bf16/fp16, or fp32 when it is the fp32 residual stream (final norm);
            the output then takes `weight`'s dtype.
        weight: `[hidden]`, bf16/fp16.
        eps: the model's `rms_norm_eps`.
        profile: rounding profile name.
        backend: `"triton"`, `"torch"` or `None` (Triton on CUDA, else torch).
        reduction_lanes: sum `x^2` in Inductor's CPU order over this many lanes (a power of two);
            default from the profile (`vllm-compiled-exact`: 32), else torch's order.

    Returns:
        `[..., hidden]` in `weight`'s dtype.
    """
    if isinstance(x, torch.Tensor) and x.dtype == torch.float32:
        check_tensor("weight", weight)
    else:
        check_tensor("x", x)
        check_tensor("weight", weight, x.dtype)
    check_norm_weight(x, weight)
    prof, backend = resolve(profile, backend, x, weight)
    lanes = norm_lanes(prof, reduction_lanes)
    if prof.norm == "hf":
        return hf_rms_norm(x, weight, eps)
    if backend == "triton":
        from .triton.rms_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps, lanes, prof.gpu_kernels)
    return _RMSNormRef.apply(x, weight, float(eps), lanes)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    profile: str | Profile = "vllm-compiled",
    backend: str | None = None,
    reduction_lanes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add followed by RMSNorm, rounded per `profile`.

    Args:
        x: the sublayer output `[..., hidden]`, bf16/fp16.
        residual: the residual stream, same shape: `x`'s dtype or fp32.
        weight: `[hidden]`.
        eps: the model's `rms_norm_eps`.
        profile: rounding profile name. Under a profile whose residual is `"fp32"` the returned
            residual is the fp32 sum `f(residual) + f(x)`; otherwise it is rounded to `x`'s dtype.
        backend: `"triton"`, `"torch"` or `None`.
        reduction_lanes: see `rms_norm`.

    Returns:
        `(normed, new_residual)`.
    """
    check_tensor("x", x)
    check_residual(residual, x.dtype)
    check_tensor("weight", weight, x.dtype)
    if residual.shape != x.shape:
        raise TypeError(f"residual {tuple(residual.shape)} and x {tuple(x.shape)} must have the same shape.")
    check_norm_weight(x, weight)
    prof, backend = resolve(profile, backend, x, residual, weight)
    lanes = norm_lanes(prof, reduction_lanes)
    if prof.residual == "round" and prof.norm_reads == "sum":
        # vLLM-CPU eager: the residual is stored rounded, the norm reads the fp32 sum.
        s = residual.float() + x.float()
        if prof.norm == "hf":
            return hf_rms_norm(s, weight, eps), s.to(x.dtype)
        y, _ = norm_forward_fp32(s, weight, eps, lanes)
        return y.to(weight.dtype), s.to(x.dtype)
    if prof.norm == "hf":
        # Hugging Face: `hidden = residual + hidden` in the model dtype, then the norm of that.
        new_res = residual + x if residual.dtype == x.dtype else (residual.float() + x.float()).to(x.dtype)
        return hf_rms_norm(new_res, weight, eps), new_res
    if backend == "triton":
        from .triton.rms_norm import add_rms_norm_triton

        return add_rms_norm_triton(x, residual, weight, eps, lanes, prof.residual != "round", prof.gpu_kernels)
    fn = _AddRMSNormRef if prof.residual != "round" else _AddRMSNormRoundRef
    return fn.apply(x, residual, weight, float(eps), lanes)
