"""GRPO with rounding alignment: the one training script behind every recipe.

    accelerate launch --config_file recipes/accelerate_configs/zero2.yaml \\
        recipes/grpo.py --config recipes/Qwen3-1.7B/grpo/config_three_region.yaml
    python recipes/grpo.py --config recipes/cpu/smollm2_arithmetic.yaml --max_steps 2   # one process

Arguments are read by `TrlParser((GRPOScriptArguments, RoundAlignGRPOConfig, ModelConfig))`: the YAML
given with `--config` sets them, command-line flags override the YAML (`--help` lists them all).

- Model: `model_name_or_path` is a hub id, a local checkpoint folder, or an offline name resolved by
  `trl_roundalign.local_models.resolve_model` (`smollm2-135m`, `tiny-qwen3`, ...). The policy loads with
  `model_init_kwargs` built from `ModelConfig` (`dtype`, `attn_implementation`, `model_revision`) as TRL's
  own `trl grpo` script does; `RoundAlignGRPOConfig.model_init_kwargs` entries win.
- Data: `dataset_name` is a hub id, a local `.jsonl`/`.json`/`.parquet`/`.csv` file or folder, or
  `arithmetic` (the packaged CPU-demo prompts, `trl_roundalign.data.arithmetic_dataset`). The column
  `prompt_column` becomes `prompt`; the other columns reach the reward functions.
- Rewards: `reward_funcs` names functions of `trl_roundalign.rewards.REWARD_FUNCS`; the generation limit
  and the tokenizer's EOS ids are bound in through `get_reward_funcs`.
- `condition`: optional shortcut for one of the paper's conditions (`CONDITIONS` below): it sets the
  region set, the importance-sampling correction, the fp32 head or the fp16 dtypes on top of the YAML;
  flags given after it on the command line still override it.

Every step logs `mismatch/*` (see `trl_roundalign.metrics.METRIC_DOCS`) with the rewards; the rows also go
to `<output_dir>/mismatch.jsonl` (mismatch only) and `<output_dir>/log_history.jsonl` (every logged value).

Bad input (an unknown condition or reward, a missing dataset file or column, a config file that does not
exist, an option the trainer refuses) ends with one line `error: ...` on stderr and exit code 2, before
training starts (`TRL_ROUNDALIGN_DEBUG=1` shows the traceback instead).
"""

import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from trl import ModelConfig, ScriptArguments, TrlParser

from trl_roundalign.cli import one_line

logger = logging.getLogger("recipes.grpo")

# The paper's conditions as field values of RoundAlignGRPOConfig / ModelConfig (`--condition NAME`).
CONDITIONS: dict[str, dict[str, Any]] = {
    "bf16_default": {"roundalign_regions": []},
    "rope_only": {"roundalign_regions": ["rope"]},
    "three_region": {"roundalign_regions": ["rope", "swiglu", "rmsnorm"]},
    "exact": {"roundalign_regions": ["rope", "swiglu", "rmsnorm", "attention"]},
    "tis": {
        "roundalign_regions": [],
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_mode": "token_truncate",
    },
    "mis": {
        "roundalign_regions": [],
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_mode": "sequence_mask",
    },
    "fp32_lm_head": {"roundalign_regions": [], "cast_lm_head_to_fp32": True},
    "fp16": {
        "roundalign_regions": [],
        "dtype": "float16",
        "bf16": False,
        "fp16": True,
        "model_init_kwargs": {"dtype": "float16"},
        "vllm_engine_kwargs": {"dtype": "float16"},
    },
}
# What every condition resets unless it sets it itself: conditions differ only in what they name.
_CONDITION_BASE: dict[str, Any] = {"vllm_importance_sampling_correction": False, "cast_lm_head_to_fp32": False}

LOCAL_DATA_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
PACKAGED_DATASETS = ("arithmetic",)


@dataclass
class GRPOScriptArguments(ScriptArguments):
    """Script arguments of `recipes/grpo.py` (TRL's `ScriptArguments` plus the fields below).

    Args:
        prompt_column (`str`): dataset column holding the prompt (text or chat messages); renamed to `prompt`.
        reward_funcs (`list[str]`): names from `trl_roundalign.rewards.REWARD_FUNCS`.
        condition (`str`, *optional*): one of `CONDITIONS`; sets that condition's options on top of the YAML.
        max_train_samples (`int`, *optional*): keep only the first N training rows (smoke runs).
        log_history_file (`str`, *optional*): JSONL of every logged row (default `<output_dir>/log_history.jsonl`).
        save_final_model (`bool`): save the trained model to `output_dir` at the end.
        max_train_seconds (`float`, *optional*): stop training after the step that passes this wall time.
        step_limit_file (`str`, *optional*): a file holding a step count, read after every step: training stops
            once it reaches that step (another process may lower or raise it while the run trains; the CPU demo
            plans its step count this way).
    """

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Prompts: a hub dataset id, a local .jsonl/.json/.parquet/.csv file or data folder, or "
            "'arithmetic' (the packaged CPU-demo prompt set)."
        },
    )
    prompt_column: str = field(
        default="prompt",
        metadata={"help": "Dataset column with the prompt (text or chat messages); renamed to 'prompt' for TRL."},
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": "Reward functions by name: r1_math_reward, boxed_math_reward, arithmetic_reward."},
    )
    condition: str | None = field(
        default=None,
        metadata={
            "help": f"Shortcut for one of the paper's conditions, applied on top of the YAML: {', '.join(CONDITIONS)}."
        },
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N training rows (smoke runs)."}
    )
    log_history_file: str | None = field(
        default=None,
        metadata={"help": "JSONL file with every logged row (default: <output_dir>/log_history.jsonl)."},
    )
    save_final_model: bool = field(default=True, metadata={"help": "Save the trained model to output_dir at the end."})
    max_train_seconds: float | None = field(
        default=None,
        metadata={"help": "Stop training after the first step that ends past this many seconds of training."},
    )
    step_limit_file: str | None = field(
        default=None,
        metadata={
            "help": "File holding a step count, read after every step: training stops once it reaches that step "
            "(it may be changed while the run trains)."
        },
    )


# ------------------------------------------------------------------------------------------------
# Arguments


def _cli_value(value: Any) -> list[str]:
    if isinstance(value, bool):
        return [str(value).lower()]
    if isinstance(value, dict):
        return [json.dumps(value)]
    if isinstance(value, list):
        return [str(v) for v in value] or ["none"]
    return [str(value)]


def condition_overrides(name: str, yaml_config: dict | None = None) -> dict[str, Any]:
    """The field values condition `name` sets (dict fields merged into the YAML's own values).

    Raises:
        ValueError: an unknown condition name.
    """
    if name not in CONDITIONS:
        raise ValueError(f"unknown condition {name!r}; valid conditions: {', '.join(CONDITIONS)}")
    values = {**_CONDITION_BASE, **CONDITIONS[name]}
    for key in ("model_init_kwargs", "vllm_engine_kwargs"):
        if key in values and isinstance((yaml_config or {}).get(key), dict):
            values[key] = {**yaml_config[key], **values[key]}
    return values


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _has_flag(argv: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def expand_argv(argv: Sequence[str]) -> list[str]:
    """Turn `--condition` into the flags it stands for and add `--use_cpu true` on a machine without a GPU.

    The added flags go first, so they override the YAML and any flag the user wrote still overrides them.
    """
    import yaml

    argv = list(argv)
    config_path = _flag_value(argv, "--config")
    yaml_config: dict = {}
    if config_path is not None:
        if not Path(config_path).is_file():
            raise FileNotFoundError(f"config file {config_path!r} does not exist")
        yaml_config = yaml.safe_load(Path(config_path).read_text()) or {}
        if not isinstance(yaml_config, dict):
            raise ValueError(f"config file {config_path!r} must hold a YAML mapping")
    condition = _flag_value(argv, "--condition") or yaml_config.get("condition")
    prefix: list[str] = []
    if condition:
        for key, value in condition_overrides(condition, yaml_config).items():
            prefix += [f"--{key}", *_cli_value(value)]
    if not _has_flag(argv, "--use_cpu") and "use_cpu" not in yaml_config and not _cuda_available():
        prefix += ["--use_cpu", "true"]  # transformers refuses bf16/fp16 without a GPU otherwise
    if config_path is not None:  # TrlParser reads `--config PATH` from anywhere; keep it first
        rest = list(argv)
        i = next(i for i, a in enumerate(rest) if a == "--config" or a.startswith("--config="))
        config_args = rest[i : i + (1 if "=" in rest[i] else 2)]
        del rest[i : i + len(config_args)]
        if len(config_args) == 1:
            config_args = ["--config", config_args[0].split("=", 1)[1]]
        return config_args + prefix + rest
    return prefix + argv


def make_parser() -> TrlParser:
    from trl_roundalign.trainer.config import RoundAlignGRPOConfig

    return TrlParser((GRPOScriptArguments, RoundAlignGRPOConfig, ModelConfig))


def parse_args(argv: Sequence[str] | None = None):
    """`(script_args, training_args, model_args)` from the command line (and its `--config` YAML)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return make_parser().parse_args_and_config(args=expand_argv(argv))


def model_init_kwargs(training_args, model_args) -> dict[str, Any]:
    """The policy's `from_pretrained` kwargs: `ModelConfig`'s fields under the config's `model_init_kwargs`.

    `RoundAlignGRPOConfig` always fills `model_init_kwargs["dtype"]` (default `bfloat16`, the dtype vLLM
    serves); an explicit `--dtype` other than TRL's default `float32` replaces that default.

    Raises:
        ValueError: `--dtype` and `model_init_kwargs.dtype` both set, to different dtypes.
    """
    kwargs: dict[str, Any] = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
    }
    configured = dict(training_args.model_init_kwargs or {})
    dtype = configured.get("dtype", "bfloat16")
    wanted = model_args.dtype
    if wanted not in (None, "float32") and wanted != dtype:
        if dtype != "bfloat16":
            raise ValueError(f"dtype={wanted!r} contradicts model_init_kwargs.dtype={dtype!r}: set one of them")
        configured["dtype"] = wanted
    elif wanted == "float32" and dtype != "float32":
        logger.info("loading the policy in %s (RoundAlignGRPOConfig's default), not ModelConfig's float32", dtype)
    kwargs.update(configured)
    return {k: v for k, v in kwargs.items() if v is not None}


# ------------------------------------------------------------------------------------------------
# Data


def _is_path_like(name: str) -> bool:
    p = Path(name).expanduser()
    return p.suffix.lower() in LOCAL_DATA_FORMATS or name.startswith((".", "/", "~")) or p.exists()


def load_dataset_split(name: str, split: str, *, config: str | None = None):
    """One split of a dataset: hub id, local file (`.jsonl`, `.json`, `.parquet`, `.csv`), folder, or `arithmetic`.

    Local files have the single split `train` (slices such as `train[:100]` work).

    Raises:
        FileNotFoundError: a local path that does not exist.
        ValueError: a local file of an unknown format.
    """
    import datasets

    if name in PACKAGED_DATASETS:
        from trl_roundalign.data import arithmetic_dataset

        return arithmetic_dataset(split)
    if _is_path_like(name):
        path = Path(name).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"dataset file {name!r} does not exist")
        if path.is_dir():
            if (path / "dataset_info.json").exists() or (path / "state.json").exists():
                loaded = datasets.load_from_disk(str(path))
                return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
            return datasets.load_dataset(str(path), name=config, split=split)
        fmt = LOCAL_DATA_FORMATS.get(path.suffix.lower())
        if fmt is None:
            raise ValueError(
                f"dataset file {name!r}: unknown format {path.suffix!r}; use one of {', '.join(LOCAL_DATA_FORMATS)}"
            )
        return datasets.load_dataset(fmt, data_files={"train": str(path)}, split=split)
    return datasets.load_dataset(name, name=config, split=split)


def load_prompt_dataset(name: str, split: str, *, config: str | None = None, prompt_column: str = "prompt"):
    """Load one split of a prompt set (`load_dataset_split`) and name its prompt column `prompt`.

    Raises:
        FileNotFoundError: a local path that does not exist.
        ValueError: a missing prompt column, or a `prompt` column besides another `prompt_column`.
    """
    ds = load_dataset_split(name, split, config=config)
    columns = list(ds.column_names)
    if prompt_column not in columns:
        raise ValueError(
            f"dataset {name!r} has no column {prompt_column!r} (prompt_column); its columns: {', '.join(columns)}"
        )
    if prompt_column != "prompt":
        if "prompt" in columns:
            raise ValueError(
                f"dataset {name!r} has a 'prompt' column besides prompt_column={prompt_column!r}; "
                "rename or drop one of them"
            )
        ds = ds.rename_column(prompt_column, "prompt")
    if len(ds) == 0:
        raise ValueError(f"dataset {name!r} split {split!r} is empty")
    return ds


# ------------------------------------------------------------------------------------------------
# Rewards


def eos_token_ids(model_path: str, *, revision: str | None = None, trust_remote_code: bool = False) -> list[int]:
    """The ids that end a completion: the tokenizer's EOS and pad, and the generation config's EOS."""
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(model_path, revision=revision, trust_remote_code=trust_remote_code)
    ids = {tok.eos_token_id, tok.pad_token_id}
    try:
        gen = GenerationConfig.from_pretrained(model_path, revision=revision)
        eos = gen.eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos])
    except OSError:  # no generation_config.json
        pass
    return sorted(i for i in ids if i is not None)


def check_reward_names(names: Sequence[str] | None) -> None:
    """Raise `ValueError` (one line) for an empty list or a name not in `REWARD_FUNCS`."""
    from trl_roundalign.rewards import REWARD_FUNCS

    if not names:
        raise ValueError(f"reward_funcs is empty; name at least one of {', '.join(REWARD_FUNCS)}")
    unknown = [n for n in names if n not in REWARD_FUNCS]
    if unknown:
        raise ValueError(
            f"unknown reward function(s) {', '.join(map(repr, unknown))}; known: {', '.join(REWARD_FUNCS)}"
        )


def build_reward_funcs(names: Sequence[str] | None, training_args, model_path: str, model_args) -> list:
    """`get_reward_funcs(names)` with the generation limit and the EOS ids bound in."""
    from trl_roundalign.rewards import get_reward_funcs

    check_reward_names(names)
    eos = eos_token_ids(
        model_path, revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code
    )
    return get_reward_funcs(names, max_completion_length=training_args.max_completion_length, eos_token_ids=eos)


# ------------------------------------------------------------------------------------------------
# Logging


class LogHistoryCallback(TrainerCallback):
    """Append every logged row (rewards, `mismatch/*`, loss, ...) to a JSONL file, one row per log."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            open(self.path, "a" if state.global_step > 0 else "w").close()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            row = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, int | float | str)}}
            with open(self.path, "a") as fh:
                fh.write(json.dumps(row) + "\n")


def _all_agree(accelerator, flag: bool) -> bool:
    """Rank 0's `flag` on every rank (a decision read from a clock or a file must be the same everywhere)."""
    if accelerator is None or accelerator.num_processes <= 1:
        return flag
    import torch
    from accelerate.utils import broadcast

    return bool(broadcast(torch.tensor([float(flag)], device=accelerator.device), from_process=0).item())


def read_step_limit(path: str | os.PathLike) -> int:
    """The step count in a step-limit file; `ValueError` naming the file when it holds anything else."""
    text = Path(path).read_text().strip()
    try:
        limit = int(text)
    except ValueError:
        raise ValueError(f"step limit file {path} holds {text[:40]!r}, not a step count") from None
    if limit < 1:
        raise ValueError(f"step limit file {path} holds {limit}; a step count is at least 1")
    return limit


class StepLimitCallback(TrainerCallback):
    """Stop training once `global_step` reaches the count in a file that is read after every step."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        read_step_limit(self.path)  # fail at start-up, not after the first step
        self.accelerator = None
        self.stopped_at: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        reached = state.global_step >= read_step_limit(self.path)
        if _all_agree(self.accelerator, reached) and not control.should_training_stop:
            control.should_training_stop = True
            self.stopped_at = state.global_step
            logger.info("step limit in %s reached: stopping after step %d", self.path, state.global_step)


class TimeBudgetCallback(TrainerCallback):
    """Stop training after the first optimizer step that ends past `seconds` of training (all ranks agree)."""

    def __init__(self, seconds: float):
        self.seconds = float(seconds)
        self.accelerator = None
        self._start: float | None = None
        self.stopped_at: int | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._start = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        over = _all_agree(self.accelerator, self._start is not None and time.monotonic() - self._start > self.seconds)
        if over and not control.should_training_stop:
            control.should_training_stop = True
            self.stopped_at = state.global_step
            logger.warning("max_train_seconds=%s reached: stopping after step %d", self.seconds, state.global_step)


# ------------------------------------------------------------------------------------------------
# Main


def _set_cpu_environment() -> None:
    """Defaults for vLLM-CPU (read when vLLM starts): a 1 GiB KV cache instead of a share of host RAM."""
    if not _cuda_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def build_trainer(script_args: GRPOScriptArguments, training_args, model_args):
    """The dataset, the rewards and the `RoundAlignGRPOTrainer` (engine started, policy patched)."""
    from trl import get_peft_config, get_quantization_config

    from trl_roundalign.local_models import resolve_model

    if script_args.dataset_name is None:
        raise ValueError("dataset_name is not set (a hub id, a local file, or 'arithmetic')")
    check_reward_names(script_args.reward_funcs)
    training_args.model_init_kwargs = model_init_kwargs(training_args, model_args)
    train_dataset = load_prompt_dataset(
        script_args.dataset_name,
        script_args.dataset_train_split,
        config=script_args.dataset_config,
        prompt_column=script_args.prompt_column,
    )
    if script_args.max_train_samples is not None:
        train_dataset = train_dataset.select(range(min(script_args.max_train_samples, len(train_dataset))))
    eval_dataset = None
    if training_args.eval_strategy != "no":
        eval_dataset = load_prompt_dataset(
            script_args.dataset_name,
            script_args.dataset_test_split,
            config=script_args.dataset_config,
            prompt_column=script_args.prompt_column,
        )
    model_path = resolve_model(model_args.model_name_or_path)
    reward_funcs = build_reward_funcs(script_args.reward_funcs, training_args, model_path, model_args)

    from trl_roundalign.trainer.grpo import RoundAlignGRPOTrainer

    history = script_args.log_history_file or os.path.join(training_args.output_dir, "log_history.jsonl")
    callbacks: list[TrainerCallback] = [LogHistoryCallback(history)]
    budget = TimeBudgetCallback(script_args.max_train_seconds) if script_args.max_train_seconds else None
    limit = StepLimitCallback(script_args.step_limit_file) if script_args.step_limit_file else None
    callbacks += [cb for cb in (budget, limit) if cb is not None]
    phase(
        "building the trainer: model, vLLM engine (a first run compiles its graph, later runs load it), "
        "profile verification against the engine"
    )
    trainer = RoundAlignGRPOTrainer(
        model=model_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        callbacks=callbacks,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    for cb in (budget, limit):
        if cb is not None:
            cb.accelerator = trainer.accelerator
    trainer.accelerator.print(
        f"roundalign: condition={script_args.condition or '-'} regions={list(training_args.roundalign_regions)} "
        f"profile={trainer.roundalign_profile} dtype={training_args.model_init_kwargs.get('dtype')} "
        f"is_correction={training_args.vllm_importance_sampling_correction}"
    )
    return trainer


def phase(what: str) -> None:
    """One `[phase] ...` line on the main process: where a run's start-up is (the CPU demo shows these)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"[phase] {what}", flush=True)


def train(trainer, script_args: GRPOScriptArguments, training_args) -> None:
    """Train, then save the model (and push it when asked)."""
    phase("training")
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    history = script_args.log_history_file or os.path.join(training_args.output_dir, "log_history.jsonl")
    trainer.accelerator.print(f"Training completed. Logs: {history}")
    if script_args.save_final_model:
        trainer.save_model(training_args.output_dir)
        trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, build, train. Bad input found while setting up ends with one line `error: ...` and exit code 2;
    errors raised during training keep their traceback."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    _set_cpu_environment()
    try:
        script_args, training_args, model_args = parse_args(argv)
        phase("loading the prompts and rewards")
        trainer = build_trainer(script_args, training_args, model_args)
    except (ValueError, FileNotFoundError, ConnectionError, ImportError) as exc:
        if os.environ.get("TRL_ROUNDALIGN_DEBUG"):
            raise
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    train(trainer, script_args, training_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
