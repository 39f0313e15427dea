"""The engine's side of the probe: its `VllmConfig`, the model's shapes, and vLLM's own module for each
region (instantiated under the engine's config, or taken from a built engine's layer 0).

A vLLM quirk guarded against here: `get_rope` caches `RotaryEmbedding` instances per process, so
modules are instantiated with an empty RoPE cache (`trl_roundalign.engine.build.fresh_rope_cache`).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch

from ...engine import fresh_rope_cache


def engine_config(model: str | os.PathLike, **engine_kwargs):
    """The `VllmConfig` that `trl_roundalign.engine.build.build_llm(model, **engine_kwargs)` would run with.

    Built with `vllm.engine.arg_utils.EngineArgs(...).create_engine_config()` and the same defaults
    as `build_llm` (bf16, seed 0, `max_model_len` 1024, its memory share), without loading weights.
    """
    from vllm.engine.arg_utils import EngineArgs

    from ...engine.dispatch import is_vllm_cpu

    kw = dict(engine_kwargs)
    kw.pop("cache_tag", None)
    kw.pop("weight_sync_fix", None)
    kw.setdefault("dtype", "bfloat16")
    kw.setdefault("gpu_memory_utilization", 0.3 if is_vllm_cpu() else 0.5)
    kw.setdefault("seed", 0)
    kw.setdefault("max_model_len", 1024)
    kw.setdefault("enforce_eager", False)
    return EngineArgs(model=str(model), **kw).create_engine_config()


@dataclass
class Shapes:
    model_type: str
    hidden: int
    intermediate: int
    head_dim: int
    heads: int
    kv_heads: int
    eps: float
    max_position: int
    rope_parameters: dict | None
    qk_norm: bool


def model_shapes(vllm_config) -> Shapes:
    """The region shapes of the engine's model; `ValueError` (naming the supported ones) for an architecture
    trl_roundalign does not patch."""
    from ...models import get_spec

    cfg = vllm_config.model_config.hf_text_config
    model_type = getattr(cfg, "model_type", "")
    get_spec(model_type)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope_parameters = getattr(cfg, "rope_parameters", None)
    if rope_parameters is None and hasattr(cfg, "rope_theta"):
        rope_parameters = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    return Shapes(
        model_type=model_type,
        hidden=cfg.hidden_size,
        intermediate=cfg.intermediate_size,
        head_dim=head_dim,
        heads=heads,
        kv_heads=getattr(cfg, "num_key_value_heads", heads) or heads,
        eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
        max_position=getattr(cfg, "max_position_embeddings", 4096),
        rope_parameters=dict(rope_parameters) if rope_parameters else None,
        qk_norm=model_type.startswith("qwen3"),
    )


def fresh_modules(vllm_config, shapes: Shapes) -> dict[str, torch.nn.Module]:
    """vLLM's modules for each region, instantiated under the engine's config (dispatch decided here)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(vllm_config), fresh_rope_cache(), torch.device(engine_device()):
        mods: dict[str, torch.nn.Module] = {
            "norm": RMSNorm(shapes.hidden, eps=shapes.eps, dtype=torch.bfloat16),
            "act": SiluAndMul(),
            "rope": get_rope(
                shapes.head_dim,
                max_position=shapes.max_position,
                rope_parameters=shapes.rope_parameters,
                dtype=torch.bfloat16,
            ),
        }
        if shapes.qk_norm:
            mods["q_norm"] = RMSNorm(shapes.head_dim, eps=shapes.eps, dtype=torch.bfloat16)
            mods["k_norm"] = RMSNorm(shapes.head_dim, eps=shapes.eps, dtype=torch.bfloat16)
    return mods


def _grab_layer0(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Layer 0's region modules of an engine's model (runs inside the engine's worker)."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    out: dict[str, torch.nn.Module] = {}
    for name, m in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(m, RMSNorm) and leaf == "input_layernorm":
            out.setdefault("norm", m)
        elif isinstance(m, RMSNorm) and leaf in ("q_norm", "k_norm"):
            out.setdefault(leaf, m)
        elif isinstance(m, SiluAndMul):
            out.setdefault("act", m)
        elif isinstance(m, RotaryEmbeddingBase):
            out.setdefault("rope", m)
    return out


def engine_modules(llm) -> dict[str, torch.nn.Module]:
    results = llm.apply_model(_grab_layer0)
    if not results or not isinstance(results[0], dict):
        raise RuntimeError("Could not read the engine's modules (apply_model returned nothing usable).")
    return results[0]


def method_name(module: torch.nn.Module) -> str:
    fn = getattr(module, "_forward_method", None)
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "__wrapped__", None), "__name__", None)
    return name or type(fn).__name__


def with_weight(module: torch.nn.Module, weight: torch.Tensor) -> torch.nn.Module:
    """A copy of a vLLM RMSNorm with `weight` (its dispatch is kept: the bound method follows the copy)."""
    m = copy.deepcopy(module)
    m.weight.data = weight.to(m.weight.device).clone()
    return m


def engine_device() -> torch.device:
    """Where the engine's modules run: the accelerator on CUDA-like platforms, else the CPU."""
    from vllm.platforms import current_platform

    return torch.device("cuda") if current_platform.is_cuda_alike() else torch.device("cpu")
