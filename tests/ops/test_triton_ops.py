"""The Triton backend against the exact PyTorch references, on the CPU through the Triton interpreter.

Forward: bitwise (`assert_bitwise_equal`) against `backend="torch"`, except the RMSNorm variants with
`lanes=None`, whose `sum(x^2)` order is free (`tl.sum` vs torch's reduction) and which are held to an
explicit bound on 1-ulp flips. Backward: against fp64 autograd of the same math at a stated tolerance,
and against the reference backend's gradients.

`triton.jit` decides when a kernel module is first imported whether it is compiled for a GPU or run by
the interpreter, so the module fixture below sets `TRITON_INTERPRET=1` and (re)imports
`trl_roundalign.ops.triton.*` under it, whatever was imported before, then restores the environment
and drops those modules again so that later imports follow the environment of their own time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers.bitwise import assert_bitwise_equal
from helpers.kernel_checks import (
    BF16,
    EPS,
    FP16,
    FP32,
    compile_ptx,
    triton_mode,
)
from helpers.kernel_checks import assert_bounded_flips as _assert_bounded_flips
from helpers.kernel_checks import assert_close_fp64 as _assert_close_fp64
from helpers.kernel_checks import assert_within_one_ulp as _assert_within_one_ulp
from helpers.kernel_checks import gen as _gen
from helpers.kernel_checks import grads as _grads
from helpers.kernel_checks import randn as _randn
from helpers.kernel_checks import rms_norm_fp64 as _rms_norm_fp64
from helpers.kernel_checks import weight as _weight

from trl_roundalign.ops import add_rms_norm, qk_norm_rope, rms_norm, rope, swiglu
from trl_roundalign.ops._common import rms_rstd

# The interpreter runs the kernels' fp32 arithmetic in numpy, which warns on inf/NaN/overflow inputs.
_NUMPY_SPECIALS = "ignore:.*encountered in:RuntimeWarning"


@pytest.fixture(scope="module", autouse=True)
def triton_interpreter():
    """Run this module's kernels under the Triton interpreter, independent of earlier imports."""
    with triton_mode(interpret=True):
        yield


# --------------------------------------------------------------------------------------------------
# The single rounding: integer round-to-nearest-even under the interpreter, against torch's cast


def _tie_neighbourhood_fp32() -> torch.Tensor:
    """fp32 values at, just below and just above every bf16 rounding tie, exact bf16 values, and specials."""
    hi = torch.arange(65536, dtype=torch.int64) << 16
    low = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    bits = (hi[:, None] | low[None, :]).reshape(-1)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    return bits.view(torch.float32)


@pytest.mark.filterwarnings(_NUMPY_SPECIALS)
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_store_rounding_matches_torch(dtype):
    from trl_roundalign.ops.triton._numerics import round_tensor

    randoms = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), generator=_gen(0), dtype=torch.int64)
    x = torch.cat([_tie_neighbourhood_fp32(), randoms.to(torch.int32).view(torch.float32)])
    assert_bitwise_equal(round_tensor(x, dtype), x.to(dtype), label=f"fp32->{dtype} store rounding")


# --------------------------------------------------------------------------------------------------
# SwiGLU


@pytest.mark.parametrize("shape", [(3, 77), (2, 5, 1536), (4, 576)])
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_swiglu_forward_bitwise(shape, dtype):
    gate, up = _randn(shape, dtype, 1, 3.0), _randn(shape, dtype, 2)
    assert_bitwise_equal(
        swiglu(gate, up, backend="triton"), swiglu(gate, up, backend="torch"), label=f"swiglu {shape} {dtype}"
    )


@pytest.mark.filterwarnings(_NUMPY_SPECIALS)
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_swiglu_forward_every_gate_value(dtype):
    """Every 16-bit gate pattern (inf and NaN included) against random `up`: the exp argument space."""
    gate = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype).reshape(256, 256)
    up = _randn((256, 256), dtype, 3, 2.0)
    assert_bitwise_equal(
        swiglu(gate, up, backend="triton"), swiglu(gate, up, backend="torch"), label="swiglu all gates"
    )


def test_swiglu_forward_noncontiguous():
    """gate and up as the two halves of a fused gate_up projection (strided views)."""
    gate_up = _randn((6, 2 * 200), BF16, 4, 2.0)
    gate, up = gate_up[:, :200], gate_up[:, 200:]
    assert_bitwise_equal(swiglu(gate, up, backend="triton"), swiglu(gate, up, backend="torch"), label="swiglu strided")


def _swiglu_fp64(gate, up):
    g = gate.double()
    return g * torch.sigmoid(g) * up.double()


@pytest.mark.parametrize("shape,dtype", [((3, 77), BF16), ((4, 576), BF16), ((2, 5, 96), FP16)])
def test_swiglu_backward(shape, dtype):
    gate, up, dout = _randn(shape, dtype, 5, 3.0), _randn(shape, dtype, 6), _randn(shape, dtype, 7)
    got = _grads(lambda g, u: swiglu(g, u, backend="triton"), [gate, up], [dout])
    ref = _grads(lambda g, u: swiglu(g, u, backend="torch"), [gate, up], [dout])
    exact = _grads(_swiglu_fp64, [gate.double(), up.double()], [dout.double()])
    for name, a, r, e in zip(("d_gate", "d_up"), got, ref, exact):
        assert a.dtype == dtype
        _assert_close_fp64(a, e, label=f"swiglu {name} vs fp64")
        # The same fp32 operations in the same order, exp from the same function: bitwise.
        assert_bitwise_equal(a, r, label=f"swiglu {name} vs reference backward")


# --------------------------------------------------------------------------------------------------
# RMSNorm and residual add + RMSNorm


def _rstd_of(out: torch.Tensor) -> torch.Tensor:
    """The fp32 rstd an aligned norm saved for backward (last saved tensor of its autograd node)."""
    return out.grad_fn.saved_tensors[-1].reshape(-1)


@pytest.mark.parametrize("n", [576, 200, 96])
@pytest.mark.parametrize("lanes", [None, 16, 32])
def test_rms_norm_forward(n, lanes):
    x = _randn((3, 7, n), BF16, 10 + n, 2.0).requires_grad_(True)
    w = _weight(n, BF16, 11)
    got = rms_norm(x, w, EPS, backend="triton", reduction_lanes=lanes)
    ref = rms_norm(x, w, EPS, backend="torch", reduction_lanes=lanes)
    label = f"rms_norm n={n} lanes={lanes}"
    if lanes is None:
        _assert_bounded_flips(got, ref, label=label)
    else:
        assert_bitwise_equal(got, ref, label=label)
        assert_bitwise_equal(_rstd_of(got), _rstd_of(ref), label=f"{label} rstd")


@pytest.mark.parametrize("lanes", [16, 32])
def test_rms_norm_lanes_exact_many_rows(lanes):
    """Inductor's order over 384 rows of the Qwen-size intermediate width: 0 differing outputs and rstd."""
    x = _randn((384, 1536), BF16, 18, 2.0).requires_grad_(True)
    w = _weight(1536, BF16, 19)
    got = rms_norm(x, w, EPS, backend="triton", reduction_lanes=lanes)
    ref = rms_norm(x, w, EPS, backend="torch", reduction_lanes=lanes)
    assert_bitwise_equal(got, ref, label=f"rms_norm 384x1536 lanes={lanes}")
    assert_bitwise_equal(_rstd_of(got), _rstd_of(ref), label=f"rms_norm 384x1536 lanes={lanes} rstd")


def test_rms_norm_unordered_sum_flip_rate():
    """`lanes=None` on 1M outputs: the 1-ulp flips from the free summation order stay under the bound."""
    x, w = _randn((2048, 576), BF16, 20, 2.0), _weight(576, BF16, 21)
    got = rms_norm(x, w, EPS, backend="triton")
    ref = rms_norm(x, w, EPS, backend="torch")
    _assert_bounded_flips(got, ref, label="rms_norm 2048x576 lanes=None")


@pytest.mark.parametrize("lanes", [16, 32])
def test_rms_norm_lane_order_is_discriminating(lanes):
    """The rstd check above can fail: the other lane count (and torch's order) give different rstd bits."""
    x = _randn((64, 576), BF16, 12, 2.0)
    w = _weight(576, BF16, 13)
    from trl_roundalign.ops.triton.rms_norm import rms_norm_triton

    got = _rstd_of(rms_norm_triton(x.requires_grad_(True), w, EPS, lanes))
    assert_bitwise_equal(got, rms_rstd(x.float(), EPS, lanes).reshape(-1), label="rstd, same lanes")
    other = rms_rstd(x.float(), EPS, 48 - lanes).reshape(-1)
    assert (got != other).any(), "the test data cannot tell 16 lanes from 32; use more rows"


@pytest.mark.parametrize("lanes", [None, 32])
def test_rms_norm_fp32_input(lanes):
    """Final norm on the fp32 residual stream: x fp32, output in the weight's dtype."""
    x = _randn((5, 200), FP32, 14, 3.0)
    w = _weight(200, BF16, 15)
    got = rms_norm(x, w, EPS, backend="triton", reduction_lanes=lanes)
    ref = rms_norm(x, w, EPS, backend="torch", reduction_lanes=lanes)
    assert got.dtype == BF16
    check = _assert_bounded_flips if lanes is None else assert_bitwise_equal
    check(got, ref, label=f"rms_norm fp32 x lanes={lanes}")


def test_rms_norm_fp16():
    x, w = _randn((9, 96), FP16, 16, 2.0), _weight(96, FP16, 17)
    assert_bitwise_equal(
        rms_norm(x, w, EPS, backend="triton", reduction_lanes=16),
        rms_norm(x, w, EPS, backend="torch", reduction_lanes=16),
        label="rms_norm fp16",
    )


@pytest.mark.parametrize("n", [576, 200, 96])
@pytest.mark.parametrize("lanes", [None, 16, 32])
@pytest.mark.parametrize("fp32_residual", [True, False], ids=["fp32-residual", "rounded-residual"])
@pytest.mark.parametrize("res_dtype", [FP32, BF16])
def test_add_rms_norm_forward(n, lanes, fp32_residual, res_dtype):
    profile = "vllm-compiled" if fp32_residual else "vllm-eager"
    x = _randn((2, 5, n), BF16, 20 + n).requires_grad_(True)
    res = _randn((2, 5, n), res_dtype, 21 + n, 4.0)
    w = _weight(n, BF16, 22)
    got_y, got_res = add_rms_norm(x, res, w, EPS, profile=profile, backend="triton", reduction_lanes=lanes)
    ref_y, ref_res = add_rms_norm(x, res, w, EPS, profile=profile, backend="torch", reduction_lanes=lanes)
    label = f"add_rms_norm n={n} lanes={lanes} {profile} residual {res_dtype}"
    assert got_res.dtype == (FP32 if fp32_residual else BF16)
    assert_bitwise_equal(got_res, ref_res, label=f"{label} new residual")
    if lanes is None:
        _assert_bounded_flips(got_y, ref_y, label=label)
    else:
        assert_bitwise_equal(got_y, ref_y, label=label)
        assert_bitwise_equal(_rstd_of(got_y), _rstd_of(ref_y), label=f"{label} rstd")


@pytest.mark.parametrize("n,x_dtype", [(576, BF16), (200, BF16), (96, FP32)])
def test_rms_norm_backward(n, x_dtype):
    x, w, dy = _randn((4, 9, n), x_dtype, 30, 2.0), _weight(n, BF16, 31), _randn((4, 9, n), BF16, 32)
    got = _grads(lambda a, b: rms_norm(a, b, EPS, backend="triton"), [x, w], [dy])
    ref = _grads(lambda a, b: rms_norm(a, b, EPS, backend="torch"), [x, w], [dy])
    exact = _grads(_rms_norm_fp64, [x.double(), w.double()], [dy.double()])
    for name, a, r, e in zip(("dx", "dw"), got, ref, exact):
        _assert_close_fp64(a, e, label=f"rms_norm {name} vs fp64")
        if a.dtype == FP32:
            torch.testing.assert_close(a, r, rtol=2**-20, atol=2**-20 * r.abs().max().item())
        else:
            # Only the order of sum(dy w x̂) / of the dw row sum differs from the reference.
            _assert_within_one_ulp(a, r, label=f"rms_norm {name} vs reference backward")


@pytest.mark.parametrize("fp32_residual", [True, False], ids=["fp32-residual", "rounded-residual"])
@pytest.mark.parametrize("res_dtype", [FP32, BF16])
def test_add_rms_norm_backward(fp32_residual, res_dtype):
    n, profile = 200, ("vllm-compiled" if fp32_residual else "vllm-eager")
    x, res = _randn((3, 11, n), BF16, 40), _randn((3, 11, n), res_dtype, 41, 4.0)
    w, dy = _weight(n, BF16, 42), _randn((3, 11, n), BF16, 43)
    dres = _randn((3, 11, n), FP32 if fp32_residual else BF16, 44)

    def exact_fn(a, r, b):
        s = r.double() + a.double()
        if not fp32_residual:  # straight through the rounding, as the reference backward does
            s = s + (s.to(BF16).double() - s).detach()
        return _rms_norm_fp64(s, b), s

    got = _grads(lambda a, r, b: add_rms_norm(a, r, b, EPS, profile=profile, backend="triton"), [x, res, w], [dy, dres])
    ref = _grads(lambda a, r, b: add_rms_norm(a, r, b, EPS, profile=profile, backend="torch"), [x, res, w], [dy, dres])
    exact = _grads(exact_fn, [x.double(), res.double(), w.double()], [dy.double(), dres.double()])
    for name, a, r, e in zip(("dx", "dres", "dw"), got, ref, exact):
        assert a.dtype == r.dtype
        _assert_close_fp64(a, e, label=f"add_rms_norm {name} vs fp64")
        if a.dtype == FP32:
            torch.testing.assert_close(a, r, rtol=2**-20, atol=2**-20 * r.abs().max().item())
        else:
            _assert_within_one_ulp(a, r, label=f"add_rms_norm {name} vs reference backward")


# --------------------------------------------------------------------------------------------------
# RoPE and q/k-norm + RoPE

# (batch, heads, seq, head_dim, rotary_dim)
ROPE_SHAPES = [(2, 3, 5, 64, 64), (1, 4, 7, 128, 128), (2, 2, 9, 32, 32), (2, 3, 5, 64, 32)]


def _cos_sin(batch, heads, seq, rd, layout: str, dtype=BF16, seed: int = 50):
    """Hugging Face-style bf16 cos/sin (halves duplicated) in one of three broadcast layouts."""
    angles = torch.rand((batch, seq, rd // 2), generator=_gen(seed)) * 40.0
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    if layout == "hf":  # [b, 1, s, rd] against [b, heads, s, head_dim]
        return cos.unsqueeze(1), sin.unsqueeze(1)
    if layout == "shared":  # [s, rd], the same positions for every batch row
        return cos[0], sin[0]
    return cos.unsqueeze(1).expand(batch, heads, seq, rd), sin.unsqueeze(1).expand(batch, heads, seq, rd)


def _shape_id(shape) -> str:
    return "b{}h{}s{}d{}rd{}".format(*shape)


@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=_shape_id)
@pytest.mark.parametrize("layout", ["hf", "shared", "full"])
def test_rope_forward_bitwise(shape, layout):
    b, h, s, d, rd = shape
    x = _randn((b, h, s, d), BF16, 51, 2.0)
    cos, sin = _cos_sin(b, h, s, rd, layout)
    assert_bitwise_equal(
        rope(x, cos, sin, backend="triton"), rope(x, cos, sin, backend="torch"), label=f"rope {shape} {layout}"
    )


def test_rope_forward_noncontiguous_fp16():
    """x as `[b, s, heads, d].transpose(1, 2)` (a strided view), fp16."""
    b, h, s, d = 2, 3, 6, 64
    x = _randn((b, s, h, d), FP16, 52).transpose(1, 2)
    cos, sin = _cos_sin(b, h, s, d, "hf", dtype=FP16)
    assert_bitwise_equal(rope(x, cos, sin, backend="triton"), rope(x, cos, sin, backend="torch"), label="rope strided")


def test_rope_reads_the_first_half_of_cos_sin():
    """With halves that are not duplicated, the reference uses `cos[..., :rd/2]`; so must the kernel."""
    x = _randn((1, 2, 4, 64), BF16, 53)
    cos, sin = _randn((1, 1, 4, 64), BF16, 54), _randn((1, 1, 4, 64), BF16, 55)
    assert_bitwise_equal(rope(x, cos, sin, backend="triton"), rope(x, cos, sin, backend="torch"), label="rope halves")


def _rope_fp64(x, cos, sin):
    rd = cos.shape[-1]
    h = rd // 2
    c, s = cos[..., :h].double(), sin[..., :h].double()
    xf = x.double()
    x1, x2 = xf[..., :h], xf[..., h:rd]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, xf[..., rd:]), dim=-1)


@pytest.mark.parametrize("shape", [ROPE_SHAPES[1], ROPE_SHAPES[3]], ids=_shape_id)
def test_rope_backward(shape):
    b, h, s, d, rd = shape
    x, dout = _randn((b, h, s, d), BF16, 56), _randn((b, h, s, d), BF16, 57)
    cos, sin = _cos_sin(b, h, s, rd, "hf")
    (got,) = _grads(lambda a: rope(a, cos, sin, backend="triton"), [x], [dout])
    (ref,) = _grads(lambda a: rope(a, cos, sin, backend="torch"), [x], [dout])
    (exact,) = _grads(lambda a: _rope_fp64(a, cos, sin), [x.double()], [dout.double()])
    _assert_close_fp64(got, exact, label="rope dx vs fp64")
    assert_bitwise_equal(got, ref, label="rope dx vs reference backward")


@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=_shape_id)
@pytest.mark.parametrize("lanes", [None, 16, 32])
def test_qk_norm_rope_forward(shape, lanes):
    b, h, s, d, rd = shape
    x = _randn((b, h, s, d), BF16, 60, 2.0).requires_grad_(True)
    w = _weight(d, BF16, 61)
    cos, sin = _cos_sin(b, h, s, rd, "hf")
    got = qk_norm_rope(x, w, EPS, cos, sin, backend="triton", reduction_lanes=lanes)
    ref = qk_norm_rope(x, w, EPS, cos, sin, backend="torch", reduction_lanes=lanes)
    label = f"qk_norm_rope {shape} lanes={lanes}"
    if lanes is None:
        _assert_bounded_flips(got, ref, label=label)
    else:
        assert_bitwise_equal(got, ref, label=label)
        # saved: (x, weight, rstd, cos, sin); rstd is third
        assert_bitwise_equal(
            got.grad_fn.saved_tensors[2].reshape(-1), ref.grad_fn.saved_tensors[2].reshape(-1), label=f"{label} rstd"
        )


@pytest.mark.parametrize("shape", [ROPE_SHAPES[1], ROPE_SHAPES[3]], ids=_shape_id)
def test_qk_norm_rope_backward(shape):
    b, h, s, d, rd = shape
    x, w, dout = _randn((b, h, s, d), BF16, 62, 2.0), _weight(d, BF16, 63), _randn((b, h, s, d), BF16, 64)
    cos, sin = _cos_sin(b, h, s, rd, "hf")
    got = _grads(lambda a, c: qk_norm_rope(a, c, EPS, cos, sin, backend="triton"), [x, w], [dout])
    ref = _grads(lambda a, c: qk_norm_rope(a, c, EPS, cos, sin, backend="torch"), [x, w], [dout])
    exact = _grads(lambda a, c: _rope_fp64(_rms_norm_fp64(a, c), cos, sin), [x.double(), w.double()], [dout.double()])
    for name, a, r, e in zip(("dx", "dw"), got, ref, exact):
        _assert_close_fp64(a, e, label=f"qk_norm_rope {name} vs fp64")
        _assert_within_one_ulp(a, r, label=f"qk_norm_rope {name} vs reference backward")


# --------------------------------------------------------------------------------------------------
# Bad input and backend choice


def test_swiglu_rejects_fp32():
    g = torch.randn(4, 8)
    with pytest.raises(TypeError, match="bf16"):
        swiglu(g, g, backend="triton")


def test_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(2, 8).to(BF16)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        swiglu(x, x, backend="triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        rms_norm(x, torch.ones(8, dtype=BF16), EPS, backend="triton")


# --------------------------------------------------------------------------------------------------
# The GPU code path: compiled to PTX for sm_90 without a GPU (no run, no numerics), to check that it
# builds and that the properties the bitwise claim rests on hold in the generated code.

@pytest.mark.parametrize("gpu_kernels", ["eager", "inductor"])
def test_both_kernel_arithmetics_compute_the_reference_under_the_interpreter(gpu_kernels):
    """The variants differ only in device arithmetic (checked in PTX below); their shared logic is the reference's."""
    from dataclasses import replace

    from trl_roundalign.profiles import get_profile

    prof = replace(get_profile("vllm-compiled"), gpu_kernels=gpu_kernels)
    g, u = _randn((3, 77), torch.bfloat16, 1, 3.0), _randn((3, 77), torch.bfloat16, 2)
    x, w = _randn((2, 5, 96), torch.bfloat16, 3, 2.0), _weight(96, torch.bfloat16, 4)
    res = _randn((2, 5, 96), torch.float32, 5, 4.0)
    angles = torch.rand((1, 5, 1, 16), generator=_gen(6)) * 40.0
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(torch.bfloat16)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(torch.bfloat16)
    hx, hw = _randn((1, 5, 3, 32), torch.bfloat16, 7, 2.0), _weight(32, torch.bfloat16, 8)
    pairs = {
        "swiglu": lambda b: swiglu(g, u, profile=prof, backend=b),
        "rms_norm": lambda b: rms_norm(x, w, 1e-6, profile=prof, backend=b, reduction_lanes=16),
        "add_rms_norm": lambda b: add_rms_norm(x, res, w, 1e-6, profile=prof, backend=b, reduction_lanes=16),
        "rope": lambda b: rope(hx, cos, sin, profile=prof, backend=b),
        "qk_norm_rope": lambda b: qk_norm_rope(hx, hw, 1e-6, cos, sin, profile=prof, backend=b, reduction_lanes=16),
    }
    for name, fn in pairs.items():
        got, ref = fn("triton"), fn("torch")
        for a, b in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
            assert_bitwise_equal(a, b, label=f"{name} ({gpu_kernels} arithmetic, interpreter)")


_PTX_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from trl_roundalign.ops.triton import _numerics as N, rms_norm as R, rope as P, swiglu as S

    def ptx(fn, sig, consts, arith=None):
        consts = dict(consts, INTERPRET=False)
        if arith is not None:
            consts["ARITH"] = arith
        full = {a: ("constexpr" if a in consts else sig.get(a, "i32")) for a in fn.arg_names}
        src = ASTSource(fn=fn, signature=full, constexprs=consts)
        opts = N.launch_options(1024, N.ARITH_EAGER if arith is None else arith)
        opts["num_warps"] = 4
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]

    bf, f32 = "*bf16", "*fp32"
    out = {}
    out["round"] = ptx(N._round_kernel, dict(X=f32, Y=bf), dict(BLOCK=1024))
    swiglu_sig = dict(G=bf, U=bf, Y=bf, DO=bf, DG=bf, DU=bf, EXP_TABLE=f32)
    out["swiglu_bwd"] = ptx(S._swiglu_bwd_kernel, swiglu_sig, dict(BLOCK=1024, EXP_FROM_TABLE=False))
    norm_sig = dict(X=bf, R=f32, W=bf, Y=bf, RES_OUT=f32, RSTD=f32, inv_n="fp32", eps="fp32")
    rope_sig = dict(X=bf, W=bf, COS=bf, SIN=bf, CS_OFF="*i32", Y=bf, RSTD=f32, DO=bf, DX=bf, DW_PARTIAL=f32,
                    inv_d="fp32", eps="fp32")
    for arith, tag in ((N.ARITH_EAGER, "eager"), (N.ARITH_INDUCTOR, "inductor"), (N.ARITH_INDUCTOR_RN, "inductor_rn")):
        out[f"{tag}/swiglu_fwd"] = ptx(S._swiglu_fwd_kernel, swiglu_sig, dict(BLOCK=1024, EXP_FROM_TABLE=False), arith)
        for mode, lanes in ((0, 0), (1, 32), (2, 16)):
            meta = dict(MODE=mode, LANES=lanes, LOG2_LANES=max(lanes.bit_length() - 1, 0), BLOCK_ROWS=4,
                        BLOCK_N=1024)
            sig = dict(norm_sig, R=bf if mode == 2 else f32, RES_OUT=bf if mode == 2 else f32)
            out[f"{tag}/rms_norm_fwd_mode{mode}"] = ptx(R._rms_norm_fwd_kernel, sig, meta, arith)
        # The RoPE kernel has no division: its variants differ only in the launch's FMA contraction.
        src = ASTSource(fn=P._rope_kernel, signature={a: ("constexpr" if a in ("TRANSPOSE", "BLOCK_ROWS", "BLOCK_D",
                        "INTERPRET") else rope_sig.get(a, "i32")) for a in P._rope_kernel.arg_names},
                        constexprs=dict(TRANSPOSE=False, BLOCK_ROWS=32, BLOCK_D=128, INTERPRET=False))
        opts = dict(N.launch_options(1024, arith), num_warps=4)
        out[f"{tag}/rope_fwd"] = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
        out[f"{tag}/qk_norm_rope_fwd"] = ptx(P._qk_norm_rope_fwd_kernel, rope_sig, dict(LANES=32, LOG2_LANES=5,
                                             BLOCK_ROWS=32, BLOCK_D=128), arith)
    bwd_sig = dict(DY=bf, V=f32, W=bf, RSTD=f32, DRES_IN=f32, DX=bf, DR=f32, DW_PARTIAL=f32)
    out["rms_norm_bwd"] = ptx(R._rms_norm_bwd_kernel, bwd_sig, dict(HAS_DRES_IN=True, HAS_DR=True, BLOCK_ROWS=4,
                              BLOCK_N=1024))
    for transpose in (False, True):
        out[f"rope_transpose{int(transpose)}"] = ptx(P._rope_kernel, rope_sig, dict(TRANSPOSE=transpose,
                                                     BLOCK_ROWS=32, BLOCK_D=128))
    out["qk_norm_rope_bwd"] = ptx(P._qk_norm_rope_bwd_kernel, rope_sig, dict(BLOCK_ROWS=32, BLOCK_D=128))
    json.dump(out, sys.stdout)
    """
)


@pytest.fixture(scope="module")
def gpu_ptx() -> dict[str, str]:
    """Every kernel compiled to PTX for sm_90 (no GPU needed), the forward kernels in each arithmetic variant."""
    return compile_ptx(_PTX_SCRIPT)


_FMA = re.compile(r"\bfma\.rn\.f32\b")
_BF16_RNE = re.compile(r"cvt\.rn(\.satfinite)?\.bf16")


def test_every_kernel_rounds_to_nearest_even(gpu_ptx):
    for name, code in gpu_ptx.items():
        assert _BF16_RNE.search(code), f"{name}: no round-to-nearest-even bf16 conversion"


def test_eager_kernels_divide_correctly_rounded_and_never_contract(gpu_ptx):
    """The eager variant and every backward: eager CUDA torch numerics (`div_rn`, no FMA, rsqrtf, expf)."""
    eager = {k: v for k, v in gpu_ptx.items() if "/" not in k or k.startswith("eager/")}
    assert len(eager) == 12, sorted(eager)
    for name, code in eager.items():
        assert "div.full" not in code, f"{name}: approximate division in an eager kernel"
        if "swiglu" not in name:  # libdevice's expf uses FMAs internally, as CUDA's expf does
            assert not _FMA.search(code), f"{name}: FMA contraction in an eager kernel"
    for name in ("eager/rms_norm_fwd_mode0", "eager/rms_norm_fwd_mode1", "eager/qk_norm_rope_fwd"):
        assert "rsqrt.approx" in gpu_ptx[name], f"{name}: rstd must be CUDA's rsqrtf (libdevice.rsqrt), as torch.rsqrt is"
        assert "div.rn.f32" not in gpu_ptx[name], f"{name}: eager torch's mean multiplies by 1/n, it does not divide"
    assert "ex2.approx" in gpu_ptx["eager/swiglu_fwd"], "exp must be libdevice's __nv_expf on the GPU"
    assert "div.rn.f32" in gpu_ptx["eager/swiglu_fwd"], "silu's division must be correctly rounded in eager"


def test_inductor_kernels_divide_and_contract_as_inductor(gpu_ptx):
    """The compiled profiles' forward kernels: Inductor's Triton numerics (div.full, FMA contraction on)."""
    for name in ("swiglu_fwd", "rms_norm_fwd_mode0", "rms_norm_fwd_mode1", "rms_norm_fwd_mode2", "qk_norm_rope_fwd"):
        default, rn = gpu_ptx[f"inductor/{name}"], gpu_ptx[f"inductor_rn/{name}"]
        assert "div.full.f32" in default, f"inductor/{name}: Inductor divides with a plain `/` (div.full.f32)"
        assert "div.full" not in rn and "div.rn.f32" in rn, f"inductor_rn/{name}: division rounding on means div_rn"
    for tag in ("inductor", "inductor_rn"):
        assert _FMA.search(gpu_ptx[f"{tag}/rope_fwd"]), f"{tag}/rope_fwd: x1 c - x2 s must contract, as Inductor's does"
        assert _FMA.search(gpu_ptx[f"{tag}/qk_norm_rope_fwd"]), f"{tag}/qk_norm_rope_fwd: no FMA contraction"
        for name in ("rms_norm_fwd_mode0", "rms_norm_fwd_mode1", "qk_norm_rope_fwd"):
            assert "rsqrt.approx" in gpu_ptx[f"{tag}/{name}"], f"{tag}/{name}: Inductor's rsqrt is libdevice.rsqrt"
        assert "ex2.approx" in gpu_ptx[f"{tag}/swiglu_fwd"], f"{tag}/swiglu_fwd: Inductor's exp is libdevice.exp"
    assert not _FMA.search(gpu_ptx["eager/rope_fwd"]), "the variants must differ: the eager RoPE does not contract"


def test_profiles_pick_their_kernel_arithmetic():
    """Compiled profiles run Inductor's arithmetic, eager profiles eager CUDA's (Profile.gpu_kernels)."""
    from trl_roundalign.ops.triton import _numerics as N
    from trl_roundalign.profiles import PROFILES

    for name, prof in PROFILES.items():
        want = "inductor" if name.startswith("vllm-compiled") else "eager"
        assert prof.gpu_kernels == want, name
    assert N.arith_for("eager") == N.ARITH_EAGER
    assert N.arith_for("inductor") == N.ARITH_INDUCTOR
    with torch._inductor.config.patch({"eager_numerics.division_rounding": True}):
        assert N.arith_for("inductor") == N.ARITH_INDUCTOR_RN
    with torch._inductor.config.patch({"emulate_precision_casts": True}):
        with pytest.raises(RuntimeError, match="emulate_precision_casts"):
            N.arith_for("inductor")
        assert N.arith_for("eager") == N.ARITH_EAGER


def test_inductor_options_no_kernel_copies_are_refused(monkeypatch):
    """Read in torch 2.13 and 2.14 (docs/stack.md, "GPU stacks"): `eager_numerics.use_pytorch_libdevice` swaps the
    libdevice behind Inductor's exp/rsqrt, and torch 2.14's `numerics="strict"` sums CUDA reductions in eager's
    INNER_TREE order; the compiled profiles' kernels copy neither, so both are refused. "default" is not."""
    from trl_roundalign.ops.triton import _numerics as N

    with torch._inductor.config.patch({"eager_numerics.use_pytorch_libdevice": True}):
        with pytest.raises(RuntimeError, match="use_pytorch_libdevice") as err:
            N.arith_for("inductor")
        assert "trl-roundalign probe" in str(err.value) and "\n" not in str(err.value)
        assert N.arith_for("eager") == N.ARITH_EAGER
    real = N.inductor_option
    for value, refused in (("strict", True), ("default", False)):
        monkeypatch.setattr(N, "inductor_option", lambda name, v=value: v if name == "numerics" else real(name))
        if refused:
            with pytest.raises(RuntimeError, match="numerics is 'strict'"):
                N.arith_for("inductor")
        else:
            assert N.arith_for("inductor") == N.ARITH_INDUCTOR


_MISMATCH_SCRIPT = textwrap.dedent(
    """
    import os, torch
    os.environ.pop("TRITON_INTERPRET", None)
    import trl_roundalign.ops.triton.swiglu  # decorated for the GPU
    os.environ["TRITON_INTERPRET"] = "1"  # too late for the kernels, enough for the backend check
    from trl_roundalign.ops import swiglu
    x = torch.ones(4, dtype=torch.bfloat16)
    try:
        swiglu(x, x, backend="triton")
    except RuntimeError as e:
        print("RuntimeError:", e)
    """
)


def test_kernels_compiled_for_gpu_refuse_cpu_tensors():
    """Kernels imported without the interpreter and then called on CPU tensors: a clear error, not a crash."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _MISMATCH_SCRIPT], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RuntimeError:" in proc.stdout and "compiled for the GPU" in proc.stdout, proc.stdout
