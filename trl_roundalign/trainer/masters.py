"""fp32 master weights for bf16 models trained without DeepSpeed/FSDP mixed precision.

The forward must run on bf16 weights (that is what the engine serves and what the aligned regions
are defined on), but an update of `lr * g` with `lr = 1e-6` is below half a bf16 ulp for almost
every weight and rounds away. `MasterWeightsOptimizer` keeps an fp32 copy of each trainable
parameter, steps an inner optimizer on the copies, and writes the rounded result back into the
model's bf16 parameters in place (the parameter objects are never replaced, so TRL's weight sync
and PEFT keep their references).

Gradients accumulate in fp32. Autograd produces each micro-batch's gradient in the parameter's
dtype; a post-accumulate-grad hook adds it into the master's fp32 `.grad` and frees the bf16 one, so
with `gradient_accumulation_steps=k` the sum is rounded once per micro-batch to fp32 precision
instead of once per micro-batch to bf16 precision, and no full fp32 copy of the gradients is made at
step time. Under data parallelism the fp32 sums are averaged across processes at step time
(`reduce_gradients`, one flat all-reduce per chunk); DDP's own bf16 reduction then only sees the freed
(zero) gradients, and the trainer turns it off with a no-op communication hook. A master that has a gradient on
no process stays without one, so the inner optimizer skips it as it does in one process.

With fp16 loss scaling (accelerate's GradScaler) the masters accumulate scaled gradients; `clip_grad_norm_(...,
scaler=)` (or `unscale_`) reduces, unscales and, on an inf/NaN, drops them, since the scaler then skips `step()`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["MasterWeightsOptimizer", "aligned_fsdp2_policy", "distributed_master_weights", "noop_comm_hook"]

# Elements per all-reduce of the flattened fp32 gradients (64 MiB).
_REDUCE_CHUNK = 1 << 24


def distributed_master_weights(
    distributed_type: str,
    mixed_precision: str,
    deepspeed_config: dict | None = None,
    fsdp_param_dtype: torch.dtype | None = None,
) -> tuple[str | None, bool, str]:
    """Whether a distributed engine keeps fp32 master weights, from its actual settings.

    Args:
        distributed_type: accelerate's `DistributedType` (as a string).
        mixed_precision: accelerate's mixed precision (`"no"`, `"bf16"`, `"fp16"`).
        deepspeed_config: the DeepSpeed config in use (its `bf16`/`fp16` sections; `"auto"` follows
            `mixed_precision`, as the HF integration resolves it).
        fsdp_param_dtype: the FSDP mixed-precision policy's `param_dtype`, when one is set. It only names the
            compute dtype in the reason: whether accelerate upcasts to fp32 follows `mixed_precision` alone.

    Returns:
        `(engine, keeps, why)`: engine `"DeepSpeed"`, `"FSDP"` or None (no such engine: DDP or one process);
        whether it keeps fp32 masters; a sentence saying why.
    """
    dt = str(distributed_type).upper()
    if "DEEPSPEED" in dt:
        cfg = deepspeed_config or {}

        def enabled(section: str) -> bool:
            value = (cfg.get(section) or {}).get("enabled", False)
            return mixed_precision == section if value == "auto" else bool(value)

        if enabled("bf16") or enabled("fp16"):
            return "DeepSpeed", True, "DeepSpeed's bf16/fp16 mode keeps fp32 master weights in its optimizer"
        return "DeepSpeed", False, "the DeepSpeed config enables neither bf16 nor fp16, so it keeps no fp32 master weights"
    if "FSDP" in dt:
        # accelerate 1.x upcasts trainable parameters to fp32 exactly when its mixed_precision is not "no"
        # (FSDP1: `Accelerator.prepare_model`; FSDP2: `fsdp2_prepare_model`), whatever the policy's param_dtype,
        # which only sets the dtype FSDP casts to for the forward and backward.
        if mixed_precision not in ("no", "None", ""):
            return "FSDP", True, "with mixed precision accelerate upcasts the parameters to fp32 before FSDP shards them"
        if fsdp_param_dtype is not None:
            return "FSDP", False, (
                f"accelerate's mixed_precision is 'no', so it does not upcast the parameters to fp32 (a param_dtype of "
                f"{fsdp_param_dtype} only sets FSDP's compute dtype) and the optimizer steps the bf16 shards"
            )
        return "FSDP", False, "FSDP without mixed precision shards the bf16 parameters as they are (no fp32 copy)"
    return None, False, ""


def aligned_fsdp2_policy(policy=None, *, param_dtype: torch.dtype | None = None):
    """The FSDP2 `MixedPrecisionPolicy` an aligned model needs, from the one accelerate (or the user) set.

    FSDP2 casts every floating-point *input* of each sharded module to `param_dtype`
    (`cast_forward_inputs=True`, the default) and, with `output_dtype`, its outputs. Sharded per decoder layer,
    as accelerate wraps transformer layers, that rounds the fp32 residual stream the aligned layers hand on
    (`docs/numerics.md`) to bf16 at every layer boundary: the forward then differs from the engine's while
    looking aligned (`tests/trainer/test_fsdp2.py`). accelerate 1.x builds its FSDP2 policy with
    `output_dtype=param_dtype` and leaves `cast_forward_inputs` at its default (accelerate/utils/dataclasses.py).

    Returned: the same `param_dtype` (the compute dtype, which must be the engine's bf16/fp16), gradients
    reduced in fp32 (as `MasterWeightsOptimizer` accumulates them), nothing cast at module boundaries.

    Raises:
        ValueError: no `param_dtype`: FSDP2 would compute in the fp32 master dtype, not the engine's.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = param_dtype if param_dtype is not None else getattr(policy, "param_dtype", None)
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"FSDP2 with param_dtype={dtype}: the aligned model must compute in the engine's bf16/fp16 while FSDP keeps "
            "fp32 masters. Train with mixed precision (accelerate --mixed_precision bf16, or an fsdp_config "
            "mixed_precision_policy with param_dtype bf16)."
        )
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, output_dtype=None, cast_forward_inputs=False)


def noop_comm_hook(state, bucket):
    """A DDP communication hook that communicates nothing (the masters' fp32 gradients are reduced instead)."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class MasterWeightsOptimizer(torch.optim.Optimizer):
    """Wrap an optimizer class so it steps fp32 masters of low-precision parameters.

    Args:
        params: the model's trainable parameters (bf16/fp16) or param groups (dicts with `"params"`).
        optimizer_cls: the inner optimizer class, e.g. `torch.optim.AdamW`.
        **optimizer_kwargs: passed to `optimizer_cls`.

    `param_groups` and `state` are the inner optimizer's, so LR schedulers and gradient clipping
    work unchanged; `state_dict()` also carries the fp32 masters, so a resumed run continues from
    the exact fp32 weights rather than their bf16 rounding.
    """

    def __init__(self, params, optimizer_cls=torch.optim.AdamW, **optimizer_kwargs):
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self._model_params: list[torch.nn.Parameter] = []
        master_groups = []
        for g in groups:
            masters = []
            for p in g["params"]:
                # fp32 parameters (e.g. an fp32 lm head) are their own masters.
                m = p if p.dtype == torch.float32 else p.detach().clone().float().requires_grad_(True)
                self._model_params.append(p)
                masters.append(m)
            master_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": masters})
        self._masters = [m for g in master_groups for m in g["params"]]
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._accumulate_into(m))
            for p, m in zip(self._model_params, self._masters)
            if m is not p and p.requires_grad
        ]
        self._reduced = False
        self.inner = optimizer_cls(master_groups, **optimizer_kwargs)
        # Share the inner optimizer's bookkeeping (schedulers and clip_grad read these).
        self.defaults = self.inner.defaults
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}

    @property
    def masters(self) -> list[torch.Tensor]:
        return self._masters

    @staticmethod
    def _accumulate_into(master: torch.Tensor):
        def hook(param: torch.Tensor) -> None:
            with torch.no_grad():
                if master.grad is None:
                    master.grad = param.grad.float()
                else:
                    master.grad.add_(param.grad)
            param.grad = None

        return hook

    def remove_hooks(self) -> None:
        """Stop accumulating into the masters (gradients then stay in the parameters' `.grad`)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    @torch.no_grad()
    def reduce_gradients(self, group=None) -> None:
        """Average the masters' fp32 gradients across the processes of `group` (once per step; no-op alone)."""
        if self._reduced or not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
            self._reduced = True
            return
        world = dist.get_world_size(group)
        if not self._masters:
            self._reduced = True
            return
        # Every rank must reduce the same tensors in the same order. A master with a gradient on some rank gets zeros
        # where it has none; one without a gradient on every rank (an unused MoE expert, say) stays without one, so
        # the inner optimizer skips it (no momentum, no weight decay) as it does in one process.
        has = torch.tensor([m.grad is not None for m in self._masters], dtype=torch.int32, device=self._masters[0].device)
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=group)
        grads = []
        for m, anywhere in zip(self._masters, has.tolist()):
            if not anywhere:
                continue
            if m.grad is None:
                m.grad = torch.zeros_like(m)
            grads.append(m.grad)
        start = 0
        while start < len(grads):
            chunk, size = [], 0
            while start < len(grads) and (not chunk or size + grads[start].numel() <= _REDUCE_CHUNK):
                chunk.append(grads[start])
                size += grads[start].numel()
                start += 1
            flat = torch.cat([g.reshape(-1) for g in chunk])
            dist.all_reduce(flat, group=group)
            flat.div_(world)
            offset = 0
            for g in chunk:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        self._reduced = True

    def unscale_(self, scaler) -> bool:
        """Reduce, then divide the masters' gradients by `scaler`'s loss scale (a torch `GradScaler`); False on inf/NaN.

        With loss scaling, call this (or `clip_grad_norm_(..., scaler=scaler)`) once per step before
        `scaler.step(self)`. The scaler skips `step()` when it found an inf/NaN; `step()` is what consumes the masters'
        gradients, so they are dropped here instead and the overflowed sums do not leak into the next step. Reducing
        first gives every process the same gradients, hence the same verdict. No scaler (or a disabled one): reduce only.
        """
        finite = self._unscale(scaler)
        if not finite:
            self._drop_gradients()
        return finite

    def _unscale(self, scaler) -> bool:
        self.reduce_gradients()
        if scaler is None or not scaler.is_enabled():
            return True
        scaler.unscale_(self)  # this optimizer's params are the masters: their fp32 gradients are unscaled
        found = scaler._per_optimizer_states[id(self)]["found_inf_per_device"]
        return not any(bool(v.item()) for v in found.values())

    def _drop_gradients(self) -> None:
        for p, m in zip(self._model_params, self._masters):
            m.grad = None
            p.grad = None
        self._reduced = False

    def clip_grad_norm_(self, max_norm: float, scaler=None) -> torch.Tensor:
        """Reduce (and unscale with `scaler`, see `unscale_`), then clip the masters' fp32 gradients to `max_norm`
        (inf: only measure). Returns the pre-clip norm of the unscaled gradients: inf/NaN on an overflow, whose step
        the scaler skips."""
        finite = self._unscale(scaler)
        grads = [m for m in self._masters if m.grad is not None]
        if not grads:
            norm = torch.zeros(())
        elif finite:
            norm = torch.nn.utils.clip_grad_norm_(grads, max_norm)
        else:
            norm = torch.nn.utils.get_total_norm([m.grad for m in grads])
            self._drop_gradients()
        return norm

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterWeightsOptimizer does not support closures.")
        for p, m in zip(self._model_params, self._masters):
            if m is not p and p.grad is not None:
                # Gradients that reached .grad without the hook (hooks removed, or set by hand).
                m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                p.grad = None
        self.reduce_gradients()
        self.inner.step()
        for p, m in zip(self._model_params, self._masters):
            if m is not p and m.grad is not None:
                p.copy_(m)  # rounds fp32 -> bf16 once (round-to-nearest-even)
                m.grad = None  # consumed: the next step accumulates afresh (the trainer zeroes the model only)
        self._reduced = False
        return None

    def zero_grad(self, set_to_none: bool = True):
        for p in self._model_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        for p, m in zip(self._model_params, self._masters):
            if m is not p:
                m.grad = None
        self._reduced = False

    def state_dict(self):
        return {"inner": self.inner.state_dict(), "masters": [m.detach().clone() for m in self._masters]}

    def load_state_dict(self, state_dict):
        if "inner" not in state_dict:
            # A plain optimizer checkpoint: masters restart from the model's weights.
            self.inner.load_state_dict(state_dict)
            return
        self.inner.load_state_dict(state_dict["inner"])
        with torch.no_grad():
            for p, m, saved in zip(self._model_params, self._masters, state_dict["masters"]):
                m.copy_(saved.to(m.device))
                if m is not p:
                    p.copy_(m)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    def __repr__(self) -> str:
        return f"MasterWeightsOptimizer(fp32 masters, inner={self.inner.__class__.__name__})"


def distributed_precision(accelerator) -> tuple[str | None, bool, str]:
    """`distributed_master_weights` from the accelerator's actual DeepSpeed/FSDP settings."""
    if accelerator is None:
        return None, False, ""
    state = accelerator.state
    ds_plugin = getattr(state, "deepspeed_plugin", None)
    fsdp_plugin = getattr(state, "fsdp_plugin", None)
    policy = getattr(fsdp_plugin, "mixed_precision_policy", None)
    return distributed_master_weights(
        str(accelerator.distributed_type),
        str(accelerator.mixed_precision),
        deepspeed_config=getattr(ds_plugin, "deepspeed_config", None),
        fsdp_param_dtype=getattr(policy, "param_dtype", None),
    )
