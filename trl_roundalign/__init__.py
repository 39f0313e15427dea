"""trl-roundalign: round the trainer where the inference engine rounds.

Public API (imported lazily: importing the package starts neither vLLM nor TRL):

- `apply_roundalign`, `revert_roundalign`, `PatchReport`: patch models of the registered families (`models.ARCH_SPECS`).
- `RoundAlignGRPOTrainer`, `RoundAlignGRPOConfig`, `MismatchCallback`: the TRL front door.
- `trl_roundalign.ops`: the aligned regions (Triton kernels and exact PyTorch references).
- `trl_roundalign.profiles`: the rounding contract.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "apply_roundalign": "trl_roundalign.patching",
    "revert_roundalign": "trl_roundalign.patching",
    "get_patch_report": "trl_roundalign.patching",
    "PatchReport": "trl_roundalign.patching",
    "PROFILES": "trl_roundalign.profiles",
    "PAPER_REGIONS": "trl_roundalign.profiles",
    "ALL_REGIONS": "trl_roundalign.profiles",
    "RoundAlignGRPOConfig": "trl_roundalign.config",
    "RoundAlignGRPOTrainer": "trl_roundalign.trainer",
    "MismatchCallback": "trl_roundalign.callbacks",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trl_roundalign' has no attribute {name!r}")


def __dir__():
    return __all__
