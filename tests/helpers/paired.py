"""Paired comparisons on the same tokens, decided as the start-up check decides (`verify.SIGNIFICANCE_Z`).

A bound like "three regions at least 2x below default" is fitted to one machine's sample; which tokens are sampled
depends on the CPU's kernels. These helpers ask instead whether one condition is below another by more than
`SIGNIFICANCE_Z` standard errors of their paired per-token difference: the margin comes from the data itself, on any
CPU kind. The magnitudes stay in the committed tables the tests name.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path

from trl_roundalign.trainer.startup_check import SIGNIFICANCE_Z


def k3_terms(train: Sequence[float], reference: Sequence[float]) -> list[float]:
    """Per-token k3 = (r - 1) - log r with log r = train - reference (the metric's own per-token term)."""
    out = []
    for t, r in zip(train, reference):
        d = t - r
        out.append(math.expm1(d) - d)
    return out


def paired(lower: Sequence[float], higher: Sequence[float]) -> tuple[float, float]:
    """(mean of higher - lower, its standard error) over paired terms."""
    diff = [h - lo for lo, h in zip(lower, higher)]
    n = len(diff)
    assert n > 1 and n == len(lower) == len(higher), (n, len(lower), len(higher))
    mean = sum(diff) / n
    var = sum((x - mean) ** 2 for x in diff) / (n - 1)
    return mean, math.sqrt(var / n)


def assert_significantly_lower(lower: Sequence[float], higher: Sequence[float], *, label: str) -> None:
    mean, se = paired(lower, higher)
    assert mean > SIGNIFICANCE_Z * se, (
        f"{label}: paired mean difference {mean:.3e} is not above {SIGNIFICANCE_Z} standard errors ({se:.3e}); "
        f"means {sum(lower) / len(lower):.3e} vs {sum(higher) / len(higher):.3e}"
    )


def per_token_k3_from_csv(path: Path, conditions: Sequence[str]) -> dict[str, list[float]]:
    """Per-token k3 against vLLM's prefill for each condition, from `analyze`'s per_token.csv."""
    rows = list(csv.DictReader(path.open()))
    ref = [float(r["vllm_prefill"]) for r in rows]
    return {c: k3_terms([float(r[f"train_{c}"]) for r in rows], ref) for c in conditions}


def assert_lower_on_most_tokens(lower: Sequence[float], higher: Sequence[float], *, label: str) -> None:
    """A sign test on the paired terms: `lower` is below `higher` on more tokens than not, by more than
    `SIGNIFICANCE_Z` standard deviations of a fair coin (ties left out). For heavy-tailed samples (an MoE's expert
    flips: a few tokens tens of nats off carry the mean) where the mean's standard error says nothing."""
    wins = sum(lo < h for lo, h in zip(lower, higher))
    losses = sum(lo > h for lo, h in zip(lower, higher))
    n = wins + losses
    z = (wins - losses) / math.sqrt(n) if n else 0.0
    assert z > SIGNIFICANCE_Z, f"{label}: lower on {wins} tokens, higher on {losses} (sign test z = {z:.2f})"
