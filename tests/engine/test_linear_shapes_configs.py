"""`models.linear_shapes` measures at the shapes each family runs, and reads every family's config as transformers 5.19 builds it: that release gives every
config a `per_layer_config` view, and a Qwen2 config's has no per-layer head dim (reading it raised; the GEMM schedule
measured on the Intel Xeon AVX-512 machine then failed every tiny-qwen2 engine). No engine: configs only."""

from __future__ import annotations

from transformers import Qwen2Config, Qwen3Config

from trl_roundalign.models import linear_shapes


def test_a_config_without_a_head_dim_field_uses_hidden_over_heads():
    cfg = Qwen2Config(num_hidden_layers=2, hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=160, vocab_size=512)
    shapes = linear_shapes(cfg)
    assert shapes["qkv_proj"] == (96, 96, 48, 48)
    assert shapes["down_proj"] == (160, 96)


def test_a_config_with_a_head_dim_field_keeps_it():
    cfg = Qwen3Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      intermediate_size=128, vocab_size=512)
    assert linear_shapes(cfg)["qkv_proj"] == (64, 128, 64, 64)


def _uncovered(model, shapes) -> list[str]:
    """The `nn.Linear` layers of a transformers model whose (in, out) no shape of `shapes` measures: neither a shape
    nor one part of a fused one (the part is what the trainer computes; the whole what the engine computes)."""
    import torch

    have = {(k, n) for k, *ns in shapes.values() for n in (*ns, sum(ns))}
    return sorted({
        f"{name.split('.')[-1]} ({m.in_features} x {m.out_features})"
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and (m.in_features, m.out_features) not in have
    })


def test_every_linear_a_tiny_family_runs_is_measured():
    """Batch invariance is measured at the shapes the model runs (every family the project builds offline, Qwen3.5's
    gated q projection and gated delta-net projections included): a linear outside them is a GEMM whose bits nobody
    measured on this machine."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trl_roundalign.local_models import SUPPORTED_TINY_ARCHS, tiny_model, tiny_qwen3_5

    paths = {arch: tiny_model(arch) for arch in SUPPORTED_TINY_ARCHS} | {"qwen3_5": tiny_qwen3_5()}
    missing = {}
    for arch, path in paths.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        if gaps := _uncovered(model, linear_shapes(AutoConfig.from_pretrained(path))):
            missing[arch] = gaps
    assert not missing, missing


def test_qwen3_5_fused_shapes_are_the_engines():
    """As vLLM 0.32 builds them (`Qwen3NextAttention`: q and its output gate in one q part; `QwenGatedDeltaNetAttention`
    with Qwen3.5's flat layout: `in_proj_qkvz` of parts [qkv | z] as the trainer computes them, `in_proj_ba` of
    [b | a]), for the tiny hybrid (hidden 128, 4 heads of 32, 2 KV heads; 2 key heads / 4 value heads of 128)."""
    from transformers import AutoConfig

    from trl_roundalign.local_models import tiny_qwen3_5

    shapes = linear_shapes(AutoConfig.from_pretrained(tiny_qwen3_5()))
    assert shapes["qkv_proj"] == (128, 256, 64, 64)
    assert shapes["in_proj_qkvz"] == (128, 2 * 256 + 512, 512)
    assert shapes["in_proj_ba"] == (128, 4, 4)
    assert shapes["out_proj"] == (512, 128)


def test_gemma4s_two_attention_layouts_are_its_specs_answer_for_shapes_and_the_prompt_horizon():
    """Gemma 4's full-attention layers are wider (head dim 512 against the sliding layers' 256): its spec answers
    both layouts (`models.attention_layouts`), which `linear_shapes` measures and the prompt-horizon measurement
    reads. The horizon used to read the config's `head_dim`, which transformers 5.19 refuses for a per-layer Gemma 4
    config (AmbiguousGlobalPerLayerAttributeError): an exact run whose engine prefilled prompts together stopped."""
    from transformers import AutoConfig

    from trl_roundalign.local_models import tiny_model
    from trl_roundalign.models import attention_layouts

    cfg = AutoConfig.from_pretrained(str(tiny_model("gemma4")))
    layouts = attention_layouts(cfg)
    assert [hd for hd, _, _ in layouts] == [256, 512]
    shapes = linear_shapes(cfg)
    for i, (hd, heads, kv) in enumerate(layouts):
        suffix = f"@{hd}" if i else ""
        assert shapes[f"qkv_proj{suffix}"][1:] == (heads * hd, kv * hd, kv * hd)
    assert attention_layouts(Qwen3Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=32)) == [(32, 4, 2)]
