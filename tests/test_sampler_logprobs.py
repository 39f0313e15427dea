"""The trainer's log-probs the sampler's way (`trl_roundalign.trainer.logprobs`), against vLLM's sampler's formula.

The declared reference is vLLM 0.31's sampler (`vllm/v1/sample/sampler.py`, `logprobs_mode="processed_logprobs"`):
the head's bf16 logits, `.to(float32)`, `.div_(temperature)`, `log_softmax(dim=-1)`, gathered. Claims, each able to
fail: the forward equals it bit for bit at SmolLM2's head shape (576 x 49152) and at any number of rows; TRL's fused
head does not (so the test sees the difference it removes); the gradients are TRL's; outside the scope, TRL's
function runs unchanged.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.bitwise import assert_bitwise_equal

from trl_roundalign import gemm, logprobs

VOCAB, HIDDEN = 49152, 576


def _inputs(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, HIDDEN, generator=g) * 2).bfloat16()
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5 * 3).bfloat16()
    targets = torch.randint(0, VOCAB, (n,), generator=g)
    return hidden, weight, targets


def _sampler(hidden, weight, targets, temperature, schedule):
    """vLLM's sampler on the engine's logits (the engine's linears under `schedule`: row blocks, a row floor, or plain)."""
    logits = gemm.linear(hidden, weight, None, *schedule).to(torch.float32)
    if temperature != 1.0:
        logits.div_(torch.tensor([temperature], dtype=torch.float32).unsqueeze(1))
    return logits.log_softmax(dim=-1, dtype=torch.float32).gather(1, targets[:, None]).squeeze(1)


@pytest.mark.parametrize("n", [1, 37, 300])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("rows", [gemm.GemmSchedule(), gemm.GemmSchedule(64), gemm.GemmSchedule(0, 2)], ids=str)
def test_forward_is_the_samplers_bit_for_bit(n, temperature, rows):
    hidden, weight, targets = _inputs(n)
    lp, ent, *_ = logprobs.SamplerLogProb.apply(hidden, weight, None, targets, temperature, 32768, None, 1.0, ("entropy",), rows)
    assert_bitwise_equal(lp, _sampler(hidden, weight, targets, temperature, rows), label=f"log-probs n={n} T={temperature}")
    z = F.linear(hidden, weight).float() / temperature
    ref_ent = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-4, atol=1e-4)


def test_trls_fused_head_differs_from_the_sampler():
    """What this module removes: TRL 1.16's online logsumexp over 32768-wide tiles rounds otherwise."""
    from trl.kernels import ChunkedLogProbFunction

    hidden, weight, targets = _inputs(300)
    trl_lp = ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, 32768, None, 1.0, ("entropy",))[0]
    sampler = _sampler(hidden, weight, targets, 1.0, gemm.GemmSchedule())
    assert not torch.equal(trl_lp, sampler)
    torch.testing.assert_close(trl_lp, sampler, rtol=0, atol=1e-4)  # the same function, rounded otherwise


def test_gradients_are_trls():
    from trl.kernels import ChunkedLogProbFunction

    hidden0, weight0, targets = _inputs(50, seed=1)
    g_lp = torch.randn(50, generator=torch.Generator().manual_seed(2))
    g_ent = torch.randn(50, generator=torch.Generator().manual_seed(3))
    grads = []
    for fn, extra in ((logprobs.SamplerLogProb, (gemm.GemmSchedule(64),)), (ChunkedLogProbFunction, ())):
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        lp, ent, *_ = fn.apply(hidden, weight, None, targets, 1.0, 32768, None, 1.0, ("entropy",), *extra)
        (lp * g_lp + ent * g_ent).sum().backward()
        grads.append((hidden.grad, weight.grad))
    for name, a, b in zip(("hidden", "weight"), *grads):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=1e-3, msg=f"grad {name}")


def test_the_dispatcher_is_scoped():
    import trl.trainer.utils as utils
    from trl.kernels import ChunkedLogProbFunction

    logprobs.install()
    assert logprobs.installed() and utils._ChunkedLogProbFunction is not ChunkedLogProbFunction
    hidden, weight, targets = _inputs(40)
    args = (hidden, weight, None, targets, 1.0, 32768, None, 1.0, ("entropy",))
    outside = utils._ChunkedLogProbFunction.apply(*args)[0]
    assert_bitwise_equal(outside, ChunkedLogProbFunction.apply(*args)[0], label="outside the scope: TRL's")
    with logprobs.sampler_logprobs():
        inside = utils._ChunkedLogProbFunction.apply(*args)[0]
        capped = utils._ChunkedLogProbFunction.apply(*args[:6], 30.0, 1.0, ("entropy",))[0]  # a soft-cap: TRL's
    assert_bitwise_equal(inside, _sampler(hidden, weight, targets, 1.0, gemm.GemmSchedule()), label="inside the scope: the sampler's")
    assert_bitwise_equal(capped, ChunkedLogProbFunction.apply(*args[:6], 30.0, 1.0, ("entropy",))[0], label="soft-cap")


def test_models_with_a_logit_scale_are_named():
    from transformers import Gemma2Config, Qwen3Config

    assert logprobs.supports(torch.nn.Module()) is None
    m = torch.nn.Module()
    m.config = Qwen3Config()
    assert logprobs.supports(m) is None
    m.config = Gemma2Config(final_logit_softcapping=30.0)
    assert "final_logit_softcapping=30.0" in logprobs.supports(m)
