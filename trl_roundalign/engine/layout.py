"""What the engine is: the facts of a built vLLM engine that decide how the policy must compute.

`EngineInfo` holds them; `engine_info` reads them from a built engine (or its `VllmConfig`). `cpu_vector_isa` and
`vllm_cpu_kernel_library` name what this process's CPU code runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .dispatch import is_vllm_cpu, vllm_cpu_weight_sync_fix_applied


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
    # The row-block size its linears compute with (`trl_roundalign.engine.gemm`; 0: plain F.linear; None: vLLM's own
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
