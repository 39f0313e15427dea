"""Tensor parallelism with LoRA on a row-parallel layer (issue 37, defect 2): the PEFT-wrapped `o_proj` used to keep
plain `F.linear` while `down_proj` summed the engine's shards, silently; now it is refused in one line, before
loading in colocate mode and when the TP form is installed otherwise (a server's TP size is known from /server_info)."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")


def test_install_tp_linears_refuses_a_lora_wrapped_row_parallel_layer(tiny_models):
    from transformers import AutoModelForCausalLM

    from trl_roundalign.engine.tp import install_tp_linears

    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen3"], dtype=torch.bfloat16)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "o_proj"]))
    with pytest.raises(ValueError, match=r"^LoRA targets the row-parallel layer\(s\) o_proj, which a tensor_parallel_size=2 engine") as e:
        install_tp_linears(wrapped, 2, 0)
    assert "\n" not in str(e.value)
    plain = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_models["qwen3"], dtype=torch.bfloat16),
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    assert install_tp_linears(plain, 2, 0) == 2 * plain.config.num_hidden_layers  # o_proj and down_proj of each layer


@pytest.mark.parametrize("targets", [["q_proj", "o_proj"], "all-linear"])
def test_the_trainer_refuses_it_before_loading(tiny_models, tmp_path, targets):
    from helpers.trainer import make_config, varied_reward

    from trl_roundalign import RoundAlignGRPOTrainer
    from trl_roundalign.data import arithmetic_dataset
    from trl_roundalign.engine.dispatch import is_vllm_cpu

    if not is_vllm_cpu():
        pytest.skip("colocate TP=2 is aligned on vLLM-CPU only (refused elsewhere by check_options)")
    args = make_config(tmp_path, vllm_tensor_parallel_size=2, roundalign_regions=["rope", "swiglu", "rmsnorm"])
    with pytest.raises(ValueError, match=r"^LoRA targets the row-parallel layer\(s\) (o_proj|o_proj, down_proj), "):
        RoundAlignGRPOTrainer(
            model=str(tiny_models["qwen3"]), reward_funcs=varied_reward, args=args,
            train_dataset=arithmetic_dataset("train[:8]"), peft_config=peft.LoraConfig(r=4, target_modules=targets),
        )  # fmt: skip
