"""The merged-weight LoRA forward (`trl_roundalign.lora`): the bits of PEFT's merge, and gradients to A and B."""

from __future__ import annotations

import copy

import pytest
import torch

peft = pytest.importorskip("peft")

from trl_roundalign.lora import install_merged_lora_forward  # noqa: E402


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
