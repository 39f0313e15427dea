"""The benchmark scripts: unit tests of the measurement harness, and a `--quick` smoke run of each script.

Each script runs in a subprocess, as `make bench` runs it, writing its JSON/CSV into a temporary folder.
On a CPU the Triton and Liger rows must be skipped with a stated reason; with `--interpret` the Triton
path runs under the interpreter (a tiny case) and Liger's failure there is reported, not fatal.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.env import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import harness  # noqa: E402
import summarize  # noqa: E402

ON_GPU = torch.cuda.is_available()


def _env(interpret: bool = False) -> dict:
    env = subprocess_env()
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(args: list[str], timeout: int = 300, interpret: bool = False, env: dict | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env or _env(interpret), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{args} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _last_run(path: Path) -> dict:
    runs = json.loads(path.read_text())
    assert isinstance(runs, list) and runs
    return runs[-1]


# --------------------------------------------------------------------------------------------- harness


def test_paired_ratio_is_the_median_of_per_round_ratios():
    assert harness.paired_ratio([2.0, 4.0, 9.0], [1.0, 2.0, 3.0]) == 2.0
    assert math.isnan(harness.paired_ratio_iqr([1.0, 1.0, 1.0], [1.0, 1.0, 1.0]))  # too few rounds
    assert harness.paired_ratio_iqr([1.0, 2.0, 3.0, 4.0, 5.0], [1.0] * 5) == pytest.approx(3.0)


def test_format_table_pads_columns_and_marks_missing_values():
    text = harness.format_table([{"a": 1, "b": "xyz"}, {"a": 22}], [("a", "A"), ("b", "Bee")])
    lines = text.splitlines()
    assert lines[0] == "| A  | Bee |"
    assert lines[2] == "| 1  | xyz |" and lines[3] == "| 22 | -   |"


def test_measure_memory_counts_what_forward_keeps_on_cpu():
    """A forward that saves a 4 MiB fp32 tensor for backward: held and saved see it, peak sees more."""
    x = torch.randn(1024, 1024, requires_grad=True)

    def forward():
        return (x * 2.0).exp().sum()  # exp saves its 4 MiB output; the product is freed

    stats = harness.measure_memory(forward, lambda out: out.backward(), torch.device("cpu"))
    mib = harness.MiB
    assert 4 * mib <= stats["held"] < 5 * mib
    assert 4 * mib <= stats["saved"] < 5 * mib
    assert stats["peak"] >= 8 * mib  # forward: product + exp output; backward: gradients on top


def test_append_results_appends_json_runs_and_csv_rows(tmp_path):
    env = {"timestamp": "2026-01-01T00:00:00+00:00", "device": "cpu", "commit": "abc"}
    harness.append_results("demo", env, {"k": 1}, [{"x": 1, "y": 2.5}], tmp_path)
    harness.append_results("demo", env, {"k": 2}, [{"x": 3, "y": 4.5}], tmp_path)
    runs = json.loads((tmp_path / "demo.json").read_text())
    assert [r["settings"]["k"] for r in runs] == [1, 2]
    rows = list(csv.DictReader(open(tmp_path / "demo.csv")))
    assert [r["x"] for r in rows] == ["1", "3"] and rows[0]["commit"] == "abc"
    # The same columns in another order (or fewer) keep the file; new columns start a new one beside it.
    harness.append_results("demo", env, {}, [{"y": 6.5, "x": 5}], tmp_path)
    assert [r["x"] for r in csv.DictReader(open(tmp_path / "demo.csv"))] == ["1", "3", "5"]
    harness.append_results("demo", env, {}, [{"z": 0}], tmp_path)
    assert len(list(tmp_path.glob("demo*.csv"))) == 2


def test_model_shapes_match_the_recipes():
    shapes = harness.MODEL_SHAPES
    assert set(shapes) == {"Qwen3-1.7B", "Qwen3-4B", "Qwen3-8B", "DeepSeek-R1-Distill-Qwen-1.5B"}
    cfg = shapes["Qwen3-8B"].config(2)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.head_dim) == (4096, 12288, 2, 128)
    assert shapes["DeepSeek-R1-Distill-Qwen-1.5B"].config().model_type == "qwen2"
    assert [shapes[n].recipe_batch for n in ("Qwen3-1.7B", "Qwen3-4B", "Qwen3-8B")] == [8, 4, 2]


def test_summarize_reads_the_last_runs(tmp_path):
    env = {"device": "GPU X", "timestamp": "t", "commit": "c"}
    ops = [
        {"region": "swiglu", "impl": "hf", "fwd_bwd_ms": 1.0, "held_mib": 4.0},
        {
            "region": "swiglu",
            "impl": "triton",
            "fwd_vs_hf": 0.5,
            "fwd_bwd_vs_hf": 0.6,
            "fwd_bwd_ms": 0.6,
            "held_mib": 2.0,
        },
    ]
    model = [
        {"model": "M", "layers": "4/28", "batch": 8, "seq": 2048, "head": "none", "condition": "bf16_default",
         "backend": "hf eager", "checkpointing": "on", "time_ms": 10.0},
        {"model": "M", "layers": "4/28", "condition": "three_region", "backend": "triton", "checkpointing": "on",
         "time_ms": 9.0, "overhead_pct": -10.0, "d_peak_full_gib": 0.5, "d_held_full_gib": 0.25},
    ]  # fmt: skip
    harness.append_results("bench_ops", env, {"model": "Qwen3-8B", "batch": 2, "seq": 4096}, ops, tmp_path)
    harness.append_results("bench_model", env, {}, model, tmp_path)
    text = summarize.summarize(tmp_path)
    assert "| swiglu | triton | 0.50x" in text
    assert "three_region (triton) | on   | -10.0%" in text and "+0.500" in text
    assert "paper:" in text


# --------------------------------------------------------------------------------------------- scripts


def test_triton_and_liger_are_skipped_with_a_reason_on_cpu():
    import bench_model
    import bench_ops

    cpu = torch.device("cpu")
    for impl in ("triton", "liger"):
        assert "GPU" in bench_ops.availability(impl, cpu, interpret=False)
        assert bench_ops.availability(impl, cpu, interpret=True) is None
    assert bench_ops.availability("torch", cpu, interpret=False) is None
    for cond in ("three_region:triton", "liger"):
        assert "GPU" in bench_model.skip_reason(cond, cpu, interpret=False)
    assert bench_model.skip_reason("three_region:torch", cpu, interpret=False) is None
    assert bench_model.backend_of("rope_only", cpu) == "torch"


@pytest.mark.full  # a script-run check, not a claim (make test stays under 40 min on the AVX2 machine)
def test_bench_ops_quick(tmp_path):
    """All regions on a tiny shape; on a CPU the Triton kernels run under the interpreter (path, not speed)."""
    out = _run(["bench/bench_ops.py", "--quick", "--interpret", "--out", str(tmp_path)], interpret=not ON_GPU)
    run = _last_run(tmp_path / "bench_ops.json")
    assert run["env"]["commit"] and run["env"]["torch"] and run["env"]["device"]
    by = {(r["region"], r["impl"]): r for r in run["rows"]}
    for region in ("rope", "qk_norm_rope", "swiglu", "rms_norm", "add_rms_norm"):
        for impl in ("hf", "torch", "triton"):
            r = by[(region, impl)]
            assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["peak_mib"] >= 0 and r["held_mib"] >= 0, r
        if not ON_GPU:
            assert "interpreter" in by[(region, "triton")]["note"]
        liger = by[(region, "liger")]
        assert liger.get("fwd_bwd_ms") or liger.get("skip_reason")  # runs, or why not is reported
    assert by[("swiglu", "hf")]["fwd_vs_hf"] == 1.0
    assert (tmp_path / "bench_ops.csv").exists()
    assert "| region" in out and "fwd+bwd ms" in out


@pytest.mark.full  # a script-run check, not a claim (make test stays under 40 min on the AVX2 machine)
def test_bench_model_quick(tmp_path):
    """A tiny Qwen3, every condition, checkpointing off and on (Triton under the interpreter on a CPU)."""
    out = _run(["bench/bench_model.py", "--quick", "--interpret", "--out", str(tmp_path)], interpret=not ON_GPU)
    rows = _last_run(tmp_path / "bench_model.json")["rows"]
    done = {(r["condition"], r["backend"], r["checkpointing"]): r for r in rows if "time_ms" in r}
    for ckpt in ("off", "on"):
        for key in (("bf16_default", "hf eager"), ("rope_only", "triton" if ON_GPU else "torch"),
                    ("three_region", "torch"), ("three_region", "triton")):  # fmt: skip
            assert (*key, ckpt) in done, (key, ckpt)
    liger = [r for r in rows if r["condition"] == "liger"]
    assert len(liger) == 2 and all(r.get("time_ms") or r.get("skip_reason") for r in liger)
    base = done[("bf16_default", "hf eager", "on")]
    assert base["overhead_pct"] == 0.0 and base["d_held_full_gib"] == 0.0
    aligned = done[("three_region", "torch", "on")]
    # Under checkpointing the aligned layers keep an fp32 layer input (the residual stream): twice the bytes.
    # cost.md's claim, 2x (bench/results/bench_model.json: 0.38 -> 0.75, 0.5 -> 1.0, 0.63 -> 1.25, 1.0 -> 2.0 MiB).
    # Both values are rounded to 0.01 MiB.
    assert aligned["held_per_layer_mib"] == pytest.approx(2 * base["held_per_layer_mib"], abs=0.0151), (aligned, base)
    assert "paper" in out and "layers" in out


# The two longest smoke runs (about 60 s and 40 s on the AVX2 machine) are make test-full: they check that the
# scripts run, not a claim; make test keeps the harness tests and the ops/model smoke runs.
@pytest.mark.slow
@pytest.mark.full
@pytest.mark.vllm
def test_bench_step_quick(tmp_path):
    """One GRPO step on a tiny Qwen3 with vLLM colocate, aligned, with and without the mismatch callback."""
    out = _run(["bench/bench_step.py", "--quick", "--conditions", "three_region", "--out", str(tmp_path)], timeout=600)
    rows = {r["log_mismatch"]: r for r in _last_run(tmp_path / "bench_step.json")["rows"]}
    assert set(rows) == {"off", "on"}
    assert rows["off"]["step_s"] > 0 and rows["off"]["callback_ms_per_step"] is None
    assert rows["on"]["callback_ms_per_step"] >= 0 and rows["on"]["kl_k3_last"] >= 0
    assert "callback % of step" in out


@pytest.mark.slow
@pytest.mark.full
def test_gpu_check_dry_run(tmp_path):
    """`bench/gpu_check.sh` end to end on a CPU (GPU tests skip, benchmarks --quick): outputs and the summary."""
    env = _env()
    env.update(GPU_CHECK_DRY_RUN="1", PYTHON=sys.executable, OUT=str(tmp_path))
    proc = subprocess.run(
        ["bash", "bench/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {
        "gpu_check.log", "gpu_tests.log", "gpu_tests.xml", "bench_ops.json", "bench_ops.csv", "bench_model.json",
        "bench_model.csv", "bench_tp.json", "bench_tp.csv", "summary.md",
    }  # fmt: skip
    tail = proc.stdout.strip().splitlines()[-12:]
    assert any("paper:" in line for line in tail), "the summary table must come last"
    assert "GPU tests (pytest -m gpu)" in (tmp_path / "summary.md").read_text()


def test_bench_gemm_quick(tmp_path):
    """The GEMM part on one shape: each way timed, and each way's batch invariance measured alongside (the row-block
    schedules must measure invariant on any CPU; plain F.linear is whatever this machine's GEMM is)."""
    out = _run(["bench/bench_gemm.py", "--quick", "--parts", "gemm", "--out", str(tmp_path)])
    run = _last_run(tmp_path / "bench_gemm.json")
    rows = [r for r in run["rows"] if r["part"] == "gemm"]
    impls = {r["impl"] for r in rows}
    assert {"plain", "blocks64", "blocks128"} <= impls, impls
    assert all(r["ms"] > 0 for r in rows)
    assert all(r["invariant"] for r in rows if r["impl"].startswith("blocks")), rows
    assert ("capped" in impls) == run["settings"]["amx"]  # the oneDNN cap is measured where there is AMX to cap
    assert "| part" in out


def test_bench_tp_quick(tmp_path):
    """The TP-aligned row-parallel linear on one shape: each way timed forward and forward + backward, with memory."""
    out = _run(["bench/bench_tp.py", "--quick", "--out", str(tmp_path)])
    run = _last_run(tmp_path / "bench_tp.json")
    impls = {r["impl"] for r in run["rows"]}
    assert {"f_linear", "tp2"} <= impls and ("triton_tp2" in impls) == ON_GPU, impls
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > r["fwd_ms"] * 0.5 and r["peak_mib"] >= 0 for r in run["rows"])
    from trl_roundalign.engine.gemm import cpu_kind

    assert run["settings"]["cpu_kind"] == (None if ON_GPU else cpu_kind())
    assert "| model" in out
