"""Engine tensor parallelism on the trainer side: the row-parallel linears computed as a TP=k vLLM-CPU engine does.

A vLLM engine with `tensor_parallel_size=k` shards every linear. Column-parallel ones (`q/k/v_proj`, `gate/up_proj`,
the vocab-parallel `lm_head`) split the output columns: each output is still one GEMM over the whole inner dimension,
and measured on the Intel AMX machine they give the trainer's bits (docs/numerics.md, "Tensor parallelism").
Row-parallel ones (`o_proj`, `down_proj`) split the inner dimension K: rank r computes the bf16 partial product
`r(x_r W_r^T)` over its contiguous slice of K (bias on rank 0 only), and the partials are all-reduced. vLLM-CPU's
shared-memory all-reduce (`torch.ops._C.shm_allreduce`, csrc/cpu/shm.cpp) converts its own partial to fp32, adds the
other ranks' in fp32 (rank-rotated order) and rounds once to bf16:

    out = r(fp32(r(x_0 W_0^T)) + fp32(r(x_1 W_1^T)))        (k = 2: fp32 addition of two terms has no order)

`row_parallel_linear` computes exactly that, each partial with the engine's GEMM (`gemm.linear`, its row blocks);
`install_tp_linears(model, k)` makes a model's row-parallel layers use it. The backward is the ordinary GEMM
gradient (the gradient is not part of the bitwise claim). Measured: k = 2 on vLLM-CPU's one-graph compiled engine
with the shared-memory all-reduce; `tp_refusal` names what differs in every other layout
(`engine.profile_for_engine` refuses it in one line).
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "MEASURED_TP",
    "ROW_PARALLEL",
        "install_tp_linears",
    "remove_tp_linears",
    "row_parallel_linear",
    "tp_refusal",
]

# The row-parallel projections of the families measured at TP=2 (Qwen3, Llama: the decoder layer vLLM runs with
# `RowParallelLinear` for these two).
ROW_PARALLEL = {"qwen3": ("o_proj", "down_proj"), "llama": ("o_proj", "down_proj")}
MEASURED_TP = (1, 2)
_MARK = "_roundalign_tp"


class _RowParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, tp, rows):
        from .gemm import linear

        k = weight.shape[1] // tp
        acc = None
        for r in range(tp):
            part = linear(x[..., r * k : (r + 1) * k].contiguous(), weight[:, r * k : (r + 1) * k], bias if r == 0 else None, rows)
            acc = part.float() if acc is None else acc + part.float()
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return acc.to(weight.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = g2.mm(weight).reshape(x.shape) if ctx.needs_input_grad[0] else None
        grad_w = g2.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None


def row_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: int, rows: int | None = None
) -> torch.Tensor:
    """`x @ weight.T + bias` as a TP=`tp` engine's row-parallel layer computes it: `tp` bf16 partial products over
    contiguous K slices (bias in the first), summed in fp32 and rounded once. `rows`: the GEMM's row blocks
    (`trl_roundalign.gemm`; None: this process's setting)."""
    if weight.shape[1] % tp:
        raise ValueError(f"the inner dimension {weight.shape[1]} does not split into {tp} equal shards")
    if tp == 1:
        from .gemm import linear

        return linear(x, weight, bias, rows)
    return _RowParallel.apply(x, weight, bias, tp, rows)


def _tp_forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    tp, rows = module.__dict__[_MARK]
    return row_parallel_linear(x, module.weight, module.bias, tp, rows)


def install_tp_linears(model: torch.nn.Module, tp: int, rows: int | None = None) -> int:
    """Make the row-parallel linears of `model` (`ROW_PARALLEL` for its family) compute as a TP=`tp` engine's do.

    Installs an instance `forward` (no parameter is added or replaced: TRL's weight sync and the optimizer keep
    their references; the live weight is sliced at every call). `rows` is the engine's GEMM row-block size (None:
    this process's `gemm.block_rows()` at each call). Call it after `gemm.install_row_blocked_linears`, whose
    forward it replaces on these layers. Returns the number of layers; `tp=1` removes the form.

    Raises:
        ValueError: a family or TP size not measured, or a layer whose inner dimension does not split evenly.
    """
    if tp == 1:
        return remove_tp_linears(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ROW_PARALLEL or tp not in MEASURED_TP:
        raise ValueError(
            f"TP alignment is measured for {sorted(ROW_PARALLEL)} at tensor_parallel_size in {MEASURED_TP}; "
            f"got model_type={model_type!r}, tp={tp}."
        )
    n = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in ROW_PARALLEL[model_type]:
            if module.in_features % tp:
                raise ValueError(f"{name}: inner dimension {module.in_features} does not split into {tp} shards")
            module.__dict__[_MARK] = (tp, rows)
            module.forward = functools.partial(_tp_forward, module)
            n += 1
    if not n:
        raise ValueError(f"no row-parallel layer ({', '.join(ROW_PARALLEL[model_type])}) found in this model")
    return n


def remove_tp_linears(model: torch.nn.Module) -> int:
    """Undo `install_tp_linears` (the layers get back the row-block forward where one is installed)."""
    from .gemm import _MARK as ROWS_MARK
    from .gemm import _blocked_forward

    n = 0
    for module in model.modules():
        if _MARK in module.__dict__:
            del module.__dict__[_MARK]
            module.__dict__.pop("forward", None)
            if ROWS_MARK in module.__dict__:
                module.forward = functools.partial(_blocked_forward, module)
            n += 1
    return n


def tp_refusal(info, *, aligned: bool, library: str | None) -> str | None:
    """Why an engine's TP layout is one the trainer does not reproduce (None: it does), for
    `engine.profile_for_engine` to refuse in one line.

    TP=1 passes. TP=2 passes only where measured bit for bit (exact mode with `install_tp_linears` against the
    engine's prefill; docs/numerics.md, "Tensor parallelism"): vLLM-CPU compiled as one graph, its AVX-512 kernel
    library (`library == "_C"`: the shared-memory all-reduce), and only when the caller computes the TP form
    (`aligned`).
    """
    tp = int(getattr(info, "tensor_parallel_size", 1) or 1)
    if tp == 1:
        return None
    if not aligned:
        return "the trainer's unsharded matmul does not sum the shards' partial products (trl_roundalign.tp aligns TP=2)"
    if tp not in MEASURED_TP:
        return f"measured: {', '.join(map(str, MEASURED_TP))}"
    if info.platform != "cpu":
        return f"on {info.platform} the all-reduce's arithmetic depends on its transport (measured: vLLM-CPU)"
    if not info.compiled or info.compile_mode != "DYNAMO_TRACE_ONCE":
        return "measured: vLLM-CPU's one-graph compiled engine"
    if library != "_C":
        return f"vLLM-CPU's {library} kernel library (measured: _C, its shared-memory all-reduce)"
    return None
