"""Bit comparison of a region's engine output with a profile's reference.

A profile *matches* a region when every output element is bit-identical, or, for RMSNorm regions in
torch's reduction order (every profile except the Inductor-lane variants), when at least
`NORM_MIN_MATCH` of them are and none is off by more than `NORM_MAX_ULP` (a different summation order
of `mean(x^2)` is not a rounding location, docs/numerics.md).
"""

from __future__ import annotations

import torch

from .. import bitwise
from .results import ProfileMatch

__all__ = ["NORM_MAX_ULP", "NORM_MIN_MATCH", "ulp_distance"]

# Tolerance for RMSNorm regions in torch's reduction order (reduction-order noise, not rounding).
NORM_MIN_MATCH = 0.9999
NORM_MAX_ULP = 1


def ulp_distance(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in ulps of two bf16/fp16 tensors; NaN-NaN is 0, NaN against a number -1.

    `trl_roundalign.analysis.bitwise.ulp_distance` restricted to 16-bit floats (the probe's tolerance is in
    bf16 ulps; any other dtype raises `TypeError`).
    """
    return bitwise.ulp_distance(actual, expected, dtypes=bitwise.HALF_DTYPES)


def compare_outputs(
    label: str,
    profile: str,
    lanes: int | None,
    engine_out: dict[str, torch.Tensor],
    ref_out: dict[str, torch.Tensor],
    *,
    norm_region: bool,
) -> ProfileMatch:
    elements = mismatches = one_ulp = 0
    max_ulp = 0
    per_output = {}
    for name, e in engine_out.items():
        r = ref_out[name]
        if r.dtype != e.dtype:  # the fp32 residual stream, stored by the engine in its dtype
            r = r.to(e.dtype)
        dist = ulp_distance(e, r)
        n, bad = dist.numel(), int((dist != 0).sum())
        elements += n
        mismatches += bad
        one_ulp += int((dist == 1).sum())
        if bad:
            m = int(dist.max())
            max_ulp = -1 if bool((dist == -1).any()) else max(max_ulp, m)
        per_output[name] = 1.0 - bad / n if n else 1.0
    rate = 1.0 - mismatches / elements if elements else 1.0
    exact = mismatches == 0
    tolerant = norm_region and lanes is None and rate >= NORM_MIN_MATCH and 0 <= max_ulp <= NORM_MAX_ULP
    return ProfileMatch(
        label, profile, lanes, elements, mismatches, rate, max_ulp, one_ulp, per_output, exact, exact or tolerant
    )


def match_score(m: ProfileMatch) -> tuple:
    return (m.matches, m.exact, m.match_rate)
