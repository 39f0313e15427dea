"""RoundAlignGRPOTrainer: profile auto-detection, LoRA, checkpoints and resume, plain GRPOTrainer + callback, guards."""

from __future__ import annotations

import json
import warnings
import weakref
from pathlib import Path

import pytest
import torch
from helpers.trainer import config_kwargs, make_config, varied_reward
from transformers import AutoModelForCausalLM, TrainerCallback

from trl_roundalign import MismatchCallback, RoundAlignGRPOConfig, RoundAlignGRPOTrainer, get_patch_report
from trl_roundalign.analysis.compare import Condition, compare_with_engine
from trl_roundalign.data import arithmetic_dataset
from trl_roundalign.local_models import tiny_model
from trl_roundalign.profiles import ALL_REGIONS, PAPER_REGIONS
from trl_roundalign.trainer.callbacks import read_mismatch_runs

pytestmark = pytest.mark.vllm


def _eager_cpu_profile() -> str:
    from trl_roundalign.engine import EAGER_CPU_PROFILES, vllm_cpu_kernel_library

    return EAGER_CPU_PROFILES[vllm_cpu_kernel_library()]


@pytest.mark.parametrize(
    ("engine_kwargs", "expected", "other"),
    [(None, "vllm-compiled", "eager-cpu"), ({"enforce_eager": True}, "eager-cpu", "vllm-compiled")],
    ids=["compiled", "eager"],
)
def test_auto_profile_follows_the_engine_and_matches_it_better(tmp_path, engine_kwargs, expected, other, closing):
    # the eager reading depends on vLLM-CPU's kernel library (AVX2: a truncating RoPE kernel)
    expected, other = (_eager_cpu_profile() if p == "eager-cpu" else p for p in (expected, other))
    path = tiny_model("qwen3", initializer_range=0.2, head_dim=64, hidden_size=256, intermediate_size=512, qk_norm_gain=2.0)
    args = make_config(tmp_path, max_steps=1, vllm_engine_kwargs=engine_kwargs)
    trainer = closing(
        RoundAlignGRPOTrainer(model=str(path), reward_funcs=varied_reward, args=args, train_dataset=arithmetic_dataset("train[:8]"))
    )
    assert trainer.roundalign_profile == expected
    assert trainer.roundalign_engine.enforce_eager == bool(engine_kwargs)
    # The chosen profile reproduces this engine better than the other reading does.
    conds = [Condition("chosen", PAPER_REGIONS, expected), Condition("other", PAPER_REGIONS, other)]
    comp = compare_with_engine(path, trainer.vllm_generation.llm, conds, num_prompts=4, samples_per_prompt=2, max_new_tokens=32, floors=False)
    chosen = comp.stats["chosen"]["vs_prefill"]["mismatch/kl_k3"]
    worse = comp.stats["other"]["vs_prefill"]["mismatch/kl_k3"]
    assert chosen < worse, (expected, chosen, other, worse)
    trainer.close()


def test_lora_with_gradient_checkpointing_trains(tmp_path, closing):
    import peft  # pinned by make setup: a broken install fails here, never skips LoRA coverage
    args = make_config(tmp_path, max_steps=2, gradient_checkpointing=True, learning_rate=1e-4)
    trainer = RoundAlignGRPOTrainer(
        model=str(tiny_model("qwen3")),
        reward_funcs=varied_reward,
        args=args,
        train_dataset=arithmetic_dataset("train[:16]"),
        peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], task_type="CAUSAL_LM"),
    )
    closing(trainer)
    assert get_patch_report(trainer.model).regions == PAPER_REGIONS
    lora_before = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if "lora_B" in k}
    trainer.train()
    moved = [k for k, v in trainer.model.named_parameters() if k in lora_before and not torch.equal(v, lora_before[k])]
    assert moved, "LoRA weights did not train"
    steps = [h for h in trainer.state.log_history if "mismatch/kl_k3" in h]
    assert len(steps) == 2
    trainer.close()


def test_checkpoint_loads_in_plain_transformers_and_resume_reapplies_patches(tmp_path, closing):
    out = tmp_path / "run"
    args = make_config(out, max_steps=3, save_strategy="steps", save_steps=2, learning_rate=1e-5)
    trainer = RoundAlignGRPOTrainer(
        model=tiny_model("llama"),  # a Path, as build_tiny_model returns it
        reward_funcs=varied_reward,
        args=args,
        train_dataset=arithmetic_dataset("train[:32]"),
    )
    closing(trainer)
    trainer.train()
    ckpt = out / "checkpoint-2"
    assert ckpt.is_dir()
    plain = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    saved_masters = torch.load(ckpt / "optimizer.pt", weights_only=False)["masters"]
    # The checkpoint's bf16 weights are the rounding of its fp32 masters, which hold more than bf16 can.
    by_name = dict(plain.named_parameters())
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    named = [names[id(p)] for p in trainer.optimizer.optimizer._model_params]  # the optimizer's order
    assert len(named) == len(saved_masters)
    for n, m in zip(named, saved_masters):
        assert torch.equal(by_name[n].detach(), m.to(torch.bfloat16)), n
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in saved_masters)
    assert [json.loads(x).get("step") for x in (out / "mismatch.jsonl").read_text().splitlines()][1:] == [1, 2, 3]
    trainer.close()

    class Snapshot(TrainerCallback):
        masters = None

        def on_train_begin(self, args, state, control, **kwargs):
            Snapshot.masters = [m.detach().clone() for m in resumed.optimizer.optimizer.masters]

    args = make_config(out, max_steps=3, save_strategy="no", learning_rate=1e-5)
    resumed = RoundAlignGRPOTrainer(
        model=str(tiny_model("llama")),
        reward_funcs=varied_reward,
        args=args,
        train_dataset=arithmetic_dataset("train[:32]"),
        callbacks=[Snapshot()],
    )
    closing(resumed)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert get_patch_report(resumed.model) is not None
    assert resumed.state.global_step == 3
    # The fp32 masters came back from the checkpoint bit for bit (not re-derived from the bf16 weights).
    assert len(Snapshot.masters) == len(saved_masters)
    for got, want in zip(Snapshot.masters, saved_masters):
        assert got.dtype == torch.float32 and torch.equal(got, want)
    rows = [json.loads(x) for x in (out / "mismatch.jsonl").read_text().splitlines()]
    assert rows[0]["run_info"]["regions"] == list(PAPER_REGIONS)
    assert any(r.get("resumed_at_step") == 2 for r in rows if "run_info" in r)
    # The file is append-only: step 3 of the first attempt stays, superseded by the resumed run's step 3.
    assert [r["step"] for r in rows if "step" in r] == [1, 2, 3, 3]
    (run,) = read_mismatch_runs(out / "mismatch.jsonl")
    assert [r["step"] for r in run["rows"]] == [1, 2, 3] and [r["step"] for r in run["superseded"]] == [3]
    resumed.close()


def test_plain_grpo_trainer_with_the_callback(tmp_path, closing):
    from trl import GRPOConfig, GRPOTrainer

    from trl_roundalign.engine.dispatch import apply_vllm_cpu_weight_sync_fix

    apply_vllm_cpu_weight_sync_fix()
    args = GRPOConfig(**config_kwargs(tmp_path, max_steps=2, vllm_importance_sampling_correction=True))
    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.bfloat16)
    trainer = closing(
        GRPOTrainer(model=model, reward_funcs=varied_reward, args=args, train_dataset=arithmetic_dataset("train[:16]"))
    )
    cb = MismatchCallback(log_file=tmp_path / "plain.jsonl").attach(trainer)
    trainer.add_callback(cb)
    trainer.train()
    steps = [h for h in trainer.state.log_history if "mismatch/kl_k3" in h]
    assert len(steps) == 2 and all(h["mismatch/tokens"] > 0 for h in steps)
    # TRL's own mismatch metric and ours describe the same tokens.
    assert all("sampling/sampling_logp_difference/mean" in h for h in steps)


def test_guards(tmp_path, closing):
    ds = arithmetic_dataset("train[:8]")
    path = str(tiny_model("llama"))
    from trl import GRPOConfig

    # A plain GRPOConfig is upgraded: its fields kept, the alignment defaults added.
    plain = GRPOConfig(**config_kwargs(tmp_path, gradient_accumulation_steps=2, vllm_importance_sampling_correction=True))
    upgraded = RoundAlignGRPOTrainer._upgrade_args(path, plain)
    assert isinstance(upgraded, RoundAlignGRPOConfig) and upgraded.roundalign_regions == list(PAPER_REGIONS)
    for key in ("gradient_accumulation_steps", "steps_per_generation", "generation_batch_size", "use_cpu", "seed"):
        assert getattr(upgraded, key) == getattr(plain, key), key
    assert upgraded.vllm_importance_sampling_correction is True  # kept from the user's config
    with pytest.raises(TypeError, match="RoundAlignGRPOConfig or a trl.GRPOConfig"):
        RoundAlignGRPOTrainer(model=path, reward_funcs=varied_reward, args={"lr": 1}, train_dataset=ds)
    with pytest.raises(ValueError, match="use_liger_kernel"):
        RoundAlignGRPOTrainer(model=path, reward_funcs=varied_reward, args=make_config(tmp_path, use_liger_kernel=True), train_dataset=ds)
    with pytest.raises(ValueError, match="use_kernels"):
        RoundAlignGRPOTrainer(
            model=path, reward_funcs=varied_reward, args=make_config(tmp_path, model_init_kwargs={"use_kernels": True}), train_dataset=ds
        )
    with pytest.raises(ValueError, match="use_vllm=True"):
        RoundAlignGRPOTrainer(model=path, reward_funcs=varied_reward, args=make_config(tmp_path, use_vllm=False), train_dataset=ds)
    fp32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with pytest.raises(ValueError, match="dtype=torch.bfloat16"):
        RoundAlignGRPOTrainer(model=fp32, reward_funcs=varied_reward, args=make_config(tmp_path), train_dataset=ds)
    with pytest.raises(ValueError, match="^The policy loads in torch.float32; "):
        RoundAlignGRPOTrainer(
            model=path, reward_funcs=varied_reward, args=make_config(tmp_path, model_init_kwargs={"dtype": "float32"}), train_dataset=ds
        )
    with pytest.raises(ValueError, match="known regions"):
        make_config(tmp_path, roundalign_regions=["rope", "gelu"])
    with pytest.raises(ValueError, match="roundalign_profile"):
        make_config(tmp_path, roundalign_profile="fast")
    with pytest.raises(ValueError, match="JSON"):
        make_config(tmp_path, vllm_engine_kwargs="{enforce_eager: true")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with RoundAlignGRPOTrainer(
            model=path, reward_funcs=varied_reward, args=make_config(tmp_path, top_p=0.9, max_steps=1), train_dataset=ds
        ) as trainer:
            closing(trainer)
            llm = weakref.ref(trainer.vllm_generation.llm)
    assert any("top_p=0.9" in str(w.message) and "biased" in str(w.message) for w in caught)
    # Leaving the with-block shut the engine down and freed it; a second close is harmless.
    assert trainer.vllm_generation.llm is None and llm() is None
    trainer.close()


def test_a_cpu_config_as_a_user_writes_it(tmp_path, monkeypatch):
    """No use_cpu, TRL's default bf16=True: on a machine without an accelerator the config sets use_cpu itself."""
    import trl_roundalign.trainer.config as config_mod

    monkeypatch.setattr(config_mod, "_has_accelerator", lambda: False)
    cfg = RoundAlignGRPOConfig(output_dir=str(tmp_path))
    assert cfg.use_cpu is True and cfg.bf16 is True


def test_regions_none_and_exact_from_config(tmp_path):
    assert make_config(tmp_path, roundalign_regions=["none"]).roundalign_regions == []
    assert make_config(tmp_path, roundalign_regions="rope,swiglu").roundalign_regions == ["rope", "swiglu"]
    cfg = make_config(tmp_path, roundalign_regions=["rope", "swiglu", "rmsnorm", "attention"])
    assert cfg.roundalign_regions[-1] == "attention"
    assert cfg.vllm_importance_sampling_correction is False
    assert cfg.model_init_kwargs["dtype"] == "bfloat16"


def test_mismatch_jsonl_path_default_and_override(tmp_path):
    cfg = make_config(tmp_path, mismatch_log_file=str(tmp_path / "x" / "m.jsonl"))
    assert Path(cfg.mismatch_log_file).name == "m.jsonl"


def test_fp32_lm_head_on_both_sides(tmp_path, closing):
    args = make_config(tmp_path, max_steps=1, cast_lm_head_to_fp32=True, roundalign_regions=[])
    trainer = RoundAlignGRPOTrainer(
        model=str(tiny_model("llama")), reward_funcs=varied_reward, args=args, train_dataset=arithmetic_dataset("train[:8]")
    )
    closing(trainer)
    assert trainer.vllm_generation.llm.llm_engine.model_config.head_dtype == torch.float32
    assert trainer.model.lm_head.weight.dtype == torch.float32
    before = trainer.model.lm_head.weight.detach().clone()
    trainer.train()
    assert not torch.equal(before, trainer.model.lm_head.weight), "the fp32 head is its own master and must train"
    trainer.close()


@pytest.mark.parametrize("sync", [pytest.param("trl", marks=pytest.mark.full), "lossless"])
def test_lora_weight_sync_leaves_the_frozen_base_bit_identical(tmp_path, closing, sync):
    """6 LoRA GRPO steps at a large learning rate: TRL's in-place merge/unmerge drifts the frozen base weights,
    the lossless sync (the trainer's default) leaves every one bit-identical."""
    import peft  # pinned by make setup: a broken install fails here, never skips LoRA coverage
    from trl.generation.vllm_generation import VLLMGeneration

    args = make_config(tmp_path, max_steps=6, learning_rate=5e-2)
    trainer = RoundAlignGRPOTrainer(
        model=str(tiny_model("qwen3")),
        reward_funcs=varied_reward,
        args=args,
        train_dataset=arithmetic_dataset("train[:32]"),
        peft_config=peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], task_type="CAUSAL_LM"),
    )
    closing(trainer)
    if sync == "trl":  # TRL's own PEFT sync, for the comparison
        trainer.vllm_generation._iter_named_params = VLLMGeneration._iter_named_params.__get__(trainer.vllm_generation)
    base = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if "lora_" not in k}
    lora_b = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if "lora_B" in k}
    trainer.train()
    assert trainer.state.global_step == 6
    assert any(not torch.equal(v, lora_b[k]) for k, v in trainer.model.named_parameters() if k in lora_b)
    after = dict(trainer.model.named_parameters())
    changed = sum(int((after[k].detach() != v).sum()) for k, v in base.items())
    total = sum(v.numel() for v in base.values())
    print(f"{sync} sync: {changed} of {total} frozen base elements changed after 6 steps")
    if sync == "lossless":
        assert changed == 0
        # What vLLM receives is what PEFT's own merge gives (on a copy, merged in place as TRL would).
        import copy

        from trl_roundalign.trainer.lora import lossless_peft_params

        sent = dict(lossless_peft_params(trainer.vllm_generation))
        merged = copy.deepcopy(trainer.model)
        merged.merge_adapter()
        want = {
            n.removeprefix("base_model.model.").replace(".base_layer", ""): p.detach()
            for n, p in merged.named_parameters()
            if "lora_" not in n
        }
        assert set(sent) == set(want)
        for name, tensor in sent.items():
            assert torch.equal(tensor, want[name]), name
    else:
        assert changed > 0, "TRL's in-place merge/unmerge should drift the bf16 base (else this test cannot tell)"
    trainer.close()


_LORA_REGIONS = {"bf16_default": [], "three_region": list(PAPER_REGIONS), "exact": list(ALL_REGIONS)}


def _lora_k3(tmp_path, closing, forward: str, condition: str, **extra) -> list[float]:
    """k3 per step of a 4-step LoRA GRPO run at lr 5e-2 (tiny Qwen3) with `forward` under `condition`."""
    import peft  # pinned by make setup: a broken install fails here, never skips LoRA coverage
    args = make_config(
        tmp_path / f"{forward}_{condition}", max_steps=4, learning_rate=5e-2,
        roundalign_lora_forward=forward, roundalign_regions=_LORA_REGIONS[condition], **extra,
    )
    trainer = RoundAlignGRPOTrainer(
        model=str(tiny_model("qwen3")),
        reward_funcs=varied_reward,
        args=args,
        train_dataset=arithmetic_dataset("train[:32]"),
        peft_config=peft.LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
            task_type="CAUSAL_LM",
        ),
    )
    closing(trainer)
    trainer.train()
    steps = [h["mismatch/kl_k3"] for h in trainer.state.log_history if "mismatch/kl_k3" in h]
    assert len(steps) == 4
    trainer.close()
    return steps


def test_lora_merged_forward_lowers_the_mismatch(tmp_path, closing):
    """LoRA GRPO against the engine, three regions: the merged-weight forward's k3 is below PEFT's forward's.

    Mean over steps 2-4: step 1 runs with B = 0 (PEFT's init), where both forwards are `W x`.
    """
    k3 = {f: sum(_lora_k3(tmp_path, closing, f, "three_region")[1:]) / 3 for f in ("peft", "merged")}
    print("LoRA mean k3, steps 2-4, three regions:", {k: f"{v:.3e}" for k, v in k3.items()})
    assert k3["merged"] < k3["peft"]


def test_lora_exact_mode_is_exact_with_gradient_checkpointing(tmp_path, closing):
    """Exact mode with LoRA (merged forward, gradient checkpointing on): every step's k3 at the level of full
    fine-tuning's exact mode, also once the adapter is non-zero (steps 2-4). It was 9.7e-7 while the merged
    weight was computed under accelerate's bf16 autocast (a bf16 `B @ A`; scripts/lora_exact_diagnostic.py)."""
    steps = _lora_k3(tmp_path, closing, "merged", "exact", gradient_checkpointing=True)
    print("LoRA exact mode k3 per step:", [f"{v:.3e}" for v in steps])
    assert max(steps) < 1e-8, steps


@pytest.mark.full
def test_lora_mismatch_matrix(tmp_path, closing):
    """The evidence table (README, LoRA): mean k3 over steps 2-4 for PEFT's and the merged forward under default
    BF16, three regions and exact mode."""
    table = {}
    for condition in _LORA_REGIONS:
        for forward in ("peft", "merged"):
            table[f"{forward}/{condition}"] = sum(_lora_k3(tmp_path, closing, forward, condition)[1:]) / 3
    print("LoRA mean k3 matrix, steps 2-4:", json.dumps({k: f"{v:.3e}" for k, v in table.items()}))
    for condition in _LORA_REGIONS:
        assert table[f"merged/{condition}"] <= table[f"peft/{condition}"], condition
    assert table["merged/exact"] < 1e-8


@pytest.mark.full  # an exact trainer with a 40,960-token context, about 2 min on AMD AVX2 (make test-full)
def test_exact_mode_needs_no_vllm_max_model_length(tmp_path, closing):
    """With `vllm_max_model_length` unset TRL's engine takes the model's whole context (Qwen3's 40,960 tokens here).
    Exact mode's colocated engine records each request's schedule and keeps vLLM's chunked prefill and step budget,
    so nothing needs a step of the whole context: the trainer builds and every completion token of both steps is the
    sampler's, bit for bit (it was refused in one line while the engine prefilled each prompt whole in one step)."""
    model = str(tiny_model("qwen3", max_position_embeddings=40960))
    args = make_config(tmp_path, max_steps=2, vllm_max_model_length=None, roundalign_profile="auto",
                       roundalign_regions=["rope", "swiglu", "rmsnorm", "attention"])
    trainer = closing(RoundAlignGRPOTrainer(model=model, reward_funcs=varied_reward, args=args,
                                            train_dataset=arithmetic_dataset("train[:16]")))
    assert trainer.roundalign_layout.max_model_len == 40960, trainer.roundalign_layout
    trainer.train()
    steps = [h for h in trainer.state.log_history if "mismatch/tokens" in h]
    print("exact, vllm_max_model_length unset:", [(h["step"], h["mismatch/tokens"], h["mismatch/frac_bitwise_equal"])
                                                  for h in steps])
    assert [h["step"] for h in steps] == [1, 2]
    assert all(h["mismatch/frac_bitwise_equal"] == 1.0 and h["mismatch/unreproduced_tokens"] == 0 for h in steps), steps
