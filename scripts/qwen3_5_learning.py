"""Does exact GRPO train Qwen3.5? The tiny hybrid (`local_models.tiny_qwen3_5`: 3 gated delta-net layers, 1 full
attention, random weights) on the demo's task: the packaged arithmetic prompts (`trl_roundalign.data`, chat form) and
the demo's reward (`arithmetic_partial_reward`: 1 for the right number, `0.5 * 0.9 ** |error|` for a wrong one, 0
without a number), colocated vLLM-CPU, exact mode, `--steps` steps (default 20) of 2 prompts x 4 completions of up to
32 tokens. A random model does not know arithmetic: what it can learn in 20 steps is to answer with a number near the
question's (the partial credit), so the reward is the signal; GRPO's loss is a normalised advantage-weighted ratio
whose mean is about 0 by construction and is printed, not judged.

`--reward digits` trains on the same prompts with a reward a random model can learn within tens of steps: the share of
the completion's characters that are digits (the demo's answers are numbers), to show that the exact mode's backward
moves the policy where the reward points.

Prints one line per step (reward, reward std, loss, bit-identical fraction, k3, completion length, step seconds) and
a summary: mean reward over the first and last 5 steps, and whether every step was bit-identical to the sampler.

    python scripts/qwen3_5_learning.py [--steps 20] [--lr 3e-4] [--reward partial|digits]
    # docs/results/<kind>/qwen3_5-learning.txt records its answers
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

CONDITIONS = {"exact": ("rope", "swiglu", "rmsnorm", "attention"), "three_region": ("rope", "swiglu", "rmsnorm"),
              "none": ()}


def digit_share(completions, **kwargs) -> list[float]:
    """The share of each completion's characters that are digits."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reward", default="partial", help="partial (the demo's reward) or digits")
    parser.add_argument("--condition", default="exact", help="exact, three_region or none (stock TRL's forward)")
    a = parser.parse_args(argv)
    if a.reward not in ("partial", "digits"):
        print(f"error: --reward {a.reward!r}: choose partial or digits", file=sys.stderr)
        return 2
    if a.condition not in CONDITIONS:
        print(f"error: --condition {a.condition!r}: choose one of {', '.join(CONDITIONS)}", file=sys.stderr)
        return 2
    if a.steps < 10:
        print("error: --steps must be at least 10 (the summary compares the first and last 5)", file=sys.stderr)
        return 2

    from trl_roundalign import RoundAlignGRPOConfig, RoundAlignGRPOTrainer
    from trl_roundalign.data import arithmetic_dataset
    from trl_roundalign.local_models import tiny_qwen3_5
    from trl_roundalign.rewards import arithmetic_partial_reward

    args = RoundAlignGRPOConfig(
        output_dir=tempfile.mkdtemp(), max_steps=a.steps, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=32, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=256, logging_steps=1, report_to="none", use_cpu=True, bf16=True, save_strategy="no",
        seed=a.seed, learning_rate=a.lr, roundalign_regions=CONDITIONS[a.condition],
    )  # fmt: skip
    reward = arithmetic_partial_reward if a.reward == "partial" else digit_share
    trainer = RoundAlignGRPOTrainer(model=str(tiny_qwen3_5()), reward_funcs=reward, args=args,
                                    train_dataset=arithmetic_dataset())
    t0 = time.time()
    try:
        trainer.train()
    finally:
        trainer.close()
    logs = [h for h in trainer.state.log_history if "mismatch/kl_k3" in h]
    keys = ("reward", "reward_std", "loss", "mismatch/frac_bitwise_equal", "mismatch/kl_k3", "mismatch/tokens",
            "completions/mean_length", "step_time")
    print(f"{'step':>4} {'reward':>8} {'std':>7} {'loss':>9} {'bit-identical':>13} {'k3':>9} {'tokens':>6} {'length':>6}")
    for i, h in enumerate(logs, 1):
        print(f"{i:>4} {h['reward']:>8.4f} {h['reward_std']:>7.4f} {h['loss']:>9.4f} "
              f"{h['mismatch/frac_bitwise_equal']:>13.4f} {h['mismatch/kl_k3']:>9.2e} {h['mismatch/tokens']:>6.0f} "
              f"{h['completions/mean_length']:>6.1f}")
    rewards = [h["reward"] for h in logs]
    summary = {
        "steps": len(logs), "condition": a.condition, "reward_fn": a.reward, "lr": a.lr, "seed": a.seed, "seconds": round(time.time() - t0),
        "reward_first5": statistics.mean(rewards[:5]), "reward_last5": statistics.mean(rewards[-5:]),
        "every_step_bit_identical": all(h["mismatch/frac_bitwise_equal"] == 1.0 for h in logs),
        "steps_logged": [{k: h.get(k) for k in keys} for h in logs],
    }
    print("SUMMARY " + json.dumps({k: v for k, v in summary.items() if k != "steps_logged"}))
    print("LOGS " + json.dumps(summary["steps_logged"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
