"""Run by test_server_exact.py as one of two training processes (RANK, WORLD_SIZE, MASTER_* set by the test for plain
data parallelism on gloo, or by `accelerate launch` with the FSDP2 or ZeRO-3 recipe) against one `trl-roundalign serve --exact` server: `<out> <server url> <model> <group port>`.

Two exact GRPO steps; each process reports the start-up check's verdict, the merged per-step metrics it logged, the
schedule records it was handed, and the weight comparison after a final sync (every process takes part).
"""

import os
import sys
import time

out, url, model, group_port = sys.argv[1:5]
rank = int(os.environ["RANK"])
started = time.monotonic()

from helpers.ranks import report  # noqa: E402
from helpers.trainer import long_prompts, make_config, varied_reward  # noqa: E402

from trl_roundalign import RoundAlignGRPOTrainer  # noqa: E402

args = make_config(
    out, max_steps=2, max_completion_length=256, vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=60,
    vllm_group_port=int(group_port), roundalign_profile="auto", roundalign_regions=["rope", "swiglu", "rmsnorm", "attention"],
    generation_kwargs={"ignore_eos": True}, roundalign_stop_on_unreproduced=True, learning_rate=1e-3,
)  # fmt: skip
trainer = RoundAlignGRPOTrainer(model=model, reward_funcs=varied_reward, args=args, train_dataset=long_prompts(4))
try:
    ver = trainer.roundalign_verification
    trainer.train()
    capture = trainer._roundalign_schedule
    trainer.vllm_generation.sync_weights()  # the last step's update (TRL sends it before the next generation only)
    weights = trainer.roundalign_verify_server_weights()
    result = {
        "processes": trainer.accelerator.num_processes, "profile": trainer.roundalign_profile,
        "distributed_type": trainer.accelerator.distributed_type.name,
        "verdict": ver.verdict, "sampler_bitwise": ver.sampler_bitwise, "sampler_tokens": ver.sampler_tokens,
        "steps": [{k: v for k, v in h.items() if k.startswith(("mismatch/", "schedule/")) or k == "step"}
                  for h in trainer.state.log_history if "mismatch/tokens" in h],
        "engine": capture.engine, "record_rows": sum(len(g) for g in capture.generations),
        "weights": weights.summary(), "weights_equal": weights.equal,
    }
finally:
    trainer.close()
report(out, rank, result, started)
