"""Pure mismatch statistics between the trainer's and the inference engine's log-probabilities.

Inputs, for the completion tokens vLLM sampled:

- `train_logps` `[B, T]`: the training forward's log-probs of the sampled tokens (fp32);
- `infer_logps` `[B, T]`: vLLM's sampler log-probs of the same tokens (TRL's
  `sampling_per_token_logps`: NaN where vLLM returned none, 0.0 on padding);
- `mask` `[B, T]`: 1 on completion tokens, 0 on padding and tool-result tokens.

Which tokens: those of one optimizer step in a row of `mismatch.jsonl`, and those of the whole logging window
(the steps since the last log) in what TRL logs: `MismatchCallback` merges the window's steps with `merge_sums`, so
a logged maximum is the window's maximum, a logged mean is token-weighted and a logged count is the window's sum.

A token is *valid* when it is inside the mask and both log-probs are finite. With
`Δ = log_ratio = train_logps - infer_logps = log(π_train / π_vLLM)` and `r = exp(Δ)`:

- `k1 = -Δ` and `k3 = (r - 1) - Δ` (Schulman's estimators, http://joschu.net/blog/kl-approx.html) estimate
  `KL(π_vLLM || π_train)` from vLLM's own samples; `k3 >= 0` always and has lower variance.
- The PPO clip band is `1 - eps_low <= r <= 1 + eps_high`; a token with `r` strictly outside it would be
  clipped by a PPO-style loss at the first optimisation pass if vLLM's log-probs were the "old" ones.

Everything is computed in float64 from the given values (the difference of two fp32 log-probs is
exact in float64). Statistics are split in two steps so that several processes can be reduced
exactly: `mismatch_sums` returns additive sufficient statistics (`MismatchSums`), `merge_sums`
combines them (sums add, minima/maxima combine, per-sequence sums and `|Δ|` values concatenate),
`finalize` turns them into the logged numbers. `reduce_across_processes` gathers and merges; what
it gathers has a bounded size (scalars, one sum per sequence and a sparse histogram of `|Δ|`), so the
cost does not grow with the number of tokens per process.

Exactness of a merge: counts, minima, maxima, the histogram and the concatenated per-sequence sums of a
merge equal those computed on the union of the tokens, bit for bit. The float64 sums (`k1`, `k3`, `|Δ|`) are added in
a different order than a single pass would add them, so they agree up to float64 rounding: at most
`n * 2**-52 * sum(|terms|)` for `n` tokens, in practice ~1e-15 relative.

Quantiles of `|Δ|` come from a mergeable histogram instead of the values: each `|Δ|`, rounded to fp32,
falls in the bucket of its fp32 bit pattern with the mantissa truncated to `HIST_MANTISSA_BITS` (8)
bits, i.e. 256 buckets per octave, and a bucket stands for its midpoint clamped to the smallest and
largest value it holds (so a bucket of one distinct value, e.g. the exact zeros, stands for that value). The quantile is then the linear interpolation between order statistics, the method of
`torch.quantile`'s `interpolation="linear"` and NumPy's default (for `n` sorted values `v` and level `q`,
position `q * (n - 1)`, `lerp(v[floor], v[ceil], position - floor)`), applied to the bucket midpoints:
its relative error against that method on the exact values is at most `2**-9 + 2**-24` (half a bucket,
plus the fp32 rounding), for values of at least 2**-126 (below, an absolute error under 2**-126), and
it is clamped to `[0, max |Δ|]`. Only non-empty buckets are stored: at most one per token, at most
256 per octave of `|Δ|` seen (a few thousand in practice), whatever the number of tokens.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "METRIC_DOCS",
    "METRIC_KEYS",
    "MismatchSums",
    "UNREPRODUCED_CAUSES",
    "empty_sums",
    "finalize",
    "histogram_quantiles",
    "kl_k1",
    "kl_k3",
    "merge_sums",
    "mismatch_sums",
    "quantile_linear",
    "reduce_across_processes",
    "token_stats",
]

METRIC_DOCS: dict[str, str] = {
    "mismatch/kl_k1": "Mean over valid tokens of k1 = -log r, with r = π_train/π_vLLM on vLLM's samples: "
    "an unbiased (possibly negative) estimate of KL(π_vLLM || π_train).",
    "mismatch/kl_k3": "Mean over valid tokens of k3 = (r - 1) - log r: Schulman's non-negative, low-variance "
    "estimate of KL(π_vLLM || π_train).",
    "mismatch/abs_logp_diff/mean": "Mean over valid tokens of |Δ| = |log π_train - log π_vLLM| (nats).",
    "mismatch/abs_logp_diff/p50": "Median of |Δ| over valid tokens (linear interpolation between order statistics, "
    "from a histogram: relative error at most 2^-9).",
    "mismatch/abs_logp_diff/p90": "90th percentile of |Δ| over valid tokens (as p50).",
    "mismatch/abs_logp_diff/p99": "99th percentile of |Δ| over valid tokens (as p50).",
    "mismatch/abs_logp_diff/max": "Largest |Δ| over valid tokens.",
    "mismatch/ratio/min": "Smallest per-token ratio r = exp(Δ) = π_train/π_vLLM.",
    "mismatch/ratio/max": "Largest per-token ratio r = exp(Δ) = π_train/π_vLLM.",
    "mismatch/frac_outside_clip": "Fraction of valid tokens with r < 1 - ε_low or r > 1 + ε_high: the loss's clip band (PPO's; CISPO's r > ε_high, `callbacks.clip_band`).",
    "mismatch/frac_bitwise_equal": "Fraction of valid tokens whose training and vLLM log-probs are equal as fp32 "
    "numbers.",
    "mismatch/seq_log_ratio/mean": "Mean over sequences of the sequence log-ratio Σ_t Δ_t "
    "(= log of the sequence-level ratio π_train/π_vLLM; sequences without valid tokens excluded).",
    "mismatch/seq_log_ratio/max_abs": "Largest |Σ_t Δ_t| over sequences.",
    "mismatch/tokens": "Number of valid tokens: inside the completion mask with both log-probs finite (logged: "
    "summed over the logging window, as every count here; the other statistics pool the window's tokens).",
    "mismatch/nan_tokens": "Number of tokens inside the completion mask whose training or vLLM log-prob is not "
    "finite (NaN, ±inf; NaN where vLLM returned none), excluded from every statistic above. vLLM returns the "
    "log-prob of every token it samples, so a non-zero count means one side computed NaN/inf: investigate it.",
    "mismatch/nonfinite_train_tokens": "Of `mismatch/nan_tokens`, the tokens whose training-side log-prob is not "
    "finite (the trainer's forward produced NaN/inf); the rest are non-finite on vLLM's side only.",
    "mismatch/unreproduced_tokens": "Exact mode: of the valid tokens, those the engine computed in a form the trainer "
    "does not reproduce, by its own per-request schedule record (`engine.schedule`): the sum of the causes below. "
    "They are in every statistic above; where it is 0 every token was computed as the trainer recomputes it. 0 outside "
    "exact mode (not tracked).",
    "mismatch/unreproduced_tokens/preempted": "Of `mismatch/unreproduced_tokens`: tokens sampled after the engine "
    "preempted their request (KV cache full) and prefilled its prompt and tokens again.",
    "mismatch/unreproduced_tokens/prefill_chunked": "Of `mismatch/unreproduced_tokens`: tokens the engine computed "
    "after a multi-token step its record does not explain (a chunk that does not continue its prefill); chunked "
    "prefills that do are reproduced.",
    "mismatch/unreproduced_tokens/prefix_cached": "Of `mismatch/unreproduced_tokens`: tokens of requests whose "
    "prompt's prefix came from the engine's prefix cache (only its tail was computed).",
    "mismatch/unreproduced_tokens/unrecorded": "Of `mismatch/unreproduced_tokens`: tokens of requests the engine kept "
    "no schedule record of (another scheduler class, or no readable one): counted as not reproduced.",
    "mismatch/reprefilled_tokens": "Exact mode: of the valid tokens, those the engine computed after it preempted "
    "their request (KV cache full) and resumed it by a whole prefill of its prompt and tokens: reproduced, by a "
    "trainer forward of their own per stretch (what the preemption costs the trainer). 0 outside exact mode.",
}

# The causes of `mismatch/unreproduced_tokens`, in the order of their codes (1, 2, ...) in the per-token tensor
# `mismatch_sums` takes; `engine.schedule.CAUSES` names the same.
UNREPRODUCED_CAUSES: tuple[str, ...] = ("preempted", "prefill_chunked", "prefix_cached", "unrecorded")
# The code, in the same tensor, of a token reproduced through its request's re-prefill (`mismatch/reprefilled_tokens`).
REPREFILLED_CODE = -1

METRIC_KEYS: tuple[str, ...] = tuple(METRIC_DOCS)

_QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}

HIST_MANTISSA_BITS = 8
_HIST_SHIFT = 23 - HIST_MANTISSA_BITS
# Relative error bound of the histogram quantiles (module docstring), for tests and docs.
HIST_REL_ERROR = 2.0 ** -(HIST_MANTISSA_BITS + 1) + 2.0**-24


def _histogram(abs_d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse histogram of non-negative values: (sorted bucket ids, counts, [min, max] per bucket)."""
    v = abs_d.float().contiguous().reshape(-1)
    keys = v.view(torch.int32).to(torch.int64) >> _HIST_SHIFT
    return _collect(keys, torch.ones_like(keys), torch.stack([v, v], dim=1))


def _collect(keys, counts, bounds) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    buckets, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    total = torch.zeros(buckets.numel(), dtype=torch.int64).index_add_(0, inverse, counts)
    lo = torch.full((buckets.numel(),), math.inf).scatter_reduce(0, inverse, bounds[:, 0], "amin")
    hi = torch.full((buckets.numel(),), -math.inf).scatter_reduce(0, inverse, bounds[:, 1], "amax")
    return buckets, total, torch.stack([lo, hi], dim=1)


def _merge_histograms(parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    keys = torch.cat([b.cpu().long() for b, _, _ in parts])
    if keys.numel() == 0:
        return keys, keys.clone(), torch.zeros(0, 2)
    counts = torch.cat([c.cpu().long() for _, c, _ in parts])
    bounds = torch.cat([m.cpu().float() for _, _, m in parts])
    return _collect(keys, counts, bounds)


def _bucket_values(buckets: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """float64 midpoint of each bucket, clamped to the values it holds."""
    lo = (buckets << _HIST_SHIFT).to(torch.int32).view(torch.float32).double()
    hi = ((buckets + 1) << _HIST_SHIFT).to(torch.int32).view(torch.float32).double()
    return torch.minimum(torch.maximum((lo + hi) / 2, bounds[:, 0].double()), bounds[:, 1].double())


def histogram_quantiles(
    buckets: torch.Tensor, counts: torch.Tensor, bounds: torch.Tensor, qs: Sequence[float]
) -> list[float]:
    """Linear-interpolation quantiles of the values a histogram holds (bucket midpoints; module docstring)."""
    n = int(counts.sum().item()) if counts.numel() else 0
    if n == 0:
        return [math.nan] * len(qs)
    ends = torch.cumsum(counts, 0)  # order statistics [ends[j-1], ends[j]) fall in bucket j
    values = _bucket_values(buckets, bounds)
    pos = torch.tensor(list(qs), dtype=torch.float64) * (n - 1)
    lo, hi = pos.floor(), pos.ceil()
    at = lambda i: values[torch.searchsorted(ends, i.long(), right=True)]  # noqa: E731
    return torch.lerp(at(lo), at(hi), pos - lo).tolist()


@dataclass
class MismatchSums:
    """Additive sufficient statistics of the train/vLLM log-prob mismatch over a set of tokens.

    Two `MismatchSums` of disjoint token sets merge exactly with `merge_sums` (see the module docstring
    for the float64 rounding of the sums). All tensors live on the CPU.

    Args:
        tokens (`int`): valid tokens (inside the mask, both log-probs finite).
        nan_tokens (`int`): tokens inside the mask excluded because a log-prob was not finite.
        nonfinite_train (`int`): of `nan_tokens`, those whose training log-prob is not finite.
        k1_sum (`float`): `Σ -Δ` over valid tokens.
        k3_sum (`float`): `Σ (exp(Δ) - 1 - Δ)` over valid tokens.
        abs_diff_sum (`float`): `Σ |Δ|` over valid tokens.
        bitwise_equal (`int`): valid tokens with `train == infer` as fp32.
        outside_clip (`int`): valid tokens with `exp(Δ) < 1 - clip_eps_low` or `> 1 + clip_eps_high`.
        ratio_min (`float`): smallest `exp(Δ)` (`+inf` when there are no valid tokens).
        ratio_max (`float`): largest `exp(Δ)` (`-inf` when there are no valid tokens).
        abs_diff_max (`float`): largest `|Δ|` (`-inf` when there are no valid tokens).
        seq_log_ratios (`torch.Tensor`): float64 `[S]`, `Σ_t Δ_t` of each sequence with at least one valid token.
        abs_diff_buckets (`torch.Tensor`): int64 `[K]`, sorted histogram bucket ids of `|Δ|` (module docstring).
        abs_diff_counts (`torch.Tensor`): int64 `[K]`, tokens per bucket (positive; they sum to `tokens`).
        abs_diff_bounds (`torch.Tensor`): float32 `[K, 2]`, smallest and largest `|Δ|` in each bucket.
        clip_eps_low (`float`), clip_eps_high (`float`): the clip band the counts used; merging sums of
            different bands raises.
        unreproduced (`tuple[int, ...]`): valid tokens computed in a form the trainer does not reproduce, one count
            per cause of `UNREPRODUCED_CAUSES`.
        reprefilled (`int`): valid tokens reproduced through their request's re-prefill (`REPREFILLED_CODE`).
    """

    tokens: int = 0
    nan_tokens: int = 0
    nonfinite_train: int = 0
    k1_sum: float = 0.0
    k3_sum: float = 0.0
    abs_diff_sum: float = 0.0
    bitwise_equal: int = 0
    outside_clip: int = 0
    ratio_min: float = math.inf
    ratio_max: float = -math.inf
    abs_diff_max: float = -math.inf
    seq_log_ratios: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    abs_diff_buckets: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    abs_diff_counts: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    abs_diff_bounds: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.float32))
    unreproduced: tuple[int, ...] = (0,) * len(UNREPRODUCED_CAUSES)
    reprefilled: int = 0
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2


def _as_2d(x: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}.")
    if x.dim() == 1:
        return x.unsqueeze(0)
    if x.dim() != 2:
        raise ValueError(f"`{name}` must have shape [B, T] (or [T]), got {tuple(x.shape)}.")
    return x


def mismatch_sums(
    train_logps: torch.Tensor,
    infer_logps: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    unreproduced: torch.Tensor | None = None,
) -> MismatchSums:
    """Additive mismatch statistics of one batch of sampled tokens.

    Args:
        train_logps (`torch.Tensor`):
            `[B, T]` training-side log-probs of the sampled tokens (fp32; any float dtype is accepted).
        infer_logps (`torch.Tensor`):
            `[B, T]` vLLM sampler log-probs of the same tokens; NaN where missing.
        mask (`torch.Tensor` or `None`):
            `[B, T]` completion mask (nonzero = completion token). `None` means every token.
        clip_eps_low (`float`, *optional*, defaults to `0.2`):
            Lower PPO clip width: ratios below `1 - clip_eps_low` count as outside the band.
        clip_eps_high (`float`, *optional*, defaults to `0.2`):
            Upper PPO clip width: ratios above `1 + clip_eps_high` count as outside the band.
        unreproduced (`torch.Tensor`, *optional*):
            `[B, T]` integer codes: 0 where the engine computed the token as the trainer recomputes it, `i` (1-based)
            where it did not, for the cause `UNREPRODUCED_CAUSES[i - 1]`. `None`: not tracked (all 0).

    Returns:
        `MismatchSums`: the sufficient statistics, on the CPU. Tokens inside the mask whose train or vLLM
        log-prob is not finite are excluded from every statistic and counted in `nan_tokens` (those with a
        non-finite training log-prob also in `nonfinite_train`); sequences
        without any valid token contribute no per-sequence sum.
    """
    train = _as_2d(train_logps, "train_logps")
    infer = _as_2d(infer_logps, "infer_logps")
    if train.shape != infer.shape:
        raise ValueError(f"train_logps {tuple(train.shape)} and infer_logps {tuple(infer.shape)} differ in shape.")
    if mask is None:
        in_mask = torch.ones(train.shape, dtype=torch.bool, device=train.device)
    else:
        in_mask = _as_2d(mask, "mask")
        if in_mask.shape != train.shape:
            raise ValueError(f"mask {tuple(in_mask.shape)} and log-probs {tuple(train.shape)} differ in shape.")
        in_mask = in_mask.to(device=train.device) != 0
    infer = infer.to(device=train.device)

    finite = torch.isfinite(train) & torch.isfinite(infer)
    valid = in_mask & finite
    nan_tokens = int((in_mask & ~finite).sum().item())
    nonfinite_train = int((in_mask & ~torch.isfinite(train)).sum().item()) if nan_tokens else 0

    train64 = torch.where(valid, train.double(), 0.0)
    infer64 = torch.where(valid, infer.double(), 0.0)
    delta = train64 - infer64  # exactly 0 outside `valid`
    seq_log_ratios = delta.sum(dim=-1)[valid.any(dim=-1)]

    d = delta[valid]
    equal = train.float()[valid] == infer.float()[valid]
    unreproduced_counts, reprefilled = (0,) * len(UNREPRODUCED_CAUSES), 0
    if unreproduced is not None:
        codes = _as_2d(unreproduced, "unreproduced").to(device=train.device)
        if codes.shape != train.shape:
            raise ValueError(f"unreproduced {tuple(codes.shape)} and log-probs {tuple(train.shape)} differ in shape.")
        codes = codes[valid].long()
        unreproduced_counts = tuple(int((codes == i + 1).sum()) for i in range(len(UNREPRODUCED_CAUSES)))
        reprefilled = int((codes == REPREFILLED_CODE).sum())
    if d.numel() == 0:
        return MismatchSums(
            nan_tokens=nan_tokens,
            nonfinite_train=nonfinite_train,
            seq_log_ratios=seq_log_ratios.cpu(),
            clip_eps_low=clip_eps_low,
            clip_eps_high=clip_eps_high,
        )
    ratio = torch.exp(d)
    abs_d = d.abs()
    buckets, counts, bounds = _histogram(abs_d.cpu())
    k3 = torch.expm1(d) - d  # (r - 1) - log r without cancellation for small |Δ|
    outside = (ratio < 1.0 - clip_eps_low) | (ratio > 1.0 + clip_eps_high)
    scalars = torch.stack(
        [
            (-d).sum(),
            k3.sum(),
            abs_d.sum(),
            ratio.min(),
            ratio.max(),
            abs_d.max(),
            equal.sum().double(),
            outside.sum().double(),
        ]
    ).tolist()
    return MismatchSums(
        tokens=int(d.numel()),
        nan_tokens=nan_tokens,
        nonfinite_train=nonfinite_train,
        k1_sum=scalars[0],
        k3_sum=scalars[1],
        abs_diff_sum=scalars[2],
        bitwise_equal=int(scalars[6]),
        outside_clip=int(scalars[7]),
        ratio_min=scalars[3],
        ratio_max=scalars[4],
        abs_diff_max=scalars[5],
        seq_log_ratios=seq_log_ratios.cpu(),
        abs_diff_buckets=buckets,
        abs_diff_counts=counts,
        abs_diff_bounds=bounds,
        clip_eps_low=clip_eps_low,
        clip_eps_high=clip_eps_high,
        unreproduced=unreproduced_counts,
        reprefilled=reprefilled,
    )


def empty_sums(*, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2) -> MismatchSums:
    """Statistics of no tokens: the identity of `merge_sums` (for a process with nothing to report)."""
    return MismatchSums(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high)


def merge_sums(sums_list: Sequence[MismatchSums]) -> MismatchSums:
    """Merge statistics of disjoint token sets, in the given order.

    Args:
        sums_list (`Sequence[MismatchSums]`): the parts (e.g. one per process, in rank order).

    Returns:
        `MismatchSums`: sums added left to right, minima/maxima combined, per-sequence sums concatenated in
        order, `|Δ|` histograms added. An empty sequence gives an empty `MismatchSums`.

    Raises:
        ValueError: parts with valid tokens were computed with different clip bands (parts without valid
            tokens merge with any band).
    """
    sums_list = list(sums_list)
    if not sums_list:
        return MismatchSums()
    # Only parts with valid tokens depend on the band (`outside_clip`); an empty part (e.g. a process
    # that saw no completion tokens this step) merges with any band.
    bands = {(s.clip_eps_low, s.clip_eps_high) for s in sums_list if s.tokens > 0}
    if len(bands) > 1:
        raise ValueError(f"Cannot merge mismatch statistics computed with different clip bands: {sorted(bands)}.")
    eps_low, eps_high = bands.pop() if bands else (sums_list[0].clip_eps_low, sums_list[0].clip_eps_high)
    merged = MismatchSums(clip_eps_low=eps_low, clip_eps_high=eps_high)
    for s in sums_list:
        merged.tokens += s.tokens
        merged.nan_tokens += s.nan_tokens
        merged.nonfinite_train += s.nonfinite_train
        merged.k1_sum += s.k1_sum
        merged.k3_sum += s.k3_sum
        merged.abs_diff_sum += s.abs_diff_sum
        merged.bitwise_equal += s.bitwise_equal
        merged.outside_clip += s.outside_clip
        merged.ratio_min = min(merged.ratio_min, s.ratio_min)
        merged.ratio_max = max(merged.ratio_max, s.ratio_max)
        merged.abs_diff_max = max(merged.abs_diff_max, s.abs_diff_max)
        merged.unreproduced = tuple(a + b for a, b in zip(merged.unreproduced, s.unreproduced, strict=True))
        merged.reprefilled += s.reprefilled
    merged.seq_log_ratios = torch.cat([s.seq_log_ratios.cpu().double() for s in sums_list])
    merged.abs_diff_buckets, merged.abs_diff_counts, merged.abs_diff_bounds = _merge_histograms(
        [(s.abs_diff_buckets, s.abs_diff_counts, s.abs_diff_bounds) for s in sums_list]
    )
    return merged


def quantile_linear(values: torch.Tensor, qs: Sequence[float]) -> list[float]:
    """Quantiles with linear interpolation between order statistics (`torch.quantile`'s default method).

    Args:
        values (`torch.Tensor`): any shape; flattened. Computed in float64.
        qs (`Sequence[float]`): levels in `[0, 1]`.

    Returns:
        `list[float]`: one quantile per level; NaN for every level when `values` is empty.
    """
    if any(not 0.0 <= q <= 1.0 for q in qs):
        raise ValueError(f"Quantile levels must lie in [0, 1], got {list(qs)}.")
    v = values.detach().reshape(-1).double().cpu()
    n = v.numel()
    if n == 0:
        return [math.nan] * len(qs)
    v = torch.sort(v).values
    pos = torch.tensor(list(qs), dtype=torch.float64) * (n - 1)
    lo = pos.floor()
    hi = pos.ceil()
    below = v[lo.long()]
    above = v[hi.long()]
    return torch.lerp(below, above, pos - lo).tolist()


def finalize(sums: MismatchSums) -> dict[str, float]:
    """Turn sufficient statistics into the logged metrics (keys and definitions in `METRIC_DOCS`).

    Args:
        sums (`MismatchSums`): the (merged) statistics.

    Returns:
        `dict[str, float]`: exactly the keys of `METRIC_KEYS`, in that order. With zero valid tokens every
        statistic is NaN, `mismatch/tokens` is 0 and the non-finite counts keep theirs. The two
        `seq_log_ratio` entries are NaN when no sequence had a valid token.
    """
    n = sums.tokens
    out = {key: math.nan for key in METRIC_KEYS}
    out["mismatch/tokens"] = float(n)
    out["mismatch/nan_tokens"] = float(sums.nan_tokens)
    out["mismatch/nonfinite_train_tokens"] = float(sums.nonfinite_train)
    out["mismatch/unreproduced_tokens"] = float(sum(sums.unreproduced))
    for cause, count in zip(UNREPRODUCED_CAUSES, sums.unreproduced, strict=True):
        out[f"mismatch/unreproduced_tokens/{cause}"] = float(count)
    out["mismatch/reprefilled_tokens"] = float(sums.reprefilled)
    if n > 0:
        out["mismatch/kl_k1"] = sums.k1_sum / n
        out["mismatch/kl_k3"] = sums.k3_sum / n
        out["mismatch/abs_logp_diff/mean"] = sums.abs_diff_sum / n
        quantiles = histogram_quantiles(
            sums.abs_diff_buckets, sums.abs_diff_counts, sums.abs_diff_bounds, list(_QUANTILES.values())
        )
        for (name, _), value in zip(_QUANTILES.items(), quantiles):
            out[f"mismatch/abs_logp_diff/{name}"] = min(max(value, 0.0), sums.abs_diff_max)
        out["mismatch/abs_logp_diff/max"] = sums.abs_diff_max
        out["mismatch/ratio/min"] = sums.ratio_min
        out["mismatch/ratio/max"] = sums.ratio_max
        out["mismatch/frac_outside_clip"] = sums.outside_clip / n
        out["mismatch/frac_bitwise_equal"] = sums.bitwise_equal / n
    if sums.seq_log_ratios.numel() > 0:
        out["mismatch/seq_log_ratio/mean"] = sums.seq_log_ratios.double().mean().item()
        out["mismatch/seq_log_ratio/max_abs"] = sums.seq_log_ratios.double().abs().max().item()
    return out


def _world_size(accelerator) -> int:
    if accelerator is not None:
        return int(getattr(accelerator, "num_processes", 1))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def reduce_across_processes(sums: MismatchSums, accelerator=None) -> MismatchSums:
    """Gather every process's statistics and merge them in rank order.

    Args:
        sums (`MismatchSums`): this process's statistics.
        accelerator (`accelerate.Accelerator` or `None`):
            With more than one process, gathers with `accelerate.utils.gather_object`. Without an
            accelerator, uses `torch.distributed.all_gather_object` when a process group is initialised.

    Returns:
        `MismatchSums`: the merge over all processes (identical on every process); `sums` itself when there
        is a single process. Every process must call this (it is a collective).
    """
    world = _world_size(accelerator)
    if world <= 1:
        return sums
    if accelerator is not None:
        from accelerate.utils import gather_object

        gathered = gather_object([sums])
    else:
        gathered = [None] * world
        torch.distributed.all_gather_object(gathered, sums)
    if len(gathered) != world:
        raise RuntimeError(f"Gathered {len(gathered)} mismatch statistics from {world} processes.")
    return merge_sums(gathered)


def token_stats(
    a_logps: torch.Tensor,
    b_logps: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
) -> dict[str, float]:
    """The finalized metrics of two log-prob sets, `a` in the training role and `b` in vLLM's.

    Convenience for analysis tools (e.g. vLLM prefill vs. the training forward): `Δ = a - b`.

    Args:
        a_logps (`torch.Tensor`): `[B, T]` log-probs taking the place of `train_logps`.
        b_logps (`torch.Tensor`): `[B, T]` log-probs taking the place of `infer_logps` (the sampler side).
        mask (`torch.Tensor`, *optional*): `[B, T]` tokens to include; all when `None`.
        clip_eps_low (`float`, *optional*, defaults to `0.2`): see `mismatch_sums`.
        clip_eps_high (`float`, *optional*, defaults to `0.2`): see `mismatch_sums`.

    Returns:
        `dict[str, float]`: as `finalize`.
    """
    return finalize(mismatch_sums(a_logps, b_logps, mask, clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high))


def _valid_log_ratio(train_logps: torch.Tensor, infer_logps: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    valid = torch.isfinite(train_logps) & torch.isfinite(infer_logps)
    if mask is not None:
        valid = valid & (mask.to(valid.device) != 0)
    return train_logps.double()[valid] - infer_logps.double()[valid]


def kl_k1(train_logps: torch.Tensor, infer_logps: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Mean `k1 = -(train - infer)` over valid tokens: estimate of `KL(π_infer || π_train)`; NaN if none."""
    d = _valid_log_ratio(train_logps, infer_logps, mask)
    return (-d).mean().item() if d.numel() else math.nan


def kl_k3(train_logps: torch.Tensor, infer_logps: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Mean `k3 = (r - 1) - log r`, `r = exp(train - infer)`, over valid tokens: estimate of
    `KL(π_infer || π_train)` that is never negative; NaN if no token is valid."""
    d = _valid_log_ratio(train_logps, infer_logps, mask)
    return (torch.expm1(d) - d).mean().item() if d.numel() else math.nan
