"""A real vLLM server for the server-mode tests: started on 127.0.0.1 by the test, in its own process group, with a
fresh token and its log; what the tests read from it (prompt log-probs, listening addresses)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers.env import free_port
from trl_roundalign.weight_transfer.auth import TOKEN_ENV, new_token


def listening_addresses(port: int) -> list[str]:
    """The local addresses of the TCP sockets listening on `port` (from /proc/net/tcp and tcp6), as hex strings
    ('0100007F' is 127.0.0.1, all zeros the wildcard)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in f.read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.append(address)
    return found


STARTUP_TIMEOUT_S = float(os.environ.get("ROUNDALIGN_SERVER_STARTUP_S", "420"))
TEXT = "Question: what is 17 + 25? Answer: 17 + 25 = 42."


# One token for every server this module starts; the trainers' clients read it from the environment (`token`).
TOKEN = new_token()


@pytest.fixture(autouse=True)
def token(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    return TOKEN


class Server:
    """A `trl-roundalign serve` process (`trl vllm-serve`'s arguments; own process group) and its log; no --host: the
    default is loopback."""

    def __init__(self, model: Path, log: Path, backend: str = "gloo", extra: list[str] = (), env: dict | None = None,
                 max_model_len: int = 256, port: int | None = None):
        self.port = port or free_port()  # a given port: a server started again in another's place
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [
            str(Path(sys.executable).with_name("trl-roundalign")), "serve",  # the documented command (console script)
            "--model", str(model), "--port", str(self.port),
            "--max_model_len", str(max_model_len),
            "--weight-transfer-config", json.dumps({"backend": backend}), *extra,
        ]  # fmt: skip
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **(env or {}))
        env[TOKEN_ENV] = TOKEN
        self._log_file = open(log, "w")  # noqa: SIM115  (closed in stop)
        self.proc = subprocess.Popen(
            cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def tail(self, n: int = 60) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join(lines[-n:])

    def wait_ready(self, timeout_s: float) -> None:
        import requests

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        raise TimeoutError(f"the vLLM server was not up after {timeout_s:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log_file.close()

    @contextlib.contextmanager
    def log_on_failure(self):
        try:
            yield
        except BaseException as e:
            raise AssertionError(f"{type(e).__name__}: {e}\n--- vLLM server log (tail) ---\n{self.tail()}") from e


def server_logprobs(client, ids: list[int]) -> torch.Tensor:
    """The server's log-prob of each token of `ids` given the ones before (prompt log-probs, one request)."""
    out = client.get_sequence_logprobs(sequences=[ids], prompt_lengths=[1], top_logprobs=1)
    return torch.tensor([lp[0] for lp in out["actual_logprobs"][0]], dtype=torch.float64)


@torch.no_grad()
def trainer_logprobs(model, ids: list[int]) -> torch.Tensor:
    """The same log-probs from the trainer's policy (patched, bf16), computed here: no engine involved."""
    x = torch.tensor([ids], device=model.device)
    logits = model(input_ids=x).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0].double().cpu()


def train_and_check_the_server_follows(trainer, client, ids) -> None:
    """Train, push the final weights, and check the server's log-probs follow the trainer's (as closely as before
    training, and far closer to the new weights than to the old)."""
    # Before training the server holds the checkpoint: it agrees with the trainer up to rounding.
    served_0, local_0 = server_logprobs(client, ids), trainer_logprobs(trainer.model, ids)
    base_gap = (served_0 - local_0).abs().max().item()
    trainer.train()
    # The server generated the last step with the weights before it; push the final weights once more.
    trainer.vllm_generation.sync_weights()
    served_2, local_2 = server_logprobs(client, ids), trainer_logprobs(trainer.model, ids)
    moved = (local_2 - local_0).abs().max().item()
    gap = (served_2 - local_2).abs().max().item()
    stale = (served_0 - local_2).abs().max().item()
    print(f"log-probs: trainer moved {moved:.3g}; server vs trainer before {base_gap:.3g}, after {gap:.3g}")
    assert moved > 1e-2, "training did not move the policy's log-probs; the check below would prove nothing"
    assert not torch.equal(served_2, served_0), "the server's log-probs did not change: weights were not synced"
    assert gap < max(4 * base_gap, 1e-3), (gap, base_gap)  # follows the trainer as closely as at the start
    assert gap < stale / 4, (gap, stale)  # and is far closer to the new weights than to the old ones


def server_trainer(server, tmp_path, profile: str, **overrides):
    """A one-step server-mode trainer of the tiny Qwen3 against `server` under `profile`."""
    from helpers.trainer import make_config, varied_reward
    from trl_roundalign import RoundAlignGRPOTrainer
    from trl_roundalign.data import arithmetic_dataset
    from trl_roundalign.local_models import tiny_model

    args = make_config(
        tmp_path, max_steps=1, vllm_mode="server", vllm_server_base_url=server.url, vllm_server_timeout=60,
        vllm_group_port=free_port(), roundalign_profile=profile, **overrides,
    )  # fmt: skip
    return RoundAlignGRPOTrainer(
        model=tiny_model("qwen3"), reward_funcs=varied_reward, args=args, train_dataset=arithmetic_dataset("train[:16]")
    )
