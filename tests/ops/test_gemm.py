"""Batch-invariant linear layers (`trl_roundalign.engine.gemm`), at the shapes users run (SmolLM2: K = 576 and 1536,
where oneDNN's AMX kernels are batch-variant) and not only at tiny-model shapes where every path agrees.

The claims, each able to fail:
- the row-block schedule gives every row the same bits at every row count, on every CPU (the declared
  reference: the same rows computed as one call of `max_rows` rows);
- its value is `F.linear` on each block of `block_rows` rows (so it is a matrix product, not something else);
- its gradients are `F.linear`'s, bit for bit; it runs under `torch.compile` with the eager bits;
- the trainer's install/remove works on every `nn.Linear`, and `choose_schedule` picks the schedule only where
  the measurement of plain `F.linear` on this machine says it is needed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.bitwise import assert_bitwise_equal

from trl_roundalign import gemm
from trl_roundalign.models import linear_shapes

SMOLLM2 = {"gate_up_proj": (576, 1536, 1536), "down_proj": (1536, 576), "o_proj": (576, 576)}


def _x(m: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _w(n: int, k: int, seed: int = 1) -> torch.Tensor:
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5).bfloat16()


def test_row_blocks_are_batch_invariant_at_smollm2_shapes():
    report = gemm.measure_batch_invariance(SMOLLM2, 300, block_rows=gemm.DEFAULT_BLOCK_ROWS)
    assert report.invariant, report.summary()
    assert all(s.rows_tried > 40 for s in report.shapes)


def test_the_measurement_can_see_a_variant_schedule():
    """A schedule that changes the reduction with the row count (for odd M: two half-K products added in bf16)
    is reported variant at exactly those counts: the measurement is not blind."""

    def odd_rows_split_k(x, w, bias=None, rows=None, min_rows=0):
        if x.shape[0] % 2:
            h = x.shape[1] // 2
            return F.linear(x[:, :h], w[:, :h]) + F.linear(x[:, h:], w[:, h:])
        return real(x, w, rows=gemm.DEFAULT_BLOCK_ROWS)

    real = gemm.linear
    gemm.linear = odd_rows_split_k
    try:
        report = gemm.measure_batch_invariance({"down": (1536, 576)}, 64, rows=[1, 2, 3, 4, 63])
    finally:
        gemm.linear = real
    assert not report.invariant
    assert report.variant[0].variant_rows == [1, 3, 63], report.summary()


@pytest.mark.parametrize("m", [1, 7, 64, 130, 257])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_row_blocks_compute_f_linear_on_each_block(m, bias):
    rows = 64
    x, w = _x(m, 576), _w(1536, 576)
    b = _w(1536, 1, seed=2).squeeze(1) if bias else None
    out = gemm.row_blocked_linear(x, w, b, rows)
    padded = torch.zeros(-(-m // rows) * rows, 576, dtype=x.dtype)
    padded[:m] = x
    want = torch.cat([F.linear(blk, w, b) for blk in padded.split(rows)])[:m]
    assert_bitwise_equal(out, want, label=f"blocked vs F.linear per block, M={m}")


@pytest.mark.parametrize("m", [1, 63, 64, 65, 130])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_every_gemm_call_has_exactly_block_rows_rows(monkeypatch, m, bias):
    """The schedule itself, seen on any machine: every GEMM that `linear(rows=64)` runs has exactly 64 rows (the last
    block zero-padded). Where the machine's GEMM is batch-invariant (AVX2, AMD AVX-512), an unpadded last block or
    another block size gives the same bits, so the bitwise tests above cannot see them there; on Intel AMX they are
    the batch-variance the schedule exists to remove."""
    seen = []
    real_mm, real_addmm = torch.mm, torch.addmm

    def mm(a, b, *, out=None):
        seen.append(a.shape[0])
        return real_mm(a, b, out=out)

    def addmm(c, a, b, *, out=None):
        seen.append(a.shape[0])
        return real_addmm(c, a, b, out=out)

    x, w = _x(m, 576), _w(96, 576)
    b = _w(96, 1, seed=2).squeeze(1) if bias else None
    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch, "addmm", addmm)
    out = gemm.linear(x, w, b, rows=64)
    monkeypatch.undo()
    assert seen == [64] * -(-m // 64), seen
    padded = torch.zeros(-(-m // 64) * 64, 576, dtype=x.dtype)
    padded[:m] = x
    want = torch.cat([F.linear(blk, w, b) for blk in padded.split(64)])[:m]
    assert_bitwise_equal(out, want, label=f"linear(rows=64) vs F.linear per padded block, M={m}")


def test_row_blocks_keep_leading_dims_and_dtype_checks():
    x = _x(2 * 5, 576).view(2, 5, 576)
    out = gemm.row_blocked_linear(x, _w(64, 576), None, 4)
    assert out.shape == (2, 5, 64)
    with pytest.raises(TypeError, match="one dtype"):
        gemm.row_blocked_linear(x.float(), _w(64, 576), None, 4)
    with pytest.raises(ValueError, match="block_rows > 0"):
        gemm.row_blocked_linear(x, _w(64, 576), None, 0)


def test_gradients_are_f_linears():
    x0, w0 = _x(100, 576), _w(320, 576)
    b0 = _w(320, 1, seed=3).squeeze(1)
    g = _x(100, 320, seed=4)
    grads = []
    for fn in (lambda x, w, b: gemm.row_blocked_linear(x, w, b, 64), F.linear):
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        fn(x, w, b).backward(g)
        grads.append((x.grad, w.grad, b.grad))
    for name, a, e in zip(("x", "weight", "bias"), *grads):
        assert_bitwise_equal(a, e, label=f"grad {name}")


def test_compiled_equals_eager():
    x, w = _x(150, 576), _w(576, 576)
    torch._dynamo.reset()
    fn = torch.compile(lambda t: torch.nn.functional.silu(gemm.row_blocked_linear(t, w, None, 64)), dynamic=True)
    eager = torch.nn.functional.silu(gemm.row_blocked_linear(x, w, None, 64))
    assert_bitwise_equal(fn(x), eager, label="compiled row blocks")
    assert_bitwise_equal(fn(x[:33]), eager[:33], label="compiled row blocks, other M")


def test_install_and_remove_on_a_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(576, 1536), torch.nn.SiLU(), torch.nn.Linear(1536, 576, bias=False)).bfloat16()
    x = _x(90, 576)
    plain = model(x)
    assert gemm.model_block_rows(model) == 0
    assert gemm.install_row_blocked_linears(model, 64) == 2
    assert gemm.model_block_rows(model) == 64
    want = gemm.row_blocked_linear(torch.nn.functional.silu(gemm.row_blocked_linear(x, model[0].weight, model[0].bias, 64)), model[2].weight, None, 64)
    assert_bitwise_equal(model(x), want, label="installed forward")
    assert {n for n, _ in model.named_parameters()} == {"0.weight", "0.bias", "2.weight"}
    assert gemm.remove_row_blocked_linears(model) == 2
    assert gemm.model_block_rows(model) == 0
    assert_bitwise_equal(model(x), plain, label="removed forward")


def test_choose_schedule_follows_the_measurement():
    from transformers import Qwen3Config

    cfg = Qwen3Config(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, vocab_size=2048)
    schedule, report = gemm.choose_schedule(cfg, 300)
    plain = gemm.measure_batch_invariance(linear_shapes(cfg), 300)
    # "auto" uses plain F.linear exactly where plain is invariant on this machine; otherwise the checked schedule.
    assert schedule.plain == plain.invariant, plain.summary()
    assert report.invariant
    assert report.schedule == schedule


def test_auto_blocks_where_plain_is_measured_variant(monkeypatch):
    """'auto' follows the measurement on every machine: where plain F.linear is measured batch-variant (as on Intel
    AMX) it takes DEFAULT_BLOCK_ROWS, measured invariant. The test above only sees this machine's answer: where plain
    is invariant, a rule that never blocks passes it."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, vocab_size=2048)
    asked = []

    def measured(shapes, max_rows, schedule):  # plain variant at M = 34, the row blocks invariant
        asked.append(schedule)
        res = gemm.ShapeResult("down_proj", 1536, (576,), 40, variant_rows=[] if schedule.block_rows else [34],
                               worst_fraction=0.0 if schedule.block_rows else 1e-4)
        return gemm.BatchInvarianceReport(schedule.block_rows, max_rows, [res], min_rows=schedule.min_rows)

    monkeypatch.setattr(gemm, "_cached_measure", measured)
    schedule, report = gemm.choose_schedule(cfg, 300)
    assert schedule == gemm.GemmSchedule(gemm.DEFAULT_BLOCK_ROWS) and report.invariant and report.schedule == schedule
    assert asked == [gemm.GemmSchedule(), gemm.GemmSchedule(gemm.DEFAULT_BLOCK_ROWS)]  # 34 rows: no floor tried
    with pytest.raises(ValueError, match="roundalign_gemm_block_rows=64"):
        gemm.choose_schedule(cfg, 300, requested=0)


def test_auto_takes_a_row_floor_where_only_the_smallest_row_counts_differ(monkeypatch):
    """Where plain F.linear differs only at M = 1 (as on the AMD AVX-512 kind at K = 1536), 'auto' takes a row floor of
    2, measured invariant, not 64-row blocks (which would pad every decode step to 64 rows); where the floor does not
    measure invariant, the row blocks."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, vocab_size=2048)
    asked = []

    def measured(floor_works):
        def measure(shapes, max_rows, schedule):
            asked.append(schedule)
            fixed = schedule.block_rows or (schedule.min_rows and floor_works)
            res = gemm.ShapeResult("down_proj", 1536, (576,), 40, variant_rows=[] if fixed else [1],
                                   worst_fraction=0.0 if fixed else 1e-3)
            return gemm.BatchInvarianceReport(schedule.block_rows, max_rows, [res], min_rows=schedule.min_rows)
        return measure

    monkeypatch.setattr(gemm, "_cached_measure", measured(True))
    schedule, report = gemm.choose_schedule(cfg, 300)
    assert schedule == gemm.GemmSchedule(0, 2) and report.invariant and report.schedule == schedule
    assert asked == [gemm.GemmSchedule(), gemm.GemmSchedule(0, 2)]
    asked.clear()
    monkeypatch.setattr(gemm, "_cached_measure", measured(False))
    assert gemm.choose_schedule(cfg, 300)[0] == gemm.GemmSchedule(gemm.DEFAULT_BLOCK_ROWS)
    assert asked == [gemm.GemmSchedule(), gemm.GemmSchedule(0, 2), gemm.GemmSchedule(gemm.DEFAULT_BLOCK_ROWS)]


@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 90])
def test_row_floor_is_the_padded_gemm_below_the_floor_and_plain_above(m):
    """The floor's definition, bit for bit: fewer than `min_rows` rows are the first rows of the zero-padded
    `min_rows`-row GEMM; more are plain F.linear. Its backward is F.linear's."""
    torch.manual_seed(0)
    x, w, b = _x(m, 1536), _x(576, 1536), _x(1, 576)[0]
    floor = 8
    padded = torch.zeros(max(m, floor), 1536, dtype=x.dtype)
    padded[:m] = x
    want = torch.nn.functional.linear(padded, w, b)[:m]
    assert_bitwise_equal(gemm.linear(x, w, b, min_rows=floor), want, label=f"floor {floor}, {m} rows")
    assert_bitwise_equal(gemm.linear(x.view(1, m, 1536), w, b, min_rows=floor), want.view(1, m, 576), label="3-d")
    xg, wg = x.float().requires_grad_(), w.float().requires_grad_()
    gemm.row_floor_linear(xg, wg, None, floor).sum().backward()
    xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
    torch.nn.functional.linear(xr, wr).sum().backward()
    assert_bitwise_equal(xg.grad, xr.grad, label="grad x")
    assert_bitwise_equal(wg.grad, wr.grad, label="grad w")


@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_every_gemm_call_under_a_floor_has_at_least_the_floor(monkeypatch, m):
    """The floor itself, seen on any machine: every GEMM that `linear(min_rows=3)` runs has at least 3 rows, and a
    call of 3 or more rows is one GEMM of its own rows. Where the machine's 2-row GEMM is invariant, an unpadded call
    gives the same bits, so the bitwise test above cannot see it there."""
    seen = []
    real = F.linear

    def counting(x, w, b=None):
        seen.append(x.reshape(-1, x.shape[-1]).shape[0])
        return real(x, w, b)

    x, w = _x(m, 576), _w(96, 576)
    monkeypatch.setattr(gemm.F, "linear", counting)
    gemm.linear(x, w, None, min_rows=3)
    monkeypatch.undo()
    assert seen == [max(m, 3)], seen


def test_schedule_transport_and_install_round_trip(monkeypatch):
    """The decided schedule reaches the engine's dispatcher through its transport and a model's linears through
    `install_row_blocked_linears`, and is read back whole from both."""
    monkeypatch.setenv(gemm.ENV_BLOCK_ROWS, "0")
    gemm.set_schedule(gemm.GemmSchedule(0, 2))
    assert gemm.engine_schedule() == gemm.GemmSchedule(0, 2)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4)).bfloat16()
    assert gemm.install_row_blocked_linears(model, 0, 2) == 2
    assert gemm.model_schedule(model) == gemm.GemmSchedule(0, 2) and gemm.model_block_rows(model) == 0
    gemm.install_row_blocked_linears(model, 64)
    assert gemm.model_schedule(model) == gemm.GemmSchedule(64, 0)
    assert gemm.install_row_blocked_linears(model, 0, 0) == 0 and gemm.model_schedule(model).plain
    assert gemm.GemmSchedule(0, 2).tag() != gemm.GemmSchedule().tag() != gemm.GemmSchedule(64).tag()


def test_explicit_zero_where_plain_is_variant_is_refused_in_one_line():
    from transformers import Qwen3Config

    cfg = Qwen3Config(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, vocab_size=2048)
    plain = gemm.measure_batch_invariance(linear_shapes(cfg), 300)
    if plain.invariant:
        assert gemm.choose_schedule(cfg, 300, requested=0)[0].plain
        return
    with pytest.raises(ValueError) as e:
        gemm.choose_schedule(cfg, 300, requested=0)
    assert "\n" not in str(e.value) and "roundalign_gemm_block_rows=64" in str(e.value)


@pytest.mark.parametrize("raw", ["x", "-3"])
def test_bad_env_value_is_one_line(monkeypatch, raw):
    monkeypatch.setenv(gemm.ENV_BLOCK_ROWS, raw)
    with pytest.raises(ValueError, match="ROUNDALIGN_GEMM_BLOCK_ROWS") as e:
        gemm.engine_schedule()
    assert "\n" not in str(e.value)
