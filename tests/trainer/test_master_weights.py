"""`MasterWeightsOptimizer` beyond accumulation: loss scaling, data parallelism with absent gradients, which
distributed settings keep fp32 masters (accelerate's own FSDP2 preparation), and a trainer trained twice (with vLLM)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trl_roundalign.trainer.masters import MasterWeightsOptimizer

SCALE = 2.0**12  # a power of two: scaled bf16 gradients are exactly SCALE x the unscaled ones
MAX_NORM = 1.0


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Tanh(), torch.nn.Linear(48, 16)).to(torch.bfloat16)


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 32, generator=g).to(torch.bfloat16), torch.randn(8, 16, generator=g)


def _loss(model, x, w):
    return (model(x).float() * w).sum()


def _pair():
    """A reference (no loss scaling) and a loss-scaled copy of the same model, each with fp32 masters."""
    ref_model, model = _model(), _model()
    ref = MasterWeightsOptimizer(list(ref_model.parameters()), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    opt = MasterWeightsOptimizer(list(model.parameters()), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    return ref_model, ref, model, opt, torch.amp.GradScaler("cpu", init_scale=SCALE)


def _trainer_stub(opt, scaler, max_grad_norm):
    """What `RoundAlignGRPOTrainer._clip_grad_norm`/`_get_grad_norm` read: accelerate's optimizer wrapper holding
    the master optimizer and the GradScaler its `step` uses (accelerate creates one for fp16 on an accelerator)."""
    from trl_roundalign.trainer.grpo import RoundAlignGRPOTrainer

    stub = types.SimpleNamespace(
        optimizer=types.SimpleNamespace(optimizer=opt, scaler=scaler), args=types.SimpleNamespace(max_grad_norm=max_grad_norm)
    )
    for name in ("_master_optimizer", "_clip_grad_norm", "_get_grad_norm", "_loss_scaler"):
        setattr(stub, name, types.MethodType(getattr(RoundAlignGRPOTrainer, name), stub))
    return stub


@pytest.mark.parametrize("max_grad_norm", [MAX_NORM, 0.0], ids=["clip", "measure-only"])
def test_loss_scaled_gradients_are_unscaled_before_clipping(max_grad_norm):
    """fp16 with a GradScaler: after backward the masters hold S x the gradients. The trainer's clip and its logged
    grad_norm must see the true gradients, and the update must be the unscaled run's, bit for bit."""
    ref_model, ref, model, opt, scaler = _pair()
    x, w = _batch(0)
    _loss(ref_model, x, w).backward()
    scaler.scale(_loss(model, x, w)).backward()
    want = ref.clip_grad_norm_(max_grad_norm or float("inf"))
    assert want > 2 * MAX_NORM, "the gradient norm must exceed max_norm (else the clip is not tested)"

    trainer = _trainer_stub(opt, scaler, max_grad_norm)
    got = trainer._clip_grad_norm(model) if max_grad_norm > 0 else trainer._get_grad_norm(model)
    assert torch.equal(got, want), f"logged grad_norm {float(got):.4g}, true {float(want):.4g}"
    for a, b in zip(ref.masters, opt.masters):
        assert torch.equal(a.grad, b.grad)
    ref.step()
    scaler.step(opt)  # what accelerate's AcceleratedOptimizer.step does with a scaler
    scaler.update()
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert all(m.grad is None for m in opt.masters)


def test_an_overflow_skips_the_step_and_drops_its_gradients():
    """An inf in the scaled gradients: the scaler skips `step()`, so nothing consumes the masters' gradients. They
    must not leak into the next step, which must equal a fresh optimizer's step on the next batch alone."""
    ref_model, ref, model, opt, scaler = _pair()
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(_loss(model, *_batch(0))).backward()
    opt.masters[0].grad[0, 0] = float("inf")  # an overflow in the scaled backward
    norm = opt.clip_grad_norm_(MAX_NORM, scaler=scaler)
    assert not torch.isfinite(norm)
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == SCALE / 2, "the scaler must have seen the overflow and backed off"
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "the step must be skipped"
    assert not opt.state, "AdamW must not have stepped"
    assert all(m.grad is None for m in opt.masters), "the skipped step's gradients must be dropped"

    x, w = _batch(1)
    _loss(ref_model, x, w).backward()
    ref.clip_grad_norm_(MAX_NORM)
    ref.step()
    scaler.scale(_loss(model, x, w)).backward()
    opt.clip_grad_norm_(MAX_NORM, scaler=scaler)
    scaler.step(opt)
    scaler.update()
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)


def _absent_grads_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        shared, rank0_only, unused = (torch.nn.Linear(8, 8).to(torch.bfloat16) for _ in range(3))
        params = [*shared.parameters(), *rank0_only.parameters(), *unused.parameters()]
        before = [p.detach().clone() for p in params]
        opt = MasterWeightsOptimizer(params, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
        y = shared(x)
        if rank == 0:  # e.g. an MoE expert only rank 0's tokens were routed to
            y = rank0_only(y)
        y.float().square().sum().backward()
        opt.reduce_gradients()
        grads = [None if m.grad is None else m.grad.clone() for m in opt.masters]
        opt.step()
        torch.save(
            {
                "grads": grads,
                "moved": [not torch.equal(b, p) for b, p in zip(before, params)],
                "state": [m in opt.state for m in opt.masters],
                "params": [p.detach().clone() for p in params],
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def test_ddp_master_without_a_gradient_on_every_rank_is_skipped(tmp_path):
    """Two gloo processes. A master no rank has a gradient for stays without one, so AdamW skips it (no decay, no
    state), as one process does; a master only one rank has a gradient for gets the mean with zeros elsewhere."""
    world = 2
    with tempfile.NamedTemporaryFile(dir=tmp_path, delete=False) as f:
        init_file = f.name
    os.remove(init_file)
    mp.start_processes(_absent_grads_worker, args=(world, init_file, str(tmp_path)), nprocs=world, start_method="spawn")
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    shared, rank0_only, unused = slice(0, 2), slice(2, 4), slice(4, 6)
    for r in range(world):
        assert got[r]["grads"][unused] == [None, None], f"rank {r}: absent everywhere must stay absent"
        assert got[r]["moved"][unused] == [False, False], f"rank {r}: AdamW decayed parameters without a gradient"
        assert got[r]["state"][unused] == [False, False]
        assert all(g is not None for g in got[r]["grads"][shared] + got[r]["grads"][rank0_only])
        assert all(got[r]["moved"][shared] + got[r]["moved"][rank0_only])
    for a, b in zip(got[0]["grads"], got[1]["grads"]):
        assert (a is None and b is None) or torch.equal(a, b)
    for a, b in zip(got[0]["params"], got[1]["params"]):
        assert torch.equal(a, b), "ranks must stay identical"


_FSDP2_PROBE = r"""
import sys, types, torch, torch.distributed as dist
from accelerate import PartialState
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from trl_roundalign.trainer.masters import distributed_master_weights
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
PartialState(cpu=True)
for mixed in ("no", "bf16", "fp16"):
    policy = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "output_dtype": torch.bfloat16}
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy=policy)
    acc = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin), mixed_precision=mixed,
                                is_main_process=True, torch_device_mesh=None, device=torch.device("cpu"))
    model = fsdp2_prepare_model(acc, torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).to(torch.bfloat16))
    dtypes = sorted({str(p.to_local().dtype) for p in model.parameters()})
    keeps = distributed_master_weights("DistributedType.FSDP", mixed, fsdp_param_dtype=torch.bfloat16)[1]
    print(mixed, ",".join(dtypes), keeps)
dist.destroy_process_group()
"""


def test_fsdp_keeps_fp32_masters_exactly_when_accelerate_upcasts(tmp_path):
    """accelerate's own `fsdp2_prepare_model` (one gloo process) on a bf16 model with a bf16 `param_dtype` policy:
    the sharded parameters the optimizer steps are fp32 only with mixed precision on, whatever `param_dtype` says;
    `distributed_master_weights` must give the same answer."""
    script = tmp_path / "fsdp2_probe.py"
    script.write_text(_FSDP2_PROBE)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:1] in (["no"], ["bf16"], ["fp16"])]
    assert [r[:2] for r in rows] == [["no", "torch.bfloat16"], ["bf16", "torch.float32"], ["fp16", "torch.float32"]]
    for mixed, dtype, keeps in rows:
        assert keeps == str(dtype == "torch.float32"), f"mixed_precision={mixed}: parameters {dtype}, keeps={keeps}"


@pytest.mark.vllm
def test_a_second_train_keeps_the_master_optimizer(tmp_path, closing):
    """`train()` twice on one trainer: the second finds accelerate's wrapper around the master optimizer and must
    reuse it (one set of fp32 masters), not wrap the wrapper."""
    from helpers.trainer import make_config, varied_reward

    from trl_roundalign import RoundAlignGRPOTrainer
    from trl_roundalign.data import arithmetic_dataset
    from trl_roundalign.local_models import tiny_model

    args = make_config(tmp_path, max_steps=1, learning_rate=1e-5, roundalign_regions=[])
    trainer = closing(
        RoundAlignGRPOTrainer(
            model=str(tiny_model("llama")), reward_funcs=varied_reward, args=args, train_dataset=arithmetic_dataset("train[:8]")
        )
    )
    trainer.train()
    first = trainer._master_optimizer()
    assert isinstance(first, MasterWeightsOptimizer)
    masters = [m.detach().clone() for m in first.masters]
    trainer.train()
    assert trainer._master_optimizer() is first
    assert trainer.optimizer.optimizer is first, "accelerate's wrapper must hold the master optimizer itself"
    assert any(not torch.equal(a, m) for a, m in zip(masters, first.masters)), "the second train() must step the masters"
    trainer.close()
