"""What the probe measures: the profiles and regions it compares, and its result records."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

__all__ = [
    "BASE_PROFILES",
    "REGIONS",
    "ModelLevelResult",
    "ProbeReport",
    "ProfileMatch",
    "RegionResult",
    "reduction_variants",
]

# The profiles every region is compared with (the per-region verdict is one of these).
BASE_PROFILES: tuple[str, ...] = ("none", "vllm-compiled", "vllm-eager", "vllm-eager-cpu", "vllm-eager-cpu-avx2")


def reduction_variants() -> tuple[tuple[str, int], ...]:
    """Extra variants for regions with an RMSNorm reduction: vllm-compiled in Inductor's CPU order, over two
    vectors and one vector of this CPU's fp32 lanes (32 and 16 on AVX-512, 16 and 8 on AVX2)."""
    from ...engine import cpu_vector_isa

    isa = cpu_vector_isa()
    vf = isa[1] if isa else 16
    return (("vllm-compiled-exact", 2 * vf), ("vllm-compiled-exact", vf))


REGIONS = ("rms_norm", "add_rms_norm", "swiglu", "rope", "qk_norm_rope")
NORM_REGIONS = ("rms_norm", "add_rms_norm", "qk_norm_rope")


@dataclass
class ProfileMatch:
    """One region's engine output against one profile's reference.

    Attributes:
        label: the profile name, with the lane count for Inductor-order variants
            (`"vllm-compiled-exact@32"`).
        profile: the profile name.
        reduction_lanes: Inductor lane count of the reference's `mean(x^2)`, or None (torch's order).
        elements: compared elements (all outputs of the region together).
        mismatches: elements whose bits differ.
        match_rate: `1 - mismatches / elements`.
        max_ulp: largest distance in bf16 ulps (-1: a NaN against a number).
        one_ulp: mismatches that are one ulp off.
        per_output: `{output name: match rate}` (e.g. `out` and `residual` for the fused add + norm).
        exact: every element bit-identical.
        matches: `exact`, or within the RMSNorm reduction-order tolerance.
    """

    label: str
    profile: str
    reduction_lanes: int | None
    elements: int
    mismatches: int
    match_rate: float
    max_ulp: int
    one_ulp: int
    per_output: dict[str, float]
    exact: bool
    matches: bool


@dataclass
class RegionResult:
    """What the engine computes for one region, and how every profile fares against it.

    Attributes:
        region: `rms_norm`, `add_rms_norm`, `swiglu`, `rope` or `qk_norm_rope`.
        engine_path: what ran on the engine side (module, dispatched method, compiled or eager).
        shape: the main input's shape.
        results: `{label: ProfileMatch}` for `BASE_PROFILES` (and the reduction variants).
        matching: base profiles that match.
        best: the best base profile (the verdict when it is among the best-scoring).
        exact_variant: label of a reduction-order variant that matches bit for bit, if any.
        warning: set when no profile reproduces the region bit for bit.
        diagnostics: `{reading: match rate}` for readings no profile implements (checked when no
            profile reproduces the region).
        engine_computes: the diagnostic reading that reproduces the engine bit for bit, if any.
        skipped: reason the region could not be probed (then `results` is empty).
    """

    region: str
    engine_path: str = ""
    shape: list[int] = field(default_factory=list)
    results: dict[str, ProfileMatch] = field(default_factory=dict)
    matching: list[str] = field(default_factory=list)
    best: str | None = None
    exact_variant: str | None = None
    warning: str | None = None
    diagnostics: dict[str, float] = field(default_factory=dict)
    engine_computes: str | None = None
    skipped: str | None = None


@dataclass
class ModelLevelResult:
    """One candidate's training forward against the engine's prefill log-probs (completion tokens).

    Attributes:
        candidate: a label (`profile` or `profile+attention`).
        profile: the rounding profile.
        regions: the region set applied to the Hugging Face model.
        attention: `"sdpa"` (the model's attention) or `"engine"` (the engine's attention kernel).
        bit_identical: fraction of tokens whose log-probs equal the engine's as fp32 numbers.
        k3: mean k3 against the engine's prefill log-probs.
        max_abs_diff: largest |Δ log p|.
        tokens: number of tokens compared.
    """

    candidate: str
    profile: str
    regions: list[str]
    attention: str
    bit_identical: float
    k3: float
    max_abs_diff: float
    tokens: int


@dataclass
class ProbeReport:
    """Everything `probe` measured; `as_dict()` is JSON-able.

    Attributes:
        model: the model as given (an offline name, a hub id or a path).
        model_path: the checkpoint folder it resolved to (or the hub id).
        engine: engine facts (`trl_roundalign.engine.layout.EngineInfo.as_dict()`) plus the Inductor options used.
        source: `"engine"` (modules taken from a built engine) or `"config"` (instantiated under its config).
        rows: tokens of random input per region; seed: the input seed.
        regions: per-region results.
        profile: the verdict (None when no profile matches any region).
        profile_exact: the verdict matches every probed region.
        region_profiles: `{region: best profile}`.
        auto_profile: what `profile="auto"` chooses for this engine (or None when it refuses).
        auto_error: its error message when it refuses (mixed custom ops).
        agrees_with_auto: `profile == auto_profile`.
        model_level: candidates at the model level (empty when skipped).
        model_level_best: the base profile of the candidate that reproduces the engine bit for bit, or
            else of the one closest by k3 (engine-attention candidates first, see `model_best`).
        model_level_exact: the candidate that reproduces the engine bit for bit, if any.
        model_level_conclusive: a candidate reproduces the engine bit for bit.
        warnings: everything the user should read.
        timings: seconds per phase.
    """

    model: str
    engine: dict
    source: str
    rows: int
    seed: int
    regions: list[RegionResult]
    model_path: str = ""
    profile: str | None = None
    profile_exact: bool = False
    region_profiles: dict[str, str | None] = field(default_factory=dict)
    auto_profile: str | None = None
    auto_error: str | None = None
    agrees_with_auto: bool | None = None
    model_level: list[ModelLevelResult] = field(default_factory=list)
    model_level_best: str | None = None
    model_level_exact: str | None = None
    model_level_conclusive: bool = False
    warnings: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def region(self, name: str) -> RegionResult:
        for r in self.regions:
            if r.region == name:
                return r
        raise KeyError(f"region {name!r} was not probed; probed: {[r.region for r in self.regions]}")

    def as_dict(self) -> dict:
        return _jsonable(asdict(self))


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else str(x)
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x
