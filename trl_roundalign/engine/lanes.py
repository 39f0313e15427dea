"""Reading Inductor's generated C++ of a compiled engine: the reduction lanes of every RMSNorm, in forward order
(the path-based reader lives in `engine.inductor_code`; this module reads a built engine's)."""

from __future__ import annotations

import os

from .inductor_code import (  # noqa: F401  (the readers' names, re-exported)
    _ACC_LOOP_RE,
    _ACC_RE,
    _CALL_RE,
    _GEMM_MARKERS,
    _KERNEL_RE,
    _ROTATE_HALF_RE,
    EngineLanes,
    _embedding_kernels,
    _inductor_modules,
    _module_lanes,
    lanes_in_worker,
    lanes_under,
    reduction_lanes_in,
)
from .layout import EngineInfo, engine_info


def _inductor_dir_of(llm_or_dir) -> tuple[str, EngineInfo | None]:
    if isinstance(llm_or_dir, (str, os.PathLike)):
        return str(llm_or_dir), None
    info = engine_info(llm_or_dir)
    if not info.compiled:
        raise ValueError("This engine has no compiled graph: it is not compiled (enforce_eager?).")
    path = info.inductor_dir or info.cache_dir
    if not path:
        raise ValueError("This engine's compile cache is unknown: build it with trl_roundalign.engine.build.build_llm.")
    return path, info


def inductor_reduction_lanes(llm_or_cache_dir, *, num_layers: int | None = None) -> list[int]:
    """Lane count of every RMSNorm reduction the engine's compiled model runs, in forward order.

    Read from the C++ Inductor generated for this engine (its compile cache), checked against this
    machine's vector width. For the decoder models we patch each reduction is one RMSNorm (input norm,
    Qwen3's q/k norms, post-attention norm, ..., final norm), in the order the forward runs them.

    - One-graph engine (vLLM-CPU default): the model is the newest generated module (the last compile's).
    - Piecewise engine (graph split at attention): one module per piece; the first piece holds the
      embedding, the last holds no RoPE, and the middle pieces (one per layer boundary) share one
      generated module, which is repeated `num_layers - 1` times. Middle modules that differ raise.

    Args:
        llm_or_cache_dir: a built compiled `vllm.LLM` (from `build_llm` or TRL colocate) or an Inductor
            cache folder.
        num_layers: decoder layers (read from the engine when an `LLM` is given; needed for a piecewise
            cache folder).

    Raises:
        FileNotFoundError: no Inductor C++ model graph in the cache.
        ValueError: code for another ISA, or pieces this reader cannot order.
    """
    path, info = _inductor_dir_of(llm_or_cache_dir)
    piecewise = info.piecewise if info is not None else None
    if piecewise and num_layers is None:
        num_layers = int(llm_or_cache_dir.llm_engine.model_config.hf_config.num_hidden_layers)
    return lanes_under(path, piecewise=piecewise, num_layers=num_layers)
