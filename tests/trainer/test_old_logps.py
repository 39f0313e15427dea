"""Exact mode's old log-probs (`trainer.old_logps`): where TRL would run a no-grad forward of the whole batch at
generation (importance-sampling correction on, `num_iterations > 1`), the sampler's log-probs stand in for it, bit for
bit: the loss, the gradients and the updated weights are those of the run that takes the forward, and the step's
check still compares the sampler with the trainer (the loss forward's log-probs). A batch with a completion token the
trainer does not reproduce takes the forward."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers.trainer import make_config, varied_reward

from trl_roundalign.trainer.old_logps import reuses_sampler_logps, sampler_old_logps


def args(**kw):
    base = dict(gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1, use_vllm=True,
                vllm_importance_sampling_correction=True, roundalign_reuse_sampler_logps=True)
    return SimpleNamespace(**{**base, **kw})


def test_where_the_sampler_stands_in_for_trls_old_forward():
    assert reuses_sampler_logps(args(), exact=True, recorded=True)
    assert not reuses_sampler_logps(args(), exact=False, recorded=True)  # not exact: the forward corrects the gap
    assert not reuses_sampler_logps(args(), exact=True, recorded=False)  # no schedule record: nothing verifies a batch
    assert not reuses_sampler_logps(args(roundalign_reuse_sampler_logps=False), exact=True, recorded=True)
    # TRL computes no old log-probs: nothing to stand in for.
    assert not reuses_sampler_logps(args(vllm_importance_sampling_correction=False), exact=True, recorded=True)
    # num_iterations > 1 (TRL needs old log-probs): each slice is first used at the generation's weights.
    assert reuses_sampler_logps(args(vllm_importance_sampling_correction=False, num_iterations=2), exact=True,
                                recorded=True)
    assert reuses_sampler_logps(args(gradient_accumulation_steps=4, steps_per_generation=4, num_iterations=2),
                                exact=True, recorded=True)
    # A generation's slices spread over optimizer steps: later slices' loss forwards cannot check the sampler.
    assert not reuses_sampler_logps(args(gradient_accumulation_steps=2, steps_per_generation=4), exact=True,
                                    recorded=True)


def test_a_batch_with_a_token_not_reproduced_or_a_missing_log_prob_takes_the_forward():
    codes = torch.zeros(2, 3, dtype=torch.int8)
    old = sampler_old_logps([[-0.5, -1.0, -2.0], [-0.25]], codes, pad_to_multiple_of=None, device="cpu")
    assert torch.equal(old, torch.tensor([[-0.5, -1.0, -2.0], [-0.25, 0.0, 0.0]]))
    codes[1, 0] = -1  # reproduced through a re-prefill (`metrics.REPREFILLED_CODE`): still stands in
    assert sampler_old_logps([[-0.5, -1.0, -2.0], [-0.25]], codes, pad_to_multiple_of=None, device="cpu") is not None
    codes[1, 0] = 2  # a cause of `mismatch/unreproduced_tokens`
    assert sampler_old_logps([[-0.5, -1.0, -2.0], [-0.25]], codes, pad_to_multiple_of=None, device="cpu") is None
    assert sampler_old_logps([[-0.5, None, -2.0], [-0.25]], torch.zeros(2, 3), pad_to_multiple_of=None,
                             device="cpu") is None


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("setting", [dict(vllm_importance_sampling_correction=True, max_steps=1),
                                     dict(vllm_importance_sampling_correction=False, num_iterations=2, max_steps=2)],
                         ids=["is-correction", "two-iterations"])
def test_the_sampler_standing_in_gives_the_same_loss_gradients_and_weights(tmp_path, closing, setting):
    """Two exact runs with the importance-sampling correction on (TRL's default), or two iterations over each
    generation (the second step's old log-probs are the first's): one takes TRL's old-logprob forward, one lets the
    sampler's log-probs stand in. Same seed, same completions: the same losses and gradient norms, and every weight
    bit-identical after the steps; the check held in both (every token bit-identical)."""
    from trl_roundalign import RoundAlignGRPOTrainer
    from trl_roundalign.data import arithmetic_dataset
    from trl_roundalign.local_models import tiny_model

    model = str(tiny_model("qwen3", num_hidden_layers=2, head_dim=128, max_position_embeddings=8192))
    runs = {}
    for reuse in (False, True):
        out = tmp_path / f"reuse-{reuse}"
        cfg = make_config(out, max_completion_length=64, roundalign_reuse_sampler_logps=reuse,
                          roundalign_regions=["rope", "swiglu", "rmsnorm", "attention"], learning_rate=1e-3,
                          generation_kwargs={"ignore_eos": True}, **setting)
        trainer = closing(RoundAlignGRPOTrainer(model=model, reward_funcs=varied_reward, args=cfg,
                                                train_dataset=arithmetic_dataset("train[:4]")))
        trainer.train()
        rows = [json.loads(x) for x in (out / "mismatch.jsonl").read_text().splitlines()[1:]]
        logged = [h for h in trainer.state.log_history if "loss" in h]
        weights = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
        runs[reuse] = (rows, logged, weights)
    (rows0, log0, w0), (rows1, log1, w1) = runs[False], runs[True]
    print(log0, log1)
    assert len(log0) == len(log1) == setting["max_steps"]
    # The sampler stood in on the generation's step (the second iteration reuses the batch, no generation).
    assert all("schedule/old_logps_from_sampler" not in h for h in log0)
    assert log1[0]["schedule/old_logps_from_sampler"] == 1.0
    # Each generation checked once, at its first use (the generation's weights), every token bit-identical.
    for rows in (rows0, rows1):
        [row] = [r for r in rows if r["mismatch/tokens"]]
        assert row["mismatch/tokens"] == 4 * 64 and row["mismatch/frac_bitwise_equal"] == 1.0, row
    assert [(h["loss"], h["grad_norm"]) for h in log0] == [(h["loss"], h["grad_norm"]) for h in log1]
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
