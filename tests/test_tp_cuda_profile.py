"""The CUDA tensor-parallel profile (issue 27, part 4): which all-reduce transport a CUDA TP engine's layout sends
its row-parallel sums to, read from vLLM 0.31's sources (no GPU has run it), and how `profile_for_engine` accepts
or refuses it. No GPU and no engine: layouts as `tp.read_cuda_all_reduce` returns them."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from trl_roundalign.engine import EngineInfo, UnknownEngineConfiguration, profile_for_engine
from trl_roundalign.engine.tp import CUDA_TP_CLAIM, cuda_all_reduce_transport

# An A100 pair (sm_80: no FlashInfer all-reduce, no torch symmetric memory), default flags, a 1.5B model's hidden
# size and a prefill budget small enough for the custom all-reduce: 512 tokens x 1536 x 2 bytes = 1.5 MiB < 8 MiB.
A100_TP2 = {
    "tp": 2, "capability": "8.0", "flashinfer": True, "use_flashinfer": True, "use_flashinfer_pcie_ipc": False,
    "use_symm_mem": True, "batch_invariant": False, "disable_custom_all_reduce": False, "fuse_allreduce_rms": False,
    "enable_sp": False, "hidden": 1536, "max_tokens": 512, "itemsize": 2,
}
# vLLM's CUDA default: compiled piecewise.
CUDA_TP2 = EngineInfo(
    vllm_version="0.31.0", platform="cuda", compile_mode="VLLM_COMPILE", enforce_eager=False, custom_ops=["none"],
    backend="inductor", torch_version="2.13.0", tensor_parallel_size=2,
    splitting_ops=["vllm::unified_attention"],
)


def test_custom_all_reduce_at_tp2_is_the_one_alignable_transport():
    transport, why = cuda_all_reduce_transport(A100_TP2)
    assert transport == "custom_all_reduce_1stage" and "fp32(p0) + fp32(p1)" in why


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"tp": 4}, "TP=4: vLLM's custom all-reduce sums ranks 0..k-1 in fp32 only below 512/256 KiB"),
        ({"capability": "9.0", "fuse_allreduce_rms": True}, "fuse_allreduce_rms pass"),
        ({"enable_sp": True}, "sequence parallelism"),
        ({"capability": "9.0"}, "FlashInfer's all-reduce (VLLM_ALLREDUCE_USE_FLASHINFER=1, the default)"),
        ({"capability": "10.0"}, "FlashInfer's all-reduce"),
        ({"use_flashinfer_pcie_ipc": True}, "PCIe IPC"),
        ({"disable_custom_all_reduce": True}, "NCCL sums in bf16 steps"),
        ({"max_tokens": 8192}, "messages of 8192 KiB and more leave the custom all-reduce"),
        # sm_100 with torch symmetric memory on: the custom all-reduce stops at 2 MiB.
        ({"capability": "10.0", "use_flashinfer": False, "max_tokens": 1024}, "messages of 2048 KiB and more"),
        ({"max_tokens": None}, "largest all-reduce message"),
        ({"hidden": 1540}, "not 16-byte multiples"),
    ],
)
def test_every_other_transport_is_refused_with_its_reason(change, fragment):
    transport, why = cuda_all_reduce_transport(dict(A100_TP2, **change))
    assert transport is None and fragment in why and "\n" not in why


def test_flags_that_route_back_to_the_custom_all_reduce():
    # H100 with FlashInfer's all-reduce and its fusion switched off: custom all-reduce up to min(8, 64) MiB.
    h100 = dict(A100_TP2, capability="9.0", use_flashinfer=False, max_tokens=2048)
    assert cuda_all_reduce_transport(h100)[0] == "custom_all_reduce_1stage"
    # VLLM_BATCH_INVARIANT switches FlashInfer's all-reduce off (and torch symmetric memory: 8 MiB again).
    assert cuda_all_reduce_transport(dict(A100_TP2, capability="10.0", batch_invariant=True, max_tokens=2048))[0]
    # Without FlashInfer installed its all-reduce is never chosen.
    assert cuda_all_reduce_transport(dict(A100_TP2, capability="9.0", flashinfer=False))[0]


def test_profile_for_engine_refuses_a_cuda_engine_whose_transport_was_not_read():
    with pytest.raises(UnknownEngineConfiguration, match="on cuda the all-reduce's arithmetic depends on its transport"):
        profile_for_engine(CUDA_TP2, tensor_parallel=True)


def test_profile_for_engine_refuses_an_unalignable_cuda_transport_in_one_line():
    info = replace(CUDA_TP2)
    info.cuda_all_reduce = dict(A100_TP2, capability="9.0")
    with pytest.raises(UnknownEngineConfiguration, match="tensor parallel size is 2: on cuda FlashInfer's") as e:
        profile_for_engine(info, tensor_parallel=True)
    assert "\n" not in str(e.value)


def test_profile_for_engine_accepts_the_custom_all_reduce_only_as_read_not_run(caplog):
    info = replace(CUDA_TP2)
    info.cuda_all_reduce = dict(A100_TP2)
    with caplog.at_level(logging.WARNING, logger="trl_roundalign.engine.tp"):
        assert profile_for_engine(info, tensor_parallel=True) == "vllm-compiled-piecewise"
    assert CUDA_TP_CLAIM == "read from sources, not run" and CUDA_TP_CLAIM in caplog.text
    # Still only with the TP form computed by the trainer.
    with pytest.raises(UnknownEngineConfiguration, match="unsharded matmul"):
        profile_for_engine(info)


def test_read_cuda_all_reduce_takes_the_layout_from_the_config_and_environment(monkeypatch):
    from types import SimpleNamespace

    import torch

    from trl_roundalign.engine.tp import read_cuda_all_reduce

    cfg = SimpleNamespace(
        compilation_config=SimpleNamespace(pass_config=SimpleNamespace(fuse_allreduce_rms=False, enable_sp=False,
                                                                       fuse_gemm_comms=False)),
        parallel_config=SimpleNamespace(tensor_parallel_size=2, disable_custom_all_reduce=False),
        model_config=SimpleNamespace(dtype=torch.bfloat16, get_hidden_size=lambda: 1536),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=512),
    )
    monkeypatch.setenv("VLLM_ALLREDUCE_USE_FLASHINFER", "0")
    layout = read_cuda_all_reduce(SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=cfg)), capability="9.0",
                                  flashinfer=True)
    assert set(layout) == set(A100_TP2) and layout["use_flashinfer"] is False and layout["hidden"] == 1536
    assert cuda_all_reduce_transport(layout)[0] == "custom_all_reduce_1stage"
    monkeypatch.delenv("VLLM_ALLREDUCE_USE_FLASHINFER")
    assert cuda_all_reduce_transport(read_cuda_all_reduce(cfg, capability="9.0", flashinfer=True))[0] is None
