"""The rounding contract: named profiles, the regions they govern, and where each rounds.

Notation (as in docs/numerics.md): `r(x)` rounds fp32 to the model dtype (bf16) with
round-to-nearest-even, `f(x)` is the exact upcast, every other operation is fp32, and
`x̂(z) = f(z) * rsqrt(mean(f(z)^2) + eps)` over the last dimension.

A *region* is a switch: the paper's `"rope"`, `"swiglu"` and `"rmsnorm"` (residual add + RMSNorm,
which owns the residual stream), plus `"attention"` (beyond the paper: the attention forward
computed by the engine's own kernel). A *profile* says how each region rounds, mirroring one way
the inference engine runs:

| profile | RoPE | q/k-norm (Qwen3) | SwiGLU | RMSNorm output | residual stream | norm reads | mean(s^2) order | attention |
|---|---|---|---|---|---|---|---|---|
| `none` | `r(r(x1 c) - r(x2 s))` | `r(w r(x̂))` | `r(r(silu g) u)` | `r(w r(x̂))` | `r(h+res)` each sublayer | `r(s)` | torch | unchanged |
| `vllm-compiled` | `r(x1 c - x2 s)` | fp32, fused into RoPE | `r(silu(g) u)` | `r(x̂ w)` | fp32 sum, never rounded | `s` | torch | unchanged |
| `vllm-compiled-exact` | as `vllm-compiled` | as `vllm-compiled` | as `vllm-compiled` | `r(x̂ w)` | fp32 sum | `s` | Inductor CPU lanes | engine kernel |
| `vllm-compiled-piecewise` | as `vllm-compiled` | as `vllm-compiled` | as `vllm-compiled` | `r(x̂ w)` | `r(s)` at each input-norm add, fp32 across the post-attention add | `s` | torch | unchanged |
| `vllm-compiled-piecewise-exact` | as above | as above | as above | `r(x̂ w)` | as `vllm-compiled-piecewise` | `s` | Inductor CPU lanes | engine kernel |
| `vllm-eager` (CUDA ops) | `r(x1 c - x2 s)` | `r(x̂ w)` then RoPE | `r(r(silu g) u)` | `r(x̂ w)` | `r(h+res)` | `r(s)` | torch | unchanged |
| `vllm-eager-cpu` | `r(x1 c - x2 s)` | `r(w r(x̂))` then RoPE | `r(r(silu g) u)` | `r(w r(x̂))` | `r(h+res)` | `s` (fp32 sum) | torch | unchanged |
| `vllm-eager-cpu-avx2` | `t(x1 c - x2 s)` (truncated) | `r(w r(x̂))` then RoPE | `r(r(silu g) u)` | `r(w r(x̂))` | `r(h+res)` | `s` (fp32 sum) | torch | unchanged |

"norm reads" is what the norm after a residual add normalises: the rounded residual `r(s)` or
the fp32 sum `s = f(res) + f(h)` before it is rounded. vLLM-CPU's eager fused add+RMSNorm stores
`r(s)` but normalises `s` (measured by `trl-roundalign probe`: 100% bit-identical at the model level
with the engine's attention, versus 80% of outputs per op when the norm reads `r(s)`).

`vllm-compiled` is vLLM V1's default (`torch.compile` + Inductor; measured on vLLM-CPU 0.31, read
from source for GPU). `vllm-eager` holds the CUDA custom-op readings of vLLM 0.31/0.32 and
`vllm-eager-cpu` the CPU readings with `enforce_eager=True`; both are version- and
platform-dependent: `trl-roundalign probe` checks which one the installed engine really uses.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Literal

__all__ = [
    "ALL_REGIONS",
    "PAPER_CONDITIONS",
    "PAPER_REGIONS",
    "PROFILES",
    "Profile",
    "get_profile",
    "is_exact",
    "validate_regions",
]

PAPER_REGIONS: tuple[str, ...] = ("rope", "swiglu", "rmsnorm")
ALL_REGIONS: tuple[str, ...] = ("rope", "swiglu", "rmsnorm", "attention")

# The paper's named conditions, as region sets.
PAPER_CONDITIONS: dict[str, tuple[str, ...]] = {
    "bf16_default": (),
    "rope_only": ("rope",),
    "three_region": PAPER_REGIONS,
    "exact": ALL_REGIONS,
}

RopeMode = Literal["hf", "fp32", "fp32-trunc"]
QkNormMode = Literal["hf", "round-once", "fp32-fused"]
SwigluMode = Literal["hf", "fp32"]
NormMode = Literal["hf", "fp32"]
ResidualMode = Literal["round", "fp32", "layer"]
NormReads = Literal["rounded", "sum"]
ReductionMode = Literal["torch", "inductor-cpu"]
AttentionMode = Literal["unchanged", "vllm-cpu"]
GpuKernels = Literal["eager", "inductor"]


@dataclass(frozen=True)
class Profile:
    """Where one engine configuration rounds, region by region.

    Attributes:
        name: the profile's name.
        rope: `"hf"` rounds after each product and the sum (three roundings); `"fp32"` rotates in
            fp32 and rounds once; `"fp32-trunc"` rotates in fp32 and truncates to bf16 (vLLM-CPU's
            C++ RoPE kernel from its AVX2 kernel library, on CPUs without AVX-512).
        qk_norm: Qwen3's per-head q/k RMSNorm before RoPE. `"hf"`: `r(w * r(x̂))`; `"round-once"`:
            `r(x̂ * w)`; `"fp32-fused"`: `x̂ * w` kept in fp32 and fed to RoPE, one rounding at the end.
        swiglu: `"hf"`: `r(r(silu(g)) * u)`; `"fp32"`: `r(silu(g) * u)`.
        norm: RMSNorm output. `"hf"`: `r(w * r(x̂))`; `"fp32"`: `r(x̂ * w)`.
        residual: `"round"`: the residual is rounded after every sublayer (`r(h + res)`), and the
            variance is taken from the rounded sum; `"fp32"`: the residual stream is an fp32
            running sum that is never rounded; `"layer"`: rounded once per layer, at the input-norm add
            (the value that crosses the attention split of a piecewise-compiled engine), kept fp32 across
            the post-attention add; every norm reads the fp32 sum.
        norm_reads: with `residual="round"`, whether a norm after a residual add normalises the
            rounded residual (`"rounded"`) or the fp32 sum before rounding (`"sum"`). With
            `residual="fp32"` the sum is never rounded, so both read the same value.
        reduction: order of `sum(x^2)` inside RMSNorm. `"torch"`: whatever eager torch does (it
            differs from the engine on about 1e-5 of outputs); `"inductor-cpu"`: Inductor's C++
            order (lane-strided fp32 accumulation over `reduction_lanes` lanes, then a halving tree).
        reduction_lanes: default lane count for `"inductor-cpu"` (the engine may choose another
            per fused kernel; callers pass the per-norm value).
        attention: `"unchanged"` keeps the model's attention; `"vllm-cpu"` computes its forward
            with vLLM-CPU's attention kernel.
        gpu_kernels: the device arithmetic of the Triton forward kernels on a GPU. `"eager"`: eager
            CUDA ops (correctly rounded division, no FMA contraction); `"inductor"`: Inductor-generated
            Triton, what a compiled engine runs on a GPU (`div.full.f32` division unless Inductor's
            division rounding is on, FMA contraction). The CPU reference is the same for both.
        description: one line for reports.
    """

    name: str
    rope: RopeMode
    qk_norm: QkNormMode
    swiglu: SwigluMode
    norm: NormMode
    residual: ResidualMode
    norm_reads: NormReads = "rounded"
    reduction: ReductionMode = "torch"
    reduction_lanes: int = 32
    attention: AttentionMode = "unchanged"
    gpu_kernels: GpuKernels = "eager"
    description: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def _exact(base: Profile) -> Profile:
    """The exact refinement of a compiled profile: the engine's RMSNorm reduction order and attention kernel."""
    return replace(
        base,
        name=f"{base.name}-exact",
        reduction="inductor-cpu",
        attention="vllm-cpu",
        description=f"{base.name} plus the engine's RMSNorm reduction order and attention kernel (vLLM-CPU)",
    )


_COMPILED = Profile(
    "vllm-compiled",
    rope="fp32",
    qk_norm="fp32-fused",
    swiglu="fp32",
    norm="fp32",
    residual="fp32",
    gpu_kernels="inductor",
    description="vLLM-CPU default (torch.compile/Inductor, one graph): one rounding per fused region, fp32 residual",
)
_PIECEWISE = replace(
    _COMPILED,
    name="vllm-compiled-piecewise",
    residual="layer",
    norm_reads="sum",
    description="vLLM VLLM_COMPILE split at attention (CUDA default): fused regions, residual rounded once per layer",
)
_EAGER_CPU = Profile(
    "vllm-eager-cpu",
    rope="fp32",
    qk_norm="hf",
    swiglu="hf",
    norm="hf",
    residual="round",
    norm_reads="sum",
    description="vLLM-CPU enforce_eager: C++ RoPE kernel, eager PyTorch SwiGLU and RMSNorm (norm of the fp32 sum)",
)

PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            "none",
            rope="hf",
            qk_norm="hf",
            swiglu="hf",
            norm="hf",
            residual="round",
            description="Hugging Face eager: rounds after every op (the paper's default BF16)",
        ),
        _COMPILED,
        _exact(_COMPILED),
        _PIECEWISE,
        _exact(_PIECEWISE),
        Profile(
            "vllm-eager",
            rope="fp32",
            qk_norm="round-once",
            swiglu="hf",
            norm="fp32",
            residual="round",
            description="vLLM enforce_eager with CUDA custom ops (0.31/0.32 readings; version-dependent)",
        ),
        _EAGER_CPU,
        replace(
            _EAGER_CPU,
            name="vllm-eager-cpu-avx2",
            rope="fp32-trunc",
            description="vllm-eager-cpu with vLLM-CPU's AVX2 kernel library (no AVX-512): the C++ RoPE kernel truncates",
        ),
    )
}


def get_profile(profile: str | Profile) -> Profile:
    """Return the `Profile` named `profile` (or `profile` itself).

    Raises:
        ValueError: unknown name; the message lists the known profiles.
    """
    if isinstance(profile, Profile):
        return profile
    try:
        return PROFILES[profile]
    except (KeyError, TypeError):
        raise ValueError(
            f"Unknown rounding profile {profile!r}; known profiles: {', '.join(PROFILES)} "
            "(the trainer also accepts 'auto': derived from the vLLM engine it builds)."
        ) from None


def is_exact(profile: str | Profile) -> bool:
    """Whether a profile is an exact mode (the engine's reduction order and attention kernel)."""
    p = get_profile(profile)
    return p.reduction == "inductor-cpu" or p.attention == "vllm-cpu"


def validate_regions(regions) -> tuple[str, ...]:
    """Normalise a region set to a sorted-by-contract tuple; raise on unknown names.

    Raises:
        ValueError: a region that is not one of `ALL_REGIONS`, or a string instead of a sequence.
        ValueError: `"attention"` without the three paper regions (exact mode needs all of them).
    """
    if isinstance(regions, str):
        raise ValueError(
            f"regions must be a sequence of region names, not the string {regions!r}; "
            f"e.g. ({regions!r},). Known regions: {', '.join(ALL_REGIONS)}."
        )
    regions = tuple(regions or ())
    unknown = [r for r in regions if r not in ALL_REGIONS]
    if unknown:
        raise ValueError(f"Unknown region(s) {unknown}; known regions: {', '.join(ALL_REGIONS)}.")
    if "attention" in regions and not set(PAPER_REGIONS) <= set(regions):
        raise ValueError(
            "The 'attention' region is the exact mode's extra step and needs the three paper regions "
            "with it: regions=('rope', 'swiglu', 'rmsnorm', 'attention')."
        )
    return tuple(r for r in ALL_REGIONS if r in regions)
