"""Routing replay's forward half: each MoE layer's router takes the experts the engine chose for each token.

Where the trainer's hidden states differ from the sampler's (any profile but the exact one), its router can choose
other experts than the engine did, and a token's log-prob is then computed through experts that never sampled it.
With routing replay the router still computes its logits (the router's weights get their gradient, and transformers'
load-balancing loss reads them), but its top-k indices are the engine's for every token the engine recorded
(`engine.routes`); its weights are the profile's formula at those indices (transformers' fp32 softmax, renormalised
over the top k where `norm_topk_prob`, cast to the logits' dtype; the aligned block's fp32 form). A token the engine
did not record (a prompt position served from its prefix cache by a request outside the batch) keeps the trainer's
own choice and is counted. Under the exact profile the trainer's router already chooses the engine's experts, in the
engine's slot order (bit-identical router, `models.qwen3_moe`): the replayed indices are then the trainer's own, and
the counts say so.

`RoutingReplay` is one trainer's state: `install` binds it to the model's routers; `hold(routes, input_ids)` gives
the routes `[B, S, MoE layers, k]` (-1: not recorded, -2: not a token the engine computed) of the rows `input_ids`
(`[B, S]`) whose forwards follow, until the next `hold` or `release`. Each model forward finds its rows in `input_ids`
(TRL computes a batch's log-probs in chunks of rows), through a pre-hook on the decoder. Gradient checkpointing
recomputes a decoder layer in the backward, after later forwards may have selected other rows (exact mode's
re-prefill stretches, which replay nothing): each layer's checkpoint function is wrapped so that its recomputation
replays the routes its forward replayed (`_keeping_routes`), never the last forward's.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

__all__ = ["RoutingReplay", "replay_of", "router_renormalizes"]

# Each bound router's replay and its column in the routes (`RoutingReplay.install`).
_BOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def replay_of(gate) -> RoutingReplay | None:
    """The replay bound to this router, while it holds routes for the forward in progress; else None."""
    replay = _BOUND.get(gate, (None, None))[0]
    return replay if replay is not None and replay.current is not None else None


@dataclass
class RoutingReplay:
    layers: tuple[int, ...]  # the decoder layers with experts, in the routes' third dimension
    routes: torch.Tensor | None = None
    input_ids: torch.Tensor | None = None
    current: torch.Tensor | None = None  # the routes of the rows of the forward in progress
    counts: dict[str, int] = field(default_factory=lambda: {"compared": 0, "differ": 0, "unrecorded": 0})
    decoder_layers: list = field(default_factory=list, repr=False)  # the bound model's (`install`)

    def install(self, model: torch.nn.Module) -> int:
        """Bind each MoE layer's router of `model` (a transformers CausalLM, possibly wrapped) to this replay;
        returns how many. A router whose layer the engine did not record experts for is refused."""
        decoder, layers = _decoder_layers(model)
        self.decoder_layers = layers
        bound = 0
        for i, layer in enumerate(layers):
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            if gate is None or not hasattr(getattr(layer.mlp, "experts", None), "gate_up_proj"):
                continue
            if i not in self.layers:
                raise ValueError(f"Routing replay: layer {i} has experts but the engine recorded none for it "
                                 f"(engine MoE layers {list(self.layers)}); not the engine's model.")
            _BOUND[gate] = (self, self.layers.index(i))
            if "forward" not in gate.__dict__:
                gate.__dict__["forward"] = _replayed_gate_forward(gate, self)
            bound += 1
        if bound != len(self.layers):
            raise ValueError(f"Routing replay: the engine recorded {len(self.layers)} MoE layers, the model has {bound}.")
        decoder.register_forward_pre_hook(self._select_rows, with_kwargs=True)
        return bound

    def hold(self, routes: torch.Tensor | None, input_ids: torch.Tensor | None) -> None:
        self.routes, self.input_ids, self.current = routes, input_ids, None
        for layer in self.decoder_layers:  # checkpointing may have been turned on (or again) since `install`
            function = getattr(layer, "_gradient_checkpointing_func", None)
            if function is not None and not getattr(function, "keeps_routes", False):
                layer._gradient_checkpointing_func = _keeping_routes(function, self)

    def release(self) -> None:
        self.hold(None, None)

    def take_counts(self) -> dict[str, int]:
        counts, self.counts = self.counts, {"compared": 0, "differ": 0, "unrecorded": 0}
        return counts

    def _select_rows(self, module, args, kwargs):
        self.current = None
        if self.routes is None:
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise ValueError("Routing replay: a forward from inputs_embeds; replay needs the token rows it recorded.")
        if ids.shape[1] != self.input_ids.shape[1]:
            # Exact mode's re-prefill stretches (`trainer.unreproduced`): other columns, whose router is the engine's
            # bit for bit (the exact profile); counted as not replayed.
            self.counts["unrecorded"] += int(ids.numel()) if torch._C._current_graph_task_id() == -1 else 0
            return None
        b = ids.shape[0]
        held = self.input_ids.to(ids.device)
        for start in range(0, held.shape[0] - b + 1):
            if torch.equal(held[start : start + b], ids):
                self.current = self.routes[start : start + b]
                return None
        raise ValueError("Routing replay: the forward's rows are not the held batch's (its routes were recorded for "
                         "other sequences).")

    def indices(self, gate, own: torch.Tensor, *, count: bool = True) -> torch.Tensor:
        """The experts `[N, k]` this router's tokens take: the engine's where recorded, else `own`; counted against
        `own` (once per forward: not again in gradient checkpointing's recomputation inside the backward)."""
        replay, column = _BOUND.get(gate, (None, None))
        if replay is not self or self.current is None:
            return own
        routes = self.current[:, :, column].reshape(-1, own.shape[-1]).to(own.device)
        if routes.shape[0] != own.shape[0]:
            raise ValueError(f"Routing replay: the router sees {own.shape[0]} tokens, the held rows have "
                             f"{routes.shape[0]}.")
        recorded = routes[:, 0] >= 0
        unrecorded = routes[:, 0] == -1
        if count and torch._C._current_graph_task_id() == -1:
            replayed = routes[recorded].long()
            same = torch.eq(replayed.sort(-1).values, own[recorded].sort(-1).values).all(-1)
            self.counts["compared"] += int(recorded.sum())
            self.counts["differ"] += int((~same).sum())
            self.counts["unrecorded"] += int(unrecorded.sum())
        return torch.where(recorded[:, None], routes.long().clamp_min(0), own)


def _keeping_routes(checkpoint, replay: RoutingReplay):
    """A decoder layer's checkpoint function (transformers' `_gradient_checkpointing_func`) whose checkpointed call
    runs with the routes held when the forward ran, in the forward and again in the backward's recomputation (the same
    experts, and the same saved tensors, which torch's checkpoint checks)."""

    def checkpointed(function, *args, **kwargs):
        held = replay.current

        def with_routes(*a, **k):
            saved, replay.current = replay.current, held
            try:
                return function(*a, **k)
            finally:
                replay.current = saved

        return checkpoint(with_routes, *args, **kwargs)

    checkpointed.keeps_routes = True
    return checkpointed


def router_renormalizes(gate) -> bool:
    """Whether a transformers MoE router's top-k weights are a softmax over the top k (renormalised): its
    `norm_topk_prob` (Qwen3-MoE), or always where the router has none (Qwen3.5-MoE's `Qwen3_5MoeTopKRouter`; vLLM reads
    the absent config field as true too)."""
    return bool(getattr(gate, "norm_topk_prob", True))


def _replayed_gate_forward(gate, replay: RoutingReplay):
    """transformers' `Qwen3MoeTopKRouter.forward` (or Qwen3.5-MoE's) with the replayed indices (module docstring)."""
    original = type(gate).forward

    def forward(hidden_states):
        if replay.current is None:
            return original(gate, hidden_states)
        hidden_states = hidden_states.reshape(-1, gate.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, gate.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        idx = replay.indices(gate, torch.topk(probs, gate.top_k, dim=-1).indices)
        top = probs.gather(-1, idx)
        if router_renormalizes(gate):
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), idx

    return forward


def _decoder_layers(model: torch.nn.Module):
    """The decoder module (whose pre-hook selects the rows) and its layers, through PEFT/DDP wrappers."""
    for m in model.modules():
        layers = getattr(m, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and hasattr(m, "embed_tokens"):
            return m, list(layers)
    raise ValueError("Routing replay: no decoder with `embed_tokens` and `layers` in this model.")
