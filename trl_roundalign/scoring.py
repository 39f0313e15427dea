"""Scoring the same tokens with vLLM and with the (patched) Hugging Face model.

Per-token log-probs come from three places:

- the sampler: log-probs vLLM recorded while generating (what TRL's loss sees as
  `sampling_per_token_logps`);
- vLLM prefill: `prompt_logprobs` of the whole sequence (what the training side can match);
- the training forward: the Hugging Face model under a region set and profile.

All are fp32 log-probs of the realised next token, aligned so that entry `t` scores token `t + 1`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "Sample",
    "generate_samples",
    "hf_logprobs",
    "vllm_prefill_logprobs",
]


@dataclass
class Sample:
    """One generated sequence: prompt and completion token ids, and the sampler's log-probs."""

    prompt_ids: list[int]
    completion_ids: list[int]
    sampler_logprobs: list[float] = field(default_factory=list)
    prompt_index: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    @property
    def completion_slice(self) -> slice:
        """Positions (in next-token log-prob arrays) that score completion tokens."""
        start = len(self.prompt_ids) - 1
        return slice(start, start + len(self.completion_ids))


def generate_samples(
    llm,
    prompts: Sequence[Sequence[int] | str],
    *,
    n: int = 1,
    max_tokens: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
) -> list[Sample]:
    """Generate `n` completions per prompt with vLLM, recording the sampler's log-probs.

    Prompts are token id lists or strings (tokenised by the engine without special tokens added).
    """
    from vllm import SamplingParams, TokensPrompt

    tok = llm.get_tokenizer()
    inputs = []
    for p in prompts:
        ids = tok.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p)
        if not ids:
            raise ValueError("An empty prompt cannot be scored: every prompt needs at least one token.")
        inputs.append(TokensPrompt(prompt_token_ids=ids))
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, seed=seed, logprobs=0)
    outs = llm.generate(inputs, params, use_tqdm=False)
    samples = []
    for i, out in enumerate(outs):
        for comp in out.outputs:
            ids = list(comp.token_ids)
            lps = [float(d[t].logprob) for t, d in zip(ids, comp.logprobs)] if comp.logprobs else []
            samples.append(Sample(list(out.prompt_token_ids), ids, lps, prompt_index=i))
    return samples


def vllm_prefill_logprobs(llm, sequences: Sequence[Sequence[int]], *, one_at_a_time: bool = False) -> list[torch.Tensor]:
    """vLLM's prompt log-probs of each whole sequence: entry `t` is `log p(token[t+1] | token[:t+1])`.

    Args:
        llm: a `vllm.LLM`.
        sequences: token id lists (at least 2 tokens each).
        one_at_a_time: score each sequence in its own call (the batched-vs-single floor).
    """
    from vllm import SamplingParams, TokensPrompt

    # The one token each request must generate is drawn from its own seeded generator: an unseeded request would
    # draw it from the engine's sampling stream (a colocated engine's is the process's torch RNG) and shift every
    # sample after it. The prompt log-probs do not depend on it.
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=list(s)) for s in sequences]
    if one_at_a_time:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    result = []
    for seq, out in zip(sequences, outs):
        plp = out.prompt_logprobs
        vals = [float(plp[t][seq[t]].logprob) for t in range(1, len(seq))]
        result.append(torch.tensor(vals, dtype=torch.float32))
    return result


@torch.no_grad()
def hf_logprobs(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    *,
    batch_size: int = 1,
    pad_token_id: int = 0,
) -> list[torch.Tensor]:
    """The training forward's log-probs of each sequence (same layout as `vllm_prefill_logprobs`).

    Logits are upcast to fp32 and log-softmaxed in fp32, as vLLM's sampler does. With
    `batch_size > 1` sequences are right-padded (padding never changes the real tokens' values
    under causal attention, but it can change the kernels' blocking: the default scores one at a time).
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    result: list[torch.Tensor] = []
    try:
        for b in range(0, len(sequences), batch_size):
            chunk = [list(s) for s in sequences[b : b + batch_size]]
            width = max(len(s) for s in chunk)
            ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, s in enumerate(chunk):
                ids[i, : len(s)] = torch.tensor(s)
                mask[i, : len(s)] = 1
            kwargs = {"attention_mask": mask.to(device)} if len(chunk) > 1 else {}
            logits = model(input_ids=ids.to(device), use_cache=False, **kwargs).logits
            logp = torch.log_softmax(logits.float(), dim=-1)
            for i, s in enumerate(chunk):
                tgt = torch.tensor(s[1:], device=device)
                result.append(logp[i, : len(s) - 1].gather(-1, tgt[:, None])[:, 0].cpu())
    finally:
        model.train(was_training)
    return result
