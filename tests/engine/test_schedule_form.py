"""`RequestSchedule.form()` on hand-written records: which prefills, cuts and re-prefills a record gives the trainer,
and what it counts as not reproduced (the engine-backed cases are in `test_schedule_record.py`)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vllm]


def record(prompt, steps, preemptions=(), inherited=None):
    from trl_roundalign.engine.schedule import RequestSchedule

    return RequestSchedule(prompt, list(steps), list(preemptions), dict(inherited or {}))


def test_a_whole_prefill_then_decode_steps():
    r = record(40, [(0, 40, 0)] + [(40 + i - 1, 1, i) for i in range(1, 5)])
    assert r.form() == (((0, ()),), None) and r.prefill_tokens() == (40, 0)
    assert r.kinds() == frozenset()  # the start-up check's `sampler_forms` counts none


def test_chunks_a_prefix_hit_and_a_re_prefill_from_the_requests_own_cached_blocks():
    # A 300-token prompt from a hit of 256 (the cached blocks' computations started at 64 and 192), 3 decode steps,
    # preempted with 3 tokens, re-prefilled from a hit of 256 again, then in chunks of 40 and 7 (303 positions).
    steps = [(256, 44, 0), (300, 1, 1), (301, 1, 2), (256, 40, 3), (296, 7, 3), (303, 1, 4)]
    r = record(300, steps, preemptions=[(3, 3)], inherited={0: (64, 192), 3: (64, 192)})
    assert r.form() == (((0, (64, 192, 256)), (3, (64, 192, 256, 296))), None)
    assert r.prefill_tokens() == (44 + 40 + 7, 256 + 256)
    assert r.kinds() == {"prefix hit", "re-prefilled", "chunked"}
    chunked = record(168, [(0, 56, 0), (56, 56, 0), (112, 56, 0), (168, 1, 1)])  # the start-up check's chunked prompt
    assert chunked.kinds() == {"chunked"} and chunked.form() == (((0, (56, 112)),), None)


def test_what_the_record_cannot_place_is_counted_with_its_cause():
    assert record(40, []).form() == ((), (0, "unrecorded"))
    assert record(300, [(256, 44, 0)]).form() == ((), (0, "prefix_cached"))  # a hit with no inherited form
    gap = record(300, [(0, 100, 0), (150, 150, 0)])  # a chunk that does not continue where the last one ended
    assert gap.form() == (((0, ()),), (0, "prefill_chunked"))
    resumed = record(40, [(0, 40, 0), (40, 1, 1), (128, 10, 2)], preemptions=[(2, 2)])  # resumed from an unknown hit
    assert resumed.form() == (((0, ()),), (2, "preempted"))
