"""Routing replay's engine half: which experts vLLM-CPU's MoE routers chose for each token of each request.

vLLM returns the routed experts itself (`enable_return_routed_experts`) only with its second model runner, which
needs Triton: vLLM-CPU 0.32 refuses it ("AuxOutput Connector requires Model Runner V2", then "Model Runner V2
requires Triton"). An engine built with `RECORD_ROUTES_KEY` true in its `additional_config` records them the same
way on vLLM-CPU's own runner: each MoE layer's router gets vLLM's capture callback (`BaseRouter.set_capture_fn`,
bound before the model is first compiled, so the compiled graph writes each step's top-k ids into one buffer
`[step tokens, MoE layers, k]`), and after each model step the rows are filed per request at their positions (the
runner lays a step's tokens out request by request, in its input batch's order, each request's from its computed
count on). A position computed twice (a preempted request's re-prefill) keeps the later routes, the ones whose keys
and values the later tokens read. The key is hashed into vLLM's compile cache, so a graph compiled without the
capture never serves a recording engine; a step whose buffer rows were not all written (-1) leaves its tokens
unrecorded, and the trainer counts them (`trainer.routing`).

Measured on the peaked tiny Qwen3-MoE (AVX2 kind): the engine's sampled tokens and log-probs with the capture equal
those without it, bit for bit (`tests/trainer/test_routing_replay.py`).
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["RECORD_ROUTES_KEY", "install_route_recording", "record_routes_active", "recorded_layers", "take_routes"]

# The key of the engine's `additional_config` that turns recording on (per engine).
RECORD_ROUTES_KEY = "roundalign_record_routes"
_RECORDER = "_roundalign_routes"  # the recorder, on the model runner that owns it (read only in this module)


def record_routes_active(vllm_config) -> bool:
    extra = getattr(vllm_config, "additional_config", None)
    return bool(isinstance(extra, dict) and extra.get(RECORD_ROUTES_KEY))


class RouteRecorder:
    """The capture buffer of one model runner's MoE routers and the routes filed per request (module docstring)."""

    def __init__(self, model: torch.nn.Module, max_tokens: int):
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        runners = [m for m in model.modules() if isinstance(m, MoERunner)]
        if not runners:
            raise ValueError("Routing replay: the engine's model has no MoE layers (nothing to record).")
        if any(r._quant_method.is_monolithic or not isinstance(r.router, BaseRouter) for r in runners):
            raise ValueError("Routing replay: this engine's MoE kernel routes inside the kernel (monolithic), where "
                             "vLLM-CPU's runner cannot record the choices; not supported.")
        self.layers = tuple(sorted(int(r.layer_id) for r in runners))  # the decoder layers with experts
        top_k = {int(r.router.top_k) for r in runners}
        if len(top_k) != 1:
            raise ValueError(f"Routing replay: MoE layers with different top-k {sorted(top_k)}; not supported.")
        self.top_k = top_k.pop()
        self.buffer = torch.full((int(max_tokens), len(self.layers), self.top_k), -1, dtype=torch.int16)
        column = {layer: i for i, layer in enumerate(self.layers)}
        for r in runners:
            r.router.set_capture_fn(functools.partial(_capture, self.buffer, column[int(r.layer_id)]))
        self.requests: dict[str, np.ndarray] = {}  # engine request id -> [positions, MoE layers, k] int16, -1 unset

    def before_step(self) -> None:
        self.buffer.fill_(-1)

    def after_step(self, scheduler_output, req_ids) -> None:
        """File the step's rows per request: `req_ids` the runner's input batch order, each request's
        `num_scheduled_tokens` rows from its computed count on."""
        total = int(scheduler_output.total_num_scheduled_tokens)
        if total == 0:
            return
        rows = self.buffer[:total].numpy().copy()
        starts = {r.req_id: int(r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, map(int, cached.num_computed_tokens)))
        counts = scheduler_output.num_scheduled_tokens
        offset = 0
        for req_id in [r for r in req_ids if r in counts]:
            n, start = int(counts[req_id]), starts[req_id]
            record = self.requests.get(req_id)
            if record is None or record.shape[0] < start + n:
                grown = np.full((max(start + n, 2 * (0 if record is None else record.shape[0])), *rows.shape[1:]),
                                -1, dtype=np.int16)
                if record is not None:
                    grown[: record.shape[0]] = record
                record = self.requests[req_id] = grown
            record[start : start + n] = rows[offset : offset + n]
            offset += n
        if offset != total:  # not the layout read above: file nothing rather than misfile (the trainer counts it)
            logger.warning("Routing replay: a model step's %d tokens did not map to its requests (%d mapped); its "
                           "routes are not recorded.", total, offset)
            for req_id in counts:
                if req_id in self.requests:
                    self.requests[req_id][starts.get(req_id, 0):] = -1

    def take(self, request_ids) -> list[np.ndarray | None]:
        """The records of `request_ids` (the caller's ids; the engine appends `-<8 chars>`), removed."""
        internal = {k.rsplit("-", 1)[0]: k for k in self.requests if "-" in k and len(k.rsplit("-", 1)[1]) == 8}
        return [self.requests.pop(str(r), None) or self.requests.pop(internal.get(str(r), ""), None)
                for r in request_ids]


def _capture(buffer: torch.Tensor, column: int, topk_ids: torch.Tensor) -> None:
    buffer[: topk_ids.shape[0], column] = topk_ids.to(torch.int16)


def install_route_recording() -> bool:
    """Hook vLLM-CPU's model runner (idempotent; False where it is not importable). The hooks act only in engines
    whose `additional_config` asks for recording (`record_routes_active`)."""
    from .runner_hooks import hook_cpu_model_runner

    return hook_cpu_model_runner("routes", after_load=_new_recorder, before_step=_before_step, after_step=_after_step)


def _new_recorder(runner) -> None:
    if record_routes_active(runner.vllm_config):  # before the first forward compiles the model
        runner.__dict__[_RECORDER] = RouteRecorder(runner.model, runner.scheduler_config.max_num_batched_tokens)


def _before_step(runner, scheduler_output) -> None:
    if (recorder := runner.__dict__.get(_RECORDER)) is not None:
        recorder.before_step()


def _after_step(runner, scheduler_output) -> None:
    if (recorder := runner.__dict__.get(_RECORDER)) is not None:
        recorder.after_step(scheduler_output, list(runner.input_batch.req_ids))


def _take_in_worker(worker, request_ids):
    recorder = worker.model_runner.__dict__.get(_RECORDER)
    return None if recorder is None else (recorder.layers, recorder.take(request_ids))


def take_routes(llm, request_ids) -> tuple[tuple[int, ...], list[np.ndarray | None]] | None:
    """`(MoE layer indices, per request its routes [positions, layers, k] int16, -1 where not recorded)` from `llm`'s
    recording runner (the first worker's: every tensor-parallel rank routes alike), removed from it; None where the
    engine does not record."""
    answers = llm.collective_rpc(_take_in_worker, args=(list(request_ids),))
    return answers[0] if answers else None


def _layers_in_worker(worker):
    recorder = worker.model_runner.__dict__.get(_RECORDER)
    return None if recorder is None else recorder.layers


def recorded_layers(llm) -> tuple[int, ...] | None:
    """The decoder layers whose routes `llm`'s runner records (the routes' third dimension), or None where it does not
    record."""
    answers = llm.collective_rpc(_layers_in_worker)
    return answers[0] if answers else None
