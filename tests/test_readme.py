"""The README's quickstart block runs as printed, in a fresh process with a new user's environment."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _quickstart() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- quickstart -->\n```python\n(.*?)```", text, re.S)
    assert match, "README.md lost its quickstart block (marked <!-- quickstart -->)"
    return match.group(1)


def test_readme_quickstart_runs_as_printed(tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(_quickstart())
    # No use_cpu, no KV-cache size, no offline flags: only where the offline models are cached (so the test
    # does not rebuild them) and a private home.
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path / "home"),
        "TRL_ROUNDALIGN_CACHE": os.environ["TRL_ROUNDALIGN_CACHE"],
    }
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    k3 = float(re.search(r"mismatch k3: (\S+)", proc.stdout).group(1))
    assert 0 <= k3 < 1e-2
    if not torch.cuda.is_available():
        assert "training on the CPU (use_cpu=True)" in proc.stderr
        assert "VLLM_CPU_KVCACHE_SPACE is unset" in proc.stderr
    assert (tmp_path / "outputs" / "quickstart" / "mismatch.jsonl").is_file()
