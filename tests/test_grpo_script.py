"""`recipes/grpo.py`, `recipes/eval_aime.py` and the CPU demo's helpers: arguments, data, errors, a real run.

The fast tests load the scripts as modules and call their functions (or `main`) in-process; the slow
ones run them as people do: `accelerate launch ... recipes/grpo.py --config recipes/cpu/smollm2_arithmetic.yaml`
for 2 steps, and `recipes/eval_aime.py` on a tiny model with vLLM.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.env import subprocess_env

from trl_roundalign.profiles import PAPER_CONDITIONS

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
CPU_RECIPE = RECIPES / "cpu" / "smollm2_arithmetic.yaml"
CPU_ACCELERATE = RECIPES / "accelerate_configs" / "cpu.yaml"


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def grpo():
    return _load(RECIPES / "grpo.py", "roundalign_recipes_grpo")


@pytest.fixture(scope="module")
def eval_aime():
    return _load(RECIPES / "eval_aime.py", "roundalign_recipes_eval_aime")


@pytest.fixture(scope="module")
def demo():
    return _load(RECIPES / "cpu" / "demo.py", "roundalign_recipes_demo")


def _parse(grpo, *extra):
    return grpo.parse_args(["--config", str(CPU_RECIPE), *extra])


# ------------------------------------------------------------------------------------------------
# Conditions


def test_conditions_are_the_papers(grpo):
    assert set(grpo.CONDITIONS) == {
        "bf16_default", "rope_only", "three_region", "exact", "tis", "mis", "fp32_lm_head", "fp16",
    }  # fmt: skip
    for name, regions in PAPER_CONDITIONS.items():
        assert tuple(grpo.CONDITIONS[name]["roundalign_regions"]) == regions


@pytest.mark.parametrize(
    "condition", ["bf16_default", "rope_only", "three_region", "tis", "mis", "fp32_lm_head", "fp16"]
)
def test_condition_sets_its_options_over_the_yaml(grpo, condition):
    _, args, model_args = _parse(grpo, "--condition", condition)
    expected_regions = {"rope_only": ["rope"], "three_region": ["rope", "swiglu", "rmsnorm"]}.get(condition, [])
    assert list(args.roundalign_regions) == expected_regions
    assert args.vllm_importance_sampling_correction is (condition in ("tis", "mis"))
    if condition == "tis":
        assert args.vllm_importance_sampling_mode == "token_truncate"
    if condition == "mis":
        assert args.vllm_importance_sampling_mode == "sequence_mask"
    assert args.cast_lm_head_to_fp32 is (condition == "fp32_lm_head")
    half = condition == "fp16"
    assert args.fp16 is half and args.bf16 is (not half)
    assert grpo.model_init_kwargs(args, model_args)["dtype"] == ("float16" if half else "bfloat16")
    assert (args.vllm_engine_kwargs or {}).get("dtype") == ("float16" if half else None)
    assert args.use_cpu or torch.cuda.is_available()


def test_flags_after_the_condition_override_it(grpo):
    _, args, _ = _parse(grpo, "--condition", "three_region", "--roundalign_regions", "rope")
    assert list(args.roundalign_regions) == ["rope"]
    _, args, _ = _parse(grpo, "--condition", "tis", "--vllm_importance_sampling_mode", "sequence_mask")
    assert args.vllm_importance_sampling_correction is True and args.vllm_importance_sampling_mode == "sequence_mask"


def test_unknown_condition_lists_the_valid_names(grpo):
    with pytest.raises(ValueError, match=r"unknown condition 'nope'; valid conditions: bf16_default, .*three_region"):
        grpo.condition_overrides("nope")


def test_yaml_and_cli_overrides(grpo):
    _, args, model_args = _parse(grpo, "--max_steps", "2", "--learning_rate", "3e-6")
    assert args.max_steps == 2 and args.learning_rate == 3e-6
    assert model_args.model_name_or_path == "smollm2-135m"
    assert grpo.model_init_kwargs(args, model_args)["dtype"] == "bfloat16"


def test_dtype_contradiction_is_an_error(grpo):
    _, args, model_args = _parse(grpo, "--dtype", "float16", "--model_init_kwargs", '{"dtype": "float32"}')
    with pytest.raises(ValueError, match="contradicts"):
        grpo.model_init_kwargs(args, model_args)


# ------------------------------------------------------------------------------------------------
# Data


def _write_rows(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".parquet":
        import datasets

        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_local_dataset_with_another_prompt_column(grpo, tmp_path, suffix):
    rows = [{"question": f"What is {i} plus 1?", "answer": str(i + 1)} for i in range(5)]
    path = _write_rows(tmp_path / f"prompts{suffix}", rows)
    ds = grpo.load_prompt_dataset(str(path), "train", prompt_column="question")
    assert ds.column_names == ["prompt", "answer"] and len(ds) == 5
    assert ds[0]["prompt"] == "What is 0 plus 1?"
    assert len(grpo.load_prompt_dataset(str(path), "train[:2]", prompt_column="question")) == 2


def test_packaged_arithmetic_dataset(grpo):
    ds = grpo.load_prompt_dataset("arithmetic", "train")
    assert {"prompt", "answer"} <= set(ds.column_names) and len(ds) == 500


def test_prompt_column_clash(grpo, tmp_path):
    path = _write_rows(tmp_path / "p.jsonl", [{"prompt": "a", "question": "b", "answer": "1"}])
    with pytest.raises(ValueError, match="besides prompt_column"):
        grpo.load_prompt_dataset(str(path), "train", prompt_column="question")


# ------------------------------------------------------------------------------------------------
# Bad input: one line `error: ...`, exit code 2, no traceback


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--condition", "nope"],
            "error: unknown condition 'nope'; valid conditions: bf16_default, rope_only, three_region",
        ),
        (
            ["--dataset_name", "data/does_not_exist.jsonl"],
            "error: dataset file 'data/does_not_exist.jsonl' does not exist",
        ),
        (["--prompt_column", "question"], "error: dataset 'arithmetic' has no column 'question' (prompt_column)"),
        (["--reward_funcs", "nope_reward"], "error: unknown reward function(s) 'nope_reward'"),
    ],
    ids=["condition", "dataset-path", "prompt-column", "reward"],
)
def test_bad_input_is_one_line(grpo, capsys, extra, message):
    assert grpo.main(["--config", str(CPU_RECIPE), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err


def test_missing_config_is_one_line(grpo, capsys):
    assert grpo.main(["--config", "recipes/nope.yaml"]) == 2
    assert capsys.readouterr().err.strip() == "error: config file 'recipes/nope.yaml' does not exist"


def test_bad_input_from_the_command_line_has_no_traceback():
    proc = subprocess.run(
        [sys.executable, "recipes/grpo.py", "--config", str(CPU_RECIPE.relative_to(ROOT)), "--condition", "nope"],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: unknown condition 'nope'; valid conditions:"), proc.stderr[-2000:]


def test_eval_aime_bad_input(eval_aime, capsys):
    assert eval_aime.main(["tiny-qwen3", "--dataset", "data/no_such_aime.jsonl"]) == 2
    assert capsys.readouterr().err.strip() == "error: dataset file 'data/no_such_aime.jsonl' does not exist"


def test_eval_aime_columns(eval_aime, tmp_path, capsys):
    path = _write_rows(tmp_path / "aime.jsonl", [{"text": "1+1?", "solution": "2"}])
    assert eval_aime.main(["tiny-qwen3", "--dataset", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # above it: datasets' progress bars
    assert err.startswith("error: dataset") and "no problem column" in err and "--problem-column" in err


def test_time_budget_stops_after_the_step_that_passes_it(grpo, monkeypatch):
    from transformers import TrainerControl, TrainerState

    clock = iter([0.0, 5.0, 12.0])
    monkeypatch.setattr(grpo.time, "monotonic", lambda: next(clock))
    cb, state, control = grpo.TimeBudgetCallback(10), TrainerState(), TrainerControl()
    cb.on_train_begin(None, state, control)
    state.global_step = 1
    cb.on_step_end(None, state, control)
    assert not control.should_training_stop
    state.global_step = 2
    cb.on_step_end(None, state, control)
    assert control.should_training_stop and cb.stopped_at == 2


def test_step_limit_file_stops_at_its_count_and_may_change(grpo, tmp_path):
    from transformers import TrainerControl, TrainerState

    path = tmp_path / "limit"
    path.write_text("3\n")
    cb, state, control = grpo.StepLimitCallback(path), TrainerState(), TrainerControl()
    for step in (1, 2):
        state.global_step = step
        cb.on_step_end(None, state, control)
        assert not control.should_training_stop
    path.write_text("2")  # lowered below the current step while the run trains: stop now
    state.global_step = 3
    cb.on_step_end(None, state, control)
    assert control.should_training_stop and cb.stopped_at == 3
    for bad, says in (("", "not a step count"), ("x", "not a step count"), ("0", "at least 1")):
        path.write_text(bad)
        with pytest.raises(ValueError, match=says):
            grpo.StepLimitCallback(path)


# ------------------------------------------------------------------------------------------------
# The demo's plan, phases, table and summary


def test_demo_plans_equal_steps_from_the_measured_first_step(demo):
    # 13 min budget, 120 s start-up, 20 s a step, 600 s left after the first step:
    # (600 - 20 - 120 + 1 * 20) / 40 = 12 steps per run.
    assert demo.plan_steps(requested=30, done=1, step_s=20.0, startup_s=120.0, remaining_s=600.0) == 12
    assert demo.plan_steps(requested=30, done=1, step_s=2.0, startup_s=60.0, remaining_s=600.0) == 30  # capped
    # A slow machine: never below the step under way (the one after the last row the demo has seen).
    assert demo.plan_steps(requested=30, done=4, step_s=200.0, startup_s=300.0, remaining_s=100.0) == 5
    assert demo.plan_steps(requested=30, done=1, step_s=500.0, startup_s=300.0, remaining_s=10.0) == 2
    assert demo.plan_steps(requested=3, done=3, step_s=1.0, startup_s=1.0, remaining_s=1e4) == 3
    assert demo.plan_steps(requested=30, done=1, step_s=500.0, startup_s=300.0, remaining_s=None) == 30


def test_demo_reads_phases_in_order(demo):
    log = "x\n[phase] loading the prompts and rewards\n[phase] building the trainer: ...\n"
    assert demo.PHASES[demo.phase_of(log)][1] == "loading the model"
    log += "INFO ... Dynamo bytecode transform time: 3.1 s\n"
    i = demo.phase_of(log)
    assert "compiling" in demo.PHASES[i][1]
    assert demo.phase_of(log + "[phase] training\n", i) == len(demo.PHASES) - 1
    assert demo.phase_of("nothing yet") == -1


def test_demo_plot_has_integer_steps_and_says_lower_is_better(demo, tmp_path):
    rows = [{"step": s, "reward": 0.1 * s, "mismatch/kl_k3": 1e-3 / s} for s in (1, 2)]
    path = tmp_path / "kl.png"
    demo.plot_kl({"three_region": rows, "bf16_default": rows[:1]}, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    src = inspect.getsource(demo.plot_kl)
    assert "lower is better" in src and "MaxNLocator(integer=True)" in src


def test_demo_table_and_summary(demo):
    rows = [
        {"step": s, "reward": 0.25 * s, "mismatch/kl_k3": 1e-3 * s, "mismatch/abs_logp_diff/mean": 0.03,
         "mismatch/frac_outside_clip": 0.0, "step_time": 3.0}
        for s in range(1, 7)
    ]  # fmt: skip
    assert len(demo.table_row(rows[0])) == len(demo.table_header())
    summary = demo.summarize(rows, 12.0)
    assert summary["steps"] == 6 and math.isclose(summary["reward_mean"], 0.875)
    assert math.isclose(summary["kl_k3_last5"], 4e-3)
    table = demo.summary_table({"three_region": summary, "bf16_default": demo.summarize(rows[:3], 5.0)})
    assert "mismatch/kl_k3, mean" in table and "three_region" in table
    cmd = demo.launch_command("three_region", ROOT / "outputs" / "x", 30, ROOT / "outputs" / "x" / "step_limit")
    assert cmd[cmd.index("--step_limit_file") + 1] == "outputs/x/step_limit"
    assert cmd[:4] == ["accelerate", "launch", "--config_file", "recipes/accelerate_configs/cpu.yaml"]
    assert "recipes/grpo.py" in cmd and cmd[cmd.index("--condition") + 1] == "three_region"


# ------------------------------------------------------------------------------------------------
# Real runs


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize(
    "model", ["peaked-qwen3"] + [pytest.param(m, marks=pytest.mark.full) for m in ("smollm2-135m", "peaked-qwen3-moe")]
)
def test_cpu_recipe_two_steps_through_accelerate_launch(tmp_path, model):
    """The CPU demo's recipe, 2 GRPO steps, launched the way the demo and README launch it (`make test`: on a
    tiny model; the recipe's own SmolLM2, about 1.5 min per step on an AVX2 2-core CPU, and Qwen3-MoE, whose engine
    must be its process's first, in `make test-full`)."""
    out = tmp_path / "run"
    limit = tmp_path / "step_limit"
    limit.write_text("2")  # as the demo plans it: the file, not --max_steps 3, ends the run
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CPU_ACCELERATE),
        "recipes/grpo.py", "--config", str(CPU_RECIPE), "--max_steps", "3", "--output_dir", str(out),
        "--save_final_model", "false", "--model_name_or_path", model, "--step_limit_file", str(limit),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The start-up phases the demo shows, in order.
    phases = [line for line in proc.stdout.splitlines() if line.startswith("[phase] ")]
    assert [p.split(":")[0] for p in phases] == [
        "[phase] loading the prompts and rewards", "[phase] building the trainer", "[phase] training"
    ]  # fmt: skip
    rows = [json.loads(line) for line in (out / "log_history.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "mismatch/kl_k3" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert math.isfinite(r["mismatch/kl_k3"]) and r["mismatch/kl_k3"] >= 0
        assert r["mismatch/tokens"] > 0 and "reward" in r
    header = json.loads((out / "mismatch.jsonl").read_text().splitlines()[0])
    assert header["run_info"]["regions"] == ["rope", "swiglu", "rmsnorm"]
    assert header["run_info"]["profile"] == "vllm-compiled"


@pytest.mark.slow
@pytest.mark.full  # a script-run check (make test stays under 40 min on the AVX2 machine)
@pytest.mark.vllm
def test_eval_aime_on_a_tiny_model(tmp_path):
    rows = [
        {"problem": "What is 1 + 1?", "answer": "2", "id": "a"},
        {"problem": "What is 2 + 3?", "answer": "5", "id": "b"},
    ]
    data = _write_rows(tmp_path / "aime.jsonl", rows)
    out = tmp_path / "eval.json"
    cmd = [
        sys.executable, "recipes/eval_aime.py", "tiny-qwen3", "--dataset", str(data), "--num-samples", "3",
        "--max-tokens", "8", "--max-model-len", "512", "--enforce-eager", "--output", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["num_problems"] == 2 and report["num_samples"] == 3
    assert 0.0 <= report["avg@3"] <= 1.0
    assert [p["id"] for p in report["per_problem"]] == ["a", "b"]
    assert report["temperature"] == 0.6 and report["top_p"] == 0.95
    assert "avg@3 = " in proc.stdout
