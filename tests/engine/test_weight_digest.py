"""The trainer's side of the weight comparison (`trl_roundalign.engine.weight_digest.compare`), against digests a
worker would report (`worker_digests`' entries: trainer name, dim, start, length, digest, dtype). The worker's side
runs on real servers (tests/trainer/test_server_exact.py, test_server_tp.py)."""

from __future__ import annotations

import torch

from trl_roundalign.engine.weight_digest import compare, tensor_digest


def _model(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6, bias=False), torch.nn.Linear(6, 4, bias=False))
    return model.to(dtype)


def _reported(engine_weights: dict[str, torch.Tensor]) -> list[dict]:
    """One worker's report of whole tensors, plus the first 3 rows of the second (a fused projection's part)."""
    digests = [[n, None, 0, 0, tensor_digest(t), str(t.dtype)] for n, t in engine_weights.items()]
    w = engine_weights["1.weight"]
    digests.append(["1.weight", 0, 0, 3, tensor_digest(w.narrow(0, 0, 3)), str(w.dtype)])
    return [{"digests": digests, "not_cut": []}]


def test_fp32_masters_compare_as_the_bf16_image_the_engine_loads():
    """FSDP2 trains fp32 parameters (accelerate's upcast) and TRL pushes them as they are; the engine's loader copies
    each into its bf16 tensor (round to nearest even). The trainer's fp32 tensor is compared as that image: equal
    when the engine holds it, a tensor one bf16 ulp away named as differing."""
    masters = _model(torch.float32)
    engine = {n: p.detach().to(torch.bfloat16) for n, p in masters.named_parameters()}
    result = compare(masters, _reported(engine))
    assert result.equal and result.compared == 3, result.summary()

    moved = dict(engine)
    w = moved["0.weight"].clone()
    w.view(torch.int16)[0, 0] += 1  # one bf16 ulp in one entry
    moved["0.weight"] = w
    result = compare(masters, _reported(moved))
    assert result.differing == ["0.weight"] and result.compared == 2, result.summary()


def test_a_trainer_tensor_in_bf16_is_compared_as_it_is():
    """A bf16 policy (the package's own masters keep fp32 apart) is hashed as it is; an engine that holds fp32 is not
    taken as equal to it (only an fp32 trainer tensor is cast, to the engine's 16-bit dtype)."""
    policy = _model(torch.bfloat16)
    same = {n: p.detach().clone() for n, p in policy.named_parameters()}
    assert compare(policy, _reported(same)).equal
    wider = {n: p.detach().float() for n, p in policy.named_parameters()}
    result = compare(policy, _reported(wider))
    assert sorted(result.differing) == ["0.weight", "1.weight", "1.weight[0: 0:3]"], result.summary()
