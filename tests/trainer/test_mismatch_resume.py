"""Resuming a run keeps `mismatch.jsonl` append-only, and the resumed rows name the run and checkpoint they continue.

Driven through transformers' own `CallbackHandler` and `TrainerState`: a "checkpoint" is the trainer state written
with `TrainerState.save_to_json` at a step and read back with `load_from_json`, exactly what `Trainer` does with
`trainer_state.json` (the state is saved before `on_save` runs, and loaded before `on_train_begin`).
"""

from __future__ import annotations

import json
import time

from transformers import TrainerControl, TrainerState
from transformers.trainer_callback import CallbackHandler

from tests.test_metrics_windows import STEPS, batch, fake_grpo_trainer
from trl_roundalign import callbacks
from trl_roundalign.trainer.callbacks import MismatchCallback


def train(path, *, steps, state=None, save_at=(), tag=0.0):
    """One `train()` call of a fresh trainer: `steps` optimizer steps from `state` (a resumed checkpoint) on.

    Each step's log-probs are shifted by `tag`, so the rows of different attempts differ. Returns the callback and
    the checkpoints saved at `save_at`, as `{step: path of trainer_state.json}`.
    """
    trainer = fake_grpo_trainer()
    cb = MismatchCallback(log_file=path, run_info={"profile": "vllm-compiled"})
    cb.trainer = trainer
    handler = CallbackHandler([cb], None, None, None, None)  # the hooks under test, without the flow callback
    state = state or TrainerState()
    control = TrainerControl()
    handler.on_train_begin(None, state, control)
    saved = {}
    for step in range(state.global_step + 1, steps + 1):
        deltas = [d + tag for d in STEPS[step % len(STEPS)][:3] if d == d]
        cb.record(*batch(deltas))
        state.global_step = step
        handler.on_step_end(None, state, control)
        if step in save_at:
            ckpt = path.parent / f"checkpoint-{step}-{time.monotonic_ns()}.json"
            state.save_to_json(str(ckpt))  # what Trainer._save_checkpoint writes, before on_save
            handler.on_save(None, state, control)
            saved[step] = ckpt
    handler.on_train_end(None, state, control)
    return cb, saved


def test_resuming_a_run_keeps_another_runs_rows_and_files_the_resume_under_its_own_run(tmp_path):
    path = tmp_path / "mismatch.jsonl"
    a, ckpts = train(path, steps=10, save_at=(5,))  # run A: 10 steps, checkpoint at step 5
    b, _ = train(path, steps=8, tag=1.0)  # run B: 8 steps, same output_dir
    before = path.read_text()
    resumed, _ = train(path, steps=10, state=TrainerState.load_from_json(str(ckpts[5])), tag=2.0)

    after = path.read_text()
    assert after.startswith(before)  # append-only: nothing written before the resume is removed or rewritten
    assert resumed.run_id == a.run_id != b.run_id
    lines = [json.loads(x) for x in after.splitlines()]
    resume_header = [r for r in lines if "run_info" in r][-1]
    assert resume_header["run_id"] == a.run_id and resume_header["resumed_at_step"] == 5
    resumed_rows = lines[lines.index(resume_header) + 1:]
    assert [r["step"] for r in resumed_rows] == [6, 7, 8, 9, 10]
    assert all(r["run_id"] == a.run_id and r["resumed_at_step"] == 5 for r in resumed_rows)

    runs = {run["run_id"]: run for run in callbacks.read_mismatch_runs(path)}
    assert list(runs) == [a.run_id, b.run_id]
    assert [r["step"] for r in runs[b.run_id]["rows"]] == list(range(1, 9))  # B's rows 6-8 are all there
    assert runs[b.run_id]["rows"] == [r for r in lines if r.get("run_id") == b.run_id and "step" in r]
    run_a = runs[a.run_id]
    assert [r["step"] for r in run_a["rows"]] == list(range(1, 11))  # each step once ...
    assert run_a["rows"][5:] == resumed_rows  # ... steps 6-10 from the resumed attempt
    assert [r["step"] for r in run_a["superseded"]] == [6, 7, 8, 9, 10]  # the first attempt's, kept as evidence
    assert [h["resumed_at_step"] for h in run_a["headers"]] == [None, 5]


def test_a_resume_from_a_checkpoint_without_a_run_id_starts_a_new_run(tmp_path, caplog):
    """A checkpoint written without the run's id (another version, or no log file then) is not guessed at."""
    path = tmp_path / "mismatch.jsonl"
    a, _ = train(path, steps=4)
    legacy = TrainerState()
    legacy.global_step = 2
    with caplog.at_level("WARNING", logger="trl_roundalign.trainer.callbacks"):
        resumed, _ = train(path, steps=4, state=legacy)
    assert resumed.run_id != a.run_id and "records no mismatch-log run" in caplog.text
    runs = callbacks.read_mismatch_runs(path)
    assert [[r["step"] for r in run["rows"]] for run in runs] == [[1, 2, 3, 4], [3, 4]]
    assert runs[1]["header"]["resumed_at_step"] == 2


def test_every_checkpoint_records_the_run_it_belongs_to(tmp_path):
    path = tmp_path / "mismatch.jsonl"
    a, ckpts = train(path, steps=4, save_at=(2, 4))
    for ckpt in ckpts.values():
        record = json.loads(ckpt.read_text())["stateful_callbacks"][callbacks.CHECKPOINT_KEY]
        assert record["run_id"] == a.run_id
    # A resumed run's own checkpoints keep the id, so a second resume continues the same run.
    resumed, again = train(path, steps=6, state=TrainerState.load_from_json(str(ckpts[4])), save_at=(5,))
    third, _ = train(path, steps=6, state=TrainerState.load_from_json(str(again[5])), tag=3.0)
    assert a.run_id == resumed.run_id == third.run_id
    (run,) = callbacks.read_mismatch_runs(path)
    assert [r["step"] for r in run["rows"]] == [1, 2, 3, 4, 5, 6]
    assert [h["resumed_at_step"] for h in run["headers"]] == [None, 4, 5]
