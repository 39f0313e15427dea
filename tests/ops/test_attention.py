"""vLLM-CPU attention: bitwise against the real engine's prefill, fp32 backward, Hugging Face padding.

The engine tests build an in-process vLLM-CPU engine per model (module scope), score prompts with
`prompt_logprobs`, and capture the q/k/v and the output of every attention call by wrapping
`CPUAttentionBackendImpl.forward`. That method runs inside the opaque custom op
`vllm::unified_attention_with_output`, which Inductor calls as an extern kernel: it is the same
Python call, on the same C++ op, in compiled and in eager engines (the Qwen3 engine below is
compiled, the Llama engine eager).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
import torch

from trl_roundalign.engine import close_llm
from trl_roundalign.ops import attention as attn_mod
from trl_roundalign.ops.attention import (
    hf_attention_interface,
    segments_from_attention_mask,
    vllm_cpu_attention,
    vllm_cpu_attention_available,
    vllm_cpu_attention_forward,
)


@pytest.fixture
def requires_vllm():
    if not vllm_cpu_attention_available():
        pytest.skip("needs vLLM's CPU build (vllm-cpu)")


needs_vllm = pytest.mark.usefixtures("requires_vllm")


def _mismatch_report(actual: torch.Tensor, expected: torch.Tensor, limit: int = 5) -> str:
    """Ulp histogram (bf16 bit distance) and the first mismatches."""
    a = actual.contiguous().view(torch.int16).int()
    e = expected.contiguous().view(torch.int16).int()
    ulp = (a - e).abs().flatten()
    bad = (actual != expected).flatten().nonzero().flatten()
    hist = {int(u): int((ulp == u).sum()) for u in ulp[bad].unique()[:8]} if bad.numel() else {}
    first = [(int(i), float(actual.flatten()[i]), float(expected.flatten()[i])) for i in bad[:limit]]
    return f"{bad.numel()}/{actual.numel()} differ; ulp histogram {hist}; first (index, got, expected) {first}"


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert torch.equal(actual, expected), _mismatch_report(actual, expected)


def causal_attention_reference(q, k, v, seq_lens, scale):
    """Plain causal softmax attention on packed [T, H, D] tensors (any dtype; GQA by repetition)."""
    group = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in seq_lens:
        qq = q[start : start + n].transpose(0, 1)
        kk = k[start : start + n].transpose(0, 1).repeat_interleave(group, 0)
        vv = v[start : start + n].transpose(0, 1).repeat_interleave(group, 0)
        s = torch.matmul(qq, kk.transpose(1, 2)) * scale
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        outs.append(torch.matmul(s.softmax(-1), vv).transpose(0, 1))
        start += n
    return torch.cat(outs)


def random_qkv(seq_lens, hq, hkv, d, *, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    n = sum(seq_lens)
    q = (torch.randn(n, hq, d, generator=g) * 2).bfloat16()
    k = torch.randn(n, hkv, d, generator=g).bfloat16()
    v = torch.randn(n, hkv, d, generator=g).bfloat16()
    if requires_grad:
        for t in (q, k, v):
            t.requires_grad_()
    return q, k, v


def per_sequence(q, k, v, seq_lens, **kw):
    outs, start = [], 0
    for n in seq_lens:
        sl = slice(start, start + n)
        outs.append(vllm_cpu_attention_forward(q[sl], k[sl], v[sl], seq_lens=[n], **kw))
        start += n
    return torch.cat(outs)


# ------------------------------------------------------------------------------------------------
# Against the real engine
# ------------------------------------------------------------------------------------------------

ENGINES = {
    # Qwen3: head_dim 32, GQA 4:2, the default (compiled) engine, the process's thread count.
    "qwen3-compiled": dict(arch="qwen3", overrides={}, enforce_eager=False, threads=None),
    # Llama: head_dim 64, GQA 2:1, eager engine, one OpenMP thread.
    "llama-eager-1thread": dict(
        arch="llama",
        overrides=dict(head_dim=64, num_attention_heads=2, num_key_value_heads=1, hidden_size=128),
        enforce_eager=True,
        threads=1,
    ),
}
SINGLE = [45]
SEVERAL = [3, 17, 130, 61, 1, 300]


@contextlib.contextmanager
def _capturing_engine(spec, cache_dir):
    """An in-process vLLM-CPU engine whose attention calls are recorded."""
    from trl_roundalign.local_models import tiny_model

    mp = pytest.MonkeyPatch()
    set_threads = torch.set_num_threads  # vLLM's CPU worker replaces it with a no-op; restored below
    threads_before = torch.get_num_threads()
    try:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        mp.setenv("VLLM_CACHE_ROOT", str(cache_dir / "vllm"))
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache_dir / "inductor"))
        if spec["threads"] is not None:
            torch._C.set_num_threads(spec["threads"])
        from vllm import LLM, SamplingParams
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        records: list[dict] = []
        original = CPUAttentionBackendImpl.forward

        def recording_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
            result = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
            if attn_metadata is not None:
                n = attn_metadata.num_actual_tokens
                records.append(
                    dict(
                        layer=layer.layer_name,
                        q=query[:n].clone(),
                        k=key[:n].clone(),
                        v=value[:n].clone(),
                        out=output[:n].clone(),
                        seq_lens=attn_metadata.seq_lens.tolist(),
                        query_start_loc=attn_metadata.query_start_loc.tolist(),
                        scale=self.scale,
                        isa=layer.isa,
                        block_size=kv_cache.shape[2],
                        threads=torch.get_num_threads(),
                    )
                )
            return result

        mp.setattr(CPUAttentionBackendImpl, "forward", recording_forward)
        path = tiny_model(spec["arch"], **spec["overrides"])
        llm = LLM(model=str(path), dtype="bfloat16", enforce_eager=spec["enforce_eager"], seed=0, max_model_len=1024)
        params = SamplingParams(max_tokens=1, prompt_logprobs=0)
        g = torch.Generator().manual_seed(7)
        captured = {}
        for name, lens in (("single", SINGLE), ("several", SEVERAL)):
            records.clear()
            prompts = [dict(prompt_token_ids=torch.randint(3, 500, (n,), generator=g).tolist()) for n in lens]
            llm.generate(prompts, params, use_tqdm=False)
            captured[name] = list(records)
        yield captured
    finally:
        with contextlib.suppress(NameError):
            close_llm(llm)
        mp.undo()
        torch.set_num_threads = set_threads
        torch._C.set_num_threads(threads_before)


@pytest.fixture(scope="module", params=list(ENGINES))
def engine_capture(request, tmp_path_factory):
    if not vllm_cpu_attention_available():
        pytest.skip("needs vLLM's CPU build (vllm-cpu)")
    with _capturing_engine(ENGINES[request.param], tmp_path_factory.mktemp("engine")) as captured:
        yield captured


@pytest.mark.vllm
@pytest.mark.parametrize("batch", ["single", "several"])
def test_forward_bitwise_vs_engine_prefill(engine_capture, batch, record_property):
    records = engine_capture[batch]
    lens = SINGLE if batch == "single" else SEVERAL
    assert len(records) == 2, "one prefill step, one call per layer (2 layers)"
    for rec in records:
        starts = rec["query_start_loc"]
        assert [b - a for a, b in zip(starts[:-1], starts[1:])] == rec["seq_lens"], "whole-prompt prefill"
        assert sorted(rec["seq_lens"]) == sorted(lens)
        q, k, v = rec["q"], rec["k"], rec["v"]
        assert q.dtype == torch.bfloat16
        expected = rec["out"].view(q.shape)
        mine = vllm_cpu_attention_forward(
            q,
            k,
            v,
            scale=rec["scale"],
            seq_lens=rec["seq_lens"],
            block_size=rec["block_size"],
            num_threads=rec["threads"],
        )
        assert_bitwise(mine, expected)
        # the engine's scale is 1/sqrt(D), as Hugging Face's `module.scaling`
        assert rec["scale"] == q.shape[-1] ** -0.5
        # the autograd path and each sequence alone (all shorter than the kernel's tile) give the same bits
        assert_bitwise(vllm_cpu_attention(q, k, v, scale=rec["scale"], seq_lens=rec["seq_lens"]), expected)
        assert_bitwise(per_sequence(q, k, v, rec["seq_lens"], scale=rec["scale"]), expected)
        # context: Hugging Face sdpa on the same bf16 inputs
        start, sdpa = 0, []
        for n in rec["seq_lens"]:
            sl = slice(start, start + n)
            o = torch.nn.functional.scaled_dot_product_attention(
                q[sl].transpose(0, 1)[None],
                k[sl].transpose(0, 1)[None],
                v[sl].transpose(0, 1)[None],
                is_causal=True,
                scale=rec["scale"],
                enable_gqa=True,
            )
            sdpa.append(o[0].transpose(0, 1))
            start += n
        frac = (torch.cat(sdpa) == expected).float().mean().item()
        record_property(f"sdpa_equal_fraction/{batch}/{rec['layer']}", round(frac, 4))


@pytest.mark.vllm
def test_engine_isa_matches_ours(engine_capture):
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    for rec in engine_capture["several"]:
        assert rec["isa"] == _get_attn_isa(torch.bfloat16, rec["block_size"], rec["q"].shape[-1])


# ------------------------------------------------------------------------------------------------
# The kernel on its own: threads, batch composition, block size
# ------------------------------------------------------------------------------------------------


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("d,hq,hkv", [(128, 8, 2), (64, 6, 2)])
def test_one_thread_is_batch_invariant_on_long_sequences(d, hq, hkv):
    lens = [1100, 7, 1600, 300]
    q, k, v = random_qkv(lens, hq, hkv, d, seed=1)
    batched = vllm_cpu_attention_forward(q, k, v, scale=d**-0.5, seq_lens=lens, num_threads=1)
    assert_bitwise(per_sequence(q, k, v, lens, scale=d**-0.5, num_threads=1), batched)
    reordered = [lens[2], lens[0]]
    qq = torch.cat([q[1107:2707], q[:1100]])
    kk = torch.cat([k[1107:2707], k[:1100]])
    vv = torch.cat([v[1107:2707], v[:1100]])
    other = vllm_cpu_attention_forward(qq, kk, vv, scale=d**-0.5, seq_lens=reordered, num_threads=1)
    assert_bitwise(torch.cat([other[1600:], other[:1600]]), torch.cat([batched[:1100], batched[1107:2707]]))


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("d", [128, 64])
def test_decode_form_is_each_tokens_own_decode_step_whatever_else_is_in_the_call(d):
    """Decode form (`decode_from`): each token after the prompt is one query over its prefix, the keys on one thread.
    Computed in one call for two long sequences it gives every token the bits of a call that decodes that token
    alone (a decode step of one sequence), on the process's threads: the sampler's value whatever shared its step."""
    lens, prompts = [700, 450], [17, 60]
    q, k, v = random_qkv(lens, 4, 2, d, seed=4)
    out = vllm_cpu_attention_forward(q, k, v, scale=d**-0.5, seq_lens=lens, decode_from=prompts, kv_split=False)
    start = 0
    for n, p in zip(lens, prompts):
        for t in [p - 1, p, p + 1, 100, 321, 333, 449, n - 1]:
            if t >= n:
                continue
            sl = slice(start, start + t + 1)
            alone = vllm_cpu_attention_forward(q[sl], k[sl], v[sl], scale=d**-0.5, seq_lens=[t + 1],
                                               decode_from=[min(t, p)], kv_split=False)
            assert_bitwise(out[start + t], alone[t])
        start += n
    # the prompt is one prefill: the tokens before `decode_from` are those of the prompt's own prefill
    prompt_only = vllm_cpu_attention_forward(q[:17], k[:17], v[:17], scale=d**-0.5, seq_lens=[17])
    assert_bitwise(out[:17], prompt_only)


@pytest.mark.vllm
@needs_vllm
def test_the_prompt_horizon_is_where_a_prefill_starts_to_depend_on_its_batch():
    """`prefill_batch_invariant_tokens`: up to the horizon a prompt's prefill has the same bits alone and beside
    another sequence (checked again here at other lengths and another neighbour); one step above it, not. Measured
    on this machine's threads (None where every length up to the limit is invariant, e.g. one thread)."""
    from trl_roundalign.trainer.startup_check import prefill_batch_invariant_tokens

    horizon = prefill_batch_invariant_tokens(128, 4, 2, limit=1024)
    if horizon is None:
        pytest.skip(f"every prompt up to 1024 tokens is batch-invariant here ({torch.get_num_threads()} threads)")
    assert horizon % 32 == 0 and horizon >= 0
    for n in sorted({32, horizon // 2, horizon} - {0}):
        q, k, v = random_qkv([n, 333], 4, 2, 128, seed=n)
        alone = vllm_cpu_attention_forward(q[:n], k[:n], v[:n], scale=128**-0.5, seq_lens=[n])
        assert_bitwise(vllm_cpu_attention_forward(q, k, v, scale=128**-0.5, seq_lens=[n, 333])[:n], alone)


def test_decode_from_must_fit_each_sequence():
    q, k, v = random_qkv([5, 3], 2, 1, 32)
    with pytest.raises(ValueError, match="decode_from must give each of the 2 sequences a prefill length"):
        vllm_cpu_attention_forward(q, k, v, scale=1.0, seq_lens=[5, 3], decode_from=[2, 4])
    for chunks in ([(3, 2), 1], [(0, 2), 1], [(), 1], [(2, 6), 1]):  # not increasing, empty, past the sequence
        with pytest.raises(ValueError, match="or its prefill chunks' increasing ends"):
            vllm_cpu_attention_forward(q, k, v, scale=1.0, seq_lens=[5, 3], decode_from=chunks)


@pytest.mark.vllm
@needs_vllm
def test_a_chunked_prefill_is_each_chunk_over_its_past_keys():
    """Chunk ends in `decode_from` (vLLM's chunked prefill, a prefix hit's tail): each chunk is a request with past
    keys, and every prefill request is cut at the KV cache's block boundaries (`engine.prefill.block_pieces`, what exact
    mode's engine computes). Without the pieces, the first 512 tokens of a 1,200-token prefill differ from a prefill of
    those 512 alone (the kernel tiles a request by its own length: measured 4 and 7 outputs on AMD AVX2 with 1 and 2
    threads), so a cached block's bits would depend on how far its request went on. With them, a chunk cut at a block
    boundary changes nothing, one cut inside a block does (its own request), and a chunk's tokens are those of a
    prefill of the sequence up to its end."""
    lens, d = [1200, 300], 128
    q, k, v = random_qkv(lens, 4, 2, d, seed=7)
    kw = dict(scale=d**-0.5, seq_lens=lens, kv_split=False)
    whole = vllm_cpu_attention_forward(q, k, v, decode_from=[1100, 250], **kw)
    assert_bitwise(vllm_cpu_attention_forward(q, k, v, decode_from=[(1100,), (250,)], **kw), whole)
    assert_bitwise(vllm_cpu_attention_forward(q, k, v, decode_from=[(512, 1100), (250,)], **kw), whole)
    inside = vllm_cpu_attention_forward(q, k, v, decode_from=[(500, 1100), (250,)], **kw)
    assert not torch.equal(inside[500:1100], whole[500:1100])
    first = vllm_cpu_attention_forward(q[:500], k[:500], v[:500], scale=d**-0.5, seq_lens=[500])
    assert_bitwise(inside[:500], first)
    assert_bitwise(inside[1200:], whole[1200:])  # the other sequence is untouched
    unpieced = vllm_cpu_attention_forward(q, k, v, decode_from=[1100, 250], prefill_alone=False, **kw)
    alone = vllm_cpu_attention_forward(q[:512], k[:512], v[:512], scale=d**-0.5, seq_lens=[512], prefill_alone=False)
    assert not torch.equal(unpieced[:512], alone)


@pytest.mark.vllm
@needs_vllm
def test_num_threads_is_restored():
    """A one-call thread count is the process's again after the call. The count asked for differs from the current
    one (under OMP_NUM_THREADS=1 a request for 1 thread would pass with no restore at all)."""
    before = torch.get_num_threads()
    other = 2 if before == 1 else 1
    q, k, v = random_qkv([40], 4, 2, 32)
    vllm_cpu_attention_forward(q, k, v, scale=32**-0.5, seq_lens=[40], num_threads=other)
    assert torch.get_num_threads() == before


@pytest.mark.vllm
@needs_vllm
def test_short_sequences_do_not_depend_on_threads_or_batch():
    lens = [5, 37, 200, 1, 400]
    q, k, v = random_qkv(lens, 4, 2, 32, seed=2)
    one = vllm_cpu_attention_forward(q, k, v, scale=32**-0.5, seq_lens=lens, num_threads=1)
    two = vllm_cpu_attention_forward(q, k, v, scale=32**-0.5, seq_lens=lens, num_threads=2)
    assert_bitwise(two, one)
    assert_bitwise(per_sequence(q, k, v, lens, scale=32**-0.5, num_threads=2), one)


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("block_size", [32, 64, 256])
def test_block_size_does_not_change_the_vec_path(block_size):
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    if _get_attn_isa(torch.bfloat16, 128, 64) != "vec":
        pytest.skip("this CPU takes the amx path: test_vec_path_claims_run_on_an_amx_cpu runs this in a process without")
    assert _get_attn_isa(torch.bfloat16, block_size, 64) == "vec"
    lens = [9, 150, 260]
    q, k, v = random_qkv(lens, 4, 2, 64, seed=3)
    ref = vllm_cpu_attention_forward(q, k, v, scale=0.125, seq_lens=lens)
    assert_bitwise(vllm_cpu_attention_forward(q, k, v, scale=0.125, seq_lens=lens, block_size=block_size), ref)


@pytest.mark.vllm
@needs_vllm
def test_vec_path_claims_run_on_an_amx_cpu(tmp_path):
    """Where vLLM-CPU takes the amx path, the vec-path tests (block size, the fp32-probability bound) run in a fresh
    process whose AMX probe answers no, as on an AVX-512 CPU without AMX, and must pass there, none skipped."""
    import subprocess
    import sys

    from helpers.env import subprocess_env
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    if _get_attn_isa(torch.bfloat16, 128, 64) != "amx":
        pytest.skip("this CPU takes the vec path itself: the tests ran in this process")
    env = subprocess_env(ROUNDALIGN_TEST_AS_CPU="no-amx")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", __file__, "-k",
         "does_not_change_the_vec_path or within_bf16_rounding or vec_isa_is_taken"],
        capture_output=True, text=True, env=env, timeout=900, cwd=Path(__file__).resolve().parents[2],
    )
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    # 3 block sizes, 2 head dims, the ISA check: all run, none skipped.
    assert "skipped" not in proc.stdout and "6 passed" in proc.stdout, tail


@pytest.mark.vllm
@needs_vllm
def test_vec_isa_is_taken_where_amx_is_absent():
    """In a process without AMX (any CPU but the Intel AMX kind, or the no-amx process above) vLLM-CPU picks the vec
    path for a head dim that is a multiple of 32, and the package's wrapper asks vLLM's own choice."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    if torch.cpu._is_amx_tile_supported():
        pytest.skip("this process has AMX: test_vec_path_claims_run_on_an_amx_cpu runs this in one without")
    assert _get_attn_isa(torch.bfloat16, 128, 64) == "vec"


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("d", [32, 80])
def test_forward_is_attention_within_bf16_rounding(d):
    """vLLM-CPU's kernel is causal attention up to its roundings. The `vec`/`vec16` paths keep the probabilities in
    fp32: `|out - ref| <= 2^-7 |ref| + 1e-3`. The `amx` path (Intel AMX, head dims that are a multiple of 32, the
    default block size) multiplies P.V on bf16 tiles, so each probability is rounded to bf16 once: its bound adds
    `2^-8 sum_j p_j |v_j|` (measured there: the larger bound's excess at most -1.2e-5 over seeds 4-6 and d = 32, 64,
    128 with 1e-5 in place of 1e-3; the old bound was exceeded by 7 of 23296 outputs at d = 32)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    lens = [3, 50, 129]
    q, k, v = random_qkv(lens, 4, 2, d, seed=4)
    out = vllm_cpu_attention_forward(q, k, v, scale=d**-0.5, seq_lens=lens)
    ref = causal_attention_reference(q.double(), k.double(), v.double(), lens, d**-0.5)
    err = (out.double() - ref).abs()
    bound = 2**-7 * ref.abs() + 1e-3
    if _get_attn_isa(torch.bfloat16, 128, d) == "amx":
        bound = bound + 2**-8 * causal_attention_reference(q.double(), k.double(), v.double().abs(), lens, d**-0.5)
    assert bool((err <= bound).all()), (err - bound).max()


# ------------------------------------------------------------------------------------------------
# Backward
# ------------------------------------------------------------------------------------------------


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("d,hq,hkv,lens", [(32, 4, 2, [5, 17, 1, 33]), (64, 6, 2, [40, 3, 70]), (128, 2, 2, [90])])
def test_backward_vs_fp64_autograd(d, hq, hkv, lens):
    """Tolerance: one bf16 rounding of the fp64 gradient plus fp32 noise,
    `|g - g64| <= 2^-8 |g64| + 1e-6 max|g64|`, and at least 99.5% of elements equal `r(g64)`."""
    q, k, v = random_qkv(lens, hq, hkv, d, seed=5, requires_grad=True)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(6)).bfloat16()
    out = vllm_cpu_attention(q, k, v, scale=d**-0.5, seq_lens=lens)
    out.backward(grad_out)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    causal_attention_reference(q64, k64, v64, lens, d**-0.5).backward(grad_out.double())
    for name, got, ref in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        assert got.dtype == torch.bfloat16
        err = (got.double() - ref).abs()
        bound = 2**-8 * ref.abs() + 1e-6 * ref.abs().max()
        assert bool((err <= bound).all()), f"{name}: max excess {(err - bound).max().item()}"
        assert (got == ref.bfloat16()).float().mean().item() >= 0.995, name


def test_backward_fp32_matches_autograd_without_vllm():
    """The fp32 gradient formula alone (no vLLM needed) against fp64 autograd."""
    lens, d = [6, 11], 32
    q, k, v = random_qkv(lens, 4, 2, d, seed=8)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))
    dq, dk, dv = attn_mod.attention_backward_fp32(grad_out, q, k, v, d**-0.5, lens)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    causal_attention_reference(q64, k64, v64, lens, d**-0.5).backward(grad_out.double())
    for got, ref in ((dq, q64.grad), (dk, k64.grad), (dv, v64.grad)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# Hugging Face interface: masks and padding
# ------------------------------------------------------------------------------------------------

T_PAD = 23
# (offset, length) of the real tokens of each row: left padded, right padded, both, none
ROWS = [(T_PAD - 9, 9), (0, 14), (3, 17), (0, T_PAD)]


def _hf_mask(impl: str, padding_mask: torch.Tensor, position_ids: torch.Tensor | None = None):
    from transformers import Qwen3Config
    from transformers.masking_utils import create_causal_mask

    config = Qwen3Config(num_hidden_layers=1, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    config._attn_implementation = impl
    shape = (padding_mask if padding_mask is not None else position_ids).shape
    embeds = torch.zeros(*shape, 8, dtype=torch.bfloat16)
    return create_causal_mask(
        config=config,
        inputs_embeds=embeds,
        attention_mask=padding_mask,
        past_key_values=None,
        position_ids=position_ids,
    )


class _Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2


def _padded_batch(hq=4, hkv=2, d=32, seed=10, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    b = len(ROWS)
    query = (torch.randn(b, hq, T_PAD, d, generator=g) * 2).bfloat16()
    key = torch.randn(b, hkv, T_PAD, d, generator=g).bfloat16()
    value = torch.randn(b, hkv, T_PAD, d, generator=g).bfloat16()
    padding_mask = torch.zeros(b, T_PAD, dtype=torch.long)
    for i, (off, n) in enumerate(ROWS):
        padding_mask[i, off : off + n] = 1
    if requires_grad:
        for t in (query, key, value):
            t.requires_grad_()
    return query, key, value, padding_mask


@pytest.mark.parametrize("impl", ["sdpa", "eager", "2d"])
def test_segments_from_hf_masks(impl):
    _, _, _, padding_mask = _padded_batch()
    mask = padding_mask if impl == "2d" else _hf_mask(impl, padding_mask)
    assert segments_from_attention_mask(mask, len(ROWS), T_PAD) == [[(off, off + n)] for off, n in ROWS]
    assert segments_from_attention_mask(None, 2, 5) == [[(0, 5)], [(0, 5)]]


def test_segments_of_packed_sequences():
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]])
    mask = _hf_mask("sdpa", None, position_ids=position_ids)
    assert segments_from_attention_mask(mask, 1, 12) == [[(0, 4), (4, 7), (7, 12)]]


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("impl", ["sdpa", "eager", "2d"])
def test_padded_batch_equals_unpadded_rows(impl):
    query, key, value, padding_mask = _padded_batch()
    mask = padding_mask if impl == "2d" else _hf_mask(impl, padding_mask)
    out, weights = hf_attention_interface(_Module(), query, key, value, mask, scaling=32**-0.5, dropout=0.0)
    assert weights is None
    assert out.shape == (len(ROWS), T_PAD, 4, 32) and out.is_contiguous()
    for i, (off, n) in enumerate(ROWS):
        sl = slice(off, off + n)
        alone = vllm_cpu_attention_forward(
            query[i, :, sl].transpose(0, 1),
            key[i, :, sl].transpose(0, 1),
            value[i, :, sl].transpose(0, 1),
            scale=32**-0.5,
            seq_lens=[n],
        )
        assert_bitwise(out[i, sl], alone)
        pad = torch.ones(T_PAD, dtype=torch.bool)
        pad[sl] = False
        assert bool((out[i, pad] == 0).all())


@pytest.mark.vllm
@needs_vllm
def test_hf_interface_passes_the_modules_scale():
    """The softmax scale is the module's (`scaling`: Gemma 3's `query_pre_attn_scalar**-0.5`, not `1/sqrt(D)`), passed
    to the kernel as given; `scaling=None` means `1/sqrt(D)`. The tests above pass `1/sqrt(D)` itself, which cannot
    tell the module's scale from the default."""
    query, key, value, padding_mask = _padded_batch()
    off, n = ROWS[3]
    row = [t[3, :, off : off + n].transpose(0, 1) for t in (query, key, value)]
    for scaling, scale in ((0.3, 0.3), (None, 32**-0.5)):
        out, _ = hf_attention_interface(_Module(), query, key, value, padding_mask, scaling=scaling)
        assert_bitwise(out[3, off : off + n], vllm_cpu_attention_forward(*row, scale=scale, seq_lens=[n]))
    assert not torch.equal(vllm_cpu_attention_forward(*row, scale=0.3, seq_lens=[n]),
                           vllm_cpu_attention_forward(*row, scale=32**-0.5, seq_lens=[n]))


@pytest.mark.vllm
@needs_vllm
def test_mask_changed_in_place_is_read_again():
    """The packing plan is cached per mask object; an in-place change of the mask invalidates it."""
    query, key, value, padding_mask = _padded_batch()
    mask = _hf_mask("sdpa", padding_mask)
    first, _ = hf_attention_interface(_Module(), query, key, value, mask, scaling=32**-0.5)
    again, _ = hf_attention_interface(_Module(), query, key, value, mask, scaling=32**-0.5)
    assert_bitwise(again, first)
    mask[0].copy_(torch.ones(T_PAD, T_PAD, dtype=torch.bool).tril())  # row 0 no longer padded
    changed, _ = hf_attention_interface(_Module(), query, key, value, mask, scaling=32**-0.5, num_threads=1)
    alone = vllm_cpu_attention_forward(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), scale=32**-0.5, seq_lens=[T_PAD]
    )
    assert_bitwise(changed[0], alone)
    assert_bitwise(changed[1:], first[1:])


@pytest.mark.vllm
@needs_vllm
def test_unpadded_batch_with_no_mask():
    query, key, value, _ = _padded_batch()
    out, _ = hf_attention_interface(_Module(), query, key, value, None, scaling=32**-0.5)
    for i in range(len(ROWS)):
        alone = vllm_cpu_attention_forward(
            query[i].transpose(0, 1), key[i].transpose(0, 1), value[i].transpose(0, 1), scale=32**-0.5, seq_lens=[T_PAD]
        )
        assert_bitwise(out[i], alone)


@pytest.mark.vllm
@needs_vllm
def test_padded_gradients_equal_unpadded_rows():
    query, key, value, padding_mask = _padded_batch(requires_grad=True)
    mask = _hf_mask("sdpa", padding_mask)
    out, _ = hf_attention_interface(_Module(), query, key, value, mask, scaling=32**-0.5)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(11)).bfloat16()
    out.backward(grad_out)
    for i, (off, n) in enumerate(ROWS):
        sl = slice(off, off + n)
        q, k, v = (t.detach()[i, :, sl].transpose(0, 1).contiguous().requires_grad_() for t in (query, key, value))
        vllm_cpu_attention(q, k, v, scale=32**-0.5, seq_lens=[n]).backward(grad_out[i, sl])
        for padded, alone in ((query, q), (key, k), (value, v)):
            assert_bitwise(padded.grad[i, :, sl].transpose(0, 1), alone.grad)
            pad = torch.ones(T_PAD, dtype=torch.bool)
            pad[sl] = False
            assert bool((padded.grad[i, :, pad] == 0).all())


@pytest.mark.vllm
@needs_vllm
def test_hf_model_padded_batch_equals_single_rows():
    """A whole Hugging Face model with the interface registered: real-token logits of a left/right
    padded batch (position ids starting at each row's first real token) equal each row run alone."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from trl_roundalign.local_models import tiny_model

    name = "vllm_cpu_test"
    AttentionInterface.register(name, hf_attention_interface)
    AttentionMaskInterface.register(name, sdpa_mask)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            tiny_model("qwen3"), dtype=torch.bfloat16, attn_implementation=name
        )
        model.eval()
        g = torch.Generator().manual_seed(12)
        rows = [(9, 5), (0, 12), (2, 9)]
        ids = torch.zeros(3, 14, dtype=torch.long)
        padding_mask = torch.zeros_like(ids)
        tokens = []
        for i, (off, n) in enumerate(rows):
            tokens.append(torch.randint(3, 500, (n,), generator=g))
            ids[i, off : off + n] = tokens[-1]
            padding_mask[i, off : off + n] = 1
        position_ids = (padding_mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=padding_mask, position_ids=position_ids).logits
            for i, (off, n) in enumerate(rows):
                assert_bitwise(logits[i, off : off + n], model(input_ids=tokens[i][None]).logits[0])
    finally:
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)


# ------------------------------------------------------------------------------------------------
# Bad inputs
# ------------------------------------------------------------------------------------------------


def test_bad_inputs_raise_before_vllm_is_needed():
    q, k, v = random_qkv([8], 4, 2, 32)
    with pytest.raises(ValueError, match="head_dim=48"):
        vllm_cpu_attention_forward(*random_qkv([8], 4, 2, 48), scale=0.1, seq_lens=[8])
    with pytest.raises(ValueError, match="sum to 9"):
        vllm_cpu_attention_forward(q, k, v, scale=0.1, seq_lens=[4, 5])
    with pytest.raises(ValueError, match="positive"):
        vllm_cpu_attention_forward(q, k, v, scale=0.1, seq_lens=[8, 0])
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        vllm_cpu_attention_forward(q[:, :3], k, v, scale=0.1, seq_lens=[8])
    with pytest.raises(ValueError, match="tokens, heads, head_dim"):
        vllm_cpu_attention_forward(q[None], k, v, scale=0.1, seq_lens=[8])
    with pytest.raises(ValueError, match="matching q"):
        vllm_cpu_attention_forward(q, k[:7], v[:7], scale=0.1, seq_lens=[8])
    with pytest.raises(TypeError, match="bf16"):
        vllm_cpu_attention_forward(q.float(), k.float(), v.float(), scale=0.1, seq_lens=[8])
    with pytest.raises(TypeError, match="same dtype"):
        vllm_cpu_attention_forward(q, k.half(), v.half(), scale=0.1, seq_lens=[8])


def test_a_window_that_covers_every_sequence_is_passed_to_the_kernel_and_masks_nothing():
    """Gemma 3's local layers: vLLM passes the window to the kernel; within it the output is full causal attention,
    bit for bit, and the gradient (full causal attention's) is the same function."""
    query, key, value, padding_mask = _padded_batch()
    module = _Module()
    full, _ = hf_attention_interface(module, query, key, value, padding_mask)
    import trl_roundalign.ops.attention as attention

    real, seen = attention.vllm_cpu_attention_forward, []

    def recording(*args, **kwargs):  # the real kernel call, with the window it was given recorded
        seen.append(kwargs["sliding_window"])
        return real(*args, **kwargs)

    attention.vllm_cpu_attention_forward = recording
    try:
        windowed, _ = hf_attention_interface(module, query, key, value, padding_mask, sliding_window=T_PAD)
    finally:
        attention.vllm_cpu_attention_forward = real
    assert seen == [T_PAD], seen  # the window reached the kernel call
    assert torch.equal(full, windowed)


def test_the_kernel_applies_the_window_it_is_given():
    """The window the package passes is one the kernel uses: shorter than a sequence, it changes exactly the rows
    that have keys outside it (so a window dropped on the way would be seen in the test above's recording, and a
    window the kernel ignored here)."""
    q, k, v = random_qkv([16], 4, 2, 32)
    full = vllm_cpu_attention_forward(q, k, v, scale=0.17, seq_lens=[16])
    windowed = vllm_cpu_attention_forward(q, k, v, scale=0.17, seq_lens=[16], sliding_window=5)
    same = (full == windowed).flatten(1).all(-1)
    # vLLM's window w: query i sees keys i-w+1..i (rows before w see their whole prefix)
    first_changed = int((~same).nonzero()[0])
    assert same[:first_changed].all() and not same[first_changed:].any(), same.tolist()
    assert first_changed == 5, first_changed  # query 5 is the first whose window (1..5) leaves out key 0


def test_hf_interface_rejects_unsupported_calls():
    query, key, value, padding_mask = _padded_batch()
    module = _Module()
    with pytest.raises(ValueError, match="dropout"):
        hf_attention_interface(module, query, key, value, None, dropout=0.1)
    with pytest.raises(ValueError, match="longer than this layer's sliding window"):
        hf_attention_interface(module, query, key, value, None, sliding_window=4)
    with pytest.raises(ValueError, match="causal attention only"):
        hf_attention_interface(module, query, key, value, None, is_causal=False)
    with pytest.raises(ValueError, match="no KV cache"):
        hf_attention_interface(module, query[:, :, :5], key, value, None)
    # a sliding-window mask, a bidirectional mask, an additive bias, padding in the middle
    causal = torch.ones(T_PAD, T_PAD, dtype=torch.bool).tril()
    window = causal & ~torch.ones(T_PAD, T_PAD, dtype=torch.bool).tril(-4)
    with pytest.raises(ValueError, match="sliding-window"):
        hf_attention_interface(module, query, key, value, window[None, None].expand(4, 1, -1, -1))
    with pytest.raises(ValueError, match="causal range"):
        hf_attention_interface(module, query, key, value, torch.ones(4, 1, T_PAD, T_PAD, dtype=torch.bool))
    bias = torch.zeros(4, 1, T_PAD, T_PAD).masked_fill(~causal, -math.inf) + 0.5 * causal
    with pytest.raises(ValueError, match="additive values"):
        hf_attention_interface(module, query, key, value, bias)
    holes = padding_mask.clone()
    holes[3, 10] = 0
    with pytest.raises(ValueError, match="padding between real tokens"):
        hf_attention_interface(module, query, key, value, holes)
    with pytest.raises(TypeError, match="BlockMask"):
        hf_attention_interface(module, query, key, value, object())
    with pytest.raises(ValueError, match="4D"):
        hf_attention_interface(module, query, key, value, torch.ones(4, T_PAD, T_PAD, dtype=torch.bool))


def test_missing_vllm_raises_clear_error(monkeypatch):
    import sys

    attn_mod._vllm_cpu_ops.cache_clear()
    monkeypatch.setitem(sys.modules, "vllm._custom_ops", None)
    try:
        assert not vllm_cpu_attention_available()
        q, k, v = random_qkv([8], 4, 2, 32)
        with pytest.raises(RuntimeError, match="vllm-cpu"):
            vllm_cpu_attention_forward(q, k, v, scale=0.1, seq_lens=[8])
    finally:
        monkeypatch.undo()
        attn_mod._vllm_cpu_ops.cache_clear()
