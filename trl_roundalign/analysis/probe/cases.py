"""The probe's test cases: for each region, random bf16 inputs of the model's shapes, the engine's
module call, and the reference (`trl_roundalign.ops`) under any profile."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ... import ops
from .modules import Shapes, method_name, with_weight


@dataclass
class Case:
    region: str
    engine_fn: Callable[..., dict[str, torch.Tensor]]
    inputs: tuple
    dynamic: tuple[int, ...]  # indices of inputs whose dim 0 is the token dim
    reference: Callable[[str, int | None], dict[str, torch.Tensor]]
    path: str
    shape: list[int]
    # Readings no profile implements, `{name: (description, outputs)}`: named in the warning when one
    # of them, and no profile, reproduces the engine.
    diagnostics: Callable[[], dict[str, tuple[str, dict[str, torch.Tensor]]]] | None = None


def _rand(gen: torch.Generator, *shape: int, scale: float = 2.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)


def _weight(gen: torch.Generator, n: int) -> torch.Tensor:
    return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(torch.bfloat16)


def _hf_cos_sin(rope_module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's bf16 cos/sin table rows, in Hugging Face's layout (`[T, 1, rotary_dim]`, halves duplicated)."""
    cache = rope_module.cos_sin_cache.detach().cpu().to(torch.bfloat16)
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)
    return torch.cat((cos, cos), -1)[:, None, :], torch.cat((sin, sin), -1)[:, None, :]


def build_cases(
    mods: dict[str, torch.nn.Module], shapes: Shapes, rows: int, seed: int, compiled: bool
) -> tuple[list[Case], dict[str, str]]:
    gen = torch.Generator().manual_seed(seed)
    skipped: dict[str, str] = {}
    cases: list[Case] = []
    how = "torch.compile (Inductor)" if compiled else "eager"
    T, H, eps = rows, shapes.hidden, shapes.eps

    # RMSNorm without residual (layer-0 input norm).
    norm = mods.get("norm")
    if norm is None:
        skipped["rms_norm"] = skipped["add_rms_norm"] = "the engine's model has no vLLM RMSNorm input_layernorm"
    else:
        w = _weight(gen, H)
        norm_w = with_weight(norm, w)
        x = _rand(gen, T, H)

        def rms_engine(x, _m=norm_w):
            return {"out": _m(x.clone())}

        def rms_ref(profile, lanes, x=x, w=w):
            return {"out": ops.rms_norm(x, w, eps, profile=profile, backend="torch", reduction_lanes=lanes)}

        path = f"{type(norm).__name__}.{method_name(norm)} -> vllm.ir rms_norm, {how}"
        cases.append(Case("rms_norm", rms_engine, (x,), (0,), rms_ref, path, [T, H]))

        # Fused residual add + RMSNorm: both outputs.
        w2 = _weight(gen, H)
        norm_w2 = with_weight(norm, w2)
        h, res = _rand(gen, T, H), _rand(gen, T, H, scale=4.0)

        def add_engine(h, res, _m=norm_w2):
            out, new_res = _m(h.clone(), res.clone())
            return {"out": out, "residual": new_res}

        def add_ref(profile, lanes, h=h, res=res, w=w2):
            out, new_res = ops.add_rms_norm(h, res, w, eps, profile=profile, backend="torch", reduction_lanes=lanes)
            return {"out": out, "residual": new_res}

        def add_diagnostics(h=h, res=res, w=w2):
            s = res.float() + h.float()  # the unrounded fp32 sum
            xhat = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
            out = (w.float() * xhat.to(torch.bfloat16).float()).to(torch.bfloat16)
            return {
                "hf-norm-of-fp32-sum": (
                    "residual r(s), output r(f(w) * f(r(x̂(s)))) with x̂ taken from the UNROUNDED fp32 sum "
                    "s = f(x) + f(residual)",
                    {"out": out, "residual": s.to(torch.bfloat16)},
                )
            }

        path = f"{type(norm).__name__}.{method_name(norm)}(x, residual) -> vllm.ir fused_add_rms_norm, {how}"
        cases.append(
            Case("add_rms_norm", add_engine, (h, res), (0, 1), add_ref, path, [T, H], diagnostics=add_diagnostics)
        )

    # SwiGLU.
    act = mods.get("act")
    if act is None:
        skipped["swiglu"] = "the engine's model has no vLLM SiluAndMul"
    else:
        inter = shapes.intermediate
        gate, up = _rand(gen, T, inter), _rand(gen, T, inter)
        gate_up = torch.cat((gate, up), dim=-1)

        def act_engine(gu, _m=act):
            return {"out": _m(gu.clone())}

        def act_ref(profile, lanes, gate=gate, up=up):
            return {"out": ops.swiglu(gate, up, profile=profile, backend="torch")}

        path = f"SiluAndMul.{method_name(act)}, {how}"
        cases.append(Case("swiglu", act_engine, (gate_up,), (0,), act_ref, path, [T, 2 * inter]))

    # RoPE and Qwen3's q/k-norm + RoPE.
    rope = mods.get("rope")
    rope_ok = rope is not None and getattr(rope, "is_neox_style", False) and hasattr(rope, "cos_sin_cache")
    if rope is None:
        skipped["rope"] = skipped["qk_norm_rope"] = "the engine's model has no vLLM RotaryEmbedding"
    elif not rope_ok:
        skipped["rope"] = skipped["qk_norm_rope"] = (
            f"{type(rope).__name__} is not a neox-style RoPE with a cos/sin cache: no reference for it"
        )
    elif rows > rope.cos_sin_cache.shape[0]:
        skipped["rope"] = skipped["qk_norm_rope"] = (
            f"rows={rows} exceeds the RoPE table ({rope.cos_sin_cache.shape[0]} positions)"
        )
    else:
        D, nq, nkv = shapes.head_dim, shapes.heads, shapes.kv_heads
        positions = torch.arange(T, dtype=torch.long)
        cos, sin = _hf_cos_sin(rope, positions)
        q, k = _rand(gen, T, nq * D), _rand(gen, T, nkv * D)

        def rope_engine(pos, q, k, _m=rope):
            qo, ko = _m(pos, q.clone(), k.clone())
            return {"q": qo, "k": ko}

        def rope_ref(profile, lanes, q=q, k=k):
            return {
                "q": ops.rope(q.view(T, nq, D), cos, sin, profile=profile, backend="torch").reshape(T, nq * D),
                "k": ops.rope(k.view(T, nkv, D), cos, sin, profile=profile, backend="torch").reshape(T, nkv * D),
            }

        path = f"{type(rope).__name__}.{method_name(rope)}, {how}"
        cases.append(Case("rope", rope_engine, (positions, q, k), (0, 1, 2), rope_ref, path, [T, nq * D]))

        if not shapes.qk_norm:
            skipped["qk_norm_rope"] = f"model type {shapes.model_type!r} has no q/k-norm"
        elif "q_norm" not in mods or "k_norm" not in mods:
            skipped["qk_norm_rope"] = "the engine's model has no q_norm/k_norm RMSNorm"
        else:
            wq, wk = _weight(gen, D), _weight(gen, D)
            q_norm, k_norm = with_weight(mods["q_norm"], wq), with_weight(mods["k_norm"], wk)
            q2, k2 = _rand(gen, T, nq * D), _rand(gen, T, nkv * D)

            def qk_engine(pos, q, k, _qn=q_norm, _kn=k_norm, _rope=rope):
                # As vLLM's Qwen3Attention.forward: per-head norm, view back, rotary embedding.
                qh = _qn(q.view(*q.shape[:-1], q.shape[-1] // D, D)).view(q.shape)
                kh = _kn(k.view(*k.shape[:-1], k.shape[-1] // D, D)).view(k.shape)
                qo, ko = _rope(pos, qh, kh)
                return {"q": qo, "k": ko}

            def qk_ref(profile, lanes, q=q2, k=k2):
                return {
                    "q": ops.qk_norm_rope(
                        q.view(T, nq, D), wq, eps, cos, sin, profile=profile, backend="torch", reduction_lanes=lanes
                    ).reshape(T, nq * D),
                    "k": ops.qk_norm_rope(
                        k.view(T, nkv, D), wk, eps, cos, sin, profile=profile, backend="torch", reduction_lanes=lanes
                    ).reshape(T, nkv * D),
                }

            path = (
                f"RMSNorm.{method_name(mods['q_norm'])} per head + {type(rope).__name__}.{method_name(rope)}, {how}"
            )
            cases.append(Case("qk_norm_rope", qk_engine, (positions, q2, k2), (0, 1, 2), qk_ref, path, [T, nq * D]))
    return cases, skipped
