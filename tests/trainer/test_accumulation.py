"""fp32 gradient accumulation of `MasterWeightsOptimizer`, against an fp64 sum of the micro-batch gradients.

Autograd gives each micro-batch's gradient of a bf16 parameter in bf16; what accumulation adds is the
rounding of the running sum. Accumulating in `p.grad` (bf16, what a plain optimizer sees) rounds it to
bf16 after every micro-batch; the masters' fp32 `.grad` rounds it to fp32. Pure torch, no engine.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trl_roundalign.trainer.masters import MasterWeightsOptimizer, noop_comm_hook

STEPS = 8  # gradient_accumulation_steps
FP32_EPS = 2.0**-24


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 32)).to(torch.bfloat16)


def _batch(i: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + i)
    # Micro-batches of different scales, as losses of different lengths give.
    x = (torch.randn(16, 64, generator=g) * (0.5 + i)).to(torch.bfloat16)
    w = torch.randn(16, 32, generator=g).to(torch.bfloat16)
    return x, w


def _loss(model, x, w):
    return (model(x).float() * w.float()).sum()


def _micro_grads(model, batches):
    """Each micro-batch's bf16 gradient, computed alone (what autograd hands to accumulation)."""
    out = []
    for x, w in batches:
        model.zero_grad(set_to_none=True)
        _loss(model, x, w).backward()
        out.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return out


def test_fp32_accumulation_of_8_micro_batches():
    model = _model()
    batches = [_batch(i) for i in range(STEPS)]
    micro = _micro_grads(model, batches)
    exact = [sum(m[k].double() for m in micro) for k in range(len(micro[0]))]
    bound = [STEPS * FP32_EPS * sum(m[k].double().abs() for m in micro) for k in range(len(micro[0]))]

    # Today's bf16 accumulation in p.grad.
    for x, w in batches:
        _loss(model, x, w).backward()
    bf16_err = max(((p.grad.double() - e).abs() / (b / (STEPS * FP32_EPS))).max().item() for p, e, b in zip(model.parameters(), exact, bound))
    model.zero_grad(set_to_none=True)

    opt = MasterWeightsOptimizer(list(model.parameters()), torch.optim.SGD, lr=0.0)
    for x, w in batches:
        _loss(model, x, w).backward()
        assert all(p.grad is None for p in model.parameters()), "the bf16 gradient must move into the fp32 master"
    fp32_err = 0.0
    for m, e, b in zip(opt.masters, exact, bound):
        assert m.grad.dtype == torch.float32
        assert ((m.grad.double() - e).abs() <= b).all(), "fp32 accumulation exceeds its rounding bound"
        fp32_err = max(fp32_err, ((m.grad.double() - e).abs() / (b / (STEPS * FP32_EPS))).max().item())
    print(f"relative accumulation error, max over elements: bf16 {bf16_err:.2e}, fp32 {fp32_err:.2e}")
    assert bf16_err > 2.0**-10, "bf16 accumulation should visibly round (else the test cannot tell the two apart)"
    assert fp32_err <= STEPS * FP32_EPS

    # The step consumes the accumulated gradient: the next step starts from zero.
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(m.grad is None for m in opt.masters)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # lr 0


def test_clip_grad_norm_reads_the_fp32_masters():
    model = _model(1)
    opt = MasterWeightsOptimizer(list(model.parameters()), torch.optim.SGD, lr=0.1)
    for i in range(3):
        _loss(model, *_batch(i)).backward()
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m.grad) for m in opt.masters]))
    got = opt.clip_grad_norm_(1.0)
    assert torch.allclose(got, want)
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m.grad) for m in opt.masters]))
    assert clipped == pytest.approx(1.0, rel=1e-5)


def _ddp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = _model()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(None, noop_comm_hook)
        opt = MasterWeightsOptimizer(list(model.parameters()), torch.optim.SGD, lr=0.0)
        for i in range(STEPS):
            x, w = _batch(i, rank)
            if i < STEPS - 1:
                with ddp.no_sync():
                    _loss(ddp, x, w).backward()
            else:
                _loss(ddp, x, w).backward()
        opt.reduce_gradients()
        torch.save([m.grad for m in opt.masters], os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ddp_averages_fp32_sums_across_processes(tmp_path):
    """Two gloo processes: the masters hold the mean over ranks of each rank's fp32 sum, on every rank."""
    world = 2
    with tempfile.NamedTemporaryFile(dir=tmp_path, delete=False) as f:
        init_file = f.name
    os.remove(init_file)
    mp.start_processes(_ddp_worker, args=(world, init_file, str(tmp_path)), nprocs=world, start_method="spawn")
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    model = _model()
    per_rank = [_micro_grads(model, [_batch(i, r) for i in range(STEPS)]) for r in range(world)]
    n = len(per_rank[0][0])
    for k in range(n):
        exact = sum(sum(m[k].double() for m in micro) for micro in per_rank) / world
        bound = (STEPS + 2) * FP32_EPS * sum(sum(m[k].double().abs() for m in micro) for micro in per_rank) / world
        for r in range(world):
            assert ((got[r][k].double() - exact).abs() <= bound).all(), f"rank {r} tensor {k}"
        assert torch.equal(got[0][k], got[1][k]), "ranks must hold identical gradients"


def test_zero3_and_fsdp2_precision_is_read_from_their_settings():
    """Who keeps fp32 masters under DeepSpeed/FSDP, decided by their actual precision settings."""
    import yaml

    from trl_roundalign.trainer.masters import distributed_master_weights

    # The recipes' DeepSpeed configs as accelerate passes them (mixed_precision bf16, bf16 "auto" in the HF config).
    assert distributed_master_weights("DistributedType.DEEPSPEED", "bf16", {"bf16": {"enabled": "auto"}})[:2] == (
        "DeepSpeed",
        True,
    )
    engine, keeps, why = distributed_master_weights("DEEPSPEED", "no", {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}})
    assert (engine, keeps) == ("DeepSpeed", False) and "neither bf16 nor fp16" in why
    assert distributed_master_weights("DEEPSPEED", "no", {"fp16": {"enabled": True}})[1] is True
    cfg = yaml.safe_load(open(Path(__file__).parents[2] / "recipes" / "accelerate_configs" / "fsdp2.yaml"))
    assert distributed_master_weights("FSDP", cfg["mixed_precision"])[:2] == ("FSDP", True)
    engine, keeps, why = distributed_master_weights("DistributedType.FSDP", "no")
    assert (engine, keeps) == ("FSDP", False) and "no fp32 copy" in why
    # accelerate upcasts to fp32 only when its mixed_precision is on; a bf16 param_dtype alone sets the compute
    # dtype and leaves the optimizer stepping bf16 shards (test_master_weights.py runs accelerate's own code).
    engine, keeps, why = distributed_master_weights("FSDP", "no", fsdp_param_dtype=torch.bfloat16)
    assert (engine, keeps) == ("FSDP", False) and "param_dtype" in why
    assert distributed_master_weights("FSDP", "fp16", fsdp_param_dtype=torch.float16)[1] is True
    assert distributed_master_weights("MULTI_CPU", "no") == (None, False, "")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", "-s"]))
