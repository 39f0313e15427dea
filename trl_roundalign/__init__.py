"""trl-roundalign: round the trainer where the inference engine rounds.

Public API (imported lazily: importing the package starts neither vLLM nor TRL):

- `apply_roundalign`, `revert_roundalign`, `PatchReport`: patch models of the registered families (`models.ARCH_SPECS`).
- `RoundAlignGRPOTrainer`, `RoundAlignGRPOConfig`, `MismatchCallback`: the TRL front door.
- `trl_roundalign.ops`: the aligned regions (Triton kernels and exact PyTorch references).
- `trl_roundalign.profiles`: the rounding contract.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

_LAZY = {
    "apply_roundalign": "trl_roundalign.patching",
    "revert_roundalign": "trl_roundalign.patching",
    "get_patch_report": "trl_roundalign.patching",
    "PatchReport": "trl_roundalign.patching",
    "PROFILES": "trl_roundalign.profiles",
    "PAPER_REGIONS": "trl_roundalign.profiles",
    "ALL_REGIONS": "trl_roundalign.profiles",
    "RoundAlignGRPOConfig": "trl_roundalign.trainer.config",
    "RoundAlignGRPOTrainer": "trl_roundalign.trainer.grpo",
    "MismatchCallback": "trl_roundalign.trainer.callbacks",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trl_roundalign' has no attribute {name!r}")


def __dir__():
    return __all__


# Modules that moved into the `trainer/` and `engine/` packages (and `analysis.scoring` below both): their old paths
# import the same module object, so code and docs written against them keep working.
_MOVED = {
    "config": "trainer.config",
    "options": "trainer.options",
    "callbacks": "trainer.callbacks",
    "verify": "trainer.startup_check",
    "verify_server": "trainer.server_check",
    "logprobs": "trainer.logprobs",
    "optim": "trainer.masters",
    "lora": "trainer.lora",
    "_compat": "engine.dispatch",
    "gemm": "engine.gemm",
    "tp": "engine.tp",
    "analysis.scoring": "scoring",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix(__name__ + ".")
        if old == fullname or old not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(f"{__name__}.{_MOVED[spec.name.removeprefix(__name__ + '.')]}")
        spec.loader_state = module.__spec__  # the import system is about to overwrite it with `spec`
        return module

    def exec_module(self, module):
        # The module ran under its own name. Give it back its own spec: one naming the old path makes every relative
        # import inside it warn (ImportWarning: __package__ != __spec__.parent), an error under warnings-as-errors.
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())
