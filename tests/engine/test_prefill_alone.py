"""Each prompt prefilled alone (`engine.prefill`, issue 38): what makes a prompt of any length reproducible.

vLLM-CPU computes a step's prompts in one attention call whose schedule shares the work among the threads; past one
key tile (544 tokens at head dim 128 on the AMD AVX-512 kind, 2 threads) a prompt's prefill then depends on the other
prompts of its step, and exact mode only warned. An engine built with `prefill_alone` computes each prompt in a call
of its own, whole (no chunking, no prefix caching), as the trainer recomputes it.
"""

from __future__ import annotations

import pytest
import torch

from trl_roundalign.engine.prefill import PREFILL_ALONE_KEY, prefill_alone_engine_kwargs, request_groups


def test_each_prompt_gets_its_own_call_and_decodes_share_one():
    assert request_groups([5]) is None  # one request: the step's call is already its own
    assert request_groups([1, 1, 1]) is None  # decodes only: one call
    assert request_groups([7, 1, 1, 9, 1]) == [(0, 1), (1, 3), (3, 4), (4, 5)]
    assert request_groups([1, 1, 300, 200]) == [(0, 2), (2, 3), (3, 4)]


def test_the_engine_options_keep_what_the_user_set():
    """The flag always; chunking and prefix caching off unless the user's `vllm_engine_kwargs` say otherwise; the step
    budget raised to the context length where chunking is off (vLLM requires it)."""
    kwargs = {"additional_config": {"other": 1}, "max_num_batched_tokens": 4096}
    prefill_alone_engine_kwargs(kwargs, 8192, None)
    assert kwargs == {"additional_config": {"other": 1, PREFILL_ALONE_KEY: True}, "max_num_batched_tokens": 8192,
                      "enable_chunked_prefill": False, "enable_prefix_caching": False}
    kwargs = {"enable_prefix_caching": True, "enable_chunked_prefill": True, "max_num_batched_tokens": 2048}
    prefill_alone_engine_kwargs(kwargs, 8192, None)
    assert (kwargs["enable_prefix_caching"], kwargs["enable_chunked_prefill"], kwargs["max_num_batched_tokens"]) == (
        True, True, 2048)


@pytest.mark.vllm
@pytest.mark.slow
def test_a_long_prompt_is_prefilled_as_alone_beside_others():
    """Prompts past one key tile, prefilled in one step beside each other: the engine's prompt log-probs of each equal
    its prefill alone, bit for bit, and the layout says so (read back from the engine's worker). On the stock engine
    the same batch differs from the lone prefills wherever this machine's prompt horizon is below these lengths (the
    half of the test that shows the setting matters; on one thread there is no horizon)."""
    from transformers import AutoConfig

    from trl_roundalign.engine import build_llm, close_llm, engine_layout
    from trl_roundalign.local_models import tiny_model
    from trl_roundalign.scoring import vllm_prefill_logprobs
    from trl_roundalign.trainer.startup_check import model_prompt_horizon

    model = tiny_model("qwen3", num_hidden_layers=2, head_dim=128, max_position_embeddings=4096)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(10, 500, (n,), generator=gen).tolist() for n in (1100, 1000, 640)]
    horizon = model_prompt_horizon(AutoConfig.from_pretrained(str(model)))
    differ = {}
    for alone in (True, False):
        if not alone and (horizon is None or horizon >= 640):
            continue
        llm = build_llm(model, max_model_len=2048, prefill_alone=alone, cache_tag="alone" if alone else "")
        try:
            layout = engine_layout(llm)
            batched = vllm_prefill_logprobs(llm, seqs)
            single = vllm_prefill_logprobs(llm, seqs, one_at_a_time=True)
        finally:
            close_llm(llm)
        differ[alone] = [int((b != s).sum()) for b, s in zip(batched, single)]
        if alone:
            assert (layout.attention_prefill_alone, layout.chunked_prefill, layout.prefix_caching) == (True, False, False)
            assert layout.prompts_alone and layout.max_num_batched_tokens >= 2048, layout
        else:
            assert not layout.attention_prefill_alone and not layout.prompts_alone, layout
    print(f"horizon {horizon}; log-probs differing batched vs alone: {differ}")
    assert differ[True] == [0, 0, 0], differ
    if False in differ:
        assert any(differ[False]), differ


@pytest.mark.vllm
def test_the_trainer_computes_each_prompt_as_its_lone_prefill():
    """The trainer's kernel calls follow the engine's grouping: a forward of several sequences (prompts past one key
    tile, and completion tokens in decode form) gives each sequence the bits of its own call, whatever its company."""
    pytest.importorskip("vllm")
    from trl_roundalign.ops.attention import vllm_cpu_attention_forward
    from trl_roundalign.trainer.startup_check import prefill_batch_invariant_tokens

    gen = torch.Generator().manual_seed(1)
    lens, prompts = [1100, 700, 900], [1000, 700, 850]
    q = (torch.randn(sum(lens), 4, 128, generator=gen) * 2).to(torch.bfloat16)
    k, v = (torch.randn(sum(lens), 2, 128, generator=gen).to(torch.bfloat16) for _ in range(2))
    together = vllm_cpu_attention_forward(q, k, v, scale=128**-0.5, seq_lens=lens, decode_from=prompts, kv_split=False)
    start = 0
    for n, p in zip(lens, prompts):
        s = slice(start, start + n)
        alone = vllm_cpu_attention_forward(q[s], k[s], v[s], scale=128**-0.5, seq_lens=[n], decode_from=[p],
                                           kv_split=False)
        assert torch.equal(together[s], alone), (n, p)
        start += n
    horizon = prefill_batch_invariant_tokens(128, 4, 2, limit=1024)
    if horizon is not None and horizon < 700:  # here one call for all would have given other bits
        one_call = vllm_cpu_attention_forward(q, k, v, scale=128**-0.5, seq_lens=lens, decode_from=prompts,
                                              kv_split=False, prefill_alone=False)
        assert not torch.equal(one_call, together)
