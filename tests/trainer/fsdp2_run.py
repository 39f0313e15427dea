"""Run by test_fsdp2.py under `torch.distributed.run --nproc_per_node 2` (gloo, CPU): FSDP2 (`fully_shard` per
decoder layer and at the root, as accelerate wraps a transformers model) on the aligned tiny Qwen3, with
accelerate's own FSDP2 mixed-precision policy and with `optim.aligned_fsdp2_policy`.

Each rank scores its own sequence; it saves its forward's logits and, after backward, the full (unsharded)
fp32 gradients FSDP2 reduced across the two ranks."""

import sys

import torch
import torch.distributed as dist
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from trl_roundalign import apply_roundalign
from trl_roundalign.local_models import tiny_model
from trl_roundalign.profiles import PAPER_REGIONS
from trl_roundalign.trainer.masters import aligned_fsdp2_policy

out, which = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
plugin.set_mixed_precision("bf16")  # what accelerate builds for --mixed_precision bf16
policy = plugin.mixed_precision_policy if which == "accelerate" else aligned_fsdp2_policy(plugin.mixed_precision_policy)

model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen3"), dtype=torch.bfloat16)
apply_roundalign(model, PAPER_REGIONS, "vllm-compiled")  # the trainer patches before accelerate prepares
model = model.float()  # accelerate's fsdp2_prepare_model upcasts trainable parameters to fp32 masters
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh, mp_policy=policy)
fully_shard(model, mesh=mesh, mp_policy=policy)

ids = torch.tensor([list(range(5 + 7 * rank, 45 + 7 * rank))])
logits = model(input_ids=ids, use_cache=False).logits
logp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])
(-logp.sum()).backward()
grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
torch.save({"ids": ids, "logits": logits.detach(), "grads": grads, "policy": repr(policy)}, f"{out}/{which}-rank{rank}.pt")
dist.destroy_process_group()
