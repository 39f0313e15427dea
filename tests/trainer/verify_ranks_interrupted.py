"""Run by test_verify_ranks.py as one of two gloo ranks (RANK, WORLD_SIZE, MASTER_ADDR/PORT set by the test):
a start-up check that rank 0 leaves with a `BaseException` that is no `Exception` (`KeyboardInterrupt`,
`SystemExit(3)`) or with a plain `ValueError`, named by argv[2] as `<where>:<exception>`. Where: `colocated`
(`verify_on_main_process`), `server-info` (server mode's `/server_info` request) or `server-logprobs` (server
mode's prompt log-prob requests), each raising on rank 0 only.

Each rank writes what it raised (type, args, whether rank 0 got its own exception object back, and after how long)
to <out>/rank<r>.json, then stays alive until the other rank has written its own, as a trainer whose caller caught
the error would: rank 0 leaving would otherwise break rank 1's collective for it.
"""

from __future__ import annotations

import os
import sys
import time
import types
from datetime import timedelta

import torch.distributed as dist

out, kind = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))

from accelerate import PartialState  # noqa: E402
from helpers.ranks import report  # noqa: E402

PartialState(cpu=True)

import trl_roundalign.trainer.startup_check as verify  # noqa: E402

where, name = kind.split(":")
RAISED = {"KeyboardInterrupt": KeyboardInterrupt(), "SystemExit": SystemExit(3), "ValueError": ValueError("bad option")}
raised = RAISED[name]


def check(*args, **kwargs):
    raise raised


def server_check():
    """Server mode's check against a server whose request raises on rank 0 (nothing is listening at the URL)."""
    from trl_roundalign.trainer.server_check import ServerCheck

    url = "http://127.0.0.1:9"
    verify.verification_sequences = lambda tokenizer: [[1, 2, 3, 4]]  # no tokenizer needed: nothing gets scored
    client = types.SimpleNamespace(base_url=url, session=types.SimpleNamespace(get=check)) if rank == 0 else None
    server = ServerCheck(types.SimpleNamespace(vllm_client=client), url, "qwen3")
    if where == "server-logprobs":  # /server_info answered (a server of unknown platform); the log-prob requests raise
        server._read = (None, "unknown")
        verify.server_prompt_logprobs = check
        server.verify(None, None, profile="vllm-compiled", regions=("rope",), backend="torch")
    else:
        server.layout()


start = time.monotonic()
try:
    verify.verify_on_main_process(check) if where == "colocated" else server_check()
    result = {"type": None, "args": None}
except BaseException as e:  # noqa: BLE001 - reported to the test
    result = {"type": type(e).__name__, "args": [str(a) for a in e.args], "original": e is raised}
report(out, rank, result, start)
dist.destroy_process_group()
