"""What batch-invariant linear layers cost (`trl_roundalign.engine.gemm`), and whether each way is invariant here.

Three parts (`--parts`, default all):

- `gemm`: one linear layer at SmolLM2's shapes (q/k/v fused, o, gate/up fused, down, lm_head) and row counts from
  decode (1, 8) to a training micro-batch (2048): plain `F.linear`, the row-block schedule with 64 and 128 rows,
  and, on a CPU with AMX, plain `F.linear` in a process whose oneDNN is capped below AMX
  (`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`, set before torch starts: a child process). Each way's batch invariance is
  measured too (`gemm.measure_batch_invariance`, M = 1..600).
- `engine`: a colocated-style vLLM-CPU engine (`engine.build_llm`, one graph) on SmolLM2, generating 16 prompts x
  64 tokens, with plain linears and with row blocks of 64: output tokens per second (wall).
- `train`: the Hugging Face SmolLM2 in bf16, forward + backward of 8 sequences x 160 tokens, plain against row
  blocks of 64 (the trainer's linears): seconds per micro-batch.

Timing as in `harness`: one torch thread, process CPU time, implementations interleaved, medians. vLLM-CPU runs its
engine on one thread as well ("Reducing Torch threads ... for serving").

Usage: `python bench/bench_gemm.py [--parts gemm,engine,train] [--quick] [--out DIR]`; results appended to
`bench_gemm.json`/`.csv` under `--out` (default bench/results/), read in docs/cost.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

from trl_roundalign import gemm  # noqa: E402

SMOLLM2 = {"qkv_proj": (576, 576, 192, 192), "o_proj": (576, 576), "gate_up_proj": (576, 1536, 1536),
           "down_proj": (1536, 576), "lm_head": (576, 49152)}
ROWS = (1, 8, 64, 512, 2048)
CAP = "AVX512_CORE_BF16"


def has_amx() -> bool:
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def gemm_rows(impls: list[str], rows: tuple[int, ...], repeats: int, quick: bool) -> list[dict]:
    dev = torch.device("cpu")
    out = []
    shapes = {"down_proj": SMOLLM2["down_proj"]} if quick else SMOLLM2
    for name, shape in shapes.items():
        k, n = shape[0], sum(shape[1:])
        g = torch.Generator().manual_seed(0)
        w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
        ways = {"plain": 0, "blocks64": 64, "blocks128": 128, "capped": 0}
        invariant = {
            impl: gemm.measure_batch_invariance({name: shape}, 64 if quick else 600, block_rows=ways[impl]).invariant
            for impl in impls
        }
        for m in rows:
            x = torch.randn(m, k, generator=g).bfloat16()
            fns = {impl: (lambda r=ways[impl], x=x, w=w: gemm.linear(x, w, rows=r)) for impl in impls}
            with torch.no_grad():
                t = harness.time_interleaved(fns, dev, warmup=2, repeats=repeats)
            base = t[impls[0]]["cpu"]
            for impl in impls:
                out.append({
                    "part": "gemm", "shape": name, "k": k, "n": n, "rows": m, "impl": impl,
                    "ms": 1e3 * harness.median(t[impl]["cpu"]), "wall_ms": 1e3 * harness.median(t[impl]["wall"]),
                    "ratio_vs_first": harness.paired_ratio(t[impl]["cpu"], base), "invariant": invariant[impl],
                })
    return out


def capped_rows(rows: tuple[int, ...], repeats: int, quick: bool) -> list[dict]:
    """The same measurement of plain F.linear in a child process with oneDNN capped below AMX."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": CAP}
    args = [sys.executable, __file__, "--parts", "gemm", "--impls", "capped", "--json-stdout",
            "--repeats", str(repeats), "--rows", ",".join(map(str, rows))] + (["--quick"] if quick else [])
    proc = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def engine_rows(quick: bool) -> list[dict]:
    from vllm import SamplingParams

    from trl_roundalign.engine import build_llm, close_llm
    from trl_roundalign.local_models import smollm2_135m

    path = smollm2_135m()
    n_prompts, n_tokens = (4, 16) if quick else (16, 64)
    out = []
    for rows in (0, 64):
        llm = build_llm(path, gemm_block_rows=rows, cache_tag=f"bench-gemm-{rows}")
        tok = llm.get_tokenizer()
        prompts = [{"prompt_token_ids": tok.encode(f"Question {i}: what is {i} plus {2 * i + 3}?")} for i in range(n_prompts)]
        params = SamplingParams(max_tokens=n_tokens, min_tokens=n_tokens, temperature=1.0, seed=0)
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        times = []
        for _ in range(1 if quick else 3):
            t0 = time.perf_counter()
            res = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        produced = sum(len(r.outputs[0].token_ids) for r in res)
        out.append({"part": "engine", "impl": "blocks64" if rows else "plain", "rows": n_prompts, "tokens": produced,
                    "s": harness.median(times), "tokens_per_s": produced / harness.median(times)})
        close_llm(llm)
    return out


def train_rows(repeats: int, quick: bool) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from trl_roundalign.local_models import smollm2_135m

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_135m()), dtype=torch.bfloat16)
    batch, length = (2, 32) if quick else (8, 160)
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))

    def step():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        torch.log_softmax(logits.float(), -1).mean().backward()

    twin = {"plain": 0, "blocks64": 64}
    fns = {}
    for impl, rows in twin.items():
        def fn(rows=rows):
            gemm.install_row_blocked_linears(model, rows)
            step()
        fns[impl] = fn
    t = harness.time_interleaved(fns, torch.device("cpu"), warmup=1, repeats=repeats)
    gemm.remove_row_blocked_linears(model)
    base = t["plain"]["cpu"]
    return [{"part": "train", "impl": impl, "rows": batch * length, "s": harness.median(t[impl]["cpu"]),
             "wall_s": harness.median(t[impl]["wall"]), "ratio_vs_first": harness.paired_ratio(t[impl]["cpu"], base)}
            for impl in twin]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="gemm,engine,train")
    p.add_argument("--impls", default="plain,blocks64,blocks128")
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json-stdout", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    p.add_argument("--no-save", action="store_true")
    a = p.parse_args(argv)
    parts = a.parts.split(",")
    rows = (1, 64) if a.quick else tuple(int(r) for r in a.rows.split(","))
    repeats = a.repeats or (2 if a.quick else 9)
    dev = torch.device("cpu")
    note = harness.set_cpu_threads(None, dev)
    results: list[dict] = []
    if "gemm" in parts:
        results += gemm_rows(a.impls.split(","), rows, repeats, a.quick)
        if a.json_stdout:
            print(json.dumps(results))
            return
        if has_amx():
            plain = {(r["shape"], r["rows"]): r["ms"] for r in results if r["impl"] == "plain"}
            for r in capped_rows(rows, repeats, a.quick):  # another process: a ratio of medians, not interleaved
                r["ratio_vs_first"] = r["ms"] / plain[r["shape"], r["rows"]] if (r["shape"], r["rows"]) in plain else None
                results.append(r)
    if "engine" in parts:
        results += engine_rows(a.quick)
    if "train" in parts:
        results += train_rows(repeats, a.quick)
    cols = [("part", "part"), ("shape", "shape"), ("rows", "rows"), ("impl", "impl"), ("ms", "ms"),
            ("ratio_vs_first", "x plain"), ("invariant", "invariant"), ("tokens_per_s", "tok/s"), ("s", "s")]
    shown = [{k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in r.items()} for r in results]
    print(harness.format_table(shown, cols))
    if not a.no_save:
        settings = {"parts": parts, "rows": rows, "repeats": repeats, "quick": a.quick, "threads": note, "amx": has_amx()}
        print(harness.append_results("bench_gemm", harness.environment(dev), settings, results, a.out))


if __name__ == "__main__":
    main()
