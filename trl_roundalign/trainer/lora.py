"""LoRA weight sync that leaves the frozen base weights untouched.

TRL 1.16 syncs a PEFT model to vLLM by `merge_adapter()`, reading the weights, then `unmerge_adapter()`.
PEFT merges and unmerges in place in the base dtype, so in bf16 a round trip is `r(r(W + d) - d)`, not `W`:
every sync moves the "frozen" base (and the reference model, which is the base with the adapter disabled).

`lossless_peft_params` yields what TRL's merge would send, computed out of place: for each LoRA layer the
merged weight `r(f(W) + f(d))` with PEFT's own `get_delta_weight` (the bits PEFT's in-place `W += d` gives),
one layer at a time, and the base weights are never written; with `lora_bias=True` the base bias is sent as
`r(b + s b_B)`, PEFT's merge of the adapter's bias. Vanilla LoRA only: variants (DoRA, ...), and an adapter bias on
a layer without a base bias (which PEFT cannot merge), are refused by `check_lossless_supported`.

`merged_lora_forward` makes the trainer compute what vLLM runs after that sync: `x @ r(W + ΔW)^T`, one
GEMM with the merged weight (materialised for one layer at a time, in the forward and again in the backward,
never kept), and the merged bias, instead of PEFT's `W x + s B(A x)`; gradients reach A and B (and B's bias)
through the merge (`_MergedLinear`).
"""

from __future__ import annotations

import types

import torch

from ..engine.gemm import linear, module_schedule

__all__ = [
    "check_lossless_supported",
    "install_lossless_peft_sync",
    "install_merged_lora_forward",
    "lossless_peft_params",
    "merged_lora_forward",
]


def _lora_layers(model):
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def check_lossless_supported(model) -> None:
    """Raise `ValueError` for adapters whose merge is not `W + get_delta_weight` (LoRA variants such as DoRA)."""
    for layer in _lora_layers(model):
        variants = getattr(layer, "lora_variant", {}) or {}
        if variants:
            named = ", ".join(f"adapter {a!r}: {type(v).__name__}" for a, v in sorted(variants.items()))
            raise ValueError(
                f"LoRA variant adapters ({named}) are not supported by trl-roundalign's lossless weight sync (their merge "
                "is not W + get_delta_weight); use plain LoRA (use_dora=False)."
            )
        if any((getattr(layer, "lora_bias", {}) or {}).values()) and getattr(layer.get_base_layer(), "bias", None) is None:
            raise ValueError(
                f"lora_bias=True on a {type(layer.get_base_layer()).__name__} without a bias: PEFT cannot merge the adapter's "
                "bias, so vLLM could never receive it. Use lora_bias=False, or target only layers that have a bias."
            )


def _active(layer) -> list[str]:
    """The layer's active adapters that are LoRA adapters (what PEFT's merge and forward use)."""
    return [a for a in layer.active_adapters if a in layer.lora_A]


def _merged_weight(layer, adapters: list[str]) -> torch.Tensor:
    """`r(W + ΔW)` of one LoRA layer, the bits PEFT's in-place merge writes, without writing them.

    Autocast is switched off: the trainer's forward runs inside accelerate's bf16 autocast, which would compute
    `get_delta_weight`'s `B @ A` as a bf16 matmul, while the weight sync (outside autocast) sends the fp32
    product; the two merged weights then differ and exact mode is no longer exact
    (scripts/lora_exact_diagnostic.py).
    """
    weight = layer.get_base_layer().weight
    with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
        return _merged(weight, [layer.get_delta_weight(a) for a in adapters])


def _bias_adapters(layer, adapters: list[str]) -> list[str]:
    """The adapters whose `lora_B` has a bias (`lora_bias=True`), which PEFT's merge adds into the base bias."""
    return [a for a in adapters if layer.lora_bias.get(a, False)]


def _merged_bias(layer, adapters: list[str]) -> torch.Tensor | None:
    """`r(b + s b_B)` of one LoRA layer, the bits PEFT's in-place merge writes into the base bias (`base.bias` when
    no adapter has a bias), without writing them; autocast off as in `_merged_weight`."""
    bias = getattr(layer.get_base_layer(), "bias", None)
    with_bias = _bias_adapters(layer, adapters)
    if bias is None or not with_bias:
        return bias
    with torch.no_grad(), torch.autocast(bias.device.type, enabled=False):
        return _merged(bias, [layer.lora_B[a].bias * layer.scaling[a] for a in with_bias])


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
        adapters = _active(layer)
        if not adapters:
            continue
        weight_deltas[id(base.weight)] = (layer, adapters)
        if _bias_adapters(layer, adapters) and getattr(base, "bias", None) is not None:
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
                    data = _merged_weight(*weight_deltas[id(param)])
                elif id(param) in bias_deltas:
                    data = _merged_bias(*bias_deltas[id(param)])
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
    vllm_generation._iter_named_params = types.MethodType(lossless_peft_params, vllm_generation)
    return True


# ----------------------------------------------------------------------------- merged-weight forward


class _MergedLinear(torch.autograd.Function):
    """`x @ r(W + ΔW)^T + r(b + Δb)` with `ΔW = s B A` and `Δb = s b_B` as PEFT merges them; gradients reach A, B
    and, with `lora_bias=True`, B's bias.

    The rounding of the merge is treated as the identity in the backward (the weight's gradient is the
    gradient of a linear layer, `dW = dy^T x`), then `dB = s dW A^T`, `dA = s B^T dW`, `db_B = s sum(dy)`, in fp32
    and without forming `dW`.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, layer, adapters, *lora_params):
        merged = _merged_weight(layer, adapters)
        # The merged weight is not saved: the backward recomputes it (the same bits: A, B and W do not change
        # between a forward and its backward), so no layer's merged copy outlives its own GEMM.
        ctx.save_for_backward(x, *lora_params)
        ctx.layer, ctx.adapters, ctx.has_bias = layer, adapters, bias is not None
        # The base layer's GEMM schedule (`trl_roundalign.engine.gemm`, set where the machine's GEMM is batch-variant).
        schedule = module_schedule(layer.get_base_layer())
        return linear(x, merged, _merged_bias(layer, adapters), schedule.block_rows, schedule.min_rows)

    @staticmethod
    def backward(ctx, dy):
        with torch.autocast(dy.device.type, enabled=False):  # the fp32 products below stay fp32
            return _MergedLinear._backward(ctx, dy)

    @staticmethod
    def _backward(ctx, dy):
        x, *lora_params = ctx.saved_tensors
        layer, adapters = ctx.layer, ctx.adapters
        merged = _merged_weight(layer, adapters)
        dx = dy @ merged
        dbias = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias else None
        # dA = s B^T dW and dB = s dW A^T with dW = dy^T x, computed without forming dW (a weight-sized GEMM):
        # dA = s (dy B)^T x, dB = s dy^T (x A^T), in fp32: tokens x r x (in + out) multiply-adds per adapter.
        dyf = dy.reshape(-1, dy.shape[-1]).float()
        xf = x.reshape(-1, x.shape[-1]).float()
        grads = []
        for i, a in enumerate(adapters):
            wa, wb = lora_params[2 * i], lora_params[2 * i + 1]
            s = layer.scaling[a]
            grads.append((s * ((dyf @ wb.float()).t() @ xf)).to(wa.dtype))  # dA [r, in]
            grads.append((s * (dyf.t() @ (xf @ wa.float().t()))).to(wb.dtype))  # dB [out, r]
        bias_params = lora_params[2 * len(adapters) :]
        if bias_params:
            dsum = dyf.sum(0)
            grads += [(layer.scaling[a] * dsum).to(bb.dtype) for a, bb in zip(_bias_adapters(layer, adapters), bias_params)]
        return (dx, None, dbias, None, None, *grads)


def merged_lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """PEFT LoRA `Linear.forward` computed with the merged weight vLLM receives (bound to a layer instance)."""
    base = self.get_base_layer()
    adapters = _active(self)
    if self.disable_adapters or self.merged or not adapters or kwargs.get("adapter_names") is not None:
        return type(self).forward(self, x, *args, **kwargs)
    if self.training:
        for a in adapters:
            p = getattr(self.lora_dropout[a], "p", 0.0)
            if p:
                raise ValueError(
                    f"lora_dropout={p}: the merged-weight LoRA forward cannot drop inputs of the adapter path alone. Set "
                    "lora_dropout=0 in the LoraConfig, or roundalign_lora_forward='peft' (the forward then differs from vLLM's)."
                )
    lora_params = []
    for a in adapters:
        lora_params += [self.lora_A[a].weight, self.lora_B[a].weight]
    lora_params += [self.lora_B[a].bias for a in _bias_adapters(self, adapters)]  # lora_bias=True
    x = x.to(base.weight.dtype)
    return _MergedLinear.apply(x, base.weight, base.bias, self, adapters, *lora_params)


def install_merged_lora_forward(model) -> int:
    """Bind `merged_lora_forward` to every PEFT LoRA `Linear` of `model`; returns how many layers."""
    from peft.tuners.lora import Linear as LoraLinear

    check_lossless_supported(model)
    n = 0
    for m in model.modules():
        if isinstance(m, LoraLinear):
            if getattr(m, "fan_in_fan_out", False):
                raise ValueError("fan_in_fan_out LoRA layers (Conv1D bases) are not supported by the merged LoRA forward.")
            m.forward = types.MethodType(merged_lora_forward, m)
            n += 1
    return n
