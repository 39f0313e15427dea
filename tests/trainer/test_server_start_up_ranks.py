"""Server mode's start-up check across processes: a failure on the main process stops every rank at once."""

from __future__ import annotations

from pathlib import Path

from helpers.ranks import run_two_ranks as two_ranks
from helpers.server import free_port


def test_a_failed_start_up_check_stops_every_rank_at_once_with_the_same_error(tmp_path):
    """Rank 0's `/server_info` request fails (nothing listens at the URL): both ranks raise the same one-line error
    within seconds, instead of rank 1 waiting in the broadcast until the collective times out (60 s here)."""
    url = f"http://127.0.0.1:{free_port()}"
    results = two_ranks(Path(__file__).with_name("server_check_ranks.py"), tmp_path, url, timeout=300)
    r0, r1 = results
    assert r0["type"] == r1["type"] == "RuntimeError", results
    assert r0["error"] == r1["error"] and "\n" not in r0["error"], results
    assert r0["error"].startswith(f"The server-mode start-up check could not query the vLLM server at {url}: "), results
    assert "ConnectionError" in r0["error"], results
    assert r1["seconds"] < 30, results  # the collective timeout is 60 s
