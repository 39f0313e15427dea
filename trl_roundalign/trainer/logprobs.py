"""The trainer's per-token log-probs computed the way vLLM's sampler computes the ones it returns.

TRL 1.16 scores completions through a fused LM head (`trl.trainer.utils.add_fused_lm_head`): the head's GEMM in
tiles of 4096 tokens x 32768 vocabulary entries and an online logsumexp over the tiles in fp32
(`trl.kernels.ChunkedLogProbFunction`). vLLM's sampler, with TRL's `logprobs_mode="processed_logprobs"`, takes the
head's bf16 logits, converts them to fp32, divides by the temperature and calls `log_softmax`
(`vllm/v1/sample/sampler.py`). Both are log-softmax in fp32, summed in other orders: the trainer's log-probs differ
from the sampler's in the last bits of nearly every token (measured on the Intel AMX machine, SmolLM2 exact mode:
0% bit-identical, max |dlogp| 1.9e-5, k3 ~4e-11; docs/numerics.md, "Exact against the sampler").

`SamplerLogProb` computes the forward as the sampler does: the head's GEMM as the engine's linears compute it
(`trl_roundalign.engine.gemm`, row blocks where the machine's GEMM is batch-variant), `.float()`, `/ temperature`,
`torch.log_softmax`, gathered at the targets; entropy and the other optional outputs from the same log-probs. The
backward is TRL's (the gradient is not part of the bitwise claim): it recomputes the logits tile by tile from the
saved `log_z`. Memory: `chunk` rows of fp32 logits at a time (256 x vocabulary), as TRL keeps 4096 x 32768 bf16.

Scoped: `install()` puts a dispatcher in place of TRL's function in `trl.trainer.utils` (where the fused head
looks it up at each call), and it computes the sampler's way only inside `sampler_logprobs(rows)`, which the
trainer enters while TRL computes its log-probs; any other call (another trainer, a model with a logit soft-cap or
scale, which this does not reproduce) goes to TRL's function unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging

import torch

from ..engine.gemm import PLAIN, GemmSchedule, linear

logger = logging.getLogger(__name__)

__all__ = ["SamplerLogProb", "install", "installed", "sampler_logprobs"]

_ROWS: contextvars.ContextVar[GemmSchedule | None] = contextvars.ContextVar("roundalign_sampler_logprobs", default=None)
CHUNK_ROWS = 256  # fp32 logits held at a time: CHUNK_ROWS x vocabulary


@contextlib.contextmanager
def sampler_logprobs(schedule: GemmSchedule = PLAIN):
    """Inside: the fused LM head's log-probs are computed the sampler's way, the head's GEMM under the engine's
    `schedule` (`engine.gemm.GemmSchedule`: row blocks, a row floor, or plain `F.linear`)."""
    token = _ROWS.set(GemmSchedule(*schedule))
    try:
        yield
    finally:
        _ROWS.reset(token)


def _trl_function():
    from trl.kernels import ChunkedLogProbFunction

    return ChunkedLogProbFunction


class SamplerLogProb(torch.autograd.Function):
    """`ChunkedLogProbFunction`'s interface and backward, with the sampler's forward (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
                logit_scale=1.0, outputs=("entropy",), schedule=PLAIN):
        ctx.set_materialize_grads(False)
        n, vocab = hidden.shape[0], weight.shape[0]
        device = hidden.device
        compute_dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else hidden.dtype
        logprobs = torch.empty(n, device=device, dtype=torch.float32)
        log_z = torch.empty(n, device=device, dtype=torch.float32)
        want = {name: name in outputs for name in ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")}
        entropy = torch.empty(n, device=device, dtype=torch.float32) if want["entropy"] else None
        log_sum_sq = torch.empty(n, device=device, dtype=torch.float32) if want["log_sum_sq_probs"] else None
        mean_logits = torch.empty(n, device=device, dtype=torch.float32) if want["mean_logits"] else None
        is_top1 = torch.empty(n, device=device, dtype=torch.bool) if want["is_top1"] else None
        temp = torch.tensor(float(temperature), dtype=torch.float32, device=device)
        w = weight.to(compute_dtype)
        b = bias.to(compute_dtype) if bias is not None else None
        rows = schedule.block_rows
        step = max(CHUNK_ROWS // rows, 1) * rows if rows else CHUNK_ROWS
        with torch.autocast(device.type, enabled=False):
            for s in range(0, n, step):
                e = min(s + step, n)
                z = linear(hidden[s:e].to(compute_dtype), w, b, rows, schedule.min_rows).float()  # the engine's bf16 logits, fp32
                if float(temperature) != 1.0:
                    z.div_(temp)  # the sampler's `logits.div_(temp)`
                lp = torch.log_softmax(z, dim=-1)
                t = targets[s:e].unsqueeze(1)
                logprobs[s:e] = lp.gather(1, t).squeeze(1)
                log_z[s:e] = torch.logsumexp(z, dim=-1)
                if entropy is not None:
                    entropy[s:e] = -(lp.exp() * lp).sum(-1)
                if log_sum_sq is not None:
                    log_sum_sq[s:e] = torch.logsumexp(2 * lp, dim=-1)
                if mean_logits is not None:
                    mean_logits[s:e] = z.sum(-1) / vocab
                if is_top1 is not None:
                    is_top1[s:e] = z.argmax(-1) == targets[s:e]
        ctx.save_for_backward(hidden, weight, bias, targets, log_z, log_z if entropy is None else entropy)
        ctx.compute_dtype = compute_dtype
        ctx.chunk_size = chunk_size
        ctx.kernel_args = {"logit_scale": 1.0, "softcap": 1.0, "inv_t": 1 / temperature, "HAS_SOFTCAP": False}
        ctx.mark_non_differentiable(*(x for x in (log_sum_sq, mean_logits, is_top1) if x is not None))
        return logprobs, entropy, log_sum_sq, mean_logits, is_top1

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, *_):
        grads = _trl_function().backward(ctx, grad_logprobs, grad_entropy)
        return (*grads, None)


class _Dispatch:
    """Stands in for `trl.trainer.utils._ChunkedLogProbFunction`: the sampler's way inside `sampler_logprobs`."""

    _roundalign = True

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None, logit_scale=1.0,
              outputs=("entropy",)):
        schedule = _ROWS.get()
        if schedule is None or final_logit_softcapping is not None or logit_scale != 1.0:
            return _trl_function().apply(hidden, weight, bias, targets, temperature, chunk_size,
                                         final_logit_softcapping, logit_scale, outputs)
        return SamplerLogProb.apply(hidden, weight, bias, targets, temperature, chunk_size, None, 1.0, outputs, schedule)


def install() -> None:
    """Put the dispatcher where TRL's fused LM head looks its function up (idempotent)."""
    import trl.trainer.utils as utils

    current = getattr(utils, "_ChunkedLogProbFunction", None)
    if current is None:
        raise RuntimeError(
            "trl.trainer.utils._ChunkedLogProbFunction is gone in this TRL: the sampler-aligned log-probs need "
            "updating for it (built against trl 1.16)."
        )
    if getattr(current, "_roundalign", False):
        return
    utils._ChunkedLogProbFunction = _Dispatch


def installed() -> bool:
    import trl.trainer.utils as utils

    return bool(getattr(getattr(utils, "_ChunkedLogProbFunction", None), "_roundalign", False))


def supports(model) -> str | None:
    """Why the sampler's way does not apply to `model` (a logit soft-cap or scale), or None."""
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    for name in ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling"):
        if getattr(text, name, None) not in (None, 1.0):
            return f"its config sets {name}={getattr(text, name)!r}, which this does not reproduce"
    return None
