"""An engine's weights shown equal, bit for bit, to the trainer's: a digest per tensor, in the trainer's names.

Each worker of the server hashes the weights its model computes with (`worker_digests`, through the token-guarded
/collective_rpc of `trl-roundalign serve`'s workers: `engine.layout.WorkerFacts.roundalign_weight_digests`), cut back to
the trainer's tensors: a fused projection (`qkv_proj`, `gate_up_proj`: the model class's `packed_modules_mapping`) into
its parts, a tensor-parallel shard as the rows or columns of the trainer's tensor it holds, a padded vocabulary to its
real rows. The trainer hashes the same slices of its own tensors (`trainer_digests`) and `compare` names every tensor
whose bytes differ, and every one that could not be compared (a parameter of a kind not cut back here, say an MoE
expert stack, or a trainer tensor no worker reported): nothing is taken as equal that was not hashed on both sides.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

__all__ = ["DIGEST_METHOD", "WeightComparison", "compare", "tensor_digest", "trainer_digests", "worker_digests"]

DIGEST_METHOD = "roundalign_weight_digests"


def tensor_digest(tensor) -> str:
    """A 128-bit BLAKE2b of the tensor's bytes (its dtype's bit patterns, row-major), with its dtype and shape."""
    import torch

    t = tensor.detach().contiguous().cpu()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _slices(model) -> tuple[list[tuple[str, object, int | None, int, int]], list[str]]:
    """`(slices, not_cut)`: each of the engine model's parameters as `(trainer name, engine tensor, dim, start,
    length)`: the engine tensor equals the trainer tensor's `narrow(dim, start, length)` (dim None: the whole tensor)."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    out, not_cut = [], []
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        module = modules.get(owner)
        short = owner.rsplit(".", 1)[-1]
        data = param.data
        if isinstance(module, QKVParallelLinear):
            sizes = [module.num_heads * module.head_size, module.num_kv_heads * module.head_size,
                     module.num_kv_heads * module.v_head_size]
            starts = [rank * sizes[0], (rank // module.num_kv_head_replicas) * sizes[1],
                      (rank // module.num_kv_head_replicas) * sizes[2]]
            parts = packed.get(short, ["q_proj", "k_proj", "v_proj"])
        elif isinstance(module, MergedColumnParallelLinear):
            sizes = [s // tp for s in module.output_sizes]
            starts = [rank * s for s in sizes]
            parts = packed.get(short)
        else:
            parts = None
        if parts is not None:
            if len(parts) != len(sizes):
                not_cut.append(f"{name} (fused from {len(parts)} tensors, {len(sizes)} output sizes)")
                continue
            offset = 0
            for part, size, start in zip(parts, sizes, starts):
                out.append((f"{owner.rsplit('.', 1)[0]}.{part}.{leaf}", data.narrow(0, offset, size),
                            0 if tp > 1 else None, start, size))
                offset += size
        elif isinstance(module, VocabParallelEmbedding):  # the padded rows past the real vocabulary are not the trainer's
            shard = module.shard_indices
            rows = shard.org_vocab_end_index - shard.org_vocab_start_index
            whole = tp == 1 and rows == getattr(module, "org_vocab_size", rows)
            out.append((name, data.narrow(0, 0, rows), None if whole else 0, shard.org_vocab_start_index, rows))
        elif tp > 1 and isinstance(module, RowParallelLinear) and leaf == "weight":
            out.append((name, data, 1, rank * data.shape[1], data.shape[1]))
        elif tp > 1 and isinstance(module, ColumnParallelLinear):
            out.append((name, data, 0, rank * data.shape[0], data.shape[0]))
        elif tp == 1 or isinstance(module, ReplicatedLinear) or (
                getattr(param, "output_dim", None) is None and getattr(param, "input_dim", None) is None):
            out.append((name, data, None, 0, 0))  # whole on every rank
        else:
            not_cut.append(f"{name} (a {type(module).__name__} shard)")
    return out, not_cut


def worker_digests(worker) -> dict:
    """What one worker reports: `digests` (`[trainer name, dim, start, length, digest, dtype]` per slice) and `not_cut`
    for the model it computes with (see the module)."""
    model = worker.model_runner.model
    slices, not_cut = _slices(model)
    return {"digests": [[n, d, s, k, tensor_digest(t), str(t.dtype)] for n, t, d, s, k in slices], "not_cut": not_cut}


def _as_engine_holds(t, dtype: str | None):
    """The trainer tensor `t` as the engine holds it: an fp32 master (FSDP2's upcast parameters, which TRL pushes as
    they are) becomes the 16-bit image the engine's loader copies it into (`copy_`, round to nearest even: the bits the
    policy's bf16 forward computes with too). Any other dtype difference is left to differ."""
    import torch

    target = {"torch.bfloat16": torch.bfloat16, "torch.float16": torch.float16}.get(dtype)
    return t.to(target) if target is not None and t.dtype == torch.float32 else t


def trainer_digests(model, reported: list[list]) -> dict[tuple, str]:
    """The trainer's digests of the slices the workers `reported`, keyed `(name, dim, start, length)`: every process
    calls it, in the same order (a sharded parameter is gathered whole: FSDP2's `full_tensor`, DeepSpeed ZeRO-3's
    `GatheredParameters`, each a collective)."""
    params = dict(model.named_parameters())
    out = {}
    for name, dim, start, length, _, dtype in sorted(reported, key=lambda e: (e[0], -1 if e[1] is None else e[1], e[2])):
        p = params.get(name)
        if p is None:
            continue
        with _gathered(p):
            t = _as_engine_holds((p.full_tensor() if hasattr(p, "full_tensor") else p).detach(), dtype)
            out[(name, dim, start, length)] = tensor_digest(t if dim is None else t.narrow(dim, start, length))
    return out


def _gathered(p):
    """A ZeRO-3 partitioned parameter gathered whole for the duration (a no-op for any other parameter)."""
    import contextlib

    if not hasattr(p, "ds_id"):
        return contextlib.nullcontext()
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if p.ds_status == ZeroParamStatus.AVAILABLE:  # gathered by an outer context (nested gathers are refused)
        return contextlib.nullcontext()

    return deepspeed.zero.GatheredParameters([p], modifier_rank=None)


@dataclass
class WeightComparison:
    """What `compare` found: `compared` slices equal on both sides, `differing` and `not_compared` named."""

    compared: int = 0
    differing: list[str] = field(default_factory=list)
    not_compared: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not self.differing and not self.not_compared

    def summary(self) -> str:
        line = f"{self.compared} tensors bit-identical"
        if self.differing:
            line += f"; {len(self.differing)} differ: {', '.join(self.differing[:3])}" + (" ..." if len(self.differing) > 3 else "")
        if self.not_compared:
            line += (f"; {len(self.not_compared)} not compared: {', '.join(self.not_compared[:3])}"
                     + (" ..." if len(self.not_compared) > 3 else ""))
        return line


def compare(model, workers: list[dict]) -> WeightComparison:
    """The trainer's `model` against what each worker reported (`worker_digests`)."""
    result = WeightComparison()
    reported = set()
    for facts in workers:
        result.not_compared += [f"server: {n}" for n in facts.get("not_cut", [])]
        ours = trainer_digests(model, facts["digests"])
        for name, dim, start, length, digest, _ in facts["digests"]:
            mine = ours.get((name, dim, start, length))
            reported.add(name)
            if mine is None:
                result.not_compared.append(f"server: {name} (the trainer has no such tensor)")
            elif mine != digest:
                result.differing.append(name if dim is None else f"{name}[{dim}: {start}:{start + length}]")
            else:
                result.compared += 1
    for name, _ in model.named_parameters():  # a tied head is one parameter here, and one in the engine
        if name not in reported:
            result.not_compared.append(f"trainer: {name} (no worker reported it)")
    return result
