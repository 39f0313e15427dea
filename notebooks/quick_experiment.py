# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Quick experiment: where the trainer rounds vs where vLLM rounds
#
# 1. **Environment**: versions, device, the rounding profile `auto` would pick.
# 2. **Static analysis**: generate with vLLM once, score the same tokens with the Hugging Face model under the
#    paper's conditions (`bf16_default`, `rope_only`, `three_region`) and measure the mismatch against vLLM's
#    prefill scoring and against the sampler.
# 3. **A short GRPO run** with `RoundAlignGRPOTrainer` (colocated vLLM) and its per-step `mismatch/kl_k3`.
# 4. **The command to scale up** to the paper's recipes.
#
# `SMOKE = True` (the default, and what `make test` runs through `nbmake` on a CPU) keeps everything small:
# a few prompts, a 3-step GRPO run. Set it to `False` for more samples and a 20-step run of both conditions.
# Paired with `quick_experiment.py` by jupytext (`jupytext --sync notebooks/quick_experiment.ipynb`).

# %% tags=["parameters"]
SMOKE = True  # small and fast (about 2-3 minutes on a 2-core CPU)
MODEL = "smollm2-135m"  # offline name (smollm2-135m, tiny-qwen3, peaked-qwen3), local checkpoint or hub id
NUM_PROMPTS = 2 if SMOKE else 16  # analysis: prompts from the packaged arithmetic set
SAMPLES_PER_PROMPT = 2 if SMOKE else 4
MAX_NEW_TOKENS = 24 if SMOKE else 64
GRPO_STEPS = 3 if SMOKE else 20
GRPO_CONDITIONS = ["three_region"] if SMOKE else ["bf16_default", "three_region"]
SEED = 0

# %%
# ruff: noqa: E402  (a notebook: imports follow the parameters cell)
import io
import logging
import os
import sys
import warnings
from pathlib import Path

ROOT = next(p for p in (Path.cwd(), *Path.cwd().parents) if (p / "pyproject.toml").exists())
OUT = ROOT / "outputs" / "notebooks" / "quick_experiment"
# Offline, caches shared with the tests and the demo, a 1 GiB vLLM-CPU KV cache, quiet logs.
for key, value in {
    "VLLM_CACHE_ROOT": ROOT / ".cache" / "vllm",
    "TORCHINDUCTOR_CACHE_DIR": ROOT / ".cache" / "inductor",
    "TRL_ROUNDALIGN_CACHE": ROOT / ".cache" / "models",
    "VLLM_CPU_KVCACHE_SPACE": 1,
    "VLLM_LOGGING_LEVEL": "ERROR",
    "HF_HUB_OFFLINE": 1,
    "HF_DATASETS_OFFLINE": 1,
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(key, str(value))
warnings.filterwarnings("ignore")
# vLLM silences C-level output by redirecting sys.stdout's file descriptor while it starts; a kernel started
# under pytest (nbmake) does not capture descriptors, so its sys.stdout has no fileno(): give it the real one.
try:
    sys.stdout.fileno()
except (io.UnsupportedOperation, AttributeError):
    sys.stdout.fileno = lambda: 1
logging.basicConfig(level=logging.WARNING)

import torch
import transformers

transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()
ON_CPU = not torch.cuda.is_available()

# %% [markdown]
# ## 1. Environment

# %%
from trl_roundalign.cli import main as trl_roundalign_cli

_ = trl_roundalign_cli(["env"])

# %% [markdown]
# ## 2. Static analysis: default vs aligned on the same tokens
#
# One vLLM engine (compiled, as TRL's colocate mode builds it; its rounding profile is read from the engine),
# one generation pass, then the Hugging Face model scores the same tokens under each condition.
# `vs prefill` is what the training side can control (vLLM scoring the whole sequence at once);
# `vs sampler` is what the RL loss sees (vLLM's decode-time log-probs), with the engine's own floor below.

# %%
from trl_roundalign.analysis.compare import build_conditions, compare_with_engine
from trl_roundalign.engine import build_llm, close_llm, engine_info, profile_for_engine
from trl_roundalign.local_models import resolve_model

model_path = resolve_model(MODEL)
llm = build_llm(model_path, max_model_len=512, seed=SEED)
profile = profile_for_engine(engine_info(llm))
conditions = build_conditions("paper", profile)
comparison = compare_with_engine(
    model_path,
    llm,
    conditions,
    num_prompts=NUM_PROMPTS,
    samples_per_prompt=SAMPLES_PER_PROMPT,
    max_new_tokens=MAX_NEW_TOKENS,
    seed=SEED,
)
tokens = sum(len(s.completion_ids) for s in comparison.samples)
print(f"model {MODEL}, engine profile {profile}, {len(comparison.samples)} completions, {tokens} tokens\n")
print(f"{'condition':<14}{'k3 vs prefill':>15}{'mean|Δ| prefill':>17}{'bit-identical':>15}{'k3 vs sampler':>15}")
for cond in conditions:
    pre, samp = comparison.stats[cond.name]["vs_prefill"], comparison.stats[cond.name]["vs_sampler"]
    print(
        f"{cond.name:<14}{pre['mismatch/kl_k3']:>15.2e}{pre['mismatch/abs_logp_diff/mean']:>17.4f}"
        f"{pre['mismatch/frac_bitwise_equal']:>15.3f}{samp['mismatch/kl_k3']:>15.2e}"
    )
floor = comparison.floors["sampler_vs_prefill"]
print(f"{'engine floor':<14}{'':>15}{'':>17}{'':>15}{floor['mismatch/kl_k3']:>15.2e}  (sampler vs prefill)")

# %%
close_llm(llm)  # frees the engine's memory now (vLLM freezes the garbage collector while it runs)
del llm, comparison

# %% [markdown]
# ## 3. A short GRPO run with `RoundAlignGRPOTrainer`
#
# The packaged arithmetic prompts, `arithmetic_reward`, a colocated vLLM engine; the trainer logs
# `mismatch/*` every step (also in `<output_dir>/mismatch.jsonl`). Same seed for every condition, so the
# first step samples the same completions.

# %%
from transformers import PrinterCallback

from trl_roundalign import RoundAlignGRPOConfig, RoundAlignGRPOTrainer
from trl_roundalign.data import arithmetic_dataset
from trl_roundalign.profiles import PAPER_CONDITIONS
from trl_roundalign.rewards import get_reward_funcs

history = {}
for condition in GRPO_CONDITIONS:
    config = RoundAlignGRPOConfig(
        output_dir=str(OUT / condition),
        roundalign_regions=list(PAPER_CONDITIONS[condition]),
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=512,
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=MAX_NEW_TOKENS,
        max_steps=GRPO_STEPS,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        loss_type="grpo",
        beta=0.0,
        bf16=True,
        use_cpu=ON_CPU,
        gradient_checkpointing=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=SEED,
    )
    trainer = RoundAlignGRPOTrainer(
        model=model_path,
        reward_funcs=get_reward_funcs(["arithmetic_reward"]),
        args=config,
        train_dataset=arithmetic_dataset(),
    )
    trainer.remove_callback(PrinterCallback)  # the table below shows the numbers
    trainer.train()
    history[condition] = [r for r in trainer.state.log_history if "mismatch/kl_k3" in r]
    trainer.close()  # shut its colocated engine down before the next condition builds one
    del trainer

print(f"{'condition':<14}{'step':>5}{'reward':>8}{'kl_k3':>11}{'mean|Δ|':>9}{'outside clip':>14}")
for condition, rows in history.items():
    for r in rows:
        print(
            f"{condition:<14}{r['step']:>5}{r['reward']:>8.3f}{r['mismatch/kl_k3']:>11.2e}"
            f"{r['mismatch/abs_logp_diff/mean']:>9.4f}{r['mismatch/frac_outside_clip']:>14.4f}"
        )

# %%
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(6, 3.2))
for condition, rows in history.items():
    ax.plot([r["step"] for r in rows], [r["mismatch/kl_k3"] for r in rows], marker="o", label=condition)
ax.set_xlabel("step")
ax.set_ylabel("mismatch/kl_k3")
ax.set_yscale("log")
ax.set_title(f"{MODEL}: train/inference mismatch per GRPO step")
ax.grid(True, which="both", alpha=0.3)
ax.legend()
fig.tight_layout()
OUT.mkdir(parents=True, exist_ok=True)
fig.savefig(OUT / "kl_k3.png", dpi=100)
plt.show()

# %% [markdown]
# ## 4. Scale up
#
# The CPU demo (both conditions, 30 steps each, a per-step table, a summary and a plot):
#
# ```bash
# make demo
# ```
#
# One condition of the CPU recipe, as the demo launches it:
#
# ```bash
# accelerate launch --config_file recipes/accelerate_configs/cpu.yaml \
#     recipes/grpo.py --config recipes/cpu/smollm2_arithmetic.yaml --condition three_region
# ```
#
# The paper's runs (8 x 80 GB GPUs, one node), e.g. Qwen3-1.7B with the three aligned regions; swap the
# YAML for `config_bf16_default.yaml` or `config_rope_only.yaml` (see `recipes/README.md`):
#
# ```bash
# accelerate launch --config_file recipes/accelerate_configs/zero2.yaml \
#     recipes/grpo.py --config recipes/Qwen3-1.7B/grpo/config_three_region.yaml
# ```
#
# Watch `mismatch/kl_k3` in the logs: in the runs that collapse it rises steadily for many steps before the
# reward falls.
