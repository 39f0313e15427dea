"""Conditions: a region set under a rounding profile, how an analysis builds them, and how one is applied.

Shared by `compare` (scoring against the engine) and `per_layer` (layer by layer against the exact mode), so
neither imports the other.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..engine.gemm import PLAIN, GemmSchedule
from ..models import takes_engine_lanes
from ..patching import apply_roundalign, revert_roundalign
from ..profiles import ALL_REGIONS, PAPER_CONDITIONS, PAPER_REGIONS, get_profile

__all__ = ["CONDITION_SETS", "Condition", "apply_condition", "build_conditions"]

CONDITION_SETS = ("paper", "regions", "all")
_PAPER_NAMES = {regions: name for name, regions in PAPER_CONDITIONS.items()}


@dataclass(frozen=True)
class Condition:
    """A region set under a rounding profile, with a name for tables."""

    name: str
    regions: tuple[str, ...]
    profile: str
    # The row-parallel linears' TP form: None follows the engine's tensor_parallel_size (`apply_condition`), 1 keeps
    # the unsharded linears against a TP engine (what TP alone changes).
    tensor_parallel: int | None = None


def _name(regions: tuple[str, ...]) -> str:
    return _PAPER_NAMES.get(regions) or "+".join(regions)


def build_conditions(which: str, profile: str, *, exact: bool = False, tensor_parallel: int = 1) -> list[Condition]:
    """The conditions of one analysis.

    Args:
        which: `"paper"` (default BF16, RoPE-only, three regions), `"regions"` (default, each region
            alone, the three together) or `"all"` (all 8 subsets of the three regions).
        profile: the aligned conditions' profile (the default condition always uses `none`).
        exact: append the exact mode: `ALL_REGIONS` under the exact refinement of `profile`
            (`vllm-compiled-exact`, `vllm-compiled-piecewise-exact`).
        tensor_parallel: the engine's TP size; above 1 (with `exact`) the exact mode without the TP form is added
            too, `exact_tp1`: what the engine's sharded sums alone change.
    """
    from ..engine import exact_profile_for

    if which == "paper":
        sets = [(), ("rope",), PAPER_REGIONS]
    elif which == "regions":
        sets = [()] + [(r,) for r in PAPER_REGIONS] + [PAPER_REGIONS]
    elif which == "all":
        sets = [tuple(c) for k in range(4) for c in itertools.combinations(PAPER_REGIONS, k)]
    else:
        raise ValueError(f"Unknown condition set {which!r}; choose one of {', '.join(CONDITION_SETS)}.")
    out = [Condition(_name(s), s, "none" if not s else profile) for s in sets]
    if exact:
        out.append(Condition("exact", ALL_REGIONS, exact_profile_for(profile)))
        if tensor_parallel > 1:
            out.append(Condition("exact_tp1", ALL_REGIONS, exact_profile_for(profile), tensor_parallel=1))
    return out


def apply_condition(
    model: torch.nn.Module,
    cond: Condition,
    reduction_lanes: Sequence[int] | None,
    attention_block_size: int | None,
    backend: str | None = None,
    engine_max_model_len: int | None = None,
    gemm_schedule: GemmSchedule = PLAIN,
    tensor_parallel: int = 1,
) -> None:
    """Revert whatever patches `model` has, then apply `cond`'s (lanes and block size where its profile uses them;
    the engine's max_model_len for LongRoPE models). An aligned condition's linears compute as the engine's do
    (`gemm_schedule`, `trl_roundalign.engine.gemm`; a `tensor_parallel` > 1 engine's row-parallel sums, `trl_roundalign.engine.tp`),
    as the trainer's do; the default condition keeps plain `F.linear`."""
    from ..engine.gemm import install_row_blocked_linears
    from ..engine.tp import install_tp_linears

    revert_roundalign(model)
    schedule = GemmSchedule(*gemm_schedule) if cond.regions else GemmSchedule()
    install_row_blocked_linears(model, schedule.block_rows, schedule.min_rows)
    tp = tensor_parallel if cond.tensor_parallel is None else cond.tensor_parallel
    install_tp_linears(model, tp if cond.regions else 1, schedule.block_rows, schedule.min_rows)
    lanes = reduction_lanes if takes_engine_lanes(model, cond.profile) else None
    block = attention_block_size if get_profile(cond.profile).attention == "vllm-cpu" else None
    apply_roundalign(
        model, cond.regions, cond.profile, backend, reduction_lanes=lanes, positions_from_mask=False,
        attention_block_size=block, engine_max_model_len=engine_max_model_len,
    )
