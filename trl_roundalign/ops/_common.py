"""Input checks, backend choice and the fp32 building blocks the regions share (the RMSNorm math is used by
`rms_norm` and by `rope`'s q/k-norm)."""

from __future__ import annotations

import os

import torch

from ..profiles import Profile, get_profile

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
BACKENDS = ("triton", "torch")


def check_tensor(name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """Raise `TypeError` unless `t` is a bf16/fp16 tensor (of `dtype`, when given)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{name} has dtype {t.dtype}; the aligned regions are defined for bf16 (and fp16) tensors. "
            "Load the model with dtype=torch.bfloat16."
        )
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but the input is {dtype}: pass both in the same dtype.")


def check_residual(t: torch.Tensor, dtype: torch.dtype) -> None:
    """The residual may be in the model dtype or the fp32 running sum."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor, got {type(t).__name__}.")
    if t.dtype not in (dtype, torch.float32):
        raise TypeError(f"residual has dtype {t.dtype}; expected {dtype} or torch.float32 (the fp32 residual stream).")


def resolve(profile: str | Profile, backend: str | None, *tensors: torch.Tensor) -> tuple[Profile, str]:
    """Resolve the profile and the backend (`None`: Triton on CUDA tensors, the PyTorch reference elsewhere)."""
    prof = get_profile(profile)
    if backend is None:
        backend = "triton" if all(t.is_cuda for t in tensors) else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"Unknown backend {backend!r}; choose one of {BACKENDS} or None (automatic).")
    if backend == "triton":
        on_cpu = any(not t.is_cuda for t in tensors)
        if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "backend='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 "
                "before triton is imported, or use backend='torch' (the exact PyTorch reference)."
            )
    return prof, backend


_COMPILED_EXP = None


class _InductorExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        global _COMPILED_EXP
        if _COMPILED_EXP is None:
            _COMPILED_EXP = torch.compile(torch.exp, dynamic=True, fullgraph=True)
        with torch.no_grad():
            y = _COMPILED_EXP(x.contiguous())
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * y


def inductor_exp(x: torch.Tensor) -> torch.Tensor:
    """`exp` of an fp32 CPU tensor with the bits of the engine's compiled C++ (Inductor's vectorised `exp`), where
    eager `torch.exp` takes another implementation: on the AMD AVX2 machine the two differ in the last bit for about
    1 fp32 input in 12 (measured over 2M points in [-100, 100]; tests/ops/test_gated_delta_net.py). Compiled once
    per process by this machine's Inductor, so it is the engine's wherever the engine's code is this machine's (the
    layout compares the ISA). Differentiable (`d exp = exp`)."""
    return _InductorExp.apply(x)


def inductor_sum(x: torch.Tensor, lanes: int) -> torch.Tensor:
    """Sum the last dim in Inductor's C++ order; `x` is fp32, result keeps the dim (size 1).

    Inductor's vectorised reduction accumulates element `i` into lane `i % lanes` in order (fp32,
    no FMA: Inductor compiles with `-ffp-contract=off`), then reduces the lanes with a halving
    tree (`lane[i] + lane[i + L/2]`, ...), and finally adds that to a scalar accumulator that
    starts at 0. A width that is not a multiple of `lanes` is handled as a masked vector whose
    missing lanes are 0, which leaves the sums unchanged.
    """
    if lanes < 1 or lanes & (lanes - 1):
        raise ValueError(f"reduction lanes must be a power of two, got {lanes}.")
    n = x.shape[-1]
    pad = (-n) % lanes
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    chunks = x.reshape(*x.shape[:-1], -1, lanes)
    acc = chunks[..., 0, :]
    for k in range(1, chunks.shape[-2]):
        acc = acc + chunks[..., k, :]
    width = lanes
    while width > 1:
        width //= 2
        acc = acc[..., :width] + acc[..., width:]
    return acc


def sum_of_squares(xf: torch.Tensor, lanes: int | None) -> torch.Tensor:
    """`sum(xf^2)` over the last dim (keepdim): torch's order when `lanes` is None, else Inductor's."""
    sq = xf * xf
    if lanes is None:
        return sq.sum(dim=-1, keepdim=True)
    return inductor_sum(sq, lanes)


def rms_rstd(xf: torch.Tensor, eps: float, lanes: int | None) -> torch.Tensor:
    """`1 / sqrt(sum(x^2) / n + eps)` in fp32, as the engine's compiled code writes it.

    Inductor emits `1 / std::sqrt(v)` (two correctly rounded operations); eager `torch.rsqrt`
    gives the same bits on CPU, while eager `1.0 / torch.sqrt(v)` does not (it goes through
    `reciprocal`), so the reference uses `torch.rsqrt`.
    """
    n = xf.shape[-1]
    var = sum_of_squares(xf, lanes) / n
    return torch.rsqrt(var + eps)


def norm_lanes(prof: Profile, reduction_lanes: int | None) -> int | None:
    """The RMSNorm reduction's lane count: `reduction_lanes` (checked), else the profile's default, or None
    (torch's order)."""
    if reduction_lanes is not None:
        if prof.norm == "hf":
            raise ValueError(
                f"reduction_lanes applies to the aligned RMSNorm; profile {prof.name!r} keeps Hugging Face's norm."
            )
        if reduction_lanes < 1 or reduction_lanes & (reduction_lanes - 1):
            raise ValueError(f"reduction_lanes must be a power of two, got {reduction_lanes}.")
        return reduction_lanes
    return prof.reduction_lanes if prof.reduction == "inductor-cpu" else None


def check_norm_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Raise `TypeError` unless `weight` is a bf16/fp16 vector of `x`'s last-dim size."""
    check_tensor("weight", weight)
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise TypeError(f"weight {tuple(weight.shape)} must be 1-D of size {x.shape[-1]} (x's last dim).")


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm/Qwen2RMSNorm/Qwen3RMSNorm forward, op for op."""
    input_dtype = weight.dtype if x.dtype == torch.float32 else x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def norm_forward_fp32(xf: torch.Tensor, weight: torch.Tensor, eps: float, lanes: int | None):
    """`(x̂ * f(w), rstd)` in fp32: the aligned norm before its single rounding."""
    rstd = rms_rstd(xf, eps, lanes)
    return (xf * rstd) * weight.float(), rstd


def norm_backward_fp32(dy: torch.Tensor, xf: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor):
    """fp32 gradients `(dx, dw)` of `y = x̂ * w` with `x̂ = x * rstd(x)`."""
    xhat = xf * rstd
    dxhat = dy * weight.float()
    n = xf.shape[-1]
    dx = rstd * (dxhat - xhat * ((dxhat * xhat).sum(dim=-1, keepdim=True) / n))
    dw = (dy * xhat).reshape(-1, n).sum(dim=0)
    return dx, dw


def resolve_reference_only(profile: str | Profile, backend: str | None, regions: str) -> Profile:
    """The profile of a family's regions that have only the PyTorch reference (`regions` names them in the error)."""
    if backend not in (None, "torch"):
        raise ValueError(
            f"backend={backend!r}: {regions} have no Triton kernels yet; use backend='torch' or None (the PyTorch "
            "reference, on any device)."
        )
    return get_profile(profile)


def check_half_or_stream(name: str, t: torch.Tensor, fp32_ok: bool = False) -> None:
    """Raise `TypeError` unless `t` is bf16/fp16 (or, with `fp32_ok`, the fp32 residual stream)."""
    ok = (torch.bfloat16, torch.float16) + ((torch.float32,) if fp32_ok else ())
    if not isinstance(t, torch.Tensor) or t.dtype not in ok:
        raise TypeError(f"{name} must be a bf16/fp16 tensor{' (or the fp32 stream)' if fp32_ok else ''}, got "
                        f"{getattr(t, 'dtype', type(t).__name__)}.")


class _RoundKeepGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.to(dtype).to(t.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def round_keep_grad(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` rounded to `dtype`, returned in `t`'s dtype, with the gradient passed through unrounded.

    An engine's interior rounding (a value its kernel stores in bf16 between two fused pieces) is a forward event:
    a plain `.to(bf16)` would also round the gradient flowing back through it, so the backward would no longer be
    the fp32 derivative (OLMo 2's q/k path: 1.4% of d x off by up to 8% where the two RoPE branches cancel)."""
    return _RoundKeepGrad.apply(t, dtype)


# The forms of an engine step's attention both sides compute (the engine's prefill-alone hook, `engine.prefill`, and the
# exact attention region, `ops.attention`): one function each, here on the lowest floor both import.
def block_pieces(start: int, end: int, block_size: int) -> list[tuple[int, int]]:
    """The pieces a prefill request of positions `[start, end)` is computed in, in an engine that prefills each prompt
    alone: cut at every multiple of `block_size` (the KV cache's block) inside it, each piece a request with past keys.
    Each block's keys and values then come from computations that lie inside the block, so a block's bits depend on the
    tokens up to it and the request starts inside it, never on how far its request went on: a prefix-cache hit (whole
    blocks) reads keys and values the recipient's own prefill, cut the same way, would have computed."""
    cuts = list(range((start // block_size + 1) * block_size, end, block_size))
    return list(zip([start, *cuts], [*cuts, end]))


def request_groups(query_lens: list[int]) -> list[tuple[int, int]] | None:
    """The request ranges `[a, b)` the step's attention is computed in: each multi-token request alone, each run of
    consecutive one-query requests together. None where that is the whole step already (nothing to split)."""
    groups: list[tuple[int, int]] = []
    for i, n in enumerate(query_lens):
        if n == 1 and groups and groups[-1][1] == i and query_lens[groups[-1][0]] == 1:
            groups[-1] = (groups[-1][0], i + 1)
        else:
            groups.append((i, i + 1))
    return groups if len(groups) > 1 else None
