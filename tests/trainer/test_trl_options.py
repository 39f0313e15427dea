"""The TRL options docs/options.md lists as aligned, each trained for two steps with the mismatch metrics logged.

Each run is the tiny Qwen3 with a colocated vLLM-CPU engine under the three regions. What each option adds is
asserted where it has something to show: the reference model's log-probs computed like the policy's (beta > 0: the
first step's KL is exactly 0, both forwards on the same weights), the loss's clip band in the mismatch metrics
(CISPO), the correction's own metrics (importance sampling).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.trainer import make_config, varied_reward

from trl_roundalign import RoundAlignGRPOTrainer, get_patch_report
from trl_roundalign.data import arithmetic_dataset
from trl_roundalign.local_models import tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# In make test: the options most recipes set. make test-full trains every row.
OPTIONS = {
    "beta": ({"beta": 0.04}, True),
    "is-correction": ({"vllm_importance_sampling_correction": True}, False),
    "cispo": ({"loss_type": "cispo", "epsilon_high": 5.0}, True),
    "gspo": ({"importance_sampling_level": "sequence", "loss_type": "grpo"}, True),
    "is-token-truncate": ({"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_truncate"}, True),
    "is-token-mask": ({"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_mask"}, True),
    "is-sequence-truncate": (
        {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_truncate"}, True
    ),
    "dapo": ({"loss_type": "dapo"}, True),
    "dr-grpo": ({"loss_type": "dr_grpo"}, True),
    "bnpo": ({"loss_type": "bnpo"}, True),
    "sapo": ({"loss_type": "sapo"}, True),
    "vespo": ({"loss_type": "vespo"}, True),
    "gradient-checkpointing": ({"gradient_checkpointing": True}, True),
    "mask-truncated": ({"mask_truncated_completions": True, "max_completion_length": 8}, True),
    "num-iterations": ({"num_iterations": 2, "steps_per_generation": 1, "max_steps": 3}, True),
    "temperature": ({"temperature": 0.7}, True),
    "sync-ref-model": ({"beta": 0.04, "sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5}, True),
    "luspo": ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, True),
    "pad-to-multiple-of": ({"pad_to_multiple_of": 8}, True),
    "full-determinism": ({"full_determinism": True}, True),
    "cast-lm-head-to-fp32": ({"cast_lm_head_to_fp32": True}, True),
    "optim-adamw-torch": ({"optim": "adamw_torch"}, True),
    "positions-from-mask-off": ({"roundalign_positions_from_mask": False}, True),
    # model_init_kwargs beyond dtype: transformers' eager attention (an additive float mask) under the three regions,
    # and under the exact mode, whose attention kernel reads that mask instead of sdpa's boolean one.
    # A float16 policy with a float16 engine (fp16=True: autocast in fp16, a GradScaler, the fp32 masters).
    "fp16-policy": (
        {"fp16": True, "bf16": False, "model_init_kwargs": {"dtype": "float16"}, "vllm_engine_kwargs": {"dtype": "float16"}},
        True,
    ),
    "attn-eager": ({"model_init_kwargs": {"dtype": "bfloat16", "attn_implementation": "eager"}}, True),
    "attn-eager-exact": (
        {"model_init_kwargs": {"dtype": "bfloat16", "attn_implementation": "eager"},
         "roundalign_regions": ["rope", "swiglu", "rmsnorm", "attention"]}, False,
    ),
}


def _params():
    for name, (options, full) in OPTIONS.items():
        yield pytest.param(options, id=name, marks=[pytest.mark.full] if full else [])


@pytest.mark.parametrize("options", _params())
def test_the_option_trains_aligned_with_the_metrics_logged(tmp_path, options, closing):
    args = make_config(tmp_path, **{"max_steps": 2, "learning_rate": 1e-4, **options})
    trainer = closing(
        RoundAlignGRPOTrainer(
            model=str(tiny_model("qwen3")), reward_funcs=varied_reward, args=args,
            train_dataset=arithmetic_dataset("train[:16]"),
        )
    )
    assert trainer.roundalign_verification is not None and trainer.roundalign_verification.verdict == "ok"
    if options.get("fp16"):
        assert trainer.vllm_generation.llm.llm_engine.model_config.dtype == torch.float16
        assert {p.dtype for p in trainer.model.parameters()} == {torch.float16}
    if "attn_implementation" in options.get("model_init_kwargs", {}):
        assert trainer.model.config._attn_implementation == options["model_init_kwargs"]["attn_implementation"]
    if "attention" in options.get("roundalign_regions", []):
        # The start-up check scored the engine's sequences bit for bit under the eager mask.
        v = trainer.roundalign_verification
        assert next(c for c in v.candidates if c.profile == v.chosen).frac_bitwise_equal == 1.0, v
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    logs = [h for h in steps if "mismatch/kl_k3" in h]
    if options.get("mask_truncated_completions"):
        # The tiny model never samples its end token in 8 tokens: every completion is truncated, so masked, and no
        # token is left to compare; the metrics log nothing rather than a statistic of nothing.
        assert all(h["completions/clipped_ratio"] == 1.0 for h in steps) and logs == [], steps
        trainer.close()
        return
    # Each generated batch is compared once, at the weights it was sampled with (num_iterations=2: steps 1 and 3).
    expected = [1, 3] if options.get("num_iterations") == 2 else [1, 2]
    assert [h["step"] for h in logs] == expected, trainer.state.log_history
    for h in logs:
        assert h["mismatch/tokens"] > 0 and math.isfinite(h["mismatch/kl_k3"]), h
        assert math.isfinite(h["loss"]), h
    if options.get("beta"):
        # The reference model carries the policy's patches, and on the first step (the same weights) its
        # log-probs are the policy's bit for bit: TRL's KL is exactly 0 there.
        assert get_patch_report(trainer.ref_model) == get_patch_report(trainer.model)
        assert logs[0]["kl"] == 0.0 and logs[1]["kl"] > 0.0, [h["kl"] for h in logs]
    if options.get("loss_type") == "cispo":
        # The band CISPO clips at (r <= epsilon_high, no lower bound) is the one the mismatch metrics count.
        from trl_roundalign.trainer.callbacks import clip_band

        assert clip_band(trainer) == (1.0, 4.0)
        assert all(h["mismatch/frac_outside_clip"] == 0.0 for h in logs)  # no ratio near 5 on aligned rollouts
    if options.get("vllm_importance_sampling_correction"):
        assert any(k.startswith("sampling/") for k in logs[0]), sorted(logs[0])
    trainer.close()


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


@pytest.mark.full
def test_tool_calls_leave_the_tool_results_out_of_the_mismatch(tmp_path, closing):
    """Multi-turn generation with a tool (TRL's `tools=`, `max_tool_calling_iterations`): the tool's result tokens are
    inserted into the completion, not sampled by vLLM, and must not be compared with vLLM's log-probs.

    The offline tiny Qwen3 gets TRL's Qwen3 chat template (so TRL accepts it for tools and parses its tool calls), and
    a structured-output regex makes every completion a call of `add`: a random model would never emit one. The regex
    also makes vLLM report log-probs after its grammar mask (TRL asks for processed log-probs), so this test asserts
    the masking, not the size of the mismatch (the package warns about structured outputs for that reason)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_chat_template

    path = str(tiny_model("qwen3"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = qwen3_chat_template
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i} + 2?"}]} for i in range(8)])
    call = r'<tool_call>\n\{"name": "add", "arguments": \{"a": 1, "b": 2\}\}\n</tool_call>'
    args = make_config(tmp_path, max_steps=2, max_completion_length=128, vllm_max_model_length=1024,
                       vllm_structured_outputs_regex=call, max_tool_calling_iterations=1)  # fmt: skip
    with pytest.warns(UserWarning, match="vllm_structured_outputs_regex"):
        trainer = closing(RoundAlignGRPOTrainer(model=path, reward_funcs=varied_reward, args=args,
                                                train_dataset=dataset, processing_class=tokenizer, tools=[add]))  # fmt: skip
    generated, recorded = [], []
    generate, record = trainer._generate_and_score_completions, trainer._mismatch_callback.record

    def generate_and_keep(*a, **k):
        out = generate(*a, **k)
        generated.append({key: out[key].clone() for key in ("completion_mask", "tool_mask")})
        return out

    def record_and_keep(train_logps, sampling_logps, mask):
        recorded.append(mask.clone())
        record(train_logps, sampling_logps, mask)

    trainer._generate_and_score_completions = generate_and_keep
    trainer._mismatch_callback.record = record_and_keep
    trainer.train()
    logs = [h for h in trainer.state.log_history if "mismatch/kl_k3" in h]
    assert [h["step"] for h in logs] == [1, 2] and all(h["tools/call_frequency"] > 0 for h in logs), logs
    assert len(generated) == len(recorded) == 2
    for gen, mask, log in zip(generated, recorded, logs):
        tool_tokens = int(((gen["tool_mask"] == 0) & (gen["completion_mask"] == 1)).sum())
        assert tool_tokens > 0, "no tool result was inserted"
        # The recorded mask is the completion mask with the tool results taken out, and the logged count is its sum.
        # TRL shuffles the generated rows before the loss: compare the rows as a multiset.
        rows = sorted(tuple(r) for r in mask.bool().tolist())
        assert rows == sorted(tuple(r) for r in (gen["completion_mask"] * gen["tool_mask"]).bool().tolist())
        assert log["mismatch/tokens"] == int(mask.sum()) == int(gen["completion_mask"].sum()) - tool_tokens
    trainer.close()
