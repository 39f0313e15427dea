"""Measurements kept between runs (`trl_roundalign.measured`): one entry per whole key, reused only under the same key,
measured again when any part of the key changes, when the entry cannot be read, or with the cache off; and the GEMM
batch-invariance report (`engine.gemm`) coming back from disk equal to the one measured."""

from __future__ import annotations

import json

import pytest

from trl_roundalign import measured


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_ROUNDALIGN_CACHE", str(tmp_path))
    monkeypatch.delenv("ROUNDALIGN_MEASURE_CACHE", raising=False)
    return tmp_path / "measured" / "probe"


def _counted():
    calls = []

    def measure():
        calls.append(1)
        return {"value": len(calls)}

    return measure, calls


def test_a_measurement_is_reused_under_its_whole_key_only(cache, monkeypatch):
    measure, calls = _counted()
    first = measured.cached_measurement("probe", {"rows": 8}, (measured.__file__,), measure)
    again = measured.cached_measurement("probe", {"rows": 8}, (measured.__file__,), measure)
    assert first == again == {"value": 1} and len(calls) == 1
    assert len(list(cache.glob("*.json"))) == 1
    # What is measured, the machine's library settings, the thread count: each is another key.
    assert measured.cached_measurement("probe", {"rows": 16}, (measured.__file__,), measure) == {"value": 2}
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert measured.cached_measurement("probe", {"rows": 8}, (measured.__file__,), measure) == {"value": 3}
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    import torch

    threads = torch.get_num_threads()
    try:
        # torch._C's setter: a vLLM-CPU engine run earlier in this process replaces torch.set_num_threads with a no-op.
        torch._C.set_num_threads(threads + 1)
        assert torch.get_num_threads() == threads + 1
        assert measured.cached_measurement("probe", {"rows": 8}, (measured.__file__,), measure) == {"value": 4}
    finally:
        torch._C.set_num_threads(threads)
    assert measured.cached_measurement("probe", {"rows": 8}, (measured.__file__,), measure) == {"value": 1}
    assert len(calls) == 4


def test_the_measuring_code_is_part_of_the_key(cache, tmp_path):
    measure, calls = _counted()
    source = tmp_path / "measuring.py"
    source.write_text("x = 1\n")
    measured.cached_measurement("probe", {}, (str(source),), measure)
    source.write_text("x = 2\n")
    measured._source_digest.cache_clear()
    assert measured.cached_measurement("probe", {}, (str(source),), measure) == {"value": 2} and len(calls) == 2


def test_an_unreadable_entry_is_measured_again_and_the_cache_can_be_off(cache, monkeypatch):
    measure, calls = _counted()
    measured.cached_measurement("probe", {}, (measured.__file__,), measure)
    (entry,) = cache.glob("*.json")
    entry.write_text("{not json")
    assert measured.cached_measurement("probe", {}, (measured.__file__,), measure) == {"value": 2}
    assert json.loads(entry.read_text())["result"] == {"value": 2}
    monkeypatch.setenv("ROUNDALIGN_MEASURE_CACHE", "off")
    assert measured.cached_measurement("probe", {}, (measured.__file__,), measure) == {"value": 3}
    assert len(calls) == 3


def test_the_gemm_report_comes_back_from_disk_as_measured(cache):
    from trl_roundalign.engine import gemm

    shapes = (("down", (96, 64)), ("gate_up", (64, 96, 96)))
    gemm._cached_measure.cache_clear()
    first = gemm._cached_measure(shapes, 32, gemm.GemmSchedule())
    gemm._cached_measure.cache_clear()  # a new process: only the disk remains
    again = gemm._cached_measure(shapes, 32, gemm.GemmSchedule())
    gemm._cached_measure.cache_clear()
    assert again == first and again is not first
    assert again.shapes[1].n == (96, 96) and again.invariant == first.invariant
    assert len(list((cache.parent / "gemm-batch-invariance").glob("*.json"))) == 1
