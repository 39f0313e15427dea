"""The 2026 families refused with what stands in the way, in one line (issue 40), not a generic "unsupported"."""

from __future__ import annotations

import pytest

from trl_roundalign.models import get_spec


def test_an_unknown_family_lists_the_supported_ones():
    with pytest.raises(ValueError, match="supported: llama"):
        get_spec("not_a_family")


@pytest.mark.parametrize("overrides,names", [
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 64},
     ["MoE layers", "router"]),
    ({"num_kv_shared_layers": 1}, ["num_kv_shared_layers=1", "KV-shared layers not measured"]),
    ({"attention_k_eq_v": True}, ["attention_k_eq_v=True"]),
    ({"final_logit_softcapping": 30.0}, ["final_logit_softcapping=30.0"]),
    ({"hidden_size_per_layer_input": 0}, ["no per-layer inputs"]),
])
def test_gemma4_refuses_what_was_not_measured_in_one_line(overrides, names):
    """Gemma 4 is aligned for dense models with per-layer inputs (tests/models/test_gemma4_vllm.py); the rest of its
    configurations were not measured against the engine and are refused, each with its reason."""
    from transformers import Gemma4TextConfig

    from trl_roundalign.models import ARCH_SPECS

    cfg = Gemma4TextConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=32, **overrides)
    with pytest.raises(ValueError) as e:
        ARCH_SPECS["gemma4_text"].check_config(cfg)
    line = str(e.value)
    assert "\n" not in line and line.startswith("This gemma4_text model has ")
    assert all(n in line for n in names), line


def test_gemma4_dense_with_per_layer_inputs_is_accepted():
    from transformers import Gemma4TextConfig

    from trl_roundalign.models import ARCH_SPECS, get_spec

    assert get_spec("gemma4_text") is ARCH_SPECS["gemma4_text"]
    ARCH_SPECS["gemma4_text"].check_config(Gemma4TextConfig(hidden_size=64, num_hidden_layers=2, head_dim=32))


@pytest.mark.parametrize("overrides,names", [
    ({"hidden_act": "gelu"}, ["hidden_act='gelu'"]),
    ({"layer_types": ["linear_attention", "sliding_attention"], "num_hidden_layers": 2}, ["layer_types ['sliding_attention']"]),
])
def test_qwen3_5_refuses_what_was_not_measured_in_one_line(overrides, names):
    """Qwen3.5 (dense text) is aligned (tests/models/test_qwen3_5_vllm.py); a configuration outside what was measured
    is refused with its reason."""
    from transformers import Qwen3_5TextConfig

    from trl_roundalign.models import ARCH_SPECS

    cfg = Qwen3_5TextConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, **overrides)
    with pytest.raises(ValueError) as e:
        ARCH_SPECS["qwen3_5_text"].check_config(cfg)
    line = str(e.value)
    assert "\n" not in line and line.startswith("This qwen3_5_text model has ")
    assert all(n in line for n in names), line


@pytest.mark.parametrize("model_type,config,names", [
    ("olmo2", {"attention_bias": True}, ["attention_bias=True", "Supported: OLMo 2"]),
    ("gemma3_text", {"final_logit_softcapping": 30.0}, ["final_logit_softcapping=30.0", "Supported: Gemma 3"]),
])
def test_gemma3_and_olmo2_refuse_what_was_not_measured_in_one_line(model_type, config, names):
    from transformers import Gemma3TextConfig, Olmo2Config

    from trl_roundalign.models import ARCH_SPECS

    cfg = (Olmo2Config if model_type == "olmo2" else Gemma3TextConfig)(**config)
    with pytest.raises(ValueError) as e:
        ARCH_SPECS[model_type].check_config(cfg)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"This {model_type} model has ")
    assert all(n in line for n in names), line
