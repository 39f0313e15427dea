"""SwiGLU region: `silu(gate) * up`.

Rounding per profile (docs/numerics.md):

- `"fp32"` (`vllm-compiled`): `r(silu(f(g)) * f(u))`, silu computed in fp32 as
  `g / (exp(-g) + 1)` (Inductor's lowering), one rounding.
- `"hf"` (`none`, `vllm-eager`, `vllm-eager-cpu`): `r(r(silu(g)) * u)`, exactly Hugging Face's
  `act_fn(gate) * up` in bf16.

Backward (aligned modes): the exact derivative of the fp32 function, computed in fp32 from the
saved bf16 inputs and rounded once per gradient tensor:
`dg = do * u * s * (1 + g * (1 - s))`, `du = do * silu(g)` with `s = sigmoid(g)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..profiles import Profile
from ._common import check_tensor, resolve

__all__ = ["sigmoid_gate", "swiglu", "swiglu_reference"]


def _silu_fp32(gf: torch.Tensor) -> torch.Tensor:
    return gf / (torch.exp(-gf) + 1.0)


def swiglu_forward_fp32(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gf = gate.float()
    return (_silu_fp32(gf) * up.float()).to(gate.dtype)


def swiglu_backward_fp32(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    gf, uf, go = gate.float(), up.float(), grad.float()
    sig = 1.0 / (torch.exp(-gf) + 1.0)
    silu = gf * sig
    dg = go * uf * sig * (1.0 + gf * (1.0 - sig))
    du = go * silu
    return dg.to(gate.dtype), du.to(up.dtype)


class _SwiGLURef(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return swiglu_forward_fp32(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return swiglu_backward_fp32(grad, gate, up)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor, mode: str) -> torch.Tensor:
    """PyTorch reference for one SwiGLU rounding mode (`"fp32"` or `"hf"`)."""
    if mode == "hf":
        return F.silu(gate) * up
    return _SwiGLURef.apply(gate, up)


def swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    profile: str | Profile = "vllm-compiled",
    backend: str | None = None,
) -> torch.Tensor:
    """`silu(gate) * up`, rounded where `profile` says.

    Args:
        gate: bf16/fp16 tensor `[..., intermediate]` (the gate projection's output).
        up: same shape and dtype (the up projection's output).
        profile: rounding profile name (see `trl_roundalign.profiles`).
        backend: `"triton"`, `"torch"` (exact reference) or `None` (Triton on CUDA, else torch).
            Non-contiguous inputs are copied to contiguous ones by the Triton backend.

    Returns:
        Tensor of the input's shape and dtype.

    Raises:
        TypeError: non-bf16/fp16 inputs, mismatched dtypes or shapes.
    """
    check_tensor("gate", gate)
    check_tensor("up", up, gate.dtype)
    if gate.shape != up.shape:
        raise TypeError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape.")
    prof, backend = resolve(profile, backend, gate, up)
    if prof.swiglu == "hf":
        return swiglu_reference(gate, up, "hf")
    if backend == "triton":
        from .triton.swiglu import swiglu_triton

        return swiglu_triton(gate, up, prof.gpu_kernels)
    return swiglu_reference(gate, up, "fp32")


# ----------------------------------------------------------------------------- sigmoid output gate (Qwen3.5)


class _SigmoidGateRef(torch.autograd.Function):
    """`r(f(x) * sigmoid(f(g)))`, sigmoid as Inductor's C++ lowers it, `1 / (exp(-g) + 1)`; one rounding."""

    @staticmethod
    def forward(ctx, x, gate):
        ctx.save_for_backward(x, gate)
        return (x.float() * (1.0 / (torch.exp(-gate.float()) + 1.0))).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, gate = ctx.saved_tensors
        go = grad.float()
        sig = 1.0 / (torch.exp(-gate.float()) + 1.0)
        dx = go * sig
        dg = go * x.float() * sig * (1.0 - sig)
        return dx.to(x.dtype), dg.to(gate.dtype)


def sigmoid_gate(
    x: torch.Tensor,
    gate: torch.Tensor,
    *,
    profile: str | Profile = "vllm-compiled",
    backend: str | None = None,
) -> torch.Tensor:
    """The gated attention output `x * sigmoid(gate)` (Qwen3.5's full-attention layers; vLLM's `Qwen3NextAttention`).

    Rounded where `profile` says, with the SwiGLU region's mode (the same kind of region: an activation of one
    projection times another value): `"fp32"` (`vllm-compiled`) computes the product in fp32 and rounds once, as
    Inductor fuses it (tests/ops/test_sigmoid_gate_vs_vllm.py); `"hf"` is transformers' `x * torch.sigmoid(gate)`
    in bf16 (the sigmoid rounded, then the product). PyTorch reference on every device (`backend="triton"` runs it
    too: no kernel of its own).

    Args:
        x: the attention output `[..., heads * head_dim]`, bf16/fp16.
        gate: the gate half of `q_proj`'s output, same shape and dtype.
    """
    check_tensor("x", x)
    check_tensor("gate", gate, x.dtype)
    if x.shape != gate.shape:
        raise TypeError(f"x {tuple(x.shape)} and gate {tuple(gate.shape)} must have the same shape.")
    prof, _ = resolve(profile, backend, x, gate)
    if prof.swiglu == "hf":
        return x * torch.sigmoid(gate)
    return _SigmoidGateRef.apply(x, gate)
