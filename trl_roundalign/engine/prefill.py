"""Each prompt prefilled on its own: what makes a long prompt's prefill reproducible by the trainer.

vLLM-CPU's attention computes one engine step in one kernel call, and the call's schedule shares the step's work among
the OpenMP threads. Once a prompt is longer than one key tile (a few hundred tokens at head dim 128), how its query
tiles fall into the threads' work items changes its bits, so its prefill depends on the other prompts of its step
(and on the decodes beside it), which the trainer does not know (`trainer.startup_check.prefill_batch_invariant_tokens`
measures where that starts). Two scheduler features add more: a chunked prefill splits a prompt over steps at
boundaries set by the step's shared token budget, and a prefix-cache hit prefills only the uncached tail of a prompt
(the copies of a GRPO prompt after the first), each tiled otherwise than a whole prefill.

An engine built with `PREFILL_ALONE_KEY` true in its `additional_config` (`prefill_alone_options`) runs:

- every request with more than one query token (a prompt) in its own kernel call, with the schedule vLLM's metadata
  builder computes for that request alone; the one-query requests (decode steps) of the step in calls of their own,
  whose bits do not depend on their company while a decoding token's keys stay on one thread
  (`build.keep_decode_keys_on_one_thread`);
- each prefill request cut at the KV cache's block boundaries (`block_pieces`), each piece a request with past keys,
  so that a block's bits depend only on the tokens up to it and where computations started inside it (what a
  prefix-cache hit inherits, and what the recording scheduler notes per block);
- unless its scheduler records each request's schedule (`engine.schedule.RecordingScheduler`, exact mode's; the
  trainer then reproduces chunks, prefix hits and re-prefills from it), no chunked prefill and no prefix caching,
  with a step budget no smaller than the context length, so that every prompt is prefilled whole, in one step.

Each prompt's prefill is then the kernel's prefill of that prompt alone on the engine's threads, which the trainer
computes (`ops.attention.vllm_cpu_attention_forward` calls each prefill alone). The hooks are installed on vLLM-CPU's
attention classes in every process that loads the package's vLLM plugin (`install_prefill_alone`); they act only in
engines whose configuration asks for it, and read it back into `EngineLayout.attention_prefill_alone`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..ops._common import block_pieces, request_groups

__all__ = [
    "PREFILL_ALONE_KEY", "block_pieces", "install_prefill_alone", "model_context_length", "prefill_alone_active", "prefill_alone_engine_kwargs",
    "prefill_alone_options",
    "request_groups",
]

# The key of the engine's `additional_config` that turns it on (per engine; a server takes it with
# `--additional-config '{"roundalign_prefill_alone": true}'`).
PREFILL_ALONE_KEY = "roundalign_prefill_alone"
_HOOK = "_roundalign_prefill_alone"


def prefill_alone_options(max_model_len: int, *, additional_config: dict | None = None,
                          max_num_batched_tokens: int | None = None, recorded: bool = False) -> dict:
    """The `vllm.LLM` options of an engine that prefills each prompt alone: the flag; where its scheduler does not
    record each request's schedule (`recorded`, `engine.schedule.RecordingScheduler`), also prefix caching and chunked
    prefill off and a step budget of at least `max_model_len` tokens (vLLM requires it without chunking), so that every
    prompt is prefilled whole. Where it records it, vLLM's chunking, step budget and prefix caching stand (the trainer
    reproduces them from the record)."""
    options = {"additional_config": {**(additional_config or {}), PREFILL_ALONE_KEY: True}}
    if not recorded:
        options["enable_prefix_caching"] = False
        options["enable_chunked_prefill"] = False
        options["max_num_batched_tokens"] = max(int(max_num_batched_tokens or 0), int(max_model_len))
    return options


def prefill_alone_engine_kwargs(engine_kwargs: dict, max_model_len: int | None, config) -> None:
    """Add `prefill_alone_options` to the options of an engine about to be built (exact mode's colocated engine:
    `vllm_engine_kwargs`), with the hooks installed; chunking stays vLLM's where `engine_kwargs` names the recording
    scheduler (`scheduler_cls`). The context length is `max_model_len`, else the model's (`config`: a transformers
    config, or the checkpoint's path). Options the user set win (the layout then says so)."""
    from .schedule import RECORDING_SCHEDULER

    install_prefill_alone()
    if not max_model_len:
        if isinstance(config, (str, bytes)) or hasattr(config, "__fspath__"):
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(config)
        max_model_len = model_context_length(config)
    options = prefill_alone_options(int(max_model_len), additional_config=engine_kwargs.get("additional_config"),
                                    max_num_batched_tokens=engine_kwargs.get("max_num_batched_tokens"),
                                    recorded=engine_kwargs.get("scheduler_cls") == RECORDING_SCHEDULER)
    engine_kwargs["additional_config"] = options.pop("additional_config")
    budget = options.pop("max_num_batched_tokens", None)
    for key, value in options.items():
        engine_kwargs.setdefault(key, value)
    if budget is not None and engine_kwargs["enable_chunked_prefill"] is False:  # the budget must hold a whole prompt
        engine_kwargs["max_num_batched_tokens"] = budget


def model_context_length(config) -> int:
    """The context length vLLM gives a model when none is set: its config's `max_position_embeddings` (a multimodal
    config's text part)."""
    cfg = getattr(config, "text_config", None) or config
    return int(cfg.max_position_embeddings)


def prefill_alone_active(vllm_config) -> bool:
    """Whether an engine's configuration asks for each prompt's prefill alone."""
    extra = getattr(vllm_config, "additional_config", None)
    return bool(isinstance(extra, dict) and extra.get(PREFILL_ALONE_KEY))


def _piece_metadata(builder, md, i: int, lo: int, hi: int):
    """The metadata of queries `[lo, hi)` of request `i` of a step alone (one piece of its prefill, `block_pieces`): a
    request with past keys whose sequence ends at the piece's end."""
    from vllm import _custom_ops as ops
    from vllm import envs

    first = int(md.query_start_loc[i])
    seq_len = int(md.seq_lens[i]) - (int(md.query_start_loc[i + 1]) - first) + hi
    query_start_loc = torch.tensor([0, hi - lo], dtype=md.query_start_loc.dtype)
    seq_lens = torch.tensor([seq_len], dtype=md.seq_lens.dtype)
    schedule = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=builder.num_heads, num_kv_heads=builder.num_kv_heads, head_dim=builder.head_dim,
        seq_lens=seq_lens, dtype=builder.dtype, query_start_loc=query_start_loc, causal=True,
        sliding_window_size=builder.window_size, isa=builder.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        kv_cache_dtype=builder.kv_cache_dtype,
    )
    sub = dataclasses.replace(
        md, num_actual_tokens=hi - lo, max_query_len=hi - lo, query_start_loc=query_start_loc, max_seq_len=seq_len,
        seq_lens=seq_lens, block_table=md.block_table[i:i + 1], scheduler_metadata=schedule,
    )
    return first + lo, first + hi, sub


def _alone_parts(builder, md, groups):
    """Each group's metadata alone (`_sub_metadata`), a prefill request's in its block pieces (`block_pieces`)."""
    parts = []
    loc, seq_lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
    for a, b in groups:
        n = loc[a + 1] - loc[a]
        if b - a == 1 and n > 1:
            start = seq_lens[a] - n
            parts += [_piece_metadata(builder, md, a, pa - start, pe - start)
                      for pa, pe in block_pieces(start, seq_lens[a], builder.block_size)]
        else:
            parts.append(_sub_metadata(builder, md, a, b))
    return parts


def _sub_metadata(builder, md, a: int, b: int):
    """The metadata of requests `[a, b)` of a step alone: their queries' offsets rebased to 0, their sequence lengths
    and block tables, and the schedule vLLM's builder computes for them alone."""
    from vllm import _custom_ops as ops
    from vllm import envs

    loc = md.query_start_loc[a:b + 1]
    query_start_loc = (loc - loc[0]).to(md.query_start_loc.dtype)
    seq_lens = md.seq_lens[a:b]
    schedule = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=b - a, num_heads=builder.num_heads, num_kv_heads=builder.num_kv_heads, head_dim=builder.head_dim,
        seq_lens=seq_lens, dtype=builder.dtype, query_start_loc=query_start_loc, causal=True,
        sliding_window_size=builder.window_size, isa=builder.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        kv_cache_dtype=builder.kv_cache_dtype,
    )
    tokens = int(loc[-1] - loc[0])
    sub = dataclasses.replace(
        md, num_actual_tokens=tokens, max_query_len=int((query_start_loc[1:] - query_start_loc[:-1]).max()),
        query_start_loc=query_start_loc, max_seq_len=int(seq_lens.max()), seq_lens=seq_lens,
        block_table=md.block_table[a:b], scheduler_metadata=schedule,
    )
    return int(loc[0]), int(loc[0]) + tokens, sub


def install_prefill_alone() -> bool:
    """Hook vLLM-CPU's attention metadata builder and backend (idempotent; False where vLLM-CPU's attention backend
    is not importable). The hooks act only in engines `prefill_alone_active` says asked for it."""
    from .dispatch import is_vllm_cpu

    if not is_vllm_cpu():
        return False
    try:
        from vllm.v1.attention.backends import cpu_attn
    except ImportError:
        return False
    builder_cls, impl_cls = cpu_attn.CPUAttentionMetadataBuilder, cpu_attn.CPUAttentionBackendImpl
    build, forward = builder_cls.build, impl_cls.forward
    if getattr(build, _HOOK, False) and getattr(forward, _HOOK, False):
        return True  # installed already (idempotent)

    @functools.wraps(build)
    def build_alone(self, common_prefix_len, common_attn_metadata, fast_build=False):
        md = build(self, common_prefix_len, common_attn_metadata, fast_build)
        if (
            prefill_alone_active(self.vllm_config)
            and md.causal is True
            and md.dynamic_causal is None
            and not self.is_cross_attention
            and not self.is_encoder_only_attention
        ):
            loc = md.query_start_loc.tolist()
            lens = [e - s for s, e in zip(loc[:-1], loc[1:])]
            groups = request_groups(lens) or [(0, len(lens))]
            if len(groups) > 1 or any(n > 1 for n in lens):
                md._roundalign_alone = _alone_parts(self, md, groups)
        return md

    @functools.wraps(forward)
    def forward_alone(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        parts = getattr(attn_metadata, "_roundalign_alone", None)
        if parts is None or self.attn_type != cpu_attn.AttentionType.DECODER:
            return forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        for start, end, sub in parts:
            forward(self, layer, query[start:end], key[start:end], value[start:end], kv_cache, sub, output[start:end],
                    *args, **kwargs)
        return output

    setattr(build_alone, _HOOK, True)
    setattr(forward_alone, _HOOK, True)
    builder_cls.build = build_alone
    impl_cls.forward = forward_alone
    return True


def prefill_alone_in_worker(vllm_config) -> bool | None:
    """Read in an engine's process: whether its attention prefills each prompt alone (the hooks installed there and
    its configuration asking for it); None off vLLM-CPU."""
    from .dispatch import is_vllm_cpu

    if not is_vllm_cpu():
        return None
    from vllm.v1.attention.backends import cpu_attn

    hooked = getattr(cpu_attn.CPUAttentionMetadataBuilder.build, _HOOK, False) and getattr(
        cpu_attn.CPUAttentionBackendImpl.forward, _HOOK, False)
    return bool(hooked and prefill_alone_active(vllm_config))
