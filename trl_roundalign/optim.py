"""fp32 master weights for bf16 models trained without DeepSpeed/FSDP mixed precision.

The forward must run on bf16 weights (that is what the engine serves and what the aligned regions
are defined on), but an update of `lr * g` with `lr = 1e-6` is below half a bf16 ulp for almost
every weight and rounds away. `MasterWeightsOptimizer` keeps an fp32 copy of each trainable
parameter, steps an inner optimizer on the copies, and writes the rounded result back into the
model's bf16 parameters in place (the parameter objects are never replaced, so TRL's weight sync
and PEFT keep their references).
"""

from __future__ import annotations

import torch

__all__ = ["MasterWeightsOptimizer"]


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

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterWeightsOptimizer does not support closures.")
        for p, m in zip(self._model_params, self._masters):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.detach().float()
        self.inner.step()
        for p, m in zip(self._model_params, self._masters):
            if m is not p and p.grad is not None:
                p.copy_(m)  # rounds fp32 -> bf16 once (round-to-nearest-even)
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
