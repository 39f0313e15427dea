"""Batch-invariant linear layers: measured on the running machine, and made so where its GEMM is not.

A linear layer is *batch-invariant* when each row of `x @ W.T` gets the same bits whatever the number of rows
computed in the same call. Exact mode needs it: the engine computes a token's row among 1 (decode) to thousands
(prefill) of rows, the trainer among `batch x length`, and the two must agree bit for bit.

Whether it holds is a property of the machine's GEMM, not of the model, so it is measured, never assumed
(`measure_batch_invariance`). Measured with torch 2.13.0+cpu (oneDNN's bf16 matmul):

- AMD AVX2 and AMD AVX-512 (no AMX): invariant at every row count of the tests' and SmolLM2's shapes; on AMD
  AVX-512 a 1-row call at K = 1536 (SmolLM2's down_proj) gives some rows other bits (a decode step with one running
  sequence; docs/results/avx512/batch_invariance.md), so "auto" takes row blocks there;
- Intel Xeon with AMX: *not* invariant. oneDNN picks its kernel by the row count M, and rows of one input get
  other bits at other M (SmolLM2's projections and lm_head from M = 34 to 350-682 against a 1024-row call, up to
  1.4e-4 of outputs; docs/results/amx/batch_invariance.md, scripts/batch_invariance.py).
  docs/numerics.md ("Batch-invariant linear layers") has the evidence.

Two schedules, each chosen only where the measurement needs it (`choose_schedule`):

- a **row floor** (`row_floor_linear`, `GemmSchedule.min_rows`): a call of fewer than `min_rows` rows is zero-padded
  to `min_rows` rows, any other call is one plain GEMM. Enough where only the smallest row counts differ (AMD AVX-512:
  only M = 1, so a floor of 2), and it costs a decode step one extra row instead of a block of 64;
- a **fixed row-block schedule** (`row_blocked_linear`, `GemmSchedule.block_rows`), where larger row counts differ
  (Intel AMX).

The row-block schedule: Every call, on both sides, computes
its rows in blocks of exactly `block_rows` rows (the last block zero-padded), so every row is computed by a
GEMM of the same shape whatever the call's length, and its bits do not depend on its neighbours. The engine
gets it through the package's vLLM-CPU GEMM dispatcher (`_compat`), the trainer through its `nn.Linear`
modules (`install_row_blocked_linears`) and the merged LoRA forward. It keeps oneDNN's AMX kernels; capping
oneDNN's ISA (`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`) also gives invariance but ran the same GEMMs 5-13x slower at
512-2048 rows (bench/bench_gemm.py, docs/cost.md).

The decided schedule reaches the engine's processes through `ROUNDALIGN_GEMM_BLOCK_ROWS` and `ROUNDALIGN_GEMM_MIN_ROWS`
(0 or unset: none), the transport vLLM's spawned workers inherit, read by the package's GEMM dispatcher alone. Backward passes use ordinary matrix products (the gradient is not
part of the bitwise claim).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..ops.linear import _MARK, _MIN_MARK, PLAIN, GemmSchedule, module_schedule

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_BLOCK_ROWS",
    "ENV_MIN_ROWS",
    "GemmSchedule",
    "PLAIN",
    "MAX_FLOOR_ROWS",
    "auto_schedule",
    "choose_schedule",
    "decide_schedule",
    "engine_schedule",
    "row_floor_linear",
    "set_schedule",
    "SMOLLM2_SHAPES",
    "ENV_BLOCK_ROWS",
    "BatchInvarianceReport",
    "cpu_kind",
    "install_row_blocked_linears",
    "linear",
    "measure_batch_invariance",
    "remove_row_blocked_linears",
    "row_blocked_linear",
    "row_counts",
]

ENV_BLOCK_ROWS = "ROUNDALIGN_GEMM_BLOCK_ROWS"
ENV_MIN_ROWS = "ROUNDALIGN_GEMM_MIN_ROWS"
# Chosen by bench/bench_gemm.py on the AMX machine (docs/cost.md): 64 rows cost 1.3-2.2x plain F.linear at decode
# sizes and 2.1-3.4x at 512-2048 rows (128 rows: 1.8-2.5x and 1.5-2.4x); end to end the engine 1.30x, the trainer's
# forward + backward 1.15x. GRPO decodes, so the decode sizes decide. Paid only where the GEMM is variant.
DEFAULT_BLOCK_ROWS = 64
# Rows the measurement also computes one at a time (`measure_batch_invariance`): on the AMD AVX-512 kind a 1-row bf16
# GEMM at K = 1536 flipped an output on about 1 row in 9 (SmolLM2's down_proj), which row 0 alone did not show.
SINGLE_ROWS = 128
# The largest row floor "auto" tries: a machine whose GEMM differs only below this many rows gets a floor one above
# its largest variant row count; one that differs at more rows (Intel AMX: 34-682) gets row blocks.
MAX_FLOOR_ROWS = 8


def _env_rows(name: str) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: give a whole number of rows (0 turns it off).") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r}: give a whole number of rows >= 0 (0 turns it off).")
    return value


def engine_schedule() -> GemmSchedule:
    """The schedule `set_schedule` handed to the engine being built in this process (plain `F.linear` when none).
    Read by the engine's GEMM dispatcher only (`dispatch._live_weight_dispatch`); everything else takes the schedule
    from the engine's layout."""
    return GemmSchedule(_env_rows(ENV_BLOCK_ROWS), _env_rows(ENV_MIN_ROWS))


def set_schedule(schedule: GemmSchedule) -> None:
    """Hand the decided schedule (`decide_schedule`) to the engine about to be built: the environment is only the
    transport into vLLM's processes (it spawns TP workers), read by its GEMM dispatcher (`dispatch`) and nowhere
    else; what the engine then computes with is read back from its loaded model (`layout.worker_facts`)."""
    schedule = GemmSchedule(*schedule)
    if schedule.block_rows < 0 or schedule.min_rows < 0:
        raise ValueError(f"row counts must be >= 0, got {schedule}")
    os.environ[ENV_BLOCK_ROWS] = str(int(schedule.block_rows))
    os.environ[ENV_MIN_ROWS] = str(int(schedule.min_rows))


# ------------------------------------------------------------------------------------------------
# The op
# ------------------------------------------------------------------------------------------------


def _blocked_2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    nblocks = (m + rows - 1) // rows
    out = torch.empty(nblocks * rows, n, dtype=x.dtype, device=x.device)
    wt = weight.t()
    full = (m // rows) * rows
    for s in range(0, full, rows):
        if bias is None:
            torch.mm(x[s : s + rows], wt, out=out[s : s + rows])
        else:
            torch.addmm(bias, x[s : s + rows], wt, out=out[s : s + rows])
    if full < m:
        tail = x.new_zeros(rows, k)
        tail[: m - full] = x[full:]
        if bias is None:
            torch.mm(tail, wt, out=out[full:])
        else:
            torch.addmm(bias, tail, wt, out=out[full:])
    return out[:m]


@torch.library.custom_op("roundalign::row_blocked_linear", mutates_args=())
def row_blocked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block_rows: int) -> torch.Tensor:
    """`x @ weight.T + bias` computed in blocks of exactly `block_rows` rows (the last one zero-padded).

    A row's bits then depend only on the row, the weight and `block_rows`, not on how many rows share the call.
    One op for torch.compile (the engine's compiled graph calls it as an opaque kernel) and for autograd.
    """
    if block_rows <= 0:
        raise ValueError(f"row_blocked_linear needs block_rows > 0, got {block_rows}")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise TypeError(
            f"row_blocked_linear computes in one dtype; got x {x.dtype}, weight {weight.dtype}"
            + (f", bias {bias.dtype}" if bias is not None else "")
        )
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    out = _blocked_2d(x2, weight, bias, block_rows)
    return out.reshape(*lead, weight.shape[0])


@row_blocked_linear.register_fake
def _(x, weight, bias, block_rows):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _setup_context(ctx, inputs, output):
    x, weight, bias, _rows = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    g2 = grad.reshape(-1, grad.shape[-1])
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_x = g2.mm(weight).reshape(x.shape)
    if ctx.needs_input_grad[1]:
        grad_w = g2.t().mm(x.reshape(-1, x.shape[-1]))
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_b = g2.sum(0)
    return grad_x, grad_w, grad_b, None


row_blocked_linear.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("roundalign::row_floor_linear", mutates_args=())
def row_floor_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, min_rows: int) -> torch.Tensor:
    """`x @ weight.T + bias` with a call of fewer than `min_rows` rows zero-padded to `min_rows` rows (any other call is
    one plain GEMM): where only the smallest row counts take another kernel, a row's bits then do not depend on how
    many rows share the call, at the price of the padding rows only. Opaque to torch.compile, like the row blocks."""
    if min_rows <= 0:
        raise ValueError(f"row_floor_linear needs min_rows > 0, got {min_rows}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    if m >= min_rows:
        return F.linear(x2, weight, bias).reshape(*lead, weight.shape[0])
    padded = x2.new_zeros(min_rows, x2.shape[1])
    padded[:m] = x2
    return F.linear(padded, weight, bias)[:m].reshape(*lead, weight.shape[0])


@row_floor_linear.register_fake
def _(x, weight, bias, min_rows):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


row_floor_linear.register_autograd(_backward, setup_context=_setup_context)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, rows: int = 0, min_rows: int = 0
) -> torch.Tensor:
    """`F.linear` under the engine layout's GEMM schedule (`GemmSchedule`): row blocks of `rows` (its
    `gemm_block_rows`) when positive, else a row floor of `min_rows` (its `gemm_min_rows`) when above 1."""
    if rows and rows > 0:
        return row_blocked_linear(x, weight, bias, rows)
    if min_rows and min_rows > 1:
        return row_floor_linear(x, weight, bias, min_rows)
    return F.linear(x, weight, bias)


# ------------------------------------------------------------------------------------------------
# The trainer's linears
# ------------------------------------------------------------------------------------------------



def install_row_blocked_linears(model: torch.nn.Module, rows: int, min_rows: int = 0) -> int:
    """Make every `nn.Linear` of `model` compute under the GEMM schedule of `rows` (row blocks) or `min_rows` (a row
    floor; `GemmSchedule`).

    Installs an instance `forward` (no parameter is added or renamed, module hooks still fire) and records the
    schedule on the module. Returns the number of layers. `rows=0, min_rows=0` removes the schedule.
    """
    schedule = GemmSchedule(int(rows or 0), int(min_rows or 0))
    remove_row_blocked_linears(model)
    if schedule.plain:
        return 0
    n = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.__dict__[_MARK] = schedule.block_rows
            module.__dict__[_MIN_MARK] = schedule.min_rows
            module.forward = functools.partial(_blocked_forward, module)
            n += 1
    return n


def _blocked_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, module.weight, module.bias, module.__dict__[_MARK], module.__dict__[_MIN_MARK])


def remove_row_blocked_linears(model: torch.nn.Module) -> int:
    """Undo `install_row_blocked_linears`; returns the number of layers restored."""
    n = 0
    for module in model.modules():
        if _MARK in module.__dict__:
            del module.__dict__[_MARK]
            module.__dict__.pop(_MIN_MARK, None)
            module.__dict__.pop("forward", None)
            n += 1
    return n


def model_schedule(model: torch.nn.Module) -> GemmSchedule:
    """The GEMM schedule `model`'s linears compute with. Raises if they disagree."""
    found = {module_schedule(m) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    if len(found) > 1:
        raise RuntimeError(f"the model's linears use different GEMM schedules: {sorted(found)}")
    return found.pop() if found else GemmSchedule()


def model_block_rows(model: torch.nn.Module) -> int:
    """The row-block size `model`'s linears compute with (0: none). Raises if they disagree."""
    return model_schedule(model).block_rows


# ------------------------------------------------------------------------------------------------
# Measuring it
# ------------------------------------------------------------------------------------------------


# SmolLM2-135M's linear shapes (q/k/v and gate/up fused as the engine computes them), in `linear_shapes`' order: where
# Intel AMX's GEMM was first seen batch-variant (docs/results/amx/batch_invariance.md). `env` and the numerics card
# measure at them without the checkpoint.
SMOLLM2_SHAPES = {"qkv_proj": (576, 576, 192, 192), "o_proj": (576, 576), "lm_head": (576, 49152),
                  "gate_up_proj": (576, 1536, 1536), "down_proj": (1536, 576)}


def row_counts(max_rows: int) -> list[int]:
    """Row counts to try up to `max_rows`: every count to 32 (decode batches), then steps of ~7% (oneDNN's
    kernel choices change over ranges of M, measured 8-400 rows wide), and `max_rows` itself."""
    counts = set(range(1, min(32, max_rows) + 1))
    m = 32
    while m < max_rows:
        m = max(m + 1, int(m * 1.07))
        counts.add(min(m, max_rows))
    counts.add(max_rows)
    return sorted(counts)


@dataclass
class ShapeResult:
    name: str
    k: int
    n: tuple[int, ...]
    rows_tried: int
    variant_rows: list[int] = field(default_factory=list)
    worst_fraction: float = 0.0
    fused_differs: bool = False

    @property
    def invariant(self) -> bool:
        return not self.variant_rows and not self.fused_differs

    def describe(self) -> str:
        shape = f"{self.k} x {'+'.join(map(str, self.n))}"
        if self.invariant:
            return f"{self.name} ({shape}): invariant at {self.rows_tried} row counts"
        parts = []
        if self.variant_rows:
            parts.append(f"rows differ at M = {_ranges(self.variant_rows)} (up to {self.worst_fraction:.1e} of outputs)")
        if self.fused_differs:
            parts.append("the fused projection differs from its parts")
        return f"{self.name} ({shape}): " + "; ".join(parts)


@dataclass
class BatchInvarianceReport:
    """What `measure_batch_invariance` found: one `ShapeResult` per linear shape."""

    block_rows: int
    max_rows: int
    shapes: list[ShapeResult]
    cpu: str = ""
    # What the run reaches that the measurement did not cover (row counts above its cap), one phrase each.
    not_covered: list[str] = field(default_factory=list)
    min_rows: int = 0

    @property
    def schedule(self) -> GemmSchedule:
        return GemmSchedule(self.block_rows, self.min_rows)

    @property
    def invariant(self) -> bool:
        return all(s.invariant for s in self.shapes)

    @property
    def variant(self) -> list[ShapeResult]:
        return [s for s in self.shapes if not s.invariant]

    def summary(self) -> str:
        how = self.schedule.describe()
        if self.invariant:
            return f"batch-invariant ({how}; {len(self.shapes)} shapes, M = 1..{self.max_rows})"
        first = self.variant[0]
        return f"batch-VARIANT ({how}; {len(self.variant)} of {len(self.shapes)} shapes): {first.describe()}"

    def as_dict(self) -> dict:
        return {
            "block_rows": self.block_rows,
            "min_rows": self.min_rows,
            "max_rows": self.max_rows,
            "invariant": self.invariant,
            "cpu": self.cpu,
            "not_covered": list(self.not_covered),
            "shapes": [
                {
                    "name": s.name, "k": s.k, "n": list(s.n), "rows_tried": s.rows_tried, "invariant": s.invariant,
                    "variant_rows": _ranges(s.variant_rows) if s.variant_rows else "", "worst_fraction": s.worst_fraction,
                    "fused_differs": s.fused_differs,
                }
                for s in self.shapes
            ],
        }


def _ranges(values: Sequence[int]) -> str:
    out: list[str] = []
    values = sorted(values)
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] - values[j] <= max(1, values[j] // 10):
            j += 1
        out.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(out)


def cpu_kind() -> str:
    """The CPU kinds the project measures on: "amx" (Intel Xeon with AMX), "avx512" (AVX-512 without AMX), "avx2"."""
    flags = _cpu_flags().split()
    return "amx" if "amx_bf16" in flags else "avx512" if "avx512f" in flags else "avx2"


def _cpu_flags() -> str:
    from ..machine import cpu_info

    flags = cpu_info()[1]
    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)


def measure_batch_invariance(
    shapes: dict[str, tuple[int, ...]] | Iterable[tuple[int, ...]],
    max_rows: int,
    *,
    block_rows: int = 0,
    min_rows: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    rows: Sequence[int] | None = None,
) -> BatchInvarianceReport:
    """Measure whether this machine's linear layers give each row the same bits whatever the call's row count.

    For each shape, random inputs of `max_rows` rows are multiplied once as a whole (the reference) and then as
    their first M rows for every M of `row_counts(max_rows)`, and each of the first `SINGLE_ROWS` rows alone (a
    decode step with one running sequence computes 1-row GEMMs, and a 1-row call can take another kernel whose bits
    differ on some rows only: the first row alone is no sample of them); a shape is variant if any call gives any
    other bit.
    Fused shapes (K, N1, N2, ...) are also checked against their parts computed separately, as the trainer
    computes them. `block_rows > 0` measures the row-block schedule instead of plain `F.linear`, `min_rows > 1` the row
    floor (`GemmSchedule`).
    """
    if not isinstance(shapes, dict):
        shapes = {f"{s[0]}x{'+'.join(map(str, s[1:]))}": tuple(s) for s in shapes}
    counts = list(rows) if rows is not None else row_counts(max_rows)
    gen = torch.Generator().manual_seed(seed)
    results = []
    for name, shape in shapes.items():
        k, ns = int(shape[0]), tuple(int(n) for n in shape[1:])
        n = sum(ns)
        x = torch.randn(max_rows, k, generator=gen).to(dtype)
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
        with torch.no_grad():
            ref = linear(x, w, rows=block_rows, min_rows=min_rows)
            res = ShapeResult(name, k, ns, len(counts))
            for m in counts:
                out = linear(x[:m], w, rows=block_rows, min_rows=min_rows)
                if not torch.equal(out, ref[:m]):
                    res.variant_rows.append(m)
                    res.worst_fraction = max(res.worst_fraction, (out != ref[:m]).float().mean().item())
            if 1 in counts and 1 not in res.variant_rows:
                for i in range(1, min(SINGLE_ROWS, max_rows)):
                    out = linear(x[i : i + 1], w, rows=block_rows, min_rows=min_rows)
                    if not torch.equal(out, ref[i : i + 1]):
                        res.variant_rows.insert(0, 1)
                        res.worst_fraction = max(res.worst_fraction, (out != ref[i : i + 1]).float().mean().item())
                        break
            if len(ns) > 1:
                parts = torch.cat([linear(x, wp, rows=block_rows, min_rows=min_rows) for wp in w.split(list(ns))], dim=1)
                res.fused_differs = not torch.equal(parts, ref)
        results.append(res)
    return BatchInvarianceReport(block_rows, max_rows, results, _cpu_flags(), min_rows=min_rows)


@functools.lru_cache(maxsize=32)
def _cached_measure(shapes: tuple, max_rows: int, schedule: GemmSchedule) -> BatchInvarianceReport:
    """`measure_batch_invariance` of `shapes`, once per process and, on disk, once per machine (`measured`: keyed by
    the shapes, rows and schedule, this module's source, the CPU, the torch build, its threads and the environment
    that steers its kernels)."""
    from dataclasses import asdict

    from ..measured import cached_measurement

    def measure() -> dict:
        return asdict(measure_batch_invariance(dict(shapes), max_rows, block_rows=schedule.block_rows,
                                               min_rows=schedule.min_rows))

    key = {"shapes": [[name, list(shape)] for name, shape in shapes], "max_rows": max_rows,
           "block_rows": schedule.block_rows, "min_rows": schedule.min_rows, "dtype": "bfloat16", "seed": 0}
    d = cached_measurement("gemm-batch-invariance", key, (__file__,), measure)
    return BatchInvarianceReport(**{**d, "shapes": [ShapeResult(**{**r, "n": tuple(r["n"])}) for r in d["shapes"]]})


def _floor_for(report: BatchInvarianceReport) -> int:
    """The row floor that would cover `report`'s variant row counts (0 where none would: a fused projection that
    differs from its parts, or a variant row count at or above `MAX_FLOOR_ROWS`)."""
    variant = [m for s in report.variant for m in s.variant_rows]
    if any(s.fused_differs for s in report.variant) or not variant or max(variant) >= MAX_FLOOR_ROWS:
        return 0
    return max(variant) + 1


def auto_schedule(measure) -> tuple[GemmSchedule | None, list[BatchInvarianceReport]]:
    """What "auto" takes, given `measure(schedule) -> BatchInvarianceReport` at the shapes and row counts of interest:
    plain `F.linear` where it measures batch-invariant; else a row floor one above the largest variant row count,
    where only counts below `MAX_FLOOR_ROWS` differ and the floor measures invariant; else row blocks of
    `DEFAULT_BLOCK_ROWS` where they measure invariant; else None (no schedule makes it invariant). Returns the
    schedule and every measurement made, in order (the last one decided)."""
    reports = [measure(GemmSchedule())]
    if reports[0].invariant:
        return GemmSchedule(), reports
    floor = _floor_for(reports[0])
    candidates = ([GemmSchedule(0, floor)] if floor else []) + [GemmSchedule(DEFAULT_BLOCK_ROWS)]
    for schedule in candidates:
        reports.append(measure(schedule))
        if reports[-1].invariant:
            return schedule, reports
    return None, reports


def choose_schedule(
    config, max_rows: int, requested: int | str = "auto", *, tensor_parallel: int = 1
) -> tuple[GemmSchedule, BatchInvarianceReport]:
    """The GEMM schedule exact mode needs on this machine, and the measurement that decided it.

    `requested="auto"`: `auto_schedule` for the model's shapes (and, at `tensor_parallel` > 1, their shards) up to
    `max_rows` rows. An explicit size is row blocks of that size (0: plain `F.linear`), measured as it is. Raises
    `ValueError` with one line when the chosen schedule is not batch-invariant here (exact mode is then impossible).
    """
    from ..models import linear_shapes  # the family's spec answers its shapes

    shapes = tuple(sorted(linear_shapes(config, tensor_parallel).items()))
    if requested == "auto":
        schedule, reports = auto_schedule(lambda s: _cached_measure(shapes, max_rows, s))
        report = reports[-1]
    else:
        schedule = GemmSchedule(int(requested))
        report = _cached_measure(shapes, max_rows, schedule)
        if not report.invariant:
            schedule = None
    if schedule is None:
        hint = (
            f"set roundalign_gemm_block_rows={DEFAULT_BLOCK_ROWS} (or 'auto')" if report.schedule.plain
            else "no row-block schedule makes it invariant here; use the profile without '-exact' and regions without 'attention'"
        )
        raise ValueError(f"Exact mode needs batch-invariant linear layers, and this machine's GEMM is {report.summary()}; {hint}.")
    return schedule, report


def decide_schedule(
    config,
    requested: int | str,
    reaches: dict[str, int],
    *,
    cap: int,
    tensor_parallel: int = 1,
    refuse: bool = True,
) -> tuple[GemmSchedule, BatchInvarianceReport | None]:
    """THE decision of the GEMM schedule both sides' linears compute with (the trainer, `build_llm` and the server
    all call it): measured on this machine for the model's shapes, their TP shards, and every row count the run
    reaches (`reaches`: what reaches how many rows, e.g. the training micro-batch, the engine's prefill chunk), up to
    `cap` rows. Row counts above the cap are named in the report's `not_covered` (and logged), never passed over.

    Where no schedule is batch-invariant: `refuse=True` raises the one-line `ValueError` (exact mode), else it warns
    and returns plain `F.linear` for "auto" (or the row blocks asked for) with no report.
    """
    want = max([1, *reaches.values()])
    max_rows = min(cap, want)
    try:
        schedule, report = choose_schedule(config, max_rows, requested, tensor_parallel=tensor_parallel)
    except ValueError as e:
        if refuse:
            raise
        logger.warning("%s The linears compute with %s; exact mode will not reproduce the engine.", e,
                       "plain F.linear" if requested == "auto" else f"row blocks of {int(requested)}")
        return (GemmSchedule() if requested == "auto" else GemmSchedule(int(requested))), None
    uncovered = [f"{what} reaches {n} rows (measured up to {max_rows})" for what, n in sorted(reaches.items()) if n > max_rows]
    if uncovered:
        report = BatchInvarianceReport(report.block_rows, report.max_rows, report.shapes, report.cpu, uncovered, report.min_rows)
        logger.warning("GEMM batch invariance not measured for: %s", "; ".join(uncovered))
    return schedule, report
