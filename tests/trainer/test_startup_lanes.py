"""The start-up check scores each candidate profile on the model form the trainer will run: a family that reads facts
of the engine's generated code with the reduction lanes (Gemma 4's layer-0 form, `ArchSpec.engine_code_facts`) gets
the lanes under every profile, as the trainer's own patching does (`models.takes_engine_lanes`, the one home of that
decision). Before, `_score` handed them to the exact profiles only, so the non-exact Gemma 4 candidate was scored
on the schedule-rule form (73 of 73 tokens differed) while the trainer ran the engine-code form. No engine: the lanes
are handed in as read."""

from __future__ import annotations

import torch

from trl_roundalign.local_models import tiny_model


def test_the_start_up_check_scores_gemma4s_non_exact_profile_with_the_engines_code_facts():
    from transformers import AutoModelForCausalLM

    from trl_roundalign.engine.lanes import EngineLanes
    from trl_roundalign.models import ARCH_SPECS, default_reduction_lanes, find_backbone
    from trl_roundalign.trainer.startup_check import _score

    model = AutoModelForCausalLM.from_pretrained(tiny_model("gemma4"), dtype=torch.bfloat16)
    lanes = default_reduction_lanes(2, True, spec=ARCH_SPECS["gemma4_text"])
    seqs = [list(range(3, 15))]
    engine = [torch.zeros(11)]
    for read in (1, 2):
        for profile in ("vllm-compiled", "vllm-compiled-exact"):
            regions = ("rope", "swiglu", "rmsnorm")
            _score(model, seqs, engine, regions, profile, None, EngineLanes(lanes, embedding_kernels=read), None)
            state = find_backbone(model).layers[0].__dict__["_roundalign"]
            assert state.originals.get("engine_embedding_kernels") == read, (profile, read)


def test_which_profiles_take_the_engines_lanes_is_one_decision():
    from transformers import AutoModelForCausalLM

    from trl_roundalign.models import takes_engine_lanes

    qwen = AutoModelForCausalLM.from_pretrained(tiny_model("qwen3"), dtype=torch.bfloat16)
    gemma4 = AutoModelForCausalLM.from_pretrained(tiny_model("gemma4"), dtype=torch.bfloat16)
    assert takes_engine_lanes(qwen, "vllm-compiled-exact") and not takes_engine_lanes(qwen, "vllm-compiled")
    assert takes_engine_lanes(gemma4, "vllm-compiled") and takes_engine_lanes(gemma4, "vllm-compiled-exact")
    assert not takes_engine_lanes(qwen, "none")
