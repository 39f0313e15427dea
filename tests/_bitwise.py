"""Bitwise tensor comparison with a failure message that says where and by how many ulps.

The claim of the aligned kernels is bitwise, so the check is bitwise: two floating-point tensors are
equal when their bit patterns are equal element for element. The one exception is NaN: any NaN
matches any NaN, because torch itself writes different NaN payloads on different code paths (its
vectorised fp32->bf16 conversion gives 0xFFFF, the scalar one 0x7FC0).

Distances are counted in ulps of the tensors' own dtype: the bit patterns are mapped to integers
that are ordered like the values (sign-magnitude -> two's complement), so adjacent representable
numbers are 1 apart; -0.0 and +0.0 are kept distinct (1 apart), since their bits differ.
"""

from __future__ import annotations

import torch

__all__ = ["assert_bitwise_equal", "bit_mismatches", "ulp_distance"]

_INT_VIEW = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Integers ordered like the float values of `t` (int64; one apart for adjacent floats, -0.0 below +0.0)."""
    if t.dtype not in _INT_VIEW:
        raise TypeError(f"bitwise comparison needs a floating-point tensor, got {t.dtype}.")
    bits = t.contiguous().view(_INT_VIEW[t.dtype]).to(torch.int64)
    magnitude = bits & ((1 << (t.element_size() * 8 - 1)) - 1)
    return torch.where(bits < 0, -magnitude - 1, bits)


def ulp_distance(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """`|ordered(actual) - ordered(expected)|` elementwise (int64); NaN against NaN is 0, NaN against a number -1."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise TypeError(
            f"cannot compare {actual.dtype}{tuple(actual.shape)} with {expected.dtype}{tuple(expected.shape)}."
        )
    dist = (_ordered(actual) - _ordered(expected)).abs()
    a_nan, e_nan = actual.isnan(), expected.isnan()
    dist = torch.where(a_nan & e_nan, torch.zeros_like(dist), dist)
    return torch.where(a_nan ^ e_nan, torch.full_like(dist, -1), dist)


def bit_mismatches(actual: torch.Tensor, expected: torch.Tensor) -> dict:
    """Summary of the elements whose bits differ: count, fraction, max ulps, histogram, positions."""
    dist = ulp_distance(actual.detach().cpu(), expected.detach().cpu())
    differs = dist != 0
    count = int(differs.sum())
    finite = dist[differs & (dist > 0)]
    bins = {"1": 0, "2": 0, "3-4": 0, "5-16": 0, "17-256": 0, ">256": 0, "nan-vs-number": int((dist == -1).sum())}
    for v in finite.tolist():
        key = (
            "1"
            if v == 1
            else "2"
            if v == 2
            else "3-4"
            if v <= 4
            else "5-16"
            if v <= 16
            else "17-256"
            if v <= 256
            else ">256"
        )
        bins[key] += 1
    return {
        "count": count,
        "numel": dist.numel(),
        "fraction": count / max(dist.numel(), 1),
        "max_ulp": int(finite.max()) if finite.numel() else 0,
        "histogram": {k: v for k, v in bins.items() if v},
        "indices": differs.nonzero(),
    }


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, *, label: str, show: int = 8) -> None:
    """Assert `actual` and `expected` have the same dtype, shape and bits (NaN matches NaN).

    On failure the message gives the number and fraction of differing elements, a histogram of their
    distance in ulps, and the first `show` mismatches with both values.
    """
    assert actual.dtype == expected.dtype, f"{label}: dtype {actual.dtype} != expected {expected.dtype}"
    assert actual.shape == expected.shape, f"{label}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    stats = bit_mismatches(actual, expected)
    if stats["count"] == 0:
        return
    a, e = actual.detach().cpu(), expected.detach().cpu()
    dist = ulp_distance(a, e)
    lines = [
        f"{label}: {stats['count']} of {stats['numel']} elements differ ({stats['fraction']:.3e}), "
        f"max {stats['max_ulp']} ulp ({actual.dtype}); ulp histogram {stats['histogram']}",
        "first mismatches (index: actual vs expected, ulps):",
    ]
    for idx in stats["indices"][:show].tolist():
        i = tuple(idx)
        lines.append(f"  {list(i)}: {a[i].item()!r} vs {e[i].item()!r}, {int(dist[i])} ulp")
    raise AssertionError("\n".join(lines))
