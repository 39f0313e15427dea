"""Runtime LoRA routes on a real server: with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` (and no `--api-key`) vLLM serves
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, which change what the server samples from. They must need the
server token like every other state-changing route; only the named read-only and inference routes stay open.

The test starts its own server (`trl-roundalign serve` on 127.0.0.1, as in
test_server_mode.py) on the tiny Qwen3 model with LoRA enabled, so the routes are live.
"""

from __future__ import annotations

import os

import pytest
from helpers.server import STARTUP_TIMEOUT_S, TOKEN, Server  # the server gets TOKEN

from trl_roundalign.local_models import tiny_model
from trl_roundalign.weight_transfer.auth import TOKEN_HEADER

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LORA_ROUTES = {
    "/v1/load_lora_adapter": {"lora_name": "attacker", "lora_path": "/tmp/attacker-adapter"},
    "/v1/unload_lora_adapter": {"lora_name": "attacker"},
}


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    old = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # Server copies the environment when it starts
    try:
        srv = Server(tiny_model("qwen3"), tmp_path_factory.mktemp("vllm-lora-server") / "server.log",
                     extra=["--enable-lora", "--max-lora-rank", "8"])
    finally:
        if old is None:
            os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
        else:
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = old
    try:
        srv.wait_ready(STARTUP_TIMEOUT_S)
        yield srv
    finally:
        srv.stop()


def test_runtime_lora_routes_need_the_token_and_inference_stays_open(lora_server):
    import requests

    with lora_server.log_on_failure():
        for path, body in LORA_ROUTES.items():
            refused = requests.post(lora_server.url + path, json=body, timeout=30)
            assert refused.status_code == 401 and TOKEN_HEADER in refused.json()["error"], (path, refused.text)
            wrong = requests.post(lora_server.url + path, json=body, headers={TOKEN_HEADER: "guess"}, timeout=30)
            assert wrong.status_code == 403, (path, wrong.text)
            # With the token the request reaches vLLM's LoRA handler (which refuses the missing adapter itself).
            accepted = requests.post(lora_server.url + path, json=body, headers={TOKEN_HEADER: TOKEN}, timeout=30)
            assert accepted.status_code not in (401, 403) and TOKEN_HEADER not in accepted.text, (path, accepted.text)
        # Another state-changing /v1/ route, and one vLLM does not have: refused too.
        for path in ("/v1/responses/r0/cancel", "/v1/not_a_route"):
            assert requests.post(lora_server.url + path, json={}, timeout=30).status_code == 401, path
        # The routes TRL's client reads and generates with stay open (vLLM's --api-key guards them when set).
        assert requests.get(lora_server.url + "/v1/models", timeout=30).status_code == 200
        completion = requests.post(
            lora_server.url + "/v1/completions", json={"model": str(tiny_model("qwen3")), "prompt": "1 + 1 =", "max_tokens": 2},
            timeout=120,
        )
        assert completion.status_code == 200, completion.text
        assert requests.get(lora_server.url + "/health", timeout=30).status_code == 200

