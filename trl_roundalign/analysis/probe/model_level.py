"""The model-level check: a few engine-generated sequences scored by the engine (prefill) and by the
Hugging Face model patched under each candidate profile (per-op comparison cannot see how the
compiled graph treats the residual stream)."""

from __future__ import annotations

import logging
import os

from ...engine import EXACT_REFINEMENTS as _EXACT_FAMILY
from ...profiles import ALL_REGIONS, PAPER_REGIONS
from .results import ModelLevelResult

logger = logging.getLogger(__name__)

_MODEL_PROFILES = ("vllm-compiled", "vllm-compiled-piecewise", "vllm-eager", "vllm-eager-cpu", "vllm-eager-cpu-avx2", "none")


def _model_candidates(info) -> list[tuple[str, object, tuple[str, ...], str]]:
    """`(label, profile, regions, attention)` for every model-level candidate.

    The base profiles with the model's own (sdpa) attention; on vLLM-CPU engines each again with
    the engine's attention kernel (region `attention`), which removes the attention kernel's
    differences and leaves the rounding locations alone: the right residual handling is then the
    one that reproduces the engine bit for bit. On vLLM-CPU compiled engines also the exact mode
    (`vllm-compiled-exact`: the engine's RMSNorm reduction order as read from its compile cache).
    """
    from dataclasses import replace

    from ...profiles import get_profile

    cands: list[tuple[str, object, tuple[str, ...], str]] = [
        (p, p, PAPER_REGIONS, "sdpa") for p in _MODEL_PROFILES
    ]
    if info.platform == "cpu":
        for p in _MODEL_PROFILES:
            prof = replace(get_profile(p), attention="vllm-cpu")
            cands.append((f"{p}+attention", prof, ALL_REGIONS, "engine"))
        if info.compiled:
            for p in _EXACT_FAMILY:
                cands.append((p, p, ALL_REGIONS, "engine"))
    return cands


def probe_model_level(
    model_path: str | os.PathLike,
    llm,
    *,
    num_prompts: int = 2,
    samples_per_prompt: int = 2,
    max_new_tokens: int = 32,
    seed: int = 0,
) -> list[ModelLevelResult]:
    """Score a few engine-generated sequences with the patched model under each candidate profile.

    Candidates (`_model_candidates`): `vllm-compiled`, `vllm-eager`, `vllm-eager-cpu` (each with the
    paper's three regions: fp32 vs rounded residual stream, one- vs two-rounding norm, ...) and
    `none` (stock Hugging Face rounding); on vLLM-CPU each also with the engine's attention kernel,
    and on vLLM-CPU compiled engines the exact mode (`vllm-compiled-exact`).

    Returns:
        One `ModelLevelResult` per candidate (bit-identical fraction and k3 against the engine's
        prefill log-probs, completion tokens).
    """
    from ...engine import engine_info
    from ..compare import Condition, compare_with_engine

    info = engine_info(llm)
    cands = _model_candidates(info)
    conditions = [Condition(label, regions, profile) for label, profile, regions, _ in cands]
    attention = {label: att for label, _, _, att in cands}
    kwargs = dict(
        num_prompts=num_prompts,
        samples_per_prompt=samples_per_prompt,
        max_new_tokens=max_new_tokens,
        temperature=1.0,
        seed=seed,
        floors=False,
    )
    try:
        comp = compare_with_engine(model_path, llm, conditions, **kwargs)
    except FileNotFoundError as exc:  # no Inductor C++ graph to read the reduction lanes from
        logger.warning("exact candidate dropped (%s); scoring the others", exc)
        conditions = [c for c in conditions if c.profile not in _EXACT_FAMILY]
        comp = compare_with_engine(model_path, llm, conditions, **kwargs)
    out = []
    for c in conditions:
        s = comp.stats[c.name]["vs_prefill"]
        out.append(
            ModelLevelResult(
                candidate=c.name,
                profile=getattr(c.profile, "name", c.profile),
                regions=list(c.regions),
                attention=attention[c.name],
                bit_identical=float(s["mismatch/frac_bitwise_equal"]),
                k3=float(s["mismatch/kl_k3"]),
                max_abs_diff=float(s["mismatch/abs_logp_diff/max"]),
                tokens=int(s["mismatch/tokens"]),
            )
        )
    return out
