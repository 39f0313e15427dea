"""TRL's `VLLMClient` over the gloo backend; see `trl_roundalign.weight_transfer`."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import time

import requests
import torch
from requests.adapters import HTTPAdapter
from trl.generation.vllm_client import VLLMClient

from . import BACKEND
from .auth import TOKEN_ENV, TOKEN_HEADER
from .gloo import (
    DEFAULT_BUFFER_SIZE_BYTES,
    DEFAULT_TIMEOUT_S,
    NOT_JOINED,
    GlooGroup,
    _dtype,
    _is_loopback,
    rendezvous,
    send_tensors,
    stream_update,
    worker_init_payload,
)

__all__ = ["GlooVLLMClient", "gloo_client", "server_backend"]

# HTTP timeouts (seconds), each overridable by its environment variable. A request's read timeout bounds the wait
# for the answer (vLLM answers a generation when it is complete, so it must cover the slowest batch on a CPU); the
# weight endpoints block while the weights stream over gloo and load, so theirs is longer than the gloo timeout.
CONNECT_TIMEOUT_S = ("ROUNDALIGN_SERVER_CONNECT_TIMEOUT_S", 30.0)
READ_TIMEOUT_S = ("ROUNDALIGN_SERVER_READ_TIMEOUT_S", 1800.0)
WEIGHT_UPDATE_TIMEOUT_S = ("ROUNDALIGN_WEIGHT_UPDATE_TIMEOUT_S", 3600.0)
WEIGHT_ENDPOINTS = (
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
)


def _seconds(setting: tuple[str, float]) -> float:
    name, default = setting
    value = os.environ.get(name)
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a number of seconds") from None
    if not seconds > 0:
        raise ValueError(f"{name}={value!r}: expected a positive number of seconds")
    return seconds


class _TimeoutAdapter(HTTPAdapter):
    """An adapter that gives every request without a timeout of its own a (connect, read) one."""

    def __init__(self, connect_s: float, read_s: float, weight_read_s: float, **kwargs):
        super().__init__(**kwargs)
        self.connect_s, self.read_s, self.weight_read_s = connect_s, read_s, weight_read_s

    def timeout_for(self, url: str) -> tuple[float, float]:
        path = requests.utils.urlparse(url).path
        weights = path.endswith(WEIGHT_ENDPOINTS)
        return (self.connect_s, self.weight_read_s if weights else self.read_s)

    def send(self, request, stream=False, timeout=None, **kwargs):
        return super().send(request, stream=stream, timeout=timeout or self.timeout_for(request.url), **kwargs)


def server_backend(server_info: dict) -> str | None:
    """The weight-transfer backend a vLLM server runs (from its `/server_info`), or None without one."""
    config = server_info.get("weight_transfer_config")
    if config is None:
        return None
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError:
            return config
    return config.get("backend") if isinstance(config, dict) else getattr(config, "backend", None)


class GlooVLLMClient(VLLMClient):
    """TRL's `VLLMClient` with the weights pushed over the gloo backend instead of NCCL.

    Used for a trainer without CUDA (installed by `RoundAlignGRPOTrainer` in server mode on CPU);
    on a CUDA device it is TRL's client unchanged. The server must run the ``"gloo"`` backend
    (`--weight-transfer-config '{"backend": "gloo"}'`, with trl-roundalign installed next to it).
    """

    buffer_size_bytes = DEFAULT_BUFFER_SIZE_BYTES
    timeout_s = DEFAULT_TIMEOUT_S

    def __init__(self, *args, **kwargs):
        # Read before TRL's constructor, whose health check and model lookup already need them.
        self.connect_timeout_s = _seconds(CONNECT_TIMEOUT_S)
        self.read_timeout_s = _seconds(READ_TIMEOUT_S)
        self.weight_update_timeout_s = _seconds(WEIGHT_UPDATE_TIMEOUT_S)
        self.server_token = os.environ.get(TOKEN_ENV) or None
        super().__init__(*args, **kwargs)
        # The same retries as TRL's session, with default timeouts; the server token on every request.
        retries = self.session.get_adapter("http://").max_retries
        adapter = _TimeoutAdapter(
            self.connect_timeout_s,
            self.read_timeout_s,
            self.weight_update_timeout_s,
            max_retries=retries,
            pool_maxsize=self.session.get_adapter("http://")._pool_maxsize,
        )
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        if self.server_token:
            self.session.headers[TOKEN_HEADER] = self.server_token

    def check_server(self, total_timeout: float = 0.0, retry_interval: float = 2.0):
        """TRL's health check (`/health` until it answers 200 or `total_timeout` passes), each try with a timeout:
        a server that accepts the connection and never answers is retried, not waited for."""
        url, start = f"{self.base_url}/health", time.time()
        while True:
            try:
                response = requests.get(url, timeout=(self.connect_timeout_s, self.connect_timeout_s))
            except requests.exceptions.RequestException as exc:
                if time.time() - start >= total_timeout:
                    raise ConnectionError(
                        f"The vLLM server can't be reached at {self.base_url} after {total_timeout} seconds: {exc}"
                    ) from exc
            else:
                if response.status_code == 200:
                    if "X-Forwarded-For" in response.headers:
                        self.host = response.headers["X-Forwarded-For"]
                    return
                if time.time() - start >= total_timeout:
                    raise ConnectionError(
                        f"The vLLM server at {self.base_url} answered /health with {response.status_code} for "
                        f"{total_timeout} seconds."
                    )
            time.sleep(retry_interval)

    def _get(self, url: str, **kwargs) -> dict:
        # TRL's constructor asks for /v1/models before the session's adapter gives timeouts.
        kwargs.setdefault("timeout", (self.connect_timeout_s, self.read_timeout_s))
        return super()._get(url, **kwargs)

    def init_communicator(self, device: torch.device | str | int = 0):
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type == "cuda":
            return super().init_communicator(device)
        backend = server_backend(self.get_server_info())
        if backend != BACKEND:
            have = "no weight-transfer engine" if backend is None else f"the {backend!r} weight-transfer backend"
            raise RuntimeError(
                f"The vLLM server at {self.base_url} runs {have}; a CPU trainer syncs weights over gloo: start it with "
                f'--weight-transfer-config \'{{"backend": "{BACKEND}"}}\' (trl-roundalign installed in its environment).'
            )
        world_size = self.get_world_size() + 1
        if _is_loopback(self.host or ""):
            address = "127.0.0.1"
        else:
            from vllm.utils.network_utils import get_ip

            address = get_ip()
        init_info = worker_init_payload(address, self.group_port, world_size, self.buffer_size_bytes, self.timeout_s)
        self.communicator = rendezvous(
            lambda: self._post(f"{self.base_url}/init_weight_transfer_engine", json={"init_info": init_info}),
            address,
            self.group_port,
            world_size,
            self.timeout_s,
        )

        atexit.register(self.close_communicator)

    def update_named_params(self, metadata, named_params):
        if not isinstance(self.communicator, GlooGroup):
            return super().update_named_params(metadata, named_params)
        names, dtype_names, shapes = (list(f) for f in zip(*metadata, strict=True))
        dtypes = [_dtype(d) for d in dtype_names]
        update_info = {"names": names, "dtype_names": dtype_names, "shapes": shapes}
        if not self._updating_weights:
            self._start_weight_update()
        try:
            stream_update(
                lambda: self._post_once(f"{self.base_url}/update_weights", json={"update_info": update_info}),
                lambda: send_tensors(self.communicator, dtypes, shapes, names, named_params, self.buffer_size_bytes),
            )
        except RuntimeError as e:
            if NOT_JOINED not in str(e):
                raise
            raise RuntimeError(
                f"The vLLM server at {self.base_url} is not the one this trainer started with: its weight transfer never "
                "joined the trainer's group (it was restarted, or another server answers at that address), so its "
                "weights are not the trainer's. Restart the training run (from its last checkpoint)."
            ) from e
        if not self._updating_weights:
            self._finish_weight_update()

    def _post_once(self, url: str, **kwargs) -> dict:
        """A POST without the session's retries: a weight stream cannot be replayed, and a retry would hide the
        server's first error behind `start_weight_update must be called before update_weights`."""
        headers = {**kwargs.pop("headers", {}), **({TOKEN_HEADER: self.server_token} if self.server_token else {})}
        timeout = kwargs.pop("timeout", (self.connect_timeout_s, self.weight_update_timeout_s))
        try:
            response = requests.post(url, headers=headers, timeout=timeout, **kwargs)
        except requests.exceptions.Timeout as e:
            raise RuntimeError(
                f"{url} timed out: no answer within the (connect, read) timeouts {timeout} s "
                f"({CONNECT_TIMEOUT_S[0]}, {WEIGHT_UPDATE_TIMEOUT_S[0]}): {e}"
            ) from e
        if response.status_code != 200:
            raise RuntimeError(f"{url} failed: {response.status_code}, {response.text}")
        return response.json()

    def close_communicator(self):
        if isinstance(self.communicator, GlooGroup):
            self.communicator.close()
            self.communicator = None
            return
        super().close_communicator()


@contextlib.contextmanager
def gloo_client():
    """Inside: TRL's server-mode generation builds a `GlooVLLMClient` (what `RoundAlignGRPOTrainer` uses on CPU)."""
    import trl.generation.vllm_generation as vg

    original = vg.VLLMClient
    vg.VLLMClient = GlooVLLMClient
    try:
        yield
    finally:
        vg.VLLMClient = original
