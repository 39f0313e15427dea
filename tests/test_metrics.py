"""Mismatch statistics on hand-built tensors with known answers."""

from __future__ import annotations

import math
import os
import tempfile
from types import SimpleNamespace

import pytest
import torch

from trl_roundalign import metrics
from trl_roundalign.metrics import (
    METRIC_DOCS,
    METRIC_KEYS,
    MismatchSums,
    empty_sums,
    finalize,
    kl_k1,
    kl_k3,
    merge_sums,
    mismatch_sums,
    quantile_linear,
    reduce_across_processes,
    token_stats,
)

L = float(torch.tensor(math.log(2.0), dtype=torch.float32))  # ln 2 as the nearest fp32 number
NAN = float("nan")


def hand_batch():
    """Three rows: known log-ratios, a NaN inside the mask, padding (one NaN in padding), an all-padding row.

    Valid log-ratios Δ = train - infer: row 0: [L, -L, 0]; row 1: [0.125, (NaN, excluded), 0.25]; row 2: none.
    """
    train = torch.tensor(
        [
            [0.0, -2 * L, -1.5, 0.0],
            [-0.5, -1.0, -3.0, NAN],
            [-1.0, -1.0, 0.0, 0.0],
        ],
        dtype=torch.float32,
    )
    infer = torch.tensor(
        [
            [-L, -L, -1.5, 0.0],
            [-0.625, NAN, -3.25, 0.0],
            [-2.0, -3.0, 0.0, 0.0],
        ],
        dtype=torch.float32,
    )
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 0]])
    return train, infer, mask


def test_hand_built_batch_known_answers():
    train, infer, mask = hand_batch()
    s = mismatch_sums(train, infer, mask)
    assert s.tokens == 5
    assert s.nan_tokens == 1  # the NaN inside the mask; the one on padding is not counted
    assert s.bitwise_equal == 1  # -1.5 vs -1.5
    assert s.outside_clip == 3  # r = 2, 0.5 and exp(0.25) = 1.28; exp(0.125) = 1.13 and 1 are inside
    assert s.k1_sum == -0.375  # -(L - L + 0 + 0.125 + 0.25), exact
    assert s.abs_diff_sum == 2 * L + 0.375
    assert s.abs_diff_max == L
    assert torch.equal(s.seq_log_ratios, torch.tensor([0.0, 0.375], dtype=torch.float64))  # row 2 has no token
    # |Δ| = [0, .125, .25, L, L] in four histogram buckets, each holding one distinct value.
    assert s.abs_diff_counts.tolist() == [1, 1, 1, 2]
    assert s.abs_diff_bounds[:, 0].tolist() == s.abs_diff_bounds[:, 1].tolist() == [0.0, 0.125, 0.25, L]

    out = finalize(s)
    assert list(out) == list(METRIC_KEYS)
    k3 = (math.expm1(L) - L) + (math.expm1(-L) + L) + (math.expm1(0.125) - 0.125) + (math.expm1(0.25) - 0.25)
    assert out["mismatch/kl_k1"] == pytest.approx(-0.075, rel=1e-15)
    assert out["mismatch/kl_k3"] == pytest.approx(k3 / 5, rel=1e-12)
    # ±ln 2 alone: k3 = (2 - 1 - ln 2) + (0.5 - 1 + ln 2) = 0.5
    assert (math.expm1(L) - L) + (math.expm1(-L) + L) == pytest.approx(0.5, abs=1e-7)
    assert out["mismatch/abs_logp_diff/mean"] == pytest.approx((2 * L + 0.375) / 5, rel=1e-15)
    # sorted |Δ| = [0, .125, .25, L, L]: p50 at position 2, p90 at 3.6, p99 at 3.96 (both between L and L)
    assert out["mismatch/abs_logp_diff/p50"] == 0.25
    assert out["mismatch/abs_logp_diff/p90"] == L
    assert out["mismatch/abs_logp_diff/p99"] == L
    assert out["mismatch/abs_logp_diff/max"] == L
    assert out["mismatch/ratio/min"] == pytest.approx(0.5, rel=1e-7)
    assert out["mismatch/ratio/max"] == pytest.approx(2.0, rel=1e-7)
    assert out["mismatch/frac_outside_clip"] == 0.6
    assert out["mismatch/frac_bitwise_equal"] == 0.2
    assert out["mismatch/seq_log_ratio/mean"] == 0.1875
    assert out["mismatch/seq_log_ratio/max_abs"] == 0.375
    assert out["mismatch/tokens"] == 5.0
    assert out["mismatch/nan_tokens"] == 1.0


def test_k1_k3_for_plus_minus_log2():
    # vLLM p = 1/2 for both tokens; the trainer gives 1 (r = 2) and 1/4 (r = 1/2)
    train = torch.tensor([[0.0, -2 * L]])
    infer = torch.tensor([[-L, -L]])
    out = token_stats(train, infer)
    assert out["mismatch/kl_k1"] == 0.0  # -(L) + L, exact
    assert out["mismatch/kl_k3"] == pytest.approx(0.25, abs=1e-7)  # ((1 - ln 2) + (ln 2 - 1/2)) / 2
    assert kl_k1(train, infer) == 0.0
    assert kl_k3(train, infer) == pytest.approx(0.25, abs=1e-7)
    # r = 2 alone: k1 = -ln 2, k3 = 1 - ln 2
    assert kl_k1(train[:, :1], infer[:, :1]) == -L
    assert kl_k3(train[:, :1], infer[:, :1]) == pytest.approx(1 - math.log(2), abs=1e-7)


def test_k3_is_accurate_for_tiny_differences_and_never_negative():
    d = 1e-4
    train = torch.tensor([[-1.0]], dtype=torch.float64)
    infer = train - d
    expected = d * d / 2 + d**3 / 6
    assert kl_k3(train, infer) == pytest.approx(expected, rel=1e-6)
    g = torch.Generator().manual_seed(0)
    a, b = -torch.rand(4, 50, generator=g) * 5, -torch.rand(4, 50, generator=g) * 5
    s = mismatch_sums(a, b, None)
    assert s.k3_sum >= 0
    assert kl_k3(a, b) >= 0


def test_nan_tokens_are_excluded_and_counted():
    train = torch.tensor([[-1.0, -2.0, -3.0, -4.0]])
    infer = torch.tensor([[NAN, -2.5, NAN, float("-inf")]])
    mask = torch.tensor([[1, 1, 0, 1]])  # the NaN at position 2 is padding
    out = token_stats(train, infer, mask)
    assert out["mismatch/tokens"] == 1.0
    assert out["mismatch/nan_tokens"] == 2.0  # a NaN and a -inf inside the mask
    assert out["mismatch/kl_k1"] == -0.5
    # NaN on the training side is excluded too
    out = token_stats(torch.tensor([[NAN, -1.0]]), torch.tensor([[-1.0, -1.0]]))
    assert (out["mismatch/tokens"], out["mismatch/nan_tokens"]) == (1.0, 1.0)
    assert out["mismatch/frac_bitwise_equal"] == 1.0


def test_padding_is_excluded_whatever_its_values():
    train = torch.tensor([[-1.0, -1.0, 5.0, -100.0]])
    infer = torch.tensor([[-1.0, -1.0, 0.0, 0.0]])
    out = token_stats(train, infer, torch.tensor([[1, 1, 0, 0]]))
    assert out["mismatch/tokens"] == 2.0
    assert out["mismatch/abs_logp_diff/max"] == 0.0
    assert out["mismatch/frac_bitwise_equal"] == 1.0
    assert out["mismatch/seq_log_ratio/max_abs"] == 0.0
    # a boolean mask and a float mask mean the same
    out_bool = token_stats(train, infer, torch.tensor([[True, True, False, False]]))
    out_float = token_stats(train, infer, torch.tensor([[1.0, 1.0, 0.0, 0.0]]))
    assert out_bool == out_float == out


def test_bitwise_equal_counts_only_identical_fp32_values():
    x = torch.tensor([-1.0, -0.3, -2.5, -7.125])
    y = x.clone()
    y[1] = torch.nextafter(y[1], torch.tensor(0.0))  # one ulp away
    y[3] = torch.nextafter(y[3], torch.tensor(-10.0))
    s = mismatch_sums(x[None], y[None], None)
    assert s.bitwise_equal == 2
    assert s.abs_diff_max > 0
    # bf16 inputs compare after an exact upcast
    s = mismatch_sums(x[None].bfloat16(), x[None].bfloat16(), None)
    assert s.bitwise_equal == 4


def test_clip_band_is_strict_and_uses_both_widths():
    train = torch.tensor([[0.0, 0.0, 0.0, -2 * L]])
    infer = torch.tensor([[0.0, -L, -1e-3, -L]])  # r = 1, 2, exp(1e-3), 0.5
    s = mismatch_sums(train, infer, None, clip_eps_low=0.0, clip_eps_high=0.0)
    assert s.outside_clip == 3  # r = 1 exactly is inside even for a zero-width band
    s = mismatch_sums(train, infer, None, clip_eps_low=0.6, clip_eps_high=0.2)
    assert s.outside_clip == 1  # only r = 2: 0.5 >= 0.4 and 1.001 <= 1.2
    s = mismatch_sums(train, infer, None, clip_eps_low=0.2, clip_eps_high=1.5)
    assert s.outside_clip == 1  # only r = 0.5
    assert finalize(s)["mismatch/frac_outside_clip"] == 0.25


def test_per_sequence_log_ratio_sums():
    train = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, 0.0], [-1.0, -1.0, -1.0]])
    infer = torch.tensor([[-1.5, -1.25, -1.0], [-1.0, -1.5, 0.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    s = mismatch_sums(train, infer, mask)
    assert s.seq_log_ratios.tolist() == [0.75, -1.5]
    out = finalize(s)
    assert out["mismatch/seq_log_ratio/mean"] == -0.375
    assert out["mismatch/seq_log_ratio/max_abs"] == 1.5


@pytest.mark.parametrize("mask", [torch.zeros(2, 3), torch.zeros(0, 0)], ids=["all-padding", "empty-tensors"])
def test_no_valid_tokens(mask):
    shape = mask.shape
    out = token_stats(-torch.ones(shape), -torch.ones(shape), mask)
    assert set(out) == set(METRIC_KEYS)
    assert out["mismatch/tokens"] == 0.0 and out["mismatch/nan_tokens"] == 0.0
    counts = [k for k in METRIC_KEYS if k.startswith(("mismatch/unreproduced_tokens", "mismatch/reprefilled_tokens"))]
    for key in METRIC_KEYS:
        if key not in ("mismatch/tokens", "mismatch/nan_tokens", "mismatch/nonfinite_train_tokens", *counts):
            assert math.isnan(out[key]), key
    assert out["mismatch/nonfinite_train_tokens"] == 0.0
    assert len(counts) == 6 and all(out[k] == 0.0 for k in counts)  # counts of no tokens


def test_only_nan_tokens():
    out = token_stats(-torch.ones(1, 3), torch.full((1, 3), NAN))
    assert out["mismatch/tokens"] == 0.0 and out["mismatch/nan_tokens"] == 3.0
    assert math.isnan(out["mismatch/kl_k3"]) and math.isnan(out["mismatch/seq_log_ratio/mean"])


def test_shape_checks_and_1d_inputs():
    with pytest.raises(ValueError, match="differ in shape"):
        mismatch_sums(torch.zeros(2, 3), torch.zeros(2, 4), None)
    with pytest.raises(ValueError, match="differ in shape"):
        mismatch_sums(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        mismatch_sums(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3), None)
    one = token_stats(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.0]))
    two = token_stats(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]]))
    assert one == two


def test_quantile_linear_matches_the_definition_and_torch():
    v = torch.tensor([4.0, 0.0, 3.0, 1.0, 2.0])
    assert quantile_linear(v, [0.0, 0.5, 0.9, 0.99, 1.0]) == pytest.approx([0.0, 2.0, 3.6, 3.96, 4.0], abs=1e-15)
    assert quantile_linear(torch.tensor([7.0]), [0.5, 0.99]) == [7.0, 7.0]
    assert all(math.isnan(x) for x in quantile_linear(torch.zeros(0), [0.5, 0.9]))
    with pytest.raises(ValueError):
        quantile_linear(v, [1.5])
    g = torch.Generator().manual_seed(1)
    for n in (2, 17, 1000):
        x = torch.rand(n, generator=g, dtype=torch.float64)
        qs = [0.5, 0.9, 0.99]
        ours = quantile_linear(x, qs)
        ref = torch.quantile(x, torch.tensor(qs, dtype=torch.float64), interpolation="linear").tolist()
        assert ours == pytest.approx(ref, rel=0, abs=1e-15)


@pytest.mark.parametrize("seed", range(4))
def test_histogram_quantiles_within_the_stated_bound(seed):
    """Against the exact linear-interpolation quantiles of the same fp32 values: relative error <= HIST_REL_ERROR."""
    from trl_roundalign.metrics import HIST_REL_ERROR, MismatchSums

    g = torch.Generator().manual_seed(seed)
    n = 20000
    # |Δ| over many octaves (1e-9 .. 10), with ties and exact zeros, as logged mismatches look.
    v = torch.exp(torch.empty(n, dtype=torch.float64).uniform_(math.log(1e-9), math.log(10.0), generator=g))
    v[torch.rand(n, generator=g) < 0.3] = 0.0
    v[:50] = v[50]
    train = -torch.rand(1, n, generator=g, dtype=torch.float64)
    infer = train - v[None, :] * torch.where(torch.rand(1, n, generator=g) < 0.5, 1.0, -1.0).double()
    s = mismatch_sums(train, infer, None)
    exact_values = (train - infer).abs().float().reshape(-1)
    qs = [0.0, 0.01, 0.3, 0.5, 0.9, 0.99, 0.999, 1.0]
    want = quantile_linear(exact_values, qs)
    from trl_roundalign.metrics import histogram_quantiles

    got = histogram_quantiles(s.abs_diff_buckets, s.abs_diff_counts, s.abs_diff_bounds, qs)
    for q, a, b in zip(qs, got, want):
        assert abs(a - b) <= HIST_REL_ERROR * b, (q, a, b)
    assert got[0] == want[0] == 0.0  # a bucket of one distinct value (the zeros) stands for it exactly
    # Bounded size: one bucket per (octave, 8 mantissa bits) seen, far fewer than the tokens.
    assert s.abs_diff_buckets.numel() < 34 * 256 and s.abs_diff_buckets.numel() < n
    assert isinstance(s, MismatchSums)


def _random_batch(seed: int, b: int = 7, t: int = 11):
    g = torch.Generator().manual_seed(seed)
    infer = -torch.rand(b, t, generator=g) * 4
    noise = torch.randn(b, t, generator=g) * 0.05
    noise[torch.rand(b, t, generator=g) < 0.2] = 0.0  # some bitwise-equal tokens
    train = infer + noise
    infer[torch.rand(b, t, generator=g) < 0.1] = NAN
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    return train, infer, mask


def _assert_merge_equals_union(parts: list[MismatchSums], union: MismatchSums):
    merged = merge_sums(parts)
    # exact: counts, extrema, concatenated values
    for name in ("tokens", "nan_tokens", "nonfinite_train", "bitwise_equal", "outside_clip", "ratio_min", "ratio_max", "abs_diff_max"):
        assert getattr(merged, name) == getattr(union, name), name
    assert torch.equal(merged.seq_log_ratios, union.seq_log_ratios)
    for name in ("abs_diff_buckets", "abs_diff_counts", "abs_diff_bounds"):
        assert torch.equal(getattr(merged, name), getattr(union, name)), name
    # float64 sums in a different order: equal up to float64 rounding (module docstring)
    for name in ("k1_sum", "k3_sum", "abs_diff_sum"):
        assert getattr(merged, name) == pytest.approx(getattr(union, name), rel=1e-12, abs=1e-15), name
    fm, fu = finalize(merged), finalize(union)
    assert list(fm) == list(fu)
    for key in fu:
        assert fm[key] == pytest.approx(fu[key], rel=1e-12, abs=1e-15, nan_ok=True), key
    return merged


def test_merge_equals_union_of_tokens():
    train, infer, mask = _random_batch(0)
    union = mismatch_sums(train, infer, mask)
    cuts = [(0, 2), (2, 3), (3, 3), (3, 7)]  # including an empty part
    parts = [mismatch_sums(train[a:b], infer[a:b], mask[a:b]) for a, b in cuts]
    _assert_merge_equals_union(parts, union)


def test_merge_takes_the_extremes_wherever_they_fall():
    """A merge's min/max ratio and max |Δ| are the extremes over every part, whichever part holds them, in any order
    (the union test above happens to hold its minimum ratio in its last part, where "the last part's" also passes)."""
    train, infer, mask = _random_batch(0)
    union = mismatch_sums(train, infer, mask)
    parts = [mismatch_sums(train[i : i + 1], infer[i : i + 1], mask[i : i + 1]) for i in range(train.shape[0])]
    assert union.ratio_min < 1.0 < union.ratio_max
    for order in (parts, parts[::-1], parts[3:] + parts[:3]):
        merged = merge_sums(order)
        got = (merged.ratio_min, merged.ratio_max, merged.abs_diff_max)
        assert got == (union.ratio_min, union.ratio_max, union.abs_diff_max), got


def test_merge_is_bitwise_when_the_sums_are_exact():
    # dyadic log-ratios: every partial sum is exact, so every order gives the same bits
    infer = -torch.arange(1, 13, dtype=torch.float32).reshape(3, 4) / 8
    train = infer + torch.tensor([0.5, -0.25, 0.125, 0.0]).repeat(3, 1)
    union = mismatch_sums(train, infer, None)
    merged = merge_sums([mismatch_sums(train[i : i + 1], infer[i : i + 1], None) for i in range(3)])
    assert merged.k1_sum == union.k1_sum == -3 * 0.375
    assert merged.abs_diff_sum == union.abs_diff_sum == 3 * 0.875
    assert finalize(merged)["mismatch/kl_k1"] == finalize(union)["mismatch/kl_k1"]


def test_merge_edge_cases():
    empty = merge_sums([])
    assert empty.tokens == 0 and math.isnan(finalize(empty)["mismatch/kl_k3"])
    s = mismatch_sums(torch.tensor([[-1.0]]), torch.tensor([[-1.5]]), None)
    assert finalize(merge_sums([s])) == finalize(s)
    other = mismatch_sums(torch.tensor([[-1.0]]), torch.tensor([[-1.5]]), None, clip_eps_high=0.28)
    with pytest.raises(ValueError, match="clip bands"):
        merge_sums([s, other])
    # a part without valid tokens (a process with nothing this step) merges with any band
    assert merge_sums([empty_sums(), other]).clip_eps_high == 0.28
    assert finalize(merge_sums([other, empty_sums(), empty_sums(clip_eps_low=0.1)])) == finalize(other)
    nan_only = mismatch_sums(torch.tensor([[NAN]]), torch.tensor([[-1.0]]), None)
    merged = merge_sums([nan_only, other])
    assert (merged.tokens, merged.nan_tokens) == (1, 1)
    assert finalize(empty_sums())["mismatch/tokens"] == 0.0


def test_metric_docs_define_every_key_in_one_line():
    train, infer, mask = hand_batch()
    assert list(token_stats(train, infer, mask)) == list(METRIC_DOCS) == list(METRIC_KEYS)
    for key, doc in METRIC_DOCS.items():
        assert key.startswith("mismatch/")
        assert doc and "\n" not in doc


def test_reduce_single_process_is_identity():
    s = mismatch_sums(*hand_batch())
    assert reduce_across_processes(s, None) is s
    assert reduce_across_processes(s, SimpleNamespace(num_processes=1)) is s


def test_reduce_with_accelerator_gathers_in_rank_order(monkeypatch):
    train, infer, mask = _random_batch(3)
    rank_sums = [mismatch_sums(train[:4], infer[:4], mask[:4]), mismatch_sums(train[4:], infer[4:], mask[4:])]
    calls = []

    def fake_gather_object(obj):
        calls.append(obj)
        return list(rank_sums)  # what accelerate returns on every rank: one entry per rank, rank order

    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, "gather_object", fake_gather_object)
    merged = reduce_across_processes(rank_sums[0], SimpleNamespace(num_processes=2))
    assert calls and calls[0] == [rank_sums[0]]
    _assert_merge_equals_union([merged], mismatch_sums(train, infer, mask))
    monkeypatch.setattr(accelerate.utils, "gather_object", lambda obj: [rank_sums[0]])
    with pytest.raises(RuntimeError, match="from 2 processes"):
        reduce_across_processes(rank_sums[0], SimpleNamespace(num_processes=2))


def _gloo_worker(rank: int, world: int, init_file: str, out_dir: str):
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        train, infer, mask = _random_batch(5, b=6)
        rows = slice(rank * 3, rank * 3 + 3)
        merged = metrics.reduce_across_processes(metrics.mismatch_sums(train[rows], infer[rows], mask[rows]), None)
        torch.save(merged.__dict__, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def test_reduce_across_two_gloo_processes():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_gloo_worker, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        results = [MismatchSums(**torch.load(os.path.join(tmp, f"rank{r}.pt"))) for r in range(2)]
    train, infer, mask = _random_batch(5, b=6)
    union = mismatch_sums(train, infer, mask)
    for merged in results:  # every rank holds the same merge
        _assert_merge_equals_union([merged], union)
    assert finalize(results[0]) == finalize(results[1])


def test_unreproduced_tokens_are_counted_per_cause_among_valid_tokens_and_merge():
    """The per-token codes of what the engine computed in a form the trainer does not reproduce (1-based causes of
    `UNREPRODUCED_CAUSES`) count among valid tokens only, add over a merge, and change no other statistic."""
    from trl_roundalign.metrics import REPREFILLED_CODE, UNREPRODUCED_CAUSES

    train, infer, mask = hand_batch()
    codes = torch.zeros(train.shape, dtype=torch.int8)
    codes[0, 1:] = 1 + UNREPRODUCED_CAUSES.index("preempted")
    codes[1, :] = 1 + UNREPRODUCED_CAUSES.index("prefix_cached")
    codes[2, :] = 1 + UNREPRODUCED_CAUSES.index("unrecorded")  # padding only: not counted
    codes[0, 0] = REPREFILLED_CODE  # reproduced through a re-prefill: counted apart, not unreproduced
    valid = (mask != 0) & torch.isfinite(train) & torch.isfinite(infer)
    s = mismatch_sums(train, infer, mask, unreproduced=codes)
    out = finalize(s)
    preempted, cached = int((valid & (codes == 1)).sum()), int((valid & (codes == 3)).sum())
    assert preempted > 0 and cached > 0
    assert out["mismatch/unreproduced_tokens/preempted"] == preempted
    assert out["mismatch/unreproduced_tokens/prefix_cached"] == cached
    assert out["mismatch/unreproduced_tokens"] == preempted + cached
    reprefilled = int((valid & (codes == REPREFILLED_CODE)).sum())
    assert reprefilled > 0 and out["mismatch/reprefilled_tokens"] == reprefilled
    assert out["mismatch/unreproduced_tokens/prefill_chunked"] == out["mismatch/unreproduced_tokens/unrecorded"] == 0
    plain = finalize(mismatch_sums(train, infer, mask))
    assert plain["mismatch/unreproduced_tokens"] == 0
    assert {k: v for k, v in out.items() if "reproduced" not in k and "reprefilled" not in k} == {
        k: v for k, v in plain.items() if "reproduced" not in k and "reprefilled" not in k}
    merged = finalize(merge_sums([s, s]))
    assert merged["mismatch/unreproduced_tokens"] == 2 * (preempted + cached)
    assert merged["mismatch/reprefilled_tokens"] == 2 * reprefilled
