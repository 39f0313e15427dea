"""LongRoPE (Phi-3.5-mini, Phi-4-mini) against the real engine, through `trl-roundalign analyze`.

vLLM picks LongRoPE's factor set once per engine (long when its max_model_len exceeds the original length, as with the
model's own max_model_len), transformers per sequence (short within the original length). `tiny-phi3-longrope`
(original length 128, 1024 positions): with `--max-model-len 1024` (long factors) default BF16 transformers is another
policy on these short sequences, the "rope" region holds the engine's factors (RoPE alone lowers k3 by orders of
magnitude) and the exact mode is bit-identical; with vLLM's default (for LongRoPE models the original length: short
factors) both sides already agree on the factors and the exact mode is bit-identical too.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.full]


@pytest.mark.parametrize(("max_model_len", "factors"), [(1024, "long"), (None, "short")])
def test_longrope_through_analyze(tmp_path, max_model_len, factors):
    out = tmp_path / factors
    extra = ["--max-model-len", str(max_model_len)] if max_model_len else []  # None: vLLM's default
    cmd = [sys.executable, "-m", "trl_roundalign.cli", "analyze", "tiny-phi3-longrope", "--output-dir", str(out),
           "--conditions", "paper", "--num-prompts", "4", "--samples-per-prompt", "2", "--max-new-tokens", "24",
           "--no-floors", *extra]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    stats = {c["name"]: c["vs_prefill"] for c in summary["conditions"]}
    k3 = {c: v["mismatch/kl_k3"] for c, v in stats.items()}
    assert stats["bf16_default"]["mismatch/tokens"] > 60
    assert stats["exact"]["mismatch/frac_bitwise_equal"] == 1.0 and k3["exact"] == 0.0, stats["exact"]
    assert summary["engine"]["max_model_len"] == (max_model_len or 128), summary["engine"]
    if factors == "long":
        # Different factors: another policy (k3 about 0.6 on this model); the held factors leave rounding (about 1e-4).
        assert k3["bf16_default"] > 0.1 and k3["rope_only"] < k3["bf16_default"] / 100, k3
    assert 0 < k3["three_region"] < k3["bf16_default"], k3


def test_longrope_trains_with_the_engines_factors(tmp_path):
    """The trainer reads the colocated engine's max_model_len: 1024 here, so the long factors are held, the start-up
    check passes, and the mismatch logged in training is rounding, not another policy."""
    from trl_roundalign import RoundAlignGRPOConfig, RoundAlignGRPOTrainer
    from trl_roundalign.data import arithmetic_dataset
    from trl_roundalign.local_models import tiny_phi3_longrope

    args = RoundAlignGRPOConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=16, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=1024, logging_steps=1, report_to="none", use_cpu=True, bf16=True, save_strategy="no",
        seed=0, roundalign_profile="auto",
    )
    trainer = RoundAlignGRPOTrainer(
        str(tiny_phi3_longrope()), reward_funcs=[lambda completions, **k: [float(len(c)) for c in completions]],
        args=args, train_dataset=arithmetic_dataset("train[:8]"),
    )
    assert trainer.roundalign_engine.max_model_len == 1024
    assert trainer.roundalign_report.rope_factors == "long"
    assert trainer.roundalign_verification.verdict == "ok", trainer.roundalign_verification
    trainer.train()
    (row,) = [h for h in trainer.state.log_history if "mismatch/kl_k3" in h]
    assert row["mismatch/kl_k3"] < 1e-2, row  # another policy would be about 0.6
