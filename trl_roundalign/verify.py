"""Start-up verification: check the rounding profile against the engine that is actually running.

A profile is a claim about where the engine rounds. Before training starts the trainer scores a few
short sequences on both sides and checks the claim:

- the engine's prefill log-probs of the sequences (colocate: `prompt_logprobs`), against
- the policy's log-probs under the chosen profile and under the other candidates.

On a compiled vLLM-CPU engine the exact refinements of `vllm-compiled` (one graph) and
`vllm-compiled-piecewise` (graph split at attention) are scored too: the engine's own reduction order
and attention kernel leave the residual stream's rounding as the only difference, so exactly one of
them is bit-identical, and that one names the engine's profile. Elsewhere (eager engines, GPUs) the
candidates are compared by k3: a candidate at less than half the chosen profile's k3 is a clearly
better match. Either way a mismatch stops the run with one line naming the better profile; an exact
mode that is not 100% bit-identical stops it too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

import torch

from . import metrics
from .engine import EXACT_REFINEMENTS
from .profiles import ALL_REGIONS, get_profile, is_exact

logger = logging.getLogger(__name__)

__all__ = ["ProfileMismatch", "Verification", "verification_sequences", "verify_profile"]

# Fixed text, tokenised by the engine's tokenizer: the same tokens on both sides, no sampling.
_TEXTS = (
    "Question: what is 17 plus 25? Think step by step, then give the answer in a box. The sum of 17 and 25 is 42.",
    "The quick brown fox jumps over the lazy dog while the cat watches from the window, counting to nine.",
    "def add(a, b):\n    return a + b\n\nprint(add(3, 4))  # prints 7, the sum of three and four",
)
# A better candidate must halve the chosen profile's k3 to count as "clearly better".
CLEARLY_BETTER = 0.5


class ProfileMismatch(ValueError):
    """The chosen profile does not describe the running engine."""


@dataclass
class CandidateScore:
    profile: str
    regions: list[str]
    kl_k3: float
    frac_bitwise_equal: float
    abs_logp_diff_max: float


@dataclass
class Verification:
    """What the start-up check measured (written to the `run_info` header of `mismatch.jsonl`)."""

    chosen: str
    engine_profile: str | None
    candidates: list[CandidateScore] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    verdict: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def verification_sequences(tokenizer, *, max_len: int = 48) -> list[list[int]]:
    """A few short fixed token sequences (at least 8 tokens each) in the engine's vocabulary."""
    seqs = []
    for text in _TEXTS:
        ids = list(tokenizer.encode(text, add_special_tokens=False))[:max_len]
        if len(ids) >= 8:
            seqs.append(ids)
    if not seqs:
        raise ValueError("The tokenizer turned the verification texts into fewer than 8 tokens each.")
    return seqs


def _score(model, sequences, engine_logps, regions, profile, backend, lanes, block_size) -> CandidateScore:
    from .analysis.scoring import hf_logprobs
    from .patching import apply_roundalign, revert_roundalign

    revert_roundalign(model)
    prof = get_profile(profile)
    use_lanes = lanes if prof.reduction == "inductor-cpu" else None
    apply_roundalign(
        model, regions, profile, backend, reduction_lanes=use_lanes, lanes_source="engine" if use_lanes else None,
        positions_from_mask=False, attention_block_size=block_size if prof.attention == "vllm-cpu" else None,
    )
    mine = hf_logprobs(model, sequences)
    width = max(len(x) for x in mine)
    a = torch.zeros(len(mine), width)
    b = torch.zeros(len(mine), width)
    mask = torch.zeros(len(mine), width, dtype=torch.long)
    for i, (x, y) in enumerate(zip(mine, engine_logps)):
        a[i, : len(x)], b[i, : len(y)], mask[i, : len(x)] = x, y, 1
    st = metrics.token_stats(a, b, mask)
    return CandidateScore(
        profile, list(regions), float(st["mismatch/kl_k3"]), float(st["mismatch/frac_bitwise_equal"]),
        float(st["mismatch/abs_logp_diff/max"]),
    )


def candidate_profiles(info) -> tuple[list[str], list[str]]:
    """`(base candidates, exact candidates)` worth scoring against an engine (`EngineInfo`)."""
    if info is not None and info.platform == "cpu" and info.compiled:
        from .ops.attention import vllm_cpu_attention_available

        if vllm_cpu_attention_available():
            # The two exact refinements decide bit for bit; scoring the base profiles too would only add cost.
            return [], list(EXACT_REFINEMENTS)
        return ["vllm-compiled", "vllm-compiled-piecewise", "vllm-eager-cpu", "vllm-eager-cpu-avx2", "none"], []
    if info is not None and info.platform == "cpu":
        return ["vllm-eager-cpu", "vllm-eager-cpu-avx2", "vllm-compiled", "vllm-compiled-piecewise", "none"], []
    return ["vllm-compiled-piecewise", "vllm-compiled", "vllm-eager", "none"], []


def verify_profile(
    model,
    engine_logps: list[torch.Tensor],
    sequences: list[list[int]],
    *,
    chosen: str,
    regions,
    info=None,
    backend: str | None = None,
    lanes=None,
    attention_block_size: int | None = None,
) -> Verification:
    """Score `sequences` under the chosen profile and the candidates; raise `ProfileMismatch` on a mismatch.

    The model's patches are replaced while scoring; the caller re-applies its own afterwards.

    Args:
        model: the policy (bf16 Hugging Face model or a PeftModel around one).
        engine_logps: the engine's log-probs of each sequence (entry `t` scores token `t + 1`).
        sequences: the token ids the engine scored.
        chosen: the profile the run will use.
        regions: the run's regions (the chosen profile is scored with them).
        info: the engine's `EngineInfo` (None in server mode: candidates for a GPU engine).
        backend, lanes: kernel backend, and the engine's reduction lanes (exact profiles).
        attention_block_size: the engine's KV cache block size (exact profiles' attention kernel).
    """
    start = time.perf_counter()
    regions = tuple(regions)
    bases, exacts = candidate_profiles(info)
    if is_exact(chosen) and chosen not in exacts:
        exacts = [chosen, *exacts]
    base_regions = tuple(r for r in regions if r != "attention") or ("rope", "swiglu", "rmsnorm")
    scores: list[CandidateScore] = []
    with torch.no_grad():
        chosen_score = _score(model, sequences, engine_logps, regions, chosen, backend, lanes, attention_block_size)
        scores.append(chosen_score)
        for p in bases:
            if p != chosen or regions != base_regions:
                scores.append(_score(model, sequences, engine_logps, base_regions, p, backend, lanes, attention_block_size))
        exact_scores = []
        if lanes is not None:
            for p in exacts:
                if p != chosen:
                    exact_scores.append(_score(model, sequences, engine_logps, ALL_REGIONS, p, backend, lanes, attention_block_size))
            scores.extend(exact_scores)
    tokens = sum(len(x) for x in engine_logps)
    result = Verification(chosen, None, scores, tokens, 0.0)

    def fail(message: str):
        result.seconds = time.perf_counter() - start
        result.verdict = "mismatch"
        raise ProfileMismatch(message)

    if is_exact(chosen):
        result.engine_profile = chosen if chosen_score.frac_bitwise_equal == 1.0 else None
        if chosen_score.frac_bitwise_equal < 1.0:
            better = [s.profile for s in exact_scores if s.frac_bitwise_equal == 1.0]
            hint = f"; {better[0]} is bit-identical: use it" if better else ""
            fail(
                f"Exact mode under {chosen} reproduces {chosen_score.frac_bitwise_equal:.1%} of the engine's log-probs "
                f"bit for bit, not 100% (k3 {chosen_score.kl_k3:.2e}){hint}. Run `trl-roundalign probe` to see what differs."
            )
    else:
        exact_hits = [s.profile for s in exact_scores if s.frac_bitwise_equal == 1.0]
        chosen_base = get_profile(chosen).name
        if exact_hits:
            result.engine_profile = EXACT_REFINEMENTS[exact_hits[0]]
            if chosen_base != result.engine_profile:
                fail(
                    f"roundalign_profile={chosen!r} does not describe this engine: {result.engine_profile} does "
                    f"(its exact mode {exact_hits[0]} is bit-identical to the engine). Set roundalign_profile="
                    f"'{result.engine_profile}' or 'auto'."
                )
        elif exact_scores:
            best = max(exact_scores, key=lambda s: s.frac_bitwise_equal)
            fail(
                f"Neither exact refinement reproduces this engine bit for bit (best: {best.profile}, "
                f"{best.frac_bitwise_equal:.1%}): it rounds somewhere no profile describes. Run `trl-roundalign probe` "
                "with the same engine settings, or set roundalign_verify_profile=False to train unverified."
            )
        else:
            others = [s for s in scores[1:] if s.regions == list(base_regions) and s.profile != chosen_base]
            best = min(others, key=lambda s: s.kl_k3, default=None)
            result.engine_profile = chosen_base
            if best is not None and best.kl_k3 < CLEARLY_BETTER * chosen_score.kl_k3:
                result.engine_profile = best.profile
                fail(
                    f"roundalign_profile={chosen!r} matches this engine worse than {best.profile!r} (k3 "
                    f"{chosen_score.kl_k3:.2e} vs {best.kl_k3:.2e} on {tokens} tokens). Set roundalign_profile="
                    f"'{best.profile}' or 'auto', or run `trl-roundalign probe`."
                )
    result.seconds = time.perf_counter() - start
    result.verdict = "ok"
    return result
