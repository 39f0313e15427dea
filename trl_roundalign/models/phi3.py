"""Phi-3 (`Phi3ForCausalLM`: Phi-3/3.5-mini, Phi-3-medium, Phi-4-mini): the Llama math with fused projections.

vLLM 0.31 runs `Phi3ForCausalLM` as its `LlamaForCausalLM` (vllm/model_executor/models/phi3.py only renames
the packed modules): the same compiled graph, so the same profiles and regions. What differs on the Hugging
Face side is module structure, not arithmetic:

- `self_attn.qkv_proj` is one linear whose output is `[q | k | v]`: the aligned attention slices it (as
  transformers' `Phi3Attention` and vLLM's `qkv.split` do) and continues with `decoder.attend`.
- `mlp.gate_up_proj` is one linear whose output is `[gate | up]` and `mlp.activation_fn` is silu:
  `down_proj(swiglu(gate, up))`. transformers writes `up * silu(gate)`; under profile `none` that is
  `r(f(u) f(r(silu g)))`, the same bits as Llama's `r(r(silu g) u)` (a product of two bf16 values
  rounded once does not depend on the order).
- partial rotary (`rope_parameters["partial_rotary_factor"]`, 0.75 in Phi-4-mini): Hugging Face's cos/sin
  are `rotary_dim = int(head_dim * factor)` wide and vLLM's `get_rope` takes the same `rotary_dim`;
  both rotate the first `rotary_dim` dims of each head (neox halves of that part) and pass the rest
  through unchanged. `ops.rope` does the same: the pass-through dims are bf16 values upcast and cast
  back, so they are copied bit for bit in every profile (including the truncating AVX2 one).
- `resid_attn_dropout` / `resid_mlp_dropout` before each residual add: the aligned decoder layer calls
  them (`decoder._sublayer_dropout`); released configs have `resid_pdrop=0`.

LongRoPE (`rope_type="longrope"`: Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini): transformers picks the short or
the long factors per forward from the sequence length (`dynamic_rope_update`), vLLM once per engine from
`max_model_len > original_max_position_embeddings` (`Phi3LongRoPEScaledRotaryEmbedding.use_long_rope`). With
`max_model_len` above the original length (vLLM's default: the model's `max_position_embeddings`) the two rotate with
different frequencies on every sequence within the original length: a difference of positions, not of rounding
(k3 0.61 against 1.2e-4 on a tiny LongRoPE model, docs/results/avx2/longrope_factors.md). The tables themselves
agree: transformers' bf16 cos/sin equal vLLM's for both factor sets, mscale included
(`tests/ops/test_reference_vs_vllm.py`). So under the "rope" region the rotary module holds the engine's factor set
for every sequence (`phi3_engine_rope`): `apply_roundalign(..., engine_max_model_len=...)` says which, and a
LongRoPE model patched with "rope" and no engine length is refused.
"""

from __future__ import annotations

import inspect

import torch

from .. import ops
from .decoder import _state, attend
from .spec import ArchSpec, register_arch

__all__ = ["PHI3", "check_phi3_config", "phi3_attention_forward", "phi3_engine_rope", "phi3_mlp_forward"]


def phi3_attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    past_key_values=None,
    **kwargs,
):
    """`Phi3Attention` with the fused `qkv_proj` sliced into q, k, v, then the shared aligned attention."""
    hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    qkv = self.qkv_proj(hidden_states)
    q_size = self.config.num_attention_heads * self.head_dim
    kv_size = self.num_key_value_heads * self.head_dim
    q = qkv[..., :q_size].view(hidden_shape)
    k = qkv[..., q_size : q_size + kv_size].view(hidden_shape)
    v = qkv[..., q_size + kv_size :].view(hidden_shape)
    return attend(
        self, q, k, v, position_embeddings, attention_mask, past_key_values,
        sliding_window=getattr(self.config, "sliding_window", None), **kwargs,
    )


def phi3_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """`down_proj(swiglu(gate, up))` with `[gate | up] = gate_up_proj(x)`, the aligned SwiGLU."""
    st = _state(self)
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(ops.swiglu(gate, up, profile=st.profile, backend=st.backend))


def check_phi3_config(config) -> None:
    """Raise `ValueError` for what the Phi-3 forwards do not cover: RoPE scaling other than LongRoPE."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "longrope"):
        raise ValueError(
            f"This phi3 model uses rope_type={rope_type!r}; trl_roundalign supports Phi-3 with plain RoPE "
            "(rope_type='default', partial_rotary_factor allowed: Phi-3-mini-4k, Phi-3-medium-4k) and LongRoPE "
            "(rope_type='longrope': Phi-3.5-mini, Phi-4-mini); other scalings were not measured."
        )


def _original_length(config) -> int:
    rope = dict(getattr(config, "rope_parameters", None) or {})
    original = rope.get("original_max_position_embeddings", getattr(config, "original_max_position_embeddings", None))
    if original is None:
        raise ValueError("This LongRoPE phi3 config has no original_max_position_embeddings; its factors are undefined.")
    return int(original)


def phi3_engine_rope(backbone, engine_max_model_len: int | None):
    """Under the "rope" region, LongRoPE's factor set as the engine picks it: `(forward, extras)` for the rotary
    module, or None for plain RoPE (see the module docstring)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = backbone.config
    if dict(getattr(config, "rope_parameters", None) or {}).get("rope_type") != "longrope":
        return None
    original = _original_length(config)
    if engine_max_model_len is None:
        raise ValueError(
            f"This phi3 model uses LongRoPE: vLLM rotates with its long factors when the engine's max_model_len exceeds "
            f"{original} (original_max_position_embeddings), with the short ones otherwise, whatever the sequence "
            "length; transformers picks per sequence. Pass apply_roundalign(..., engine_max_model_len=<the engine's "
            "max_model_len>). RoundAlignGRPOTrainer with a colocated engine and `trl-roundalign analyze` read it from the "
            "engine; with a vLLM server it is not read yet, so LongRoPE models train with the 'rope' region in "
            "colocate mode only."
        )
    factors = "long" if int(engine_max_model_len) > original else "short"
    rotary = backbone.rotary_emb
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["longrope"](
        config, rotary.inv_freq.device, seq_len=original + 1 if factors == "long" else None
    )
    if scaling != rotary.attention_scaling:
        raise ValueError(f"LongRoPE's attention scaling differs between factor sets ({scaling} vs {rotary.attention_scaling}).")
    return phi3_longrope_rotary_forward, {"inv_freq": inv_freq, "factors": factors}


def phi3_longrope_rotary_forward(self, x: torch.Tensor, position_ids: torch.Tensor):
    """transformers' rotary forward with the held factor set: its own computation of cos/sin (the decorators that
    would pick the factors from the sequence length unwrapped), the held `inv_freq` in place for the call."""
    held = _state(self).originals["inv_freq"]
    own = self._buffers["inv_freq"]
    self._buffers["inv_freq"] = held.to(own.device)
    try:
        with torch.no_grad():
            return inspect.unwrap(type(self).forward)(self, x, position_ids)
    finally:
        self._buffers["inv_freq"] = own


PHI3 = register_arch(
    ArchSpec(
        "phi3",
        qk_norm=False,
        examples="Phi-3-mini-4k, Phi-3-medium-4k, Phi-3.5-mini, Phi-4-mini (LongRoPE: the engine's factors held)",
        attn_attrs=("qkv_proj", "o_proj", "head_dim", "scaling", "layer_idx", "num_key_value_heads", "config"),
        mlp_attrs=("gate_up_proj", "down_proj", "activation_fn"),
        act_attr="activation_fn",
        attention_forward=phi3_attention_forward,
        mlp_forward=phi3_mlp_forward,
        check_config=check_phi3_config,
        engine_rope=phi3_engine_rope,
    )
)
