"""What `MismatchCallback` hands to TRL's `log()` over a logging window, and how `mismatch.jsonl` keeps runs apart.

TRL's `GRPOTrainer.log()` logs the mean of each `_metrics` list since the last log. These tests drive the callback
with hand-built log-probs, step by step, and call TRL's own `log()` (on a trainer object built without `__init__`)
at the steps a `logging_steps=2` run logs at, so the averaging under test is TRL's, not a copy of it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerState

from trl_roundalign import callbacks, metrics
from trl_roundalign.trainer.callbacks import MismatchCallback

NAN = float("nan")


def batch(deltas, *, train_nan=0):
    """One step's `[1, T]` log-probs with the given `Δ = train - infer` (fp32-exact values); NaN = vLLM's side."""
    d = torch.tensor([deltas], dtype=torch.float32)
    infer = torch.full_like(d, -8.0)
    train = infer + torch.nan_to_num(d, nan=0.0)
    infer = torch.where(torch.isnan(d), torch.full_like(d, NAN), infer)
    if train_nan:
        train[0, :train_nan] = NAN
    return train, infer, torch.ones_like(d, dtype=torch.long)


def fake_grpo_trainer():
    """A `trl.GRPOTrainer` with just what `log()` and the callback read (no model, no engine)."""
    from transformers import TrainerControl, TrainerState
    from transformers.trainer_callback import CallbackHandler
    from trl import GRPOTrainer

    t = GRPOTrainer.__new__(GRPOTrainer)
    t.model = SimpleNamespace(training=True)
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t.state = TrainerState()
    t.state.global_step = 0
    t.args = SimpleNamespace(include_num_input_tokens_seen="no")
    t.control = TrainerControl()
    t.callback_handler = CallbackHandler([], None, None, None, None)
    t.accelerator = SimpleNamespace(is_main_process=False, num_processes=1)
    t.log_completions = False
    t.epsilon_low = t.epsilon_high = 0.2
    return t


def state(step=0):
    return SimpleNamespace(global_step=step, is_world_process_zero=True)


def run_steps(cb, trainer, steps, *, log_every=2, start=0):
    """Feed one batch per optimizer step; TRL's `log()` runs after the step's `on_step_end`, as in the Trainer."""
    logged = []
    for i, deltas in enumerate(steps, start=start + 1):
        cb.record(*batch(deltas) if not isinstance(deltas, tuple) else batch(deltas[0], train_nan=deltas[1]))
        trainer.state.global_step = i
        cb.on_step_end(None, state(i), None)
        if i % log_every == 0:
            trainer.log({})
            logged.append(trainer.state.log_history[-1])
    return logged


def pooled(steps):
    """The metrics of every token of the given steps, pooled (what a window's numbers must be)."""
    return metrics.finalize(
        metrics.merge_sums([metrics.mismatch_sums(*batch(d) if not isinstance(d, tuple) else batch(d[0], train_nan=d[1]))
                            for d in steps])
    )


STEPS = [
    [5.0, 0.0078125, -0.015625],  # one token 5 nats off
    [0.0078125] * 9 + [-0.5],
    [0.03125, 0.0625],
    [-3.0, NAN, 0.25],  # a token vLLM gave no log-prob for
]


def test_logged_max_min_and_counts_cover_the_whole_window(tmp_path):
    trainer = fake_grpo_trainer()
    cb = MismatchCallback(log_file=tmp_path / "mismatch.jsonl")
    cb.trainer = trainer
    cb.on_train_begin(None, state(0), None)
    logs = run_steps(cb, trainer, STEPS)
    rows = [r for r in lines(tmp_path / "mismatch.jsonl") if "step" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # the file stays one row per step
    for log, window in zip(logs, (rows[:2], rows[2:])):
        assert log["mismatch/abs_logp_diff/max"] == max(r["mismatch/abs_logp_diff/max"] for r in window)
        assert log["mismatch/ratio/max"] == max(r["mismatch/ratio/max"] for r in window)
        assert log["mismatch/ratio/min"] == min(r["mismatch/ratio/min"] for r in window)
        assert log["mismatch/seq_log_ratio/max_abs"] == max(r["mismatch/seq_log_ratio/max_abs"] for r in window)
        assert log["mismatch/tokens"] == sum(r["mismatch/tokens"] for r in window)
        assert log["mismatch/nan_tokens"] == sum(r["mismatch/nan_tokens"] for r in window)
    assert logs[0]["mismatch/abs_logp_diff/max"] == 5.0  # not the mean of the two steps' maxima (2.75)
    assert (logs[0]["mismatch/tokens"], logs[1]["mismatch/tokens"], logs[1]["mismatch/nan_tokens"]) == (13, 4, 1)


def test_logged_means_and_quantiles_are_token_weighted_over_the_window(tmp_path):
    trainer = fake_grpo_trainer()
    cb = MismatchCallback(log_file=None)
    cb.trainer = trainer
    cb.on_train_begin(None, state(0), None)
    logs = run_steps(cb, trainer, STEPS)
    for log, window in zip(logs, (STEPS[:2], STEPS[2:])):
        want = pooled(window)
        for key in metrics.METRIC_KEYS:
            assert log[key] == pytest.approx(want[key], rel=1e-12, abs=0.0), key
    # Step 1's three tokens and step 2's ten weigh 3:10, not 1:1.
    k3 = [metrics.kl_k3(*batch(d)) for d in STEPS[:2]]
    assert logs[0]["mismatch/kl_k3"] == pytest.approx((3 * k3[0] + 10 * k3[1]) / 13, rel=1e-12)
    assert logs[0]["mismatch/kl_k3"] != pytest.approx((k3[0] + k3[1]) / 2, rel=1e-3)


def test_an_evaluation_log_does_not_cut_the_training_window(tmp_path):
    trainer = fake_grpo_trainer()
    cb = MismatchCallback(log_file=None)
    cb.trainer = trainer
    cb.on_train_begin(None, state(0), None)
    run_steps(cb, trainer, STEPS[:1], log_every=99)
    trainer.model.training = False  # evaluate(): TRL's log() consumes the "eval" metrics only
    trainer._metrics["eval"]["reward"].append(1.0)
    trainer.log({})
    trainer.model.training = True
    logs = run_steps(cb, trainer, STEPS[1:2], log_every=2, start=1)
    assert logs[0]["mismatch/abs_logp_diff/max"] == 5.0 and logs[0]["mismatch/tokens"] == 13


def test_a_window_left_at_the_end_is_logged_once_by_the_final_log(tmp_path):
    trainer = fake_grpo_trainer()
    cb = MismatchCallback(log_file=None)
    cb.trainer = trainer
    cb.on_train_begin(None, state(0), None)
    run_steps(cb, trainer, STEPS[:3])  # logs at 2; step 3 is left for the end-of-training log
    trainer.log({"train_runtime": 1.0})
    last = trainer.state.log_history[-1]
    assert last["mismatch/tokens"] == 2 and last["mismatch/abs_logp_diff/max"] == 0.0625
    assert not any(k.startswith("mismatch/") for k in trainer._metrics["train"])


# ---------------------------------------------------------------------------------------------- the log file


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_second_run_in_the_same_output_dir_keeps_the_first_runs_rows(tmp_path):
    path = tmp_path / "mismatch.jsonl"
    for n_steps in (3, 2):  # two trainers, one after the other, same output_dir
        trainer = fake_grpo_trainer()
        cb = MismatchCallback(log_file=path, run_info={"profile": "vllm-compiled"})
        cb.trainer = trainer
        cb.on_train_begin(None, state(0), None)
        run_steps(cb, trainer, STEPS[:n_steps])
    headers = [r for r in lines(path) if "run_info" in r]
    assert len(headers) == 2 and headers[0]["run_id"] != headers[1]["run_id"]
    assert all(h["resumed_at_step"] is None and h["started_at"] for h in headers)
    runs = callbacks.read_mismatch_runs(path)
    assert [[r["step"] for r in run["rows"]] for run in runs] == [[1, 2, 3], [1, 2]]
    assert [run["run_id"] for run in runs] == [h["run_id"] for h in headers]
    header, rows = callbacks.read_mismatch_log(path)  # the last run by default
    assert header["run_id"] == headers[1]["run_id"] and [r["step"] for r in rows] == [1, 2]
    assert [r["step"] for r in callbacks.read_mismatch_log(path, run=0)[1]] == [1, 2, 3]


def test_train_twice_on_the_same_callback_writes_a_header_per_run(tmp_path):
    path = tmp_path / "mismatch.jsonl"
    trainer = fake_grpo_trainer()
    cb = MismatchCallback(log_file=path)
    cb.trainer = trainer
    for _ in range(2):
        cb.on_train_begin(None, state(0), None)
        run_steps(cb, trainer, STEPS[:2])
    assert [len(run["rows"]) for run in callbacks.read_mismatch_runs(path)] == [2, 2]
    assert [r["step"] for r in cb.history] == [1, 2]  # this run's rows


def test_resume_on_the_same_trainer_logs_each_step_once(tmp_path):
    path = tmp_path / "mismatch.jsonl"
    trainer = fake_grpo_trainer()
    cb = MismatchCallback(log_file=path)
    cb.trainer = trainer
    first = TrainerState()
    cb.on_train_begin(None, first, None)
    run_steps(cb, trainer, STEPS)
    # train(resume_from_checkpoint=<checkpoint-2>) on the same object: the checkpoint's state names the run.
    cb.on_train_begin(None, TrainerState(global_step=2, stateful_callbacks=dict(first.stateful_callbacks)), None)
    run_steps(cb, trainer, STEPS[2:], start=2)
    steps = [r["step"] for r in lines(path) if "step" in r]
    assert steps == [1, 2, 3, 4, 3, 4]  # append-only: the first attempt's steps 3-4 stay, superseded by the resume
    headers = [r for r in lines(path) if "run_info" in r]
    assert [h["resumed_at_step"] for h in headers] == [None, 2]
    assert headers[0]["run_id"] == headers[1]["run_id"]  # one run, resumed
    (run,) = callbacks.read_mismatch_runs(path)
    assert [r["step"] for r in run["rows"]] == [1, 2, 3, 4] and len(run["headers"]) == 2
    assert [r["step"] for r in cb.history] == [1, 2, 3, 4]


def test_resume_only_touches_the_last_run(tmp_path):
    path = tmp_path / "mismatch.jsonl"
    for n_steps in (4, 3):
        trainer = fake_grpo_trainer()
        cb = MismatchCallback(log_file=path)
        cb.trainer = trainer
        begun = TrainerState()
        cb.on_train_begin(None, begun, None)
        run_steps(cb, trainer, STEPS[:n_steps])
    trainer = fake_grpo_trainer()
    cb = MismatchCallback(log_file=path)  # a new trainer resuming the second run at step 1
    cb.trainer = trainer
    cb.on_train_begin(None, TrainerState(global_step=1, stateful_callbacks=dict(begun.stateful_callbacks)), None)
    run_steps(cb, trainer, STEPS[1:3], start=1)
    runs = callbacks.read_mismatch_runs(path)
    assert [[r["step"] for r in run["rows"]] for run in runs] == [[1, 2, 3, 4], [1, 2, 3]]
    assert [r["step"] for r in lines(path) if "step" in r] == [1, 2, 3, 4, 1, 2, 3, 2, 3]


def test_a_torn_last_line_does_not_swallow_the_next_header(tmp_path):
    path = tmp_path / "mismatch.jsonl"
    trainer = fake_grpo_trainer()
    cb = MismatchCallback(log_file=path)
    cb.trainer = trainer
    cb.on_train_begin(None, state(0), None)
    run_steps(cb, trainer, STEPS[:2])
    with open(path, "a") as fh:
        fh.write('{"step": 3, "mismatch/kl')  # the process was killed mid-write
    cb2 = MismatchCallback(log_file=path)
    cb2.trainer = fake_grpo_trainer()
    cb2.on_train_begin(None, state(0), None)
    run_steps(cb2, cb2.trainer, STEPS[:1])
    assert [[r["step"] for r in run["rows"]] for run in callbacks.read_mismatch_runs(path)] == [[1, 2], [1]]


def test_reader_accepts_a_file_without_run_ids(tmp_path):
    """Files written before runs carried an id: each header that is not a resume starts a run."""
    path = tmp_path / "old.jsonl"
    rows = [{"run_info": {"p": 1}, "resumed_at_step": None}, {"step": 1}, {"step": 2},
            {"run_info": {"p": 1}, "resumed_at_step": 1}, {"step": 2}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run,) = callbacks.read_mismatch_runs(path)
    assert [r["step"] for r in run["rows"]] == [1, 2] and run["header"]["run_info"] == {"p": 1}





def test_a_step_with_nonfinite_logprobs_is_logged_and_warned(tmp_path, caplog):
    trainer = fake_grpo_trainer()
    cb = MismatchCallback(log_file=None)
    cb.trainer = trainer
    cb.on_train_begin(None, state(0), None)
    with caplog.at_level("WARNING", logger="trl_roundalign.trainer.callbacks"):
        logs = run_steps(cb, trainer, [([0.0, 0.0, 0.0, 0.0], 2), ([0.0, 0.0], 2)])
    assert logs[0]["mismatch/nonfinite_train_tokens"] == 4 and logs[0]["mismatch/nan_tokens"] == 4
    assert logs[0]["mismatch/frac_bitwise_equal"] == 1.0  # over the finite tokens only, as documented
    assert "not finite" in caplog.text and "mismatch/nan_tokens" in caplog.text
