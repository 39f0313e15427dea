"""The README's quickstart block runs as printed, in a fresh process with a new user's environment."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _quickstart() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- quickstart -->\n```python\n(.*?)```", text, re.S)
    assert match, "README.md lost its quickstart block (marked <!-- quickstart -->)"
    return match.group(1)


def _run(script_text: str, tmp_path: Path, name: str):
    script = tmp_path / f"{name}.py"
    script.write_text(script_text)
    # No use_cpu, no KV-cache size, no offline flags: only where the offline models are cached (so the test
    # does not rebuild them) and a private home.
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path / "home"),
        "TRL_ROUNDALIGN_CACHE": os.environ["TRL_ROUNDALIGN_CACHE"],
    }
    run_dir = tmp_path / name
    run_dir.mkdir()
    proc = subprocess.run([sys.executable, str(script)], cwd=run_dir, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = run_dir / "outputs" / "quickstart" / "mismatch.jsonl"
    assert log.is_file()
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return proc, {r["step"]: r for r in rows if "step" in r}


def test_readme_quickstart_runs_as_printed(tmp_path):
    """The block runs as printed; what it prints is the last step's k3; and on the first step (the same sampled
    completions with alignment on or off: the start-up check leaves the random state alone) the three regions'
    k3 against the engine is below default BF16's, paired on the same tokens."""
    text = _quickstart()
    proc, aligned = _run(text, tmp_path, "aligned")
    printed = float(re.search(r"mismatch k3: (\S+)", proc.stdout).group(1))
    # TRL logs once for the run's two steps (logging window): the k3 over the window's tokens.
    n = sum(r["mismatch/tokens"] for r in aligned.values())
    assert sorted(aligned) == [1, 2] and printed == pytest.approx(
        sum(r["mismatch/kl_k3"] * r["mismatch/tokens"] for r in aligned.values()) / n, rel=1e-9
    )
    if not torch.cuda.is_available():
        assert "training on the CPU (use_cpu=True)" in proc.stderr
        assert "VLLM_CPU_KVCACHE_SPACE is unset" in proc.stderr

    marker = "    use_vllm=True,\n"
    assert marker in text
    _, default = _run(text.replace(marker, marker + "    roundalign_regions=[],\n"), tmp_path, "default")
    a, d = aligned[1], default[1]
    assert a["mismatch/tokens"] == d["mismatch/tokens"] > 0
    assert 0 <= a["mismatch/kl_k3"] < d["mismatch/kl_k3"], (a["mismatch/kl_k3"], d["mismatch/kl_k3"])
