"""Time and peak memory of the merged-weight LoRA forward against PEFT's forward (forward + backward).

Each forward runs in a fresh process (peak RSS is per process): a bf16 model (default SmolLM2-135M-Instruct,
offline) with a LoRA adapter (`--rank`, on every linear layer of the decoder, `lora_dropout=0`, B drawn
non-zero so both paths do their real work), the model's forward under bf16 autocast as the trainer runs it,
a log-prob loss, backward into the adapter; `--iters` timed iterations after one warm-up, in `--rounds`
processes per mode, alternated; medians over all timed iterations (and over the processes' peaks).

- `peft`: PEFT's forward, `W x + s B(A x)`;
- `merged`: `trl_roundalign.trainer.lora.install_merged_lora_forward`, `x @ r(W + s B A)^T` with the merged weight
  materialised for one layer at a time (and kept for that layer's backward).

Reported per mode: median process CPU seconds per forward + backward (one torch thread; wall clock kept too), and peak RSS above the loaded-model baseline (MiB),
i.e. what activations, saved tensors and gradients add.
Usage: `python bench/bench_lora.py [--model smollm2 | tiny-qwen3] [--batch 4 --seq 256 --rank 16 --iters 5] [--out DIR]`.
Writes `bench_lora.json` under `--out` (default bench/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _model_path(name: str) -> str:
    from trl_roundalign import local_models

    if name == "smollm2":
        return str(local_models.smollm2_135m())
    if name.startswith("tiny-"):
        return str(local_models.tiny_model(name.removeprefix("tiny-")))
    raise SystemExit(f"error: --model must be 'smollm2' or 'tiny-<arch>' ({', '.join(local_models.SUPPORTED_TINY_ARCHS)}).")


def run_mode(mode: str, model_name: str, batch: int, seq: int, rank: int, iters: int) -> dict:
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT))
    from trl_roundalign.trainer.lora import install_merged_lora_forward

    torch.manual_seed(0)
    torch.set_num_threads(1)  # as the other CPU benches: process CPU time of one thread (docs/cost.md, "How it is measured")
    base = AutoModelForCausalLM.from_pretrained(_model_path(model_name), dtype=torch.bfloat16)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)  # a trained adapter: B != 0
    if mode == "merged":
        install_merged_lora_forward(model)
    model.train()
    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab, (batch, seq))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids, use_cache=False).logits
        logp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])
        (-logp.mean()).backward()
        model.zero_grad(set_to_none=True)

    baseline = _rss_mib()
    step()  # warm-up
    times, walls = [], []
    for _ in range(iters):
        t0, w0 = time.process_time(), time.perf_counter()
        step()
        times.append(time.process_time() - t0)
        walls.append(time.perf_counter() - w0)
    return {
        "mode": mode,
        "lora_params": sum(p.numel() for n, p in model.named_parameters() if "lora_" in n),
        "fwd_bwd_s_median": round(statistics.median(times), 4),
        "fwd_bwd_s_all": [round(t, 4) for t in times],
        "fwd_bwd_wall_s_all": [round(t, 4) for t in walls],
        "peak_rss_above_baseline_mib": round(_rss_mib() - baseline, 1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="processes per mode, alternated (peft, merged, peft, ...)")
    ap.add_argument("--mode", choices=["peft", "merged"], help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args(argv)
    if a.mode:
        print(json.dumps(run_mode(a.mode, a.model, a.batch, a.seq, a.rank, a.iters)))
        return 0
    sys.path.insert(0, str(ROOT / "bench"))
    import torch
    from harness import environment  # noqa: E402

    runs = {"peft": [], "merged": []}
    for _ in range(a.rounds):  # alternated, so a change in machine load hits both modes alike
        for mode in runs:
            cmd = [sys.executable, __file__, "--mode", mode, "--model", a.model, "--batch", str(a.batch),
                   "--seq", str(a.seq), "--rank", str(a.rank), "--iters", str(a.iters)]  # fmt: skip
            # As in bench_accumulation.py: large tensors are mmapped and unmapped when freed, so peak RSS follows live tensors.
            env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout.strip().splitlines()[-1]
            runs[mode].append(json.loads(out))
            print(runs[mode][-1])
    rows = []
    for mode, rs in runs.items():
        times = [t for r in rs for t in r["fwd_bwd_s_all"]]
        rows.append({
            "mode": mode, "lora_params": rs[0]["lora_params"], "fwd_bwd_s_median": round(statistics.median(times), 4),
            "fwd_bwd_s_all": times, "peak_rss_above_baseline_mib": statistics.median(r["peak_rss_above_baseline_mib"] for r in rs),
        })
    peft_row, merged_row = rows
    result = {
        "environment": environment(torch.device("cpu")),
        "loadavg_1min_at_end": os.getloadavg()[0],
        "config": {k: v for k, v in vars(a).items() if k != "mode"},
        "rows": rows,
        "merged_over_peft_time": round(merged_row["fwd_bwd_s_median"] / peft_row["fwd_bwd_s_median"], 3),
        "merged_minus_peft_peak_mib": round(merged_row["peak_rss_above_baseline_mib"] - peft_row["peak_rss_above_baseline_mib"], 1),
    }
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "bench_lora.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("merged_over_peft_time", "merged_minus_peft_peak_mib", "loadavg_1min_at_end")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
