"""Run by test_server_start_up_ranks.py as one of two gloo ranks (RANK, WORLD_SIZE, MASTER_ADDR/PORT set by the test):
the server-mode start-up check with a server URL nothing answers, so rank 0's `/server_info` request fails.

Each rank writes what it raised (and after how long) to <out>/rank<r>.json, then stays alive until the other
rank has written its own, as a trainer whose caller caught the error would: rank 0 leaving would otherwise
break rank 1's collective for it.
"""

from __future__ import annotations

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
from helpers.ranks import report  # noqa: E402

PartialState(cpu=True)

from trl_roundalign.trainer.server_check import ServerCheck  # noqa: E402

client = types.SimpleNamespace(base_url=url, session=requests.Session()) if rank == 0 else None
server = ServerCheck(types.SimpleNamespace(vllm_client=client), url, "qwen3")

start = time.monotonic()
try:
    server.layout()  # the trainer's first request to the server (its /server_info)
    result = {"type": None, "error": None}
except Exception as e:  # noqa: BLE001 - reported to the test
    result = {"type": type(e).__name__, "error": str(e)}
report(out, rank, result, start)
