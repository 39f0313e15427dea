"""Running a region's engine code as the engine runs it: under the engine's vLLM config and IR op
priority, compiled with `torch.compile` (Inductor, the engine's Inductor options, a dynamic token
dimension) when the engine compiles, eagerly otherwise."""

from __future__ import annotations

import contextlib

import torch

from .cases import Case
from .modules import engine_device


def is_compiled(vllm_config) -> bool:
    from vllm.config import CompilationMode

    if vllm_config.model_config is not None and vllm_config.model_config.enforce_eager:
        return False
    return vllm_config.compilation_config.mode != CompilationMode.NONE


def inductor_options(vllm_config) -> dict:
    """The engine's Inductor options that torch's Inductor config knows (plain values only)."""
    import torch._inductor.config as inductor_config

    out = {}
    for key, value in (vllm_config.compilation_config.inductor_compile_config or {}).items():
        if not isinstance(value, (bool, int, float, str)):
            continue
        obj = inductor_config
        parts = key.split(".")
        for p in parts[:-1]:
            obj = getattr(obj, p, None)
        if obj is not None and hasattr(obj, parts[-1]):
            out[key] = value
    return out


@contextlib.contextmanager
def _engine_context(vllm_config, compiled: bool):
    """vLLM's config, IR op priority and torch-wrap setting as the engine's forward sees them.

    Under compile, vLLM IR ops are always inlined (torch wrap off): that is what vLLM's IR lowering
    pass does inside the engine's graph when the wrap is on.
    """
    from vllm import ir
    from vllm.config import set_current_vllm_config

    wrap = bool(vllm_config.compilation_config.ir_enable_torch_wrap) and not compiled
    with contextlib.ExitStack() as stack:
        stack.enter_context(set_current_vllm_config(vllm_config))
        stack.enter_context(vllm_config.kernel_config.ir_op_priority.set_priority())
        stack.enter_context(ir.enable_torch_wrap(wrap))
        yield


def run_engine_case(case: Case, vllm_config, compiled: bool) -> dict[str, torch.Tensor]:
    device = engine_device()
    inputs = tuple(t.to(device).clone() for t in case.inputs)
    with _engine_context(vllm_config, compiled), torch.no_grad():
        if not compiled:
            out = case.engine_fn(*inputs)
        else:
            backend = vllm_config.compilation_config.backend or "inductor"
            if backend not in ("inductor", "eager", "aot_eager"):
                backend = "inductor"
            options = inductor_options(vllm_config) if backend == "inductor" else None
            fn = torch.compile(case.engine_fn, backend=backend, options=options, fullgraph=False)
            for i in case.dynamic:
                torch._dynamo.mark_dynamic(inputs[i], 0)
            out = fn(*inputs)
    return {k: v.detach().cpu() for k, v in out.items()}
