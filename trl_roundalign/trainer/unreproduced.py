"""Exact mode, per step: the form in which the engine computed each completion token, reproduced or counted.

The colocated engine records each request's schedule (`engine.schedule.RecordingScheduler`). `ScheduleCapture` takes
the records of every request of a generation, in the engine's output order (TRL's colocate mode asks one completion per
request, so that order is the completions' order; with a TP > 1 engine each rank keeps its slice, as TRL does), and
turns them into two per-token tensors of the generated batch, which travel with it (TRL shuffles and splits them with
the batch's other tensors) to the log-prob recomputation and into the metrics:

- `REPREFILL_KEY`: where the engine preempted a request and resumed it by a whole prefill of its prompt and its first
  `g` tokens, each later token's `g` (0: the first prefill). `reproduce_reprefills` recomputes the tokens of each such
  stretch by a forward of their own over the row's first columns, with the prefill the engine ran, and puts them in
  place of the batch forward's.
- `CUTS_KEY`: `[B, M, 2]`, per row the `(g, position)` pairs where the engine cut the prefill of stretch `g` into
  chunks (chunked prefill; positions from the row's first prompt token; `(-1, -1)` pads): the trainer computes each
  chunk as a request with past keys (`ops.attention.sampled_from`).
- `UNREPRODUCED_KEY`: 0 where the token's form is reproduced (`metrics.REPREFILLED_CODE` where it is through a
  re-prefill, `mismatch/reprefilled_tokens`), `i` for the cause `metrics.UNREPRODUCED_CAUSES[i - 1]` where it is not
  (`mismatch/unreproduced_tokens`).

Where a generation cannot be mapped to the batch's rows (a multi-turn rollout makes several generations) and any of its
requests was not computed in the plain form, every token of the batch is counted, as "unrecorded": fail closed, never
silent.
"""

from __future__ import annotations

import logging

import torch

from ..metrics import REPREFILLED_CODE, UNREPRODUCED_CAUSES

logger = logging.getLogger(__name__)

__all__ = ["CUTS_KEY", "REPREFILL_KEY", "SCHEDULE_METRICS", "UNREPRODUCED_KEY", "ScheduleCapture", "UnreproducedStep", "reproduce_reprefills",
           "row_cuts"]

UNRECORDED = "unrecorded"  # a request the engine kept no record of (`engine.schedule.UNRECORDED`, vLLM-free here)
assert UNRECORDED in UNREPRODUCED_CAUSES

# Per step, from the engine's records: prompt positions it prefilled (chunks and re-prefills included), positions it
# took from its prefix cache instead, and its preemptions (docs/metrics.md).
SCHEDULE_METRICS = ("schedule/prefilled_tokens", "schedule/prefix_cached_tokens", "schedule/preemptions")

# The key of the per-token codes in the generated batch (TRL splits and shuffles it with the batch's other tensors).
UNREPRODUCED_KEY = "roundalign_unreproduced"
# The key of the per-token re-prefill points in the generated batch (`ScheduleCapture.reprefills`).
REPREFILL_KEY = "roundalign_reprefill"
# The key of the per-row chunk cuts of each prefill in the generated batch (`ScheduleCapture.cuts`).
CUTS_KEY = "roundalign_prefill_cuts"

_WHAT_TO_DO = {
    "preempted": "a preempted request resumed by a chunked or cached prefill (exact mode reproduces a whole "
                 "re-prefill): leave chunked prefill and prefix caching to exact mode, or give the engine enough KV "
                 "cache for a step's sequences (VLLM_CPU_KVCACHE_SPACE, vllm_gpu_memory_utilization)",
    "prefill_chunked": "report the engine's schedule record (a multi-token step that continues no prefill), or turn "
                       "chunked prefill off (enable_chunked_prefill=False) and raise max_num_batched_tokens to the "
                       "context length",
    "prefix_cached": "leave prefix caching to exact mode (it turns it off)",
    UNRECORDED: "leave vllm_engine_kwargs['scheduler_cls'] unset (exact mode's engine records each request's schedule)",
}


class UnreproducedStep(RuntimeError):
    """`roundalign_stop_on_unreproduced=True`: a step's completion tokens include some the trainer does not reproduce."""


class ScheduleCapture:
    """The schedule records of the engine's generations for the current batch: a colocated engine's (`llm.generate`
    wrapped; `llm` None: the caller adds them, `add`, as a server's client does, `server_exact`)."""

    def __init__(self, llm=None, *, tp_size: int = 1, tp_rank: int = 0, stop: bool = False):
        self.tp_size, self.tp_rank, self.stop = int(tp_size), int(tp_rank), bool(stop)
        # Per generation, per request: `RequestSchedule.form()`, `(stretches, first unreproduced or None)`.
        self.generations: list[list[tuple[tuple[tuple[int, tuple[int, ...]], ...], tuple[int, str] | None]]] = []
        self.kinds: list[list[frozenset[str]]] = []  # per generation, per request: `RequestSchedule.kinds()`
        self._warned: set[str] = set()
        # Per generation: prompt positions the engine prefilled and took from its prefix cache, and its preemptions.
        self.prefills: list[tuple[int, int, int]] = []
        if llm is None:
            return
        from ..engine.schedule import take_schedules  # imports vLLM's scheduler

        original = llm.generate

        def generate(*args, **kwargs):
            outputs = original(*args, **kwargs)
            self.add(take_schedules(llm, [o.request_id for o in outputs]))
            return outputs

        llm.generate = generate

    def add(self, records) -> None:
        """One generation's records (`engine.schedule.RequestSchedule`, None where the engine kept none), per request."""
        self.generations.append([((), (0, UNRECORDED)) if r is None else r.form() for r in records])
        self.kinds.append([frozenset() if r is None else r.kinds() for r in records])
        counts = [(*r.prefill_tokens(), len(r.preemptions)) for r in records if r is not None]
        self.prefills.append(tuple(sum(c[k] for c in counts) for k in range(3)))

    def reset(self) -> None:
        """Forget earlier generations (the start-up check's, the previous batch's)."""
        self.generations = []
        self.kinds = []
        self.prefills = []

    def schedule_metrics(self) -> dict[str, float]:
        """What the engine's schedule did in the generations since `reset` (logged per step, `SCHEDULE_METRICS`)."""
        return {name: float(sum(p[k] for p in self.prefills)) for k, name in enumerate(SCHEDULE_METRICS)}

    def _forms(self, rows: int):
        """The forms of the `rows` completions the generations since `reset` produced, or None where they cannot be
        mapped to the rows (not one generation of that many requests, or this rank's slice of it)."""
        forms = self.generations[0] if len(self.generations) == 1 else None
        if forms is not None and self.tp_size > 1 and len(forms) == rows * self.tp_size:
            forms = forms[self.tp_rank * rows : (self.tp_rank + 1) * rows]
        return forms if forms is not None and len(forms) == rows else None

    def reprefills(self, shape: tuple[int, int]) -> torch.Tensor | None:
        """`[B, T]` int32: per completion token, how many tokens its request had generated when the engine last
        prefilled it (0: the prompt's prefill; `g > 0`: a whole re-prefill after a preemption). None where the
        generations cannot be mapped to the `B` rows (`codes` then counts their tokens)."""
        forms = self._forms(shape[0])
        if forms is None:
            return None
        out = torch.zeros(shape, dtype=torch.int32)
        for i, (stretches, _) in enumerate(forms):
            for g, _ in stretches:
                out[i, g:] = g
        return out

    def cuts(self, rows: int) -> torch.Tensor | None:
        """`[rows, M, 2]` int32: per row the `(g, position)` pairs where the engine cut stretch `g`'s prefill into
        chunks, `(-1, -1)` after them (`M`: the most of any row; 0 where nothing was chunked). None where the
        generations cannot be mapped to the rows."""
        forms = self._forms(rows)
        if forms is None:
            return None
        pairs = [[(g, c) for g, cuts in stretches for c in cuts] for stretches, _ in forms]
        out = torch.full((rows, max(map(len, pairs), default=0), 2), -1, dtype=torch.int32)
        for i, row in enumerate(pairs):
            if row:
                out[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        return out

    def codes(self, completion_mask: torch.Tensor) -> torch.Tensor:
        """`[B, T]` int8 codes of the batch whose completions the generations since `reset` produced (0: reproduced)."""
        codes = torch.zeros(completion_mask.shape, dtype=torch.int8, device=completion_mask.device)
        forms = self._forms(completion_mask.shape[0])
        if forms is None:
            if any(len(stretches) > 1 or any(c for _, c in stretches) or flag is not None
                   for g in self.generations for stretches, flag in g):
                codes[:] = 1 + UNREPRODUCED_CAUSES.index(UNRECORDED)  # not mappable to rows: every token counted
                self._said([UNRECORDED], int(completion_mask.sum()))
            return codes
        for i, (stretches, flag) in enumerate(forms):
            if len(stretches) > 1:  # reproduced through a re-prefill (`reproduce_reprefills`)
                codes[i, stretches[1][0]:] = REPREFILLED_CODE
            if flag is not None:
                first, cause = flag
                codes[i, first:] = 1 + UNREPRODUCED_CAUSES.index(cause)
        codes *= (completion_mask != 0).to(codes.dtype)
        if (codes > 0).any():
            causes = [UNREPRODUCED_CAUSES[c - 1] for c in sorted(set(codes[codes > 0].tolist()))]
            self._said(causes, int((codes > 0).sum()))
        return codes

    def _said(self, causes: list[str], tokens: int) -> None:
        what = "; ".join(f"{c}: {_WHAT_TO_DO[c]}" for c in causes)
        line = (f"Exact mode: {tokens} completion tokens of this batch were computed by the engine in a form the trainer "
                f"does not reproduce ({', '.join(causes)}; mismatch/unreproduced_tokens counts them). To keep every "
                f"token exact, {what}.")
        if self.stop:
            raise UnreproducedStep(line)
        new = [c for c in causes if c not in self._warned]
        if new:
            self._warned.update(new)
            logger.warning(line)


def row_cuts(cuts: torch.Tensor | None, row: int, g: int) -> tuple[int, ...]:
    """The chunk cuts of stretch `g`'s prefill in `row` of a `CUTS_KEY` tensor (empty: one whole prefill)."""
    if cuts is None or cuts.shape[1] == 0:
        return ()
    pairs = cuts[row]
    return tuple(int(c) for c in pairs[pairs[:, 0] == g][:, 1].tolist())


def reproduce_reprefills(compute, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                         reprefill: torch.Tensor | None, out: tuple, cuts: torch.Tensor | None = None, accelerator=None):
    """`out` (`(logps, entropies, aux)` of the batch's forward, whose completion tokens were computed as after the
    prompt's prefill) with each re-prefilled stretch's tokens recomputed as the engine computed them.

    A request the engine preempted after `g` tokens and resumed by a whole prefill of its prompt and those tokens
    computed token `g` from that prefill's last position, and the tokens after it by decode steps over that prefill's
    keys and values (another form than the first prefill's and the decode steps'). Per such stretch `[g, e)` of a row
    (`e`: the next stretch's start, or the row's last completion token), `compute(ids, mask, keep, cuts)` runs the
    trainer's exact forward of the row's columns up to token `e` with its last `keep = e - g` tokens in decode form:
    the first `g` completion tokens are then prefilled with the prompt, as the engine's re-prefill was (in the chunks
    `cuts` where it chunked it, `CUTS_KEY`). One forward per stretch, each over the stretch's whole prefix: what a
    preemption costs the trainer. The gradient flows through the forward that computed each token.

    With several training processes (`accelerator`), each forward of a wrapped model is a collective (DDP's buffer
    broadcast, FSDP2's all-gathers), so every process runs as many as the process with the most stretches: the others
    add forwards of their first row's first completion token whose result enters the log-probs as an exact +0 (value
    and gradient zero), so that their backward meets the same hooks."""
    column = input_ids.shape[1] - int(logits_to_keep)
    stretches = []
    reprefill = None if reprefill is None else reprefill.to(input_ids.device)
    rows = [] if reprefill is None else [int(r) for r in torch.nonzero((reprefill > 0).any(dim=1)).flatten()]
    for r in rows:
        length = int(attention_mask[r, column:].sum())  # the completion's tokens (right-padded after them)
        starts = sorted({int(g) for g in reprefill[r, :length].tolist()} - {0})
        stretches += [(r, g, e) for g, e in zip(starts, starts[1:] + [length])]
    forwards = len(stretches)
    if accelerator is not None and accelerator.num_processes > 1:
        forwards = int(accelerator.gather(torch.tensor([forwards], device=input_ids.device)).max())
    if not forwards:
        return out
    logps, entropies, aux = out
    logps = logps.clone()
    entropies = None if entropies is None else entropies.clone()
    for r, g, e in stretches:
        part_logps, part_entropies, _ = compute(input_ids[r : r + 1, : column + e], attention_mask[r : r + 1, : column + e],
                                                e - g, [row_cuts(cuts, r, g)])
        logps[r, g:e] = part_logps[0]
        if entropies is not None:
            entropies[r, g:e] = part_entropies[0]
    for _ in range(forwards - len(stretches)):
        part_logps, _, _ = compute(input_ids[:1, : column + 1], attention_mask[:1, : column + 1], 1, [()])
        # +0 exactly, whatever the part computed (|.| * 0 is +0; x - (+0) is x, -0 included): value and gradient 0.
        logps[0, 0] = logps[0, 0] - part_logps.nan_to_num(0.0, 0.0, 0.0).sum().abs() * 0
    return logps, entropies, aux
