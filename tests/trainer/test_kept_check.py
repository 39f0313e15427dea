"""The colocated start-up check's passing verdict kept per machine (`trainer.kept_check`): read back only under the
whole key, never a failure, and a changed weight on either side runs the check again."""

from __future__ import annotations

import pytest
import torch
from helpers.trainer import make_config, varied_reward

from trl_roundalign.trainer.kept_check import kept_verification, weights_digest
from trl_roundalign.trainer.startup_check import CandidateScore, ProfileMismatch, Verification


@pytest.fixture
def kept_root(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_ROUNDALIGN_CACHE", str(tmp_path))
    monkeypatch.delenv("ROUNDALIGN_MEASURE_CACHE", raising=False)
    return tmp_path


def _verdict() -> Verification:
    return Verification("vllm-compiled-exact", "vllm-compiled", [CandidateScore("vllm-compiled-exact", ["rope"], 0.0, 1.0,
                                                                                0.0)], tokens=140, seconds=9.5,
                        verdict="ok", sampler_tokens=492, sampler_bitwise=1.0, sampler_forms={"chunked": 1})


def test_a_passing_verdict_is_read_back_under_its_whole_key_and_a_failure_is_not_kept(kept_root, monkeypatch):
    runs = []

    def run(fail=False):
        runs.append(fail)
        if fail:
            raise ProfileMismatch("differs")
        return _verdict()

    first = kept_verification({"model": "a"}, run)
    assert first.kept is None and len(runs) == 1
    second = kept_verification({"model": "a"}, run)
    assert len(runs) == 1 and second.kept is not None  # the time of the run that measured it
    assert {**second.as_dict(), "kept": None} == first.as_dict()
    assert isinstance(second.candidates[0], CandidateScore)
    assert kept_verification({"model": "b"}, run).kept is None and len(runs) == 2  # another key: checked again
    for _ in range(2):  # a failing check raises each time: nothing was kept
        with pytest.raises(ProfileMismatch):
            kept_verification({"model": "c"}, lambda: run(fail=True))
    assert runs[-2:] == [True, True]
    monkeypatch.setenv("ROUNDALIGN_MEASURE_CACHE", "off")
    assert kept_verification({"model": "a"}, run).kept is None and len(runs) == 5


def test_the_weights_digest_sees_one_bit_of_a_parameter_or_a_buffer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)).to(torch.bfloat16)
    before = weights_digest(model)
    assert weights_digest(model) == before
    with torch.no_grad():
        w = model[0].weight.view(torch.int16)
        w[3, 5] ^= 1  # the last mantissa bit of one weight
        assert weights_digest(model) != before
        w[3, 5] ^= 1
        assert weights_digest(model) == before
        model[1].running_mean.view(torch.int16)[2] ^= 1
        assert weights_digest(model) != before


def test_the_key_is_the_same_in_a_users_next_process():
    """vLLM names a shared memory buffer afresh in every process and leaves the name in the environment: a key holding
    it would never be found by the next run (measured: `bench/bench_startup.py`'s second exact run checked again)."""
    import json
    import subprocess
    import sys

    code = ("import json, vllm.envs as e; e.VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME; "
            "from trl_roundalign.trainer.kept_check import vllm_env; print(json.dumps(vllm_env()))")
    seen = [json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
                       .stdout.splitlines()[-1]) for _ in range(2)]
    assert seen[0] == seen[1]


@pytest.mark.vllm
@pytest.mark.full  # three exact trainers on the tiny Qwen3, about 1.5 min on AMD AVX2 (make test-full)
def test_a_second_trainer_reads_the_kept_verdict_and_a_changed_weight_is_checked_again(tmp_path, closing):
    """Two exact trainers on the same model and engine: the second reads the first's verdict (no engine call, no
    scoring) and trains bit-identical to its sampler. A trainer whose policy differs from the engine's weights in one
    bit of one norm weight has another key: its check runs again and refuses it, as it would without a kept verdict."""
    from transformers import AutoModelForCausalLM

    from trl_roundalign import RoundAlignGRPOTrainer
    from trl_roundalign.data import arithmetic_dataset
    from trl_roundalign.local_models import tiny_model

    model = str(tiny_model("qwen3"))
    regions = ["rope", "swiglu", "rmsnorm", "attention"]

    def build(run, policy=None, steps=1):
        args = make_config(tmp_path / run, max_steps=steps, roundalign_profile="auto", roundalign_regions=regions)
        return closing(RoundAlignGRPOTrainer(model=policy or model, reward_funcs=varied_reward, args=args,
                                             train_dataset=arithmetic_dataset("train[:16]")))

    first = build("first").roundalign_verification
    assert first.verdict == "ok" and first.sampler_bitwise == 1.0
    second = build("second")
    kept = second.roundalign_verification
    print("first", first.kept, first.seconds, "second", kept.kept, kept.seconds)
    assert kept.kept is not None and kept.chosen == first.chosen and kept.sampler_tokens == first.sampler_tokens
    second.train()
    [row] = [h for h in second.state.log_history if "mismatch/tokens" in h]
    assert row["mismatch/frac_bitwise_equal"] == 1.0 and row["mismatch/unreproduced_tokens"] == 0, row
    second.close()
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    with torch.no_grad():
        policy.model.norm.weight.view(torch.int16)[0] ^= 1  # the engine loads the checkpoint: it keeps the old bit
    with pytest.raises(ProfileMismatch):
        build("changed", policy)
