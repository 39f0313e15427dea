"""Qwen3.5's gated attention output, `x * sigmoid(gate)` (`ops.sigmoid_gate`), against vLLM's own line compiled as the
engine compiles it (Inductor, C++ codegen on this CPU): bit for bit under `vllm-compiled`, and transformers' form under
`none` (which differs: the test can fail)."""

from __future__ import annotations

import inspect

import pytest
import torch
from helpers.bitwise import assert_bitwise_equal

from trl_roundalign import ops

pytestmark = pytest.mark.vllm

ROWS = 96
WIDTHS = (256, 1024, 200)  # tiny Qwen3.5's heads x head dim, Qwen3.5-0.8B's q heads x 256 / 2 ... and an odd width


def gen(seed: int, *shape, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def test_vllm_computes_the_gate_as_read():
    """The line the reference compiles is vLLM's: `Qwen3NextAttention.forward` multiplies by `torch.sigmoid(gate)`."""
    from vllm.model_executor.models.qwen3_next import Qwen3NextAttention

    assert "attn_output = attn_output * torch.sigmoid(gate)" in inspect.getsource(Qwen3NextAttention.forward)


@pytest.mark.parametrize("width", WIDTHS)
def test_sigmoid_gate_is_the_compiled_engines(width):
    x, gate = gen(1, ROWS, width, scale=3.0), gen(2, ROWS, width, scale=6.0)
    torch._dynamo.reset()
    engine = torch.compile(lambda a, g: a * torch.sigmoid(g), dynamic=False)(x, gate)
    assert_bitwise_equal(ops.sigmoid_gate(x, gate, profile="vllm-compiled"), engine, label=f"sigmoid gate {width}")
    hf = ops.sigmoid_gate(x, gate, profile="none")
    assert torch.equal(hf, x * torch.sigmoid(gate))
    assert not torch.equal(hf, engine), "transformers' two roundings must differ from the fused form somewhere"


def test_sigmoid_gate_backward_is_the_fp32_derivative():
    x, gate = gen(3, 8, 64, scale=2.0).requires_grad_(), gen(4, 8, 64, scale=3.0).requires_grad_()
    dy = gen(5, 8, 64, scale=1.0)
    ops.sigmoid_gate(x, gate, profile="vllm-compiled").backward(dy)
    xf, gf = x.detach().double(), gate.detach().double().requires_grad_()
    xf.requires_grad_()
    (xf * torch.sigmoid(gf)).backward(dy.double())
    torch.testing.assert_close(x.grad.double(), xf.grad, atol=0, rtol=2 ** -7)
    torch.testing.assert_close(gate.grad.double(), gf.grad, atol=1e-6, rtol=2 ** -7)
