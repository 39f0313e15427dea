"""The engine's preparation is one decision from the config and the machine (`trainer.engine_plan.plan_engine`),
tested alone: no engine is built. What TRL's `vllm.LLM(...)` call gets on top of its own options, per mode."""

from __future__ import annotations

import pytest

from trl_roundalign import RoundAlignGRPOConfig
from trl_roundalign.engine.build import KV_SPLIT_ENV
from trl_roundalign.engine.dispatch import is_vllm_cpu
from trl_roundalign.local_models import tiny_model
from trl_roundalign.trainer.engine_plan import plan_engine

EXACT = ["rope", "swiglu", "rmsnorm", "attention"]


@pytest.fixture
def env(monkeypatch):
    """The process-wide settings `plan_engine` makes are restored after each test."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.delenv(KV_SPLIT_ENV, raising=False)
    return monkeypatch


def args(tmp_path, **kw) -> RoundAlignGRPOConfig:
    base = dict(output_dir=str(tmp_path), use_vllm=True, vllm_mode="colocate", use_cpu=True, bf16=True,
                per_device_train_batch_size=4, num_generations=4, max_completion_length=16, vllm_max_model_length=256,
                report_to="none")
    return RoundAlignGRPOConfig(**(base | kw))


def test_default_bf16_is_the_stock_engine(tmp_path, env):
    plan = plan_engine(str(tiny_model("qwen3")), args(tmp_path, roundalign_regions=[]))
    assert plan.colocate and plan.engine_kwargs == {}
    assert plan.gemm_report is None and (plan.gemm_schedule is None or plan.gemm_schedule.plain)
    assert plan.cache_tag == "compiled" and plan.max_model_len == 256
    plan = plan_engine(str(tiny_model("qwen3")), args(tmp_path, roundalign_regions=[], vllm_max_model_length=None))
    assert plan.max_model_len == 1024  # the model's own context (vLLM's default), decided once


@pytest.mark.skipif(not is_vllm_cpu(), reason="exact mode's engine options are vLLM-CPU's")
def test_exact_mode_prefills_each_prompt_alone_and_keeps_decode_keys_on_one_thread(tmp_path, env):
    import os

    plan = plan_engine(str(tiny_model("qwen3")), args(tmp_path, roundalign_regions=EXACT))
    kw = plan.engine_kwargs
    assert kw["additional_config"]["roundalign_prefill_alone"] is True
    # The engine records each request's schedule, so vLLM's chunked prefill, step budget and prefix caching stand.
    assert kw["scheduler_cls"] == "trl_roundalign.engine.schedule.RecordingScheduler"
    assert not {"enable_chunked_prefill", "max_num_batched_tokens", "enable_prefix_caching"} & set(kw)
    assert os.environ[KV_SPLIT_ENV] == "0"
    assert plan.gemm_report is not None and plan.gemm_schedule is not None
    # A scheduler of the user's own records nothing: every prompt is then prefilled whole, in one step.
    plan = plan_engine(str(tiny_model("qwen3")), args(tmp_path, roundalign_regions=EXACT, vllm_engine_kwargs={
        "scheduler_cls": "vllm.v1.core.sched.scheduler.Scheduler"}))
    kw = plan.engine_kwargs
    assert kw["enable_chunked_prefill"] is False and kw["enable_prefix_caching"] is False
    assert kw["max_num_batched_tokens"] >= 256


def test_what_the_user_sets_wins(tmp_path, env):
    plan = plan_engine(str(tiny_model("qwen3")), args(
        tmp_path, roundalign_regions=EXACT, cast_lm_head_to_fp32=True,
        vllm_engine_kwargs={"enable_prefix_caching": True, "hf_overrides": {"head_dtype": "bfloat16"}},
    ))
    assert plan.engine_kwargs["enable_prefix_caching"] is True
    assert plan.engine_kwargs["hf_overrides"] == {"head_dtype": "bfloat16"}
    plan = plan_engine(str(tiny_model("qwen3")), args(tmp_path, roundalign_regions=[], cast_lm_head_to_fp32=True))
    assert plan.engine_kwargs["hf_overrides"] == {"head_dtype": "float32"}


def test_server_mode_builds_no_engine_here(tmp_path, env):
    with pytest.warns(UserWarning, match="casts the trainer's lm head only"):
        plan = plan_engine("unused", args(tmp_path, vllm_mode="server", cast_lm_head_to_fp32=True,
                                          vllm_engine_kwargs={"enforce_eager": True}))
    assert not plan.colocate and plan.server_cpu_client
    assert plan.engine_kwargs == {"enforce_eager": True} and plan.gemm_schedule is None and plan.cache_tag is None
