"""The start-up check across processes when rank 0 leaves it with a `BaseException` (Ctrl-C, `sys.exit`): every
rank exits with rank 0's reason at once, instead of the other ranks waiting in the broadcast until the collective
times out (60 s here). Two real gloo processes on 127.0.0.1; a hang fails the test at its own timeout."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.ranks import run_two_ranks as two_ranks


def run_two_ranks(tmp_path: Path, kind: str) -> list[dict]:
    return two_ranks(Path(__file__).with_name("verify_ranks_interrupted.py"), tmp_path, kind)


@pytest.mark.parametrize(("kind", "args"), [("KeyboardInterrupt", []), ("SystemExit", ["3"]), ("ValueError", ["bad option"])])
def test_every_rank_exits_with_rank_0s_reason(tmp_path, kind, args):
    r0, r1 = run_two_ranks(tmp_path, "colocated:" + kind)
    assert r0["type"] == r1["type"] == kind, (r0, r1)
    assert r0["args"] == r1["args"] == args, (r0, r1)
    assert r0["original"], r0  # rank 0 re-raises its own exception (its traceback), after the broadcast
    assert r1["seconds"] < 30, (r0, r1)  # the collective timeout is 60 s


@pytest.mark.parametrize(("where", "kind", "args"), [("server-info", "KeyboardInterrupt", []),
                                                    ("server-logprobs", "SystemExit", ["3"])])
def test_server_mode_requests_interrupted_on_rank_0_stop_every_rank(tmp_path, where, kind, args):
    """Server mode asks the server on rank 0 only and broadcasts the answer: Ctrl-C (or sys.exit) while rank 0 waits
    for the server reaches every rank at once."""
    r0, r1 = run_two_ranks(tmp_path, f"{where}:{kind}")
    assert r0["type"] == r1["type"] == kind and r0["args"] == r1["args"] == args, (r0, r1)
    assert r0["original"] and r1["seconds"] < 30, (r0, r1)
