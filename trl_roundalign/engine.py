"""What we read from, and set on, the vLLM engine: mode, profile detection, compile caches.

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
import glob
import logging
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ._compat import (
    apply_vllm_cpu_weight_sync_fix,
    dispatched_block_rows,
    is_vllm_cpu,
    reset_dispatched_block_rows,
    vllm_cpu_weight_sync_fix_applied,
)
from .gpu_stacks import gpu_read_note, gpu_read_versions, gpu_version_refusal

logger = logging.getLogger(__name__)

__all__ = [
    "EngineInfo", "build_llm", "close_colocated_engine", "close_llm", "engine_cache_root", "engine_info",
    "fresh_rope_cache", "inductor_reduction_lanes", "EAGER_CPU_PROFILES", "EXACT_REFINEMENTS", "KNOWN_TORCH",
    "KNOWN_VLLM", "MEASURE_UNKNOWN_VLLM", "UnknownEngineConfiguration", "cpu_vector_isa", "exact_profile_for",
    "known_vllm", "piecewise_compilation_config", "profile_for_engine", "reduction_lanes_in", "scoped_cache_root",
    "set_offline_defaults",
]


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


def _default_cache_base() -> Path:
    return Path(os.environ.get("VLLM_CACHE_ROOT", Path.home() / ".cache" / "vllm"))


def engine_cache_root(tag: str = "", base: str | os.PathLike | None = None) -> Path:
    """A compile-cache folder for one engine patch state (`tag`), under `base` or `VLLM_CACHE_ROOT`.

    The folder name records whether the CPU weight-sync fix is active, so a fixed engine never
    loads a graph compiled without the fix (and the other way round).
    """
    fix = "wsfix" if (is_vllm_cpu() and vllm_cpu_weight_sync_fix_applied()) else "stock"
    name = f"roundalign-{fix}" + (f"-{tag}" if tag else "")
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
    gemm_block_rows: int | str | None = "auto",
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
        gemm_block_rows: how the engine's linears compute (`trl_roundalign.gemm`): `"auto"` measures this
            machine's GEMM for the model's shapes and uses the row-block schedule only where it is batch-variant
            (Intel AMX), an int sets it (0: plain `F.linear`), None keeps this process's setting. Recorded as
            `llm._roundalign_gemm_block_rows` and in `engine_info`; the training side computes the same way.
        **llm_kwargs: passed to `vllm.LLM` (e.g. `compilation_config`, `gpu_memory_utilization`).

    Returns:
        The `vllm.LLM`.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if is_vllm_cpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
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
    root = engine_cache_root("-".join(t for t in (tag, cache_tag) if t))
    if max_model_len is not None:
        llm_kwargs["max_model_len"] = max_model_len
    if weight_sync_fix and is_vllm_cpu() and gemm_block_rows is not None:
        _set_engine_block_rows(model, gemm_block_rows, llm_kwargs.get("max_num_batched_tokens"))
    reset_dispatched_block_rows()
    with scoped_cache_root(root), fresh_rope_cache(), engine_build_context(llm_kwargs.get("compilation_config")):
        llm = LLM(model=str(model), enforce_eager=enforce_eager, seed=seed, **llm_kwargs)
    llm._roundalign_cache_root = root
    rows = dispatched_block_rows()  # None where the linears were dispatched in worker processes (TP > 1)
    if rows is None and weight_sync_fix and is_vllm_cpu() and llm_kwargs.get("tensor_parallel_size", 1) > 1:
        rows = int(os.environ.get("ROUNDALIGN_GEMM_BLOCK_ROWS") or 0)  # the setting the workers inherited (gemm)
    llm._roundalign_gemm_block_rows = rows
    record_inductor_dir(llm)
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


def _set_engine_block_rows(model, requested: int | str, max_batched_tokens: int | None) -> int:
    """Decide and set (`gemm.set_block_rows`) the row-block size the engine about to be built computes with."""
    from . import gemm

    if requested != "auto":
        gemm.set_block_rows(int(requested))
        return int(requested)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model))
    rows_max = min(int(max_batched_tokens or AUTO_MEASURE_ROWS), AUTO_MEASURE_ROWS)
    try:
        rows, report = gemm.choose_block_rows(config, rows_max)
    except ValueError as e:
        logger.warning("%s The engine computes with plain F.linear; exact mode will not reproduce it.", e)
        rows = 0
    else:
        if rows:
            logger.info("GEMM here: %s; the engine computes in row blocks of %d", report.summary(), rows)
    gemm.set_block_rows(rows)
    return rows


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
    from ._compat import vllm_cpu_piecewise, workers_weight_sync_fix

    piecewise = is_vllm_cpu() and wants_piecewise(compilation_config)
    with workers_weight_sync_fix(), (vllm_cpu_piecewise() if piecewise else contextlib.nullcontext()):
        yield


def record_inductor_dir(llm) -> None:
    """Remember where Inductor wrote this engine's generated code (read later for the reduction lanes): the engine
    points `TORCHINDUCTOR_CACHE_DIR` at `<VLLM_CACHE_ROOT>/torch_compile_cache/torch_aot_compile/<hash>/inductor_cache`
    while it builds (a piecewise engine's `local_cache_dir` names another folder), in its worker processes at TP > 1."""
    path = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # at TP > 1 this process's may be inherited, from another engine
    if llm.llm_engine.vllm_config.parallel_config.world_size > 1:
        from .tp import worker_inductor_dir

        path = llm.collective_rpc(worker_inductor_dir)[0]
    if path and "torch_aot_compile" in path:
        llm._roundalign_inductor_dir = path


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


@dataclass
class EngineInfo:
    """Facts about a built engine that decide the rounding profile (read from its configuration)."""

    vllm_version: str
    platform: str
    compile_mode: str
    enforce_eager: bool
    custom_ops: list[str] = field(default_factory=list)
    cache_dir: str | None = None
    weight_sync_fix: bool = False
    backend: str = ""
    splitting_ops: list[str] = field(default_factory=list)
    use_inductor_graph_partition: bool = False
    ir_op_priority: dict[str, list[str]] = field(default_factory=dict)
    torch_version: str = ""
    inductor_dir: str | None = None
    cpu_isa: str | None = None
    # The engine's context length: it decides LongRoPE's factor set (long when above the original length).
    max_model_len: int | None = None
    # The row-block size its linears compute with (`trl_roundalign.gemm`; 0: plain F.linear; None: vLLM's own
    # kernels, or not known).
    gemm_block_rows: int | None = None
    # vLLM's model code: "auto"/"vllm" (its own modules, or its Transformers backend for a family it has no module
    # for), "transformers" (the Transformers backend asked for explicitly).
    model_impl: str = "auto"
    # Shards of every linear: a row-parallel layer sums partial products across them (an order no profile measures).
    tensor_parallel_size: int = 1

    @property
    def compiled(self) -> bool:
        return not self.enforce_eager and self.compile_mode not in ("NONE", "0", "CompilationMode.NONE")

    @property
    def piecewise(self) -> bool:
        """Compiled with the graph split at the attention ops (vLLM's CUDA default, `VLLM_COMPILE`)."""
        return (
            self.compiled
            and self.compile_mode == "VLLM_COMPILE"
            and not self.use_inductor_graph_partition
            and any("attention" in op for op in self.splitting_ops)
        )

    def as_dict(self) -> dict:
        d = asdict(self)
        d["compiled"] = self.compiled
        d["piecewise"] = self.piecewise
        return d


def _vllm_config(llm_or_config):
    if hasattr(llm_or_config, "llm_engine"):
        return llm_or_config.llm_engine.vllm_config
    if hasattr(llm_or_config, "compilation_config"):
        return llm_or_config
    raise TypeError(f"Expected a vllm.LLM or VllmConfig, got {type(llm_or_config).__name__}.")


def cpu_vector_isa() -> tuple[str, int] | None:
    """`(name, fp32 lanes per vector)` of the ISA Inductor's C++ backend compiles for in this process.

    Honours `torch._inductor.config.cpp.simdlen` (256 caps an AVX-512 machine to AVX2). None on a CPU
    where Inductor finds no vector ISA.
    """
    import torch
    from torch._inductor import cpu_vec_isa

    isa = cpu_vec_isa.pick_vec_isa()
    if not isa:
        return None
    return str(isa), int(isa.nelements(torch.float))


def engine_info(llm_or_config) -> EngineInfo:
    """Read what decides the rounding profile from a built engine (or its `VllmConfig`)."""
    import torch
    import vllm
    from vllm.platforms import current_platform

    cfg = _vllm_config(llm_or_config)
    cc = cfg.compilation_config
    mode = getattr(cc.mode, "name", str(cc.mode))
    priority = {}
    kernel_config = getattr(cfg, "kernel_config", None)
    prio = getattr(kernel_config, "ir_op_priority", None)
    if prio is not None:
        for name in ("rms_norm", "fused_add_rms_norm"):
            if hasattr(prio, name):
                priority[name] = list(getattr(prio, name))
    platform = "cpu" if current_platform.is_cpu() else ("cuda" if current_platform.is_cuda() else str(current_platform.device_type))
    isa = cpu_vector_isa() if platform == "cpu" else None
    return EngineInfo(
        vllm_version=vllm.__version__,
        platform=platform,
        compile_mode=mode,
        enforce_eager=bool(cfg.model_config.enforce_eager),
        custom_ops=list(cc.custom_ops or []),
        cache_dir=getattr(cc, "local_cache_dir", None) or None,
        weight_sync_fix=is_vllm_cpu() and vllm_cpu_weight_sync_fix_applied(),
        backend=str(getattr(cc, "backend", "") or ""),
        splitting_ops=list(cc.splitting_ops or []),
        use_inductor_graph_partition=bool(getattr(cc, "use_inductor_graph_partition", False)),
        ir_op_priority=priority,
        torch_version=torch.__version__,
        inductor_dir=getattr(llm_or_config, "_roundalign_inductor_dir", None),
        cpu_isa=isa[0] if isa else None,
        max_model_len=int(cfg.model_config.max_model_len),
        gemm_block_rows=getattr(llm_or_config, "_roundalign_gemm_block_rows", None),
        model_impl=str(getattr(cfg.model_config.model_impl, "value", cfg.model_config.model_impl) or "auto"),
        tensor_parallel_size=int(cfg.parallel_config.tensor_parallel_size),
    )


_REGION_CUSTOM_OPS = ("rms_norm", "silu_and_mul", "rotary_embedding")

# Configurations whose rounding was measured (docs/numerics.md), by vLLM minor version and torch minor
# version: anything else is refused by `profile_for_engine` rather than guessed.
# 0.32: what make setup installs (the suite on the Intel AMX machine, docs/stack.md); 0.31: make test-compat.
KNOWN_VLLM = ("0.31", "0.32")
KNOWN_TORCH = ("2.13", "2.11")
# Measurement only (docs/stack.md): `ROUNDALIGN_MEASURE_UNKNOWN_VLLM=0.32` admits that unmeasured vLLM minor version for
# one run, so that the evidence suite can run against it before it is known. Unset (the default), it is refused.
MEASURE_UNKNOWN_VLLM = "ROUNDALIGN_MEASURE_UNKNOWN_VLLM"


def known_vllm(platform: str = "cpu") -> tuple[str, ...]:
    """`KNOWN_VLLM`, the versions read for `platform` (`gpu_stacks`), the ones `ROUNDALIGN_MEASURE_UNKNOWN_VLLM` names."""
    return KNOWN_VLLM + gpu_read_versions("vllm", platform) + tuple(v.strip() for v in os.environ.get(MEASURE_UNKNOWN_VLLM, "").split(",") if v.strip())


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


class UnknownEngineConfiguration(ValueError):
    """The engine's configuration is not one whose rounding the project has measured."""


def profile_for_engine(info: EngineInfo, *, tensor_parallel: bool = False) -> str:
    """The rounding profile a built engine implies, from its configuration; never a guess.

    - compiled as one graph (vLLM-CPU's default, `DYNAMO_TRACE_ONCE`): `vllm-compiled`;
    - compiled piecewise, graph split at the attention ops (vLLM's CUDA default, `VLLM_COMPILE`):
      `vllm-compiled-piecewise`;
    - `enforce_eager=True` (or compilation off): `vllm-eager` on CUDA; on vLLM-CPU `vllm-eager-cpu`
      with its AVX512-BF16 kernel library, `vllm-eager-cpu-avx2` with its AVX2 one (`vllm_cpu_kernel_library`).

    A TP > 1 engine passes only with `tensor_parallel=True` (the caller computes its row-parallel linears with
    `trl_roundalign.tp.install_tp_linears`) and only where measured (`tp.tp_refusal`).

    Raises:
        UnknownEngineConfiguration: a configuration not measured (custom ops for the regions inside a
            compiled graph, a non-native IR op, Inductor graph partitioning, another compile backend,
            vLLM or torch version): the message names what differs and says to run `trl-roundalign probe`
            and pass the profile it reports.
    """

    def refuse(what: str):
        raise UnknownEngineConfiguration(
            f"This engine's {what}: no measured rounding profile describes it. Run `trl-roundalign probe` with the "
            "same engine settings and pass the profile it reports as roundalign_profile (or --profile)."
        )

    if _minor(info.vllm_version) not in known_vllm(info.platform):
        refuse(f"vLLM version is {info.vllm_version} (measured: {', '.join(KNOWN_VLLM)}{gpu_read_note('vllm', info.platform)})")
    if why := gpu_version_refusal(info):  # a CUDA release read for some engine kinds only
        refuse(why)
    if _minor(info.vllm_version) not in KNOWN_VLLM + gpu_read_versions("vllm", info.platform):
        logger.warning("vLLM %s admitted by %s for a measurement run only: it is not measured.", info.vllm_version,
                       MEASURE_UNKNOWN_VLLM)
    if info.tensor_parallel_size != 1:  # row-parallel linears sum the shards' partial products (trl_roundalign.tp)
        from .tp import tp_refusal

        lib = vllm_cpu_kernel_library() if info.platform == "cpu" else None
        if why := tp_refusal(info, aligned=tensor_parallel, library=lib):
            refuse(f"tensor parallel size is {info.tensor_parallel_size}: {why}")
    if not info.compiled:
        if info.platform != "cpu":
            return "vllm-eager"
        library = vllm_cpu_kernel_library()
        if library in EAGER_CPU_PROFILES:
            return EAGER_CPU_PROFILES[library]
        refuse(f"eager kernels come from vLLM-CPU's {library} library (measured: {', '.join(EAGER_CPU_PROFILES)})")
    if info.torch_version and _minor(info.torch_version) not in KNOWN_TORCH + gpu_read_versions("torch", info.platform):
        # Inductor's handling of explicit casts inside fused regions changed across 2026 torch releases.
        refuse(f"torch is {info.torch_version} (Inductor numerics measured with torch {', '.join(KNOWN_TORCH)}{gpu_read_note('torch', info.platform)})")
    on = [op for op in info.custom_ops if op.lstrip("+") in _REGION_CUSTOM_OPS and not op.startswith("-")]
    if "all" in info.custom_ops or on:
        refuse(f"compiled graph runs custom ops {info.custom_ops}")
    non_native = {k: v for k, v in info.ir_op_priority.items() if v and v[0] != "native"}
    if non_native:
        refuse(f"IR op priority is {non_native} (measured: native)")
    if info.backend and info.backend != "inductor":
        refuse(f"compile backend is {info.backend!r} (measured: inductor)")
    if info.use_inductor_graph_partition:
        refuse("compilation uses Inductor graph partitioning (use_inductor_graph_partition=True)")
    if info.compile_mode == "DYNAMO_TRACE_ONCE" or (info.compile_mode == "VLLM_COMPILE" and not info.splitting_ops):
        return "vllm-compiled"
    if info.piecewise:
        return "vllm-compiled-piecewise"
    refuse(f"compile mode is {info.compile_mode} with splitting ops {info.splitting_ops}")
    raise AssertionError("unreachable")


# vLLM-CPU's eager engine, by the kernel library it loads (measured ones only; docs/numerics.md).
EAGER_CPU_PROFILES = {"_C": "vllm-eager-cpu", "_C_AVX2": "vllm-eager-cpu-avx2"}
# The compiled profiles and their exact refinements.
EXACT_REFINEMENTS = {"vllm-compiled-exact": "vllm-compiled", "vllm-compiled-piecewise-exact": "vllm-compiled-piecewise"}


def vllm_cpu_kernel_library() -> str:
    """Which of vLLM-CPU's x86 kernel libraries this process loads (`CpuPlatform.import_kernels`' choice).

    `_C` (AVX-512 with BF16), `_C_AVX512` (AVX-512 without BF16) or `_C_AVX2`; `_C` elsewhere. The
    eager engine's C++ kernels (RoPE) convert fp32 to bf16 differently in each.
    """
    import torch
    from vllm.platforms import CpuArchEnum, current_platform

    if current_platform.get_cpu_architecture() != CpuArchEnum.X86:
        return "_C"
    if torch.cpu._is_avx512_supported():
        return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    return "_C_AVX2"


def exact_profile_for(profile: str) -> str:
    """The exact-mode refinement of a compiled profile (`vllm-compiled` -> `vllm-compiled-exact`)."""
    for exact, base in EXACT_REFINEMENTS.items():
        if profile in (exact, base):
            return exact
    raise ValueError(
        f"Exact mode reproduces vLLM-CPU's compiled engines (profiles vllm-compiled, vllm-compiled-piecewise); "
        f"{profile!r} has no exact refinement. Drop 'attention' from the regions."
    )


# ------------------------------------------------------------------------------------------------
# Reading Inductor's generated C++: the reduction order of every RMSNorm
# ------------------------------------------------------------------------------------------------

_KERNEL_RE = re.compile(r"^(cpp_fused_\w+) = async_compile\.cpp_pybinding\(\[.*?\], r'''(.*?)'''\)", re.S | re.M)
# A vector accumulator and the loop that feeds it: the loop's step is the number of fp32 lanes.
_ACC_LOOP_RE = re.compile(
    r"at::vec::(?:VectorizedN<float,(\d+)>|Vectorized<float>) tmp_acc\d+_vec = [^;]*;\s*"
    r"for\(int64_t (\w+)=[^;]*;[^;]*;\s*\2\+=static_cast<int64_t>\((\d+)L?\)\)"
)
_ACC_RE = re.compile(r"at::vec::(?:VectorizedN<float,\d+>|Vectorized<float>) tmp_acc\d+_vec =")
_CALL_RE = re.compile(r"^\s+(cpp_fused_\w+)\(", re.M)


def reduction_lanes_in(code: str, *, vector_floats: int | None = None) -> list[int]:
    """fp32 lanes of every vector reduction in one Inductor C++ source, in source order.

    The lane count is the step of the loop that feeds each vector accumulator (`VectorizedN<float,N>`
    advances `N` vectors per step), read from the code itself. With `vector_floats` (the machine's fp32
    lanes per vector) each step is checked to be `N * vector_floats`: code generated for another ISA
    (say, a compile cache from an AVX-512 machine read on an AVX2 one) raises `ValueError`.
    """
    found = _ACC_LOOP_RE.findall(code)
    if len(found) != len(_ACC_RE.findall(code)):
        raise ValueError(
            "An fp32 vector accumulator in Inductor's generated code is not followed by the loop that feeds it: this "
            "Inductor version writes reductions in a form trl_roundalign does not read (measured: torch 2.13)."
        )
    lanes = []
    for n, _, step in found:
        step, n = int(step), int(n or 1)
        if vector_floats is not None and step != n * vector_floats:
            raise ValueError(
                f"Inductor's code steps {step} fp32 lanes per iteration with {n} vector(s), but this machine's vectors "
                f"hold {vector_floats} floats: the code was generated for another CPU ISA. Rebuild the engine on this "
                "machine (clear its VLLM_CACHE_ROOT)."
            )
        lanes.append(step)
    return lanes


_ROTATE_HALF_RE = re.compile(r"^cpp_fused_\w*_cat_\w*_neg_\w*rsqrt", re.M)


# `torch.ops.roundalign.`: the linears in row blocks (`trl_roundalign.gemm`), where the machine's GEMM is
# batch-variant; a piecewise engine's pieces then hold no other GEMM or vLLM op (the attention is split out).
_GEMM_MARKERS = ("extern_kernels.mm(", "extern_kernels.addmm(", "torch.ops._C.", "torch.ops.vllm.", "torch.ops.roundalign.")


def _inductor_modules(inductor_dir: str | os.PathLike) -> list[str]:
    """The engine's generated model modules under its Inductor folder: C++ code with a norm (`rsqrt`) and a GEMM or a
    vLLM op. The GEMM excludes what other `torch.compile` calls of the same process wrote there while the folder was
    the current one (a probe's compiled regions: elementwise code only)."""
    files = glob.glob(os.path.join(str(inductor_dir), "**", "*.py"), recursive=True)
    out = []
    for f in files:
        text = Path(f).read_text(errors="ignore")
        if "async_compile.cpp_pybinding" in text and "rsqrt" in text and any(m in text for m in _GEMM_MARKERS):
            out.append(text)
    return out


def _module_lanes(src: str, vector_floats: int | None) -> list[int]:
    kernels = {m.group(1): reduction_lanes_in(m.group(2), vector_floats=vector_floats) for m in _KERNEL_RE.finditer(src)}
    lanes: list[int] = []
    for name in _CALL_RE.findall(src):
        lanes.extend(kernels.get(name, []))
    return lanes


def _inductor_dir_of(llm_or_dir) -> tuple[str, EngineInfo | None]:
    if isinstance(llm_or_dir, (str, os.PathLike)):
        return str(llm_or_dir), None
    info = engine_info(llm_or_dir)
    if not info.compiled:
        raise ValueError("This engine has no compiled graph: it is not compiled (enforce_eager?).")
    path = info.inductor_dir or info.cache_dir
    if not path:
        raise ValueError("This engine's compile cache is unknown: build it with trl_roundalign.engine.build_llm.")
    return path, info


def inductor_reduction_lanes(llm_or_cache_dir, *, num_layers: int | None = None) -> list[int]:
    """Lane count of every RMSNorm reduction the engine's compiled model runs, in forward order.

    Read from the C++ Inductor generated for this engine (its compile cache), checked against this
    machine's vector width. For the decoder models we patch each reduction is one RMSNorm (input norm,
    Qwen3's q/k norms, post-attention norm, ..., final norm), in the order the forward runs them.

    - One-graph engine (vLLM-CPU default): the model is the largest generated module.
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
    isa = cpu_vector_isa()
    vector_floats = isa[1] if isa else None
    modules = _inductor_modules(path)
    if not modules:
        raise FileNotFoundError(
            f"No Inductor C++ model graph found under {path}: the engine is not compiled with Inductor's C++ backend "
            "(the exact reduction order is read from vLLM-CPU's compile cache)."
        )
    piecewise = info.piecewise if info is not None else len(modules) > 1 and num_layers is not None
    if not piecewise:
        return _module_lanes(max(modules, key=len), vector_floats)
    if num_layers is None:
        num_layers = int(llm_or_cache_dir.llm_engine.model_config.hf_config.num_hidden_layers)
    # The middle pieces hold the next layer's RoPE: an index into the cos/sin cache (native models), or, for a model
    # run through vLLM's Transformers backend (OLMo 2), `rotate_half`'s negation fused into the q/k-norm kernel.
    first = [m for m in modules if "embedding" in m]
    middle = [m for m in modules if "embedding" not in m and ("index_select" in m or _ROTATE_HALF_RE.search(m))]
    last = [m for m in modules if "embedding" not in m and m not in middle]
    if len(first) != 1 or len(last) != 1 or (num_layers > 1 and not middle):
        raise ValueError(
            f"Piecewise compile cache under {path}: expected one first piece (embedding), one last piece and shared "
            f"middle pieces; found {len(first)}, {len(last)} and {len(middle)}. Use a fresh VLLM_CACHE_ROOT per engine."
        )
    middle_lanes = {tuple(_module_lanes(m, vector_floats)) for m in middle}
    if len(middle_lanes) > 1:
        raise ValueError(
            f"Piecewise compile cache under {path}: the middle pieces reduce in different orders {sorted(middle_lanes)}; "
            "their order in the forward cannot be read from the cache."
        )
    mid = list(next(iter(middle_lanes))) if middle_lanes else []
    return _module_lanes(first[0], vector_floats) + mid * (num_layers - 1) + _module_lanes(last[0], vector_floats)
