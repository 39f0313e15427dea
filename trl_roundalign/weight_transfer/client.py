"""TRL's `VLLMClient` over the gloo backend; see `trl_roundalign.weight_transfer`."""

from __future__ import annotations

import atexit
import contextlib
import json

import torch
from trl.generation.vllm_client import VLLMClient

from . import BACKEND
from .gloo import (
    DEFAULT_BUFFER_SIZE_BYTES,
    DEFAULT_TIMEOUT_S,
    GlooGroup,
    _dtype,
    _is_loopback,
    rendezvous,
    send_tensors,
    stream_update,
    worker_init_payload,
)

__all__ = ["GlooVLLMClient", "gloo_client", "server_backend"]


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
        stream_update(
            lambda: self._post_once(f"{self.base_url}/update_weights", json={"update_info": update_info}),
            lambda: send_tensors(self.communicator, dtypes, shapes, names, named_params, self.buffer_size_bytes),
        )
        if not self._updating_weights:
            self._finish_weight_update()

    def _post_once(self, url: str, **kwargs) -> dict:
        """A POST without the session's retries: a weight stream cannot be replayed, and a retry would hide the
        server's first error behind `start_weight_update must be called before update_weights`."""
        import requests

        response = requests.post(url, **kwargs)
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
