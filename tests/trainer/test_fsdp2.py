"""FSDP2 and the aligned model: two CPU processes (gloo), `fully_shard` per decoder layer, as accelerate wraps it.

accelerate 1.x applies FSDP only for GPU-class distributed types (`AcceleratorState`: on a CPU machine
`--use_fsdp` trains as DDP), so these runs call `fully_shard` directly, with accelerate's own FSDP2
mixed-precision policy object, and the trainer's replacement (`optim.aligned_fsdp2_policy`, installed by
`RoundAlignGRPOTrainer._align_fsdp2_policy` when accelerate runs FSDP2).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.env import free_port, subprocess_env
from transformers import AutoModelForCausalLM

from trl_roundalign import apply_roundalign
from trl_roundalign.local_models import tiny_model
from trl_roundalign.profiles import PAPER_REGIONS
from trl_roundalign.trainer.masters import aligned_fsdp2_policy

pytestmark = pytest.mark.slow


def _run(tmp_path: Path, which: str, port: int) -> list[dict]:
    script = Path(__file__).with_name("fsdp2_run.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port), str(script), str(tmp_path), which]
    proc = subprocess.run(cmd, env=subprocess_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(tmp_path / f"{which}-rank{r}.pt", weights_only=False) for r in (0, 1)]


def _reference(ranks: list[dict]):
    """One process, no FSDP: the aligned bf16 model's logits per sequence, and the fp32 mean of the two
    sequences' bf16 gradients (what a data-parallel step with fp32 reduction computes)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen3"), dtype=torch.bfloat16)
    apply_roundalign(model, PAPER_REGIONS, "vllm-compiled")
    logits, grads = [], []
    for r in ranks:
        ids = r["ids"]
        out = model(input_ids=ids, use_cache=False).logits
        logits.append(out.detach())
        logp = torch.log_softmax(out.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])
        (-logp.sum()).backward()
        grads.append({n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
    mean = {n: (grads[0][n] + grads[1][n]) / 2 for n in grads[0]}
    return logits, mean


def test_fsdp2_aligned_policy_keeps_the_fp32_residual_stream(tmp_path):
    """With the trainer's policy the sharded aligned model computes bit for bit what the unsharded one computes,
    and its gradients are the fp32 mean of the ranks' gradients (within fp32 rounding of the reduction); with
    accelerate's policy the fp32 residual stream is cast to bf16 at every layer boundary and the forward differs."""
    aligned = _run(tmp_path, "aligned", free_port())
    accel = _run(tmp_path, "accelerate", free_port())
    want_logits, want_grads = _reference(aligned)
    for r, want in zip(aligned, want_logits):
        assert torch.equal(r["logits"], want), "FSDP2 with the aligned policy must reproduce the unsharded forward"
    for name, want in want_grads.items():
        got = aligned[0]["grads"][name]
        assert torch.equal(got, aligned[1]["grads"][name]), name
        rel = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
        assert rel < 1e-6, (name, rel)
    differs = [not torch.equal(r["logits"], want) for r, want in zip(accel, want_logits)]
    assert all(differs), "accelerate's FSDP2 policy should round the fp32 residual stream (else this test cannot tell)"


def test_fsdp2_policy_from_accelerates():
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    plugin.set_mixed_precision("bf16")
    assert plugin.mixed_precision_policy.cast_forward_inputs  # accelerate's default: the reason for the replacement
    policy = aligned_fsdp2_policy(plugin.mixed_precision_policy)
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype, policy.cast_forward_inputs) == (
        torch.bfloat16, torch.float32, None, False,
    )
    with pytest.raises(ValueError, match="param_dtype=None"):
        aligned_fsdp2_policy(None)
