"""LoRA weight sync that leaves the frozen base weights untouched.

TRL 1.16 syncs a PEFT model to vLLM by `merge_adapter()`, reading the weights, then `unmerge_adapter()`.
PEFT merges and unmerges in place in the base dtype, so in bf16 a round trip is `r(r(W + d) - d)`, not `W`:
every sync moves the "frozen" base (and the reference model, which is the base with the adapter disabled).

`lossless_peft_params` yields what TRL's merge would send, computed out of place: for each LoRA layer the
merged weight `r(f(W) + f(d))` with PEFT's own `get_delta_weight` (the bits PEFT's in-place `W += d` gives),
one layer at a time, and the base weights are never written. Vanilla LoRA only: variants (DoRA, ...) are
refused by `check_lossless_supported`.
"""

from __future__ import annotations

import types

import torch

__all__ = ["check_lossless_supported", "install_lossless_peft_sync", "lossless_peft_params"]


def _lora_layers(model):
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def check_lossless_supported(model) -> None:
    """Raise `ValueError` for adapters whose merge is not `W + get_delta_weight` (LoRA variants such as DoRA)."""
    for layer in _lora_layers(model):
        variants = sorted(getattr(layer, "lora_variant", {}) or {})
        if variants:
            raise ValueError(
                f"LoRA variant adapters ({', '.join(variants)}: e.g. DoRA) are not supported by trl-roundalign's lossless "
                "weight sync; use plain LoRA (use_dora=False)."
            )


def _merged(data: torch.Tensor, deltas: list[torch.Tensor]) -> torch.Tensor:
    """`data` with each delta added as PEFT's in-place `+=` adds it: in fp32, rounded once per adapter."""
    for d in deltas:
        data = (data.float() + d.float()).to(data.dtype)
    return data


def lossless_peft_params(vllm_generation):
    """`(vLLM name, tensor)` pairs of the merged model, as TRL's PEFT branch yields them, base weights untouched."""
    model = vllm_generation.model
    weight_deltas: dict[int, tuple] = {}
    bias_deltas: dict[int, tuple] = {}
    for layer in _lora_layers(model):
        if layer.disable_adapters or layer.merged:
            continue
        base = layer.get_base_layer()
        adapters = [a for a in layer.active_adapters if a in layer.lora_A]
        if not adapters:
            continue
        weight_deltas[id(base.weight)] = (layer, adapters)
        if any(layer.lora_bias.get(a, False) for a in adapters) and getattr(base, "bias", None) is not None:
            bias_deltas[id(base.bias)] = (layer, adapters)
    with vllm_generation._dist.gather_params(list(model.parameters())):
        for name, param in model.named_parameters():
            name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            if model.prefix in name or "original_module" in name:
                continue
            name = vllm_generation._fix_param_name_to_vllm(name, extra_prefixes=["modules_to_save.default."])
            data = param.data
            with torch.no_grad():
                if id(param) in weight_deltas:
                    layer, adapters = weight_deltas[id(param)]
                    data = _merged(data, [layer.get_delta_weight(a) for a in adapters])
                elif id(param) in bias_deltas:
                    layer, adapters = bias_deltas[id(param)]
                    deltas = [layer.lora_B[a].bias * layer.scaling[a] for a in adapters if layer.lora_bias.get(a, False)]
                    data = _merged(data, deltas)
            yield name, data


def install_lossless_peft_sync(vllm_generation) -> bool:
    """Replace TRL's merge/unmerge PEFT sync on this `VLLMGeneration` with `lossless_peft_params`.

    Returns False (and changes nothing) when the model is not a PEFT model or runs under FSDP, where TRL's
    own traversal is kept.
    """
    from accelerate.utils import is_peft_model

    model = vllm_generation.model
    if not is_peft_model(model) or vllm_generation._dist.is_fsdp:
        return False
    check_lossless_supported(model)
    vllm_generation._iter_named_params = types.MethodType(lambda self: lossless_peft_params(self), vllm_generation)
    return True
