"""`trl_roundalign.analysis.bitwise`: the one bitwise comparison behind `trl-roundalign probe` and `tests/_bitwise.py`."""

from __future__ import annotations

import pytest
import torch
from helpers.bitwise import assert_bitwise_equal

from trl_roundalign.analysis import bitwise
from trl_roundalign.analysis.probe import ulp_distance as probe_ulp_distance


def _up(x: float, dtype: torch.dtype, steps: int = 1) -> torch.Tensor:
    t = torch.tensor(x, dtype=dtype)
    for _ in range(steps):
        t = torch.nextafter(t, torch.tensor(float("inf"), dtype=dtype))
    return t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_ulp_distance_counts_steps_of_the_tensors_own_dtype(dtype):
    a = torch.tensor([1.0, 1.0, -0.0, float("nan"), float("nan"), -1.0], dtype=dtype)
    b = torch.stack(
        [_up(1.0, dtype), _up(1.0, dtype, 3), torch.tensor(0.0, dtype=dtype), torch.tensor(float("nan"), dtype=dtype),
         torch.tensor(2.0, dtype=dtype), torch.tensor(-1.0, dtype=dtype)]
    )
    assert bitwise.ulp_distance(a, b).tolist() == [1, 3, 1, 0, -1, 0]


def test_ulp_distance_rejects_mixed_or_restricted_dtypes():
    x = torch.ones(3)
    with pytest.raises(TypeError, match="cannot compare"):
        bitwise.ulp_distance(x, x.double())
    with pytest.raises(TypeError, match="cannot compare"):
        bitwise.ulp_distance(x, x[:2])
    with pytest.raises(TypeError, match="cannot compare"):
        bitwise.ulp_distance(x, x, dtypes=bitwise.HALF_DTYPES)
    with pytest.raises(TypeError, match="floating-point"):
        bitwise.ulp_distance(torch.ones(3, dtype=torch.int32), torch.ones(3, dtype=torch.int32))
    # the probe's reading: bf16/fp16 ulps only
    assert probe_ulp_distance(x.bfloat16(), x.bfloat16()).tolist() == [0, 0, 0]
    with pytest.raises(TypeError, match="cannot compare"):
        probe_ulp_distance(x, x)


def test_bit_mismatches_histogram_and_positions():
    dtype = torch.bfloat16
    expected = torch.zeros(8, dtype=dtype)
    actual = expected.clone()
    actual[1] = _up(0.0, dtype)
    actual[2] = _up(0.0, dtype, 3)
    actual[5] = _up(0.0, dtype, 300)
    actual[6] = float("nan")
    stats = bitwise.bit_mismatches(actual, expected)
    assert stats["count"] == 4 and stats["numel"] == 8 and stats["fraction"] == 0.5
    assert stats["max_ulp"] == 300
    assert stats["histogram"] == {"1": 1, "3-4": 1, ">256": 1, "nan-vs-number": 1}
    assert stats["indices"].flatten().tolist() == [1, 2, 5, 6]
    with pytest.raises(AssertionError, match=r"4 of 8 elements differ.*max 300 ulp"):
        assert_bitwise_equal(actual, expected, label="x")
    assert_bitwise_equal(torch.tensor([float("nan")]), torch.tensor([float("nan")]), label="nan matches nan")
