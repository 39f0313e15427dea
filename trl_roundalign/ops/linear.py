"""The GEMM schedule a linear layer computes with, as recorded on the module: the value type (`GemmSchedule`) and its
reading (`module_schedule`), on the lowest floor, where the model families read it. Deciding, measuring and installing
a schedule is the engine's (`engine.gemm`)."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["GemmSchedule", "PLAIN", "module_schedule"]

# Where `engine.gemm.install_row_blocked_linears` records a linear's schedule (row blocks, row floor).
_MARK = "_roundalign_row_blocks"
_MIN_MARK = "_roundalign_min_rows"


class GemmSchedule(NamedTuple):
    """How both sides' linears compute their rows (`linear`): `block_rows` > 0, in blocks of exactly that many rows;
    else `min_rows` > 1, a call of fewer rows zero-padded to `min_rows`; else plain `F.linear`."""

    block_rows: int = 0
    min_rows: int = 0

    @property
    def plain(self) -> bool:
        return self.block_rows <= 0 and self.min_rows <= 1

    def describe(self) -> str:
        if self.block_rows > 0:
            return f"row blocks of {self.block_rows}"
        if self.min_rows > 1:
            return f"a row floor of {self.min_rows} (calls of fewer rows zero-padded)"
        return "plain F.linear"

    def tag(self) -> str:
        """Its part of the compile cache's folder name."""
        return f"rows{self.block_rows}" + (f"min{self.min_rows}" if self.block_rows <= 0 and self.min_rows > 1 else "")


PLAIN = GemmSchedule()  # plain F.linear


def module_schedule(module: torch.nn.Module) -> GemmSchedule:
    """The GEMM schedule `install_row_blocked_linears` gave `module` (plain where none)."""
    return GemmSchedule(module.__dict__.get(_MARK, 0), module.__dict__.get(_MIN_MARK, 0))
