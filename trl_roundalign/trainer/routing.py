"""Routing replay in GRPO (`roundalign_routing_replay=True`): the engine's recorded routes (`engine.routes`) with each
generation, laid out as TRL's batch (`ROUTES_KEY`), held for each log-prob forward (`ops.routing.RoutingReplay`).

A batch's routes are `[B, S, MoE layers, k]` int16 over TRL's columns (the left-padded prompt, then the completion):
per token the engine's experts, -1 where the engine did not record them for this request (a prompt position its
prefix cache served; filled from another request of the same generation that computed the same prefix, else
counted), -2 where the engine computed no routing (padding, and each completion's last token, never fed back).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["ROUTES_KEY", "ROUTING_METRICS", "RouteCapture", "install_routing_replay", "routing_replay_refusal"]

ROUTES_KEY = "roundalign_routes"
ROUTING_METRICS = ("routing/differs", "routing/unrecorded_tokens")
NOT_RECORDED, NOT_COMPUTED = -1, -2


def routing_replay_refusal(config, args) -> str | None:
    """Why `roundalign_routing_replay=True` cannot run for this model and configuration, or None."""
    if config is not None and not getattr(config, "num_experts", None):
        return (f"roundalign_routing_replay=True: {getattr(config, 'model_type', 'this model')} has no experts; "
                "routing replay is for MoE models (Qwen3-MoE, Qwen3.5-MoE). Turn it off.")
    if not (args.use_vllm and args.vllm_mode == "colocate"):
        return ("roundalign_routing_replay=True records the engine's routes in a colocated engine; server mode does "
                "not return them yet. Use vllm_mode='colocate', or turn routing replay off.")
    if int(getattr(args, "vllm_tensor_parallel_size", 1) or 1) > 1:
        return ("roundalign_routing_replay=True with vllm_tensor_parallel_size > 1 is not measured (each rank's engine "
                "records its own routes). Set vllm_tensor_parallel_size=1, or turn routing replay off.")
    from ..engine.dispatch import is_vllm_cpu

    if not is_vllm_cpu():
        return ("roundalign_routing_replay=True records routes through vLLM-CPU's model runner; on this platform "
                "vLLM returns them itself (enable_return_routed_experts, model runner V2), which is not wired or "
                "measured here. Turn routing replay off.")
    return None


class RouteCapture:
    """The routes of the colocated engine's generations since `reset` (`llm.generate` wrapped, like the schedule
    capture), with each request's prompt and completion token ids."""

    def __init__(self, llm, layers: tuple[int, ...]):
        from ..engine.routes import take_routes

        self.layers = layers
        self.generations: list[list[tuple[list[int], list[int], np.ndarray | None]]] = []
        self._warned = False
        original = llm.generate

        def generate(*args, **kwargs):
            outputs = original(*args, **kwargs)
            taken = take_routes(llm, [o.request_id for o in outputs])
            records = [None] * len(outputs) if taken is None else taken[1]
            self.generations.append(_fill_cached_prefixes(
                [(list(o.prompt_token_ids), list(o.outputs[0].token_ids), r) for o, r in zip(outputs, records)]))
            return outputs

        llm.generate = generate

    def reset(self) -> None:
        self.generations = []

    def routes(self, attention_mask: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        """`[B, S, layers, k]` routes of the batch `attention_mask` `[B, S]` (completions: its last `logits_to_keep`
        columns) whose rows the generation since `reset` produced; every real token -1 where they cannot be mapped."""
        rows, cols = attention_mask.shape
        k = None
        requests = self.generations[0] if len(self.generations) == 1 else None
        prompts = attention_mask[:, : cols - int(logits_to_keep)].sum(1).tolist()
        if requests is not None and len(requests) == rows and all(
                r is not None and len(p) == n for (p, _, r), n in zip(requests, prompts)):
            k = requests[0][2].shape[2]
        out = torch.full((rows, cols, len(self.layers), k or 1), NOT_COMPUTED, dtype=torch.int16)
        mask = attention_mask.cpu().bool()
        first_completion = cols - int(logits_to_keep)
        mapped = k is not None
        for i in range(rows):
            prompt_cols = torch.nonzero(mask[i, :first_completion]).flatten()
            completion = int(mask[i, first_completion:].sum())
            real = torch.cat([prompt_cols, torch.arange(first_completion, first_completion + max(completion - 1, 0))])
            out[i, real] = NOT_RECORDED
            if not mapped:
                continue
            record = requests[i][2]
            n = min(len(real), record.shape[0])
            out[i, real[:n]] = torch.from_numpy(record[:n])
        if not mapped and not self._warned:
            self._warned = True
            logger.warning("Routing replay: a batch's rows could not be mapped to the engine's requests; their tokens "
                           "keep the trainer's own routing (routing/unrecorded_tokens counts them).")
        return out


def _fill_cached_prefixes(requests):
    """Prompt positions a request did not compute (its prefix cache served them) take the routes of another request
    of the generation that computed the same prefix (the keys and values it read are that request's)."""
    for prompt, _, record in requests:
        if record is None:
            continue
        missing = np.flatnonzero(record[: len(prompt), 0, 0] < 0)
        if missing.size == 0:
            continue
        for other_prompt, _, other in requests:
            if other is None or other is record:
                continue
            common = _common_prefix(prompt, other_prompt)
            take = missing[(missing < common) & (other[missing.clip(max=other.shape[0] - 1), 0, 0] >= 0)]
            record[take] = other[take]
            missing = np.flatnonzero(record[: len(prompt), 0, 0] < 0)
            if missing.size == 0:
                break
    return requests


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


class TrainerRouting:
    """One trainer's routing replay: the capture, the replay bound to the policy, the batch's routes to hold."""

    def __init__(self, capture: RouteCapture, replay):
        self.capture, self.replay = capture, replay
        self.pending: torch.Tensor | None = None  # the training batch's routes (`ROUTES_KEY`), set by `_compute_loss`

    def before_generation(self) -> None:
        self.capture.reset()
        self.replay.release()

    def annotate(self, batch: dict) -> None:
        """The generated batch's routes under `ROUTES_KEY` (TRL splits and shuffles them with its rows)."""
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
        batch[ROUTES_KEY] = self.capture.routes(mask, batch["completion_mask"].shape[1]).to(mask.device)

    def hold(self, input_ids, attention_mask, logits_to_keep: int, generating: bool) -> None:
        """Hold the routes of the rows whose log-probs are computed next: the training batch's, or, while a batch is
        generated (TRL's old and reference log-probs), the generation's own."""
        routes = self.pending
        if routes is None or routes.shape[:2] != input_ids.shape:
            routes = self.capture.routes(attention_mask, logits_to_keep) if generating else None
        if routes is None:
            raise ValueError("Routing replay: a log-prob forward of a batch without recorded routes (not generated by "
                             "the engine in this run).")
        self.replay.hold(routes.to(input_ids.device), input_ids)

    def log(self, metrics) -> None:
        counts = self.replay.take_counts()
        if counts["compared"] or counts["unrecorded"]:
            metrics[ROUTING_METRICS[0]].append(counts["differ"] / max(counts["compared"], 1))
            metrics[ROUTING_METRICS[1]].append(float(counts["unrecorded"]))


def install_routing_replay(trainer) -> TrainerRouting:
    """Bind routing replay to `trainer`'s policy and colocated engine (`roundalign_routing_replay=True`)."""
    from ..engine.routes import recorded_layers
    from ..ops.routing import RoutingReplay

    llm = trainer.vllm_generation.llm
    layers = recorded_layers(llm)
    if layers is None:
        raise ValueError("Routing replay: the colocated engine does not record routes (its additional_config lost "
                         "the recording key, or vLLM-CPU's runner was not hooked).")
    replay = RoutingReplay(layers)
    replay.install(trainer.model)
    return TrainerRouting(RouteCapture(llm, layers), replay)
