"""Bitwise comparison of floating-point tensors, with distances in ulps.

The claim of the aligned kernels is bitwise, so the check is bitwise: two floating-point tensors are
equal when their bit patterns are equal element for element. The one exception is NaN: any NaN
matches any NaN, because torch itself writes different NaN payloads on different code paths (its
vectorised fp32->bf16 conversion gives 0xFFFF, the scalar one 0x7FC0).

Distances are counted in ulps of the tensors' own dtype: the bit patterns are mapped to integers
that are ordered like the values (sign-magnitude -> two's complement), so adjacent representable
numbers are 1 apart; -0.0 and +0.0 are kept distinct (1 apart), since their bits differ.

One implementation for `trl-roundalign probe` (`trl_roundalign.analysis.probe`) and the tests
(`tests/_bitwise.py`, which adds the failure message of `assert_bitwise_equal`).
"""

from __future__ import annotations

from collections.abc import Collection

import torch

__all__ = ["HALF_DTYPES", "bit_mismatches", "ordered_bits", "ulp_distance"]

# The 16-bit float dtypes (whose ulps the probe counts).
HALF_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)

_INT_VIEW = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Integers ordered like the float values of `t` (int64; one apart for adjacent floats, -0.0 below +0.0)."""
    if t.dtype not in _INT_VIEW:
        raise TypeError(f"bitwise comparison needs a floating-point tensor, got {t.dtype}.")
    bits = t.contiguous().view(_INT_VIEW[t.dtype]).to(torch.int64)
    magnitude = bits & ((1 << (t.element_size() * 8 - 1)) - 1)
    return torch.where(bits < 0, -magnitude - 1, bits)


def ulp_distance(
    actual: torch.Tensor, expected: torch.Tensor, *, dtypes: Collection[torch.dtype] | None = None
) -> torch.Tensor:
    """`|ordered(actual) - ordered(expected)|` elementwise (int64, on the CPU); NaN against NaN is 0, NaN
    against a number -1.

    Args:
        actual, expected: floating-point tensors of one dtype and shape (any device).
        dtypes: the dtypes accepted (e.g. `HALF_DTYPES`, so that distances are bf16/fp16 ulps); default: any
            floating-point dtype.

    Raises:
        TypeError: different dtypes or shapes, or a dtype outside `dtypes`.
    """
    if actual.dtype != expected.dtype or actual.shape != expected.shape or (dtypes is not None and actual.dtype not in dtypes):
        want = f" (two tensors of one shape and one dtype among {', '.join(map(str, dtypes))} expected)" if dtypes else ""
        raise TypeError(
            f"cannot compare {actual.dtype}{tuple(actual.shape)} with {expected.dtype}{tuple(expected.shape)}{want}."
        )
    a, e = actual.detach().cpu(), expected.detach().cpu()
    dist = (ordered_bits(a) - ordered_bits(e)).abs()
    a_nan, e_nan = a.isnan(), e.isnan()
    dist = torch.where(a_nan & e_nan, torch.zeros_like(dist), dist)
    return torch.where(a_nan ^ e_nan, torch.full_like(dist, -1), dist)


def _bin(v: int) -> str:
    if v <= 2:
        return str(v)
    if v <= 4:
        return "3-4"
    if v <= 16:
        return "5-16"
    return "17-256" if v <= 256 else ">256"


def bit_mismatches(actual: torch.Tensor, expected: torch.Tensor) -> dict:
    """Summary of the elements whose bits differ: count, numel, fraction, max ulps (finite distances),
    a histogram of the distances (`"1"`, `"2"`, `"3-4"`, `"5-16"`, `"17-256"`, `">256"`, `"nan-vs-number"`;
    empty bins left out) and the positions (`indices`, as `nonzero()`)."""
    dist = ulp_distance(actual, expected)
    differs = dist != 0
    count = int(differs.sum())
    finite = dist[differs & (dist > 0)]
    bins = {"1": 0, "2": 0, "3-4": 0, "5-16": 0, "17-256": 0, ">256": 0, "nan-vs-number": int((dist == -1).sum())}
    values, counts = finite.unique(return_counts=True)
    for v, n in zip(values.tolist(), counts.tolist()):
        bins[_bin(v)] += n
    return {
        "count": count,
        "numel": dist.numel(),
        "fraction": count / max(dist.numel(), 1),
        "max_ulp": int(finite.max()) if finite.numel() else 0,
        "histogram": {k: v for k, v in bins.items() if v},
        "indices": differs.nonzero(),
    }
