"""One home per model fact (`trl_roundalign.models`): whether a model has an exact mode here (`exact_refusal_for`),
asked with a config, a multimodal config's text part, or a loaded model, by the start-up check, `analyze` and the
numerics card alike. No engine."""

from __future__ import annotations

import torch


def test_exact_refusal_is_one_answer_for_a_config_and_its_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    from trl_roundalign.local_models import tiny_model, tiny_qwen3_5
    from trl_roundalign.models import exact_refusal_for

    hybrid = tiny_qwen3_5()
    refusal = exact_refusal_for(AutoConfig.from_pretrained(hybrid))
    assert refusal is not None and "3 of its 4 layers are gated delta-net layers" in refusal
    assert exact_refusal_for(AutoModelForCausalLM.from_pretrained(hybrid, dtype=torch.bfloat16)) == refusal
    qwen3 = tiny_model("qwen3")
    assert exact_refusal_for(AutoConfig.from_pretrained(qwen3)) is None
    assert exact_refusal_for(AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.bfloat16)) is None
