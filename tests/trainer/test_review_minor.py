"""Two small fixes: `top_k=-1` (vLLM's "off") is no sampling bias, and the TP partial sums keep fp64 inputs in fp64."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from trl_roundalign import RoundAlignGRPOConfig
from trl_roundalign.engine.tp import row_parallel_linear
from trl_roundalign.local_models import tiny_model
from trl_roundalign.trainer.options import check_options, sampling_biases


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), use_vllm=True, vllm_mode="colocate", report_to="none", use_cpu=True, bf16=True)
    return RoundAlignGRPOConfig(**{**base, **kw})


@pytest.mark.parametrize("top_k", [-1, 0, None])
def test_top_k_off_is_not_a_sampling_bias(tmp_path, top_k):
    args = _args(tmp_path, top_k=top_k)
    assert sampling_biases(args) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_options(str(tiny_model("qwen3")), args)


def test_a_real_top_k_is_still_a_sampling_bias(tmp_path):
    assert sampling_biases(_args(tmp_path, top_k=5)) == ["top_k=5"]
    assert sampling_biases(_args(tmp_path, generation_kwargs={"top_k": -1})) == []


def test_the_tp_sum_keeps_fp64_in_fp64_and_its_gradient_passes_gradcheck():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, generator=g, requires_grad=True)
    out = row_parallel_linear(x, w, b, 2)
    assert out.dtype == torch.float64
    assert torch.allclose(out, F.linear(x, w, b), rtol=1e-13, atol=1e-13), (out - F.linear(x, w, b)).abs().max()
    assert torch.autograd.gradcheck(lambda x, w, b: row_parallel_linear(x, w, b, 2), (x, w, b))


def test_the_tp_sum_of_bf16_partials_still_goes_through_fp32():
    """The engine's rule for bf16 (and fp16): each partial rounded to bf16, the sum in fp32, one rounding."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, generator=g).bfloat16()
    w = torch.randn(16, 64, generator=g).bfloat16()
    parts = [F.linear(x[:, :32], w[:, :32]), F.linear(x[:, 32:], w[:, 32:])]
    want = (parts[0].float() + parts[1].float()).bfloat16()
    assert torch.equal(row_parallel_linear(x, w, None, 2, rows=0), want)


def test_the_tp_sum_is_carried_in_fp32_across_every_partial():
    """Each bf16 partial enters an fp32 running sum, rounded to bf16 once at the end. At TP=2 that equals a bf16
    addition (torch adds two bf16 values in fp32 and rounds once), so the test above cannot tell an fp32 sum from a
    bf16 one; with four partials a bf16 running sum rounds three times and differs."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 256, generator=g).bfloat16()
    w = torch.randn(48, 256, generator=g).bfloat16()
    parts = [F.linear(x[:, r * 64 : (r + 1) * 64], w[:, r * 64 : (r + 1) * 64]) for r in range(4)]
    fp32_sum = ((parts[0].float() + parts[1].float()) + parts[2].float()) + parts[3].float()
    bf16_sum = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    assert not torch.equal(fp32_sum.bfloat16(), bf16_sum)  # the two sums are told apart on these shapes
    assert torch.equal(row_parallel_linear(x, w, None, 4, rows=0), fp32_sum.bfloat16())
