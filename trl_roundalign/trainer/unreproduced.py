"""Exact mode, per step: which completion tokens the engine computed in a form the trainer does not reproduce.

The colocated engine records each request's schedule (`engine.schedule.RecordingScheduler`). `ScheduleCapture` takes
the records of every request of a generation, in the engine's output order (TRL's colocate mode asks one completion per
request, so that order is the completions' order; with a TP > 1 engine each rank keeps its slice, as TRL does), and
turns them into per-token codes of the generated batch (`UNREPRODUCED_KEY`, 0: reproduced; `i`: the cause
`metrics.UNREPRODUCED_CAUSES[i - 1]`), which travel with the batch to the loss and into `mismatch/unreproduced_tokens`.
Where a generation cannot be mapped to the batch's rows (a multi-turn rollout makes several generations) and any of its
requests was not reproduced, every token of the batch is counted, as "unrecorded": fail closed, never silent.
"""

from __future__ import annotations

import logging

import torch

from ..metrics import UNREPRODUCED_CAUSES

logger = logging.getLogger(__name__)

__all__ = ["UNREPRODUCED_KEY", "ScheduleCapture", "UnreproducedStep"]

UNRECORDED = "unrecorded"  # a request the engine kept no record of (`engine.schedule.UNRECORDED`, vLLM-free here)
assert UNRECORDED in UNREPRODUCED_CAUSES

# The key of the per-token codes in the generated batch (TRL splits and shuffles it with the batch's other tensors).
UNREPRODUCED_KEY = "roundalign_unreproduced"

_WHAT_TO_DO = {
    "preempted": "give the engine enough KV cache for a step's sequences (VLLM_CPU_KVCACHE_SPACE, "
                 "vllm_gpu_memory_utilization) or generate fewer sequences at a time",
    "prefill_chunked": "leave chunked prefill to exact mode (it turns it off) or raise max_num_batched_tokens to the "
                       "context length",
    "prefix_cached": "leave prefix caching to exact mode (it turns it off)",
    UNRECORDED: "leave vllm_engine_kwargs['scheduler_cls'] unset (exact mode's engine records each request's schedule)",
}


class UnreproducedStep(RuntimeError):
    """`roundalign_stop_on_unreproduced=True`: a step's completion tokens include some the trainer does not reproduce."""


class ScheduleCapture:
    """The schedule records of the colocated engine's generations (`llm.generate` wrapped), for the current batch."""

    def __init__(self, llm, *, tp_size: int = 1, tp_rank: int = 0, stop: bool = False):
        self.tp_size, self.tp_rank, self.stop = int(tp_size), int(tp_rank), bool(stop)
        self.generations: list[list[tuple[int, str] | None]] = []
        self._warned: set[str] = set()
        from ..engine.schedule import take_schedules  # imports vLLM's scheduler

        original = llm.generate

        def generate(*args, **kwargs):
            outputs = original(*args, **kwargs)
            records = take_schedules(llm, [o.request_id for o in outputs])
            self.generations.append([
                (0, UNRECORDED) if r is None else r.first_unreproduced() for r in records
            ])
            return outputs

        llm.generate = generate

    def reset(self) -> None:
        """Forget earlier generations (the start-up check's, the previous batch's)."""
        self.generations = []

    def codes(self, completion_mask: torch.Tensor) -> torch.Tensor:
        """`[B, T]` int8 codes of the batch whose completions the generations since `reset` produced (0: reproduced)."""
        codes = torch.zeros(completion_mask.shape, dtype=torch.int8, device=completion_mask.device)
        rows = completion_mask.shape[0]
        flags = self.generations[0] if len(self.generations) == 1 else None
        if flags is not None and self.tp_size > 1 and len(flags) == rows * self.tp_size:
            flags = flags[self.tp_rank * rows : (self.tp_rank + 1) * rows]
        if flags is None or len(flags) != rows:
            if any(f is not None for g in self.generations for f in g):
                codes[:] = 1 + UNREPRODUCED_CAUSES.index(UNRECORDED)  # not mappable to rows: every token counted
                self._said([UNRECORDED], int(completion_mask.sum()))
            return codes
        for i, flag in enumerate(flags):
            if flag is not None:
                first, cause = flag
                codes[i, first:] = 1 + UNREPRODUCED_CAUSES.index(cause)
        codes *= (completion_mask != 0).to(codes.dtype)
        if codes.any():
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
