"""The weight-sync fix's GEMM dispatcher (`engine.dispatch`) takes the linears only: a weight that is not 2-D (a gated
delta-net's causal-conv weight `[dim, 1, width]`) goes to vLLM-CPU's dispatcher, which prepacks it for the C++
`causal_conv1d_fwd_cpu` on AVX-512-BF16 CPUs. Before, the fix kept such a weight plain and the kernel read it as
packed: Qwen3.5's log-probs were off by up to 4.3 nats (tests/models/test_qwen3_5_vllm.py, docs/families.md)."""

from __future__ import annotations

import pytest
import torch

from trl_roundalign.engine.dispatch import _live_weight_dispatch, is_vllm_cpu, vllm_dispatch

pytestmark = pytest.mark.skipif(not is_vllm_cpu(), reason="vLLM-CPU's dispatcher")


def _layer(shape) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(shape).to(torch.bfloat16), requires_grad=False)
    return layer


def test_a_conv_weight_is_dispatched_as_vllm_does():
    ours, theirs = _layer((64, 1, 4)), _layer((64, 1, 4))
    theirs.weight.data.copy_(ours.weight.data)
    _live_weight_dispatch(ours, remove_weight=False)
    vllm_dispatch()(theirs, remove_weight=False)
    assert torch.equal(ours.weight.data, theirs.weight.data)  # packed on AVX-512-BF16, untouched elsewhere
    assert not hasattr(ours, "_roundalign_block_rows")  # not taken for a linear
    if torch.cpu._is_avx512_bf16_supported():
        assert hasattr(ours, "_cpu_unpacked_conv_weight"), "vLLM-CPU prepacks a causal-conv weight on this CPU"


def test_a_linear_weight_still_computes_f_linear_on_the_live_weight():
    layer = _layer((32, 16))
    _live_weight_dispatch(layer, remove_weight=True)
    x = torch.randn(3, 16).to(torch.bfloat16)
    assert torch.equal(layer.cpu_linear(x, layer.weight, None), torch.nn.functional.linear(x, layer.weight))
    assert layer.weight.numel() == 32 * 16
