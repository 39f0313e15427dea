"""Refusals that had no test: each configuration the package cannot align is refused with one line naming what
differs, and the accepted neighbour of each is accepted (so every test here can fail both ways)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trl_roundalign.engine import EngineInfo, UnknownEngineConfiguration, profile_for_engine

ONE_GRAPH = EngineInfo(
    vllm_version="0.31.0", platform="cpu", compile_mode="DYNAMO_TRACE_ONCE", enforce_eager=False, custom_ops=["none"],
    cache_dir=None, backend="inductor", splitting_ops=[], use_inductor_graph_partition=False, ir_op_priority={},
    torch_version="2.13.0+cpu",
)


def test_the_measured_configuration_is_accepted():
    assert profile_for_engine(ONE_GRAPH) == "vllm-compiled"
    assert profile_for_engine(replace(ONE_GRAPH, compile_mode="VLLM_COMPILE", splitting_ops=["vllm::unified_attention"])) == (
        "vllm-compiled-piecewise"
    )


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"vllm_version": "0.33.0"}, "vLLM version is 0.33.0"),
        ({"torch_version": "2.14.0"}, "torch is 2.14.0"),
        ({"custom_ops": ["+rms_norm"]}, "custom ops"),
        ({"custom_ops": ["all"]}, "custom ops"),
        ({"ir_op_priority": {"rms_norm": ["vllm_c"]}}, "IR op priority"),
        ({"backend": "eager"}, "compile backend is 'eager'"),
        ({"use_inductor_graph_partition": True}, "graph partitioning"),
        ({"tensor_parallel_size": 2}, "tensor parallel size is 2"),
    ],
    ids=["vllm", "torch", "custom-op", "all-custom-ops", "ir-op", "backend", "partition", "tensor-parallel"],
)
def test_an_unmeasured_engine_configuration_is_refused_naming_what_differs(change, says):
    with pytest.raises(UnknownEngineConfiguration) as err:
        profile_for_engine(replace(ONE_GRAPH, **change))
    msg = str(err.value)
    assert says in msg and "trl-roundalign probe" in msg and "\n" not in msg, msg


def test_a_custom_op_switched_off_is_not_a_refusal():
    assert profile_for_engine(replace(ONE_GRAPH, custom_ops=["none", "-rms_norm"])) == "vllm-compiled"


def test_trl_internals_that_moved_are_named():
    from trl import GRPOTrainer

    from trl_roundalign.trainer.grpo import check_trl_internals

    check_trl_internals(GRPOTrainer)  # the pinned TRL passes

    class Moved(GRPOTrainer):
        _get_per_token_logps_and_entropies = None

    with pytest.raises(RuntimeError, match=r"GRPOTrainer._get_per_token_logps_and_entropies is gone.*trl==1.16"):
        check_trl_internals(Moved)

    class Reordered(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, input_ids, model, attention_mask, logits_to_keep):
            raise AssertionError

    with pytest.raises(RuntimeError, match=r"no longer takes"):
        check_trl_internals(Reordered)


def _peft_model(**lora):
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from trl_roundalign.local_models import tiny_model

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model("qwen3")), dtype=torch.bfloat16)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **lora))


def test_dora_is_refused_and_plain_lora_is_not():
    from trl_roundalign.trainer.lora import check_lossless_supported

    check_lossless_supported(_peft_model())
    with pytest.raises(ValueError, match=r"LoRA variant adapters \(adapter 'default': Dora\w*\).*use_dora=False") as err:
        check_lossless_supported(_peft_model(use_dora=True))
    assert "\n" not in str(err.value)


def _engine_free_trainer(tmp_path, **overrides):
    """A real trainer without an engine (default BF16, no regions), on a bf16 tiny Llama: enough to build the optimizer."""
    from helpers.trainer import make_config, varied_reward

    from trl_roundalign import RoundAlignGRPOTrainer
    from trl_roundalign.data import arithmetic_dataset
    from trl_roundalign.local_models import tiny_model

    args = make_config(tmp_path, use_vllm=False, roundalign_regions=[], log_mismatch=False, max_steps=1, **overrides)
    return RoundAlignGRPOTrainer(
        model=str(tiny_model("llama")), reward_funcs=varied_reward, args=args, train_dataset=arithmetic_dataset("train[:8]")
    )


def test_bf16_parameters_without_fp32_masters_are_refused_and_with_them_accepted(tmp_path):
    """bf16 trainable parameters with `roundalign_fp32_master_weights=False` and no ZeRO/FSDP mixed precision: AdamW
    would step the bf16 parameters and updates below half an ulp would round away. The refusal is one line naming the
    setting; with the setting on, the optimizer is the fp32 master optimizer."""
    import torch

    from trl_roundalign.trainer.masters import MasterWeightsOptimizer

    refused = _engine_free_trainer(tmp_path / "off", roundalign_fp32_master_weights=False)
    assert any(p.dtype == torch.bfloat16 for p in refused.model.parameters())
    with pytest.raises(ValueError, match=r"roundalign_fp32_master_weights=False.*Set roundalign_fp32_master_weights=True") as err:
        refused.create_optimizer()
    assert "\n" not in str(err.value)

    accepted = _engine_free_trainer(tmp_path / "on")
    assert isinstance(accepted.create_optimizer(), MasterWeightsOptimizer)
