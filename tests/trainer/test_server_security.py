"""Server mode's exposure and hangs, without a vLLM server: what `trl-roundalign serve`
binds to and the token check it installs, the trainer's gloo rendezvous store and the client's HTTP timeouts.
The real server's token check and bound addresses: test_server_mode.py."""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from helpers.server import free_port, listening_addresses  # noqa: F401  (free_port: used by other tests too)

from trl_roundalign.weight_transfer import auth


def served_command(monkeypatch, argv: list[str], env: dict[str, str] | None = None) -> tuple[list[str], dict]:
    """What `trl-roundalign serve <argv>` would exec (vLLM's CLI and its environment)."""
    from trl_roundalign.weight_transfer import serve

    seen = {}

    def execve(path, command, environ):
        seen.update(command=command, env=environ)

    monkeypatch.setattr(serve.os, "execve", execve)
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    # The model "m" has no config to measure the GEMM on: give the row blocks, so that the command does not depend
    # on whether an earlier test in the process set them (it did in the suite, not when this file runs alone).
    monkeypatch.setenv("ROUNDALIGN_GEMM_BLOCK_ROWS", "0")
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    serve.main(argv)
    return seen["command"], seen["env"]


def option(command: list[str], name: str) -> str:
    return command[len(command) - 1 - command[::-1].index(name) + 1]  # the last one given wins in vLLM's parser


def test_the_server_binds_loopback_unless_told_otherwise_and_requires_a_token(monkeypatch, caplog, capsys):
    with caplog.at_level(logging.WARNING, logger="trl_roundalign.weight_transfer.serve"):
        command, env = served_command(monkeypatch, ["--model", "m", "--port", "8011"])
    assert option(command, "--host") == "127.0.0.1"
    assert not [r for r in caplog.records if "reach" in r.getMessage()]
    # No token given: one is generated for this server, printed once for the trainer, and the middleware that
    # checks it is installed.
    assert option(command, "--middleware") == f"{auth.__name__}.ServerTokenMiddleware"
    token = env[auth.TOKEN_ENV]
    assert len(token) >= 32 and f"{auth.TOKEN_ENV}={token}" in capsys.readouterr().err
    assert env["VLLM_SERVER_DEV_MODE"] == "1"

    command, env = served_command(monkeypatch, ["--model", "m"], {auth.TOKEN_ENV: "given-token"})
    assert env[auth.TOKEN_ENV] == "given-token" and "given-token" not in capsys.readouterr().err

    for host in ("localhost", "::1"):
        command, _ = served_command(monkeypatch, ["--model", "m", "--host", host])
        assert option(command, "--host") == host

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_roundalign.weight_transfer.serve"):
        command, _ = served_command(monkeypatch, ["--model", "m", "--host", "0.0.0.0"])
    assert option(command, "--host") == "0.0.0.0"
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "0.0.0.0 is not a loopback address" in warnings[0], warnings


def test_the_token_middleware_guards_every_endpoint_but_inference_and_health():
    """The ASGI check itself, on vLLM's real routes: every dev-mode endpoint (weights, RPC, sleep, caches,
    server info) and anything else not on the public list needs the token."""
    import asyncio

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def call(middleware, path, headers=(), method="POST"):
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": list(headers)}
        asyncio.run(middleware(scope, receive, send))
        return sent[0]["status"]

    from fastapi import FastAPI
    from vllm.entrypoints.serve import register_vllm_dev_api_routers

    dev = FastAPI()
    register_vllm_dev_api_routers(dev)
    try:  # vLLM 0.32 moved the weight-transfer routes to their own registrar, also called under VLLM_SERVER_DEV_MODE
        from vllm.entrypoints.rl.factories import register_rl_api_routers
    except ImportError:  # vLLM 0.31: register_vllm_dev_api_routers registers them
        register_rl_api_routers = None
    if register_rl_api_routers is not None:
        register_rl_api_routers(dev)
    dev_paths = {r.path for r in dev.routes} - {r.path for r in FastAPI().routes}
    assert {"/init_weight_transfer_engine", "/update_weights", "/collective_rpc", "/server_info"} <= dev_paths

    guarded = auth.ServerTokenMiddleware(app, token="s3cret")
    good = [(auth.TOKEN_HEADER.lower().encode(), b"s3cret")]
    bad = [(auth.TOKEN_HEADER.lower().encode(), b"guess")]
    for path in sorted(dev_paths) + ["/start_profile", "/scale_elastic_ep", "/not_a_route"]:
        assert call(guarded, path) == 401, path
        assert call(guarded, path, bad) == 403, path
        assert call(guarded, path, good) == 200, path
    for path in ("/health", "/ping", "/version", "/metrics", "/v1/models", "/v1/completions", "/inference/v1/generate"):
        assert call(guarded, path) == 200, path  # inference stays vLLM's --api-key's business
    assert call(guarded, "/update_weights", method="OPTIONS") == 200  # CORS preflight: answered by CORS, no effect
    # A server whose process lost the token refuses, rather than opening up.
    assert call(auth.ServerTokenMiddleware(app, token=""), "/update_weights", [(b"x-roundalign-token", b"")]) == 403


class _Silent(BaseHTTPRequestHandler):
    """/health and /v1/models answer; any POST is read and never answered (until the test ends)."""

    release = threading.Event()

    def do_GET(self):  # noqa: N802
        body = json.dumps({"data": [{"id": "m"}]}).encode() if self.path == "/v1/models" else b""
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.release.wait(120)

    def log_message(self, *args):
        pass


def test_the_client_times_out_against_a_server_that_never_answers(monkeypatch):
    from trl_roundalign.weight_transfer.client import GlooVLLMClient

    monkeypatch.setenv("ROUNDALIGN_SERVER_READ_TIMEOUT_S", "1")
    monkeypatch.setenv("ROUNDALIGN_WEIGHT_UPDATE_TIMEOUT_S", "2")
    monkeypatch.setenv(auth.TOKEN_ENV, "t0ken")
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Silent)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        client = GlooVLLMClient(base_url=url, connection_timeout=10)
        assert client.session.headers[auth.TOKEN_HEADER] == "t0ken"
        # Every request of the session has a default (connect, read) timeout; the weight endpoints a longer one.
        adapter = client.session.get_adapter(url)
        assert adapter.timeout_for(f"{url}/v1/completions") == (30.0, 1.0)
        assert adapter.timeout_for(f"{url}/update_weights") == (30.0, 2.0)

        result = {}

        def post():
            start = time.monotonic()
            try:
                client._post_once(f"{url}/update_weights", json={"update_info": {}})
            except Exception as e:  # noqa: BLE001
                result["error"] = e
            result["seconds"] = time.monotonic() - start

        t = threading.Thread(target=post, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "the weight update request is still waiting for an answer after 30 s"
        assert 1.5 < result["seconds"] < 15, result
        assert "timed out" in str(result["error"]) and "/update_weights" in str(result["error"]), result
    finally:
        _Silent.release.set()
        httpd.shutdown()
        httpd.server_close()


def test_the_trainers_rendezvous_store_listens_on_loopback_only():
    """The gloo group's TCPStore (hosted by the trainer) binds to the loopback address it was given, not to every
    interface; the group still forms and carries tensors."""
    from trl_roundalign.weight_transfer.gloo import GlooGroup

    port, seen = free_port(), {}

    def worker():
        group = GlooGroup("127.0.0.1", port, 1, 2, 60)
        buf = torch.zeros(3)
        group.broadcast(buf, src=0)
        seen["got"] = buf

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    group = GlooGroup("127.0.0.1", port, 0, 2, 60)
    seen["listening"] = listening_addresses(port)
    group.broadcast(torch.tensor([1.0, 2.0, 3.0]), src=0)
    t.join(60)
    assert seen["listening"] == ["0100007F"], seen["listening"]  # 127.0.0.1, and nothing on [::] or 0.0.0.0
    assert torch.equal(seen["got"], torch.tensor([1.0, 2.0, 3.0]))
    group.close()


def test_trl_roundalign_serve_is_the_server(monkeypatch):
    """`trl-roundalign serve` (the CLI's command, which messages and docs name) runs the same server start as the
    module: the same command and environment, TRL's `trl vllm-serve` parser under the CLI's name, and one error line
    with exit code 2 for bad input."""
    import subprocess
    import sys
    from pathlib import Path

    from trl_roundalign import cli
    from trl_roundalign.weight_transfer import serve

    argv = ["--model", "m", "--port", "8123", "--weight-transfer-config", '{"backend": "gloo"}']
    module_command, module_env = served_command(monkeypatch, argv)
    seen = {}
    monkeypatch.setattr(serve.os, "execve", lambda path, command, environ: seen.update(command=command, env=environ))
    monkeypatch.setenv(auth.TOKEN_ENV, module_env[auth.TOKEN_ENV])  # the generated token, for a like-for-like compare
    assert cli.main(["serve", *argv]) == 0
    assert seen["command"] == module_command
    assert {k: v for k, v in seen["env"].items() if k != auth.TOKEN_ENV} == {
        k: v for k, v in module_env.items() if k != auth.TOKEN_ENV}
    exe = str(Path(sys.executable).with_name("trl-roundalign"))
    shown = subprocess.run([exe, "serve", "--help"], capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0 and shown.stdout.startswith("usage: trl-roundalign serve") and "--model" in shown.stdout
    bad = subprocess.run([exe, "serve", "--port", "1"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "trl-roundalign serve: error: the following arguments are required: --model")
