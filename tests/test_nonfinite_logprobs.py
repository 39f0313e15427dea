"""Non-finite log-probs are counted, never taken for a match: the training metrics and the start-up check's scoring."""

from __future__ import annotations

import math

import pytest
import torch

from trl_roundalign import metrics

NAN = float("nan")


def batch(deltas, *, train_nan=0):
    """`[1, T]` log-probs with the given `Δ = train - infer`; NaN in `deltas` = vLLM's side, `train_nan` leading
    training-side NaNs."""
    d = torch.tensor([deltas], dtype=torch.float32)
    infer = torch.full_like(d, -8.0)
    train = infer + torch.nan_to_num(d, nan=0.0)
    infer = torch.where(torch.isnan(d), torch.full_like(d, NAN), infer)
    if train_nan:
        train[0, :train_nan] = NAN
    return train, infer, torch.ones_like(d, dtype=torch.long)


def test_nonfinite_training_logprobs_are_counted_by_side():
    train, infer, mask = batch([0.0, 0.0, 0.0, NAN], train_nan=2)
    out = metrics.token_stats(train, infer, mask)
    assert out["mismatch/nan_tokens"] == 3.0  # two NaN on the trainer's side, one on vLLM's
    assert out["mismatch/nonfinite_train_tokens"] == 2.0
    s = metrics.merge_sums([metrics.mismatch_sums(train, infer, mask)] * 2)
    assert s.nonfinite_train == 4 and metrics.finalize(s)["mismatch/nonfinite_train_tokens"] == 4.0
    assert "mismatch/nonfinite_train_tokens" in metrics.METRIC_DOCS


def score_with(monkeypatch, policy, engine):
    """`verify._score` with the policy's forward replaced by fixed log-probs (no model, no patches)."""
    from trl_roundalign import patching, verify
    from trl_roundalign.analysis import scoring

    monkeypatch.setattr(scoring, "hf_logprobs", lambda model, seqs: [torch.tensor(p) for p in policy])
    monkeypatch.setattr(patching, "apply_roundalign", lambda *a, **k: None)
    monkeypatch.setattr(patching, "revert_roundalign", lambda *a, **k: None)
    seqs = [list(range(len(p) + 1)) for p in policy]
    return verify._score(None, seqs, [torch.tensor(e) for e in engine], ("rope",), "vllm-compiled", None, None, None)


ENGINE = [[-1.0, -2.0, -0.5, -3.0], [-0.25, -4.0]]


def test_score_is_fine_with_finite_logprobs(monkeypatch):
    s = score_with(monkeypatch, ENGINE, ENGINE)
    assert s.frac_bitwise_equal == 1.0 and s.kl_k3 == 0.0


@pytest.mark.parametrize(
    ("policy", "engine", "side", "count"),
    [
        ([[-1.0, NAN, -0.5, NAN], [-0.25, -4.0]], ENGINE, "policy", 2),  # read 100% bit-identical before
        ([[NAN] * 4, [NAN] * 2], ENGINE, "policy", 6),  # k3 NaN: every comparison False, so it passed
        ([[-1.0, -2.0, -0.5, -math.inf], [-0.25, -4.0]], ENGINE, "policy", 1),
        (ENGINE, [[-1.0, -2.0, NAN, -3.0], [-0.25, math.inf]], "engine", 2),
    ],
)
def test_score_fails_on_nonfinite_logprobs(monkeypatch, policy, engine, side, count):
    from trl_roundalign.trainer.startup_check import ProfileMismatch

    with pytest.raises(ProfileMismatch, match=rf"{count} of 6 .*not finite") as info:
        score_with(monkeypatch, policy, engine)
    assert f"{count} of 6 tokens on the {side}'s side" in str(info.value) and "'vllm-compiled'" in str(info.value)
