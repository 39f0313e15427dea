"""Run by test_server_start_up_ranks.py as one of two gloo ranks (RANK, WORLD_SIZE, MASTER_ADDR/PORT set by the test):
the server-mode start-up check with a server URL nothing answers, so rank 0's `/server_info` request fails.

Each rank writes what it raised (and after how long) to <out>/rank<r>.json, then stays alive until the other
rank has written its own, as a trainer whose caller caught the error would: rank 0 leaving would otherwise
break rank 1's collective for it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import types
from datetime import timedelta

import requests
import torch.distributed as dist

out, url = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))

from accelerate import PartialState  # noqa: E402

PartialState(cpu=True)

import trl_roundalign.trainer.startup_check as verify  # noqa: E402
from trl_roundalign.trainer.grpo import RoundAlignGRPOTrainer  # noqa: E402

verify.verification_sequences = lambda tokenizer: [[1, 2, 3, 4]]  # no tokenizer needed: nothing gets scored
client = types.SimpleNamespace(base_url=url, session=requests.Session()) if rank == 0 else None
trainer = types.SimpleNamespace(
    roundalign_profile="vllm-compiled",
    vllm_generation=types.SimpleNamespace(vllm_client=client, sync_weights=lambda: None),
    state=types.SimpleNamespace(global_step=0),
    processing_class=None,
    model=None,
    _install_patches=lambda args: None,
)
args = types.SimpleNamespace(vllm_server_base_url=url, roundalign_regions=("rope",), roundalign_backend="torch")

start = time.monotonic()
try:
    RoundAlignGRPOTrainer._verify_profile_server(trainer, args)
    result = {"type": None, "error": None}
except Exception as e:  # noqa: BLE001 - reported to the test
    result = {"type": type(e).__name__, "error": str(e)}
result["seconds"] = time.monotonic() - start
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
deadline = time.monotonic() + 150
while not os.path.exists(os.path.join(out, f"rank{1 - rank}.json")) and time.monotonic() < deadline:
    time.sleep(0.2)
