"""The row-block decision (`engine.gemm.decide_schedule`): one function for the trainer, `build_llm` and the server,
measuring what the run computes, and naming what it did not measure (issue 37, defect 4)."""

from __future__ import annotations

from transformers import AutoConfig

from trl_roundalign.engine.gemm import decide_schedule
from trl_roundalign.models import linear_shapes


def test_the_tp_shards_are_measured_beside_the_whole_shapes(tiny_models):
    config = AutoConfig.from_pretrained(tiny_models["qwen3"])
    whole = linear_shapes(config)
    shapes = linear_shapes(config, tensor_parallel=2)
    assert {f"{name}/tp2" for name in whole} | set(whole) == set(shapes)
    k, *n = whole["o_proj"]
    assert shapes["o_proj/tp2"] == (k // 2, *n)  # row-parallel: each rank's (and the policy's) partial product
    k, *n = whole["qkv_proj"]
    assert shapes["qkv_proj/tp2"] == (k, *(x // 2 for x in n))  # column-parallel: each rank's shard
    assert shapes["lm_head/tp2"] == (whole["lm_head"][0], whole["lm_head"][1] // 2)  # the vocabulary's shards

    _, report = decide_schedule(config, "auto", {"the engine's prefill chunk": 96}, cap=256, tensor_parallel=2, refuse=False)
    assert report is not None and {s.name for s in report.shapes} == set(shapes) and report.not_covered == []


def test_row_counts_above_the_cap_are_named_not_passed_over(tiny_models):
    config = AutoConfig.from_pretrained(tiny_models["qwen3"])
    reaches = {"the training micro-batch": 4 * 640, "the engine's prefill chunk": 200}
    rows, report = decide_schedule(config, "auto", reaches, cap=256, refuse=False)
    assert report is not None and report.max_rows == 256
    assert report.not_covered == ["the training micro-batch reaches 2560 rows (measured up to 256)"]
    assert report.as_dict()["not_covered"] == report.not_covered


def test_the_trainer_measures_its_micro_batch_its_prefill_chunk_and_its_tp_shards(tiny_models, tmp_path):
    """The trainer's decision covers the engine's TP shards and the row counts its training micro-batch and its
    engine's prefill chunk reach, and says which it did not cover (recorded in run_info's gemm report)."""
    from trl_roundalign import RoundAlignGRPOConfig
    from trl_roundalign.trainer.engine_plan import decide_gemm_schedule

    args = RoundAlignGRPOConfig(
        output_dir=str(tmp_path), use_vllm=True, vllm_mode="colocate", use_cpu=True, bf16=True,
        per_device_train_batch_size=8, num_generations=4, max_completion_length=1024, vllm_max_model_length=2048,
        vllm_tensor_parallel_size=2, roundalign_regions=["rope", "swiglu", "rmsnorm"], report_to="none",
    )  # fmt: skip
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(tiny_models["qwen3"]))
    rows, report = decide_gemm_schedule(config, args, {"max_num_batched_tokens": 512}, args.vllm_max_model_length)
    assert "o_proj/tp2" in {s.name for s in report.shapes}
    assert report.not_covered == ["the training micro-batch reaches 16384 rows (measured up to 2048)"]
