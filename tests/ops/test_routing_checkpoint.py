"""Routing replay under gradient checkpointing (`ops.routing`): a decoder layer recomputed in the backward replays the
experts its forward replayed, also when a later forward (exact mode's re-prefill stretches: other columns, nothing
replayed) ran in between. Measured first in `scripts/routing_replay.py --long-prompts --kv-blocks 10 --length 256`
(exact + replay on peaked-qwen3-moe, AVX2): torch's checkpoint stopped the backward, "A different number of tensors
was saved during the original forward and recomputation"."""

from __future__ import annotations

import pytest
import torch


def _model(use_reentrant: bool):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64)
    model = Qwen3MoeForCausalLM(cfg).float()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model.train()
    return model


def _grads(model, replay, batch, routes, stretch, *, checkpointing: bool):
    """The gradients of the batch's loss (its routes replayed) plus a stretch's (other columns, nothing replayed)."""
    for layer in model.model.layers:
        layer.gradient_checkpointing = checkpointing
    model.zero_grad(set_to_none=True)
    replay.hold(routes, batch)
    if checkpointing:  # the batch's forward, then the stretch's, then one backward: the order of exact mode's step
        loss = model(batch).logits.float().square().mean() + model(stretch).logits.float().square().mean()
        loss.backward()
    else:
        model(batch).logits.float().square().mean().backward()
        model(stretch).logits.float().square().mean().backward()
    replay.release()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_recomputed_layer_replays_its_forwards_experts(use_reentrant):
    from trl_roundalign.ops.routing import RoutingReplay

    model = _model(use_reentrant)
    replay = RoutingReplay(layers=(0, 1))
    assert replay.install(model) == 2
    batch = torch.randint(0, 64, (2, 6))
    stretch = torch.randint(0, 64, (1, 9))
    # The engine's experts: 2 and 3 for every token and layer, which the random routers mostly do not choose.
    routes = torch.tensor([3, 2], dtype=torch.int16).expand(2, 6, 2, 2).clone()
    plain = _grads(model, replay, batch, routes, stretch, checkpointing=False)
    checkpointed = _grads(model, replay, batch, routes, stretch, checkpointing=True)
    assert plain.keys() == checkpointed.keys()
    for name, g in plain.items():  # the same experts in the recomputation: the same gradients (summed in another order)
        torch.testing.assert_close(checkpointed[name], g, rtol=1e-5, atol=1e-7, msg=name)
    experts = [n for n in plain if "experts" in n]
    assert experts and all(plain[n].abs().sum() > 0 for n in experts)
