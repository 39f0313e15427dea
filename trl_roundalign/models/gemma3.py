"""Gemma 3 (`Gemma3ForCausalLM`, text; `model_type="gemma3_text"`): sandwich norms, `(1 + w)` RMSNorm, GeGLU-tanh.

vLLM 0.31 runs Gemma 3 natively (`vllm/model_executor/models/gemma3.py`). Read from the C++ Inductor
generated for its one-graph CPU engine (docs/numerics.md, "Gemma 3"), a layer computes, with `s` the
fp32 residual stream:

    normed = r(x̂(s) (1 + w_in))                       input_layernorm (fused add of the previous layer)
    a      = o_proj(attention(q/k-norm + RoPE, ...))
    s      = s + x̂(a) (1 + w_pa)                      post_attention_layernorm, *not rounded*, fp32 add
    normed = r(x̂(s) (1 + w_pf))                       pre_feedforward_layernorm
    m      = down(r(gelu_tanh(g) u))                   GeGLU-tanh, one rounding
    s      = s + x̂(m) (1 + w_pff)                     post_feedforward_layernorm, not rounded, fp32 add

and the stream starts as `f(e) f(r(sqrt(hidden)))`: the embedding times its bf16 scale, not rounded.
transformers rounds every one of those values. vLLM's piecewise engine (graph split at attention, its CUDA
default) computes the same, except that the stream crosses each split as bf16: it is rounded once per layer,
after the input norm read the fp32 sum (`residual="layer"`, as for Llama), and the first layer's input norm
sums the squares of the unrounded embedding product but normalises the product rounded to bf16 (the first
piece stores it for the next one and reloads it). The regions:

- `"rope"`: q/k-norm + RoPE as one region (`ops.gemma_qk_norm_rope`);
- `"swiglu"` (the MLP activation region): GeGLU-tanh (`ops.geglu_tanh`);
- `"rmsnorm"`: the stream above: the embedding, the decoder layers and the final norm;
- `"attention"`: vLLM-CPU's kernel with the layer's window (sequences no longer than the window).

Measured for the one-graph and the piecewise engine (`vllm-compiled[-piecewise][-exact]`; `none` is
transformers); the eager engines were not read for Gemma 3 and are refused. Refused too, as not measured:
attention or final logit soft-capping, RoPE scaling, bidirectional attention.
"""

from __future__ import annotations

import torch

from .. import ops
from .decoder import _as_forward_of, _state, aligned_attention_forward
from .spec import ArchSpec, refuse_unmeasured, register_arch, require_attrs

__all__ = ["GEMMA3", "GEMMA3_LAYER_NORMS", "gemma3_default_lanes"]

GEMMA3_LAYER_NORMS = (
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"
)
GEMMA3_PROFILES = (
    "none", "vllm-compiled", "vllm-compiled-exact", "vllm-compiled-piecewise", "vllm-compiled-piecewise-exact",
)


def gemma3_attention_forward(self, *args, **kwargs):
    """`Gemma3Attention`: the shared aligned attention with the `(1 + w)` q/k-norm + RoPE region and the layer's window."""
    return aligned_attention_forward(self, *args, qk_norm_rope=ops.gemma_qk_norm_rope, **kwargs)


def gemma3_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """`down_proj(geglu_tanh(gate_proj(x), up_proj(x)))`."""
    st = _state(self)
    return self.down_proj(ops.geglu_tanh(self.gate_proj(x), self.up_proj(x), profile=st.profile, backend=st.backend))


def gemma3_embed_forward(self, input_ids: torch.Tensor) -> torch.Tensor:
    """The stream's start: `f(e) f(r(scale))` in fp32 (the engine does not round it); transformers' `r(e r(scale))`
    under a rounding profile."""
    st = _state(self)
    e = torch.nn.Embedding.forward(self, input_ids)
    scale = self.embed_scale.to(self.weight.dtype)
    if st.profile.residual == "round":
        return e * scale
    return e.float() * scale.float()


def _norm(module, x, st, name: str, *, keep_fp32: bool = False, round_numerator: bool = False):
    return _as_forward_of(module, lambda t: ops.gemma_rms_norm(
        t, module.weight, module.eps, profile=st.profile, backend=st.backend,
        reduction_lanes=st.lanes.get(name), keep_fp32=keep_fp32, round_numerator=round_numerator,
    ), x)


def _add(s: torch.Tensor, p: torch.Tensor, st) -> torch.Tensor:
    """The residual add: fp32 in the engine, `r(s + p)` in transformers."""
    if st.profile.residual == "round":
        return (s.float() + p.float()).to(p.dtype) if s.dtype != p.dtype else s + p
    return s.float() + p


def gemma3_decoder_layer_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values=None,
    **kwargs,
) -> torch.Tensor:
    """A Gemma 3 layer carrying the stream as the engine does (module docstring); returns the stream."""
    st = _state(self)
    dtype = self.input_layernorm.weight.dtype
    if position_embeddings is not None and position_embeddings[0].dtype != dtype:
        # The fp32 stream is the rotary module's dtype reference: it returned the fp32 table. transformers with a
        # bf16 stream rounds it, and vLLM stores it in bf16: the same values.
        position_embeddings = tuple(t.to(dtype) for t in position_embeddings)
    keep = st.profile.residual != "round"
    piecewise = st.profile.residual == "layer" and hidden_states.dtype == torch.float32
    s = hidden_states
    # Piecewise engine, first layer: the embedding product is stored in bf16 for the next piece; the norm's kernel
    # sums the squares of the unrounded product but normalises the stored one.
    first = piecewise and self.self_attn.layer_idx == 0
    normed = _norm(self.input_layernorm, s, st, "input_layernorm", round_numerator=first)
    if piecewise:
        # The stream crosses the attention split as bf16 (the input norm read the fp32 sum).
        s = s.to(dtype)
    attn_out, _ = self.self_attn(
        hidden_states=normed,
        position_embeddings=position_embeddings,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        **kwargs,
    )
    s = _add(s, _norm(self.post_attention_layernorm, attn_out, st, "post_attention_layernorm", keep_fp32=keep), st)
    mlp_out = self.mlp(_norm(self.pre_feedforward_layernorm, s, st, "pre_feedforward_layernorm"))
    return _add(s, _norm(self.post_feedforward_layernorm, mlp_out, st, "post_feedforward_layernorm", keep_fp32=keep), st)


def gemma3_final_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    st = _state(self)
    return ops.gemma_rms_norm(
        hidden_states, self.weight, self.eps, profile=st.profile, backend=st.backend, reduction_lanes=st.lanes.get("norm")
    )


def check_gemma3_config(config) -> None:
    """Raise `ValueError` for what was not measured against the engine (module docstring)."""
    problems = []
    if getattr(config, "attn_logit_softcapping", None) is not None:
        problems.append(f"attn_logit_softcapping={config.attn_logit_softcapping}")
    if getattr(config, "final_logit_softcapping", None) is not None:
        problems.append(f"final_logit_softcapping={config.final_logit_softcapping}")
    if getattr(config, "use_bidirectional_attention", False):
        problems.append("use_bidirectional_attention=True")
    rope = getattr(config, "rope_parameters", None) or {}
    kinds = {p.get("rope_type", "default") for p in rope.values() if isinstance(p, dict)} or {rope.get("rope_type", "default")}
    kinds.discard("default")
    if kinds:
        problems.append(f"rope_type={sorted(kinds)}")
    act = getattr(config, "hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        problems.append(f"hidden_activation={act!r}")
    refuse_unmeasured("gemma3_text", problems, "Gemma 3 text models without soft-capping or RoPE scaling (Gemma 3 1B), "
                      "GeGLU with gelu_pytorch_tanh")


def check_gemma3_structure(backbone: torch.nn.Module, spec: ArchSpec) -> None:
    """Raise `ValueError` naming the first module that lacks what the Gemma 3 forwards read."""

    def need(obj, attrs, path):
        require_attrs(obj, attrs, path, "gemma3_text (transformers 5.17/5.19 Gemma3ForCausalLM)")

    check_gemma3_config(getattr(backbone, "config", None))
    need(backbone, ("embed_tokens", "layers", "norm", "rotary_emb"), "model")
    need(backbone.embed_tokens, ("weight", "embed_scale"), "model.embed_tokens")
    need(backbone.norm, ("weight", "eps"), "model.norm")
    for i, layer in enumerate(backbone.layers):
        p = f"model.layers.{i}"
        need(layer, ("self_attn", "mlp", *GEMMA3_LAYER_NORMS), p)
        need(layer.self_attn, spec.attn_attrs + ("q_norm", "k_norm", "sliding_window"), f"{p}.self_attn")
        for n in ("q_norm", "k_norm"):
            need(getattr(layer.self_attn, n), ("weight", "eps"), f"{p}.self_attn.{n}")
        for n in GEMMA3_LAYER_NORMS:
            need(getattr(layer, n), ("weight", "eps"), f"{p}.{n}")
        need(layer.mlp, spec.mlp_attrs, f"{p}.mlp")


def gemma3_default_lanes(num_layers: int, vector_floats: int) -> list[int]:
    """vLLM-CPU 0.31's reduction lanes for Gemma 3 (read from tiny models' generated code, 2 and 3 layers): two
    vectors for every norm except `pre_feedforward_layernorm`, which Inductor fuses with the fp32 stream's add
    and vectorises over one. Order: input, q, k, post-attention, pre-feedforward, post-feedforward; final."""
    per_layer = [2 * vector_floats] * 4 + [vector_floats, 2 * vector_floats]
    return per_layer * num_layers + [2 * vector_floats]


GEMMA3 = register_arch(
    ArchSpec(
        "gemma3_text",
        qk_norm=True,
        examples="Gemma 3 1B (text; no soft-capping, no RoPE scaling)",
        attn_attrs=("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx"),
        attention_forward=gemma3_attention_forward,
        mlp_forward=gemma3_mlp_forward,
        check_config=check_gemma3_config,
        layer_norms=GEMMA3_LAYER_NORMS,
        layer_forward=gemma3_decoder_layer_forward,
        final_norm_forward=gemma3_final_norm_forward,
        embed_forward=gemma3_embed_forward,
        structure_check=check_gemma3_structure,
        profiles=GEMMA3_PROFILES,
        default_lanes=gemma3_default_lanes,
    )
)
