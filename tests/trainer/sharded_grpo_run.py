"""Run by test_sharded_grpo.py under `accelerate launch --config_file recipes/accelerate_configs/fsdp2.yaml` (or
`zero3.yaml`) `--num_processes 2` on CPU (gloo), with `fsdp_cpu_shim/` on PYTHONPATH so accelerate prepares the model
with FSDP2 (or DeepSpeed ZeRO-3 with `DS_ACCELERATOR=cpu`).

`train`: 3 aligned GRPO steps (2 micro-batches each), a sharded checkpoint at step 2. `resume`: the same run resumed
from that checkpoint. Each rank dumps what the test compares:

- at every weight sync (TRL's FSDP2 path, `_iter_fsdp2_params`: `full_tensor()` of each DTensor into vLLM; ZeRO-3:
  `GatheredParameters` per parameter): the rank's local shards and its engine's prompt log-probs of fixed sequences;
- after training (`train` only): the engine's log-probs with each sync's weights loaded again from the two ranks' local
  shards put together by hand (all_gather of the shards, concatenated: FSDP2 along dim 0, ZeRO-3 the flat partitions
  cut to the parameter's size; no DTensor, no DeepSpeed gather involved);
- at every optimizer step: the gradients' and parameters' dtypes, the AdamW moments (local shards), and how many
  gradient entries bf16 cannot hold;
- the (train, sampling, mask) log-prob triples the mismatch callback recorded, and the metrics it logged.
"""

import os
import sys

import torch
import torch.distributed as dist
from helpers.trainer import make_config, varied_reward  # noqa: E402
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback

from trl_roundalign import RoundAlignGRPOTrainer
from trl_roundalign.data import arithmetic_dataset
from trl_roundalign.local_models import tiny_model
from trl_roundalign.scoring import vllm_prefill_logprobs
from trl_roundalign.trainer.startup_check import verification_sequences

out, phase = sys.argv[1], sys.argv[2]
rank = int(os.environ.get("RANK", 0))
# Where the sharding comes from: the launcher's config (`launcher`, the default), or the trainer's own arguments, as
# a script that sets them in GRPOConfig does: `fsdp-args` (TrainingArguments.fsdp/fsdp_config, FSDP2), `zero2-args` /
# `zero3-args` (TrainingArguments.deepspeed, a DeepSpeed config dict).
source = os.environ.get("ROUNDALIGN_TEST_SHARDING", "launcher")
sharding = {
    "launcher": {},
    "fsdp-args": {"fsdp": "full_shard", "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"],
                                                         "state_dict_type": "SHARDED_STATE_DICT"}},
}.get(source)
if sharding is None:
    stage = int(source.removeprefix("zero").removesuffix("-args"))
    sharding = {"deepspeed": {"zero_optimization": {"stage": stage}, "bf16": {"enabled": "auto"},
                              "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                              "gradient_clipping": "auto", "train_batch_size": "auto"}}
args = make_config(
    out, max_steps=3, gradient_accumulation_steps=2, learning_rate=1e-5, vllm_gpu_memory_utilization=0.2,
    save_strategy="steps", save_steps=2, save_only_model=False, **sharding,
)  # fmt: skip
trainer = RoundAlignGRPOTrainer(
    model=str(tiny_model("qwen3")), reward_funcs=varied_reward, args=args, train_dataset=arithmetic_dataset("train[:32]")
)
ds_plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
zero_stage = ds_plugin.zero_stage if ds_plugin is not None else None
zero3 = zero_stage == 3
sharded_parameters = zero3 or bool(getattr(trainer.accelerator.state, "is_fsdp2", False))
llm = trainer.vllm_generation.llm
sequences = verification_sequences(llm.get_tokenizer())
state = trainer.accelerator.state
setup = {
    "distributed_type": str(state.distributed_type),
    "zero_stage": zero_stage,
    "is_fsdp2": bool(getattr(state, "is_fsdp2", False)),
    "mixed_precision": str(trainer.accelerator.mixed_precision),
    "policy": repr(getattr(getattr(state, "fsdp_plugin", None), "mixed_precision_policy", None)),
    "state_dict_type": str(getattr(getattr(state, "fsdp_plugin", None), "state_dict_type", None)),
    "model_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
    "engine_logps_start": vllm_prefill_logprobs(llm, sequences),
}


def local(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "ds_tensor"):  # a ZeRO-3 parameter: this rank's flat partition
        return t.ds_tensor.detach().clone()
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def full(name: str, parts: list[torch.Tensor], shape) -> torch.Tensor:
    if not sharded_parameters:  # ZeRO-1/2: every rank holds the whole parameter (its optimizer state is partitioned)
        assert all(torch.equal(p, parts[0]) for p in parts), name
        return parts[0]
    if zero3:
        n = int(torch.Size(shape).numel())
        return torch.cat([p.reshape(-1) for p in parts])[:n].view(shape)
    return torch.cat(parts, dim=0)


def shapes(model) -> dict:
    return {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in model.named_parameters()}


syncs = []
vg = trainer.vllm_generation
original_sync = vg.sync_weights


def sync_weights():
    original_sync()
    model = trainer.model
    syncs.append(
        {
            "step": trainer.state.global_step,
            "model_class": type(model).__name__,
            "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "sharded": all(isinstance(p, DTensor) or hasattr(p, "ds_tensor") for p in model.parameters()),
            "sharded_parameters": sharded_parameters,
            "shapes": shapes(model),
            "shards": {n: local(p) for n, p in model.named_parameters()},
            "names": {n: vg._fix_param_name_to_vllm(n) for n, _ in model.named_parameters()},
            "engine_logps": vllm_prefill_logprobs(llm, sequences),
        }
    )


vg.sync_weights = sync_weights

cb = trainer._mismatch_callback
recorded = []
original_record = cb.record


def record(train_logps, sampling_logps, mask, **kwargs):
    recorded.append((train_logps.detach().cpu(), sampling_logps.detach().cpu(), mask.detach().cpu()))
    original_record(train_logps, sampling_logps, mask, **kwargs)


cb.record = record
steps = []


class Probe(TrainerCallback):
    def on_train_begin(self, a, s, c, **kw):
        steps.append({"begin": s.global_step, "optimizer": type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__})

    def on_pre_optimizer_step(self, a, s, c, **kw):
        opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        params = [p for g in opt.param_groups for p in g["params"]]
        if zero_stage is not None:  # the optimizer's params are DeepSpeed's fp32 flat partitions; the gradients live inside it
            # DeepSpeed's masters: ZeRO-3's partitioned flat groups, ZeRO-1/2's single partition per group.
            masters = opt.fp32_partitioned_groups_flat if zero3 else opt.single_partition_of_fp32_groups
            flat = torch.cat([f.detach().reshape(-1) for f in masters])
            steps.append(
                {
                    "step": s.global_step + 1,
                    "master_dtypes": sorted({str(f.dtype) for f in masters}),
                    "master_entries": flat.numel(),
                    "master_not_bf16": int((flat != flat.bfloat16().float()).sum()),
                }
            )
            return
        grads = [local(p.grad).float() for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        steps.append(
            {
                "step": s.global_step + 1,
                "param_dtypes": sorted({str(p.dtype) for p in params}),
                "grad_dtypes": sorted({str(p.grad.dtype) for p in params if p.grad is not None}),
                "grad_entries": flat.numel(),
                "grad_not_bf16": int((flat != flat.bfloat16().float()).sum()),
                "moments": [
                    {k: local(v) for k, v in opt.state[p].items() if torch.is_tensor(v) and v.dim() > 0}
                    for p in params if p in opt.state
                ],
            }
        )


trainer.add_callback(Probe())
if phase == "train":
    trainer.train()
else:
    trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))

final = {n: local(p) for n, p in trainer.model.named_parameters()}
rebuilt = []
if phase == "train":
    # The engine again, each sync's weights loaded from the ranks' local shards put together by hand: what the sharded
    # policy held, gathered without DTensor. The same sequences must score exactly as right after TRL's sync.
    runner_model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    for s in syncs:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, s["shards"])
        rebuilt_full = {n: full(n, [p[n] for p in parts], s["shapes"][n]) for n in s["shards"]}
        with torch.no_grad():
            for n, t in rebuilt_full.items():
                runner_model.load_weights([(s["names"][n], t)])
        llm.reset_prefix_cache()
        rebuilt.append(vllm_prefill_logprobs(llm, sequences))
        if s is syncs[0]:
            setup["full_shapes"] = {n: tuple(t.shape) for n, t in rebuilt_full.items()}

logged = [h for h in trainer.state.log_history if "mismatch/kl_k3" in h]
torch.save(
    {
        "setup": setup,
        "run_info": trainer.roundalign_run_info(),
        "uses_package_masters": trainer._master_optimizer() is not None,
        "world": trainer.accelerator.num_processes,
        "syncs": syncs,
        "rebuilt_engine_logps": rebuilt,
        "steps": steps,
        "recorded": recorded,
        "logged": logged,
        "final": final,
        "global_step": trainer.state.global_step,
    },
    os.path.join(out, f"{phase}-rank{rank}.pt"),
)
trainer.close()
