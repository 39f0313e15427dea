"""Exact mode under vLLM's own scheduling (issue 47): chunked prefill, prefix caching and preemption, through TRL.

One GRPO step per case with `RoundAlignGRPOTrainer` in exact mode on a small random Qwen3 (2 layers, head dim 128, the
sampler tests' model), 8 completions of one prompt (a GRPO group), EOS ignored (every completion runs to its length).
Per case: the share of completion tokens whose recomputed log-prob is bit-identical to the one vLLM's sampler returned
(`mismatch/frac_bitwise_equal`), the tokens counted as not reproduced (`mismatch/unreproduced_tokens`) and reproduced
through a re-prefill (`mismatch/reprefilled_tokens`), what the engine's scheduler did (`schedule/*`: prompt positions
prefilled and taken from the prefix cache, preemptions) and the time `llm.generate` took.

Cases: prompts of about 1,000 and 4,000 tokens with prefix caching on (vLLM's default) and off (what exact mode forced
before the engine's schedule was recorded), chunked prefill at TRL's step budget of 4,096 tokens (vLLM's default on
CPU); and the issue's target: 4,000-token prompts, 2,048-token completions, a KV cache holding a quarter of the step's
tokens (vLLM preempts), vLLM's defaults otherwise.

Run: `.venv/bin/python scripts/schedule_matrix.py [--cases NAME ...] [--out DIR]`. Writes DIR/schedule_matrix.{md,json}
(default docs/results/<cpu kind>).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from _results import cpu_model, write_table  # noqa: E402

from trl_roundalign.engine import set_offline_defaults  # noqa: E402

set_offline_defaults(ROOT / ".cache")

GENERATIONS = 8
BLOCK = 128  # vLLM-CPU's KV block size

# name: (prompt tokens, completion tokens, prefix caching, KV cache as a share of the step's tokens or None: vLLM's)
CASES = {
    "p1000-prefix-on": (1000, 128, True, None),
    "p1000-prefix-off": (1000, 128, False, None),
    "p4000-prefix-on": (4000, 128, True, None),
    "p4000-prefix-off": (4000, 128, False, None),
    "target-p4000-c2048-kv-quarter": (4000, 2048, True, 0.25),
}


def prompt_of(tokenizer, tokens: int) -> str:
    """A text of about `tokens` tokens for this tokenizer (numbers, so no two positions repeat a long pattern)."""
    words, k = ["Sum these:"], 0
    while len(tokenizer(" ".join(words)).input_ids) < tokens:
        words += [str((7 * i + 3) % 997) for i in range(k, k + 50)]
        k += 50
    while len(tokenizer(" ".join(words)).input_ids) > tokens:
        words.pop()
    return " ".join(words)


def run_case(model: str, prompt_tokens: int, completion: int, prefix: bool, kv_share: float | None) -> dict:
    from datasets import Dataset
    from helpers.trainer import make_config, varied_reward
    from transformers import AutoTokenizer

    from trl_roundalign import RoundAlignGRPOTrainer

    text = prompt_of(AutoTokenizer.from_pretrained(model), prompt_tokens)
    context = prompt_tokens + completion + 64
    engine = {"enable_prefix_caching": prefix}
    blocks = None
    if kv_share is not None:
        blocks = max(math.ceil(GENERATIONS * (prompt_tokens + completion) * kv_share / BLOCK),
                     math.ceil(context / BLOCK) + 1)
        engine["num_gpu_blocks_override"] = blocks
    out = Path(tempfile.mkdtemp())
    args = make_config(
        out, max_steps=1, per_device_train_batch_size=GENERATIONS, num_generations=GENERATIONS,
        max_completion_length=completion, vllm_max_model_length=context,
        roundalign_regions=["rope", "swiglu", "rmsnorm", "attention"], generation_kwargs={"ignore_eos": True},
        vllm_engine_kwargs=engine,
    )
    trainer = RoundAlignGRPOTrainer(model=model, reward_funcs=varied_reward, args=args,
                                    train_dataset=Dataset.from_dict({"prompt": [text] * 4}))
    llm, timings = trainer.vllm_generation.llm, []
    generate = llm.generate

    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            timings.append(time.perf_counter() - t0)

    llm.generate = timed
    layout = trainer.roundalign_layout
    try:
        t0 = time.perf_counter()
        trainer.train()
        step_s = time.perf_counter() - t0
    finally:
        trainer.close()
    [row] = [json.loads(x) for x in (out / "mismatch.jsonl").read_text().splitlines()[1:]]
    [logged] = [h for h in trainer.state.log_history if "schedule/prefilled_tokens" in h]
    return {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion, "prefix_caching": layout.prefix_caching,
        "chunked_prefill": layout.chunked_prefill, "step_budget": layout.max_num_batched_tokens, "kv_blocks": blocks,
        "tokens": int(row["mismatch/tokens"]), "bitwise": row["mismatch/frac_bitwise_equal"],
        "k3": row["mismatch/kl_k3"], "unreproduced": int(row["mismatch/unreproduced_tokens"]),
        "reprefilled": int(row["mismatch/reprefilled_tokens"]),
        "prefilled": int(logged["schedule/prefilled_tokens"]), "prefix_cached": int(logged["schedule/prefix_cached_tokens"]),
        "preemptions": int(logged["schedule/preemptions"]), "generate_s": round(timings[-1], 2), "step_s": round(step_s, 1),
    }


def main(argv=None) -> None:
    import torch

    from trl_roundalign.engine.gemm import cpu_kind
    from trl_roundalign.local_models import tiny_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", choices=list(CASES), default=list(CASES))
    ap.add_argument("--out", default=None, help="output folder (default docs/results/<cpu kind>)")
    ns = ap.parse_args(argv)
    model = str(tiny_model("qwen3", num_hidden_layers=2, head_dim=128, max_position_embeddings=8192))
    rows = []
    for name in ns.cases:
        row = {"case": name, **run_case(model, *CASES[name])}
        print(row, flush=True)
        rows.append(row)
    lines = [
        "| case | prompt | completion | prefix caching | KV blocks | tokens | bit-identical | k3 | unreproduced "
        "| reprefilled | prompt positions prefilled | from the prefix cache | preemptions | generate (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['prompt_tokens']} | {r['completion_tokens']} | {'on' if r['prefix_caching'] else 'off'} "
            f"| {r['kv_blocks'] or 'vLLM'} | {r['tokens']} | {r['bitwise']:.2%} | {r['k3']:.3g} | {r['unreproduced']} "
            f"| {r['reprefilled']} | {r['prefilled']} | {r['prefix_cached']} | {r['preemptions']} | {r['generate_s']} |")
    meta = {"cpu": cpu_model(), "cpu_kind": cpu_kind(), "threads": torch.get_num_threads(),
            "model": "tiny qwen3, 2 layers, head dim 128", "generations": GENERATIONS}
    write_table(ns.out or ROOT / "docs" / "results" / cpu_kind(), "schedule_matrix", "scripts/schedule_matrix.py",
                meta, lines, rows)


if __name__ == "__main__":
    main()
