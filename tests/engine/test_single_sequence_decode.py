"""A decode step with one running sequence (issue 38, item 1): the engine's linears then compute 1-row GEMMs. On the
AMD AVX-512 kind a 1-row bf16 GEMM at K = 1536 (SmolLM2's down_proj) gives some rows other bits than the same rows in
a call of 2 or more, which the batch-invariance measurement missed (it took row 0 as M = 1's only sample). In GRPO
that is the tail of the longest completion once the others ended on EOS: its sampler log-probs then differed from
the prefill that exact mode reproduces. The measurement now computes each of the first rows alone, and "auto" takes
a schedule where a 1-row call differs (a row floor of 2 where only M = 1 differs)."""

from __future__ import annotations

import pytest
import torch

from trl_roundalign.engine import gemm


def test_the_measurement_sees_a_single_row_that_differs_beyond_the_first(monkeypatch):
    """A GEMM whose 1-row call differs on row 5 only (as the AVX-512 kind's does on some rows) is batch-variant at
    M = 1; the first row alone would not have shown it."""
    real = gemm.linear
    x_seen = {}

    def linear(x, w, b=None, rows=0, min_rows=0):
        out = real(x, w, b, rows, min_rows)
        if x.shape[0] == 1 and torch.equal(x[0], x_seen["row5"]):
            out = out.clone()
            out.view(-1)[0] += 1  # one output of that row's 1-row call other
        return out

    gen = torch.Generator().manual_seed(0)  # the measurement's own draw (seed 0): its row 5, to recognise it
    x_seen["row5"] = torch.randn(64, 96, generator=gen).to(torch.bfloat16)[5]
    monkeypatch.setattr(gemm, "linear", linear)
    report = gemm.measure_batch_invariance({"down": (96, 40)}, 64)
    assert report.shapes[0].variant_rows[:1] == [1] and not report.invariant, report.summary()


@pytest.mark.full  # SmolLM2 on the engine, 109 s; make test-full: kept out of make test for its time (docs/evidence.md, 'make test-full')
def test_a_sequence_decoded_alone_matches_the_prefill(smollm2):
    """SmolLM2 on the engine the project builds ("auto" GEMM schedule): one request decoded alone (every decode step a
    1-row GEMM), its sampler log-probs bit-identical to the engine's prefill of prompt + completion, the bits exact
    mode reproduces. Before the measurement saw 1-row calls: every token but the first differed on the AMD AVX-512
    kind."""
    from trl_roundalign.engine import build_llm, close_llm, engine_layout
    from trl_roundalign.scoring import generate_samples, vllm_prefill_logprobs

    llm = build_llm(smollm2, max_model_len=256)
    try:
        prompt = llm.get_tokenizer().encode("Question: what is 17 + 25? Answer:", add_special_tokens=False)
        [sample] = generate_samples(llm, [prompt], n=1, max_tokens=24, temperature=1.0, seed=3)
        assert len(sample.completion_ids) > 4, sample
        [prefill] = vllm_prefill_logprobs(llm, [sample.prompt_ids + sample.completion_ids])
        sampler = torch.tensor(sample.sampler_logprobs, dtype=torch.float32)
        got = prefill[len(sample.prompt_ids) - 1 :]
        differ = (got != sampler).nonzero().flatten().tolist()
        layout = engine_layout(llm)
        schedule = gemm.GemmSchedule(layout.gemm_block_rows or 0, layout.gemm_min_rows or 0).describe()
        print(f"{schedule}: {len(differ)} of {len(sampler)} tokens differ {differ}")
        assert not differ, (schedule, differ)
    finally:
        close_llm(llm)

