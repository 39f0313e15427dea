"""What we read from, and set on, the vLLM engine: mode, profile detection, compile caches.

The engine facts flow into the profile choice once, at start:

- `build_llm`: an in-process `vllm.LLM` in bf16 with the CPU weight-sync fix and its own compile
  cache (vLLM's compile cache keys do not notice monkeypatches of its Python code, so an engine
  built with the fix must not reuse a graph compiled without it, and vice versa).
- `engine_info` / `profile_for_engine`: version, platform, compile mode, custom ops and
  `enforce_eager` of a built engine, and the rounding profile that engine implies.
- `inductor_reduction_lanes`: the lane count of every RMSNorm reduction in the engine's compiled
  graph, read from the C++ that Inductor wrote into the compile cache (ROUNDING.md: "read it,
  don't guess").
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ._compat import apply_vllm_cpu_weight_sync_fix, is_vllm_cpu, vllm_cpu_weight_sync_fix_applied

logger = logging.getLogger(__name__)

__all__ = [
    "EngineInfo",
    "build_llm",
    "close_colocated_engine",
    "close_llm",
    "engine_cache_root",
    "engine_info",
    "fresh_rope_cache",
    "inductor_reduction_lanes",
    "profile_for_engine",
    "scoped_cache_root",
    "set_offline_defaults",
]


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
    tag = "eager" if enforce_eager else "compiled"
    root = engine_cache_root("-".join(t for t in (tag, cache_tag) if t))
    if max_model_len is not None:
        llm_kwargs["max_model_len"] = max_model_len
    with scoped_cache_root(root), fresh_rope_cache():
        llm = LLM(model=str(model), enforce_eager=enforce_eager, seed=seed, **llm_kwargs)
    llm._roundalign_cache_root = root
    return llm


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
    """Facts about a built engine that decide the rounding profile."""

    vllm_version: str
    platform: str
    compile_mode: str
    enforce_eager: bool
    custom_ops: list[str] = field(default_factory=list)
    cache_dir: str | None = None
    weight_sync_fix: bool = False

    @property
    def compiled(self) -> bool:
        return not self.enforce_eager and self.compile_mode not in ("NONE", "0", "CompilationMode.NONE")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["compiled"] = self.compiled
        return d


def _vllm_config(llm_or_config):
    if hasattr(llm_or_config, "llm_engine"):
        return llm_or_config.llm_engine.vllm_config
    if hasattr(llm_or_config, "compilation_config"):
        return llm_or_config
    raise TypeError(f"Expected a vllm.LLM or VllmConfig, got {type(llm_or_config).__name__}.")


def engine_info(llm_or_config) -> EngineInfo:
    """Read version, platform, compile mode, custom ops and `enforce_eager` from a built engine."""
    import vllm
    from vllm.platforms import current_platform

    cfg = _vllm_config(llm_or_config)
    cc = cfg.compilation_config
    mode = getattr(cc.mode, "name", str(cc.mode))
    return EngineInfo(
        vllm_version=vllm.__version__,
        platform="cpu" if current_platform.is_cpu() else ("cuda" if current_platform.is_cuda() else str(current_platform.device_type)),
        compile_mode=mode,
        enforce_eager=bool(cfg.model_config.enforce_eager),
        custom_ops=list(cc.custom_ops or []),
        cache_dir=getattr(cc, "local_cache_dir", None) or None,
        weight_sync_fix=is_vllm_cpu() and vllm_cpu_weight_sync_fix_applied(),
    )


_REGION_CUSTOM_OPS = ("rms_norm", "silu_and_mul", "rotary_embedding")


def profile_for_engine(info: EngineInfo) -> str:
    """The rounding profile a built engine implies.

    - compiled (vLLM V1 default, custom ops off): `vllm-compiled`;
    - `enforce_eager=True` (or compilation off): `vllm-eager-cpu` on CPU, `vllm-eager` on CUDA.

    Raises:
        ValueError: a compiled engine with the regions' custom ops switched on: that mix of
            fused and custom kernels is not one profile; run `trl-roundalign probe` with those
            settings and pass the profile it reports.
    """
    if not info.compiled:
        return "vllm-eager-cpu" if info.platform == "cpu" else "vllm-eager"
    on = [op for op in info.custom_ops if op.lstrip("+") in _REGION_CUSTOM_OPS and not op.startswith("-")]
    if "all" in info.custom_ops or on:
        raise ValueError(
            f"This engine compiles the model but runs custom ops {info.custom_ops}: no single profile "
            "describes that mix. Run `trl-roundalign probe` for this engine configuration and pass the "
            "profile it reports explicitly."
        )
    return "vllm-compiled"


_KERNEL_RE = re.compile(r"^(cpp_fused_\w+) = async_compile\.cpp_pybinding\(\[.*?\], r'''(.*?)'''\)", re.S | re.M)
_ACC_RE = re.compile(r"at::vec::(Vectorized|VectorizedN)<float(?:,(\d+))?> tmp_acc\d+_vec =")
_CALL_RE = re.compile(r"^\s+(cpp_fused_\w+)\(", re.M)


def _graph_source(cache_dir: str | os.PathLike) -> str:
    files = glob.glob(os.path.join(str(cache_dir), "**", "*.py"), recursive=True)
    graphs = [f for f in files if "async_compile.cpp_pybinding" in Path(f).read_text(errors="ignore")]
    if not graphs:
        raise FileNotFoundError(
            f"No Inductor C++ graph found under {cache_dir}: the engine is not compiled with Inductor's "
            "C++ backend (exact reduction order is read from vLLM-CPU's compile cache)."
        )
    # The model graph is the largest generated module (warm-up helpers are small).
    return Path(max(graphs, key=os.path.getsize)).read_text()


def inductor_reduction_lanes(llm_or_cache_dir, *, vector_lanes: int = 16) -> list[int]:
    """Lane count of every fp32 vector reduction in the engine's compiled model graph, in call order.

    For the decoder models we patch, each reduction is one RMSNorm (input norm, Qwen3's q/k norms,
    post-attention norm, ..., final norm), in the order the forward runs them.

    Args:
        llm_or_cache_dir: a built compiled `vllm.LLM` or its `local_cache_dir`.
        vector_lanes: fp32 lanes of one `at::vec::Vectorized<float>` (16 with AVX-512).
    """
    if isinstance(llm_or_cache_dir, (str, os.PathLike)):
        cache_dir = llm_or_cache_dir
    else:
        cache_dir = engine_info(llm_or_cache_dir).cache_dir
        if not cache_dir:
            raise ValueError("This engine has no compile cache: it is not compiled (enforce_eager?).")
    src = _graph_source(cache_dir)
    kernels = {}
    for m in _KERNEL_RE.finditer(src):
        kernels[m.group(1)] = [vector_lanes * int(n or 1) for _, n in _ACC_RE.findall(m.group(2))]
    lanes: list[int] = []
    for name in _CALL_RE.findall(src):
        lanes.extend(kernels.get(name, []))
    return lanes


def file_digest(path: str | os.PathLike) -> str:
    """Short sha1 of a file (used in run records)."""
    h = hashlib.sha1()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:12]
