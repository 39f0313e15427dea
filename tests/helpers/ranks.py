"""Two gloo ranks on 127.0.0.1 for the tests of what every rank of a run does: `run_two_ranks` (in the test) starts a
script twice with RANK/WORLD_SIZE/MASTER_* set and reads what each rank reported; `report` (in the script) writes a
rank's result and stays alive until the other rank has written its own, as a trainer whose caller caught the error
would (a rank leaving early would break the other's collective for it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from helpers.env import subprocess_env
from helpers.server import free_port


def run_two_ranks(script: Path, out: Path, *argv: str, timeout: float = 240) -> list[dict]:
    master = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(out), *argv],
            env=subprocess_env(
                RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=master, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1",
            ),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        for r in (0, 1)
    ]  # fmt: skip
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    results = []
    for r in (0, 1):
        path = out / f"rank{r}.json"
        assert path.exists(), "\n".join(o[-3000:] for o in outputs)
        results.append(json.loads(path.read_text()))
    return results


def report(out: str, rank: int, result: dict, started: float, wait_s: float = 150) -> None:
    result["seconds"] = time.monotonic() - started
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    deadline = time.monotonic() + wait_s
    while not os.path.exists(os.path.join(out, f"rank{1 - rank}.json")) and time.monotonic() < deadline:
        time.sleep(0.2)


ROOT = Path(__file__).resolve().parents[2]
FSDP_CPU_SHIM = ROOT / "tests" / "trainer" / "fsdp_cpu_shim"


def accelerate_launch(config: str | None, script: Path, *argv: str, **extra: str) -> tuple[list[str], dict]:
    """`(command, environment)` of `accelerate launch` on CPU (gloo) running `script argv` as two processes: with
    `recipes/accelerate_configs/<config>` (the FSDP2 recipe's checkpoint sharded: these runs save sharded), or, `config`
    None, a plain two-process launch; the test-only shim on their PYTHONPATH (accelerate's FSDP / DeepSpeed branch on a
    CPU, see `tests/trainer/fsdp_cpu_shim`); a rendezvous port the kernel has just handed out (`--main_process_port`
    overrides any other)."""
    path = os.pathsep.join(p for p in (str(FSDP_CPU_SHIM), os.environ.get("PYTHONPATH", "")) if p)
    env = subprocess_env(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", PYTHONPATH=path, **extra)
    where = (["--config_file", str(ROOT / "recipes" / "accelerate_configs" / config)] if config
             else ["--multi_gpu", "--num_machines", "1"])
    if config == "fsdp2.yaml":  # the recipe gathers a FULL_STATE_DICT at save
        where += ["--fsdp_state_dict_type", "SHARDED_STATE_DICT"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *where, "--num_processes", "2",
           "--main_process_port", str(free_port()), str(script), *argv]
    return cmd, env


def accelerate_launch_two(script: Path, out: Path, *argv: str, config: str, timeout: float = 900,
                          **extra: str) -> list[dict]:
    """`script out argv` under `accelerate_launch(config, ...)`; what each rank reported (`report`)."""
    cmd, env = accelerate_launch(config, script, str(out), *argv, **extra)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    results = []
    for r in (0, 1):
        path = out / f"rank{r}.json"
        assert path.exists(), f"rc {proc.returncode}\n" + proc.stdout[-3000:] + proc.stderr[-6000:]
        results.append(json.loads(path.read_text()))
    return results
