"""`trl-roundalign probe`: which rounding profile does the installed vLLM really implement?

Two measurements, for one engine configuration (compiled by default, `enforce_eager=True`, custom
ops switched on or off):

1. **Per region.** vLLM's own modules for each region (`RMSNorm`, `SiluAndMul`, the model's
   `RotaryEmbedding`, and Qwen3's q/k-norm feeding the RoPE) are instantiated under the engine's
   `VllmConfig` (or taken from a built engine), so each one dispatches exactly as the engine's
   does (`CustomOp` enabled or not, `forward_cpu` vs `forward_native`, vLLM IR op priority). They
   run on random bf16 inputs of the model's shapes: compiled with `torch.compile` (Inductor, the
   engine's Inductor options, a dynamic token dimension) when the engine compiles, eagerly
   otherwise. Each output is compared bit for bit with `trl_roundalign.ops` under every profile
   (for RMSNorm regions also in Inductor's CPU reduction order, 32 and 16 lanes).
2. **Model level** (optional). Per-op comparison cannot see how the whole compiled graph treats
   the residual stream (docs/numerics.md: it drops the residual's bf16 rounding). So a few sequences are
   generated and scored by the engine (prefill) and by the Hugging Face model patched with the
   paper's three regions under each candidate profile; the report gives the bit-identical fraction
   and k3 against the engine's prefill log-probs, and which candidate reproduces the engine best.
   On vLLM-CPU compiled engines the exact modes (`vllm-compiled-exact`, `vllm-compiled-piecewise-exact`, with the `attention` region)
   is scored too.

The verdict is the profile consistent with the most regions (all of them, when the engine is one of
the profiles); it is compared with what `profile="auto"` picks for the same configuration
(`trl_roundalign.engine.profile_for_engine`).

Match rules: a profile *matches* a region when every output element is bit-identical, or, for
RMSNorm regions in torch's reduction order (every profile except the Inductor-lane variants), when
at least 99.99% are and none is off by more than one ulp (a different summation order of
`mean(x^2)` is not a rounding location, docs/numerics.md).

A vLLM quirk the probe guards against: `get_rope` caches `RotaryEmbedding` instances per process,
so a second engine in the same process reuses the first engine's RoPE module, with the first
engine's dispatch (a compiled engine's `forward_native` inside an eager engine rounds three times).
The probe builds its engine with an empty cache and warns when an engine it is handed carries a
RoPE module whose dispatch differs from its own configuration's.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from .. import ops
from ..engine import EXACT_REFINEMENTS as _EXACT_FAMILY
from ..engine import fresh_rope_cache
from ..profiles import ALL_REGIONS, PAPER_REGIONS

logger = logging.getLogger(__name__)

__all__ = [
    "BASE_PROFILES",
    "reduction_variants",
    "ModelLevelResult",
    "ProbeReport",
    "ProfileMatch",
    "RegionResult",
    "engine_config",
    "format_report",
    "probe",
    "probe_model_level",
    "probe_regions",
    "run_probe_cli",
]

# The profiles every region is compared with (the per-region verdict is one of these).
BASE_PROFILES: tuple[str, ...] = ("none", "vllm-compiled", "vllm-eager", "vllm-eager-cpu", "vllm-eager-cpu-avx2")


def reduction_variants() -> tuple[tuple[str, int], ...]:
    """Extra variants for regions with an RMSNorm reduction: vllm-compiled in Inductor's CPU order, over two
    vectors and one vector of this CPU's fp32 lanes (32 and 16 on AVX-512, 16 and 8 on AVX2)."""
    from ..engine import cpu_vector_isa

    isa = cpu_vector_isa()
    vf = isa[1] if isa else 16
    return (("vllm-compiled-exact", 2 * vf), ("vllm-compiled-exact", vf))
# Tolerance for RMSNorm regions in torch's reduction order (reduction-order noise, not rounding).
NORM_MIN_MATCH = 0.9999
NORM_MAX_ULP = 1

REGIONS = ("rms_norm", "add_rms_norm", "swiglu", "rope", "qk_norm_rope")
_NORM_REGIONS = ("rms_norm", "add_rms_norm", "qk_norm_rope")


# ----------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------


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
        model: checkpoint path.
        engine: engine facts (`trl_roundalign.engine.EngineInfo.as_dict()`) plus the Inductor options used.
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
            else of the one closest by k3 (engine-attention candidates first, see `_model_best`).
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


# ----------------------------------------------------------------------------------------------
# Bitwise comparison
# ----------------------------------------------------------------------------------------------


def _ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 bit patterns as int64 ordered like the values (adjacent floats one apart)."""
    bits = t.contiguous().view(torch.int16).to(torch.int64)
    magnitude = bits & 0x7FFF
    return torch.where(bits < 0, -magnitude - 1, bits)


def ulp_distance(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in ulps of two bf16/fp16 tensors; NaN-NaN is 0, NaN against a number -1."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape or actual.element_size() != 2:
        raise TypeError(
            f"cannot compare {actual.dtype}{tuple(actual.shape)} with {expected.dtype}{tuple(expected.shape)} "
            "(two 16-bit float tensors of one shape expected)."
        )
    a, e = actual.detach().cpu(), expected.detach().cpu()
    dist = (_ordered_bits(a) - _ordered_bits(e)).abs()
    a_nan, e_nan = a.isnan(), e.isnan()
    dist = torch.where(a_nan & e_nan, torch.zeros_like(dist), dist)
    return torch.where(a_nan ^ e_nan, torch.full_like(dist, -1), dist)


def _compare(
    label: str,
    profile: str,
    lanes: int | None,
    engine_out: dict[str, torch.Tensor],
    ref_out: dict[str, torch.Tensor],
    *,
    norm_region: bool,
) -> ProfileMatch:
    elements = mismatches = one_ulp = 0
    max_ulp = 0
    per_output = {}
    for name, e in engine_out.items():
        r = ref_out[name]
        if r.dtype != e.dtype:  # the fp32 residual stream, stored by the engine in its dtype
            r = r.to(e.dtype)
        dist = ulp_distance(e, r)
        n, bad = dist.numel(), int((dist != 0).sum())
        elements += n
        mismatches += bad
        one_ulp += int((dist == 1).sum())
        if bad:
            m = int(dist.max())
            max_ulp = -1 if bool((dist == -1).any()) else max(max_ulp, m)
        per_output[name] = 1.0 - bad / n if n else 1.0
    rate = 1.0 - mismatches / elements if elements else 1.0
    exact = mismatches == 0
    tolerant = norm_region and lanes is None and rate >= NORM_MIN_MATCH and 0 <= max_ulp <= NORM_MAX_ULP
    return ProfileMatch(
        label, profile, lanes, elements, mismatches, rate, max_ulp, one_ulp, per_output, exact, exact or tolerant
    )


# ----------------------------------------------------------------------------------------------
# The engine's configuration and modules
# ----------------------------------------------------------------------------------------------


def engine_config(model: str | os.PathLike, **engine_kwargs):
    """The `VllmConfig` that `trl_roundalign.engine.build_llm(model, **engine_kwargs)` would run with.

    Built with `vllm.engine.arg_utils.EngineArgs(...).create_engine_config()` and the same defaults
    as `build_llm` (bf16, seed 0, `max_model_len` 1024, its memory share), without loading weights.
    """
    from vllm.engine.arg_utils import EngineArgs

    from .._compat import is_vllm_cpu

    kw = dict(engine_kwargs)
    kw.pop("cache_tag", None)
    kw.pop("weight_sync_fix", None)
    kw.setdefault("dtype", "bfloat16")
    kw.setdefault("gpu_memory_utilization", 0.3 if is_vllm_cpu() else 0.5)
    kw.setdefault("seed", 0)
    kw.setdefault("max_model_len", 1024)
    kw.setdefault("enforce_eager", False)
    return EngineArgs(model=str(model), **kw).create_engine_config()


def _is_compiled(vllm_config) -> bool:
    from vllm.config import CompilationMode

    if vllm_config.model_config is not None and vllm_config.model_config.enforce_eager:
        return False
    return vllm_config.compilation_config.mode != CompilationMode.NONE


def _inductor_options(vllm_config) -> dict:
    """The engine's Inductor options that torch's Inductor config knows (plain values only)."""
    import torch._inductor.config as inductor_config

    out = {}
    for key, value in (vllm_config.compilation_config.inductor_compile_config or {}).items():
        if not isinstance(value, (bool, int, float, str)):
            continue
        obj = inductor_config
        parts = key.split(".")
        for p in parts[:-1]:
            obj = getattr(obj, p, None)
        if obj is not None and hasattr(obj, parts[-1]):
            out[key] = value
    return out


@dataclass
class _Shapes:
    model_type: str
    hidden: int
    intermediate: int
    head_dim: int
    heads: int
    kv_heads: int
    eps: float
    max_position: int
    rope_parameters: dict | None
    qk_norm: bool


def _shapes(vllm_config) -> _Shapes:
    cfg = vllm_config.model_config.hf_text_config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    model_type = getattr(cfg, "model_type", "")
    rope_parameters = getattr(cfg, "rope_parameters", None)
    if rope_parameters is None and hasattr(cfg, "rope_theta"):
        rope_parameters = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    return _Shapes(
        model_type=model_type,
        hidden=cfg.hidden_size,
        intermediate=cfg.intermediate_size,
        head_dim=head_dim,
        heads=heads,
        kv_heads=getattr(cfg, "num_key_value_heads", heads) or heads,
        eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
        max_position=getattr(cfg, "max_position_embeddings", 4096),
        rope_parameters=dict(rope_parameters) if rope_parameters else None,
        qk_norm=model_type.startswith("qwen3"),
    )


def _fresh_modules(vllm_config, shapes: _Shapes) -> dict[str, torch.nn.Module]:
    """vLLM's modules for each region, instantiated under the engine's config (dispatch decided here)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(vllm_config), fresh_rope_cache(), torch.device(_device()):
        mods: dict[str, torch.nn.Module] = {
            "norm": RMSNorm(shapes.hidden, eps=shapes.eps, dtype=torch.bfloat16),
            "act": SiluAndMul(),
            "rope": get_rope(
                shapes.head_dim,
                max_position=shapes.max_position,
                rope_parameters=shapes.rope_parameters,
                dtype=torch.bfloat16,
            ),
        }
        if shapes.qk_norm:
            mods["q_norm"] = RMSNorm(shapes.head_dim, eps=shapes.eps, dtype=torch.bfloat16)
            mods["k_norm"] = RMSNorm(shapes.head_dim, eps=shapes.eps, dtype=torch.bfloat16)
    return mods


def _grab_layer0(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Layer 0's region modules of an engine's model (runs inside the engine's worker)."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    out: dict[str, torch.nn.Module] = {}
    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(m, RMSNorm) and leaf == "input_layernorm":
            out.setdefault("norm", m)
        elif isinstance(m, RMSNorm) and leaf in ("q_norm", "k_norm"):
            out.setdefault(leaf, m)
        elif isinstance(m, SiluAndMul):
            out.setdefault("act", m)
        elif isinstance(m, RotaryEmbeddingBase):
            out.setdefault("rope", m)
    return out


def _engine_modules(llm) -> dict[str, torch.nn.Module]:
    results = llm.apply_model(_grab_layer0)
    if not results or not isinstance(results[0], dict):
        raise RuntimeError("Could not read the engine's modules (apply_model returned nothing usable).")
    return results[0]


def _method_name(module: torch.nn.Module) -> str:
    fn = getattr(module, "_forward_method", None)
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "__wrapped__", None), "__name__", None)
    return name or type(fn).__name__


def _with_weight(module: torch.nn.Module, weight: torch.Tensor) -> torch.nn.Module:
    """A copy of a vLLM RMSNorm with `weight` (its dispatch is kept: the bound method follows the copy)."""
    m = copy.deepcopy(module)
    m.weight.data = weight.to(m.weight.device).clone()
    return m


def _device() -> torch.device:
    """Where the engine's modules run: the accelerator on CUDA-like platforms, else the CPU."""
    from vllm.platforms import current_platform

    return torch.device("cuda") if current_platform.is_cuda_alike() else torch.device("cpu")


# ----------------------------------------------------------------------------------------------
# Per-region probing
# ----------------------------------------------------------------------------------------------


@dataclass
class _Case:
    region: str
    engine_fn: Callable[..., dict[str, torch.Tensor]]
    inputs: tuple
    dynamic: tuple[int, ...]  # indices of inputs whose dim 0 is the token dim
    reference: Callable[[str, int | None], dict[str, torch.Tensor]]
    path: str
    shape: list[int]
    # Readings no profile implements, `{name: (description, outputs)}`: named in the warning when one
    # of them, and no profile, reproduces the engine.
    diagnostics: Callable[[], dict[str, tuple[str, dict[str, torch.Tensor]]]] | None = None


def _rand(gen: torch.Generator, *shape: int, scale: float = 2.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)


def _weight(gen: torch.Generator, n: int) -> torch.Tensor:
    return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(torch.bfloat16)


def _hf_cos_sin(rope_module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's bf16 cos/sin table rows, in Hugging Face's layout (`[T, 1, rotary_dim]`, halves duplicated)."""
    cache = rope_module.cos_sin_cache.detach().cpu().to(torch.bfloat16)
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)
    return torch.cat((cos, cos), -1)[:, None, :], torch.cat((sin, sin), -1)[:, None, :]


def _build_cases(
    mods: dict[str, torch.nn.Module], shapes: _Shapes, rows: int, seed: int, compiled: bool
) -> tuple[list[_Case], dict[str, str]]:
    gen = torch.Generator().manual_seed(seed)
    skipped: dict[str, str] = {}
    cases: list[_Case] = []
    how = "torch.compile (Inductor)" if compiled else "eager"
    T, H, eps = rows, shapes.hidden, shapes.eps

    # RMSNorm without residual (layer-0 input norm).
    norm = mods.get("norm")
    if norm is None:
        skipped["rms_norm"] = skipped["add_rms_norm"] = "the engine's model has no vLLM RMSNorm input_layernorm"
    else:
        w = _weight(gen, H)
        norm_w = _with_weight(norm, w)
        x = _rand(gen, T, H)

        def rms_engine(x, _m=norm_w):
            return {"out": _m(x.clone())}

        def rms_ref(profile, lanes, x=x, w=w):
            return {"out": ops.rms_norm(x, w, eps, profile=profile, backend="torch", reduction_lanes=lanes)}

        path = f"{type(norm).__name__}.{_method_name(norm)} -> vllm.ir rms_norm, {how}"
        cases.append(_Case("rms_norm", rms_engine, (x,), (0,), rms_ref, path, [T, H]))

        # Fused residual add + RMSNorm: both outputs.
        w2 = _weight(gen, H)
        norm_w2 = _with_weight(norm, w2)
        h, res = _rand(gen, T, H), _rand(gen, T, H, scale=4.0)

        def add_engine(h, res, _m=norm_w2):
            out, new_res = _m(h.clone(), res.clone())
            return {"out": out, "residual": new_res}

        def add_ref(profile, lanes, h=h, res=res, w=w2):
            out, new_res = ops.add_rms_norm(h, res, w, eps, profile=profile, backend="torch", reduction_lanes=lanes)
            return {"out": out, "residual": new_res}

        def add_diagnostics(h=h, res=res, w=w2):
            s = res.float() + h.float()  # the unrounded fp32 sum
            xhat = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
            out = (w.float() * xhat.to(torch.bfloat16).float()).to(torch.bfloat16)
            return {
                "hf-norm-of-fp32-sum": (
                    "residual r(s), output r(f(w) * f(r(x̂(s)))) with x̂ taken from the UNROUNDED fp32 sum "
                    "s = f(x) + f(residual)",
                    {"out": out, "residual": s.to(torch.bfloat16)},
                )
            }

        path = f"{type(norm).__name__}.{_method_name(norm)}(x, residual) -> vllm.ir fused_add_rms_norm, {how}"
        cases.append(
            _Case("add_rms_norm", add_engine, (h, res), (0, 1), add_ref, path, [T, H], diagnostics=add_diagnostics)
        )

    # SwiGLU.
    act = mods.get("act")
    if act is None:
        skipped["swiglu"] = "the engine's model has no vLLM SiluAndMul"
    else:
        inter = shapes.intermediate
        gate, up = _rand(gen, T, inter), _rand(gen, T, inter)
        gate_up = torch.cat((gate, up), dim=-1)

        def act_engine(gu, _m=act):
            return {"out": _m(gu.clone())}

        def act_ref(profile, lanes, gate=gate, up=up):
            return {"out": ops.swiglu(gate, up, profile=profile, backend="torch")}

        path = f"SiluAndMul.{_method_name(act)}, {how}"
        cases.append(_Case("swiglu", act_engine, (gate_up,), (0,), act_ref, path, [T, 2 * inter]))

    # RoPE and Qwen3's q/k-norm + RoPE.
    rope = mods.get("rope")
    rope_ok = rope is not None and getattr(rope, "is_neox_style", False) and hasattr(rope, "cos_sin_cache")
    if rope is None:
        skipped["rope"] = skipped["qk_norm_rope"] = "the engine's model has no vLLM RotaryEmbedding"
    elif not rope_ok:
        skipped["rope"] = skipped["qk_norm_rope"] = (
            f"{type(rope).__name__} is not a neox-style RoPE with a cos/sin cache: no reference for it"
        )
    elif rows > rope.cos_sin_cache.shape[0]:
        skipped["rope"] = skipped["qk_norm_rope"] = (
            f"rows={rows} exceeds the RoPE table ({rope.cos_sin_cache.shape[0]} positions)"
        )
    else:
        D, nq, nkv = shapes.head_dim, shapes.heads, shapes.kv_heads
        positions = torch.arange(T, dtype=torch.long)
        cos, sin = _hf_cos_sin(rope, positions)
        q, k = _rand(gen, T, nq * D), _rand(gen, T, nkv * D)

        def rope_engine(pos, q, k, _m=rope):
            qo, ko = _m(pos, q.clone(), k.clone())
            return {"q": qo, "k": ko}

        def rope_ref(profile, lanes, q=q, k=k):
            return {
                "q": ops.rope(q.view(T, nq, D), cos, sin, profile=profile, backend="torch").reshape(T, nq * D),
                "k": ops.rope(k.view(T, nkv, D), cos, sin, profile=profile, backend="torch").reshape(T, nkv * D),
            }

        path = f"{type(rope).__name__}.{_method_name(rope)}, {how}"
        cases.append(_Case("rope", rope_engine, (positions, q, k), (0, 1, 2), rope_ref, path, [T, nq * D]))

        if not shapes.qk_norm:
            skipped["qk_norm_rope"] = f"model type {shapes.model_type!r} has no q/k-norm"
        elif "q_norm" not in mods or "k_norm" not in mods:
            skipped["qk_norm_rope"] = "the engine's model has no q_norm/k_norm RMSNorm"
        else:
            wq, wk = _weight(gen, D), _weight(gen, D)
            q_norm, k_norm = _with_weight(mods["q_norm"], wq), _with_weight(mods["k_norm"], wk)
            q2, k2 = _rand(gen, T, nq * D), _rand(gen, T, nkv * D)

            def qk_engine(pos, q, k, _qn=q_norm, _kn=k_norm, _rope=rope):
                # As vLLM's Qwen3Attention.forward: per-head norm, view back, rotary embedding.
                qh = _qn(q.view(*q.shape[:-1], q.shape[-1] // D, D)).view(q.shape)
                kh = _kn(k.view(*k.shape[:-1], k.shape[-1] // D, D)).view(k.shape)
                qo, ko = _rope(pos, qh, kh)
                return {"q": qo, "k": ko}

            def qk_ref(profile, lanes, q=q2, k=k2):
                return {
                    "q": ops.qk_norm_rope(
                        q.view(T, nq, D), wq, eps, cos, sin, profile=profile, backend="torch", reduction_lanes=lanes
                    ).reshape(T, nq * D),
                    "k": ops.qk_norm_rope(
                        k.view(T, nkv, D), wk, eps, cos, sin, profile=profile, backend="torch", reduction_lanes=lanes
                    ).reshape(T, nkv * D),
                }

            path = (
                f"RMSNorm.{_method_name(mods['q_norm'])} per head + {type(rope).__name__}.{_method_name(rope)}, {how}"
            )
            cases.append(_Case("qk_norm_rope", qk_engine, (positions, q2, k2), (0, 1, 2), qk_ref, path, [T, nq * D]))
    return cases, skipped


@contextlib.contextmanager
def _engine_context(vllm_config, compiled: bool):
    """vLLM's config, IR op priority and torch-wrap setting as the engine's forward sees them.

    Under compile, vLLM IR ops are always inlined (torch wrap off): that is what vLLM's IR lowering
    pass does inside the engine's graph when the wrap is on.
    """
    from vllm import ir
    from vllm.config import set_current_vllm_config

    wrap = bool(vllm_config.compilation_config.ir_enable_torch_wrap) and not compiled
    with contextlib.ExitStack() as stack:
        stack.enter_context(set_current_vllm_config(vllm_config))
        stack.enter_context(vllm_config.kernel_config.ir_op_priority.set_priority())
        stack.enter_context(ir.enable_torch_wrap(wrap))
        yield


def _run_engine_case(case: _Case, vllm_config, compiled: bool) -> dict[str, torch.Tensor]:
    device = _device()
    inputs = tuple(t.to(device).clone() for t in case.inputs)
    with _engine_context(vllm_config, compiled), torch.no_grad():
        if not compiled:
            out = case.engine_fn(*inputs)
        else:
            backend = vllm_config.compilation_config.backend or "inductor"
            if backend not in ("inductor", "eager", "aot_eager"):
                backend = "inductor"
            options = _inductor_options(vllm_config) if backend == "inductor" else None
            fn = torch.compile(case.engine_fn, backend=backend, options=options, fullgraph=False)
            for i in case.dynamic:
                torch._dynamo.mark_dynamic(inputs[i], 0)
            out = fn(*inputs)
    return {k: v.detach().cpu() for k, v in out.items()}


def _score(m: ProfileMatch) -> tuple:
    return (m.matches, m.exact, m.match_rate)


def probe_regions(
    model: str | os.PathLike,
    *,
    llm=None,
    vllm_config=None,
    rows: int = 64,
    seed: int = 0,
    regions: Sequence[str] = REGIONS,
    **engine_kwargs,
) -> tuple[list[RegionResult], dict]:
    """Run vLLM's own code for each region the way the engine runs it; compare with every profile.

    Args:
        model: checkpoint folder (its config gives the shapes).
        llm: a built `vllm.LLM` (in-process): its own modules and config are used. Otherwise the
            modules are instantiated under `vllm_config`, or under `engine_config(model, **engine_kwargs)`.
        vllm_config: the engine's `VllmConfig` (when no `llm`).
        rows: tokens of random input per region.
        seed: input seed.
        regions: the regions to probe (default: all that the model has).
        **engine_kwargs: as for `trl_roundalign.engine.build_llm` (`enforce_eager`, `compilation_config`, ...).

    Returns:
        `(results, context)`: per-region results and `{"source", "compiled", "inductor_options",
        "warnings", "vllm_config"}`.
    """
    if rows < 1:
        raise ValueError(f"rows must be at least 1, got {rows}.")
    unknown = [r for r in regions if r not in REGIONS]
    if unknown:
        raise ValueError(f"Unknown region(s) {unknown}; known: {', '.join(REGIONS)}.")
    warnings: list[str] = []
    if llm is not None:
        vllm_config = llm.llm_engine.vllm_config
        mods = _engine_modules(llm)
        source = "engine"
        shapes = _shapes(vllm_config)
        fresh = _fresh_modules(vllm_config, shapes)
        rope, ref_rope = mods.get("rope"), fresh.get("rope")
        if rope is not None and ref_rope is not None and _method_name(rope) != _method_name(ref_rope):
            warnings.append(
                f"This engine's RotaryEmbedding runs {_method_name(rope)}, but its configuration dispatches "
                f"{_method_name(ref_rope)}: the module was created by an earlier engine in this process (vLLM caches "
                "get_rope instances per process). The engine is probed as it runs; in a fresh process it would run "
                f"{_method_name(ref_rope)}."
            )
    else:
        if vllm_config is None:
            vllm_config = engine_config(model, **engine_kwargs)
        source = "config"
        shapes = _shapes(vllm_config)
        mods = _fresh_modules(vllm_config, shapes)
    compiled = _is_compiled(vllm_config)
    cases, skipped = _build_cases(mods, shapes, rows, seed, compiled)

    results: list[RegionResult] = []
    for case in cases:
        if case.region not in regions:
            continue
        t0 = time.perf_counter()
        engine_out = _run_engine_case(case, vllm_config, compiled)
        norm_region = case.region in _NORM_REGIONS
        res = RegionResult(case.region, engine_path=case.path, shape=case.shape)
        variants: list[tuple[str, str, int | None]] = [(p, p, None) for p in BASE_PROFILES]
        if norm_region:
            variants += [(f"{p}@{lanes}", p, lanes) for p, lanes in reduction_variants()]
        with torch.no_grad():
            for label, profile, lanes in variants:
                ref = case.reference(profile, lanes)
                res.results[label] = _compare(label, profile, lanes, engine_out, ref, norm_region=norm_region)
        res.matching = [p for p in BASE_PROFILES if res.results[p].matches]
        exact_variants = [lbl for lbl, m in res.results.items() if m.exact and m.reduction_lanes is not None]
        res.exact_variant = exact_variants[0] if exact_variants else None
        if not any(m.exact for m in res.results.values()):
            top = max(res.results.values(), key=_score)
            parts = ", ".join(f"{k} {v:.2%}" for k, v in top.per_output.items()) if len(top.per_output) > 1 else ""
            res.warning = (
                f"no profile reproduces the engine's {case.region} bit for bit (closest: {top.label}, "
                f"{top.match_rate:.4%} identical{' (' + parts + ')' if parts else ''}, max {top.max_ulp} ulp)"
            )
            for name, (description, outputs) in (case.diagnostics() if case.diagnostics else {}).items():
                d = _compare(name, "", None, engine_out, outputs, norm_region=False)
                res.diagnostics[name] = d.match_rate
                if d.exact:
                    res.engine_computes = description
                    res.warning += f"; the engine computes: {description}"
        logger.info("probe %s: %.1fs, matching %s", case.region, time.perf_counter() - t0, res.matching)
        results.append(res)
    for region, why in skipped.items():
        if region in regions:
            results.append(RegionResult(region, skipped=why))
    order = {r: i for i, r in enumerate(REGIONS)}
    results.sort(key=lambda r: order[r.region])
    context = {
        "source": source,
        "compiled": compiled,
        "inductor_options": _inductor_options(vllm_config) if compiled else {},
        "warnings": warnings,
        "vllm_config": vllm_config,
    }
    return results, context


def _verdict(results: Sequence[RegionResult]) -> tuple[str | None, bool]:
    """The base profile that matches the most probed regions (then: most exact, highest mean match rate)."""
    probed = [r for r in results if not r.skipped]
    if not probed:
        return None, False

    def key(p: str):
        ms = [r.results[p] for r in probed]
        return (sum(m.matches for m in ms), sum(m.exact for m in ms), sum(m.match_rate for m in ms))

    best = max(BASE_PROFILES, key=key)
    if key(best)[0] == 0:
        return None, False
    return best, key(best)[0] == len(probed)


def _assign_best(results: Sequence[RegionResult], verdict: str | None) -> None:
    for r in results:
        if r.skipped:
            continue
        top = max(_score(r.results[p]) for p in BASE_PROFILES)
        tied = [p for p in BASE_PROFILES if _score(r.results[p]) == top]
        r.best = verdict if verdict in tied else tied[0]


# ----------------------------------------------------------------------------------------------
# Model level
# ----------------------------------------------------------------------------------------------


_MODEL_PROFILES = ("vllm-compiled", "vllm-compiled-piecewise", "vllm-eager", "vllm-eager-cpu", "vllm-eager-cpu-avx2", "none")


def _model_candidates(info) -> list[tuple[str, object, tuple[str, ...], str]]:
    """`(label, profile, regions, attention)` for every model-level candidate.

    The base profiles with the model's own (sdpa) attention; on vLLM-CPU engines each again with
    the engine's attention kernel (region `attention`), which removes the attention kernel's
    differences and leaves the rounding locations alone: the right residual handling is then the
    one that reproduces the engine bit for bit. On vLLM-CPU compiled engines also the exact mode
    (`vllm-compiled-exact`: the engine's RMSNorm reduction order as read from its compile cache).
    """
    from dataclasses import replace

    from ..profiles import get_profile

    cands: list[tuple[str, object, tuple[str, ...], str]] = [
        (p, p, PAPER_REGIONS, "sdpa") for p in _MODEL_PROFILES
    ]
    if info.platform == "cpu":
        for p in _MODEL_PROFILES:
            prof = replace(get_profile(p), attention="vllm-cpu")
            cands.append((f"{p}+attention", prof, ALL_REGIONS, "engine"))
        if info.compiled:
            for p in _EXACT_FAMILY:
                cands.append((p, p, ALL_REGIONS, "engine"))
    return cands


def probe_model_level(
    model_path: str | os.PathLike,
    llm,
    *,
    num_prompts: int = 2,
    samples_per_prompt: int = 2,
    max_new_tokens: int = 32,
    seed: int = 0,
) -> list[ModelLevelResult]:
    """Score a few engine-generated sequences with the patched model under each candidate profile.

    Candidates (`_model_candidates`): `vllm-compiled`, `vllm-eager`, `vllm-eager-cpu` (each with the
    paper's three regions: fp32 vs rounded residual stream, one- vs two-rounding norm, ...) and
    `none` (stock Hugging Face rounding); on vLLM-CPU each also with the engine's attention kernel,
    and on vLLM-CPU compiled engines the exact mode (`vllm-compiled-exact`).

    Returns:
        One `ModelLevelResult` per candidate (bit-identical fraction and k3 against the engine's
        prefill log-probs, completion tokens).
    """
    from ..engine import engine_info
    from .compare import Condition, compare_with_engine

    info = engine_info(llm)
    cands = _model_candidates(info)
    conditions = [Condition(label, regions, profile) for label, profile, regions, _ in cands]
    attention = {label: att for label, _, _, att in cands}
    kwargs = dict(
        num_prompts=num_prompts,
        samples_per_prompt=samples_per_prompt,
        max_new_tokens=max_new_tokens,
        temperature=1.0,
        seed=seed,
        floors=False,
    )
    try:
        comp = compare_with_engine(model_path, llm, conditions, **kwargs)
    except FileNotFoundError as exc:  # no Inductor C++ graph to read the reduction lanes from
        logger.warning("exact candidate dropped (%s); scoring the others", exc)
        conditions = [c for c in conditions if c.profile not in _EXACT_FAMILY]
        comp = compare_with_engine(model_path, llm, conditions, **kwargs)
    out = []
    for c in conditions:
        s = comp.stats[c.name]["vs_prefill"]
        out.append(
            ModelLevelResult(
                candidate=c.name,
                profile=getattr(c.profile, "name", c.profile),
                regions=list(c.regions),
                attention=attention[c.name],
                bit_identical=float(s["mismatch/frac_bitwise_equal"]),
                k3=float(s["mismatch/kl_k3"]),
                max_abs_diff=float(s["mismatch/abs_logp_diff/max"]),
                tokens=int(s["mismatch/tokens"]),
            )
        )
    return out


def _family(profile: str) -> str:
    """The base profile a candidate's profile refines (`vllm-compiled-exact` refines `vllm-compiled`)."""
    return _EXACT_FAMILY.get(profile, profile)


def _model_best(results: Sequence[ModelLevelResult], prefer: str | None = None) -> tuple[str | None, str | None, bool]:
    """`(best base profile, bit-exact candidate, conclusive)`.

    Candidates are ranked among those with the engine's attention kernel when there are any (the
    attention kernel's own differences would otherwise dominate every comparison). A candidate that
    reproduces every token bit for bit decides (`conclusive`); otherwise the lowest k3 is only the
    closest, and on tiny random models (near-uniform logits) that ranking is mostly noise. Exact
    ties (e.g. `vllm-eager` and `vllm-eager-cpu` on a model whose norm weights are all ones) go to
    `prefer` (the per-region verdict).
    """
    engine_att = [r for r in results if r.attention == "engine"]
    pool = engine_att or list(results)
    if not pool:
        return None, None, False
    exact = [r for r in pool if r.tokens > 0 and r.bit_identical == 1.0]
    if exact:
        top = min(exact, key=lambda r: r.profile in _EXACT_FAMILY)  # prefer a base profile
        return _family(top.profile), top.candidate, True
    top = min(pool, key=lambda r: (r.k3, -r.bit_identical, _family(r.profile) != prefer))
    return _family(top.profile), None, False


# ----------------------------------------------------------------------------------------------
# The whole probe
# ----------------------------------------------------------------------------------------------


def probe(
    model: str | os.PathLike,
    *,
    rows: int = 64,
    seed: int = 0,
    model_check: bool = True,
    llm=None,
    num_prompts: int = 2,
    samples_per_prompt: int = 2,
    max_new_tokens: int = 32,
    **engine_kwargs,
) -> ProbeReport:
    """Probe which rounding profile an engine configuration implements.

    Args:
        model: checkpoint folder (resolve offline names with `trl_roundalign.local_models.resolve_model`).
        rows: tokens of random input per region.
        seed: input and sampling seed.
        model_check: also build the engine (unless `llm` is given) and score sequences at the model level.
        llm: an already built in-process engine for this model; its modules and config are probed.
        num_prompts, samples_per_prompt, max_new_tokens: size of the model-level check.
        **engine_kwargs: the engine configuration, as for `trl_roundalign.engine.build_llm`
            (`enforce_eager`, `compilation_config={"custom_ops": [...]}`, `max_model_len`, ...).

    Returns:
        A `ProbeReport`.
    """
    from ..engine import build_llm, close_llm, engine_info, profile_for_engine

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    own_engine = llm is None and model_check
    if own_engine:
        llm = build_llm(str(model), **engine_kwargs)  # with a fresh RoPE cache, like every build_llm engine
        timings["build_engine"] = time.perf_counter() - t0
    try:
        t1 = time.perf_counter()
        results, ctx = probe_regions(model, llm=llm, rows=rows, seed=seed, **({} if llm is not None else engine_kwargs))
        timings["regions"] = time.perf_counter() - t1
        cfg = ctx["vllm_config"]
        info = engine_info(llm if llm is not None else cfg)
        engine = info.as_dict()
        engine["inductor_options"] = ctx["inductor_options"]

        verdict, exact = _verdict(results)
        _assign_best(results, verdict)
        report = ProbeReport(
            model=str(model),
            engine=engine,
            source=ctx["source"],
            rows=rows,
            seed=seed,
            regions=results,
            profile=verdict,
            profile_exact=exact,
            region_profiles={r.region: r.best for r in results if not r.skipped},
            warnings=list(ctx["warnings"]),
        )
        for r in results:
            if r.warning:
                report.warnings.append(f"{r.region}: {r.warning}")
            elif r.skipped:
                report.warnings.append(f"{r.region}: not probed ({r.skipped})")
        if verdict is None:
            report.warnings.append("no profile matches any region of this engine")
        elif not exact:
            off = [r.region for r in results if not r.skipped and not r.results[verdict].matches]
            report.warnings.append(
                f"no single profile matches every region; {verdict!r} matches all but {', '.join(off)} "
                f"(per region: {report.region_profiles})"
            )
        try:
            report.auto_profile = profile_for_engine(info)
        except ValueError as exc:
            report.auto_error = str(exc)
        if report.auto_profile is not None:
            report.agrees_with_auto = report.auto_profile == verdict
            if not report.agrees_with_auto:
                report.warnings.append(
                    f"profile='auto' picks {report.auto_profile!r} for this engine, but the probe measured {verdict!r}"
                )

        if model_check:
            t2 = time.perf_counter()
            report.model_level = probe_model_level(
                model,
                llm,
                num_prompts=num_prompts,
                samples_per_prompt=samples_per_prompt,
                max_new_tokens=max_new_tokens,
                seed=seed,
            )
            timings["model_level"] = time.perf_counter() - t2
            best, exact_cand, conclusive = _model_best(report.model_level, prefer=verdict)
            report.model_level_best, report.model_level_exact, report.model_level_conclusive = best, exact_cand, conclusive
            if not conclusive:
                report.warnings.append(
                    "no model-level candidate reproduces the engine's log-probs bit for bit; the closest by k3 is "
                    f"{best!r} (inconclusive: every candidate differs somewhere)"
                )
            elif verdict is not None and best != verdict:
                report.warnings.append(
                    f"at the model level {exact_cand!r} reproduces the engine bit for bit, not the per-region verdict "
                    f"{verdict!r}: the engine handles the residual stream differently from what its regions suggest"
                )
    finally:
        if own_engine:
            close_llm(llm)
    timings["total"] = time.perf_counter() - t0
    report.timings = timings
    return report


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


def _rate(m: ProfileMatch | None) -> str:
    if m is None:
        return "-"
    if m.exact:
        return "100%"
    s = f"{m.match_rate * 100:.2f}%" if m.match_rate < 0.9999 else f"{m.match_rate * 100:.4f}%"
    return s + ("~" if m.matches else "")


def format_report(report: ProbeReport) -> str:
    """The probe's report as plain-text tables (regions x profiles, then the model level)."""
    e = report.engine
    lines = [
        f"trl-roundalign probe: {report.model}",
        f"engine: vLLM {e.get('vllm_version')} on {e.get('platform')}, "
        f"{'compiled (' + str(e.get('compile_mode')) + ')' if e.get('compiled') else 'eager (enforce_eager)'}, "
        f"custom_ops={e.get('custom_ops')}; modules from the {report.source}; {report.rows} rows, seed {report.seed}",
        "",
    ]
    labels = list(BASE_PROFILES) + [f"{p}@{n}" for p, n in reduction_variants()]
    head = ["region"] + labels + ["best"]
    rows = []
    for r in report.regions:
        if r.skipped:
            rows.append([r.region] + ["-"] * len(labels) + [f"not probed: {r.skipped}"])
            continue
        best = r.best or "-"
        if r.exact_variant:
            best += f" (exact: {r.exact_variant})"
        rows.append([r.region] + [_rate(r.results.get(lbl)) for lbl in labels] + [best])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines.append(fmt.format(*head))
    lines.append(fmt.format(*["-" * w for w in widths]))
    lines += [fmt.format(*row) for row in rows]
    lines.append(
        "  (100%: bit-identical; ~: RMSNorm within reduction-order noise, >=99.99% and <=1 ulp; @N: Inductor CPU order, N lanes)"
    )
    lines.append("")
    for r in report.regions:
        if not r.skipped:
            lines.append(f"  {r.region}: {r.engine_path}")
    lines.append("")
    if report.model_level:
        lines.append(
            "model level (completion tokens against the engine's prefill log-probs; each candidate with the paper's "
            "three regions, 'none' without; +attention: also the engine's attention kernel):"
        )
        head2 = ["candidate", "attention", "bit-identical", "k3", "max|dlogp|", "tokens"]
        rows2 = [
            [
                m.candidate,
                m.attention,
                f"{m.bit_identical:.2%}",
                f"{m.k3:.3e}",
                f"{m.max_abs_diff:.3e}",
                str(m.tokens),
            ]
            for m in report.model_level
        ]
        widths2 = [max(len(str(x)) for x in col) for col in zip(head2, *rows2)]
        fmt2 = "  ".join(f"{{:<{w}}}" for w in widths2)
        lines.append(fmt2.format(*head2))
        lines.append(fmt2.format(*["-" * w for w in widths2]))
        lines += [fmt2.format(*row) for row in rows2]
        if report.model_level_conclusive:
            lines.append(
                f"reproduces the engine bit for bit: {report.model_level_exact} (profile {report.model_level_best})"
            )
        else:
            lines.append(f"no candidate is bit-identical; closest by k3: {report.model_level_best}")
        lines.append("")
    verdict = report.profile or "(no profile matches any region)"
    lines.append(f"profile: {verdict}" + ("" if report.profile_exact else " (not every region matches)"))
    if report.auto_profile is not None:
        lines.append(
            f"profile='auto' picks: {report.auto_profile} ({'agrees' if report.agrees_with_auto else 'DISAGREES'})"
        )
    elif report.auto_error:
        lines.append(f"profile='auto' refuses this engine: {report.auto_error.splitlines()[0]}")
    for w in report.warnings:
        lines.append(f"WARNING: {w}")
    if report.timings:
        lines.append("time: " + ", ".join(f"{k} {v:.1f}s" for k, v in report.timings.items()))
    return "\n".join(lines)


def run_probe_cli(args) -> dict:
    """`trl-roundalign probe`: print the tables and return the report as a JSON-able dict."""
    from ..local_models import resolve_model

    if args.rows < 1:
        raise ValueError(f"--rows must be at least 1, got {args.rows}.")
    model_path = resolve_model(args.model)
    from ..engine import engine_kwargs_from

    report = probe(
        model_path,
        rows=args.rows,
        seed=args.seed,
        model_check=not args.no_model_check,
        **engine_kwargs_from(args.enforce_eager, args.max_model_len, args.gpu_memory_utilization, args.custom_ops),
    )
    print(format_report(report), flush=True)
    return report.as_dict()
