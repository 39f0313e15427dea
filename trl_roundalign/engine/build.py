"""Building the vLLM engine the project scores and trains with: compile caches, the weight-sync fix, row blocks.

Measure the engine, never assume it. The engine facts flow into the profile choice once, at start:

- `build_llm`: an in-process `vllm.LLM` in bf16 with the CPU weight-sync fix and its own compile
  cache (vLLM's compile cache keys do not notice monkeypatches of its Python code, so an engine
  built with the fix must not reuse a graph compiled without it, and vice versa); `piecewise=True`
  builds vLLM-CPU the way vLLM compiles on CUDA (graph split at attention).
- `engine_info` / `profile_for_engine`: compile mode, splitting ops, graph partitioning, custom ops,
  IR op priority, backend, `enforce_eager`, platform, vLLM and torch versions, the CPU's vector ISA
  and vLLM-CPU's kernel library of a built engine, and the rounding profile that engine implies; a
  configuration nobody measured raises `UnknownEngineConfiguration`.
- `inductor_reduction_lanes`: the lane count of every RMSNorm reduction in the engine's compiled
  graph, read from the loop steps of the C++ that Inductor wrote for it and checked against this
  CPU's vector width (docs/numerics.md, "The exact mode").
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from .dispatch import apply_vllm_cpu_weight_sync_fix, is_vllm_cpu, vllm_cpu_weight_sync_fix_applied

logger = logging.getLogger(__name__)


def engine_kwargs_from(
    enforce_eager: bool = False,
    max_model_len: int | None = None,
    gpu_memory_utilization: float | None = None,
    custom_ops: str | None = None,
    piecewise: bool = False,
) -> dict:
    """`build_llm` keyword arguments for the CLI's engine options (`--enforce-eager`, `--piecewise`,
    `--custom-ops a,b`, ...).

    Raises:
        ValueError: `--piecewise` with `--enforce-eager` (a piecewise engine is a compiled one).
    """
    if piecewise and enforce_eager:
        raise ValueError("--piecewise compiles the model in pieces; it cannot be combined with --enforce-eager.")
    kw: dict = {"enforce_eager": bool(enforce_eager), "max_model_len": max_model_len}
    if piecewise:
        kw["piecewise"] = True
    if gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = gpu_memory_utilization
    if custom_ops:
        kw["compilation_config"] = {"custom_ops": [s.strip() for s in custom_ops.split(",") if s.strip()]}
    return kw


def set_offline_defaults(cache: str | os.PathLike, *, in_process_vllm: bool = True) -> None:
    """Environment defaults for offline runs on this kind of machine (existing values win).

    Every cache under `cache` (converted models, vLLM's compile cache, Inductor's), no hub access,
    a 1 GiB vLLM-CPU KV cache (otherwise vLLM takes a share of host RAM), tokenizers without
    their own thread pool, and, with `in_process_vllm`, vLLM's engine in this process (TRL colocate
    needs no such setting: it builds the engine with the external launcher, in process).
    Call it before vLLM is imported.
    """
    cache = Path(cache)
    defaults = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TRL_ROUNDALIGN_CACHE": str(cache / "models"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if in_process_vllm:
        defaults["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


# vLLM-CPU's switch for splitting one decoding sequence's keys over threads (on by default). The project's engines
# run with it off: each sampled token's attention is then computed on one thread over its whole prefix, whatever
# else shares the step, which the trainer reproduces (`ops.attention.sampled_from`). Read back from the engine's
# workers into `EngineLayout.attention_kv_split`.
KV_SPLIT_ENV = "VLLM_CPU_ATTN_SPLIT_KV"


def keep_decode_keys_on_one_thread() -> None:
    """Before a vLLM-CPU engine is built in this process: turn its decode KV split off (`KV_SPLIT_ENV`), unless the
    environment already says otherwise (then the layout reports it and exact mode refuses). vLLM caches its
    environment once an engine has started; the cache is reset where it holds another value, so that the engine
    about to start reads this one."""
    if not is_vllm_cpu():
        return
    os.environ.setdefault(KV_SPLIT_ENV, "0")
    from vllm import envs

    if bool(envs.VLLM_CPU_ATTN_SPLIT_KV) != bool(int(os.environ[KV_SPLIT_ENV])):  # only a cached value can differ
        envs.disable_envs_cache()


def _default_cache_base() -> Path:
    return Path(os.environ.get("VLLM_CACHE_ROOT", Path.home() / ".cache" / "vllm"))


def engine_cache_root(tag: str = "", base: str | os.PathLike | None = None, *, gemm_schedule=None) -> Path:
    """A compile-cache folder for one engine patch state, under `base` or `VLLM_CACHE_ROOT`.

    vLLM's own cache key hashes its configuration and model code, not what this package decides outside them: the
    folder name holds those decisions, so an engine never loads a graph compiled under other ones. They are whether
    the CPU weight-sync fix is active (`wsfix`/`stock`), the build's `tag` (eager, compiled, piecewise, ...) and the
    GEMM schedule the dispatcher traces into the graph (`gemm_schedule`, a `gemm.GemmSchedule`: `rows<N>` for row
    blocks, `rows0min<N>` for a row floor; a constant of the compiled code that no hashed input holds: a graph traced
    with plain `F.linear` must not serve an engine built with 64-row blocks).
    """
    from .gemm import GemmSchedule

    fix = "wsfix" if (is_vllm_cpu() and vllm_cpu_weight_sync_fix_applied()) else "stock"
    rows = GemmSchedule(*gemm_schedule).tag() if fix == "wsfix" and gemm_schedule is not None else ""
    name = "-".join(p for p in ("roundalign", fix, rows, tag) if p)
    return (Path(base) if base else _default_cache_base()) / name


@contextlib.contextmanager
def scoped_cache_root(path: str | os.PathLike):
    """Set `VLLM_CACHE_ROOT` (read lazily by vLLM) for the duration of an engine build."""
    old = os.environ.get("VLLM_CACHE_ROOT")
    os.environ["VLLM_CACHE_ROOT"] = str(path)
    try:
        yield Path(path)
    finally:
        if old is None:
            os.environ.pop("VLLM_CACHE_ROOT", None)
        else:
            os.environ["VLLM_CACHE_ROOT"] = old


def _rope_cache():
    from vllm.model_executor.layers import rotary_embedding

    return rotary_embedding._ROPE_DICT


@contextlib.contextmanager
def fresh_rope_cache():
    """Hide vLLM's per-process `get_rope` cache for the duration (restored afterwards).

    vLLM caches `RotaryEmbedding` instances by shape and parameters, not by configuration: without
    this, an engine built after another one in the same process shares the first engine's RoPE
    module and its dispatch (a compiled engine's `forward_native`, run eagerly by an eager engine).
    """
    cache = _rope_cache()
    saved = dict(cache)
    cache.clear()
    try:
        yield
    finally:
        cache.clear()
        cache.update(saved)


def build_llm(
    model: str | os.PathLike,
    *,
    enforce_eager: bool = False,
    seed: int = 0,
    max_model_len: int | None = None,
    cache_tag: str = "",
    weight_sync_fix: bool = True,
    piecewise: bool = False,
    gemm_block_rows="auto",
    prefill_alone: bool = False,
    **llm_kwargs,
):
    """Build an in-process `vllm.LLM` the way the project scores and trains with it.

    Args:
        model: checkpoint folder (or hub id, where a hub is reachable).
        enforce_eager: build vLLM's eager engine (custom ops, no compile) instead of the compiled one.
        seed: engine seed.
        max_model_len: context length (None: the model's own).
        cache_tag: extra name for this engine's compile cache (use one per differently patched engine).
        weight_sync_fix: apply the vLLM-CPU weight-sync fix first (on CPU; as training does).
        piecewise: compile the way vLLM does on CUDA (`mode=VLLM_COMPILE`, graph split at the attention
            ops). On vLLM-CPU this needs `_compat.vllm_cpu_piecewise` (applied here) and
            `compile_sizes=[]` (set here): vLLM-CPU otherwise compiles one whole graph.
        gemm_block_rows: how the engine's linears compute (`trl_roundalign.engine.gemm`): `"auto"` measures this
            machine's GEMM for the model's shapes and takes a schedule only where it is batch-variant (a row floor
            where only the smallest row counts differ, AMD AVX-512; row blocks where more do, Intel AMX), an int
            sets row blocks of that size (0: plain `F.linear`), a `gemm.GemmSchedule` sets that schedule, None keeps this
            process's setting. Part of the
            compile cache's folder name; read back from the loaded model into `engine_layout(llm)`'s
            `gemm_block_rows` and `gemm_min_rows`.
        prefill_alone: prefill each prompt alone (`engine.prefill`: each prompt in its own attention call, no prefix
            caching; chunked prefill off and a step budget of at least the context length unless `scheduler_cls`
            names the recording scheduler, whose chunks the trainer reproduces), what exact mode's engine does so
            that a prompt of any length is reproduced; read back into the layout's `attention_prefill_alone`.
        **llm_kwargs: passed to `vllm.LLM` (e.g. `compilation_config`, `gpu_memory_utilization`).

    Returns:
        The `vllm.LLM`.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if is_vllm_cpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        keep_decode_keys_on_one_thread()
    if weight_sync_fix:
        apply_vllm_cpu_weight_sync_fix()
    elif is_vllm_cpu() and vllm_cpu_weight_sync_fix_applied():
        raise RuntimeError(
            "The vLLM-CPU weight-sync fix is already applied in this process; an engine without it "
            "needs a fresh process."
        )
    from vllm import LLM

    llm_kwargs.setdefault("dtype", "bfloat16")
    llm_kwargs.setdefault("gpu_memory_utilization", 0.3 if is_vllm_cpu() else 0.5)
    if piecewise:
        if enforce_eager:
            raise ValueError("piecewise=True compiles the model; it cannot be combined with enforce_eager=True.")
        llm_kwargs["compilation_config"] = piecewise_compilation_config(llm_kwargs.get("compilation_config"))
    tag = "eager" if enforce_eager else ("piecewise" if piecewise else "compiled")
    if max_model_len is not None:
        llm_kwargs["max_model_len"] = max_model_len
    if prefill_alone:
        from .prefill import prefill_alone_engine_kwargs

        prefill_alone_engine_kwargs(llm_kwargs, max_model_len, str(model))  # the trainer's colocated engine's way
    rows = None
    if weight_sync_fix and is_vllm_cpu() and gemm_block_rows is not None:
        rows = _decide_engine_schedule(model, gemm_block_rows, llm_kwargs.get("max_num_batched_tokens"),
                                       int(llm_kwargs.get("tensor_parallel_size", 1)))
    root = engine_cache_root("-".join(t for t in (tag, cache_tag) if t), gemm_schedule=rows)
    with scoped_cache_root(root), fresh_rope_cache(), engine_build_context(llm_kwargs.get("compilation_config")):
        llm = LLM(model=str(model), enforce_eager=enforce_eager, seed=seed, **llm_kwargs)
    from .layout import engine_layout

    engine_layout(llm)  # read once, now: what the engine computes with (its workers' linears, Inductor folder, ...)
    return llm


# Rows up to which `gemm_block_rows="auto"` measures: every call of the engines the project builds (prefill chunks,
# decode batches) and of the trainer's scoring stays within the row counts where oneDNN's kernel choice was seen to
# change (1-800); the start-up check and the exactness tests then verify the bits at the sizes used.
AUTO_MEASURE_ROWS = 1024
# The trainer measures up to its batch's tokens (per_device_train_batch_size x sequence length), capped here for the
# time the lm_head's measurement takes. The cap decides only whether row blocks are needed (on the AMX machine plain
# F.linear was already variant below 40 rows); the row-block schedule computes every row by the same block-shaped
# GEMM at any row count, which the measurement up to the cap confirms.
GEMM_MEASURE_MAX_ROWS = 2048


def _decide_engine_schedule(model, requested, max_batched_tokens: int | None, tp: int):
    """`gemm.decide_schedule` for an engine `build_llm` is about to build (an explicit size is row blocks of it, taken
    as it is), and handed to it (`gemm.set_schedule`)."""
    from . import gemm

    if requested == "auto":
        from transformers import AutoConfig

        reaches = {"the engine's prefill chunk": min(int(max_batched_tokens or AUTO_MEASURE_ROWS), AUTO_MEASURE_ROWS)}
        schedule, report = gemm.decide_schedule(AutoConfig.from_pretrained(str(model)), "auto", reaches,
                                                cap=AUTO_MEASURE_ROWS, tensor_parallel=tp, refuse=False)
        if not schedule.plain and report is not None:
            logger.info("GEMM here: %s; the engine computes with %s", report.summary(), schedule.describe())
    elif isinstance(requested, tuple):
        schedule = gemm.GemmSchedule(*requested)
    else:
        schedule = gemm.GemmSchedule(int(requested))
    gemm.set_schedule(schedule)
    return schedule


def piecewise_compilation_config(config: dict | None = None) -> dict:
    """`compilation_config` for a piecewise engine (vLLM's CUDA default), as a dict for `vllm.LLM`.

    `mode=3` (`VLLM_COMPILE`); on vLLM-CPU also `compile_sizes=[]` (without it vLLM-CPU's piecewise
    backend asserts "Shape 4096 out of considered ranges"). Existing keys win.
    """
    out = dict(config or {})
    out.setdefault("mode", 3)
    if is_vllm_cpu():
        out.setdefault("compile_sizes", [])
    return out


def wants_piecewise(compilation_config) -> bool:
    """Whether a `compilation_config` (dict or `CompilationConfig`) explicitly asks for `VLLM_COMPILE`."""
    if compilation_config is None:
        return False
    mode = compilation_config.get("mode") if isinstance(compilation_config, dict) else getattr(compilation_config, "mode", None)
    return mode is not None and int(getattr(mode, "value", mode)) == 3


@contextlib.contextmanager
def engine_build_context(compilation_config):
    """Around a `vllm.LLM(...)` build: honour an explicit piecewise request on vLLM-CPU, and give the workers a
    TP > 1 engine spawns this process's weight-sync fix (see `_compat`)."""
    from .dispatch import vllm_cpu_piecewise, workers_weight_sync_fix

    piecewise = is_vllm_cpu() and wants_piecewise(compilation_config)
    with workers_weight_sync_fix(), (vllm_cpu_piecewise() if piecewise else contextlib.nullcontext()):
        yield


def close_llm(llm) -> None:
    """Shut an in-process `vllm.LLM` down now and free what it holds (KV cache, weights, graphs).

    Dropping the last reference is not enough: vLLM's engine core calls `gc.freeze()` when it starts,
    so the engine (and every object alive at that moment, a trainer included) stays in memory until
    the engine is shut down. This calls the engine core's shutdown (which also unfreezes the
    collector and tears down the torch.distributed state vLLM created) and collects. Safe to call
    twice; the `llm` must not be used afterwards.
    """
    import gc

    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is None or not hasattr(core, "shutdown"):
        raise TypeError(f"close_llm expects a vllm.LLM, got {type(llm).__name__}.")
    core.shutdown()
    gc.collect()


def close_colocated_engine(trainer) -> None:
    """`close_llm` for the engine a TRL `GRPOTrainer` built in colocate mode (any GRPOTrainer, ours or
    TRL's own); nothing in server mode or when it is already closed."""
    generation = getattr(trainer, "vllm_generation", None)
    llm = getattr(generation, "llm", None)
    if llm is not None:
        close_llm(llm)
        generation.llm = None
