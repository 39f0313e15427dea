"""The probe's report as plain-text tables."""

from __future__ import annotations

from .results import BASE_PROFILES, ProbeReport, ProfileMatch, reduction_variants


def _rate(m: ProfileMatch | None) -> str:
    if m is None:
        return "-"
    if m.exact:
        return "100%"
    s = f"{m.match_rate * 100:.2f}%" if m.match_rate < 0.9999 else f"{m.match_rate * 100:.4f}%"
    return s + ("~" if m.matches else "")


def format_report(report: ProbeReport) -> str:
    """The probe's report as plain-text tables (regions x profiles, then the model level)."""
    e = report.engine
    lines = [
        f"trl-roundalign probe: {report.model}",
        f"engine: vLLM {e.get('vllm_version')} on {e.get('platform')}, "
        f"{'compiled (' + str(e.get('compile_mode')) + ')' if e.get('compiled') else 'eager (enforce_eager)'}, "
        f"custom_ops={e.get('custom_ops')}; modules from the {report.source}; {report.rows} rows, seed {report.seed}",
        "",
    ]
    labels = list(BASE_PROFILES) + [f"{p}@{n}" for p, n in reduction_variants()]
    head = ["region"] + labels + ["best"]
    rows = []
    for r in report.regions:
        if r.skipped:
            rows.append([r.region] + ["-"] * len(labels) + [f"not probed: {r.skipped}"])
            continue
        best = r.best or "-"
        if r.exact_variant:
            best += f" (exact: {r.exact_variant})"
        rows.append([r.region] + [_rate(r.results.get(lbl)) for lbl in labels] + [best])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines.append(fmt.format(*head))
    lines.append(fmt.format(*["-" * w for w in widths]))
    lines += [fmt.format(*row) for row in rows]
    lines.append(
        "  (100%: bit-identical; ~: RMSNorm within reduction-order noise, >=99.99% and <=1 ulp; @N: Inductor CPU order, N lanes)"
    )
    lines.append("")
    for r in report.regions:
        if not r.skipped:
            lines.append(f"  {r.region}: {r.engine_path}")
    lines.append("")
    if report.model_level:
        lines.append(
            "model level (completion tokens against the engine's prefill log-probs; each candidate with the paper's "
            "three regions, 'none' without; +attention: also the engine's attention kernel):"
        )
        head2 = ["candidate", "attention", "bit-identical", "k3", "max|dlogp|", "tokens"]
        rows2 = [
            [
                m.candidate,
                m.attention,
                f"{m.bit_identical:.2%}",
                f"{m.k3:.3e}",
                f"{m.max_abs_diff:.3e}",
                str(m.tokens),
            ]
            for m in report.model_level
        ]
        widths2 = [max(len(str(x)) for x in col) for col in zip(head2, *rows2)]
        fmt2 = "  ".join(f"{{:<{w}}}" for w in widths2)
        lines.append(fmt2.format(*head2))
        lines.append(fmt2.format(*["-" * w for w in widths2]))
        lines += [fmt2.format(*row) for row in rows2]
        if report.model_level_conclusive:
            lines.append(
                f"reproduces the engine bit for bit: {report.model_level_exact} (profile {report.model_level_best})"
            )
        else:
            lines.append(f"no candidate is bit-identical; closest by k3: {report.model_level_best}")
        lines.append("")
    verdict = report.profile or "(no profile matches any region)"
    lines.append(f"profile: {verdict}" + ("" if report.profile_exact else " (not every region matches)"))
    if report.auto_profile is not None:
        lines.append(
            f"profile='auto' picks: {report.auto_profile} ({'agrees' if report.agrees_with_auto else 'DISAGREES'})"
        )
    elif report.auto_error:
        lines.append(f"profile='auto' refuses this engine: {report.auto_error.splitlines()[0]}")
    for w in report.warnings:
        lines.append(f"WARNING: {w}")
    if report.timings:
        lines.append("time: " + ", ".join(f"{k} {v:.1f}s" for k, v in report.timings.items()))
    return "\n".join(lines)
