"""Shared setup for the trainer tests."""

from __future__ import annotations

from pathlib import Path

from trl_roundalign import RoundAlignGRPOConfig


def varied_reward(completions, **kwargs):
    """A reward that differs within a group, so advantages (and updates) are non-zero."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(len(set(t)) % 5) for t in texts]


def config_kwargs(tmp_path: Path, **overrides) -> dict:
    kw = dict(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=16,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=256,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=True,
        gradient_checkpointing=False,
        save_strategy="no",
        seed=0,
    )
    kw.update(overrides)
    return kw


def make_config(tmp_path: Path, **overrides) -> RoundAlignGRPOConfig:
    return RoundAlignGRPOConfig(**config_kwargs(tmp_path, **overrides))


def long_prompts(n: int):
    from datasets import Dataset

    # About 570 tokens each with this tokenizer: longer than the step budget below, so vLLM must chunk each prefill.
    return Dataset.from_dict({"prompt": [
        f"Sum these, case {i}: " + " ".join(str((7 * k + i) % 97) for k in range(300)) for i in range(n)]})
