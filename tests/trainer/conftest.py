"""Trainer-test fixtures: every trainer's colocated engine is shut down when its test ends.

vLLM's engine freezes the garbage collector when it starts, so a trainer that is only dropped keeps
its engine (about 1 GiB of KV cache on CPU) for the rest of the session; the suite builds dozens.
"""

from __future__ import annotations

import pytest

from trl_roundalign.engine import close_colocated_engine


@pytest.fixture
def closing():
    """`closing(trainer)` returns the trainer (ours or TRL's) and shuts its engine down at teardown, pass or fail."""
    kept = []

    def keep(trainer):
        kept.append(trainer)
        return trainer

    yield keep
    for trainer in kept:
        close = getattr(trainer, "close", None)  # ours: the engine, or a server-mode trainer's weight-transfer group
        close() if close is not None else close_colocated_engine(trainer)
