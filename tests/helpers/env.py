"""Environment for subprocesses started by tests.

Their scripts import the tests' shared code as the `helpers` package: the tests folder leads their PYTHONPATH.

A vLLM engine colocated by TRL in the test process sets the torch.distributed rendezvous variables
(MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE, ...) and keeps a TCP store listening on MASTER_PORT; a child
that inherited them would try to listen on the same port. Children get the environment without them.
"""

from __future__ import annotations

import os
from pathlib import Path

RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")


TESTS = str(Path(__file__).resolve().parents[1])


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, env.get("PYTHONPATH", "")) if p)
    return env
