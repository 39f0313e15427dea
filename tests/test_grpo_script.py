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


def test_demo_runs_default_three_regions_and_exact(demo):
    assert demo.CONDITIONS == ("bf16_default", "three_region", "exact")
    assert set(demo.CONDITIONS) <= set(PAPER_CONDITIONS) and demo.MIN_STEPS == 10


def test_demo_plans_go_from_smollm2_to_the_toy_model(demo):
    assert demo.PLANS[0].model == "smollm2-135m" and demo.PLANS[-1].model == "peaked-qwen3"
    assert len(set(demo.PLAN_NAMES)) == len(demo.PLANS)
    for plan in demo.PLANS:
        assert plan.batch % plan.num_generations == 0  # TRL: whole groups of completions per step
    # Completions per step and their length never grow down the table.
    sizes = [p.batch * p.max_completion_length for p in demo.PLANS if p.model == "smollm2-135m"]
    assert sizes == sorted(sizes, reverse=True)
    assert set(demo.RECORDED) == {"avx2", "avx512", "amx"}
    assert all(set(times) <= set(demo.PLAN_NAMES) for times in demo.RECORDED.values())
    assert "2 prompts x 4 completions of up to 32 tokens" in demo.PLANS[0].describe()


def test_demo_chooses_a_plan_per_cpu_kind(demo):
    budget = 13 * 60.0
    # AVX2: three SmolLM2 start-ups alone take most of the budget; the toy model fits.
    plan, why = demo.choose_plan("avx2", budget)
    assert plan.name == "peaked-qwen3"
    assert "smollm2: recorded on avx2" in why and "over 13.0 min" in why and "within 13.0 min" in why
    for kind in ("avx512", "amx"):
        assert demo.choose_plan(kind, budget)[0].name == "smollm2"
    # No record for a plan on a kind: it is tried (the first run measures it); no budget: the first plan.
    recorded = {"avx2": {"smollm2": (200.0, 100.0)}}
    plan, why = demo.choose_plan("avx2", budget, recorded=recorded)
    assert plan.name == "smollm2-short" and "measured on the first run" in why
    assert demo.choose_plan("avx2", None)[0].name == "smollm2"
    # Nothing fits: the cheapest, and the reason says the budget will be exceeded.
    plan, why = demo.choose_plan("avx2", 60.0)
    assert plan is demo.PLANS[-1] and "exceed the budget" in why
    # A fallback chooses among the cheaper plans only.
    assert demo.choose_plan("avx512", budget, demo.PLANS[1:])[0].name != "smollm2"


def test_demo_plans_equal_steps_from_the_measured_first_step(demo):
    # 700 s left after the first step, 10 s a step, 60 s start-up, three runs, 30 s margin:
    # (700 - 30 - 2 * 60 + 1 * 10) / 30 = 18 steps per run.
    assert demo.steps_that_fit(done=1, step_s=10.0, startup_s=60.0, remaining_s=700.0) == 18
    assert demo.plan_steps(requested=30, done=1, step_s=10.0, startup_s=60.0, remaining_s=700.0) == 18
    assert demo.plan_steps(requested=30, done=1, step_s=1.0, startup_s=60.0, remaining_s=700.0) == 30  # capped
    # Never fewer than 10 steps, however slow the machine; never below the step under way.
    assert demo.steps_that_fit(done=1, step_s=100.0, startup_s=200.0, remaining_s=300.0) < 10
    assert demo.plan_steps(requested=30, done=1, step_s=100.0, startup_s=200.0, remaining_s=300.0) == 10
    assert demo.plan_steps(requested=30, done=12, step_s=100.0, startup_s=200.0, remaining_s=10.0) == 13
    assert demo.plan_steps(requested=30, done=1, step_s=500.0, startup_s=300.0, remaining_s=None) == 30
    assert demo.seconds_needed(60.0, 3.0) == 3 * (60 + 10 * 3)


def test_demo_reads_phases_in_order(demo):
    log = "x\n[phase] loading the prompts and rewards\n[phase] building the trainer: ...\n"
    assert demo.PHASES[demo.phase_of(log)][1] == "loading the model"
    log += "INFO ... Dynamo bytecode transform time: 3.1 s\n"
    i = demo.phase_of(log)
    assert "compiling" in demo.PHASES[i][1]
    assert demo.phase_of(log + "[phase] training\n", i) == len(demo.PHASES) - 1
    assert demo.phase_of("nothing yet") == -1


def _demo_rows(condition: str, steps: int = 6) -> list[dict]:
    exact = condition == "exact"
    return [
        {"step": s, "reward": 0.25 * s, "rewards/arithmetic_reward/mean": 0.0,
         "mismatch/kl_k3": 0.0 if exact else 1e-3 * s, "mismatch/frac_bitwise_equal": 1.0 if exact else 0.01,
         "mismatch/abs_logp_diff/mean": 0.0 if exact else 0.03, "mismatch/frac_outside_clip": 0.0, "step_time": 3.0}
        for s in range(1, steps + 1)
    ]  # fmt: skip


def test_demo_plot_shows_exacts_zero_and_bit_identity(demo, tmp_path):
    runs = {c: _demo_rows(c, 3) for c in demo.CONDITIONS}
    path = tmp_path / "kl.png"
    demo.plot_kl(runs, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    src = inspect.getsource(demo.plot_kl)
    assert "lower is better" in src and "MaxNLocator(integer=True)" in src and "mismatch/frac_bitwise_equal" in src
    assert demo.ZERO_LABEL == "0 (bit-identical)" and "ZERO_LABEL" in src
    # Zero is drawn a decade below the smallest positive value (a power of 10).
    assert demo.zero_floor([0.0, 3e-3, 2e-2]) == pytest.approx(1e-4)
    assert demo.zero_floor([0.0]) == 1e-6
    demo.plot_kl({"three_region": runs["three_region"]}, tmp_path / "no-zero.png")  # no zero: a plain log axis


def test_demo_table_and_summary(demo):
    rows = _demo_rows("three_region")
    assert len(demo.table_row(rows[0])) == len(demo.table_header())
    assert "bit-identical" in demo.table_header()
    summary = demo.summarize(rows, 12.0)
    assert summary["steps"] == 6 and math.isclose(summary["reward_mean"], 0.875)
    assert math.isclose(summary["kl_k3_last5"], 4e-3) and math.isclose(summary["kl_k3_max"], 6e-3)
    assert math.isclose(summary["frac_bitwise_equal_mean"], 0.01) and summary["step_s_mean"] == 3.0
    summaries = {c: demo.summarize(_demo_rows(c), 12.0) for c in demo.CONDITIONS}
    assert summaries["exact"]["kl_k3_max"] == 0.0 and summaries["exact"]["frac_bitwise_equal_min"] == 1.0
    table = demo.summary_table(summaries)
    assert "mismatch/kl_k3, mean" in table and "bit-identical, mean" in table
    assert all(c in table.splitlines()[0] for c in demo.CONDITIONS)
    assert "exact: kl_k3 0 and every token bit-identical to the sampler, at every step" in table
    assert "three_region: mean kl_k3 1.00x bf16_default's" in table
    # A missing value prints as "-".
    assert demo.table_row({"step": 1}).split()[1:] == ["-"] * len(demo.COLUMNS)


def test_demo_launch_command_carries_the_plan(demo, grpo):
    plan = demo.PLANS[-1]
    cmd = demo.launch_command("exact", ROOT / "outputs" / "x", 30, plan, ROOT / "outputs" / "x" / "step_limit")
    assert cmd[cmd.index("--step_limit_file") + 1] == "outputs/x/step_limit"
    assert cmd[:4] == ["accelerate", "launch", "--config_file", "recipes/accelerate_configs/cpu.yaml"]
    assert "recipes/grpo.py" in cmd and cmd[cmd.index("--condition") + 1] == "exact"
    assert cmd[cmd.index("--model_name_or_path") + 1] == "peaked-qwen3"
    assert cmd[cmd.index("--max_completion_length") + 1] == str(plan.max_completion_length)
    assert cmd[cmd.index("--per_device_train_batch_size") + 1] == str(plan.batch)
    assert cmd[cmd.index("--num_generations") + 1] == str(plan.num_generations)
    i = cmd.index("--reward_funcs")
    assert cmd[i + 1 : i + 3] == ["arithmetic_partial_reward", "arithmetic_reward"]
    assert cmd[cmd.index("--reward_weights") + 1 :][:2] == ["1", "0"]
    # recipes/grpo.py parses it: the plan's flags override the recipe, the condition sets exact's regions.
    assert cmd[4:7] == ["recipes/grpo.py", "--config", "recipes/cpu/smollm2_arithmetic.yaml"]
    script_args, args, model_args = _parse(grpo, *cmd[7:])
    assert model_args.model_name_or_path == "peaked-qwen3" and args.per_device_train_batch_size == plan.batch
    assert list(args.roundalign_regions) == ["rope", "swiglu", "rmsnorm", "attention"]
    assert script_args.reward_funcs == ["arithmetic_partial_reward", "arithmetic_reward"]
    assert args.reward_weights == [1.0, 0.0] and args.max_steps == 30


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "5"], "--steps must be at least 10"),
        (["--steps", "many"], "invalid int value"),
        (["--plan", "huge"], "unknown plan 'huge'; plans: smollm2, smollm2-short, peaked-qwen3"),
        (["--time-budget-min", "-1"], "--time-budget-min must be"),
        (["--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_demo_bad_input_is_one_line(demo, capsys, argv, message):
    assert demo.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


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
