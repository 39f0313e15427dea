"""Gemma 4's region forms against vLLM 0.32's own code, compiled the way vLLM-CPU's default engine compiles it
(torch.compile, Inductor's C++ on this CPU), at Gemma 4 E2B's widths: the `x̂ w` norm (vLLM's plain `RMSNorm`, whose
Python rounds `x̂` before the weight: compiled, that cast is gone), the weightless v-norm, q/k-norm + RoPE with
Gemma 4's RoPE modules (sliding: default, head 256; full: proportional, a quarter of a 512 head), and the per-layer
input merge (vLLM's `project_per_layer_inputs` with its scales as the bf16 model holds them). Profile `none` is
transformers' Gemma 4 modules bit for bit and differs from the engine, so each test can fail.
"""

from __future__ import annotations

import types

import pytest
import torch
from helpers.bitwise import assert_bitwise_equal
from test_reference_vs_vllm import compiled, gen, reduction_lanes_of, vllm_rms_norm, weight
from torch._inductor.utils import run_and_get_code

from trl_roundalign import ops

pytestmark = pytest.mark.vllm

ROWS = 256
EPS = 1e-6


class _VllmNorm:
    """vLLM's `RMSNorm` as the engine runs it: `forward_native` with its IR op's native implementation inlined
    (`ir_op_priority` native on CPU; `vllm.ir.ops.rms_norm`, which rounds x̂ to the weight's dtype, then multiplies)."""

    def __init__(self, w: torch.Tensor | None):
        from vllm.model_executor.layers.layernorm import RMSNorm

        assert "ir.ops.rms_norm" in __import__("inspect").getsource(RMSNorm.forward_native)
        self.w = w

    def __call__(self, x):
        return vllm_rms_norm(x, self.w, EPS)

    forward_native = __call__


def _vllm_norm(n: int, w: torch.Tensor | None) -> _VllmNorm:
    return _VllmNorm(w)


def _hf_norm(n: int, w: torch.Tensor | None):
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    norm = Gemma4RMSNorm(n, eps=EPS, with_scale=w is not None).to(torch.bfloat16)
    if w is not None:
        norm.weight.data = w.clone()
    return norm


@pytest.mark.parametrize("n", (2304, 256, 512))  # E2B's hidden, sliding and full head dims
@pytest.mark.parametrize("weighted", (True, False), ids=("w", "v_norm"))
def test_gemma4_rms_norm(n, weighted):
    x, w = gen(41, ROWS, n), (weight(42, n) if weighted else None)
    norm = _vllm_norm(n, w)
    engine, code = run_and_get_code(compiled(norm.forward_native), x)
    lanes = reduction_lanes_of(code[0])
    assert len(lanes) == 1
    mine = ops.gemma4_rms_norm(x, w, EPS, reduction_lanes=lanes[0])
    assert_bitwise_equal(mine, engine, label=f"gemma4 norm n={n} L={lanes[0]}")
    with torch.no_grad():
        hf = _hf_norm(n, w)(x)
    assert torch.equal(ops.gemma4_rms_norm(x, w, EPS, profile="none"), hf)
    if weighted:
        # vLLM's Python, run eagerly, rounds x̂ before the weight: the compiled engine does not (the cast is gone).
        with torch.no_grad():
            eager = norm.forward_native(x)
        assert not torch.equal(eager, engine)


def _rope(head_dim: int, params: dict):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(head_dim, max_position=1024, rope_parameters=dict(params), is_neox_style=True,
                        dtype=torch.bfloat16)


def _hf_cos_sin(layer_type: str, positions: torch.Tensor):
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    cfg = Gemma4TextConfig(hidden_size=2304, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    probe = torch.zeros(1, positions.numel(), 8, dtype=torch.bfloat16)
    return cfg, Gemma4TextRotaryEmbedding(cfg)(probe, positions[None], layer_type)


@pytest.mark.parametrize(("layer_type", "head_dim"), [("sliding_attention", 256), ("full_attention", 512)])
def test_gemma4_qk_norm_rope(layer_type, head_dim):
    pos = torch.arange(ROWS)
    cfg, (cos, sin) = _hf_cos_sin(layer_type, pos)
    module = _rope(head_dim, cfg.rope_parameters[layer_type])
    # The engine's bf16 cos/sin table is transformers' bf16 cos/sin (the proportional one: cos 1, sin 0 past the
    # rotated quarter), so the region uses transformers' table.
    half = head_dim // 2
    table = module.cos_sin_cache[pos]
    assert torch.equal(table[:, :half], cos[0][:, :half]) and torch.equal(table[:, half:], sin[0][:, :half])
    heads = 4
    q, w = gen(43, ROWS, heads * head_dim), weight(44, head_dim)
    norm = _vllm_norm(head_dim, w)

    def native(p, q):
        qn = norm.forward_native(q.view(ROWS, heads, head_dim)).view(ROWS, heads * head_dim)
        out, _ = module.forward_native(p, qn, None)
        return out

    engine, code = run_and_get_code(compiled(native), pos, q)
    lanes = reduction_lanes_of(code[0])
    x = q.view(ROWS, heads, head_dim)
    mine = ops.gemma4_qk_norm_rope(x, w, EPS, cos[0][:, None], sin[0][:, None], reduction_lanes=lanes[0])
    assert_bitwise_equal(mine.view(ROWS, -1), engine, label=f"gemma4 qk_norm_rope {layer_type} lanes={lanes[0]}")
    from transformers.models.gemma4.modeling_gemma4 import apply_rotary_pos_emb

    with torch.no_grad():
        hf = apply_rotary_pos_emb(_hf_norm(head_dim, w)(x[None]), cos, sin, unsqueeze_dim=2)[0]
    none = ops.gemma4_qk_norm_rope(x, w, EPS, cos[0][:, None], sin[0][:, None], profile="none")
    assert torch.equal(none, hf)
    assert not torch.equal(hf.reshape(ROWS, -1), engine)


def test_gemma4_per_layer_inputs():
    """vLLM's `Gemma4SelfDecoderLayers.project_per_layer_inputs` (the projection given, its three scales as the bf16
    model holds them) against `ops.gemma4_per_layer_inputs`; transformers' `project_per_layer_inputs` for `none`."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextModel
    from vllm.model_executor.models.gemma4 import Gemma4SelfDecoderLayers

    layers, ple, hidden = 2, 256, 2304
    proj = gen(45, ROWS, layers * ple, scale=20.0)  # the projection of an embedding of norm ~sqrt(hidden)
    emb = (gen(46, ROWS, layers, ple, scale=0.02).float() * 16).bfloat16()  # E * 16: exact in bf16
    w = weight(47, ple)
    vllm_self = types.SimpleNamespace(
        per_layer_model_projection=lambda x: x, per_layer_projection_norm=_vllm_norm(ple, w),
        per_layer_projection_scale=torch.tensor(hidden**-0.5).bfloat16(),
        per_layer_input_scale=torch.rsqrt(torch.tensor(2.0)).bfloat16(),
        config=types.SimpleNamespace(num_hidden_layers=layers), hidden_size_per_layer_input=ple,
    )

    def native(p, e):
        return Gemma4SelfDecoderLayers.project_per_layer_inputs(vllm_self, p, e)

    engine, code = run_and_get_code(compiled(native), proj, emb)
    lanes = reduction_lanes_of(code[0])
    assert len(lanes) == 1
    mine = ops.gemma4_per_layer_inputs(proj.view(ROWS, layers, ple), emb, w, EPS, hidden_size=hidden,
                                       reduction_lanes=lanes[0])
    assert_bitwise_equal(mine, engine, label=f"gemma4 per-layer inputs L={lanes[0]}")
    # transformers: Python-float scales, a rounding after each step.
    hf_self = types.SimpleNamespace(
        per_layer_model_projection=lambda x: x, per_layer_model_projection_scale=hidden**-0.5,
        per_layer_projection_norm=_hf_norm(ple, w), per_layer_input_scale=2.0**-0.5,
        config=types.SimpleNamespace(num_hidden_layers=layers), hidden_size_per_layer_input=ple,
    )
    with torch.no_grad():
        hf = Gemma4TextModel.project_per_layer_inputs(hf_self, proj, emb)
    none = ops.gemma4_per_layer_inputs(proj.view(ROWS, layers, ple), emb, w, EPS, hidden_size=hidden, profile="none")
    assert torch.equal(none, hf)
    assert not torch.equal(hf, engine)


def test_gemma4_norm_gradient_is_the_fp32_derivative_of_x_w():
    """d(x̂ w): the fp32 derivative rounded once (fp64 reference); Gemma 3's `1 + w` falls outside the bound."""
    from helpers.kernel_checks import assert_close_fp64

    x, w = gen(48, 16, 256).requires_grad_(), weight(49, 256).requires_grad_()
    dy = gen(50, 16, 256)
    (ops.gemma4_rms_norm(x, w, EPS, keep_fp32=True) * dy.float()).sum().backward()

    def fp64_grads(shift):
        x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * (shift + w64) * dy.double()).sum().backward()
        return x64.grad, w64.grad

    dx, dw = fp64_grads(0.0)
    assert_close_fp64(x.grad, dx, label="d x")
    assert_close_fp64(w.grad, dw, label="d w")
    with pytest.raises(AssertionError):
        assert_close_fp64(x.grad, fp64_grads(1.0)[0], label="d x with a 1 +")
