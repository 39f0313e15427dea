"""The documentation site (mkdocs.yml, docs/) builds offline with `mkdocs build --strict`, so a broken link, a
missing anchor, a page left out of the navigation or an API reference that no longer resolves fails `make test`;
and its figures are what scripts/figures.py draws from the committed artifacts."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["NO_MKDOCS_2_WARNING"] = "1"  # Material's banner, not a warning of the build
    # Offline: any attempt to fetch something (fonts, a plugin's download) goes to a closed port and fails.
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
        env[var] = "http://127.0.0.1:9"
    env.pop("NO_PROXY", None)
    env.pop("no_proxy", None)
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)]
    return subprocess.run(cmd, cwd=config.parent, env=env, capture_output=True, text=True, timeout=600)


def test_the_site_builds_offline_with_strict(tmp_path):
    proc = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode == 0, proc.stderr[-4000:]
    site = tmp_path / "site"
    api = (site / "api" / "index.html").read_text()
    for name in ("RoundAlignGRPOTrainer", "RoundAlignGRPOConfig", "apply_roundalign", "add_rms_norm"):
        assert name in api, f"the API reference lost {name}"
    for figure in ("alignment_k3", "mismatch_hist_smollm2", "per_layer_smollm2", "stability"):
        assert (site / "figures" / f"{figure}.png").is_file()
    assert (site / "bench" / "bench_step.json").is_file(), "bench/results is reachable from the evidence page"
    pages = [p.read_text() for p in site.rglob("*.html")]
    assert not [p for p in pages if "fonts.googleapis.com" in p or "fonts.gstatic.com" in p], "web fonts: not offline"


def _copy_of_the_site(tmp_path: Path) -> Path:
    """docs/ and mkdocs.yml copied (docs/bench's link followed), the API reference still reading the package here."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs", symlinks=False)
    config = (ROOT / "mkdocs.yml").read_text()
    assert "paths: [.]" in config
    (tmp_path / "mkdocs.yml").write_text(config.replace("paths: [.]", f"paths: [{ROOT}]"))
    return tmp_path / "mkdocs.yml"


def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    config = _copy_of_the_site(tmp_path)
    page = tmp_path / "docs" / "limitations.md"
    page.write_text(page.read_text() + "\n[a](no-such-page.md), [b](numerics.md#no-such-anchor), [c](results/none.txt)\n")
    proc = _build(config, tmp_path / "site")
    assert proc.returncode != 0
    for target in ("no-such-page.md", "#no-such-anchor", "results/none.txt"):
        assert target in proc.stderr, proc.stderr[-4000:]


def test_a_page_outside_the_navigation_fails_the_build(tmp_path):
    config = _copy_of_the_site(tmp_path)
    (tmp_path / "docs" / "orphan.md").write_text("# Orphan\n")
    proc = _build(config, tmp_path / "site")
    assert proc.returncode != 0 and "orphan.md" in proc.stderr, proc.stderr[-4000:]


def test_the_figures_are_drawn_from_the_committed_artifacts(tmp_path):
    """scripts/figures.py, run on the committed artifacts, draws the committed PNGs again bit for bit."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "figures.py"), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    drawn = sorted(p.name for p in tmp_path.glob("*.png"))
    assert drawn == sorted(p.name for p in (ROOT / "docs" / "figures").glob("*.png"))
    # Bit for bit with the matplotlib the CPU lock pins (another release rasterises differently; requirements/gpu.txt
    # leaves matplotlib unpinned).
    import matplotlib

    pinned = re.search(r"(?m)^matplotlib==(\S+)$", (ROOT / "requirements" / "cpu.lock").read_text()).group(1)
    if matplotlib.__version__ != pinned:
        pytest.skip(f"matplotlib {matplotlib.__version__}, not the locked {pinned}: figures drawn, bytes not compared")
    changed = [n for n in drawn if (tmp_path / n).read_bytes() != (ROOT / "docs" / "figures" / n).read_bytes()]
    assert not changed, f"docs/figures differ from what scripts/figures.py draws now: {changed} (run it and commit)"


def test_the_api_pages_map_names_every_module():
    """docs/api.md's package map names every module of the package: the flat ones and those of trainer/ and engine/
    by file, the other packages by folder."""
    text = (ROOT / "docs" / "api.md").read_text()
    block = text[text.index("## Package layout") : text.index("## The trainer and its config")]
    pkg = ROOT / "trl_roundalign"
    missing = []
    for path in sorted(pkg.glob("*.py")) + sorted(pkg.glob("trainer/*.py")) + sorted(pkg.glob("engine/*.py")):
        if path.name != "__init__.py" or path.parent == pkg:
            if not re.search(rf"(?<![\w.]){re.escape(path.name)}", block):
                missing.append(str(path.relative_to(ROOT)))
    for folder in sorted(p for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        if f"{folder.name}/" not in block:
            missing.append(f"{folder.relative_to(ROOT)}/")
    assert not missing, f"docs/api.md's package map omits {missing}"
