"""`recipes/cpu/stability.py` (`make experiment`): bad input, the rows files, the summary and figure, stop and resume.

The study itself (SmolLM2-135M, 200 steps per condition) runs for hours and is not part of the suite. Here the
recipe's own code runs on the tiny Qwen3 (`--model tiny-qwen3`) in this process: 2 steps, then the same command
with `--steps 3`, which resumes from the step-2 checkpoint after a torn step-3 row was left in the rows file, as a
run killed while writing it leaves it (rows of whole steps after a checkpoint are dropped the same way: see
`test_rows_after_a_checkpoint_are_dropped_and_summary_rebuilds_from_rows`).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "recipes" / "cpu" / "stability.py"


@pytest.fixture(scope="module")
def stability():
    spec = importlib.util.spec_from_file_location("roundalign_recipes_stability", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: "), err
    return err[0]


def test_conditions_are_the_papers(stability):
    from trl_roundalign.profiles import PAPER_CONDITIONS

    assert {name: tuple(r) for name, r in stability.CONDITIONS.items()} == PAPER_CONDITIONS
    assert stability.SETTINGS["vllm_importance_sampling_correction"] is False
    assert stability.SETTINGS["num_iterations"] > 1  # the PPO clip acts only on reused batches


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--conditions", "bf16", "exact"], "unknown condition(s) 'bf16'"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--save-steps", "3"], "multiple of num_iterations=2"),
        (["--seeds", "0", "0"], "must not repeat"),
        (["--model", "tiny-qwen3"], "needs --results-dir"),
    ],
)
def test_bad_input_is_one_line(stability, capsys, argv, says):
    assert stability.main(argv) == 2
    assert says in _error_line(capsys)


def test_plot_only_without_rows_is_one_line(stability, capsys, tmp_path):
    assert stability.main(["--plot-only", "--results-dir", str(tmp_path)]) == 2
    assert "nothing to summarise" in _error_line(capsys)


def _header(stability, condition, seed, resumed_at=0, **settings):
    return {
        "header": {
            "condition": condition,
            "seed": seed,
            "settings": {"model": "m", **stability.SETTINGS, **settings},
            "machine": stability.machine_info(),
            "load_avg": [1.0, 1.0, 1.0],
            "resumed_at_step": resumed_at,
        }
    }


def _row(step, **values):
    base = {"step": step, "time": 1.0e9 + step, "step_s": 20.0, "grad_norm": 0.1, "entropy": 0.5}
    if step % 2:  # generation steps carry the reward and the mismatch
        base.update({"reward": 0.25 * (step % 4), "mismatch/kl_k3": 1e-4 * step, "mismatch/frac_outside_clip": 0.01})
    return {**base, **values}


def test_rows_after_a_checkpoint_are_dropped_and_summary_rebuilds_from_rows(stability, tmp_path):
    results = tmp_path / "results"
    path = stability.rows_path(results, "bf16_default", 0)
    path.parent.mkdir(parents=True)
    lines = [_header(stability, "bf16_default", 0), *(_row(s) for s in range(1, 6))]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 6, "tim')  # torn by a kill
    assert stability.drop_rows_after(path, 4) == 2  # step 5 and the torn line
    assert [r["step"] for r in stability.step_rows(stability.read_jsonl(path))] == [1, 2, 3, 4]
    other = stability.rows_path(results, "exact", 0)
    other.write_text("".join(json.dumps(x) + "\n" for x in [_header(stability, "exact", 0), _row(1), _row(2)]))

    assert stability.main(["--plot-only", "--results-dir", str(results)]) == 0
    summary = json.loads((results / "summary.json").read_text())
    assert set(summary) == {"conditions", "settings", "machine"}
    assert list(summary["conditions"]) == ["bf16_default", "exact"]  # the study's order
    assert summary["conditions"]["bf16_default"]["steps"] == 4 and summary["conditions"]["exact"]["steps"] == 2
    bf16 = summary["conditions"]["bf16_default"]
    assert bf16["reward_mean"] == pytest.approx((0.25 + 0.75) / 2)  # steps 1 and 3 carry a reward
    assert bf16["kl_k3_max"] == pytest.approx(3e-4) and bf16["wall_s"] == 80.0
    assert bf16["kl_k3_median"] == pytest.approx(2e-4) and bf16["kl_k3_generations_below_1e-9"] == 0
    assert bf16["reward_max"] == pytest.approx(0.75) and bf16["reward_best_window"] is None  # < 10 values
    assert summary["conditions"]["exact"]["first_step_sampled_unlike_bf16_default"] == {"0": None}  # same rows
    assert "first_step_sampled_unlike_bf16_default" not in bf16
    assert summary["settings"]["num_iterations"] == stability.SETTINGS["num_iterations"]
    assert {"cpu", "isa", "cores", "torch", "vllm", "trl"} <= set(summary["machine"])
    assert (results / "stability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_step_where_samples_part_is_the_first_generation_that_differs(stability):
    base = [_row(s) for s in range(1, 9)]
    assert stability.first_step_sampled_apart(base, base) is None
    other = [_row(s, num_tokens=100) if s >= 5 else _row(s) for s in range(1, 9)]
    assert stability.first_step_sampled_apart(other, base) == 5
    # Steps without a generation (no reward) do not count, nor do steps the baseline has not reached.
    assert stability.first_step_sampled_apart([_row(s, entropy=9.0) for s in range(1, 9)], base) is None
    assert stability.first_step_sampled_apart(other, base[:3]) is None


def test_other_settings_in_a_rows_file_refuse_to_resume(stability, tmp_path):
    results = tmp_path / "results"
    path = stability.rows_path(results, "exact", 0)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(_header(stability, "exact", 0, learning_rate=3e-6)) + "\n")
    settings = {"model": "m", **stability.SETTINGS}
    with pytest.raises(stability.UsageError, match=re.escape(f"learning_rate 3e-06 -> {settings['learning_rate']!r}")):
        stability.plan_run("exact", 0, 3, results, tmp_path / "out", settings)
    # Steps logged but no checkpoint left (outputs/ cleaned): starting over would discard them.
    path.write_text("".join(json.dumps(x) + "\n" for x in [_header(stability, "exact", 0), _row(1), _row(2)]))
    with pytest.raises(stability.UsageError, match="no checkpoint"):
        stability.plan_run("exact", 0, 3, results, tmp_path / "out", settings)
    # A checkpoint past the logged steps (the rows were moved away): resuming would leave steps unlogged.
    (tmp_path / "out" / "exact_seed0" / "checkpoint-2").mkdir(parents=True)
    path.write_text(json.dumps(_header(stability, "exact", 0)) + "\n")
    with pytest.raises(stability.UsageError, match="is at step 2 but .* logs 0 steps"):
        stability.plan_run("exact", 0, 3, results, tmp_path / "out", settings)


@pytest.mark.full  # 33 s; make test-full: kept out of make test for its time (docs/evidence.md, 'make test-full')
@pytest.mark.vllm
@pytest.mark.slow
def test_tiny_model_runs_stops_and_resumes_without_duplicate_rows(stability, tmp_path, capfd):
    # capfd, not capsys: vLLM redirects stdout through its file descriptor while it starts
    results, out = tmp_path / "results", tmp_path / "out"
    # bf16_default: no start-up profile check, the cheapest condition (the others differ only in regions, checked above)
    common = ["--model", "tiny-qwen3", "--conditions", "bf16_default", "--save-steps", "2"]
    common += ["--results-dir", str(results), "--output-dir", str(out)]
    assert stability.main([*common, "--steps", "2"]) == 0
    rows_file = stability.rows_path(results, "bf16_default", 0)
    assert [r["step"] for r in stability.step_rows(stability.read_jsonl(rows_file))] == [1, 2]
    assert [p.name for p in (out / "bf16_default_seed0").glob("checkpoint-*")] == ["checkpoint-2"]
    with open(rows_file, "a") as fh:  # what a run killed while writing its step-3 row leaves
        fh.write('{"step": 3, "time": 17')

    assert stability.main([*common, "--steps", "3"]) == 0
    printed = capfd.readouterr().out
    assert "starting from checkpoint" in printed and "dropped 1 rows" in printed
    assert "step 3/3" in printed and "ETA" in printed
    lines = stability.read_jsonl(rows_file)
    steps = [r["step"] for r in lines if "step" in r]
    assert steps == [1, 2, 3], steps  # no step twice, the torn row gone
    assert [r["header"]["resumed_at_step"] for r in lines if "header" in r] == [0, 2]
    step1, step3 = lines[1], lines[-1]
    for row in (step1, step3):  # generation steps: reward, mismatch, TRL's clip ratios and the rest
        for key in ("reward", "mismatch/kl_k3", "mismatch/frac_outside_clip", "mismatch/abs_logp_diff/p99",
                    "clip_ratio/region_mean", "entropy", "grad_norm", "completions/mean_length", "step_s"):  # fmt: skip
            assert key in row, (row["step"], key)
    assert [p.name for p in (out / "bf16_default_seed0").glob("checkpoint-*")] == ["checkpoint-3"]  # latest only

    summary = json.loads((results / "summary.json").read_text())
    assert set(summary) == {"conditions", "settings", "machine"}
    assert summary["conditions"]["bf16_default"]["steps"] == 3
    assert summary["conditions"]["bf16_default"]["sittings"] == 2
    assert summary["settings"]["model"] == "tiny-qwen3"
    assert (results / "stability.png").stat().st_size > 10_000

    assert stability.main([*common, "--steps", "3"]) == 0  # done already: nothing trains, nothing is logged
    assert "skipped" in capfd.readouterr().out
    assert len(stability.read_jsonl(rows_file)) == len(lines)
