"""RoPE frequencies under DeepSpeed ZeRO-3's `zero.Init`, for every supported family.

`zero.Init` casts every floating tensor a module creates while the model is built to the training dtype, RoPE's
inverse frequencies included; `restore_fp32_rope_frequencies` (run by the trainer before it patches) must bring every
one back to the fp32 values vLLM computes, whatever the rotary module calls its buffers (`inv_freq`, or Gemma 3's
`sliding_attention_inv_freq` / `full_attention_inv_freq` per layer type).

One child process (DeepSpeed on CPU, a one-process gloo group) builds each family's tiny model under transformers'
ZeRO-3 path (`HfDeepSpeedConfig` alive, so `from_config` runs inside `zero.Init`, as `from_pretrained` does), records
the frequency buffers' dtypes as loaded, calls `restore_fp32_rope_frequencies` and records them again. The expected
values are vLLM's: `1 / base ** (arange(0, rotary_dim, 2, float32) / rotary_dim)` from the config's base and rotary
dim (`vllm.model_executor.layers.rotary_embedding.RotaryEmbedding._compute_inv_freq`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "phi3", "gemma3", "olmo2"]

_CHILD = r"""
import json, os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch, deepspeed
from transformers import AutoConfig, AutoModelForCausalLM, MistralConfig
from transformers.integrations import HfDeepSpeedConfig
from trl_roundalign.local_models import tiny_model
from trl_roundalign.patching import restore_fp32_rope_frequencies

families = sys.argv[3].split(",")
paths = {f: tiny_model("llama" if f == "mistral" else f) for f in families}  # built (if not cached) before ZeRO-3 is on
deepspeed.init_distributed(dist_backend="gloo")
keep = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                          "train_micro_batch_size_per_gpu": 1})
out = {}
for family in families:
    if family == "mistral":  # no tiny Mistral checkpoint: Llama's tiny shape as a MistralConfig
        llama = AutoConfig.from_pretrained(paths[family])
        config = MistralConfig(vocab_size=llama.vocab_size, hidden_size=llama.hidden_size,
                               intermediate_size=llama.intermediate_size, num_hidden_layers=llama.num_hidden_layers,
                               num_attention_heads=llama.num_attention_heads, head_dim=llama.head_dim,
                               num_key_value_heads=llama.num_key_value_heads, sliding_window=None)
    else:
        config = AutoConfig.from_pretrained(paths[family])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert hasattr(next(model.parameters()), "ds_id"), "not built under zero.Init"
    def freqs():
        return {n: (str(b.dtype), b.float().tolist()) for n, b in model.named_buffers() if n.endswith("inv_freq")}
    before = freqs()
    fixed = restore_fp32_rope_frequencies(model)
    text = model.config.get_text_config()
    out[family] = {"before": before, "after": freqs(), "fixed": fixed, "rope_parameters": text.rope_parameters,
                   "head_dim": getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
                   "partial_rotary_factor": getattr(text, "partial_rotary_factor", None)}
with open(sys.argv[2], "w") as f:
    json.dump(out, f)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    import deepspeed  # noqa: F401  (pinned in requirements/cpu.lock: a broken install fails here, never skips)

    out = tmp_path_factory.mktemp("zero3_rope") / "freqs.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(_free_port()), str(out), ",".join(FAMILIES)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def vllm_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    """vLLM's `RotaryEmbedding._compute_inv_freq`, in fp32."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def _expected(rec: dict, buffer: str) -> torch.Tensor:
    params = rec["rope_parameters"]
    leaf = buffer.rsplit(".", 1)[-1]
    layer_type = next((lt for lt in params if isinstance(params[lt], dict) and leaf.startswith(f"{lt}_")), None)
    p = params[layer_type] if layer_type is not None else params
    assert p.get("rope_type", "default") == "default", p  # the tiny models use plain RoPE
    factor = p.get("partial_rotary_factor") or rec["partial_rotary_factor"] or 1.0
    return vllm_inv_freq(p["rope_theta"], int(rec["head_dim"] * factor))


@pytest.mark.parametrize("family", FAMILIES)
def test_zero3_loaded_rope_frequencies_are_the_engines_fp32(loaded, family):
    rec = loaded[family]
    assert rec["before"], f"{family}: no RoPE frequency buffer found"
    # zero.Init did cast them (otherwise this test would check nothing)
    assert all(dtype == "torch.bfloat16" for dtype, _ in rec["before"].values()), rec["before"]
    assert rec["fixed"] >= 1
    for name, (dtype, values) in rec["after"].items():
        want = _expected(rec, name)
        assert dtype == "torch.float32", (family, name, dtype)
        assert torch.equal(torch.tensor(values, dtype=torch.float32), want), (family, name, values, want.tolist())
    if family == "gemma3":  # both layer types, each with its own base
        assert {n.rsplit(".", 1)[-1] for n in rec["after"]} >= {"sliding_attention_inv_freq", "full_attention_inv_freq"}
