"""Server mode's start-up check across processes: a failure on the main process stops every rank at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.env import subprocess_env
from helpers.server import free_port


def test_a_failed_start_up_check_stops_every_rank_at_once_with_the_same_error(tmp_path):
    """Rank 0's `/server_info` request fails (nothing listens at the URL): both ranks raise the same one-line error
    within seconds, instead of rank 1 waiting in the broadcast until the collective times out (60 s here)."""
    url = f"http://127.0.0.1:{free_port()}"
    script = Path(__file__).with_name("server_check_ranks.py")
    master = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path), url],
            env=subprocess_env(
                RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=master, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1",
            ),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        for r in (0, 1)
    ]  # fmt: skip
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    results = []
    for r in (0, 1):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), "\n".join(o[-3000:] for o in outputs)
        results.append(json.loads(path.read_text()))
    r0, r1 = results
    assert r0["type"] == r1["type"] == "RuntimeError", results
    assert r0["error"] == r1["error"] and "\n" not in r0["error"], results
    assert r0["error"].startswith(f"The server-mode start-up check could not query the vLLM server at {url}: "), results
    assert "ConnectionError" in r0["error"], results
    assert r1["seconds"] < 30, results  # the collective timeout is 60 s
