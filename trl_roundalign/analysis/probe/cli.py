"""`trl-roundalign probe`'s entry point (the parser is `trl_roundalign.cli`)."""

from __future__ import annotations

from .report import format_report
from .run import probe


def run_probe_cli(args) -> dict:
    """`trl-roundalign probe`: print the tables and return the report as a JSON-able dict.

    The model is resolved and its architecture checked before any engine is built (`probe`), so a bad
    name or an unsupported checkpoint ends in one line within seconds.
    """
    from ...engine import engine_kwargs_from

    if args.rows < 1:
        raise ValueError(f"--rows must be at least 1, got {args.rows}.")
    kw = engine_kwargs_from(
        args.enforce_eager, args.max_model_len, args.gpu_memory_utilization, args.custom_ops, args.piecewise
    )
    kw["use_tqdm_on_load"] = bool(getattr(args, "verbose", False))  # the weight-loading bar: --verbose only
    report = probe(args.model, rows=args.rows, seed=args.seed, model_check=not args.no_model_check, **kw)
    print(format_report(report), flush=True)
    return report.as_dict()
