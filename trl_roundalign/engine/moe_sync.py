"""Weight sync into vLLM-CPU's MoE experts: pack what arrives the way the kernel reads it.

vLLM-CPU's unquantized MoE kernel (`CPUUnquantizedExperts`, `cpu_fused_moe`, ISA "vec" on AVX2 and AVX-512, "amx"
on AMX) reads its expert weights `w13_weight` / `w2_weight` in a packed layout, made once after the model loads
(`process_weights_after_loading` -> `cpu_prepack_moe_weight`). vLLM-CPU 0.32 packs only on that first call: a weight
update (TRL's colocated sync, `model.load_weights`, or vLLM's layerwise reload behind the gloo server's
`update_weights`) writes the checkpoint layout into the packed parameters and the kernel reads it as packed.
Measured on the peaked tiny Qwen3-MoE (AVX2 kind): pushing the engine its own weights turns its greedy completion
into another one, and GRPO's first step compares the trainer with that engine at k3 7.08 under the exact profile
(0% of tokens bit-identical; docs/results/avx2/routing-replay.txt).

`install_moe_weight_sync_fix()` (the plugin's `register`, every vLLM process) hooks vLLM-CPU's model runner: the
loaded model's `load_weights` notes which packed expert parameters it wrote, and before the runner's next model
step each of them is packed again, in place, with vLLM's own packing op. Engines without such experts are untouched.
A layer whose intermediate size vLLM-CPU pads is refused at the first update (the padding's contents after an update
are not what the packing assumes; not measured here).
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

__all__ = ["install_moe_weight_sync_fix", "packed_experts"]

_STALE = "_roundalign_moe_stale"  # on the model runner: the packed expert parameters written since the last step
_LAYERS = "_roundalign_moe_layers"  # on the model runner: `packed_experts` of its model
_PACKED = ("w13_weight", "w2_weight")


def packed_experts(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, object]]:
    """`{module name: (layer, experts)}` of `model`'s MoE layers whose weights vLLM-CPU's kernel reads packed."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return {}
    out = {}
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and not getattr(experts, "_use_zentorch", False):
            out[name] = (module, experts)
    return out


def _repack(layer: torch.nn.Module, experts, params) -> None:
    from vllm._custom_ops import cpu_prepack_moe_weight

    config = experts.moe_config
    if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
        raise RuntimeError(
            f"Weight sync into vLLM-CPU's MoE experts: the intermediate size {config.intermediate_size_per_partition} "
            f"is padded to {experts._padded_intermediate_size(config)} by the kernel, and re-packing updated weights "
            "with padding is not supported (engine.moe_sync); the engine would compute with stale or garbled experts."
        )
    for name in params:
        param = getattr(layer, name)
        param.data.copy_(cpu_prepack_moe_weight(param.data, experts.isa))


def install_moe_weight_sync_fix() -> bool:
    """Hook vLLM-CPU's model runner (idempotent; False where it is not importable or not the platform)."""
    from .runner_hooks import hook_cpu_model_runner

    return hook_cpu_model_runner("moe_sync", after_load=_note_writes, before_step=_repack_written)


def _note_writes(runner) -> None:
    """Wrap the loaded model's `load_weights` to note the packed expert parameters each call writes."""
    layers = packed_experts(runner.model)
    if not layers:
        return
    stale = runner.__dict__[_STALE] = {}
    runner.__dict__[_LAYERS] = layers
    original = runner.model.load_weights

    @functools.wraps(original)
    def load_weights(weights, *a, **k):
        loaded = original(weights, *a, **k)
        names = set(loaded) if loaded is not None else {f"{n}.{p}" for n in layers for p in _PACKED}
        for full in names:
            module, _, param = full.rpartition(".")
            if param in _PACKED and module in layers:
                stale.setdefault(module, set()).add(param)
        return loaded

    runner.model.load_weights = load_weights


def _repack_written(runner, scheduler_output) -> None:
    stale = runner.__dict__.get(_STALE)
    if not stale:
        return
    layers = runner.__dict__[_LAYERS]
    for module, params in list(stale.items()):
        _repack(*layers[module], sorted(params))
    logger.debug("vLLM-CPU MoE weight sync: re-packed %d layers", len(stale))
    stale.clear()
