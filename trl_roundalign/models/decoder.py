"""Aligned forwards for Llama-style decoders (Llama, Mistral, Qwen2, Qwen3; Phi-3 through `phi3.py`).

These functions are bound to module *instances* by `trl_roundalign.patching`; they mirror
transformers 5.17's and 5.19's forwards (the same) op for op, except where a region is switched on:

- attention module: `"rope"` rotates q/k with the aligned RoPE (Qwen3: q/k-norm + RoPE as one
  region); `"attention"` computes the attention forward with vLLM-CPU's kernel.
- MLP: `"swiglu"` computes `down(swiglu(gate(x), up(x)))`.
- decoder layer and final norm: `"rmsnorm"` carries the residual stream across layers the way the
  engine does, with aligned norms. A layer returns the fp32 sum after its MLP (the engine fuses that
  add into the next norm); under `residual="fp32"` the sum is never rounded, under
  `residual="round"` and `"layer"` the next layer rounds it for the stream and its norm reads `r(s)`
  or `s` (`"layer"` keeps the post-attention sum in fp32).
- backbone: derives RoPE positions from a 2-D attention mask when no `position_ids` are passed
  (vLLM numbers each sequence's tokens from 0; TRL left-pads prompts and passes no positions).

Nothing here adds, replaces or renames parameters, and every parameter is read inside a call of the
module that owns it (`_as_forward_of`): an RMSNorm whose weight an aligned region reads directly (the
q/k-norm fused into RoPE, the residual add + norm) is still *called*, so module hooks fire around that
read. ZeRO-3 gathers a module's parameters in its forward pre-hook and releases them in its forward hook;
without the call the region would read an ungathered (empty) weight.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch

from .. import ops
from ..profiles import Profile

logger = logging.getLogger(__name__)


@dataclass
class LayerState:
    """Per-module settings stored on a patched module as `_roundalign`."""

    regions: tuple[str, ...]
    profile: Profile
    backend: str | None
    lanes: dict[str, int | None] = field(default_factory=dict)
    originals: dict[str, object] = field(default_factory=dict)
    attention_block_size: int | None = None
    attention_threads: int | None = None  # the engine's kernel threads, where not this process's (a server's)
    gdn_form: object | None = None  # Qwen3.5: the engine's gated delta-net form (`ops.gated_delta_net.GdnForm`)


def _state(module) -> LayerState:
    return module.__dict__["_roundalign"]


def _as_forward_of(module: torch.nn.Module, fn, *args):
    """`fn(*args)` run as `module`'s forward: through `module(...)`, so its pre-hooks and hooks fire around it."""
    previous = module.__dict__.get("forward")
    module.__dict__["forward"] = fn
    try:
        return module(*args)
    finally:
        if previous is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = previous


# ----------------------------------------------------------------------------- attention


def aligned_attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    past_key_values=None,
    qk_norm_rope=ops.qk_norm_rope,
    **kwargs,
):
    """Llama/Qwen2/Qwen3/Mistral (and Gemma 3, with its `qk_norm_rope`) attention with aligned RoPE (and q/k-norm) and
    optional engine attention; a layer's `sliding_window` goes to the attention function."""
    hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    q = self.q_proj(hidden_states).view(hidden_shape)
    k = self.k_proj(hidden_states).view(hidden_shape)
    v = self.v_proj(hidden_states).view(hidden_shape)
    return attend(
        self, q, k, v, position_embeddings, attention_mask, past_key_values,
        sliding_window=getattr(self, "sliding_window", None), qk_norm_rope=qk_norm_rope, **kwargs,
    )


def attend(
    self,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    past_key_values,
    *,
    sliding_window: int | None = None,
    qk_norm_rope=ops.qk_norm_rope,
    output_gate: torch.Tensor | None = None,
    **kwargs,
):
    """The attention forward after the q/k/v projections (`[B, T, heads, head_dim]` each): RoPE (aligned or the
    model's, partial rotary when cos/sin are narrower than the head), the KV cache, attention (the engine's
    kernel under region `"attention"`), `o_proj`. Shared by every family's attention forward; `qk_norm_rope` is the
    fused q/k-norm + RoPE region of families with q/k-norms (Gemma 3 passes its `(1 + w)` form); `output_gate`
    (Qwen3.5's gated attention) multiplies the attention output by its sigmoid before `o_proj`."""
    st = _state(self)
    prof, backend = st.profile, st.backend
    input_shape = q.shape[:-2]
    cos, sin = position_embeddings
    # [B, T, D] -> [B, T, 1, D]: broadcast over heads in the [B, T, H, D] layout.
    cos4, sin4 = cos.unsqueeze(2), sin.unsqueeze(2)
    v = v.transpose(1, 2)
    has_qk_norm = hasattr(self, "q_norm")
    if "rope" in st.regions:
        if has_qk_norm:
            q_norm, k_norm = self.q_norm, self.k_norm
            q = _as_forward_of(q_norm, lambda x: qk_norm_rope(
                x, q_norm.weight, _eps(q_norm), cos4, sin4,
                profile=prof, backend=backend, reduction_lanes=st.lanes.get("q_norm"),
            ), q)
            k = _as_forward_of(k_norm, lambda x: qk_norm_rope(
                x, k_norm.weight, _eps(k_norm), cos4, sin4,
                profile=prof, backend=backend, reduction_lanes=st.lanes.get("k_norm"),
            ), k)
        else:
            q = ops.rope(q, cos4, sin4, profile=prof, backend=backend)
            k = ops.rope(k, cos4, sin4, profile=prof, backend=backend)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    else:
        if has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = ops.rope(q, cos.unsqueeze(1), sin.unsqueeze(1), profile="none")
        k = ops.rope(k, cos.unsqueeze(1), sin.unsqueeze(1), profile="none")

    return attention_core(
        self, q, k, v, attention_mask, past_key_values, input_shape, sliding_window=sliding_window,
        output_gate=output_gate, **kwargs,
    )


def attention_core(
    self,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    past_key_values,
    input_shape,
    *,
    sliding_window: int | None = None,
    output_gate: torch.Tensor | None = None,
    **kwargs,
):
    """The attention forward after RoPE (`q`, `k`, `v` as `[B, heads, T, head_dim]`): the KV cache, attention (the
    engine's kernel under region `"attention"`, full forwards only), the output gate (`x sigmoid(gate)`, one rounding
    under region `"swiglu"`), `o_proj`."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    st = _state(self)
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx)

    extra = {}
    if sliding_window is not None:
        extra["sliding_window"] = sliding_window
    # The engine's kernel scores whole sequences; with earlier tokens in a KV cache (decoding) the
    # model's own attention takes over.
    full_forward = k.shape[-2] == q.shape[-2]
    if "attention" in st.regions and full_forward:
        from ..ops.attention import hf_attention_interface

        attention_interface = hf_attention_interface
        bound = {k: v for k, v in (("block_size", st.attention_block_size), ("num_threads", st.attention_threads))
                 if v is not None}
        if bound:
            attention_interface = functools.partial(hf_attention_interface, **bound)
    else:
        if "attention" in st.regions:
            _warn_cached_decoding(self.config._attn_implementation)
        from transformers.models.llama.modeling_llama import eager_attention_forward

        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
    attn_output, attn_weights = attention_interface(
        self,
        q,
        k,
        v,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **extra,
        **kwargs,
    )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    if output_gate is not None:
        gate_profile = st.profile if "swiglu" in st.regions else "none"
        attn_output = ops.sigmoid_gate(attn_output, output_gate, profile=gate_profile, backend=st.backend)
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights


def _eps(norm: torch.nn.Module) -> float:
    """An RMSNorm module's epsilon (`variance_epsilon` in Llama-style norms, `eps` in Gemma's)."""
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps


_warned_cached_decoding = False


def _warn_cached_decoding(impl: str) -> None:
    global _warned_cached_decoding
    if not _warned_cached_decoding:
        logger.warning(
            "exact-mode attention covers full forwards (scoring and training); decoding with earlier tokens in a KV "
            "cache uses the model's %s attention",
            impl,
        )
        _warned_cached_decoding = True


# ----------------------------------------------------------------------------- MLP


def aligned_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """`down_proj(swiglu(gate_proj(x), up_proj(x)))` with the aligned SwiGLU."""
    st = _state(self)
    return self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x), profile=st.profile, backend=st.backend))


# ----------------------------------------------------------------------------- residual stream


def aligned_decoder_layer_forward(
    self,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values=None,
    use_cache: bool | None = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs,
) -> torch.Tensor:
    """Decoder layer whose residual stream follows the profile.

    `hidden_states` is the residual stream: the bf16 embedding for layer 0, then what the previous
    layer returned (fp32 under `residual="fp32"`). Returns the stream after this layer.
    """
    st = _state(self)
    prof, backend = st.profile, st.backend
    norm_in, norm_post = self.input_layernorm, self.post_attention_layernorm
    # A partitioned (ZeRO-3) weight keeps its dtype: reading `.dtype` outside the norm's call is safe.
    residual, norm_input = _stream(hidden_states, prof, norm_in.weight.dtype)
    normed = _as_forward_of(norm_in, lambda x: ops.rms_norm(
        x, norm_in.weight, norm_in.variance_epsilon,
        profile=prof, backend=backend, reduction_lanes=st.lanes.get("input_layernorm"),
    ), norm_input)
    attn_out, _ = self.self_attn(
        hidden_states=normed,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    attn_out = _sublayer_dropout(self, "resid_attn_dropout", attn_out)
    normed, residual = _as_forward_of(norm_post, lambda a, r: ops.add_rms_norm(
        a, r, norm_post.weight, norm_post.variance_epsilon,
        profile=prof, backend=backend, reduction_lanes=st.lanes.get("post_attention_layernorm"),
    ), attn_out, residual)
    mlp_out = _sublayer_dropout(self, "resid_mlp_dropout", self.mlp(normed))
    # The add after the MLP belongs to the next norm (vLLM fuses it there): hand on the fp32 sum;
    # under residual="round" the next layer rounds it for the stream (see `_stream`).
    return residual.float() + mlp_out.float()


def _sublayer_dropout(layer: torch.nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """Phi-3 drops out each sublayer's output before its residual add (`resid_pdrop`; 0 in released configs,
    and an identity in eval): the model's own dropout module, where the layer has one."""
    drop = getattr(layer, name, None)
    return x if drop is None else drop(x)


def _stream(hidden_states: torch.Tensor, prof: Profile, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`(residual, what the norm reads)` from the stream entering a layer or the final norm.

    The stream is the bf16 embedding (layer 0) or the fp32 sum `s` the previous layer returned.
    Under `residual="fp32"` both are `s`; under `residual="round"` the residual is `r(s)` and the
    norm reads `r(s)` or `s` (`profile.norm_reads`); under `residual="layer"` (piecewise engine: the
    stream crosses the attention split as bf16) the residual is `r(s)` and the norm reads `s`.
    """
    if hidden_states.dtype != torch.float32 or prof.residual == "fp32":
        return hidden_states, hidden_states
    rounded = hidden_states.to(dtype)
    return rounded, (hidden_states if prof.norm_reads == "sum" else rounded)


def aligned_final_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Final RMSNorm reading the residual stream (the fp32 sum the last layer returned)."""
    st = _state(self)
    _, norm_input = _stream(hidden_states, st.profile, self.weight.dtype)
    return ops.rms_norm(
        norm_input, self.weight, self.variance_epsilon,
        profile=st.profile, backend=st.backend, reduction_lanes=st.lanes.get("norm"),
    )


# ----------------------------------------------------------------------------- positions


def positions_from_mask(attention_mask: torch.Tensor) -> torch.LongTensor:
    """vLLM's positions: each row's real tokens numbered from 0 (left padding skipped)."""
    mask = attention_mask.to(torch.long)
    return (mask.cumsum(-1) - 1).clamp(min=0)


def backbone_forward_with_positions(self, *args, **kwargs):
    """Call the backbone's own forward, deriving `position_ids` from a 2-D mask when none are given."""
    cls_forward = type(self).forward
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    cache = kwargs.get("past_key_values", args[3] if len(args) > 3 else None)
    no_cache = cache is None or (hasattr(cache, "get_seq_length") and cache.get_seq_length() == 0)
    if (
        kwargs.get("position_ids") is None
        and len(args) <= 2
        and isinstance(mask, torch.Tensor)
        and mask.dim() == 2
        and no_cache
        and not bool(mask.all())
    ):
        kwargs["position_ids"] = positions_from_mask(mask)
    return cls_forward(self, *args, **kwargs)
