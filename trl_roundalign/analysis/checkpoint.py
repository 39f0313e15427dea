"""Checks on a checkpoint that the analysis commands make before building an engine."""

from __future__ import annotations

import os

__all__ = ["check_architecture"]


def check_architecture(model_path: str | os.PathLike) -> str:
    """The checkpoint's `model_type`, when trl_roundalign patches that architecture.

    Reads only the config (no weights, no engine), so a bad input fails in seconds.

    Raises:
        FileNotFoundError: no model config can be loaded from `model_path`.
        ValueError: an architecture trl_roundalign has no patch for; the message names the supported ones.
    """
    from transformers import AutoConfig

    from ..models import get_spec

    try:
        cfg = AutoConfig.from_pretrained(str(model_path))
    except OSError as exc:
        raise FileNotFoundError(f"Cannot load a model config from {str(model_path)!r}: {str(exc).splitlines()[0]}") from None
    model_type = getattr(cfg, "model_type", None) or ""
    get_spec(model_type)
    return model_type
