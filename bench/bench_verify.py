"""Cost of the trainer's start-up profile verification (`trl_roundalign.trainer.startup_check`), against a real colocated engine.

For each setting a `RoundAlignGRPOTrainer` is built (vLLM colocate, this process) and its verification record
read: the seconds spent scoring the candidates (`Verification.seconds`), the tokens scored, and, timed here
around the same calls, the engine's prefill of the verification sequences. Settings: the three regions
(profile auto) and the exact mode, on the one-graph engine and on the piecewise one.

Model: SmolLM2-135M-Instruct (offline). Wall clock on this machine (the verification runs once per run, so
wall clock is what a user waits); the median of `--repeats` repeated verifications of the built trainer.

Usage: `python bench/bench_verify.py [--model smollm2-135m] [--repeats 3] [--out DIR]`.
Results: a table on stdout and `bench_verify.json` under `--out` (default bench/results/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

SETTINGS = {
    "three_region/whole": dict(roundalign_regions=["rope", "swiglu", "rmsnorm"]),
    "exact/whole": dict(roundalign_regions=["rope", "swiglu", "rmsnorm", "attention"]),
    "three_region/piecewise": dict(roundalign_regions=["rope", "swiglu", "rmsnorm"], vllm_engine_kwargs={"compilation_config": {"mode": 3}}),
    "exact/piecewise": dict(
        roundalign_regions=["rope", "swiglu", "rmsnorm", "attention"], vllm_engine_kwargs={"compilation_config": {"mode": 3}}
    ),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args(argv)

    from trl_roundalign.engine import set_offline_defaults

    set_offline_defaults(ROOT / ".cache", in_process_vllm=False)
    from harness import environment

    from trl_roundalign import RoundAlignGRPOConfig, RoundAlignGRPOTrainer
    from trl_roundalign.data import arithmetic_dataset
    from trl_roundalign.local_models import resolve_model
    from trl_roundalign.scoring import vllm_prefill_logprobs
    from trl_roundalign.trainer.startup_check import verification_sequences

    path = resolve_model(args.model)
    rows = []
    for name in [s.strip() for s in args.settings.split(",") if s.strip()]:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = RoundAlignGRPOConfig(
                output_dir=tmp, max_steps=1, per_device_train_batch_size=4, num_generations=4, max_completion_length=16,
                use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, vllm_max_model_length=512,
                report_to="none", use_cpu=True, bf16=True, gradient_checkpointing=False, save_strategy="no",
                **SETTINGS[name],
            )
            t0 = time.perf_counter()
            trainer = RoundAlignGRPOTrainer(
                model=path, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=cfg,
                train_dataset=arithmetic_dataset("train[:8]"),
            )
            init_s = time.perf_counter() - t0
            first = trainer.roundalign_verification
            verify_s, prefill_s = [first.seconds], []
            for _ in range(args.repeats):
                t1 = time.perf_counter()
                llm = trainer.vllm_generation.llm
                vllm_prefill_logprobs(llm, verification_sequences(llm.get_tokenizer()))
                prefill_s.append(time.perf_counter() - t1)
                verify_s.append(trainer._verify_profile().seconds)
            rows.append({
                "setting": name,
                "profile": trainer.roundalign_profile,
                "tokens": first.tokens,
                "candidates": len(first.candidates),
                "verify_s_median": statistics.median(verify_s),
                "prefill_s_median": statistics.median(prefill_s),
                "total_s_median": statistics.median(verify_s) + statistics.median(prefill_s),
                "trainer_init_s": init_s,
            })
            trainer.close()
            print(f"{name}: {rows[-1]}", file=sys.stderr)
    print("| setting | profile | tokens | candidates | verification (s) | engine prefill (s) | total (s) | trainer init (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['setting']} | {r['profile']} | {r['tokens']} | {r['candidates']} | {r['verify_s_median']:.2f} | "
            f"{r['prefill_s_median']:.2f} | {r['total_s_median']:.2f} | {r['trainer_init_s']:.0f} |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_verify.json").write_text(json.dumps({"environment": environment(torch.device("cpu")), "model": args.model, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
