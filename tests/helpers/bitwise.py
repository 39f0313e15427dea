"""Bitwise tensor comparison with a failure message that says where and by how many ulps.

The comparison itself (`ulp_distance`, `bit_mismatches`: bit patterns, NaN matches NaN, distances in
ulps of the tensors' own dtype) is `trl_roundalign.analysis.bitwise`, shared with `trl-roundalign
probe`; this module re-exports it and adds `assert_bitwise_equal`.
"""

from __future__ import annotations

import torch

from trl_roundalign.analysis.bitwise import bit_mismatches, ulp_distance

__all__ = ["assert_bitwise_equal", "bit_mismatches", "ulp_distance"]


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
