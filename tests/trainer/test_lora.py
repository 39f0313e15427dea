"""The merged-weight LoRA forward (`trl_roundalign.trainer.lora`): the bits of PEFT's merge, and gradients to A and B."""

from __future__ import annotations

import contextlib
import copy
import types

import peft  # pinned by make setup: a broken install fails here, never skips LoRA coverage
import pytest
import torch

from trl_roundalign.trainer.lora import install_merged_lora_forward, lossless_peft_params


def _lora_mlp(seed: int = 0, dropout: float = 0.0):
    torch.manual_seed(seed)
    base = torch.nn.Sequential()
    base.add_module("up", torch.nn.Linear(48, 80, bias=True))
    base.add_module("act", torch.nn.Tanh())
    base.add_module("down", torch.nn.Linear(80, 32, bias=False))
    base = base.to(torch.bfloat16)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["up", "down"], lora_dropout=dropout))
    for name, p in model.named_parameters():  # B = 0 at init: make the adapter non-trivial
        if "lora_" in name:
            torch.nn.init.normal_(p, std=0.3)
    return model


def test_merged_forward_multiplies_by_the_weight_peft_merges():
    model = _lora_mlp()
    x = torch.randn(5, 7, 48).to(torch.bfloat16)
    with model.disable_adapter():
        base_out = model(x)
    merged_copy = copy.deepcopy(model)
    merged_copy.merge_adapter()  # what TRL's sync hands vLLM (and the lossless sync reproduces)
    want = merged_copy(x)
    peft_out = model(x)
    assert install_merged_lora_forward(model) == 2
    got = model(x)
    assert torch.equal(got, want), "the merged forward must compute with exactly the merged bf16 weights"
    assert not torch.equal(peft_out, want), "PEFT's W x + s B(A x) differs from the merged GEMM (else no test)"
    with model.disable_adapter():  # the reference model's path: the base weights alone
        assert torch.equal(model(x), base_out)


def test_merged_forward_gradients_against_fp64():
    model = _lora_mlp(1)
    install_merged_lora_forward(model)
    x = torch.randn(3, 6, 48).to(torch.bfloat16)
    w = torch.randn(3, 6, 32)
    (model(x).float() * w).sum().backward()
    got = {n: p.grad.double() for n, p in model.named_parameters() if p.requires_grad}

    # fp64 reference of the same function with the merge's rounding taken as the identity (straight-through).
    ref = {}
    params = {n: p.detach().double().requires_grad_(p.requires_grad) for n, p in model.named_parameters()}

    def lin(name, h):
        a, b = params[f"base_model.model.{name}.lora_A.default.weight"], params[f"base_model.model.{name}.lora_B.default.weight"]
        wt = params[f"base_model.model.{name}.base_layer.weight"] + 2.0 * (b @ a)
        bias = params.get(f"base_model.model.{name}.base_layer.bias")
        return torch.nn.functional.linear(h, wt, bias)

    h = torch.tanh(lin("up", x.double()))
    (lin("down", h) * w.double()).sum().backward()
    ref = {n: p.grad for n, p in params.items() if p.grad is not None and "lora_" in n}
    assert set(ref) == set(got)
    for n in ref:
        err = (got[n] - ref[n]).abs().max() / ref[n].abs().max()
        assert err < 2e-2, (n, float(err))  # bf16 activations and weights in the forward, fp32 gradient products


def test_merged_forward_refuses_lora_dropout_in_training():
    model = _lora_mlp(dropout=0.1)
    install_merged_lora_forward(model)
    model.train()
    with pytest.raises(ValueError, match="lora_dropout"):
        model(torch.randn(2, 48).to(torch.bfloat16))
    model.eval()
    model(torch.randn(2, 48).to(torch.bfloat16))  # dropout is inactive in eval: allowed


def _lora_bias_linear(base_bias: bool = True):
    torch.manual_seed(3)
    base = torch.nn.Sequential()
    base.add_module("up", torch.nn.Linear(16, 8, bias=base_bias))
    model = peft.get_peft_model(base.to(torch.bfloat16), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["up"], lora_bias=True))
    layer = model.base_model.model.up
    with torch.no_grad():
        torch.nn.init.normal_(layer.lora_A["default"].weight, std=0.3)
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.3)
        layer.lora_B["default"].bias.fill_(1.0)  # s = 2: PEFT's output (and vLLM's bias after the sync) moves by 2
    return model, layer


def test_merged_forward_includes_and_trains_the_lora_bias():
    """lora_bias=True: the sync sends vLLM r(b + s b_B); the merged forward must add the same bias, and the adapter
    bias must get its gradient s * sum(dy)."""
    model, layer = _lora_bias_linear()
    x = torch.randn(5, 16).to(torch.bfloat16)
    merged_copy = copy.deepcopy(model)
    merged_copy.merge_adapter()
    want = merged_copy(x)
    stub = types.SimpleNamespace(
        model=model,
        _dist=types.SimpleNamespace(gather_params=lambda params: contextlib.nullcontext()),
        _fix_param_name_to_vllm=lambda name, extra_prefixes=None: name,
    )
    sent = dict(lossless_peft_params(stub))
    assert torch.equal(sent["up.bias"], merged_copy.base_model.model.up.base_layer.bias), "the sync's merged bias"
    dy = torch.randn(5, 8)
    peft_out = model(x)
    (peft_out.float() * dy).sum().backward()
    peft_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)

    install_merged_lora_forward(model)
    got = model(x)
    assert torch.equal(got, want), f"off by {(got.float() - want.float()).abs().max().item():.3g}: the adapter bias is missing"
    (got.float() * dy).sum().backward()
    bias = layer.lora_B["default"].bias
    assert bias.grad is not None, "the adapter bias must train"
    s = layer.scaling["default"]
    assert torch.allclose(bias.grad, s * dy.to(torch.bfloat16).float().sum(0), rtol=1e-6, atol=1e-6)
    assert torch.allclose(bias.grad, peft_grads["base_model.model.up.lora_B.default.bias"], rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, n


def test_lora_bias_on_a_base_without_bias_is_refused():
    """PEFT cannot merge an adapter bias into a base layer without one, so vLLM could never receive it."""
    model, _ = _lora_bias_linear(base_bias=False)
    with pytest.raises(ValueError, match="lora_bias=True"):
        install_merged_lora_forward(model)
