"""Gemma 4 text (`Gemma4ForCausalLM`, `model_type="gemma4_text"`), dense: sandwich norms of `x̂ w`, q/k/v-norms,
GeGLU-tanh, per-layer inputs (PLE), a per-layer scalar.

vLLM 0.32 runs it natively (`vllm/model_executor/models/gemma4.py`). Read from the C++ Inductor generated for its
one-graph CPU engine (docs/numerics.md, "Gemma 4"), with `r` rounding to bf16 and `h` the value a layer receives
(fp32, unrounded; the engine also stores `r(h)`):

    normed = r(f(r(h)) rstd(h) w_in)                 input norm: statistic of h, numerator of the stored r(h)
    a      = o_proj(attention(r(rotate(q̂ w_q)), r(rotate(k̂ w_k)), r(v̂)))
    s      = f(r(h)) + x̂(a) w_pa                     post-attention norm not rounded, fp32 add
    m      = down(r(gelu_tanh(g) u))                 GeGLU-tanh, one rounding
    t      = r(s + x̂(m) w_pff)                       stored: the per-layer-input gate reads it
    p      = r(gelu_tanh(gate(t)) f(ple_i))          the per-layer input's GeGLU, one rounding
    h'     = (f(t) + x̂(proj(p)) w_ple) f(ls)         not rounded; the next norm's statistic reads it

The stream starts as the embedding product `f(e) f(r(sqrt(hidden)))`, unrounded (the first input norm's statistic
reads it, the rest reads its bf16 store); where Inductor recomputes that product instead of storing it (5 of the
6 engines read whose linears are opaque row-floor ops, `engine.gemm`; none with plain GEMMs; the exact profile reads
which from the engine's code, `engine.lanes.EngineLanes`): layer 0's input norm and residual read it
unrounded, and the post-attention sum `s` is stored instead (`r(s)` feeds the pre-feedforward norm's numerator and
the next add). The final norm reads the last layer's unrounded `h'`. The per-layer inputs
are `r(((f(P) f(r(hidden^-1/2))) x̂ w + f(E)) f(r(2^-1/2)))` (`ops.gemma4_per_layer_inputs`). transformers rounds
every one of those values, multiplies by Python-float scales and computes the statistic with `pow(., -0.5)`.

Regions: `"rope"` the q/k-norm + RoPE and the v-norm; `"swiglu"` the MLP's GeGLU-tanh and the per-layer input's;
`"rmsnorm"` the stream above (embedding, layers, per-layer inputs, final norm); `"attention"` vLLM-CPU's kernel with
the layer's window. Measured for the one-graph engine (`vllm-compiled[-exact]`; `none` is transformers).
Refused, not measured: the piecewise and eager engines, MoE layers (26B-A4B), KV-shared layers, `attention_k_eq_v`,
final logit soft-capping, bidirectional attention, an activation other than `gelu_pytorch_tanh`.
"""

from __future__ import annotations

import types

import torch

from .. import ops
from ..ops.linear import module_schedule
from .decoder import _as_forward_of, _state, attention_core
from .gemma3 import gemma3_embed_forward, gemma3_mlp_forward
from .spec import ArchSpec, register_arch, require_attrs

__all__ = ["GEMMA4", "GEMMA4_LAYER_NORMS", "gemma4_default_lanes", "gemma4_norm_order"]

GEMMA4_LAYER_NORMS = (
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
    "post_per_layer_input_norm",
)
GEMMA4_PROFILES = ("none", "vllm-compiled", "vllm-compiled-exact")


def _engine_rope(st) -> bool:
    return "rope" in st.regions and st.profile.qk_norm == "fp32-fused"


def gemma4_attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    shared_kv_states=None,
    past_key_values=None,
    **kwargs,
):
    """`Gemma4TextAttention` (layers with their own K/V): q/k-norm + RoPE and the v-norm as the engine computes them
    under region `"rope"`, the engine's kernel under `"attention"`."""
    from transformers.models.gemma4.modeling_gemma4 import apply_rotary_pos_emb

    st = _state(self)
    prof = st.profile
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    cos, sin = position_embeddings
    q = self.q_proj(hidden_states).view(hidden_shape)
    k = self.k_proj(hidden_states).view(hidden_shape)
    v = self.v_proj(hidden_states).view(hidden_shape)
    if _engine_rope(st):
        cos4, sin4 = cos.unsqueeze(2), sin.unsqueeze(2)

        def qk(norm, x, name):
            return _as_forward_of(norm, lambda t: ops.gemma4_qk_norm_rope(
                t, norm.weight, norm.eps, cos4, sin4, profile=prof, backend=st.backend, reduction_lanes=st.lanes.get(name),
            ), x)

        q, k = qk(self.q_norm, q, "q_norm"), qk(self.k_norm, k, "k_norm")
        v = _as_forward_of(self.v_norm, lambda t: ops.gemma4_rms_norm(
            t, None, self.v_norm.eps, profile=prof, backend=st.backend, reduction_lanes=st.lanes.get("v_norm"),
        ), v)
    else:
        q = apply_rotary_pos_emb(self.q_norm(q), cos, sin, unsqueeze_dim=2)
        k = apply_rotary_pos_emb(self.k_norm(k), cos, sin, unsqueeze_dim=2)
        v = self.v_norm(v)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if self.store_full_length_kv and shared_kv_states is not None:
        # transformers keeps the last K/V of each layer type for KV-shared layers (refused here; kept for parity).
        shared_kv_states[self.layer_type] = k, v
    return attention_core(
        self, q, k, v, attention_mask, past_key_values, input_shape, sliding_window=self.sliding_window, **kwargs
    )


def _norm(module, x, st, name: str, *, keep_fp32: bool = False, round_numerator: bool = False):
    return _as_forward_of(module, lambda t: ops.gemma4_rms_norm(
        t, module.weight, module.eps, profile=st.profile, backend=st.backend, reduction_lanes=st.lanes.get(name),
        keep_fp32=keep_fp32, round_numerator=round_numerator,
    ), x)


def _ple_gate(self, t: torch.Tensor, per_layer_input: torch.Tensor, st) -> torch.Tensor:
    """`gelu_tanh(gate(t)) * per_layer_input`: the engine's one rounding under `"swiglu"`, transformers' two else."""
    gate = self.per_layer_input_gate(t)
    if "swiglu" in st.regions and st.profile.swiglu != "hf":
        return ops.geglu_tanh(gate, per_layer_input, profile=st.profile, backend=st.backend)
    return self.act_fn(gate) * per_layer_input


def gemma4_decoder_layer_forward(
    self,
    hidden_states: torch.Tensor,
    per_layer_input: torch.Tensor = None,
    shared_kv_states=None,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values=None,
    **kwargs,
) -> torch.Tensor:
    """A Gemma 4 layer: the engine's stream under `"rmsnorm"` (module docstring; returns the unrounded fp32 `h'`),
    transformers' op for op otherwise (with the engine's per-layer-input GeGLU under `"swiglu"`)."""
    st = _state(self)
    dtype = self.input_layernorm.weight.dtype
    if position_embeddings is not None and position_embeddings[0].dtype != dtype:
        # The fp32 stream is the rotary module's dtype reference; transformers and vLLM both use the bf16 table.
        position_embeddings = tuple(t.to(dtype) for t in position_embeddings)
    attn_kwargs = dict(position_embeddings=position_embeddings, attention_mask=attention_mask,
                       shared_kv_states=shared_kv_states, position_ids=position_ids, past_key_values=past_key_values,
                       **kwargs)
    if not ("rmsnorm" in st.regions and st.profile.residual != "round"):
        residual = hidden_states
        a, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **attn_kwargs)
        hidden_states = residual + self.post_attention_layernorm(a)
        residual = hidden_states
        m = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        hidden_states = residual + self.post_feedforward_layernorm(m)
        residual = hidden_states
        p = self.per_layer_projection(_ple_gate(self, hidden_states, per_layer_input, st))
        hidden_states = residual + self.post_per_layer_input_norm(p)
        hidden_states *= self.layer_scalar
        return hidden_states

    h = hidden_states
    unrounded = h.dtype == torch.float32
    # Layer 0: where Inductor recomputes the embedding product instead of storing it, the first norm and the residual
    # read it unrounded, and it stores the post-attention sum instead (the pre-feedforward norm normalises that store).
    # Read from the engine's code with the lanes (two embedding kernels: `engine.lanes.EngineLanes`) where given (any
    # profile against a compiled vLLM-CPU engine: `ArchSpec.engine_code_facts`); without an engine, from the schedule of
    # this layer's linears: Inductor recomputed it in 5 of the 6 row-floor engines read and in none of the plain ones
    # (docs/numerics.md, "Gemma 4").
    opaque = False
    if unrounded and self.self_attn.layer_idx == 0:
        read = st.originals.get("engine_embedding_kernels")
        opaque = read >= 2 if read is not None else not module_schedule(self.self_attn.q_proj).plain
    stored = h.to(dtype) if unrounded else h
    normed = _norm(self.input_layernorm, h, st, "input_layernorm", round_numerator=unrounded and not opaque)
    a, _ = self.self_attn(hidden_states=normed, **attn_kwargs)
    s = (h if opaque else stored.float()) + _norm(
        self.post_attention_layernorm, a, st, "post_attention_layernorm", keep_fp32=True)
    m = self.mlp(_norm(self.pre_feedforward_layernorm, s, st, "pre_feedforward_layernorm", round_numerator=opaque))
    if opaque:
        s = s.to(dtype).float()
    s = s + _norm(self.post_feedforward_layernorm, m, st, "post_feedforward_layernorm", keep_fp32=True)
    t = s.to(dtype)
    p = self.per_layer_projection(_ple_gate(self, t, per_layer_input, st))
    s = t.float() + _norm(self.post_per_layer_input_norm, p, st, "post_per_layer_input_norm", keep_fp32=True)
    return s * self.layer_scalar.float()


def gemma4_final_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    st = _state(self)
    return ops.gemma4_rms_norm(
        hidden_states, self.weight, self.eps, profile=st.profile, backend=st.backend, reduction_lanes=st.lanes.get("norm")
    )


def gemma4_project_per_layer_inputs(self, inputs_embeds: torch.Tensor, per_layer_inputs: torch.Tensor | None = None):
    """`Gemma4TextModel.project_per_layer_inputs` as the engine computes it (`ops.gemma4_per_layer_inputs`); the
    embedding arrives as the unrounded fp32 product and the projection reads its bf16 store."""
    norm = self.per_layer_projection_norm
    st = _state(norm)
    x = inputs_embeds.to(norm.weight.dtype)
    proj = self.per_layer_model_projection(x).reshape(
        *x.shape[:-1], self.config.num_hidden_layers, self.hidden_size_per_layer_input
    )
    if per_layer_inputs is None:
        raise ValueError("Gemma 4 alignment needs input_ids (the per-layer embeddings); inputs_embeds alone is not measured.")
    return _as_forward_of(norm, lambda p: ops.gemma4_per_layer_inputs(
        p, per_layer_inputs, norm.weight, norm.eps, hidden_size=self.config.hidden_size, profile=st.profile,
        backend=st.backend, reduction_lanes=st.lanes.get("per_layer_projection_norm"),
    ), proj)


def bind_gemma4_extra(backbone, state, lanes_by_norm, installed) -> list[tuple[str, str]]:
    """Under `"rmsnorm"`: the per-layer-input merge (the backbone's `project_per_layer_inputs`)."""
    norm = backbone.per_layer_projection_norm
    norm.__dict__["_roundalign"] = state({"per_layer_projection_norm": lanes_by_norm.get("per_layer_projection_norm")})
    installed.append(norm)
    backbone.__dict__["project_per_layer_inputs"] = types.MethodType(gemma4_project_per_layer_inputs, backbone)
    backbone.__dict__["_roundalign_attrs"] = ("project_per_layer_inputs",)
    if backbone not in installed:
        installed.append(backbone)
    return [("model.per_layer_projection_norm", "rmsnorm")]


def gemma4_norm_order(num_layers: int, config=None) -> list[str]:
    """The RMSNorms of the one-graph engine's forward, in its kernels' order: per layer the input norm, the q/k/v
    norms, the post-attention, pre- and post-feedforward norms, (after layer 0's: the per-layer-input projection norm)
    and the post-per-layer-input norm; then the final norm."""
    order = []
    for i in range(num_layers):
        p = f"layers.{i}"
        order += [f"{p}.input_layernorm"] + [f"{p}.self_attn.{n}" for n in ("q_norm", "k_norm", "v_norm")]
        order += [f"{p}.{n}" for n in ("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")]
        if i == 0:
            order.append("per_layer_projection_norm")
        order.append(f"{p}.post_per_layer_input_norm")
    return order + ["norm"]


def gemma4_default_lanes(num_layers: int, vector_floats: int) -> list[int]:
    """vLLM-CPU 0.32's reduction lanes for Gemma 4 (read from a 2-layer model at E2B's width, AVX-512): two vectors
    for every norm but the final one, which Inductor fuses with the last layer's unrounded output and vectorises over
    one. Order: `gemma4_norm_order`."""
    return [2 * vector_floats] * (len(gemma4_norm_order(num_layers)) - 1) + [vector_floats]


def check_gemma4_config(config) -> None:
    """Raise `ValueError` for what was not measured against the engine (module docstring), one line."""
    problems = []
    if getattr(config, "enable_moe_block", False) or getattr(config, "num_experts", None):
        problems.append("MoE layers (enable_moe_block/num_experts: the router's pre-scale order and vLLM-CPU's fused "
                        "experts were not read in the compiled engine)")
    if getattr(config, "num_kv_shared_layers", 0):
        problems.append(f"num_kv_shared_layers={config.num_kv_shared_layers} (KV-shared layers not measured)")
    if getattr(config, "attention_k_eq_v", False):
        problems.append("attention_k_eq_v=True (not measured)")
    if getattr(config, "final_logit_softcapping", None) is not None:
        problems.append(f"final_logit_softcapping={config.final_logit_softcapping} (not measured)")
    if getattr(config, "use_bidirectional_attention", None):
        problems.append(f"use_bidirectional_attention={config.use_bidirectional_attention!r}")
    if not getattr(config, "hidden_size_per_layer_input", 0):
        problems.append("no per-layer inputs (hidden_size_per_layer_input=0: not measured)")
    act = getattr(config, "hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        problems.append(f"hidden_activation={act!r}")
    if problems:
        raise ValueError(
            f"This gemma4_text model has {'; '.join(problems)}, so trl_roundalign does not align it. Supported: dense "
            "Gemma 4 text models without KV sharing or soft-capping, GeGLU with gelu_pytorch_tanh."
        )


def check_gemma4_structure(backbone: torch.nn.Module, spec: ArchSpec) -> None:
    """Raise `ValueError` naming the first module that lacks what the Gemma 4 forwards read."""

    def need(obj, attrs, path):
        require_attrs(obj, attrs, path, "gemma4_text (transformers 5.19 Gemma4ForCausalLM)")

    check_gemma4_config(getattr(backbone, "config", None))
    need(backbone, ("embed_tokens", "layers", "norm", "rotary_emb", "hidden_size_per_layer_input"), "model")
    need(backbone.embed_tokens, ("weight", "embed_scale"), "model.embed_tokens")
    need(backbone, ("per_layer_model_projection", "per_layer_projection_norm", "embed_tokens_per_layer"), "model")
    for i, layer in enumerate(backbone.layers):
        p = f"model.layers.{i}"
        need(layer, ("self_attn", "mlp", "layer_scalar", "per_layer_input_gate", "per_layer_projection", "act_fn",
                     *GEMMA4_LAYER_NORMS), p)
        need(layer.self_attn, spec.attn_attrs + ("q_norm", "k_norm", "v_norm", "sliding_window", "store_full_length_kv"),
             f"{p}.self_attn")
        need(layer.mlp, spec.mlp_attrs, f"{p}.mlp")


def gemma4_attention_layouts(cfg) -> list[tuple[int, int, int]]:
    """Gemma 4's attention layouts per layer (`per_layer_config`: the full-attention layers are wider), the distinct
    `(head dim, query heads, key-value heads)` in layer order; [] where the config is not per-layer."""
    heads = int(cfg.num_attention_heads)
    layers = getattr(cfg, "per_layer_config", None) or []
    out: list[tuple[int, int, int]] = []
    for i in range(int(cfg.num_hidden_layers) if layers else 0):
        head_dim, kv_heads = getattr(layers[i], "head_dim", None), getattr(layers[i], "num_key_value_heads", None)
        if head_dim is None or kv_heads is None:  # not per-layer in this config
            return []
        if (layout := (int(head_dim), heads, int(kv_heads))) not in out:
            out.append(layout)
    return out


def gemma4_linear_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Gemma 4's per-layer-input linears, beside the Llama form at each attention layout (`models.linear_shapes`)."""
    h, ple = int(cfg.hidden_size), int(getattr(cfg, "hidden_size_per_layer_input", 0) or 0)
    if not ple:
        return {}
    return {"per_layer_model_projection": (h, int(cfg.num_hidden_layers) * ple), "per_layer_input_gate": (h, ple),
            "per_layer_projection": (ple, h)}


GEMMA4 = register_arch(
    ArchSpec(
        "gemma4_text",
        qk_norm=True,
        examples="Gemma 4 text, dense (E2B/E4B widths without KV sharing; no MoE, no soft-capping)",
        attn_attrs=("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx", "layer_type"),
        attention_forward=gemma4_attention_forward,
        mlp_forward=gemma3_mlp_forward,
        check_config=check_gemma4_config,
        layer_norms=GEMMA4_LAYER_NORMS,
        layer_forward=gemma4_decoder_layer_forward,
        final_norm_forward=gemma4_final_norm_forward,
        embed_forward=gemma3_embed_forward,
        structure_check=check_gemma4_structure,
        profiles=GEMMA4_PROFILES,
        default_lanes=gemma4_default_lanes,
        forward_norm_order=gemma4_norm_order,
        layer_forward_regions=("rmsnorm", "swiglu"),
        bind_extra=bind_gemma4_extra,
        engine_code_facts=True,
        linear_shapes=gemma4_linear_shapes,
        attention_layouts=gemma4_attention_layouts,
    )
)
