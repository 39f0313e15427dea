"""Run by test_review2_verify_ranks.py as one of two gloo ranks (RANK, WORLD_SIZE, MASTER_ADDR/PORT set by the test):
`verify_on_main_process` with a start-up check that rank 0 leaves with a `BaseException` that is no `Exception`
(`KeyboardInterrupt`, `SystemExit(3)`) or with a plain `ValueError`, named by argv[2].

Each rank writes what it raised (type, args, whether rank 0 got its own exception object back, and after how long)
to <out>/rank<r>.json, then stays alive until the other rank has written its own, as a trainer whose caller caught
the error would: rank 0 leaving would otherwise break rank 1's collective for it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist

out, kind = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))

from accelerate import PartialState  # noqa: E402

PartialState(cpu=True)

from trl_roundalign.verify import verify_on_main_process  # noqa: E402

RAISED = {"KeyboardInterrupt": KeyboardInterrupt(), "SystemExit": SystemExit(3), "ValueError": ValueError("bad option")}
raised = RAISED[kind]


def check():
    raise raised


start = time.monotonic()
try:
    verify_on_main_process(check)
    result = {"type": None, "args": None}
except BaseException as e:  # noqa: BLE001 - reported to the test
    result = {"type": type(e).__name__, "args": [str(a) for a in e.args], "original": e is raised}
result["seconds"] = time.monotonic() - start
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
deadline = time.monotonic() + 150
while not os.path.exists(os.path.join(out, f"rank{1 - rank}.json")) and time.monotonic() < deadline:
    time.sleep(0.2)
dist.destroy_process_group()
