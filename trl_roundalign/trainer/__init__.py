"""The trainer side: TRL's GRPOTrainer with the policy rounded where the engine rounds.

- `grpo`: `RoundAlignGRPOTrainer` (and `check_trl_internals`), the drop-in subclass;
- `config`: `RoundAlignGRPOConfig`; `options`: every refusal that needs no engine;
- `startup_check`: the start-up profile check (colocated engine); `server_check`: the same against a vLLM server;
- `callbacks`: `MismatchCallback`; `logprobs`: TRL's fused LM head computed as vLLM's sampler does;
- `masters`: fp32 master weights and the FSDP2 policy; `lora`: lossless LoRA weight sync and the merged forward.

The trainer reads the engine's facts from `trl_roundalign.engine` and never the other way round.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "RoundAlignGRPOTrainer": "trl_roundalign.trainer.grpo",
    "check_trl_internals": "trl_roundalign.trainer.grpo",
    "RoundAlignGRPOConfig": "trl_roundalign.trainer.config",
    "MismatchCallback": "trl_roundalign.trainer.callbacks",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trl_roundalign.trainer.grpo' has no attribute {name!r}")
