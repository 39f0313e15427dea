"""The rounding profile a built engine implies, from its configuration (`profile_for_engine`); never a guess.

Configurations nobody measured raise `UnknownEngineConfiguration` with one line naming what differs.
"""

from __future__ import annotations

import logging
import os

from ..gpu_stacks import gpu_read_note, gpu_read_versions, gpu_refusal_note, gpu_version_refusal
from .layout import EngineInfo, vllm_cpu_kernel_library

logger = logging.getLogger(__name__)


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
    `trl_roundalign.engine.tp.install_tp_linears`) and only where measured (`tp.tp_refusal`).

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
        refuse(f"vLLM version is {info.vllm_version} (measured: {', '.join(KNOWN_VLLM)}{gpu_read_note('vllm', info.platform)}"
               f"{gpu_refusal_note('vllm', info.vllm_version, info.platform)})")
    if why := gpu_version_refusal(info):  # a CUDA release read for some engine kinds only
        refuse(why)
    if _minor(info.vllm_version) not in KNOWN_VLLM + gpu_read_versions("vllm", info.platform):
        logger.warning("vLLM %s admitted by %s for a measurement run only: it is not measured.", info.vllm_version,
                       MEASURE_UNKNOWN_VLLM)
    if info.tensor_parallel_size != 1:  # row-parallel linears sum the shards' partial products (trl_roundalign.engine.tp)
        from .tp import tp_refusal

        lib = (info.kernel_library or vllm_cpu_kernel_library()) if info.platform == "cpu" else None
        if why := tp_refusal(info, aligned=tensor_parallel, library=lib):
            refuse(f"tensor parallel size is {info.tensor_parallel_size}: {why}")
    if not info.compiled:
        if info.platform != "cpu":
            return "vllm-eager"
        library = info.kernel_library or vllm_cpu_kernel_library()  # the engine's own processes, where it reports them
        if library in EAGER_CPU_PROFILES:
            return EAGER_CPU_PROFILES[library]
        refuse(f"eager kernels come from vLLM-CPU's {library} library (measured: {', '.join(EAGER_CPU_PROFILES)})")
    if info.torch_version and _minor(info.torch_version) not in KNOWN_TORCH + gpu_read_versions("torch", info.platform):
        # Inductor's handling of explicit casts inside fused regions changed across 2026 torch releases.
        refuse(f"torch is {info.torch_version} (Inductor numerics measured with torch {', '.join(KNOWN_TORCH)}{gpu_read_note('torch', info.platform)}"
               f"{gpu_refusal_note('torch', info.torch_version, info.platform)})")
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



def exact_profile_for(profile: str) -> str:
    """The exact-mode refinement of a compiled profile (`vllm-compiled` -> `vllm-compiled-exact`)."""
    for exact, base in EXACT_REFINEMENTS.items():
        if profile in (exact, base):
            return exact
    raise ValueError(
        f"Exact mode reproduces vLLM-CPU's compiled engines (profiles vllm-compiled, vllm-compiled-piecewise); "
        f"{profile!r} has no exact refinement. Drop 'attention' from the regions."
    )
