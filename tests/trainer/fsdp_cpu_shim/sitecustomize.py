"""Test-only shim: accelerate's FSDP (and DeepSpeed) paths on a CPU machine, for processes that put this folder on
their PYTHONPATH (`tests/trainer/test_fsdp2_grpo.py` does, for the processes `accelerate launch` starts). It is not
part of the package and nothing in `trl_roundalign` imports it.

Why: accelerate 1.15's `AcceleratorState.__init__` turns `ACCELERATE_USE_FSDP=true` into
`DistributedType.FSDP` only when the process's distributed type is GPU-class (MULTI_GPU, MULTI_NPU, MULTI_XPU, ...).
On a machine without CUDA, torch.distributed.run's processes are MULTI_CPU (gloo), so
`accelerate launch --config_file recipes/accelerate_configs/fsdp2.yaml` silently trains as DDP. torch's `fully_shard`
itself runs on CPU with gloo; the gate is that one list.

What it changes, and only when `ACCELERATE_USE_FSDP=true` in the environment: once `accelerate.state` is imported,
`AcceleratorState.__init__` is wrapped; after accelerate's own initialisation, if that initialisation was the first
one (not a re-entry on the shared state) and the distributed type is MULTI_CPU, it does what accelerate's FSDP branch
does for the GPU-class types: distributed type FSDP (also in `PartialState`'s shared state), the plugin's mixed
precision set from accelerate's, `fsdp_plugin` stored. Everything after that (`fsdp2_prepare_model`, the fp32 upcast,
`fully_shard` per layer, the mixed-precision policy, sharded state dicts, TRL's FSDP2 weight sync) is accelerate's,
torch's and TRL's unchanged code.

With `ROUNDALIGN_SHIM_DS=1` and `ACCELERATE_USE_DEEPSPEED=true` it does the same for DeepSpeed (accelerate's branch
is `... and not cpu`, and `PartialState` only initialises DeepSpeed's communication when not on CPU): distributed type
DEEPSPEED with the plugin selected, as accelerate does on GPUs. DeepSpeed itself must then run on CPU
(`DS_ACCELERATOR=cpu`).

The same holds when the plugin comes from the trainer's own arguments instead of the launcher's environment
(`TrainingArguments.fsdp`/`fsdp_config`: transformers passes `fsdp_plugin` to `Accelerator`; `TrainingArguments.deepspeed`:
`deepspeed_plugin`): with `ROUNDALIGN_SHIM=1` the wrap is installed and a plugin argument selects the branch, as it
does in accelerate's own test of the GPU-class types.

The wrap is installed by an import hook, so a process that never imports accelerate (the launcher's own children
that do not train) pays nothing, and nothing changes in a process without those variables.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys


def _env(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("true", "1")


_ARGS = os.environ.get("ROUNDALIGN_SHIM") == "1"  # plugins from TrainingArguments (fsdp / deepspeed)
_FSDP = _env("ACCELERATE_USE_FSDP")
_DS = os.environ.get("ROUNDALIGN_SHIM_DS") == "1" and (_ARGS or _env("ACCELERATE_USE_DEEPSPEED"))


def _patch(state) -> None:
    import inspect

    AcceleratorState, PartialState, DistributedType = state.AcceleratorState, state.PartialState, state.DistributedType
    original = AcceleratorState.__init__
    signature = inspect.signature(original)

    def __init__(self, *args, **kwargs):
        fresh = not AcceleratorState._shared_state or AcceleratorState._shared_state == PartialState._shared_state
        original(self, *args, **kwargs)
        if not fresh or self.distributed_type != DistributedType.MULTI_CPU:
            return
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        # Read when accelerate reads them: transformers sets ACCELERATE_USE_DEEPSPEED for the state it builds itself.
        fsdp = _env("ACCELERATE_USE_FSDP") or (_ARGS and bound.arguments["fsdp_plugin"] is not None)
        ds = _DS and (_env("ACCELERATE_USE_DEEPSPEED") or bound.arguments["deepspeed_plugin"] is not None)
        if fsdp:
            fsdp_plugin = bound.arguments["fsdp_plugin"]
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no" and fsdp_plugin is not None:
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
        elif ds:
            plugin = bound.arguments["deepspeed_plugin"]
            mixed_precision = self._mixed_precision  # accelerate's resolved value (argument, else environment)
            self.distributed_type = DistributedType.DEEPSPEED
            plugins = plugin.values() if isinstance(plugin, dict) else [plugin]
            for p in plugins:
                p.set_mixed_precision(mixed_precision)
            next(iter(plugins)).select(_from_accelerator_state=True)
            self.deepspeed_plugins = plugin
            self._mixed_precision = "no"  # as accelerate's DeepSpeed branch: DeepSpeed's config owns mixed precision
        else:
            return
        PartialState._shared_state["distributed_type"] = self.distributed_type

    AcceleratorState.__init__ = __init__
    AcceleratorState._roundalign_cpu_shim = True


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "accelerate.state":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if _FSDP or _DS or _ARGS:
    sys.meta_path.insert(0, _Hook())
