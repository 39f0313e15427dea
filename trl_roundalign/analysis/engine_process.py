"""The engine side of a comparison in a separate process (`run_engine_in_process`).

A family that vLLM runs through its Transformers backend (OLMo 2) cannot share a process with its engine: the
backend rewires the family's transformers class when it builds the engine, after which no model of that class in
the same process can run its forward (docs/families.md). `trl-roundalign analyze` then builds the engine in a
child process (`python -m trl_roundalign.analysis.engine_process REQUEST RESULT`), which generates, scores the
samples with the engine's prefill, reads the engine's description and reduction lanes, and hands them back as a
pickled `EngineRun`; the parent scores the same tokens with the Hugging Face model.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from .compare import EngineRun, run_engine

__all__ = ["run_engine_in_process"]


def run_engine_in_process(model_path, *, engine_kwargs: dict | None = None, seed: int = 0, **run_kwargs) -> EngineRun:
    """`compare.run_engine` with an engine built by `engine.build_llm(model_path, seed=seed, **engine_kwargs)` in a
    fresh Python process; returns its `EngineRun`.

    Raises:
        RuntimeError: the child process failed (its output went to this process's stderr).
    """
    with tempfile.TemporaryDirectory(prefix="roundalign-engine-") as tmp:
        request, result = Path(tmp) / "request.pt", Path(tmp) / "result.pt"
        torch.save({"model": str(model_path), "engine_kwargs": dict(engine_kwargs or {}), "seed": seed,
                    "run_kwargs": run_kwargs}, request)
        proc = subprocess.run(
            [sys.executable, "-m", "trl_roundalign.analysis.engine_process", str(request), str(result)],
            env=dict(os.environ), check=False,
        )
        if proc.returncode != 0 or not result.exists():
            raise RuntimeError(
                f"The engine process for {model_path} failed (exit code {proc.returncode}); its output is above."
            )
        return torch.load(result, weights_only=False)


def _main(request: str, result: str) -> int:
    from ..engine import build_llm, close_llm

    req = torch.load(request, weights_only=False)
    llm = build_llm(req["model"], seed=req["seed"], **req["engine_kwargs"])
    try:
        run = run_engine(llm, seed=req["seed"], **req["run_kwargs"])
    finally:
        close_llm(llm)
    torch.save(run, result)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1], sys.argv[2]))
