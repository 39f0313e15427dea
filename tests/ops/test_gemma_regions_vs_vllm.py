"""Gemma 3's region forms against vLLM's own code, compiled the way vLLM-CPU's default engine compiles it
(torch.compile, Inductor's C++ on this CPU): the `(1 + w)` norm, the sandwich (post-norm, then the fused add into
the next norm), q/k-norm + RoPE with `(1 + w)`, and GeGLU-tanh. Profile `none` is transformers' Gemma 3 modules
bit for bit and differs from the engine, so each test can fail.
"""

from __future__ import annotations

import pytest
import torch
from helpers.bitwise import assert_bitwise_equal
from helpers.kernel_checks import assert_close_fp64
from test_reference_vs_vllm import (
    ROWS,
    _hf_cos_sin,
    _rope_module,
    compiled,
    gen,
    reduction_lanes_of,
    vllm_fused_add_rms_norm,
    vllm_rms_norm,
)
from torch._inductor.utils import run_and_get_code

from trl_roundalign import ops

pytestmark = pytest.mark.vllm

NORM_ROWS = 1024
HIDDEN = (1152, 200)  # Gemma 3 1B's width, and an odd one (masked vector tails)


def gemma_weight(seed: int, n: int) -> torch.Tensor:
    """Gemma stores `w` (the norm multiplies by `1 + w`): small values around 0."""
    g = torch.Generator().manual_seed(seed)
    return (0.3 * torch.randn(n, generator=g)).bfloat16()


def _vllm(cls_name: str, *args, **kwargs):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import activation, layernorm

    cls = getattr(layernorm, cls_name, None) or getattr(activation, cls_name)
    with set_current_vllm_config(VllmConfig()):
        return cls(*args, **kwargs)


class _GemmaNorm:
    """vLLM's `GemmaRMSNorm.forward_native` with its IR ops' native implementations inlined, as the engine runs them
    (`ir_op_priority` native): the weight handed over is `w.float() + 1.0`."""

    def __init__(self, w: torch.Tensor, eps: float):
        from vllm.model_executor.layers.layernorm import GemmaRMSNorm

        assert "self.weight.float() + 1.0" in __import__("inspect").getsource(GemmaRMSNorm.forward_native)
        self.w, self.eps = w, eps

    def forward_native(self, x, residual=None):
        weight = self.w.float() + 1.0
        if residual is None:
            return vllm_rms_norm(x, weight, self.eps)
        return vllm_fused_add_rms_norm(x, residual, weight, self.eps)


def _gemma_norm(w: torch.Tensor, eps: float) -> _GemmaNorm:
    return _GemmaNorm(w, eps)


def _hf_norm(w: torch.Tensor, eps: float):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    norm = Gemma3RMSNorm(w.numel(), eps=eps).to(torch.bfloat16)
    norm.weight.data = w.clone()
    return norm


@pytest.mark.parametrize("hidden", HIDDEN)
def test_gemma_rms_norm(hidden):
    x, w = gen(21, NORM_ROWS, hidden), gemma_weight(22, hidden)
    norm = _gemma_norm(w, 1e-6)
    engine, code = run_and_get_code(compiled(norm.forward_native), x)
    lanes = reduction_lanes_of(code[0])
    assert len(lanes) == 1
    assert_bitwise_equal(ops.gemma_rms_norm(x, w, 1e-6, reduction_lanes=lanes[0]), engine, label=f"gemma norm L={lanes[0]}")
    with torch.no_grad():
        hf = _hf_norm(w, 1e-6)(x)
    assert torch.equal(ops.gemma_rms_norm(x, w, 1e-6, profile="none"), hf)


@pytest.mark.parametrize("hidden", HIDDEN)
def test_sandwich_post_norm_add_norm(hidden):
    """The post-attention norm's output goes into the next norm's fused add: the engine never rounds it, and the sum
    stays fp32 (`keep_fp32` then an fp32 add). transformers rounds both."""
    a, res = gen(23, NORM_ROWS, hidden), gen(24, NORM_ROWS, hidden, scale=4.0)
    w_post, w_pre = gemma_weight(25, hidden), gemma_weight(26, hidden)
    post, pre = _gemma_norm(w_post, 1e-6), _gemma_norm(w_pre, 1e-6)

    def native(a, res):
        return pre.forward_native(post.forward_native(a), res)

    (normed, new_res), code = run_and_get_code(compiled(native), a, res)
    lanes = reduction_lanes_of(code[0])
    assert len(lanes) == 2
    p = ops.gemma_rms_norm(a, w_post, 1e-6, reduction_lanes=lanes[0], keep_fp32=True)
    assert p.dtype == torch.float32
    s = res.float() + p
    assert_bitwise_equal(ops.gemma_rms_norm(s, w_pre, 1e-6, reduction_lanes=lanes[1]), normed, label="sandwich normed")
    assert_bitwise_equal(s.bfloat16(), new_res, label="sandwich residual (r(s) as the op returns it)")
    # transformers: r(post(a)), then r(res + that), then the norm of the rounded sum.
    with torch.no_grad():
        hf_p = _hf_norm(w_post, 1e-6)(a)
        hf = _hf_norm(w_pre, 1e-6)(res + hf_p)
    rounded_p = ops.gemma_rms_norm(a, w_post, 1e-6, profile="none")
    assert torch.equal(rounded_p, hf_p)
    assert torch.equal(ops.gemma_rms_norm(res + rounded_p, w_pre, 1e-6, profile="none"), hf)
    assert not torch.equal(hf, normed)


@pytest.mark.parametrize("head_dim", (32, 256))  # tiny-gemma3; Gemma 3's 256
def test_gemma_qk_norm_rope(head_dim):
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    heads, pos, theta = 4, torch.arange(ROWS), 1e4
    module = _rope_module(head_dim, head_dim, theta)
    q, w = gen(27, ROWS, heads * head_dim), gemma_weight(28, head_dim)
    norm = _gemma_norm(w, 1e-6)

    def native(p, q, cache):
        qn = norm.forward_native(q.view(ROWS, heads, head_dim)).view(ROWS, heads * head_dim)
        out, _ = RotaryEmbedding.forward_static(p, qn, None, head_dim, head_dim, cache, True)
        return out

    engine, code = run_and_get_code(compiled(native), pos, q, module.cos_sin_cache)
    lanes = reduction_lanes_of(code[0])
    cos, sin = _hf_cos_sin(head_dim, head_dim, theta, pos)
    x = q.view(ROWS, heads, head_dim)
    mine = ops.gemma_qk_norm_rope(x, w, 1e-6, cos[0][:, None], sin[0][:, None], reduction_lanes=lanes[0])
    assert_bitwise_equal(mine.view(ROWS, -1), engine, label=f"gemma qk_norm_rope lanes={lanes[0]}")
    hf = ops.gemma_qk_norm_rope(x, w, 1e-6, cos[0][:, None], sin[0][:, None], profile="none")
    assert not torch.equal(hf.view(ROWS, -1), engine)


@pytest.mark.parametrize("inter", (6912, 256, 77))  # Gemma 3 1B, tiny-gemma3, an odd width
def test_geglu_tanh(inter):
    from transformers.activations import ACT2FN

    act = _vllm("GeluAndMul", approximate="tanh")
    x = gen(29, ROWS, 2 * inter, scale=3.0)
    engine = compiled(act.forward_native)(x)
    gate, up = x[:, :inter].contiguous(), x[:, inter:].contiguous()
    assert_bitwise_equal(ops.geglu_tanh(gate, up), engine, label=f"geglu_tanh {inter}")
    hf = ACT2FN["gelu_pytorch_tanh"](gate) * up  # transformers' Gemma3MLP
    assert torch.equal(ops.geglu_tanh(gate, up, profile="none"), hf)
    assert not torch.equal(hf, engine)


def test_geglu_tanh_gradient_is_the_fp32_derivative():
    """The gradients are the tanh-GELU derivative computed in fp32 and rounded once (fp64 reference, one bf16
    rounding's tolerance); the erf-GELU derivative, which the engine does not compute, falls outside it."""
    gate, up = gen(30, 64, 256, scale=3.0).requires_grad_(), gen(31, 64, 256, scale=3.0).requires_grad_()
    ops.geglu_tanh(gate, up).float().sum().backward()

    def fp64_grads(approximate):
        g64, u64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
        (torch.nn.functional.gelu(g64, approximate=approximate) * u64).sum().backward()
        return g64.grad, u64.grad

    g_tanh, u_tanh = fp64_grads("tanh")
    assert_close_fp64(gate.grad, g_tanh, label="d gate (tanh GELU)")
    assert_close_fp64(up.grad, u_tanh, label="d up (tanh GELU)")
    g_erf, u_erf = fp64_grads("none")
    for actual, wrong, label in ((gate.grad, g_erf, "d gate"), (up.grad, u_erf, "d up")):
        with pytest.raises(AssertionError):
            assert_close_fp64(actual, wrong, label=f"{label} against the erf-GELU derivative")


def test_gemma_norm_gradient_reaches_w():
    """d(1 + w) through the norm: the fp32 derivative rounded once, for x and w (fp64 reference); a gradient that
    forgot the `1 +` (Llama's norm) falls outside the bound."""
    x, w = gen(32, 16, 64).requires_grad_(), gemma_weight(33, 64).requires_grad_()
    dy = gen(36, 16, 64)
    (ops.gemma_rms_norm(x, w, 1e-6, keep_fp32=True) * dy.float()).sum().backward()

    def fp64_grads(shift):
        x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * (shift + w64) * dy.double()).sum().backward()
        return x64.grad, w64.grad

    dx, dw = fp64_grads(1.0)
    assert_close_fp64(x.grad, dx, label="d x")
    assert_close_fp64(w.grad, dw, label="d w")
    with pytest.raises(AssertionError):
        assert_close_fp64(x.grad, fp64_grads(0.0)[0], label="d x without the 1 +")


def test_triton_backend_is_refused_with_the_fix():
    x, w = gen(34, 4, 64), gemma_weight(35, 64)
    with pytest.raises(ValueError, match="no Triton kernels yet"):
        ops.gemma_rms_norm(x, w, 1e-6, backend="triton")
