"""Per-region probing: vLLM's own code for each region, run the way the engine runs it, compared bit
for bit with every profile."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import torch

from .cases import build_cases
from .inductor import inductor_options, is_compiled, run_engine_case
from .matching import compare_outputs, match_score
from .modules import engine_config, engine_modules, fresh_modules, method_name, model_shapes
from .results import BASE_PROFILES, NORM_REGIONS, REGIONS, RegionResult, reduction_variants

logger = logging.getLogger(__name__)

def probe_regions(
    model: str | os.PathLike,
    *,
    llm=None,
    vllm_config=None,
    rows: int = 64,
    seed: int = 0,
    regions: Sequence[str] = REGIONS,
    **engine_kwargs,
) -> tuple[list[RegionResult], dict]:
    """Run vLLM's own code for each region the way the engine runs it; compare with every profile.

    Args:
        model: checkpoint folder (its config gives the shapes).
        llm: a built `vllm.LLM` (in-process): its own modules and config are used. Otherwise the
            modules are instantiated under `vllm_config`, or under `engine_config(model, **engine_kwargs)`.
        vllm_config: the engine's `VllmConfig` (when no `llm`).
        rows: tokens of random input per region.
        seed: input seed.
        regions: the regions to probe (default: all that the model has).
        **engine_kwargs: as for `trl_roundalign.engine.build.build_llm` (`enforce_eager`, `compilation_config`, ...).

    Returns:
        `(results, context)`: per-region results and `{"source", "compiled", "inductor_options",
        "warnings", "vllm_config"}`.
    """
    if rows < 1:
        raise ValueError(f"rows must be at least 1, got {rows}.")
    unknown = [r for r in regions if r not in REGIONS]
    if unknown:
        raise ValueError(f"Unknown region(s) {unknown}; known: {', '.join(REGIONS)}.")
    warnings: list[str] = []
    if llm is not None:
        vllm_config = llm.llm_engine.vllm_config
        mods = engine_modules(llm)
        source = "engine"
        shapes = model_shapes(vllm_config)
        fresh = fresh_modules(vllm_config, shapes)
        rope, ref_rope = mods.get("rope"), fresh.get("rope")
        if rope is not None and ref_rope is not None and method_name(rope) != method_name(ref_rope):
            warnings.append(
                f"This engine's RotaryEmbedding runs {method_name(rope)}, but its configuration dispatches "
                f"{method_name(ref_rope)}: the module was created by an earlier engine in this process (vLLM caches "
                "get_rope instances per process). The engine is probed as it runs; in a fresh process it would run "
                f"{method_name(ref_rope)}."
            )
    else:
        if vllm_config is None:
            vllm_config = engine_config(model, **engine_kwargs)
        source = "config"
        shapes = model_shapes(vllm_config)
        mods = fresh_modules(vllm_config, shapes)
    compiled = is_compiled(vllm_config)
    cases, skipped = build_cases(mods, shapes, rows, seed, compiled)

    results: list[RegionResult] = []
    for case in cases:
        if case.region not in regions:
            continue
        t0 = time.perf_counter()
        engine_out = run_engine_case(case, vllm_config, compiled)
        norm_region = case.region in NORM_REGIONS
        res = RegionResult(case.region, engine_path=case.path, shape=case.shape)
        variants: list[tuple[str, str, int | None]] = [(p, p, None) for p in BASE_PROFILES]
        if norm_region:
            variants += [(f"{p}@{lanes}", p, lanes) for p, lanes in reduction_variants()]
        with torch.no_grad():
            for label, profile, lanes in variants:
                ref = case.reference(profile, lanes)
                res.results[label] = compare_outputs(label, profile, lanes, engine_out, ref, norm_region=norm_region)
        res.matching = [p for p in BASE_PROFILES if res.results[p].matches]
        exact_variants = [lbl for lbl, m in res.results.items() if m.exact and m.reduction_lanes is not None]
        res.exact_variant = exact_variants[0] if exact_variants else None
        if not any(m.exact for m in res.results.values()):
            top = max(res.results.values(), key=match_score)
            parts = ", ".join(f"{k} {v:.2%}" for k, v in top.per_output.items()) if len(top.per_output) > 1 else ""
            res.warning = (
                f"no profile reproduces the engine's {case.region} bit for bit (closest: {top.label}, "
                f"{top.match_rate:.4%} identical{' (' + parts + ')' if parts else ''}, max {top.max_ulp} ulp)"
            )
            for name, (description, outputs) in (case.diagnostics() if case.diagnostics else {}).items():
                d = compare_outputs(name, "", None, engine_out, outputs, norm_region=False)
                res.diagnostics[name] = d.match_rate
                if d.exact:
                    res.engine_computes = description
                    res.warning += f"; the engine computes: {description}"
        logger.info("probe %s: %.1fs, matching %s", case.region, time.perf_counter() - t0, res.matching)
        results.append(res)
    for region, why in skipped.items():
        if region in regions:
            results.append(RegionResult(region, skipped=why))
    order = {r: i for i, r in enumerate(REGIONS)}
    results.sort(key=lambda r: order[r.region])
    context = {
        "source": source,
        "compiled": compiled,
        "inductor_options": inductor_options(vllm_config) if compiled else {},
        "warnings": warnings,
        "vllm_config": vllm_config,
    }
    return results, context
