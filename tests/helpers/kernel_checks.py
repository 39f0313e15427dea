"""Inputs, tolerances and Triton-mode switching shared by the kernel tests: the interpreter run on
this CPU (tests/ops/test_triton_ops.py) and the compiled run on a GPU (tests/ops/test_gpu_ops.py).
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

from helpers.bitwise import assert_bitwise_equal, bit_mismatches, ulp_distance

EPS = 1e-6
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# RMSNorm with `lanes=None`: the kernel sums x^2 with `tl.sum` (numpy's pairwise sum under the
# interpreter, its own tree on a GPU), torch with its own vectorised order. rstd then differs by 1 fp32
# ulp in about 18% of rows, which flips a bf16 output only when it lies that close to a rounding
# boundary: measured 2.5e-6 to 4.7e-6 of outputs (hidden 96-1536, 4000 rows, interpreter). The
# contract allows any order here (docs/numerics.md: 0.001-0.004% of outputs); the bound below is 20x the
# measured rate plus two elements for small tensors, and every flip must be exactly 1 ulp.
# `lanes=16/32` must be exact.
UNORDERED_SUM_FLIP_RATE = 1e-4
UNORDERED_SUM_FLIP_SLACK = 2

_TRITON_MODULES = "trl_roundalign.ops.triton"


def _drop_triton_modules() -> None:
    for name in [m for m in sys.modules if m == _TRITON_MODULES or m.startswith(_TRITON_MODULES + ".")]:
        del sys.modules[name]


@contextlib.contextmanager
def triton_mode(interpret: bool):
    """Import the kernel modules with `TRITON_INTERPRET` set to `interpret`, whatever was imported
    before (the flag is read at import), and restore the environment afterwards."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    _drop_triton_modules()
    from trl_roundalign.ops.triton import _numerics

    assert _numerics.INTERPRET == interpret
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
        _drop_triton_modules()


def compile_ptx(script: str) -> dict[str, str]:
    """Run `script` (it compiles kernels for a GPU target, no GPU needed, and prints a JSON object of PTX texts) in
    a fresh interpreter without `TRITON_INTERPRET`; skips where this Triton has no ptxas."""
    import json
    import subprocess

    import pytest

    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("no ptxas in this Triton install")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype, seed: int, scale: float = 1.0, *, device: str = "cpu") -> torch.Tensor:
    """Seeded normal values drawn on the CPU (same numbers on every device), in `dtype` on `device`."""
    return (torch.randn(shape, generator=gen(seed)) * scale).to(dtype).to(device)


def weight(n: int, dtype, seed: int, *, device: str = "cpu") -> torch.Tensor:
    """A norm weight around 1."""
    return (1.0 + 0.25 * torch.randn(n, generator=gen(seed))).to(dtype).to(device)


def grads(fn, inputs, grad_outputs):
    """Gradients of `fn(*inputs)` (one output or a tuple) for the floating-point inputs."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(list(outs), list(grad_outputs))
    return [t.grad for t in leaves]


def rms_norm_fp64(x, w):
    xf = x.double()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


def assert_bounded_flips(actual: torch.Tensor, expected: torch.Tensor, *, label: str) -> None:
    """At most `UNORDERED_SUM_FLIP_RATE` of the elements (+ slack) differ, each by exactly 1 ulp."""
    stats = bit_mismatches(actual, expected)
    allowed = UNORDERED_SUM_FLIP_RATE * stats["numel"] + UNORDERED_SUM_FLIP_SLACK
    if stats["count"] > allowed or stats["max_ulp"] > 1 or "nan-vs-number" in stats["histogram"]:
        assert_bitwise_equal(actual, expected, label=f"{label} (bound: {allowed:.0f} one-ulp flips)")


def assert_within_one_ulp(actual: torch.Tensor, expected: torch.Tensor, *, label: str) -> None:
    dist = ulp_distance(actual.cpu(), expected.cpu())
    if dist.max() > 1 or (dist < 0).any():
        assert_bitwise_equal(actual, expected, label=f"{label} (allowed: 1 ulp)")


def assert_close_fp64(actual: torch.Tensor, exact: torch.Tensor, *, label: str, atol_frac: float = 2**-16) -> None:
    """Tolerance of a gradient computed in fp32 and rounded once to `actual.dtype`.

    rtol = the dtype's epsilon (twice the half-ulp of the single rounding); atol = `atol_frac` times
    the largest |exact| value, for the fp32 cancellation where a gradient crosses zero (the derivative
    terms themselves are exact to about 2^-22 relative before the final rounding).
    """
    rtol = torch.finfo(actual.dtype).eps if actual.dtype != FP32 else 2**-18
    atol = atol_frac * exact.abs().max().item()
    torch.testing.assert_close(actual.double(), exact, rtol=rtol, atol=atol, msg=lambda m: f"{label}: {m}")
