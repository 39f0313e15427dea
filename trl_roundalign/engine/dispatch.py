"""Compatibility fixes for the stack we run on. Each is explicit, idempotent and documented.

`apply_vllm_cpu_weight_sync_fix()`: vLLM-CPU repacks every linear weight at load
(`vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`: oneDNN or the SGL small-matrix
kernel) and leaves behind an empty parameter without `weight_loader`. TRL's colocate weight sync
(`llm.collective_rpc("load_weights")` through the model's `load_weights`) then fails with
`AttributeError: 'Parameter' object has no attribute 'weight_loader'`, and the lm_head's packed
copy would go stale. The fix replaces that dispatcher, before the engine is built, with one that
computes `F.linear` on the live weight: the synced weights are used as they arrive, and vLLM's
linears then equal Hugging Face's bit for bit (docs/numerics.md: the packed kernel differs on about
1e-4 of outputs when the inner dimension is 576 or more).

`install_gloo_server_weight_sync_fix()`: the same for a `trl vllm-serve` engine that syncs over the gloo
weight-transfer backend (applied at model load, only to engines with that backend), and for the worker processes
of an engine built with the fix (`tensor_parallel_size > 1`, multiprocess executor): vLLM-CPU spawns them, so
`build_llm` sets `WORKERS_FIX_ENV` while it builds and the plugin applies the fix in each worker.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "apply_vllm_cpu_weight_sync_fix",
    "install_gloo_server_weight_sync_fix",
    "is_vllm_cpu",
    "vllm_cpu_piecewise",
    "vllm_cpu_weight_sync_fix_applied",
]

_FIX_ATTR = "_roundalign_weight_sync_fix"
# The name trl_roundalign.weight_transfer registers its backend under (``--weight-transfer-config '{"backend": "gloo"}'``):
# defined here, below the weight-transfer package, so that the dispatcher recognises a gloo-served engine without
# importing that package (whose `__init__` imports this module).
GLOO_BACKEND = "gloo"
# Set (by `engine.build_llm`) while an engine with the fix is built: its spawned workers apply the fix too.
WORKERS_FIX_ENV = "ROUNDALIGN_VLLM_CPU_WORKERS_FIX"
_GLOO_ATTR = "_roundalign_gloo_weight_sync_fix"


def is_vllm_cpu() -> bool:
    """True when vLLM is installed and its current platform is the CPU."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


def _live_weight_dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
    """Replacement for vLLM-CPU's GEMM dispatcher: keep the weight, compute `F.linear` on it, under the GEMM schedule
    of `trl_roundalign.engine.gemm` this process hands its engine (`gemm.engine_schedule`: row blocks or a row floor).

    Weights that are not 2-D are not linears (a gated delta-net's causal-conv weight `[dim, 1, width]`, 3-D MoE
    experts): they go to vLLM's dispatcher, which on an AVX-512-BF16 CPU prepacks the conv weight for its C++
    causal_conv1d kernel. Left unpacked, that kernel reads the plain weight as packed and Qwen3.5's linear-attention
    layers compute garbage (measured on the tiny Qwen3.5: prompt log-probs off by up to 4.3 nats, docs/families.md).
    """
    if layer.weight.ndim != 2:
        vllm_dispatch()(layer, remove_weight)
        return
    from .gemm import engine_schedule, linear

    schedule = engine_schedule()
    if schedule.plain:
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)
    else:
        layer.cpu_linear = lambda x, weight, bias, _s=schedule: linear(x, weight, bias, _s.block_rows, _s.min_rows)
    # Read back by `layout.worker_facts`: what the loaded engine computes with.
    layer._roundalign_block_rows = schedule.block_rows
    layer._roundalign_min_rows = schedule.min_rows


_live_weight_dispatch.__dict__[_FIX_ATTR] = True


_VLLM_DISPATCH = None  # vLLM-CPU's own dispatcher, kept when one of ours replaces it


def _keep_vllm_dispatch(current) -> None:
    global _VLLM_DISPATCH
    if _VLLM_DISPATCH is None and not getattr(current, _FIX_ATTR, False) and not getattr(current, _GLOO_ATTR, False):
        _VLLM_DISPATCH = current


def vllm_dispatch():
    """vLLM-CPU's own GEMM dispatcher, whichever of ours is installed in its place."""
    import vllm.model_executor.layers.utils as vllm_utils

    return _VLLM_DISPATCH or vllm_utils.dispatch_cpu_unquantized_gemm


def vllm_cpu_weight_sync_fix_applied() -> bool:
    import vllm.model_executor.layers.utils as vllm_utils

    return getattr(vllm_utils.dispatch_cpu_unquantized_gemm, _FIX_ATTR, False)


def apply_vllm_cpu_weight_sync_fix() -> bool:
    """Make vLLM-CPU's linears read their live weights, so TRL's weight sync works on CPU.

    Must run before the engine is built (the dispatcher runs at model load). Does nothing on
    other platforms and when already applied.

    Returns:
        True when the fix is (now) in place, False when vLLM is absent or not on the CPU platform.
    """
    if not is_vllm_cpu():
        return False
    import vllm.model_executor.layers.utils as vllm_utils

    if not hasattr(vllm_utils, "dispatch_cpu_unquantized_gemm"):
        raise RuntimeError(
            "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm is gone in this vLLM "
            f"({_vllm_version()}); the CPU weight-sync fix needs updating for it. Tested: vllm-cpu 0.31."
        )
    if not vllm_cpu_weight_sync_fix_applied():
        _keep_vllm_dispatch(vllm_utils.dispatch_cpu_unquantized_gemm)
        vllm_utils.dispatch_cpu_unquantized_gemm = _live_weight_dispatch
        logger.info("vLLM-CPU weight-sync fix applied: linears compute F.linear on the live weights")
    return True


def _engine_syncs_over_gloo() -> bool:
    """True inside the model load of an engine whose weight-transfer backend is trl-roundalign's gloo one."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    transfer = getattr(config, "weight_transfer_config", None)
    return transfer is not None and getattr(transfer, "backend", None) == GLOO_BACKEND


def install_gloo_server_weight_sync_fix() -> bool:
    """Give an engine served with the gloo weight-transfer backend live weights, whatever else the process runs.

    A server's engine is built before its weight-transfer engine exists, so `apply_vllm_cpu_weight_sync_fix`
    called from there comes too late: on a CPU whose vLLM-CPU packs the weights (oneDNN or the SGL kernel,
    AVX-512), the linears have already dropped them, and the first `update_weights` fails in vLLM's layerwise
    reload (`The size of tensor a (0) must match the size of tensor b (...)`). Installed by the
    ``vllm.general_plugins`` entry point (`weight_transfer.register`, run in every vLLM process before the
    model loads), this dispatcher computes `F.linear` on the live weight for a layer loaded under a config
    with ``weight_transfer_config.backend == "gloo"`` and hands every other layer to vLLM's dispatcher, so
    engines without that backend keep vLLM-CPU's kernels. Does nothing off vLLM-CPU, or when the unconditional
    fix is already in place.

    Returns:
        True when the dispatcher handles gloo-served engines (now or already), False off vLLM-CPU.
    """
    if not is_vllm_cpu():
        return False
    if os.environ.get(WORKERS_FIX_ENV) == "1":  # a worker of an engine that `build_llm` builds with the fix
        return apply_vllm_cpu_weight_sync_fix()
    import vllm.model_executor.layers.utils as vllm_utils

    current = getattr(vllm_utils, "dispatch_cpu_unquantized_gemm", None)
    if current is None:
        raise RuntimeError(
            "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm is gone in this vLLM "
            f"({_vllm_version()}); the gloo weight-transfer backend needs updating for it. Tested: vllm-cpu 0.31."
        )
    if getattr(current, _FIX_ATTR, False) or getattr(current, _GLOO_ATTR, False):
        return True
    _keep_vllm_dispatch(current)

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        if _engine_syncs_over_gloo():
            _live_weight_dispatch(layer, remove_weight)
        else:
            current(layer, remove_weight)

    dispatch.__dict__[_GLOO_ATTR] = True
    vllm_utils.dispatch_cpu_unquantized_gemm = dispatch
    return True


@contextlib.contextmanager
def workers_weight_sync_fix():
    """While an engine is built: the worker processes it spawns (`tensor_parallel_size > 1` with the multiprocess
    executor) apply the weight-sync fix when this process has it (`WORKERS_FIX_ENV`, read by the plugin)."""
    if not (is_vllm_cpu() and vllm_cpu_weight_sync_fix_applied()):
        yield
        return
    old = os.environ.get(WORKERS_FIX_ENV)
    os.environ[WORKERS_FIX_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(WORKERS_FIX_ENV, None)
        else:
            os.environ[WORKERS_FIX_ENV] = old


def _vllm_version() -> str:
    try:
        import vllm

        return vllm.__version__
    except Exception:  # pragma: no cover - informative only
        return "unknown"


# ------------------------------------------------------------------------------------------------
# vLLM-CPU built the CUDA way: piecewise compilation
# ------------------------------------------------------------------------------------------------

_PIECEWISE_DEPTH = 0


def _piecewise_check_and_update_config(original):
    """Wrap `CpuPlatform.check_and_update_config` so that, inside `vllm_cpu_piecewise()`, an engine asked for
    `mode=VLLM_COMPILE` keeps it (and the Inductor backend) instead of vLLM-CPU's one-graph rewrite."""

    def check_and_update_config(cls, vllm_config):
        from vllm.config import CompilationMode

        cc = vllm_config.compilation_config
        keep = _PIECEWISE_DEPTH > 0 and cc.mode == CompilationMode.VLLM_COMPILE
        original(vllm_config)
        if keep:
            # vLLM-CPU rewrote VLLM_COMPILE to DYNAMO_TRACE_ONCE (one graph); restore what CUDA runs. The
            # Inductor options vLLM-CPU added (dce, epilogue fusion, dynamic threads) stay.
            cc.mode = CompilationMode.VLLM_COMPILE
            cc.backend = "inductor"

    check_and_update_config.__dict__[_FIX_ATTR] = True
    return classmethod(check_and_update_config)


def _install_piecewise_hook() -> None:
    from vllm.platforms.cpu import CpuPlatform

    current = CpuPlatform.__dict__["check_and_update_config"]
    if getattr(current.__func__, _FIX_ATTR, False):
        return
    CpuPlatform.check_and_update_config = _piecewise_check_and_update_config(current.__get__(None, CpuPlatform))


class vllm_cpu_piecewise:  # noqa: N801 - used as a context manager, like contextlib's
    """Build vLLM-CPU engines the way vLLM builds them on CUDA: piecewise compilation.

    vLLM 0.31 on CUDA compiles with `mode=VLLM_COMPILE`, splitting the graph at the attention ops
    (`CompilationConfig.splitting_ops`); vLLM-CPU rewrites that mode to `DYNAMO_TRACE_ONCE`, one whole
    graph (`CpuPlatform.check_and_update_config`). Inside this context an engine whose
    `compilation_config` asks for `mode=3` keeps it, so its numerics (where the residual stream is
    rounded: at every split) can be measured on CPU. Pass `compile_sizes=[]` too
    (`engine.piecewise_compilation_config` does). Engines built outside the context are untouched.
    """

    def __enter__(self):
        global _PIECEWISE_DEPTH
        if not is_vllm_cpu():
            raise RuntimeError("vllm_cpu_piecewise applies to vLLM's CPU build only; on CUDA vLLM compiles piecewise itself.")
        _install_piecewise_hook()
        _PIECEWISE_DEPTH += 1
        return self

    def __exit__(self, *exc):
        global _PIECEWISE_DEPTH
        _PIECEWISE_DEPTH -= 1
        return False
