"""Verdicts: which profile the per-region results and the model-level candidates point to."""

from __future__ import annotations

from collections.abc import Sequence

from ...engine import EXACT_REFINEMENTS as _EXACT_FAMILY
from .matching import match_score
from .results import BASE_PROFILES, ModelLevelResult, RegionResult


def region_verdict(results: Sequence[RegionResult]) -> tuple[str | None, bool]:
    """The base profile that matches the most probed regions (then: most exact, highest mean match rate)."""
    probed = [r for r in results if not r.skipped]
    if not probed:
        return None, False

    def key(p: str):
        ms = [r.results[p] for r in probed]
        return (sum(m.matches for m in ms), sum(m.exact for m in ms), sum(m.match_rate for m in ms))

    best = max(BASE_PROFILES, key=key)
    if key(best)[0] == 0:
        return None, False
    return best, key(best)[0] == len(probed)


def assign_best(results: Sequence[RegionResult], verdict: str | None) -> None:
    for r in results:
        if r.skipped:
            continue
        top = max(match_score(r.results[p]) for p in BASE_PROFILES)
        tied = [p for p in BASE_PROFILES if match_score(r.results[p]) == top]
        r.best = verdict if verdict in tied else tied[0]


def _family(profile: str) -> str:
    """The base profile a candidate's profile refines (`vllm-compiled-exact` refines `vllm-compiled`)."""
    return _EXACT_FAMILY.get(profile, profile)


def model_best(results: Sequence[ModelLevelResult], prefer: str | None = None) -> tuple[str | None, str | None, bool]:
    """`(best base profile, bit-exact candidate, conclusive)`.

    Candidates are ranked among those with the engine's attention kernel when there are any (the
    attention kernel's own differences would otherwise dominate every comparison). A candidate that
    reproduces every token bit for bit decides (`conclusive`); otherwise the lowest k3 is only the
    closest, and on tiny random models (near-uniform logits) that ranking is mostly noise. Exact
    ties (e.g. `vllm-eager` and `vllm-eager-cpu` on a model whose norm weights are all ones) go to
    `prefer` (the per-region verdict).
    """
    engine_att = [r for r in results if r.attention == "engine"]
    pool = engine_att or list(results)
    if not pool:
        return None, None, False
    exact = [r for r in pool if r.tokens > 0 and r.bit_identical == 1.0]
    if exact:
        top = min(exact, key=lambda r: r.profile in _EXACT_FAMILY)  # prefer a base profile
        return _family(top.profile), top.candidate, True
    top = min(pool, key=lambda r: (r.k3, -r.bit_identical, _family(r.profile) != prefer))
    return _family(top.profile), None, False
