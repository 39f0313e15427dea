"""Trainer-test fixtures: every trainer's colocated engine is shut down when its test ends.

vLLM's engine freezes the garbage collector when it starts, so a trainer that is only dropped keeps
its engine (about 1 GiB of KV cache on CPU) for the rest of the session; the suite builds dozens.
"""

from __future__ import annotations

import pytest

from trl_roundalign.engine import close_llm


def close_trainer(trainer) -> None:
    """`RoundAlignGRPOTrainer.close()`, or the same for a plain `trl.GRPOTrainer`."""
    if hasattr(trainer, "close"):
        trainer.close()
        return
    vg = getattr(trainer, "vllm_generation", None)
    if getattr(vg, "llm", None) is not None:
        close_llm(vg.llm)
        vg.llm = None


@pytest.fixture
def closing():
    """`closing(trainer)` returns the trainer and shuts its engine down at teardown, pass or fail."""
    kept = []

    def keep(trainer):
        kept.append(trainer)
        return trainer

    yield keep
    for trainer in kept:
        close_trainer(trainer)
