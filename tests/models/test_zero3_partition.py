"""ZeRO-3's parameter partitioning, emulated: every parameter is empty except inside a call of the module that
owns it (DeepSpeed gathers a module's parameters in its forward pre-hook and releases them in its forward hook,
with `stage3_param_persistence_threshold: 0` for every parameter). The patched model must give the same bits as
when nothing is partitioned: it never reads a parameter outside its owner's call. Forward only (ZeRO-3 gathers
again for the backward through hooks on the module outputs, which the aligned regions return unchanged).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from trl_roundalign import apply_roundalign, revert_roundalign
from trl_roundalign.local_models import tiny_model
from trl_roundalign.profiles import PAPER_REGIONS


class Partitioned:
    """Empty every parameter; materialise a module's own parameters only during its forward."""

    def __init__(self, model: torch.nn.Module):
        self.full: dict[int, torch.Tensor] = {}
        self.handles = []
        self.gathers = 0
        for module in model.modules():
            own = list(module.parameters(recurse=False))
            if not own:
                continue
            for p in own:
                self.full[id(p)] = p.data
                p.data = torch.empty(0, dtype=p.dtype)
            self.handles.append(module.register_forward_pre_hook(self._gather(own)))
            self.handles.append(module.register_forward_hook(self._release(own)))

    def _gather(self, own):
        def hook(module, args):
            self.gathers += 1
            for p in own:
                p.data = self.full[id(p)]

        return hook

    def _release(self, own):
        def hook(module, args, output):
            for p in own:
                p.data = torch.empty(0, dtype=p.dtype)

        return hook

    def remove(self, model):
        for h in self.handles:
            h.remove()
        for p in model.parameters():
            p.data = self.full[id(p)]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "phi3"])
@pytest.mark.parametrize("regions", [PAPER_REGIONS, ()], ids=["three_region", "none"])
def test_zero3_partitioned_parameters_are_read_only_inside_their_modules(arch, regions):
    model = AutoModelForCausalLM.from_pretrained(tiny_model(arch), dtype=torch.bfloat16).eval()
    apply_roundalign(model, regions, "vllm-compiled")
    ids = torch.randint(5, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding, as TRL batches prompts
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        part = Partitioned(model)
        try:
            got = model(input_ids=ids, attention_mask=mask).logits
        finally:
            part.remove(model)
    assert part.gathers > 0
    assert torch.equal(got, want)
    revert_roundalign(model)


def test_the_partition_emulation_catches_a_direct_read():
    """The emulation can fail: a forward that reads a norm's weight without calling the norm breaks."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.bfloat16).eval()
    layer = model.model.layers[0]
    part = Partitioned(model)
    try:
        with pytest.raises(RuntimeError):
            x = torch.randn(1, 3, model.config.hidden_size, dtype=torch.bfloat16)
            _ = x * layer.input_layernorm.weight  # what the aligned layer used to do
    finally:
        part.remove(model)
