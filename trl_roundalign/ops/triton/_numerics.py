"""Triton building blocks shared by the aligned kernels: the single rounding, `rstd`, Inductor's sum order.

Every kernel loads 16-bit values, upcasts them to fp32 at once, computes in fp32 and rounds once, at the
store (docs/numerics.md). What differs between a GPU and the CPU interpreter is chosen by the
`INTERPRET` constexpr each kernel receives:

- rounding fp32 -> bf16: `.to(tl.bfloat16)` on a GPU (round-to-nearest-even); the interpreter truncates
  that cast, so there it is done with integer bit operations (`rne_bf16`). fp16 uses the normal cast
  everywhere (numpy's conversion rounds to nearest even).
- `rsqrt`: the reference's `torch.rsqrt` is two correctly rounded operations on a CPU (`1 / sqrt`),
  and CUDA's `rsqrtf` on a GPU, which is `libdevice.rsqrt`.
- `sum / n`: the CPU reference divides; torch on CUDA multiplies a tensor by the reciprocal of a
  Python scalar divisor (`div_true_kernel_cuda`), so the GPU path takes `inv_n = fp32(1) / fp32(n)`.
- divisions are `tl.div_rn` and square roots `tl.sqrt_rn`: a plain `/` is `div.full.f32` (approximate)
  on NVIDIA GPUs. Kernels are launched with `enable_fp_fusion=False` so that `a * b + c` is never
  contracted into an FMA that the reference (one eager op per kernel) does not perform.

Those are the `ARITH_EAGER` kernels (the eager profiles, and every backward). A compiled engine on a
GPU runs Inductor-generated Triton instead, and the compiled profiles' forward kernels copy its
arithmetic (`ARITH` constexpr, `arith_for`): `sum / n` and `g / (1 + exp(-g))` are a plain `/`
(`div.full.f32`; `tl.div_rn` when Inductor's `eager_numerics.division_rounding` is on: `ARITH_INDUCTOR_RN`),
FMA contraction is allowed (`enable_fp_fusion=True`, Inductor's default unless `emulate_precision_casts`),
`exp` and `rsqrt` are libdevice as in Inductor's `TritonOverrides`, and each expression keeps the
operand order of vLLM's native code (`x1 * cos - x2 * sin`), since contraction depends on it.
Read in torch 2.13 and again in torch 2.14 (docs/stack.md, "GPU stacks"): the same at Inductor's
defaults; 2.14's new `numerics="strict"` (another sum order) is refused by `arith_for`.
Under the interpreter every variant computes the CPU reference (numpy divides correctly rounded and
never fuses), so the interpreter tests check the shared logic and the PTX tests check each variant's
arithmetic.

The GPU paths follow the PyTorch reference running on CUDA and Inductor's Triton code generator as
read from their sources. The CPU test run compiles them to PTX for sm_90 and checks these properties
in the generated code; it cannot check their numerics bit for bit, which needs a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ...machine import inductor_option

__all__ = [
    "ARITH_EAGER",
    "ARITH_INDUCTOR",
    "ARITH_INDUCTOR_RN",
    "INTERPRET",
    "arith_for",
    "fdiv",
    "check_launchable",
    "fp32_scalar",
    "grid_programs",
    "launch_options",
    "load_fp32",
    "lane_sum_of_squares",
    "norm_rstd",
    "rne_bf16",
    "round_tensor",
    "round_to",
    "row_block",
    "to_fp32",
]

# `triton.jit` reads TRITON_INTERPRET when a kernel is decorated, i.e. when the op modules are first
# imported together with this one; the constexpr passed to the kernels must agree with that.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")

# Largest tile (elements) one program holds. The interpreter runs programs one after another, each op
# as one numpy call, so it wants few, large programs; a GPU wants tiles that fit in registers.
_MAX_TILE = 1 << 16 if INTERPRET else 1 << 13
MAX_WIDTH = 1 << 16

# Which device arithmetic a forward kernel copies (constexpr ARITH; module docstring).
ARITH_EAGER, ARITH_INDUCTOR, ARITH_INDUCTOR_RN = 0, 1, 2


def arith_for(gpu_kernels: str) -> int:
    """The `ARITH` of a profile's forward kernels: eager CUDA, or Inductor's Triton as configured now.

    For `"inductor"` the Inductor configuration of this process decides (a colocated engine compiles
    with it): division rounding on gives `ARITH_INDUCTOR_RN`. Options that change Inductor's numerics
    in ways no kernel here copies raise instead: `emulate_precision_casts`, `use_fast_math`,
    `eager_numerics.use_pytorch_libdevice` (exp/rsqrt from the CUDA toolkit's libdevice, not Triton's
    bundled one; torch 2.13 and 2.14) and `numerics="strict"` (torch 2.14: eager's INNER_TREE order for
    CUDA sums, `TORCHINDUCTOR_NUMERICS=strict`).

    Raises:
        RuntimeError: such an option is on; the message names it.
        ValueError: unknown `gpu_kernels`.
    """
    if gpu_kernels == "eager":
        return ARITH_EAGER
    if gpu_kernels != "inductor":
        raise ValueError(f"gpu_kernels must be 'eager' or 'inductor', got {gpu_kernels!r}.")
    for option in ("emulate_precision_casts", "use_fast_math", "eager_numerics.use_pytorch_libdevice", "numerics"):
        value = inductor_option(option)
        if value and value != "default":  # `numerics` (torch 2.14) is "default" or "strict"
            raise RuntimeError(
                f"torch._inductor.config.{option} is {value!r}: the compiled engine then rounds or computes in a way "
                "no trl_roundalign kernel copies. Turn it off (TORCHINDUCTOR_EMULATE_PRECISION_CASTS=0, "
                "TORCHINDUCTOR_NUMERICS=default) or run `trl-roundalign probe` to see which profile matches the engine."
            )
    division_rn = inductor_option("eager_numerics.division_rounding") or inductor_option("emulate_divison_rounding")
    return ARITH_INDUCTOR_RN if division_rn else ARITH_INDUCTOR


def check_launchable(*tensors: torch.Tensor) -> None:
    """Raise a clear error when the kernels cannot run on these tensors."""
    on_cpu = any(not t.is_cuda for t in tensors)
    if on_cpu and not INTERPRET:
        raise RuntimeError(
            "trl_roundalign's Triton kernels were compiled for the GPU (TRITON_INTERPRET was not set when "
            "trl_roundalign.ops.triton was first imported) but the tensors are on the CPU. Set "
            "TRITON_INTERPRET=1 before the first backend='triton' call, or use backend='torch'."
        )


def fp32_scalar(value: float) -> float:
    """`value` rounded to the nearest fp32 (as torch converts a Python scalar operand), as a Python float."""
    return float(torch.tensor(float(value), dtype=torch.float32))


def launch_options(tile: int, arith: int = ARITH_EAGER) -> dict:
    """Launch keywords: warps by tile size; FMA contraction only for Inductor's arithmetic (eager never fuses)."""
    num_warps = 4 if tile <= 2048 else 8 if tile <= 8192 else 16
    return {"num_warps": num_warps, "enable_fp_fusion": arith != ARITH_EAGER}


def grid_programs(n_blocks: int, t: torch.Tensor) -> int:
    """Programs of a persistent backward kernel (each loops over row blocks and keeps one `dw` partial sum)."""
    if t.is_cuda and not INTERPRET:
        return max(1, min(n_blocks, 4 * torch.cuda.get_device_properties(t.device).multi_processor_count))
    return max(1, min(n_blocks, 4))


def row_block(width: int, lanes: int | None = None) -> tuple[int, int]:
    """`(BLOCK_ROWS, BLOCK_N)` for a row-wise kernel over rows of `width` elements."""
    if width > MAX_WIDTH:
        raise ValueError(f"rows wider than {MAX_WIDTH} elements are not supported by the Triton backend (got {width}).")
    block_n = max(triton.next_power_of_2(width), lanes or 1, 16)
    block_rows = max(1, min(256 if INTERPRET else 64, _MAX_TILE // block_n))
    return block_rows, block_n


@triton.jit
def rne_bf16(x):
    """fp32 -> bf16, round to nearest even, with integer operations (NaN stays NaN, made quiet)."""
    bits = x.to(tl.uint32, bitcast=True)
    lsb = (bits >> 16) & 1
    rounded = (bits + 0x7FFF + lsb) >> 16
    quiet_nan = (bits >> 16) | 0x40
    out = tl.where(x != x, quiet_nan, rounded)
    return out.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def round_to(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """`r(x)`: the one rounding of an fp32 value to the stored `dtype` (bf16, fp16, or fp32: unchanged)."""
    if dtype == tl.bfloat16:
        if INTERPRET:
            return rne_bf16(x)
        else:
            return x.to(tl.bfloat16, fp_downcast_rounding="rtne")
    else:
        return x.to(dtype)


@triton.jit
def to_fp32(x, INTERPRET: tl.constexpr):
    """`f(x)`: the exact upcast to fp32.

    The interpreter's bf16 -> fp32 cast is wrong for bf16 subnormals (it returns other values for all
    254 of them), so there the bf16 bits are shifted into the top half of an fp32 word instead.
    """
    if INTERPRET and x.dtype == tl.bfloat16:
        out = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        out = x.to(tl.float32)
    return out


@triton.jit
def load_fp32(ptrs, mask, INTERPRET: tl.constexpr):
    """Masked load (0 where masked) upcast exactly to fp32."""
    return to_fp32(tl.load(ptrs, mask=mask, other=0.0), INTERPRET)


@triton.jit
def fdiv(a, b, ARITH: tl.constexpr):
    """fp32 `a / b` as the copied arithmetic divides: `div.full.f32` for Inductor's default, else `div_rn`."""
    if ARITH == 1:
        return a / b
    else:
        return tl.div_rn(a, b)


@triton.jit
def norm_rstd(sum_sq, n, inv_n, eps, INTERPRET: tl.constexpr, ARITH: tl.constexpr = 0):
    """`rsqrt(sum_sq / n + eps)` exactly as the copied code computes it on the device (module docstring).

    Eager torch on CUDA multiplies by `inv_n = 1 / n`; Inductor's `mean` divides the sum by `n`.
    """
    eps32 = tl.cast(eps, tl.float32)
    if INTERPRET:
        var = tl.div_rn(sum_sq, tl.cast(n, tl.float32))
        return tl.div_rn(1.0, tl.sqrt_rn(var + eps32))
    else:
        if ARITH == 0:
            var = sum_sq * tl.cast(inv_n, tl.float32)
        else:
            var = fdiv(sum_sq, tl.cast(n, tl.float32), ARITH)
        return libdevice.rsqrt(var + eps32)


@triton.jit
def _square_chunk(A, B, rows, row_mask, stride_a, stride_b, cols, n, MODE: tl.constexpr, INTERPRET: tl.constexpr):
    """Squares of one `[rows, lanes]` chunk of the normalised value: `a`, `f(b) + f(a)`, or `f(r(f(b) + f(a)))`."""
    mask = row_mask[:, None] & (cols < n)[None, :]
    v = load_fp32(A + rows[:, None] * stride_a + cols[None, :], mask, INTERPRET)
    if MODE != 0:
        r = load_fp32(B + rows[:, None] * stride_b + cols[None, :], mask, INTERPRET)
        v = r + v
        if MODE == 2:
            v = to_fp32(round_to(v, A.dtype.element_ty, INTERPRET), INTERPRET)
    return v * v


@triton.jit
def lane_sum_of_squares(
    A,
    B,
    rows,
    row_mask,
    stride_a,
    stride_b,
    n,
    MODE: tl.constexpr,
    LANES: tl.constexpr,
    LOG2_LANES: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """`sum(v^2)` per row in Inductor's CPU order (`_common.inductor_sum`).

    Element `i` is added into lane `i % LANES` in sequence (fp32 adds), the lanes are then reduced by
    a halving tree (`lane[i] + lane[i + L/2]`, ...), and the result is added to 0. The row is re-read
    chunk by chunk from memory (`MODE`: 0 plain `A`; 1 `f(B) + f(A)`; 2 the same rounded to `A`'s
    dtype), which recomputes exactly the values the caller normalises.
    """
    lane = tl.arange(0, LANES)
    acc = tl.zeros([BLOCK_ROWS, LANES], dtype=tl.float32)
    for start in range(0, n, LANES):
        acc = acc + _square_chunk(A, B, rows, row_mask, stride_a, stride_b, start + lane, n, MODE, INTERPRET)
    for level in tl.static_range(LOG2_LANES):
        acc = tl.sum(tl.reshape(acc, [BLOCK_ROWS, 2, LANES >> (level + 1)]), axis=1)
    return 0.0 + tl.reshape(acc, [BLOCK_ROWS])


@triton.jit
def _round_kernel(X, Y, n, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0)
    tl.store(Y + offs, round_to(x, Y.dtype.element_ty, INTERPRET), mask=mask)


def round_tensor(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`r(x)` of an fp32 tensor with the kernels' own store rounding (`round_to`), for tests and checks."""
    if x.dtype != torch.float32:
        raise TypeError(f"round_tensor takes an fp32 tensor, got {x.dtype}.")
    check_launchable(x)
    src = x.contiguous()
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    block = 1 << 16 if INTERPRET else 1024
    if src.numel():
        _round_kernel[(triton.cdiv(src.numel(), block),)](
            src, out, src.numel(), BLOCK=block, INTERPRET=INTERPRET, **launch_options(block)
        )
    return out
