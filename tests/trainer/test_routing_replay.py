"""Routing replay (`roundalign_routing_replay=True`, `trainer.routing`): the colocated vLLM-CPU engine records which
experts its routers chose for each token (`engine.routes`), and the trainer's routers take them in every log-prob
forward (`ops.routing`). Refusals are one line, before anything loads. The GRPO runs (make test-full) are
`scripts/routing_replay.py`'s, whose answer on the AVX2 kind is committed (docs/results/avx2/routing-replay.txt):
recording leaves the engine's samples bit for bit as they were, every completion token's routes are recorded, and
under the exact profile (AVX2 kernels only) the trainer's own routers already agree with the replayed ones
(routing/differs 0) and every token stays bit-identical to the sampler.
"""

from __future__ import annotations

import pathlib

import pytest

from trl_roundalign import RoundAlignGRPOConfig
from trl_roundalign.local_models import peaked_qwen3_moe, tiny_model, tiny_qwen3_5_moe
from trl_roundalign.trainer.options import check_options

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), use_vllm=True, vllm_mode="colocate", report_to="none", use_cpu=True,
                bf16=True, roundalign_routing_replay=True)  # fmt: skip
    base.update(kw)
    return RoundAlignGRPOConfig(**base)


def _refusal(model, args) -> str:
    with pytest.raises(ValueError) as err:
        check_options(model, args)
    msg = str(err.value)
    assert "\n" not in msg and "roundalign_routing_replay" in msg, msg
    return msg


def test_a_dense_model_is_refused_in_one_line(tmp_path):
    assert "has no experts" in _refusal(str(tiny_model("qwen3")), _args(tmp_path))


def test_server_mode_is_refused_in_one_line(tmp_path):
    msg = _refusal(str(peaked_qwen3_moe()), _args(tmp_path, vllm_mode="server"))
    assert "Use vllm_mode='colocate'" in msg


@pytest.mark.parametrize("model", [peaked_qwen3_moe, tiny_qwen3_5_moe])
def test_an_moe_model_in_colocate_mode_is_accepted(tmp_path, model):
    check_options(str(model()), _args(tmp_path))


def _exact_here(model: str) -> bool:
    from transformers import AutoConfig

    from trl_roundalign.local_models import resolve_model
    from trl_roundalign.models import exact_refusal_for

    return exact_refusal_for(AutoConfig.from_pretrained(resolve_model(model))) is None


@pytest.mark.vllm
@pytest.mark.full  # two GRPO runs of two steps, a fresh process each (~2-3 min per model on the AVX2 kind)
@pytest.mark.parametrize("model", ["peaked-qwen3-moe", "tiny-qwen3_5_moe"])
def test_grpo_with_routing_replay_samples_the_same_and_records_every_token(tmp_path, model):
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    import routing_replay

    # Exact where the model's exact forms apply here (the MoE form: vLLM-CPU's AVX2 kernels; Qwen3.5's gated delta-net:
    # not where the conv is C++, docs/families.md): there replay must change nothing (the routers agree) and keep every
    # token bit-identical; elsewhere the default profile.
    base = "exact" if _exact_here(model) else "default"
    results = {r["condition"]: r for r in routing_replay.run([base, base + "+replay"], 2, 32, tmp_path, model)}
    replay = results[base + "+replay"]
    assert replay["same_samples"] is True  # recording changed neither the sampled tokens nor their log-probs
    for step in replay["steps"]:
        assert step["routing/unrecorded_tokens"] == 0, step
        assert step["routing/differs"] is not None and 0 <= step["routing/differs"] < 1, step
        if base == "exact":
            assert step["routing/differs"] == 0, step
            assert step["mismatch/frac_bitwise_equal"] == 1.0 and step["mismatch/kl_k3"] == 0, step
    if base == "exact":
        assert all(s["mismatch/frac_bitwise_equal"] == 1.0 for s in results["exact"]["steps"])


@pytest.mark.vllm
@pytest.mark.full  # one GRPO run of two steps under preemptions, about 6 min on the AVX2 kind (make test-full)
def test_exact_routing_replay_under_a_filling_kv_cache_keeps_every_token(tmp_path):
    """Long prompts and a KV cache of 10 blocks: vLLM preempts and re-prefills, exact mode recomputes the re-prefilled
    tokens in stretches of their own after the batch's forward, and gradient checkpointing recomputes the batch's
    layers with the routes of their own forward (the backward stopped before `ops.routing._keeping_routes`)."""
    import sys

    if not _exact_here("peaked-qwen3-moe"):
        pytest.skip("no exact mode for Qwen3-MoE where vLLM-CPU loads its _C library (AVX-512, AMX): docs/families.md")
    sys.path.insert(0, str(ROOT / "scripts"))
    import routing_replay

    [result] = routing_replay.run(["exact+replay"], 2, 256, tmp_path, "peaked-qwen3-moe", long_prompts=True,
                                  kv_blocks=10)
    assert result["preemptions"] > 1, result  # more than the start-up check's provoked one
    for step in result["steps"]:
        assert step["mismatch/frac_bitwise_equal"] == 1.0 and step["mismatch/kl_k3"] == 0, step
        assert step["routing/differs"] == 0, step


def test_tensor_parallel_engines_are_refused_in_one_line(tmp_path):
    msg = _refusal(str(peaked_qwen3_moe()), _args(tmp_path, vllm_tensor_parallel_size=2))
    assert "Set vllm_tensor_parallel_size=1" in msg
