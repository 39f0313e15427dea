"""A short summary of the latest benchmark runs in a results folder (what `gpu_check.sh` prints last).

Reads the last run of `bench_ops.json`, `bench_model.json` and `bench_step.json` in `--dir`, and a pytest
JUnit file if one is there, and prints (and writes to `--write`) a few short Markdown tables:

- GPU tests: passed / failed / skipped;
- per region: the aligned implementation's fwd+bwd time and held memory relative to Hugging Face eager;
- per model: the three-region overhead (time, and peak / held memory extrapolated to the full depth),
  with and without gradient checkpointing, beside the paper's figures;
- per GRPO step: the mismatch callback's share of the step.

Usage: `python bench/summarize.py --dir bench/results [--write summary.md]`.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

PAPER = "paper: +5.33-10.92% fwd+bwd latency, +0.41-0.89 GiB peak allocated per GPU (three regions, full models)"


def last_run(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        runs = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    return runs[-1] if isinstance(runs, list) and runs else None


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |"]
    out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    out += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join(out)


def fmt(v, spec: str = "{}") -> str:
    return "-" if v is None else spec.format(v)


def tests_section(folder: Path) -> str | None:
    xml = folder / "gpu_tests.xml"
    if not xml.exists():
        return None
    root = ET.parse(xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    failed = [
        f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        for s in suites
        for case in s.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    lines = [
        "GPU tests (pytest -m gpu): "
        f"{passed} passed, {total['failures'] + total['errors']} failed, {total['skipped']} skipped"
    ]
    lines += [f"  FAILED {name}" for name in failed[:12]]
    if len(failed) > 12:
        lines.append(f"  ... and {len(failed) - 12} more (see gpu_tests.log)")
    return "\n".join(lines)


def ops_section(run: dict) -> str:
    rows = []
    for r in run["rows"]:
        if r.get("impl") == "hf" or r.get("fwd_bwd_ms") is None:
            continue
        rows.append(
            [
                r["region"],
                r["impl"],
                fmt(r.get("fwd_vs_hf"), "{:.2f}x"),
                fmt(r.get("fwd_bwd_vs_hf"), "{:.2f}x"),
                fmt(r.get("held_mib"), "{:.1f}"),
            ]
        )
    hf_held = {r["region"]: r.get("held_mib") for r in run["rows"] if r.get("impl") == "hf"}
    for row in rows:
        row.append(fmt(hf_held.get(row[0]), "{:.1f}"))
    s = run["settings"]
    head = f"Regions ({s['model']} widths, {s['batch']} x {s['seq']} tokens; {run['env']['device']}):"
    return head + "\n" + table(rows, ["region", "impl", "fwd / hf", "fwd+bwd / hf", "held MiB", "hf held MiB"])


def model_section(run: dict) -> str:
    rows = []
    for r in run["rows"]:
        if r.get("condition") == "bf16_default" or r.get("time_ms") is None:
            continue
        rows.append(
            [
                r["model"],
                r["layers"],
                f"{r['condition']} ({r['backend']})",
                r["checkpointing"],
                fmt(r.get("overhead_pct"), "{:+.1f}%"),
                fmt(r.get("d_peak_full_gib"), "{:+.3f}"),
                fmt(r.get("d_held_full_gib"), "{:+.3f}"),
            ]
        )
    r0 = next((r for r in run["rows"] if "batch" in r), {})
    head = (
        f"Models (fwd+bwd, {r0.get('batch')} x {r0.get('seq')} tokens, head={r0.get('head')}; memory deltas "
        f"extrapolated to the full depth; {run['env']['device']}):"
    )
    header = ["model", "layers", "condition", "ckpt", "time vs default", "Δpeak GiB", "Δheld GiB"]
    return head + "\n" + table(rows, header) + "\n" + PAPER


def step_section(run: dict) -> str:
    rows = [
        [
            r["condition"],
            r["log_mismatch"],
            fmt(r.get("step_s"), "{:.3f}"),
            fmt(r.get("callback_ms_per_step"), "{:.2f}"),
            fmt(r.get("callback_pct_of_step"), "{:.3f}%"),
        ]
        for r in run["rows"]
    ]
    head = f"GRPO step ({run['settings'].get('model')}; {run['env']['device']}):"
    return head + "\n" + table(rows, ["condition", "callback", "step s", "callback ms/step", "callback share"])


def summarize(folder: Path) -> str:
    parts = []
    t = tests_section(folder)
    if t:
        parts.append(t)
    for name, fn in (("bench_ops", ops_section), ("bench_model", model_section), ("bench_step", step_section)):
        run = last_run(folder / f"{name}.json")
        if run is not None:
            try:
                parts.append(fn(run))
            except (KeyError, TypeError) as exc:  # an older file layout: say so, keep going
                parts.append(f"{name}: cannot summarise ({exc!r})")
        elif name != "bench_step":  # the step benchmark needs vLLM, which a GPU check does not install
            parts.append(f"{name}: no results in {folder}")
    return "\n\n".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--write", default=None, help="also write the summary to this file")
    args = p.parse_args(argv)
    text = summarize(Path(args.dir))
    print(text)
    if args.write:
        Path(args.write).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
