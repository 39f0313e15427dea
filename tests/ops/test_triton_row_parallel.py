"""The Triton TP-aligned row-parallel linear (`trl_roundalign.ops.triton.row_parallel`) without a GPU.

1. Under the Triton interpreter, against the PyTorch form (`trl_roundalign.engine.tp.row_parallel_linear`, plain GEMMs):
   bit for bit on small-integer inputs, where every product and every fp32 sum is exact so that the GEMM's
   accumulation order cannot matter and only the structure (k rounded partials, fp32 sum in rank order, one
   rounding) decides the bits; the same inputs tell that structure from the unsharded matmul. Backward: the
   ordinary GEMM gradient.
2. Compiled for sm_90 and sm_80 (no GPU needed), the PTX: fp32-accumulating tensor-core GEMMs, one
   round-to-nearest-even per partial element of every rank, the partials summed in fp32 (at TP=2 LLVM may turn
   `r(f(a) + f(b))` of two bf16 values into one bf16 add: the same value, as fp32 has 24 >= 2*8 + 2 bits), no
   local memory and no workspace argument (no k full-size temporaries).

The bitwise claims against cuBLAS partials need a GPU: tests/ops/test_gpu_ops.py, run by bench/gpu_check.sh.
"""

from __future__ import annotations

import re
import textwrap

import pytest
import torch
from helpers.bitwise import assert_bitwise_equal
from helpers.kernel_checks import compile_ptx, triton_mode

from trl_roundalign.engine.tp import row_parallel_linear


def _ints(shape, seed: int, lo: int = -8, hi: int = 8) -> torch.Tensor:
    return torch.randint(lo, hi + 1, shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.fixture(scope="module")
def interp():
    with triton_mode(interpret=True):
        from trl_roundalign.ops.triton.row_parallel import row_parallel_linear_triton

        yield row_parallel_linear_triton


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(("m", "n", "k", "bias"), [(37, 96, 256, True), (5, 40, 96, False), (2, 3, 72, True)])
def test_interpreter_matches_the_pytorch_form_bitwise_on_exact_products(interp, tp, m, n, k, bias):
    if k % tp:
        pytest.skip("K does not split")
    x, w = _ints((m, k), 1), _ints((n, k), 2)
    b = _ints((n,), 3, -64, 64) if bias else None
    got = interp(x, w, b, tp)
    assert_bitwise_equal(got, row_parallel_linear(x, w, b, tp, rows=0), label=f"row-parallel TP={tp} {m}x{n}x{k}")


def test_exact_products_tell_the_sharded_sum_from_the_plain_matmul(interp):
    """The check above can fail: on the same inputs the unsharded GEMM and a sum without the partials' rounding
    give other bits for a large share of the outputs."""
    x, w, b = _ints((37, 256), 1), _ints((96, 256), 2), _ints((96,), 3, -64, 64)
    got = interp(x, w, b, 2)
    plain = torch.nn.functional.linear(x, w, b)
    assert (got != plain).float().mean() > 0.1
    unrounded = (x[:, :128].float() @ w[:, :128].float().T + b.float() + x[:, 128:].float() @ w[:, 128:].float().T)
    assert (got != unrounded.bfloat16()).float().mean() > 0.1
    assert not torch.equal(interp(x, w, b, 4), got)  # TP=4 rounds four partials: other bits again


def test_interpreter_on_random_inputs_and_leading_dims(interp):
    """Random inputs: the GEMMs' accumulation orders (numpy's in the interpreter, torch's in the reference) may differ,
    so the bits are checked against the structure instead: the TP=2 output is the fp32 sum, rounded once, of the bf16
    partials the same kernel computes over each K slice alone."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 9, 128, generator=g).bfloat16()
    w = torch.randn(48, 128, generator=g).bfloat16()
    got = interp(x, w, None, 2)
    assert got.shape == (2, 9, 48)
    parts = [interp(x[..., r * 64:(r + 1) * 64].contiguous(), w[:, r * 64:(r + 1) * 64].contiguous(), None, 1) for r in (0, 1)]
    assert_bitwise_equal(got, (parts[0].float() + parts[1].float()).bfloat16(), label="TP=2 vs its own partials")
    assert not torch.equal(got, torch.nn.functional.linear(x, w)), "the inputs cannot tell the sharded sum from F.linear"


def test_backward_is_the_ordinary_gemm_gradient(interp):
    x, w, b = _ints((7, 64), 5), _ints((24, 64), 6), _ints((24,), 7, -64, 64)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    interp(xr, wr, br, 2).float().sum().backward()
    ones = torch.ones(7, 24, dtype=torch.bfloat16)
    assert torch.equal(xr.grad, ones @ w) and torch.equal(wr.grad, ones.T @ x) and torch.equal(br.grad, ones.sum(0))


def test_refuses_other_dtypes_and_uneven_shards(interp):
    x, w = _ints((4, 64), 1), _ints((8, 64), 2)
    with pytest.raises(TypeError, match="bf16"):
        interp(x.float(), w.float(), None, 2)
    with pytest.raises(ValueError, match="does not split into 3"):
        interp(x, w, None, 3)


# --------------------------------------------------------------------------------------------------
# PTX for the GPU, compiled without one

_PTX_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from trl_roundalign.ops.triton import row_parallel as RP

    out = {}
    for cap in (80, 90):
        for tp in (2, 4):
            consts = dict(TP=tp, HAS_BIAS=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, INTERPRET=False)
            ptrs = dict(X="*bf16", W="*bf16", B="*bf16", Y="*bf16")
            sig = {a: ("constexpr" if a in consts else ptrs.get(a, "i32")) for a in RP._row_parallel_fwd_kernel.arg_names}
            src = ASTSource(fn=RP._row_parallel_fwd_kernel, signature=sig, constexprs=consts)
            k = triton.compile(src, target=GPUTarget("cuda", cap, 32), options=dict(num_warps=4, num_stages=3))
            out[f"sm{cap}/tp{tp}"] = k.asm["ptx"]
    json.dump(out, sys.stdout)
    """
)
# Elements of a 64 x 64 output tile per thread (4 warps).
_PER_THREAD = 64 * 64 // 128


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    return compile_ptx(_PTX_SCRIPT)


def _count(pattern: str, code: str) -> int:
    return len(re.findall(pattern, code, re.M))


_BF16_ADD = r"^\s*(add|fma)(\.rn)?\.bf16(x2)?\b"


def test_gemms_accumulate_in_fp32_on_tensor_cores(ptx):
    for name, code in ptx.items():
        if name.startswith("sm90"):
            assert re.search(r"wgmma\.mma_async[\w.]*\.f32\.bf16\.bf16", code), f"{name}: no fp32-accumulating wgmma"
        else:
            assert re.search(r"mma\.sync\.aligned\.[\w.]*\.f32\.bf16\.bf16\.f32", code), f"{name}: no fp32 mma.sync"
        assert not re.search(r"mma[\w.]*\.(f16|bf16)\.bf16\.bf16\.(f16|bf16)\b", code), f"{name}: a 16-bit accumulator"


@pytest.mark.parametrize("tp", [2, 4])
def test_every_partial_of_every_rank_is_rounded_to_nearest_even(ptx, tp):
    """k partial roundings per output element: a kernel that accumulated the whole K in one fp32 tile (the
    unsharded GEMM) would round each element once."""
    for cap in (80, 90):
        code = ptx[f"sm{cap}/tp{tp}"]
        rne = _count(r"^\s*cvt\.rn(\.satfinite)?\.bf16\.f32", code) + 2 * _count(r"^\s*cvt\.rn(\.satfinite)?\.bf16x2\.f32", code)
        assert rne >= tp * _PER_THREAD, f"sm{cap} TP={tp}: {rne} bf16 roundings, want >= {tp} x {_PER_THREAD}"
        assert not re.search(r"cvt\.(rz|rm|rp)[\w.]*\.bf16", code), f"sm{cap} TP={tp}: a directed rounding"


def test_partials_are_summed_in_fp32(ptx):
    for cap in (80, 90):
        code = ptx[f"sm{cap}/tp4"]
        assert not _count(_BF16_ADD, code), f"sm{cap} TP=4: a bf16 addition (the partial sums must stay in fp32)"
        # (k - 1) fp32 additions per element for the sum, plus the bias in rank 0's epilogue.
        assert _count(r"^\s*add(\.rn)?\.f32\b", code) >= 3 * _PER_THREAD
        # At TP=2, r(f(p0) + f(p1)) may be emitted as one bf16 add (exact: 24 >= 2 * 8 + 2 bits), or in fp32.
        two = ptx[f"sm{cap}/tp2"]
        assert _count(_BF16_ADD, two) + _count(r"^\s*add(\.rn)?\.f32\b", two) >= 2 * _PER_THREAD


def test_no_local_memory_and_no_workspace(ptx):
    """The k partials live in registers, one at a time: no spills to local memory, and the kernel takes no
    buffer beyond x, W, bias and the output."""
    for name, code in ptx.items():
        assert ".local" not in code, f"{name}: local memory (spilled tiles)"
        params = re.search(r"\.entry\s+\w+\(([^)]*)\)", code, re.S).group(1)
        # X, W, B, Y, and the two scratch pointers Triton appends to every kernel.
        assert params.count(".u64") <= 6, f"{name}: {params.count('.u64')} pointer parameters"
    from trl_roundalign.ops.triton.row_parallel import _row_parallel_fwd_kernel

    assert _row_parallel_fwd_kernel.arg_names[:5] == ["X", "W", "B", "Y", "M"]
