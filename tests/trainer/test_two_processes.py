"""Two CPU processes (gloo) started by `accelerate launch`, each with its own colocated vLLM: the logged
metrics equal the metrics of the union.

`accelerate launch --cpu --num_processes 2` would go through mpirun, which this machine lacks;
`--multi_gpu --num_processes 2` starts the processes with torch.distributed.run, and without CUDA
they run on the CPU with gloo. That is the command this test runs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.env import free_port, subprocess_env

from trl_roundalign import metrics

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_two_process_metrics_equal_the_union(tmp_path):
    script = Path(__file__).with_name("two_process_run.py")
    env = subprocess_env(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--main_process_port", str(free_port()), "--mixed_precision", "no", "--dynamo_backend", "no", str(script), str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert all(r["world"] == 2 for r in ranks)
    steps = len(ranks[0]["logged"])
    assert steps == 2
    for a, b in zip(ranks[0]["logged"], ranks[1]["logged"]):
        assert {k: v for k, v in a.items() if k.startswith("mismatch/")} == {k: v for k, v in b.items() if k.startswith("mismatch/")}
    accumulation = 2  # micro-batches per optimizer step and rank (two_process_run.py)
    for step in range(steps):
        parts = [p for r in ranks for p in r["recorded"][accumulation * step : accumulation * (step + 1)]]
        union = metrics.merge_sums([metrics.mismatch_sums(t, s, m) for t, s, m in parts])
        expected = metrics.finalize(union)
        logged = ranks[0]["logged"][step]
        assert logged["mismatch/tokens"] == expected["mismatch/tokens"] == sum(int(p[2].sum()) for p in parts)
        for key, value in expected.items():
            assert logged[key] == pytest.approx(value, rel=1e-12, abs=0), key
    # Data parallelism with fp32 masters: the fp32 gradient sums were averaged across the ranks (DDP's bf16
    # reduction is off), so both ranks took the same step and hold the same masters and weights.
    assert ranks[0]["moved"] and ranks[0]["moved"] == ranks[1]["moved"]
    for k, v in ranks[0]["final"].items():
        assert torch.equal(v, ranks[1]["final"][k]), k
    for a, b in zip(ranks[0]["masters"], ranks[1]["masters"]):
        assert a.dtype == torch.float32 and torch.equal(a, b)
