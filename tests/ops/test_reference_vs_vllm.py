"""The PyTorch reference against vLLM's own code for each region, run the way vLLM's default engine runs it here:
vLLM 0.31's native implementations compiled by torch.compile (Inductor, C++ codegen on this CPU).

Also: profile `none` reproduces Hugging Face's modules bit for bit, and `none` differs from `vllm-compiled`
(so these tests can fail).
"""

from __future__ import annotations

import pytest
import torch
from helpers.bitwise import assert_bitwise_equal
from torch._inductor.utils import run_and_get_code

from trl_roundalign import ops

pytestmark = pytest.mark.vllm

ROWS = 96
NORM_ROWS = 1024  # enough elements that "at most 0.01% differ" is a statement about the order, not one flip
HIDDEN = (576, 1536, 200, 96)  # SmolLM2, Qwen2-1.5B, and odd widths (masked vector tails)
HEAD_DIMS = (64, 128)


def gen(seed: int, *shape, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def weight(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 0.1 * torch.randn(n, generator=g)).bfloat16()


def compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


def vllm_rms_norm(x, w, eps):
    from vllm import ir

    return ir.ops.rms_norm.impls["native"].impl_fn(x, w, eps)


def vllm_fused_add_rms_norm(x, res, w, eps):
    from vllm import ir

    return ir.ops.fused_add_rms_norm.impls["native"].impl_fn(x, res, w, eps)


def reduction_lanes_of(code: str) -> list[int]:
    """Lane count of each fp32 vector reduction Inductor wrote, checked against this CPU's vector width."""
    from trl_roundalign.engine import cpu_vector_isa, reduction_lanes_in

    return reduction_lanes_in(code, vector_floats=cpu_vector_isa()[1])


def assert_close_noise(actual, expected, *, label, max_frac=1e-4):
    """RMSNorm in torch's reduction order: at most 0.01% of elements differ, each by at most one bf16 ulp."""
    a, e = actual.view(torch.int16).int(), expected.view(torch.int16).int()
    diff = (a - e).abs()
    frac = (diff != 0).float().mean().item()
    assert diff.max().item() <= 1 and frac <= max_frac, f"{label}: {frac:.2e} differ, max {diff.max().item()} ulp"


@pytest.mark.parametrize("hidden", HIDDEN)
def test_rms_norm(hidden):
    x, w = gen(1, NORM_ROWS, hidden), weight(2, hidden)
    engine, code = run_and_get_code(compiled(vllm_rms_norm), x, w, 1e-5)
    lanes = reduction_lanes_of(code[0])
    assert len(lanes) == 1
    assert_bitwise_equal(ops.rms_norm(x, w, 1e-5, reduction_lanes=lanes[0]), engine, label=f"rms_norm lanes={lanes[0]}")
    assert_close_noise(ops.rms_norm(x, w, 1e-5), engine, label="rms_norm torch order")
    assert not torch.equal(ops.rms_norm(x, w, 1e-5, profile="none"), engine)


@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("residual_dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm(hidden, residual_dtype):
    x, w = gen(3, NORM_ROWS, hidden), weight(4, hidden)
    res = gen(5, NORM_ROWS, hidden, scale=4.0)
    if residual_dtype == torch.float32:
        res = res.float() + torch.randn(NORM_ROWS, hidden, generator=torch.Generator().manual_seed(6)) * 1e-3
    (out, new_res), code = run_and_get_code(compiled(vllm_fused_add_rms_norm), x, res.bfloat16() if residual_dtype == torch.bfloat16 else res, w, 1e-6)
    if residual_dtype == torch.float32:
        # vLLM's op takes a bf16 residual; with an fp32 stream compare against the fp32-residual math directly.
        s = res + x.float()
        y = (s * torch.rsqrt((s * s).sum(-1, keepdim=True) / hidden + 1e-6) * w.float()).bfloat16()
        mine, mine_res = ops.add_rms_norm(x, res, w, 1e-6)
        assert mine_res.dtype == torch.float32 and torch.equal(mine_res, s)
        assert_close_noise(mine, y, label="fp32-stream add_rms_norm")
        return
    lanes = reduction_lanes_of(code[0])
    mine, mine_res = ops.add_rms_norm(x, res, w, 1e-6, reduction_lanes=lanes[0])
    assert mine_res.dtype == torch.float32, "vllm-compiled keeps the residual stream in fp32"
    assert_bitwise_equal(mine, out, label="add_rms_norm output")
    # vLLM's single compiled op returns r(s); ours returns s itself (the engine's graph never rounds it).
    assert_bitwise_equal(mine_res.bfloat16(), new_res, label="add_rms_norm residual")
    hf_out, hf_res = ops.add_rms_norm(x, res, w, 1e-6, profile="none")
    assert torch.equal(hf_res, new_res) and not torch.equal(hf_out, out)


@pytest.mark.parametrize("inter", (1536, 8960, 77))
def test_swiglu(inter):
    from vllm.model_executor.layers.activation import SiluAndMul

    x = gen(7, ROWS, 2 * inter, scale=3.0)
    engine = compiled(SiluAndMul.forward_native)(x)
    gate, up = x[:, :inter].contiguous(), x[:, inter:].contiguous()
    assert_bitwise_equal(ops.swiglu(gate, up), engine, label="swiglu")
    assert not torch.equal(ops.swiglu(gate, up, profile="none"), engine)


def _rope_module(head_dim: int, rotary_dim: int, theta: float):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    with set_current_vllm_config(VllmConfig()):
        return RotaryEmbedding(head_dim, rotary_dim, 4096, theta, True, torch.bfloat16)


def _hf_cos_sin(head_dim: int, rotary_dim: int, theta: float, positions: torch.Tensor):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(
        hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": rotary_dim / head_dim},
    )
    probe = torch.zeros(1, positions.numel(), 2 * head_dim, dtype=torch.bfloat16)
    return LlamaRotaryEmbedding(cfg)(probe, positions[None])


@pytest.mark.parametrize(("head_dim", "rotary_dim", "theta"), [(64, 64, 1e5), (128, 128, 1e6), (64, 32, 1e4)])
def test_rope(head_dim, rotary_dim, theta):
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    heads, pos = 3, torch.arange(ROWS)
    module = _rope_module(head_dim, rotary_dim, theta)
    q, k = gen(8, ROWS, heads * head_dim), gen(9, ROWS, heads * head_dim)

    def native(p, q, k, cache):
        return RotaryEmbedding.forward_static(p, q, k, head_dim, rotary_dim, cache, True)

    eq, _ = compiled(native)(pos, q, k, module.cos_sin_cache)
    table_cos, table_sin = module.cos_sin_cache[:ROWS].chunk(2, dim=-1)
    if rotary_dim == head_dim:
        cos, sin = _hf_cos_sin(head_dim, rotary_dim, theta, pos)
        # Hugging Face's bf16 cos/sin equal vLLM's table bit for bit.
        assert torch.equal(cos[0, :, : rotary_dim // 2], table_cos) and torch.equal(sin[0, :, : rotary_dim // 2], table_sin)
    else:
        # Partial rotary (Llama's default RoPE has none): Hugging Face's layout of vLLM's table, halves duplicated.
        cos, sin = torch.cat((table_cos, table_cos), -1)[None], torch.cat((table_sin, table_sin), -1)[None]
    x = q.view(ROWS, heads, head_dim)
    mine = ops.rope(x, cos[0][:, None], sin[0][:, None])
    assert_bitwise_equal(mine.view(ROWS, -1), eq, label=f"rope hd={head_dim} rd={rotary_dim}")
    assert not torch.equal(ops.rope(x, cos[0][:, None], sin[0][:, None], profile="none").view(ROWS, -1), eq)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_qk_norm_rope(head_dim):
    """Qwen3: per-head RMSNorm then RoPE, as vLLM's Qwen3Attention writes it, compiled as one graph."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    heads, pos, theta = 4, torch.arange(ROWS), 1e6
    module = _rope_module(head_dim, head_dim, theta)
    q, w = gen(10, ROWS, heads * head_dim), weight(11, head_dim)

    def native(p, q, w, cache):
        qn = vllm_rms_norm(q.view(ROWS, heads, head_dim), w, 1e-6).view(ROWS, heads * head_dim)
        out, _ = RotaryEmbedding.forward_static(p, qn, None, head_dim, head_dim, cache, True)
        return out

    engine, code = run_and_get_code(compiled(native), pos, q, w, module.cos_sin_cache)
    lanes = reduction_lanes_of(code[0])
    cos, sin = _hf_cos_sin(head_dim, head_dim, theta, pos)
    x = q.view(ROWS, heads, head_dim)
    mine = ops.qk_norm_rope(x, w, 1e-6, cos[0][:, None], sin[0][:, None], reduction_lanes=lanes[0])
    assert_bitwise_equal(mine.view(ROWS, -1), engine, label=f"qk_norm_rope lanes={lanes[0]}")
    hf = ops.qk_norm_rope(x, w, 1e-6, cos[0][:, None], sin[0][:, None], profile="none")
    assert not torch.equal(hf.view(ROWS, -1), engine)


def test_reduction_order_is_what_makes_rms_norm_exact():
    """On enough rows the torch order shows 1-ulp flips that the engine's lane order removes."""
    hidden = 1536
    x, w = gen(12, 4096, hidden), weight(13, hidden)
    engine, code = run_and_get_code(compiled(vllm_rms_norm), x, w, 1e-6)
    lanes = reduction_lanes_of(code[0])[0]
    torch_order = ops.rms_norm(x, w, 1e-6)
    assert not torch.equal(torch_order, engine), "torch's order must differ somewhere on 4096 x 1536"
    assert_close_noise(torch_order, engine, label="torch order")
    assert_bitwise_equal(ops.rms_norm(x, w, 1e-6, reduction_lanes=lanes), engine, label="engine order")
    other = 16 if lanes == 32 else 32
    assert not torch.equal(ops.rms_norm(x, w, 1e-6, reduction_lanes=other), engine)


def test_none_profile_is_hugging_face_bit_for_bit():
    from transformers import Qwen3Config
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

    hidden, inter = 200, 344
    norm = Qwen3RMSNorm(hidden, eps=1e-6).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(weight(14, hidden))
    x, res = gen(15, ROWS, hidden), gen(16, ROWS, hidden)
    assert torch.equal(ops.rms_norm(x, norm.weight, 1e-6, profile="none"), norm(x))
    out, new_res = ops.add_rms_norm(x, res, norm.weight, 1e-6, profile="none")
    assert torch.equal(new_res, res + x) and torch.equal(out, norm(res + x))
    mlp = Qwen3MLP(Qwen3Config(hidden_size=hidden, intermediate_size=inter)).bfloat16()
    g, u = gen(17, ROWS, inter), gen(18, ROWS, inter)
    assert torch.equal(ops.swiglu(g, u, profile="none"), mlp.act_fn(g) * u)
    cos, sin = _hf_cos_sin(64, 64, 1e6, torch.arange(ROWS))
    q = gen(19, 1, 3, ROWS, 64)
    hf_q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    assert torch.equal(ops.rope(q, cos[:, None], sin[:, None], profile="none"), hf_q)


@pytest.mark.parametrize(("head_dim", "factor"), [(32, 0.75), (128, 0.75)])  # tiny-phi3; Phi-4-mini's 96 of 128
def test_partial_rotary_rope_phi3(head_dim, factor):
    """Phi-3's partial rotary: Hugging Face's `Phi3RotaryEmbedding` cos/sin (`rotary_dim = head_dim * factor` wide)
    equal vLLM's table, and the aligned RoPE on whole heads equals vLLM's compiled native RoPE, which rotates the
    first `rotary_dim` dims and passes the rest through; profile `none` is transformers' `apply_rotary_pos_emb`."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    heads, pos, theta = 3, torch.arange(ROWS), 1e4
    rope_parameters = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor}
    with set_current_vllm_config(VllmConfig()):
        module = get_rope(head_dim, max_position=4096, rope_parameters=rope_parameters, is_neox_style=True, dtype=torch.bfloat16)
    rotary_dim = int(head_dim * factor)
    assert type(module) is RotaryEmbedding and module.rotary_dim == rotary_dim < head_dim
    cfg = Phi3Config(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=heads,
                     max_position_embeddings=4096, rope_parameters=dict(rope_parameters))
    cos, sin = Phi3RotaryEmbedding(cfg)(torch.zeros(1, ROWS, heads * head_dim, dtype=torch.bfloat16), pos[None])
    assert cos.shape[-1] == rotary_dim
    table_cos, table_sin = module.cos_sin_cache[:ROWS].chunk(2, dim=-1)
    assert torch.equal(cos[0, :, : rotary_dim // 2], table_cos) and torch.equal(sin[0, :, : rotary_dim // 2], table_sin)

    q, k = gen(20, ROWS, heads * head_dim), gen(21, ROWS, heads * head_dim)

    def native(p, q, k, cache):
        return RotaryEmbedding.forward_static(p, q, k, head_dim, rotary_dim, cache, True)

    eq, ek = compiled(native)(pos, q, k, module.cos_sin_cache)
    for x, engine in ((q, eq), (k, ek)):
        xh = x.view(ROWS, heads, head_dim)
        mine = ops.rope(xh, cos[0][:, None], sin[0][:, None])
        assert_bitwise_equal(mine.view(ROWS, -1), engine, label=f"phi3 rope hd={head_dim} rd={rotary_dim}")
        assert torch.equal(mine[..., rotary_dim:], xh[..., rotary_dim:]), "pass-through dims are copied"
        hf_q, _ = apply_rotary_pos_emb(xh.transpose(0, 1)[None], xh.transpose(0, 1)[None], cos, sin)
        none = ops.rope(xh, cos[0][:, None], sin[0][:, None], profile="none")
        assert torch.equal(none, hf_q[0].transpose(0, 1))
        assert not torch.equal(none.view(ROWS, -1), engine)


def test_longrope_tables_equal_vllms_in_both_regimes():
    """LongRoPE (refused by the Phi-3 spec): transformers' bf16 cos/sin equal vLLM's `Phi3LongRoPEScaledRotaryEmbedding`
    tables, short factors (sequence within the original length) and long ones (beyond it), mscale included. What keeps
    it unsupported is which factors each side picks (per forward vs per engine), not rounding (docs/numerics.md)."""
    import math
    import types

    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    from vllm.model_executor.layers.rotary_embedding.phi3_long_rope_scaled_rope import Phi3LongRoPEScaledRotaryEmbedding

    head_dim, rotary_dim, orig, max_pos, heads = 128, 96, 256, 4096, 4
    g = torch.Generator().manual_seed(22)
    short = (1 + torch.rand(rotary_dim // 2, generator=g)).tolist()
    long = (1 + 20 * torch.rand(rotary_dim // 2, generator=g)).tolist()
    cfg = Phi3Config(
        hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_pos,
        original_max_position_embeddings=orig,  # Phi-3 configs carry it at the top level too, and it takes priority
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75, "short_factor": short,
                         "long_factor": long, "original_max_position_embeddings": orig},
    )
    hf = Phi3RotaryEmbedding(cfg)
    # vLLM's table builder without an engine config (its constructor reads max_model_len from the current engine).
    fake = types.SimpleNamespace(base=1e4, rotary_dim=rotary_dim)
    fake._compute_inv_freq = types.MethodType(Phi3LongRoPEScaledRotaryEmbedding._compute_inv_freq, fake)
    mscale = math.sqrt(1 + math.log(max_pos / orig) / math.log(orig))
    assert hf.attention_scaling == mscale
    for factors, length in ((short, orig - 6), (long, orig + 44)):
        table = Phi3LongRoPEScaledRotaryEmbedding._compute_cos_sin_cache(fake, length, factors, mscale).to(torch.bfloat16)
        cos, sin = hf(torch.zeros(1, length, 8, dtype=torch.bfloat16), torch.arange(length)[None])
        table_cos, table_sin = table.chunk(2, dim=-1)
        assert torch.equal(cos[0, :, : rotary_dim // 2], table_cos) and torch.equal(sin[0, :, : rotary_dim // 2], table_sin)
