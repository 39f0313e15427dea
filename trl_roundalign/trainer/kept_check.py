"""The colocated start-up check's verdict kept per machine: a later run whose check would score the same weights on
the same engine, with the same code, libraries and machine, reads the verdict an earlier run measured instead of
scoring again (67-85 s of an exact SmolLM2 trainer's start-up on a 2-core AVX2 machine, docs/cost.md).

Kept under `measured.cached_measurement`'s whole key (the machine, torch's build, threads and steering variables, the
source of every module of this package), with what the check depends on beside it: the trainer's run record
(`RoundAlignGRPOTrainer.roundalign_run_info`: versions, profile, regions, backend, the engine's whole layout, the GEMM
schedule, what was patched), the engine's reduction lanes, the check's own sequences, a digest of every tensor the
trainer holds and of every tensor each engine worker computes with (`engine.weight_digest`), and every `VLLM_*`
environment variable (but a shared memory buffer's name, which vLLM draws afresh in each process). Only a passing
verdict is kept: a check that fails runs again on every start. The verdict read back says when it was measured
(`Verification.kept`), and every step still compares each completion token with the sampler's (`mismatch/*`).
`ROUNDALIGN_MEASURE_CACHE=off` runs the check every time.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from .startup_check import CandidateScore, Verification

__all__ = ["KIND", "colocated_key", "engine_weights_digest", "kept_verification", "vllm_env", "weights_digest"]

KIND = "startup-check"

logger = logging.getLogger(__name__)
# `VLLM_*` variables vLLM itself sets to a fresh value in every process (`vllm.envs.get_env_or_set_default`: a shared
# memory buffer's random name); they name a resource, not how anything is computed.
_FRESH = ("VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME",)


def weights_digest(model) -> str:
    """One digest of every parameter and buffer the policy holds, by name (`engine.weight_digest.tensor_digest`; a
    sharded parameter whole)."""
    from ..engine.weight_digest import tensor_digest

    h = hashlib.blake2b(digest_size=16)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        whole = t.full_tensor() if hasattr(t, "full_tensor") else t
        h.update(f"{name}:{tensor_digest(whole)};".encode())
    return h.hexdigest()


def engine_weights_digest(llm) -> str:
    """One digest of what each of the colocated engine's workers computes with (`engine.weight_digest.worker_digests`)."""
    from ..engine.weight_digest import worker_digests

    h = hashlib.blake2b(digest_size=16)
    for report in llm.collective_rpc(worker_digests):
        h.update(repr((sorted(map(tuple, report["digests"])), report["not_cut"])).encode())
    return h.hexdigest()


def colocated_key(run_info: dict, llm, model, *, lanes, sequences: list[list[int]]) -> dict:
    """What the colocated check's verdict depends on besides the machine and this package's code (see the module)."""
    info = {k: v for k, v in run_info.items() if k != "verification"}
    return {"run": info, "lanes": repr(lanes), "sequences": sequences, "trainer_weights": weights_digest(model),
            "engine_weights": engine_weights_digest(llm),
            "vllm_env": vllm_env()}


def vllm_env() -> dict[str, str]:
    """The `VLLM_*` environment variables, but those vLLM sets afresh in every process (`_FRESH`)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_") and k not in _FRESH}


def _sources() -> tuple[str, ...]:
    root = Path(__file__).resolve().parents[1]
    return tuple(str(p) for p in sorted(root.rglob("*.py")))


def kept_verification(key: dict, run: Callable[[], Verification]) -> Verification:
    """`run()`'s verdict, or the one it returned on an earlier run under the same whole key (`Verification.kept` then
    gives that run's time). A failing `run()` raises and keeps nothing."""
    from ..measured import cached_measurement

    ran: list[Verification] = []

    def measure() -> dict:
        ran.append(run())
        return {**ran[0].as_dict(), "kept": datetime.now(UTC).isoformat(timespec="seconds")}

    stored = cached_measurement(KIND, key, _sources(), measure)
    if ran:
        return ran[0]
    logger.info("start-up check: passed on this machine at %s with these weights, engine layout, code and libraries; "
                "not run again (ROUNDALIGN_MEASURE_CACHE=off runs it every time)", stored["kept"])
    return Verification(**{**stored, "candidates": [CandidateScore(**c) for c in stored["candidates"]]})
