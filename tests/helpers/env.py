"""Environment for subprocesses started by tests.

Their scripts import the tests' shared code as the `helpers` package: the tests folder leads their PYTHONPATH.

A vLLM engine colocated by TRL in the test process sets the torch.distributed rendezvous variables
(MASTER_ADDR/MASTER_PORT, RANK, WORLD_SIZE, ...) and keeps a TCP store listening on MASTER_PORT; a child
that inherited them would try to listen on the same port. Children get the environment without them, and a
rendezvous port of their own (MASTER_ADDR=127.0.0.1, MASTER_PORT one the kernel has just handed out): left unset, TRL
takes the first of 29500, 23456, ... that is free when it looks, and anything else on the machine can bind it before
vLLM does (EADDRINUSE on the Intel AMX machine). A multi-process `accelerate launch` overrides MASTER_PORT with its
`--main_process_port` (29500 unless given): such a test passes `free_port()` there.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")


TESTS = str(Path(__file__).resolve().parents[1])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the kernel has just handed out (no fixed port in a test)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, env.get("PYTHONPATH", "")) if p)
    return env
