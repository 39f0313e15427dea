"""The sampler's forms of a forward: which tokens the engine computed in decode steps and how it cut each prompt's
prefill, for every mixer that reproduces them (the attention, `ops.attention`; Qwen3.5's gated delta-net,
`ops.gated_delta_net`). The trainer sets it around a log-prob forward (`sampled_from`); each mixer reads each packed
sequence's prefill chunks from it (`sampled_prefill_ends`)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Sequence

__all__ = ["sampled_from", "sampled_prefill_ends"]

# The column from which the tokens of a batch were generated (TRL's prompt + completion layout: the completions
# are the last `logits_to_keep` columns), and per batch row the cuts of its chunked prefill. Set by `sampled_from`;
# read by `sampled_prefill_ends`.
_DECODE_FROM_COLUMN: contextvars.ContextVar[tuple[int, tuple[tuple[int, ...], ...] | None] | None] = (
    contextvars.ContextVar("roundalign_decode_from", default=None))


@contextlib.contextmanager
def sampled_from(column: int, cuts: Sequence[Sequence[int]] | None = None):
    """Inside: `hf_attention_interface` computes every query token at `column` or later (the completion tokens a
    sampler generated) in decode form, as the engine's decode steps computed them, one query over its prefix with
    the keys kept on one thread (no KV split); the tokens before it (the prompt) as one prefill per sequence, or,
    where `cuts` gives a batch row's chunk boundaries (positions from its first real token, inside its prefill), as
    the chunks the engine's chunked prefill computed, each a request with past keys. Outside, and for sequences
    that start at or after `column`, every sequence is one prefill."""
    rows = None if cuts is None else tuple(tuple(sorted(int(c) for c in row)) for row in cuts)
    token = _DECODE_FROM_COLUMN.set((int(column), rows))
    try:
        yield
    finally:
        _DECODE_FROM_COLUMN.reset(token)


def sampled_prefill_ends(lens: Sequence[int], starts: Sequence[int], rows: Sequence[int], batch: int):
    """Inside `sampled_from`: each packed sequence's prefill as its chunks' ends (positions from its first token; the
    last the prefill's length, the tokens after it computed in decode form), from the sampled column and the batch
    rows' chunk cuts; None outside (every sequence one prefill). Shared by every mixer that computes the sampler's
    forms (attention, Qwen3.5's gated delta-net)."""
    sampled = _DECODE_FROM_COLUMN.get()
    if sampled is None:
        return None
    column, cuts = sampled
    decode_from = [min(max(column - a, 1), n) for a, n in zip(starts, lens)]
    if cuts is None:
        return [(pf,) for pf in decode_from]
    if len(cuts) != batch or len(set(rows)) != len(rows):
        raise ValueError(
            f"chunked-prefill cuts are given per batch row ({len(cuts)} for {batch} rows) and need one "
            "sequence per row (a padding mask, not packed sequences).")
    return [(*(c for c in cuts[row] if 0 < c < pf), pf) for row, pf in zip(rows, decode_from)]
