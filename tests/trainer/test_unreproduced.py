"""Exact mode under KV pressure: the issue's preemption run, through TRL, every completion token bit-identical.

A tiny Qwen3 (head dim 128), exact regions, GRPO colocated, 4 completions of 1,024 tokens (EOS ignored), and a KV cache
of 24 blocks of 128 tokens where the step's sequences need 36: vLLM preempts, frees a request's KV and prefills its
prompt and tokens again later. Measured before the schedule record (AMD AVX2): 89.4% and 87.4% of tokens bit-identical,
no warning, no log field. Now the engine's own record names each re-prefill, the trainer recomputes each stretch after
one by a forward with that prefill (`trainer.unreproduced.reproduce_reprefills`), and every token is bit-identical to
the sampler; the step says how many tokens came through a re-prefill (`mismatch/reprefilled_tokens`)."""

from __future__ import annotations

import json

import pytest
from helpers.trainer import long_prompts, make_config, varied_reward

from trl_roundalign import RoundAlignGRPOTrainer
from trl_roundalign.data import arithmetic_dataset
from trl_roundalign.local_models import tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


# Where the trainer's log-probs are computed: at generation (TRL's old log-probs, for vLLM's importance sampling), or
# in the loss's forward (with the correction off), whose gradient the stretches' forwards then carry.
@pytest.mark.parametrize("correction", [True, False], ids=["at-generation", "in-the-loss"])
def test_a_preempting_engine_is_reproduced_bit_for_bit(tmp_path, closing, correction):
    model = str(tiny_model("qwen3", num_hidden_layers=2, head_dim=128, max_position_embeddings=8192))
    args = make_config(
        tmp_path, max_steps=1, max_completion_length=1024, vllm_max_model_length=1280,
        roundalign_regions=["rope", "swiglu", "rmsnorm", "attention"], generation_kwargs={"ignore_eos": True},
        vllm_engine_kwargs={"num_gpu_blocks_override": 24}, roundalign_stop_on_unreproduced=True,
        vllm_importance_sampling_correction=correction, roundalign_reuse_sampler_logps=False,  # TRL's forward runs
    )
    trainer = closing(RoundAlignGRPOTrainer(model=model, reward_funcs=varied_reward, args=args,
                                            train_dataset=arithmetic_dataset("train[:4]")))
    trainer.train()
    [row] = [json.loads(x) for x in (tmp_path / "mismatch.jsonl").read_text().splitlines()[1:]]
    print({k: v for k, v in row.items() if k.startswith("mismatch/")})
    assert row["mismatch/tokens"] == 4 * 1024
    assert 0 < row["mismatch/reprefilled_tokens"] < 4 * 1024  # the engine preempted: the case is exercised
    assert row["mismatch/unreproduced_tokens"] == 0
    assert row["mismatch/frac_bitwise_equal"] == 1.0 and row["mismatch/kl_k3"] == 0.0


def test_vllms_chunked_prefill_is_reproduced_bit_for_bit(tmp_path, closing):
    """vLLM's chunked prefill on, with a step budget of 200 tokens (prefix caching off, to see chunks alone): every
    prompt of about 570 tokens is prefilled in chunks whose boundaries depend on what else the step held (other
    prompts' chunks, decodes) and fall inside KV blocks (200, 400, ...). Measured before the chunks were reproduced (AMD
    AVX2): the tokens counted as `prefill_chunked`, and 29-34% bit-identical in the issue's longer run. The engine's
    record gives each request's cuts; the trainer computes each chunk as a request with past keys, and every
    completion token is the sampler's."""
    model = str(tiny_model("qwen3", num_hidden_layers=2, head_dim=128, max_position_embeddings=8192))
    args = make_config(
        tmp_path, max_steps=1, per_device_train_batch_size=8, num_generations=4, max_completion_length=64,
        vllm_max_model_length=1024, roundalign_regions=["rope", "swiglu", "rmsnorm", "attention"],
        generation_kwargs={"ignore_eos": True}, roundalign_stop_on_unreproduced=True,
        vllm_engine_kwargs={"enable_chunked_prefill": True, "max_num_batched_tokens": 200,
                            "enable_prefix_caching": False},
    )
    trainer = closing(RoundAlignGRPOTrainer(model=model, reward_funcs=varied_reward, args=args,
                                            train_dataset=long_prompts(8)))
    trainer.train()
    assert trainer.roundalign_layout.chunked_prefill is True and trainer.roundalign_layout.max_num_batched_tokens == 200
    [row] = [json.loads(x) for x in (tmp_path / "mismatch.jsonl").read_text().splitlines()[1:]]
    print({k: v for k, v in row.items() if k.startswith("mismatch/")})
    assert row["mismatch/tokens"] == 8 * 64 and row["mismatch/unreproduced_tokens"] == 0
    assert row["mismatch/frac_bitwise_equal"] == 1.0 and row["mismatch/kl_k3"] == 0.0


@pytest.mark.parametrize("budget", [None, 200], ids=["vllm-defaults", "budget-200"])
def test_prefix_caching_is_reproduced_bit_for_bit(tmp_path, closing, budget):
    """vLLM's defaults (chunked prefill, TRL's step budget of 4,096, prefix caching on): the copies of a GRPO prompt
    after the first take its whole blocks from the prefix cache (512 of about 570 tokens here) and prefill only the
    tail. The engine cuts every prefill at the cache's block boundaries, so a cached block's bits depend only on the
    tokens up to it and where computations started inside it, which the scheduler notes per block and a hit inherits;
    the trainer computes each copy's prompt in those pieces. With a 200-token budget the first copy's chunks start
    inside blocks (200, 400), and the copies inherit them. Measured without the inherited starts (AMD AVX2): 67.6% and
    75.0% of tokens bit-identical; with the engine's prefills not cut at block boundaries: 11.3%."""
    model = str(tiny_model("qwen3", num_hidden_layers=2, head_dim=128, max_position_embeddings=8192))
    args = make_config(
        tmp_path, max_steps=1, per_device_train_batch_size=8, num_generations=4, max_completion_length=64,
        vllm_max_model_length=1024, roundalign_regions=["rope", "swiglu", "rmsnorm", "attention"],
        generation_kwargs={"ignore_eos": True}, roundalign_stop_on_unreproduced=True,
        vllm_engine_kwargs=None if budget is None else {"max_num_batched_tokens": budget},
    )
    trainer = closing(RoundAlignGRPOTrainer(model=model, reward_funcs=varied_reward, args=args,
                                            train_dataset=long_prompts(8)))
    trainer.train()
    layout = trainer.roundalign_layout
    assert layout.prefix_caching is True and layout.chunked_prefill is True and layout.prompts_alone
    # The start-up check exercised each form too, and held bit for bit: a prefix hit (its second copy of one prompt),
    # a chunked prefill and a preemption (provoked through the engine's scheduler), whose re-prefill starts from the
    # request's own cached block (a second prefix hit).
    check = trainer.roundalign_verification
    assert check.sampler_bitwise == 1.0 and check.sampler_tokens == 328 + 140 + 24
    assert check.sampler_forms == {"prefix hit": 2, "chunked": 1, "re-prefilled": 1}
    [logged] = [h for h in trainer.state.log_history if "schedule/prefix_cached_tokens" in h]
    assert logged["schedule/prefix_cached_tokens"] == 2 * 3 * 512  # 3 copies of each prompt hit its 4 whole blocks
    [row] = [json.loads(x) for x in (tmp_path / "mismatch.jsonl").read_text().splitlines()[1:]]
    print({k: v for k, v in row.items() if k.startswith("mismatch/")}, logged)
    assert row["mismatch/tokens"] == 8 * 64 and row["mismatch/unreproduced_tokens"] == 0
    assert row["mismatch/frac_bitwise_equal"] == 1.0 and row["mismatch/kl_k3"] == 0.0


@pytest.mark.full
def test_the_issues_target_long_prompts_long_completions_a_quarter_of_the_kv_cache(tmp_path):
    """The schedule issue's target, through TRL with vLLM's defaults (chunked prefill, TRL's step budget, prefix
    caching): one prompt of 4,000 tokens sampled 8 times, completions of 2,048 tokens, a KV cache holding a quarter of
    the step's tokens, so the engine takes 7 of 8 prompt copies from its prefix cache and preempts and re-prefills.
    Every completion token bit-identical to the sampler (`scripts/schedule_matrix.py` writes the table with it)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "schedule_matrix.py"
    spec = importlib.util.spec_from_file_location("schedule_matrix", path)
    matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(matrix)
    row = matrix.run_case(str(tiny_model("qwen3", num_hidden_layers=2, head_dim=128, max_position_embeddings=8192)),
                          *matrix.CASES["target-p4000-c2048-kv-quarter"])
    print(row)
    assert row["tokens"] == 8 * 2048 and row["unreproduced"] == 0
    assert row["prefix_cached"] > 0 and row["preemptions"] > 0 and row["reprefilled"] > 0
    assert row["bitwise"] == 1.0 and row["k3"] == 0.0
