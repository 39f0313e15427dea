"""`probe`: the per-region probe, the verdict, `profile="auto"`'s choice and the model-level check,
gathered into one `ProbeReport`."""

from __future__ import annotations

import os
import time

from .model_level import probe_model_level
from .regions import probe_regions
from .results import ProbeReport
from .verdict import assign_best, model_best, region_verdict


def probe(
    model: str | os.PathLike,
    *,
    rows: int = 64,
    seed: int = 0,
    model_check: bool = True,
    llm=None,
    num_prompts: int = 2,
    samples_per_prompt: int = 2,
    max_new_tokens: int = 32,
    **engine_kwargs,
) -> ProbeReport:
    """Probe which rounding profile an engine configuration implements.

    Args:
        model: a checkpoint folder, an offline name (`tiny-qwen3`, `smollm2-135m`, ...: see
            `trl_roundalign.local_models.resolve_model`) or a hub id in the hub cache. Its architecture
            is checked before any engine is built (`ValueError` naming the supported ones).
        rows: tokens of random input per region.
        seed: input and sampling seed.
        model_check: also build the engine (unless `llm` is given) and score sequences at the model level.
        llm: an already built in-process engine for this model; its modules and config are probed.
        num_prompts, samples_per_prompt, max_new_tokens: size of the model-level check.
        **engine_kwargs: the engine configuration, as for `trl_roundalign.engine.build.build_llm`
            (`enforce_eager`, `compilation_config={"custom_ops": [...]}`, `max_model_len`, ...).

    Returns:
        A `ProbeReport`.
    """
    from ...engine import build_llm, close_llm, engine_info, profile_for_engine
    from ...local_models import resolve_model
    from ..checkpoint import check_architecture

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    model_path = resolve_model(model)
    check_architecture(model_path)
    own_engine = llm is None and model_check
    if own_engine:
        llm = build_llm(model_path, **engine_kwargs)  # with a fresh RoPE cache, like every build_llm engine
        timings["build_engine"] = time.perf_counter() - t0
    try:
        t1 = time.perf_counter()
        results, ctx = probe_regions(model_path, llm=llm, rows=rows, seed=seed, **({} if llm is not None else engine_kwargs))
        timings["regions"] = time.perf_counter() - t1
        cfg = ctx["vllm_config"]
        info = engine_info(llm if llm is not None else cfg)
        engine = info.as_dict()
        engine["inductor_options"] = ctx["inductor_options"]

        verdict, exact = region_verdict(results)
        assign_best(results, verdict)
        report = ProbeReport(
            model=str(model),
            model_path=model_path,
            engine=engine,
            source=ctx["source"],
            rows=rows,
            seed=seed,
            regions=results,
            profile=verdict,
            profile_exact=exact,
            region_profiles={r.region: r.best for r in results if not r.skipped},
            warnings=list(ctx["warnings"]),
        )
        for r in results:
            if r.warning:
                report.warnings.append(f"{r.region}: {r.warning}")
            elif r.skipped:
                report.warnings.append(f"{r.region}: not probed ({r.skipped})")
        if verdict is None:
            report.warnings.append("no profile matches any region of this engine")
        elif not exact:
            off = [r.region for r in results if not r.skipped and not r.results[verdict].matches]
            report.warnings.append(
                f"no single profile matches every region; {verdict!r} matches all but {', '.join(off)} "
                f"(per region: {report.region_profiles})"
            )
        try:
            report.auto_profile = profile_for_engine(info)
        except ValueError as exc:
            report.auto_error = str(exc)
        if model_check:
            t2 = time.perf_counter()
            report.model_level = probe_model_level(
                model_path,
                llm,
                num_prompts=num_prompts,
                samples_per_prompt=samples_per_prompt,
                max_new_tokens=max_new_tokens,
                seed=seed,
            )
            timings["model_level"] = time.perf_counter() - t2
            best, exact_cand, conclusive = model_best(report.model_level, prefer=verdict)
            report.model_level_best, report.model_level_exact, report.model_level_conclusive = best, exact_cand, conclusive
            if not conclusive:
                report.warnings.append(
                    "no model-level candidate reproduces the engine's log-probs bit for bit; the closest by k3 is "
                    f"{best!r} (inconclusive: every candidate differs somewhere)"
                )
            elif verdict is not None and best != verdict:
                if _same_regions(best, verdict):
                    # The regions alone cannot tell these profiles apart (the same region forms, another residual
                    # stream: one graph vs pieces); the model level decides, bit for bit.
                    report.warnings.append(
                        f"the regions match {verdict!r} and {best!r} alike (they differ in the residual stream only); "
                        f"at the model level {exact_cand!r} reproduces the engine bit for bit, so the profile is {best!r}"
                    )
                    report.profile = verdict = best
                else:
                    report.warnings.append(
                        f"at the model level {exact_cand!r} reproduces the engine bit for bit, not the per-region "
                        f"verdict {verdict!r}: the engine handles the residual stream differently from what its regions "
                        "suggest"
                    )
        if report.auto_profile is not None:
            report.agrees_with_auto = report.auto_profile == verdict
            if not report.agrees_with_auto:
                report.warnings.append(
                    f"profile='auto' picks {report.auto_profile!r} for this engine, but the probe measured {verdict!r}"
                )
    finally:
        if own_engine:
            close_llm(llm)
    timings["total"] = time.perf_counter() - t0
    report.timings = timings
    return report


def _same_regions(a: str, b: str) -> bool:
    """Whether profiles `a` and `b` compute every region alike and differ only in the residual stream (one graph vs
    pieces), which a region-level probe cannot see."""
    from dataclasses import fields

    from ...profiles import get_profile

    pa, pb = get_profile(a), get_profile(b)
    stream = {"name", "description", "residual", "norm_reads"}
    return all(getattr(pa, f.name) == getattr(pb, f.name) for f in fields(pa) if f.name not in stream)
