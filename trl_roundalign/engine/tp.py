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

CUDA (read from vLLM 0.31's sources, not run; docs/numerics.md, "Tensor parallelism on CUDA"): which kernel sums a
row-parallel layer's partials depends on the GPU, FlashInfer, environment flags, the compile passes and the message
size. `cuda_all_reduce_transport` reads that choice from a layout (`read_cuda_all_reduce` takes it from a built
engine): only vLLM's custom all-reduce at TP=2, one stage, is a fixed fp32 sum with one rounding (the form computed
here, and by the Triton kernel `trl_roundalign.ops.triton.row_parallel`); every other transport is refused with its
reason, and an accepted CUDA layout carries the claim `CUDA_TP_CLAIM`, never "measured".
"""

from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "CUDA_TP_CLAIM",
    "MEASURED_TP",
    "ROW_PARALLEL",
    "colocated_all_reduce",
    "cpu_threads_bind",
    "cuda_all_reduce_transport",
    "install_tp_linears",
    "linear_grads",
    "read_cuda_all_reduce",
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
    def forward(ctx, x, weight, bias, tp, rows, min_rows):
        from .gemm import linear

        k = weight.shape[1] // tp
        # The engine's rule for bf16/fp16 partials: summed in fp32. fp32 and fp64 stay in their own precision (fp64:
        # gradcheck and fp64 references must see the fp64 product, not one rounded through fp32).
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)
        acc = None
        for r in range(tp):
            part = linear(x[..., r * k : (r + 1) * k].contiguous(), weight[:, r * k : (r + 1) * k], bias if r == 0 else None, rows,
                          min_rows)
            acc = part.to(acc_dtype) if acc is None else acc + part.to(acc_dtype)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return acc.to(weight.dtype)

    @staticmethod
    def backward(ctx, grad):
        return (*linear_grads(ctx, grad), None, None, None)


def linear_grads(ctx, grad):
    """The ordinary GEMM gradient of a linear `y = x W^T (+ b)` (x, W saved; `ctx.has_bias`): the backward of every
    TP form (the sharded sum is the same product, so its gradient is `F.linear`'s)."""
    x, weight = ctx.saved_tensors
    g2 = grad.reshape(-1, grad.shape[-1])
    grad_x = g2.mm(weight).reshape(x.shape) if ctx.needs_input_grad[0] else None
    grad_w = g2.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
    grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_x, grad_w, grad_b


def row_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: int, rows: int = 0, min_rows: int = 0
) -> torch.Tensor:
    """`x @ weight.T + bias` as a TP=`tp` engine's row-parallel layer computes it: `tp` bf16 partial products over
    contiguous K slices (bias in the first), summed in fp32 and rounded once. `rows`, `min_rows`: the GEMM's schedule
    (`trl_roundalign.engine.gemm.GemmSchedule`; 0: plain `F.linear`)."""
    if weight.shape[1] % tp:
        raise ValueError(f"the inner dimension {weight.shape[1]} does not split into {tp} equal shards")
    if tp == 1:
        from .gemm import linear

        return linear(x, weight, bias, rows, min_rows)
    return _RowParallel.apply(x, weight, bias, tp, rows, min_rows)


def _tp_forward(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    tp, rows, min_rows = module.__dict__[_MARK]
    return row_parallel_linear(x, module.weight, module.bias, tp, rows, min_rows)


def install_tp_linears(model: torch.nn.Module, tp: int, rows: int = 0, min_rows: int = 0) -> int:
    """Make the row-parallel linears of `model` (`ROW_PARALLEL` for its family) compute as a TP=`tp` engine's do.

    Installs an instance `forward` (no parameter is added or replaced: TRL's weight sync and the optimizer keep
    their references; the live weight is sliced at every call). `rows`, `min_rows` are the engine's GEMM schedule (its
    layout's `gemm_block_rows` and `gemm_min_rows`; 0: plain `F.linear`). Call it after `gemm.install_row_blocked_linears`, whose
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
    wrapped = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                      if name.rsplit(".", 1)[-1] in ROW_PARALLEL[model_type] and not isinstance(module, torch.nn.Linear)})
    if wrapped:
        raise ValueError(tp_lora_refusal(wrapped, tp))
    n = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in ROW_PARALLEL[model_type]:
            if module.in_features % tp:
                raise ValueError(f"{name}: inner dimension {module.in_features} does not split into {tp} shards")
            module.__dict__[_MARK] = (tp, rows, min_rows)
            module.forward = functools.partial(_tp_forward, module)
            n += 1
    if not n:
        raise ValueError(f"no row-parallel layer ({', '.join(ROW_PARALLEL[model_type])}) found in this model")
    return n


def tp_lora_refusal(layers, tp: int) -> str:
    """The one line that refuses LoRA on a row-parallel layer at TP > 1: a PEFT-wrapped layer (`o_proj` becomes a LoRA
    module around `o_proj.base_layer`) is not computed as the engine's ranks sum it, so the policy would silently
    leave it unsharded."""
    return (
        f"LoRA targets the row-parallel layer(s) {', '.join(layers)}, which a tensor_parallel_size={tp} engine sums "
        "across its ranks: the PEFT-wrapped layers' sums are not reproduced. Leave them out of target_modules (e.g. "
        "target_modules=['q_proj', 'k_proj', 'v_proj', 'gate_proj', 'up_proj']) or run the engine at TP=1."
    )


def lora_targets_row_parallel(peft_config, model_type: str | None) -> list[str]:
    """The row-parallel layers (`ROW_PARALLEL`) a PEFT config's `target_modules` reach ("all-linear" reaches them all)."""
    targets = getattr(peft_config, "target_modules", None)
    layers = ROW_PARALLEL.get(model_type or "", ("o_proj", "down_proj"))
    if targets is None:
        return []
    if isinstance(targets, str):
        import re

        return list(layers) if targets == "all-linear" else [n for n in layers if re.fullmatch(targets, n) or re.search(targets, n)]
    return [n for n in layers if n in set(targets)]


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

    CUDA TP=2 passes only where the layout the engine was read with (`info.cuda_all_reduce`, from
    `read_cuda_all_reduce`) sends every row-parallel all-reduce to vLLM's one-stage custom all-reduce
    (`cuda_all_reduce_transport`); that acceptance is read from sources, not run (`CUDA_TP_CLAIM`, logged).
    """
    tp = int(getattr(info, "tensor_parallel_size", 1) or 1)
    if tp == 1:
        return None
    if not aligned:
        return "the trainer's unsharded matmul does not sum the shards' partial products (trl_roundalign.engine.tp aligns TP=2)"
    if tp not in MEASURED_TP:
        return f"measured: {', '.join(map(str, MEASURED_TP))}"
    if info.platform == "cuda":
        return _cuda_refusal(info)
    if info.platform != "cpu":
        return f"on {info.platform} the all-reduce's arithmetic depends on its transport (measured: vLLM-CPU)"
    if not info.compiled or info.compile_mode != "DYNAMO_TRACE_ONCE":
        return "measured: vLLM-CPU's one-graph compiled engine"
    if library != "_C":
        return f"vLLM-CPU's {library} kernel library (measured: _C, its shared-memory all-reduce)"
    return None


# --------------------------------------------------------------------------------------------------
# CUDA: the all-reduce transports of vLLM 0.31, read from its sources (no GPU has run them).
#
# vllm/distributed/device_communicators/cuda_communicator.py `CudaCommunicator.all_reduce` tries, in this order:
# FlashInfer's all-reduce (`allreduce_fusion`, pattern kAllReduce; on by default: VLLM_ALLREDUCE_USE_FLASHINFER=1,
# where FlashInfer is installed and the GPU is SM90/SM100-family), NCCL symmetric memory (VLLM_USE_NCCL_SYMM_MEM,
# TP >= 4), quick all-reduce (ROCm), FlashInfer PCIe IPC (opt-in), AITER (ROCm), vLLM's custom all-reduce
# (message < max_size), torch symmetric memory (VLLM_ALLREDUCE_USE_SYMM_MEM=1, SM90/SM100 family), then NCCL.
# csrc/custom_all_reduce.cuh: `cross_device_reduce_1stage` upcasts each rank's bf16 partial to fp32, adds them in
# rank order 0..k-1 on every rank ("we don't reorder the address so the accumulation order is the same for all
# ranks") and rounds once; TP=2 always takes it, TP 4-8 only below 512 / 256 KiB, above which the two-stage kernel
# sums each rank's slice starting from that rank (an order that depends on the element's position).
# The compile pass `fuse_allreduce_rms` (on at -O2, the default, for TP > 1 on SM90/SM100 with FlashInfer) replaces
# all-reduce + residual add + RMSNorm by FlashInfer's fused kernel; `enable_sp`/`fuse_gemm_comms` (dense models,
# hidden >= 8192 on SM90/SM100) replace the all-reduce by reduce-scatter + all-gather. Neither kernel was read.

CUDA_TP_CLAIM = "read from sources, not run"
_MIB = 1024 * 1024
# custom_all_reduce.py: CustomAllreduce(max_size=8192 * 1024); with torch symmetric memory enabled the limit is
# min(8 MiB, all_reduce_utils.CUSTOM_ALL_REDUCE_MAX_SIZES[capability][tp]) (TP=2 column below).
CUSTOM_AR_MAX_BYTES = 8 * _MIB
_CUSTOM_AR_SYMM_MEM_TP2 = {"9.0": 64 * _MIB, "10.0": 2 * _MIB, "10.3": 4 * _MIB, "10.7": 4 * _MIB}
# allreduce_rms_fusion.py FI_ALLREDUCE_FUSION_MAX_SIZE_MB: the capabilities (and TP sizes) where FlashInfer's
# all-reduce is enabled, standalone and fused.
_FLASHINFER_AR_TP = {90: (2, 4, 8), 100: (2, 4, 8, 16), 103: (2, 4, 8, 16), 107: (2, 4, 8)}
_FLASHINFER_AR_MAX_MB_TP2 = 64


def _env_flag(name: str, default: str) -> bool:
    return bool(int(os.environ.get(name, default)))


def read_cuda_all_reduce(llm_or_config, *, capability: str | None = None, flashinfer: bool | None = None) -> dict:
    """The layout `cuda_all_reduce_transport` decides from, read from a built CUDA engine (`vllm.LLM` or its
    `VllmConfig`) and this process's environment. Attach it to the engine's description before
    `profile_for_engine(info, tensor_parallel=True)`: `info.cuda_all_reduce = read_cuda_all_reduce(llm)`.

    `capability` ("9.0") and `flashinfer` (FlashInfer's `allreduce_fusion` importable) default to what this
    process sees."""
    cfg = llm_or_config.llm_engine.vllm_config if hasattr(llm_or_config, "llm_engine") else llm_or_config
    pc = cfg.compilation_config.pass_config
    if capability is None:
        major, minor = torch.cuda.get_device_capability()
        capability = f"{major}.{minor}"
    if flashinfer is None:
        try:
            import flashinfer.comm as fc  # noqa: PLC0415

            flashinfer = hasattr(fc, "allreduce_fusion")
        except Exception:  # noqa: BLE001 - absent or broken: vLLM treats both as unavailable
            flashinfer = False
    dtype = cfg.model_config.dtype
    return {
        "tp": int(cfg.parallel_config.tensor_parallel_size),
        "capability": capability,
        "flashinfer": bool(flashinfer),
        "use_flashinfer": _env_flag("VLLM_ALLREDUCE_USE_FLASHINFER", "1"),
        "use_flashinfer_pcie_ipc": _env_flag("VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC", "0"),
        "use_symm_mem": _env_flag("VLLM_ALLREDUCE_USE_SYMM_MEM", "1"),
        "batch_invariant": _env_flag("VLLM_BATCH_INVARIANT", "0"),
        "disable_custom_all_reduce": bool(cfg.parallel_config.disable_custom_all_reduce),
        "fuse_allreduce_rms": bool(pc.fuse_allreduce_rms),
        "enable_sp": bool(pc.enable_sp) or bool(pc.fuse_gemm_comms),
        "hidden": int(cfg.model_config.get_hidden_size()),
        "max_tokens": int(cfg.scheduler_config.max_num_batched_tokens),
        "itemsize": int(getattr(dtype, "itemsize", 2)),
    }


def cuda_all_reduce_transport(layout: dict) -> tuple[str | None, str]:
    """`(transport, why)`: the transport every row-parallel all-reduce of this CUDA layout takes where it is one
    fixed fp32 sum (`transport` set, `why` what it computes), else `(None, why)` with the one-line reason.

    `layout`: the keys `read_cuda_all_reduce` returns. Read from vLLM 0.31's sources, not run (`CUDA_TP_CLAIM`).
    """
    tp = int(layout.get("tp", 1))
    cap = str(layout.get("capability", ""))
    cap_int = int(cap.replace(".", "")) if cap.replace(".", "").isdigit() else None
    if tp != 2:
        return None, (
            f"TP={tp}: vLLM's custom all-reduce sums ranks 0..k-1 in fp32 only below 512/256 KiB and in a "
            "position-dependent rotated order above (read: TP=2 only)"
        )
    if layout.get("fuse_allreduce_rms"):
        return None, (
            "the fuse_allreduce_rms pass (default at -O2 on SM90/SM100 with FlashInfer) runs FlashInfer's fused "
            "all-reduce + residual add + RMSNorm, whose summation order was not read; set "
            "pass_config.fuse_allreduce_rms=False"
        )
    if layout.get("enable_sp"):
        return None, "sequence parallelism / async TP replaces the all-reduce by reduce-scatter + all-gather (not read)"
    fi_on = (layout.get("flashinfer") and layout.get("use_flashinfer") and not layout.get("batch_invariant")
             and tp in _FLASHINFER_AR_TP.get(cap_int, ()))
    if fi_on:
        return None, (
            f"FlashInfer's all-reduce (VLLM_ALLREDUCE_USE_FLASHINFER=1, the default) takes every message up to "
            f"{_FLASHINFER_AR_MAX_MB_TP2} MiB on sm_{cap_int}: its summation order was not read; set "
            "VLLM_ALLREDUCE_USE_FLASHINFER=0"
        )
    if layout.get("use_flashinfer_pcie_ipc") and not layout.get("batch_invariant"):
        return None, "FlashInfer's PCIe IPC all-reduce (VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC=1) was not read"
    if layout.get("disable_custom_all_reduce"):
        return None, "the custom all-reduce is disabled: NCCL sums in bf16 steps whose order was not read"
    limit = CUSTOM_AR_MAX_BYTES
    if layout.get("use_symm_mem") and not layout.get("batch_invariant") and cap in _CUSTOM_AR_SYMM_MEM_TP2:
        limit = min(limit, _CUSTOM_AR_SYMM_MEM_TP2[cap])
    hidden, tokens, item = layout.get("hidden"), layout.get("max_tokens"), layout.get("itemsize", 2)
    if not hidden or not tokens:
        return None, "the largest all-reduce message (max_num_batched_tokens x hidden size) is not known"
    if (hidden * item) % 16:
        return None, f"hidden size {hidden}: odd token counts give messages that are not 16-byte multiples (NCCL)"
    largest = tokens * hidden * item
    if largest >= limit:
        return None, (
            f"messages of {limit // 1024} KiB and more leave the custom all-reduce (for torch symmetric memory "
            f"or NCCL, not read); max_num_batched_tokens={tokens} x hidden {hidden} x {item} bytes = "
            f"{largest // 1024} KiB: lower max_num_batched_tokens below {limit // (hidden * item)}"
        )
    return "custom_all_reduce_1stage", "vLLM's custom all-reduce, one stage: fp32(p0) + fp32(p1), one rounding"


def _cuda_refusal(info) -> str | None:
    layout = getattr(info, "cuda_all_reduce", None)
    if layout is None:
        return (
            "on cuda the all-reduce's arithmetic depends on its transport, which this engine's description does not "
            "carry (read it with trl_roundalign.engine.tp.read_cuda_all_reduce)"
        )
    transport, why = cuda_all_reduce_transport(layout)
    if transport is None:
        return f"on cuda {why}"
    logger.warning("CUDA TP=%s row-parallel sums accepted as %s: %s.", layout.get("tp"), why, CUDA_TP_CLAIM)
    return None


def cpu_threads_bind(tp: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for a TP=`tp` vLLM-CPU engine: each rank its contiguous share of this process's
    CPUs (`0|1` on two cores). vLLM-CPU's default (`auto`) wants one NUMA node per rank.

    Raises:
        ValueError: fewer CPUs than ranks.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        raise ValueError(f"--tensor-parallel-size {tp}: this process may use {len(cpus)} CPUs, fewer than one per rank.")
    share = len(cpus) // tp
    ranks = [cpus[r * share : (r + 1) * share] for r in range(tp)]
    return "|".join(
        str(c[0]) if len(c) == 1 else f"{c[0]}-{c[-1]}" if c[-1] - c[0] == len(c) - 1 else ",".join(map(str, c)) for c in ranks
    )


def colocated_all_reduce() -> str | None:
    """The all-reduce this process's TP group sums with (a colocated engine's, one rank per training process):
    vLLM's device communicator's transport class, e.g. `_CPUSHMDistributed` (vLLM-CPU's shared-memory all-reduce), or
    None where no TP group is set up in this process."""
    try:
        from vllm.distributed import get_tp_group

        comm = getattr(get_tp_group(), "device_communicator", None)
    except (AssertionError, ImportError):  # no TP group in this process
        return None
    module = getattr(comm, "dist_module", None)
    return type(module).__name__ if module is not None else type(comm).__name__ if comm is not None else None
