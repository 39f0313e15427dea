"""Measurements of this machine kept between runs: what exact mode measures at start-up that cannot change while the
machine, the libraries, the code that measures and the thing measured stay the same (the GEMM batch-invariance
measurement, `engine.gemm`, about 140 s of a SmolLM2 trainer's first start-up on a 2-core AVX2 machine; the colocated
start-up check's passing verdict, `trainer.kept_check`).

A measurement is stored as `<cache_root>/measured/<kind>/<digest>.json` (`local_models.cache_root`:
`TRL_ROUNDALIGN_CACHE` or `~/.cache/trl_roundalign`) with its whole key beside the result: the machine (CPU model and
every CPU flag), torch's version and build configuration (its BLAS and oneDNN), its thread counts, the environment
variables that steer those libraries' kernel choice, a digest of the measuring code's source files, and what was
measured. Any change in any of it is another key, so the measurement runs again; nothing is looked up by a partial key.
`ROUNDALIGN_MEASURE_CACHE=off` measures every time. An unreadable or malformed entry is measured again and replaced.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["cached_measurement", "machine_key"]

logger = logging.getLogger(__name__)

# Environment variables that change which kernels torch's CPU libraries pick (and so their bits).
_STEERING = ("ATEN_CPU_CAPABILITY", "ONEDNN_", "DNNL_", "MKL_", "KMP_", "OMP_", "OPENBLAS_", "GOMP_")
FORMAT = 1


def _cpu() -> dict:
    from .machine import cpu_info

    model, flags = cpu_info()
    return {"model": model or platform.processor(), "machine": platform.machine(),
            "flags": hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16]}


def machine_key() -> dict:
    """What a CPU measurement's bits depend on outside the code that measures: the CPU, the torch build and its
    configuration, its thread counts, and the environment variables that steer its kernels."""
    import torch

    return {
        "cpu": _cpu(),
        "torch": torch.__version__,
        "torch_config": hashlib.sha256(torch.__config__.show().encode()).hexdigest()[:16],
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_STEERING)},
    }


@functools.cache
def _source_digest(paths: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(Path(p).read_bytes())
    return h.hexdigest()[:16]


def _folder(kind: str) -> Path | None:
    if os.environ.get("ROUNDALIGN_MEASURE_CACHE", "").lower() in ("0", "off", "false", "no"):
        return None
    from .local_models import cache_root

    return cache_root() / "measured" / kind


def cached_measurement(kind: str, key: dict, sources: tuple[str, ...], measure: Callable[[], dict]) -> dict:
    """`measure()` (a JSON-able dict), or what it returned on an earlier run under the same whole key: `key` (what is
    measured), `sources` (the files of the code that measures) and `machine_key()`."""
    full = {"format": FORMAT, "kind": kind, "what": key, "code": _source_digest(tuple(sources)), "machine": machine_key()}
    digest = hashlib.sha256(json.dumps(full, sort_keys=True, default=str).encode()).hexdigest()[:32]
    folder = _folder(kind)
    path = folder / f"{digest}.json" if folder is not None else None
    if path is not None and path.exists():
        try:
            entry = json.loads(path.read_text())
            if entry.get("key") == json.loads(json.dumps(full, sort_keys=True, default=str)):
                logger.info("%s: measured on this machine on an earlier run (%s)", kind, path)
                return entry["result"]
            logger.warning("%s: %s holds another key; measuring again", kind, path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("%s: %s could not be read (%s); measuring again", kind, path, e)
    result = measure()
    if path is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as f:
                json.dump({"key": full, "result": result}, f, sort_keys=True, default=str)
            os.replace(f.name, path)  # atomic: a concurrent process reads the old entry or the new, never half
        except OSError as e:
            logger.warning("%s: not kept for later runs (%s)", kind, e)
    return result
