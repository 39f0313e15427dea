"""Batch-invariant linear layers (`trl_roundalign.engine.gemm`), at the shapes users run (SmolLM2: K = 576 and 1536,
where oneDNN's AMX kernels are batch-variant) and not only at tiny-model shapes where every path agrees.

The claims, each able to fail:
- the row-block schedule gives every row the same bits at every row count, on every CPU (the declared
  reference: the same rows computed as one call of `max_rows` rows);
- its value is `F.linear` on each block of `block_rows` rows (so it is a matrix product, not something else);
- its gradients are `F.linear`'s, bit for bit; it runs under `torch.compile` with the eager bits;
- the trainer's install/remove works on every `nn.Linear`, and `choose_block_rows` picks the schedule only where
  the measurement of plain `F.linear` on this machine says it is needed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.bitwise import assert_bitwise_equal

from trl_roundalign import gemm

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

    def odd_rows_split_k(x, w, bias=None, rows=None):
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


def test_choose_block_rows_follows_the_measurement():
    from transformers import Qwen3Config

    cfg = Qwen3Config(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, vocab_size=2048)
    rows, report = gemm.choose_block_rows(cfg, 300)
    plain = gemm.measure_batch_invariance(gemm.linear_shapes(cfg), 300)
    # "auto" uses plain F.linear exactly where plain is invariant on this machine; otherwise the checked schedule.
    assert (rows == 0) == plain.invariant, plain.summary()
    assert report.invariant
    assert report.block_rows == rows


def test_auto_blocks_where_plain_is_measured_variant(monkeypatch):
    """'auto' follows the measurement on every machine: where plain F.linear is measured batch-variant (as on Intel
    AMX) it takes DEFAULT_BLOCK_ROWS, measured invariant. The test above only sees this machine's answer: where plain
    is invariant, a rule that never blocks passes it."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, vocab_size=2048)
    asked = []

    def measured(shapes, max_rows, block):  # plain (block 0) variant at M = 34, the row blocks invariant
        asked.append(block)
        res = gemm.ShapeResult("down_proj", 1536, (576,), 40, variant_rows=[] if block else [34],
                               worst_fraction=0.0 if block else 1e-4)
        return gemm.BatchInvarianceReport(block, max_rows, [res])

    monkeypatch.setattr(gemm, "_cached_measure", measured)
    rows, report = gemm.choose_block_rows(cfg, 300)
    assert rows == gemm.DEFAULT_BLOCK_ROWS and report.invariant and report.block_rows == rows
    assert asked == [0, gemm.DEFAULT_BLOCK_ROWS]
    with pytest.raises(ValueError, match="roundalign_gemm_block_rows=64"):
        gemm.choose_block_rows(cfg, 300, requested=0)


def test_explicit_zero_where_plain_is_variant_is_refused_in_one_line():
    from transformers import Qwen3Config

    cfg = Qwen3Config(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, vocab_size=2048)
    plain = gemm.measure_batch_invariance(gemm.linear_shapes(cfg), 300)
    if plain.invariant:
        assert gemm.choose_block_rows(cfg, 300, requested=0)[0] == 0
        return
    with pytest.raises(ValueError) as e:
        gemm.choose_block_rows(cfg, 300, requested=0)
    assert "\n" not in str(e.value) and "roundalign_gemm_block_rows=64" in str(e.value)


@pytest.mark.parametrize("raw", ["x", "-3"])
def test_bad_env_value_is_one_line(monkeypatch, raw):
    monkeypatch.setenv(gemm.ENV_BLOCK_ROWS, raw)
    with pytest.raises(ValueError, match="ROUNDALIGN_GEMM_BLOCK_ROWS") as e:
        gemm.block_rows()
    assert "\n" not in str(e.value)
