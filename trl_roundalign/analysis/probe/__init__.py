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
(`trl_roundalign.engine.profile.profile_for_engine`).

Match rules: a profile *matches* a region when every output element is bit-identical, or, for
RMSNorm regions in torch's reduction order (every profile except the Inductor-lane variants), when
at least 99.99% are and none is off by more than one ulp (a different summation order of
`mean(x^2)` is not a rounding location, docs/numerics.md).

A vLLM quirk the probe guards against: `get_rope` caches `RotaryEmbedding` instances per process,
so a second engine in the same process reuses the first engine's RoPE module, with the first
engine's dispatch (a compiled engine's `forward_native` inside an eager engine rounds three times).
The probe builds its engine with an empty cache and warns when an engine it is handed carries a
RoPE module whose dispatch differs from its own configuration's.

Modules (everything public is importable from `trl_roundalign.analysis.probe`):

- `results`: the profiles and regions compared, and the result records (`ProbeReport`, ...).
- `modules`: the engine's `VllmConfig`, the model's shapes, vLLM's module for each region.
- `cases`: per region, random inputs, the engine's module call and the `trl_roundalign.ops` reference.
- `inductor`: running a case as the engine does (its vLLM context; Inductor with its options, or eager).
- `matching`: bit comparison with a profile (`trl_roundalign.analysis.bitwise`) and the match rules.
- `regions`: `probe_regions`; `model_level`: `probe_model_level`; `verdict`: the verdicts.
- `run`: `probe`; `report`: `format_report`; `cli`: `run_probe_cli` (`trl-roundalign probe`).
"""

from __future__ import annotations

from .cli import run_probe_cli
from .matching import NORM_MAX_ULP, NORM_MIN_MATCH, ulp_distance
from .model_level import probe_model_level
from .modules import engine_config
from .regions import probe_regions
from .report import format_report
from .results import (
    BASE_PROFILES,
    REGIONS,
    ModelLevelResult,
    ProbeReport,
    ProfileMatch,
    RegionResult,
    reduction_variants,
)
from .run import probe

__all__ = [
    "BASE_PROFILES",
    "NORM_MAX_ULP",
    "NORM_MIN_MATCH",
    "REGIONS",
    "ModelLevelResult",
    "ProbeReport",
    "ProfileMatch",
    "RegionResult",
    "engine_config",
    "format_report",
    "probe",
    "probe_model_level",
    "probe_regions",
    "reduction_variants",
    "run_probe_cli",
    "ulp_distance",
]
