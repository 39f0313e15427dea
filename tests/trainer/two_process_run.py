"""Run by test_two_processes.py under `torchrun --nproc_per_node 2` (gloo, CPU): each rank trains with vLLM
colocated and dumps what it recorded locally and the metrics it logged after the cross-process reduction."""

import os
import sys

import torch
from helpers.trainer import make_config, varied_reward  # noqa: E402

from trl_roundalign import RoundAlignGRPOTrainer
from trl_roundalign.data import arithmetic_dataset
from trl_roundalign.local_models import tiny_model

out = sys.argv[1]
args = make_config(out, max_steps=2, vllm_gpu_memory_utilization=0.2, gradient_accumulation_steps=2, learning_rate=1e-3)
trainer = RoundAlignGRPOTrainer(
    model=str(tiny_model("qwen3")), reward_funcs=varied_reward, args=args, train_dataset=arithmetic_dataset("train[:32]")
)
initial = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
cb = trainer._mismatch_callback
recorded = []
original = cb.record


def record(train_logps, sampling_logps, mask, **kwargs):
    recorded.append((train_logps.detach().cpu(), sampling_logps.detach().cpu(), mask.detach().cpu()))
    original(train_logps, sampling_logps, mask, **kwargs)


cb.record = record
trainer.train()
rank = int(os.environ.get("RANK", 0))
logged = [h for h in trainer.state.log_history if "mismatch/kl_k3" in h]
final = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
masters = [m.detach().clone() for m in trainer.optimizer.optimizer.masters]
torch.save(
    {
        "recorded": recorded,
        "logged": logged,
        "world": trainer.accelerator.num_processes,
        "moved": sorted(k for k in final if not torch.equal(final[k], initial[k])),
        "final": final,
        "masters": masters,
    },
    os.path.join(out, f"rank{rank}.pt"),
)
