"""apply_roundalign / revert_roundalign on real (tiny) Hugging Face models: coverage, reversibility, training."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from trl_roundalign import apply_roundalign, get_patch_report, revert_roundalign
from trl_roundalign.local_models import tiny_model
from trl_roundalign.models import ARCH_SPECS, default_reduction_lanes, norm_order
from trl_roundalign.profiles import ALL_REGIONS, PAPER_REGIONS

ARCHS = ("qwen2", "qwen3", "llama", "phi3", "gemma3", "qwen3_moe", "olmo2")
MODEL_TYPE = {"gemma3": "gemma3_text"}


def load(arch: str, **overrides) -> torch.nn.Module:
    path = tiny_model(arch, **overrides)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")


def batch(vocab: int = 500, b: int = 2, t: int = 19, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    if b > 1:
        mask[1, :4] = 0  # a left-padded row, as TRL pads prompts
    return ids, mask


def logits(model, ids, mask=None):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


@pytest.mark.parametrize("arch", ARCHS)
def test_coverage_every_target_module_is_patched(arch):
    model = load(arch)
    report = apply_roundalign(model, PAPER_REGIONS)
    n = model.config.num_hidden_layers
    spec = ARCH_SPECS[MODEL_TYPE.get(arch, arch)]
    expected = set()
    for name, _module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "self_attn":
            expected.add((name, "rope"))
        if leaf in ("q_norm", "k_norm"):
            expected.add((name, "rope"))
        if leaf == "mlp":
            expected.add((name, "swiglu"))
        if leaf in spec.layer_norms or name == "model.norm":
            expected.add((name, "rmsnorm"))
    if spec.embed_forward is not None:  # Gemma 3: the stream starts unrounded at the scaled embedding
        expected.add(("model.embed_tokens", "rmsnorm"))
    assert set(report.entries) == expected
    assert len(report.modules("rmsnorm")) == len(spec.layer_norms) * n + 1 + (spec.embed_forward is not None)
    if spec.qk_norm:
        assert len([p for p in report.modules("rope") if p.endswith(("q_norm", "k_norm"))]) == 2 * n
    # Every module whose computation changed carries an instance forward.
    for name, module in model.named_modules():
        if name.endswith(("self_attn", "mlp")) or name.rsplit(".", 1)[-1].isdigit() and ".layers." in f".{name}":
            assert "forward" in module.__dict__, name


@pytest.mark.parametrize("arch", ARCHS)
def test_regions_change_the_forward_and_revert_restores_it_bitwise(arch):
    model = load(arch)
    ids, mask = batch()
    before = logits(model, ids)
    params_before = {k: v.clone() for k, v in model.named_parameters()}
    names_before = [k for k, _ in model.named_parameters()]
    apply_roundalign(model, PAPER_REGIONS, positions_from_mask=False)
    aligned = logits(model, ids)
    assert not torch.equal(aligned, before), "the aligned forward must differ from stock (else the test cannot fail)"
    assert [k for k, _ in model.named_parameters()] == names_before
    assert all(torch.equal(v, params_before[k]) for k, v in model.named_parameters())
    assert revert_roundalign(model)
    assert torch.equal(logits(model, ids), before)
    assert get_patch_report(model) is None
    assert not revert_roundalign(model)


def test_apply_twice_is_idempotent_and_new_settings_replace():
    model = load("qwen3")
    r1 = apply_roundalign(model, PAPER_REGIONS)
    r2 = apply_roundalign(model, PAPER_REGIONS)
    assert r1 is r2
    ids, _ = batch()
    once = logits(model, ids)
    r3 = apply_roundalign(model, ("rope",))
    assert r3.regions == ("rope",) and r3 is not r1
    assert not torch.equal(logits(model, ids), once)
    apply_roundalign(model, PAPER_REGIONS)
    assert torch.equal(logits(model, ids), once)


def test_empty_regions_leave_the_model_untouched():
    model = load("llama")
    ids, mask = batch()
    before = logits(model, ids, mask)
    report = apply_roundalign(model, ())
    assert report.entries == [] and not report.positions_from_mask
    assert torch.equal(logits(model, ids, mask), before)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_positions_from_mask_numbers_real_tokens_from_zero():
    """With a left-padded batch and no position_ids, RoPE positions start at each row's first real token (vLLM's)."""
    model = load("qwen3")
    ids, mask = batch()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        stock_with_positions = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    stock = logits(model, ids, mask)
    assert not torch.equal(stock[1, 4:], stock_with_positions[1, 4:])
    apply_roundalign(model, (), positions_from_mask=True)
    assert torch.equal(logits(model, ids, mask), stock_with_positions)
    revert_roundalign(model)
    assert torch.equal(logits(model, ids, mask), stock)


def test_eval_train_and_generate_with_cache():
    model = load("qwen3")
    apply_roundalign(model, PAPER_REGIONS)
    ids, _ = batch(b=1, t=6)
    model.train()
    out_train = logits(model, ids)
    model.eval()
    assert torch.equal(out_train, logits(model, ids))
    gen = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=True)
    assert gen.shape == (1, 11)
    gen_nocache = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=False)
    assert torch.equal(gen, gen_nocache)


@pytest.mark.parametrize("arch", ARCHS)
def test_gradient_checkpointing_gives_the_same_gradients(arch):
    ids, mask = batch()

    def grads(checkpointing: bool):
        model = load(arch)
        apply_roundalign(model, PAPER_REGIONS, backend="torch")
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        out = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        out.float().logsumexp(-1).sum().backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    plain, ckpt = grads(False), grads(True)
    assert plain.keys() == ckpt.keys() and len(plain) > 0
    for k in plain:
        assert torch.equal(plain[k], ckpt[k]), k


def test_peft_lora_model_is_patched_and_trainable():
    import peft  # pinned by make setup: a broken install fails here, never skips LoRA coverage
    model = load("qwen3")
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], lora_dropout=0.0)
    )
    report = apply_roundalign(lora, PAPER_REGIONS)
    assert len(report.modules("swiglu")) == model.config.num_hidden_layers
    ids, mask = batch()
    lora.train()
    out = lora(input_ids=ids, attention_mask=mask, use_cache=False).logits
    out.float().logsumexp(-1).sum().backward()
    lora_grads = [p.grad for n, p in lora.named_parameters() if "lora_" in n]
    assert lora_grads and all(g is not None and torch.isfinite(g).all() for g in lora_grads)
    assert any(g.abs().sum() > 0 for g in lora_grads)
    assert not any(p.grad is not None for n, p in lora.named_parameters() if "lora_" not in n)


def test_fp32_model_is_refused_with_how_to_load_bf16():
    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32)
    with pytest.raises(ValueError, match="bfloat16"):
        apply_roundalign(model)


def test_bad_regions_profiles_and_models():
    model = load("llama")
    with pytest.raises(ValueError, match="known regions"):
        apply_roundalign(model, ("rope", "gelu"))
    with pytest.raises(ValueError, match="not the string"):
        apply_roundalign(model, "rope")
    with pytest.raises(ValueError, match="known profiles"):
        apply_roundalign(model, ("rope",), profile="vllm-fast")
    with pytest.raises(ValueError, match="three paper regions"):
        apply_roundalign(model, ("attention",), profile="vllm-compiled-exact")
    with pytest.raises(ValueError, match="vllm-compiled-exact"):
        apply_roundalign(model, ALL_REGIONS, profile="vllm-compiled")
    with pytest.raises(ValueError, match="reduction_lanes has 3 entries"):
        apply_roundalign(model, PAPER_REGIONS, profile="vllm-compiled-exact", reduction_lanes=[32, 32, 32])
    gpt2_like = torch.nn.Module()
    gpt2_like.config = type("C", (), {"model_type": "gpt2"})()
    gpt2_like.model = torch.nn.Module()
    gpt2_like.model.layers, gpt2_like.model.norm = torch.nn.ModuleList(), torch.nn.Identity()
    gpt2_like.model.config = gpt2_like.config
    with pytest.raises(ValueError, match="Unsupported model_type 'gpt2'.*qwen3"):
        apply_roundalign(gpt2_like)
    broken = load("llama")
    del broken.model.layers[0].mlp.gate_proj
    with pytest.raises(ValueError, match=r"model.layers.0.mlp .*gate_proj"):
        apply_roundalign(broken)


def test_default_reduction_lanes_follow_the_engines_reading():
    assert norm_order(2, True)[:4] == [
        "layers.0.input_layernorm",
        "layers.0.self_attn.q_norm",
        "layers.0.self_attn.k_norm",
        "layers.0.post_attention_layernorm",
    ]
    assert default_reduction_lanes(2, False, vector_floats=16) == [32, 32, 32, 16, 32]  # AVX-512
    assert default_reduction_lanes(2, True, vector_floats=16) == [32, 32, 32, 32, 32, 32, 32, 16, 32]
    assert default_reduction_lanes(2, False, vector_floats=8) == [16, 16, 16, 8, 16]  # AVX2


def test_mistral_shares_the_structure():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(
        vocab_size=300, hidden_size=96, intermediate_size=200, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=256, sliding_window=None,
    )
    model = MistralForCausalLM(cfg).to(torch.bfloat16)
    ids, _ = batch(vocab=300)
    before = logits(model, ids)
    report = apply_roundalign(model, PAPER_REGIONS)
    assert report.model_type == "mistral" and len(report.modules("rmsnorm")) == 5
    assert not torch.equal(logits(model, ids), before)
    revert_roundalign(model)
    assert torch.equal(logits(model, ids), before)


def test_phi3_fused_projections_partial_rotary_and_what_is_refused():
    """Phi-3: profile `none` on every region is transformers' `Phi3ForCausalLM` bit for bit (the fused qkv/gate_up
    forwards and the 0.75 partial rotary are exact replacements); the resid dropouts are the model's own; a RoPE
    scaling other than LongRoPE and a missing fused projection raise naming what is supported."""
    model = load("phi3")
    assert model.config.rope_parameters["partial_rotary_factor"] == 0.75
    assert model.model.rotary_emb.inv_freq.numel() * 2 == 24 < model.model.layers[0].self_attn.head_dim
    ids, mask = batch()
    before = logits(model, ids, mask)
    apply_roundalign(model, PAPER_REGIONS, profile="none", positions_from_mask=False)
    assert torch.equal(logits(model, ids, mask), before)
    model.train()  # resid_pdrop 0: dropout is the identity even in training
    assert torch.equal(logits(model, ids, mask), before)
    model.eval()
    revert_roundalign(model)
    for layer in model.model.layers:  # the aligned layer calls the model's own dropout modules
        layer.resid_attn_dropout.p = layer.resid_mlp_dropout.p = 0.5
    apply_roundalign(model, PAPER_REGIONS)
    evaluated = logits(model, ids)
    model.train()
    assert not torch.equal(logits(model, ids), evaluated), "resid dropout must act in training"
    model.eval()
    revert_roundalign(model)

    scaled = load("phi3")
    scaled.config.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e4, "partial_rotary_factor": 0.75, "factor": 4.0}
    with pytest.raises(ValueError, match="rope_type='yarn'.*rope_type='default'.*rope_type='longrope'"):
        apply_roundalign(scaled)
    broken = load("phi3")
    del broken.model.layers[1].self_attn.qkv_proj
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn .*qkv_proj.*Phi-3"):
        apply_roundalign(broken)


def test_phi3_longrope_holds_the_engines_factor_set():
    """LongRoPE: under the "rope" region the rotary module gives, for every sequence, the cos/sin of the factor set the
    engine picked from its max_model_len (long above the original length), which are transformers' own cos/sin for that
    set; without the engine's length the region is refused before anything is installed; revert restores the
    per-sequence choice."""
    from transformers import AutoModelForCausalLM

    from trl_roundalign.local_models import PHI3_LONGROPE_ORIGINAL, tiny_phi3_longrope
    from trl_roundalign.patching import get_patch_report, is_patched

    model = AutoModelForCausalLM.from_pretrained(tiny_phi3_longrope(), dtype=torch.bfloat16)
    rotary = model.model.rotary_emb
    x = torch.zeros(1, 1, 8, dtype=torch.bfloat16)
    short_len, long_len = 20, PHI3_LONGROPE_ORIGINAL + 30

    def table(n):
        return rotary(x, torch.arange(n)[None])

    own_short, own_long = table(short_len), table(long_len)  # transformers: short factors within 128 tokens, long beyond
    assert not torch.equal(own_short[0], own_long[0][:, :short_len])
    with pytest.raises(ValueError, match="LongRoPE.*engine_max_model_len"):
        apply_roundalign(model, PAPER_REGIONS)
    assert not is_patched(model)
    report = apply_roundalign(model, PAPER_REGIONS, engine_max_model_len=1024)
    assert report.rope_factors == "long" and ("model.rotary_emb", "rope") in report.entries
    held = table(short_len)
    assert torch.equal(held[0], own_long[0][:, :short_len]) and torch.equal(held[1], own_long[1][:, :short_len])
    assert get_patch_report(model).as_dict()["rope_factors"] == "long"
    revert_roundalign(model)
    assert torch.equal(table(short_len)[0], own_short[0])
    report = apply_roundalign(model, PAPER_REGIONS, engine_max_model_len=PHI3_LONGROPE_ORIGINAL)
    assert report.rope_factors == "short"
    assert torch.equal(table(short_len)[0], own_short[0]) and torch.equal(table(short_len)[1], own_short[1])
    revert_roundalign(model)
    # Without the "rope" region the model keeps transformers' own choice and needs no engine length.
    assert apply_roundalign(model, ("swiglu", "rmsnorm")).rope_factors is None
    revert_roundalign(model)
    assert "forward" not in rotary.__dict__ and torch.equal(table(long_len)[0], own_long[0])


def test_gemma3_none_is_transformers_and_what_is_refused():
    """Gemma 3: profile `none` on every region is transformers' `Gemma3ForCausalLM` bit for bit (the (1+w) norms, the
    sandwich, GeGLU-tanh, the scaled embedding); the compiled profile keeps the stream in fp32 (it differs); profiles
    not measured for Gemma 3 (the eager engines), soft-capping and a missing post-feedforward norm raise naming what
    is supported."""
    model = load("gemma3")
    assert model.config.model_type == "gemma3_text"
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    assert any(not torch.all(layer.post_feedforward_layernorm.weight == 0) for layer in model.model.layers)
    ids, mask = batch()
    before = logits(model, ids, mask)
    apply_roundalign(model, PAPER_REGIONS, profile="none", positions_from_mask=False)
    assert torch.equal(logits(model, ids, mask), before)
    apply_roundalign(model, PAPER_REGIONS, positions_from_mask=False)
    assert not torch.equal(logits(model, ids, mask), before)
    with torch.no_grad():
        stream = model.model.embed_tokens(ids)
    assert stream.dtype == torch.float32  # f(e) f(r(sqrt(h))), not rounded
    revert_roundalign(model)
    assert torch.equal(logits(model, ids, mask), before)
    for profile in ("vllm-eager-cpu", "vllm-eager"):
        with pytest.raises(ValueError, match=f"Profile '{profile}' was not measured for gemma3_text"):
            apply_roundalign(model, PAPER_REGIONS, profile=profile)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0.*not measured"):
        apply_roundalign(model)
    model.config.final_logit_softcapping = None
    del model.model.layers[1].post_feedforward_layernorm
    with pytest.raises(ValueError, match=r"model.layers.1 .*post_feedforward_layernorm.*gemma3_text"):
        apply_roundalign(model)


@pytest.mark.vllm
@pytest.mark.parametrize("arch", ["qwen3", "llama", "phi3", "gemma3"])
def test_exact_mode_gradients_agree_with_three_regions(arch):
    """Exact mode swaps sdpa for the engine's attention forward (fp32-recomputed backward) and the reduction order;
    its gradients must stay within 3% (relative Frobenius norm, per parameter tensor) of the three-region mode's."""
    from trl_roundalign.profiles import ALL_REGIONS

    ids, mask = batch()

    def grads(regions, profile):
        model = load(arch)
        apply_roundalign(model, regions, profile, backend="torch")
        model.train()
        out = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        out.float().log_softmax(-1).gather(-1, ids[..., None]).sum().backward()
        return {k: p.grad.float() for k, p in model.named_parameters() if p.grad is not None}

    three = grads(PAPER_REGIONS, "vllm-compiled")
    exact = grads(ALL_REGIONS, "vllm-compiled-exact")
    assert three.keys() == exact.keys()
    worst = max(((exact[k] - three[k]).norm() / three[k].norm()).item() for k in three if three[k].norm() > 0)
    assert worst < 0.03, worst
    assert any(not torch.equal(exact[k], three[k]) for k in three), "the modes must differ somewhere"
