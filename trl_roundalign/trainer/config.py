"""`RoundAlignGRPOConfig`: TRL's `GRPOConfig` plus the rounding-alignment options.

Every field has `metadata={"help": ...}`, so it works from YAML (`TrlParser`) and `--help`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from trl import GRPOConfig

from ..profiles import PAPER_REGIONS, PROFILES, validate_regions

__all__ = ["RoundAlignGRPOConfig"]

logger = logging.getLogger(__name__)
_logged_cpu = False


def _has_accelerator() -> bool:
    """Whether torch sees a device Trainer would train on (CUDA/ROCm, XPU, MPS, NPU, HPU)."""
    if torch.cuda.is_available():
        return True
    for name in ("xpu", "npu", "hpu"):
        mod = getattr(torch, name, None)
        if mod is not None and getattr(mod, "is_available", lambda: False)():
            return True
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


@dataclass
class RoundAlignGRPOConfig(GRPOConfig):
    """GRPO configuration with rounding alignment.

    Differences from `trl.GRPOConfig`:

    - `vllm_importance_sampling_correction` defaults to **False**: the paper's condition is plain
      PPO-clipped GRPO with no mismatch correction (alignment removes the mismatch instead). Set it
      to True to combine both.
    - The policy loads in bf16 unless `model_init_kwargs["dtype"]` says otherwise (TRL loads fp32
      by default while vLLM serves bf16, which would measure the dtype gap, not rounding).
    - On a machine without an accelerator `use_cpu` is set (logged once): transformers otherwise
      refuses TRL's default `bf16=True` there.

    The new fields are listed below; each also has a `--help` line.
    """

    roundalign_regions: list[str] = field(
        default_factory=lambda: list(PAPER_REGIONS),
        metadata={
            "help": "Regions computed the engine's way: any of 'rope', 'swiglu', 'rmsnorm' (the paper's three; "
            "[] or ['none'] is the paper's default-BF16 condition, ['rope'] RoPE-only) plus 'attention' for the "
            "exact mode (with all three, profile 'auto' or an exact one: 'vllm-compiled-exact', "
            "'vllm-compiled-piecewise-exact')."
        },
    )
    roundalign_profile: str = field(
        default="auto",
        metadata={
            "help": "Rounding profile: 'auto' (derived from the vLLM engine the trainer builds: version, compile "
            "mode and splitting ops, custom ops, IR op priority, enforce_eager, platform, torch) or one of "
            f"{', '.join(PROFILES)}. Checked against the engine at start-up (roundalign_verify_profile)."
        },
    )
    roundalign_backend: str | None = field(
        default=None,
        metadata={
            "help": "Kernel backend: 'triton', 'torch' (exact PyTorch reference) or None (Triton on CUDA, "
            "the reference elsewhere)."
        },
    )
    roundalign_positions_from_mask: bool = field(
        default=True,
        metadata={
            "help": "Derive RoPE positions from the attention mask as vLLM numbers tokens (TRL left-pads prompts and "
            "passes no positions). Applies to every condition, including [] (so conditions differ only in rounding)."
        },
    )
    roundalign_fp32_master_weights: bool = field(
        default=True,
        metadata={
            "help": "With bf16/fp16 parameters and no DeepSpeed/FSDP mixed precision, keep fp32 master weights in "
            "the optimizer (the forward stays on the bf16 copies, so it stays aligned). False refuses to train in "
            "that setting, since updates at lr 1e-6 round away in bf16."
        },
    )
    roundalign_gemm_block_rows: str = field(
        default="auto",
        metadata={
            "help": "How the linear layers compute, on both sides (trl_roundalign.engine.gemm): 'auto' measures this machine's "
            "GEMM for the model's shapes at start-up and, where it is batch-variant, computes every linear on the engine "
            "and the trainer with a row floor (calls of fewer rows zero-padded, where only the smallest row counts "
            "differ: AMD AVX-512) or in fixed blocks of 64 rows (Intel AMX); a number sets row blocks; 0 keeps plain "
            "F.linear (exact mode then refuses where the GEMM is batch-variant). Colocated vLLM-CPU engines only."
        },
    )
    roundalign_verify_profile: bool = field(
        default=True,
        metadata={
            "help": "At start-up, score a few short sequences on the engine and on the policy under the profile and the "
            "other candidates; stop with an error naming the better profile if another matches the engine clearly "
            "better (exact mode: anything short of 100%% bit-identical; a vLLM-CPU server in server mode: any rival "
            "with a lower k3, exact profiles refused there). The result goes into mismatch.jsonl's header."
        },
    )
    roundalign_stop_on_unreproduced: bool = field(
        default=False,
        metadata={
            "help": "Exact mode: stop the run, in one line naming the cause and what to change, at the first batch whose "
            "completion tokens include some the engine computed in a form the trainer does not reproduce (a preempted "
            "request resumed by a chunk or a cached prefix, a chunked prefill, a prefix-cache hit: by the engine's own "
            "per-request schedule record). Off: warned once per cause and counted every step in "
            "mismatch/unreproduced_tokens."
        },
    )
    roundalign_routing_replay: bool = field(
        default=False,
        metadata={
            "help": "MoE models (Qwen3-MoE): the colocated vLLM-CPU engine records which experts its routers chose for "
            "each token, and the trainer's routers take those experts in every log-prob forward (their logits still "
            "get the gradient), so each token's log-prob goes through the experts that sampled it. Logged per step: "
            "routing/differs (the share of token-layer choices where the trainer's own router chose other experts) "
            "and routing/unrecorded_tokens (tokens that kept the trainer's choice). Under the exact profile the "
            "routers already agree (routing/differs 0)."
        },
    )
    roundalign_reuse_sampler_logps: bool = field(
        default=True,
        metadata={
            "help": "Exact mode: where TRL computes old log-probs at generation (importance-sampling correction on, "
            "num_iterations > 1, or steps_per_generation not dividing the accumulation), the sampler's log-probs stand "
            "in for that forward, bit for bit, on a batch whose every completion token the engine's schedule record "
            "says the trainer reproduces (any other batch takes the forward; schedule/old_logps_from_sampler says "
            "which). Off: TRL's forward on every batch."
        },
    )
    roundalign_lora_forward: str = field(
        default="merged",
        metadata={
            "help": "With a PEFT LoRA policy: 'merged' computes each LoRA layer with the merged weight vLLM receives "
            "(r(W + s B A), one GEMM; needs lora_dropout=0), 'peft' keeps PEFT's W x + s B(A x)."
        },
    )
    log_mismatch: bool = field(
        default=True,
        metadata={"help": "Attach MismatchCallback: log the train/inference log-prob mismatch every optimizer step."},
    )
    mismatch_log_file: str | None = field(
        default=None,
        metadata={"help": "JSONL file for the per-step mismatch rows (default: <output_dir>/mismatch.jsonl)."},
    )
    vllm_engine_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Extra keyword arguments for the colocated vllm.LLM that TRL does not expose, as a dict or JSON: "
            "e.g. {\"enforce_eager\": true}, {\"compilation_config\": {...}}, {\"dtype\": \"float16\"}, "
            "{\"hf_overrides\": {...}}."
        },
    )
    vllm_importance_sampling_correction: bool = field(
        default=False,
        metadata={
            "help": "Importance-sampling correction of the vLLM/trainer mismatch (TRL's option). Off here: the paper's "
            "condition is plain PPO-clipped GRPO; alignment removes the mismatch instead."
        },
    )

    @classmethod
    def from_grpo_config(cls, config: GRPOConfig, **overrides) -> RoundAlignGRPOConfig:
        """A `RoundAlignGRPOConfig` with every field of a plain `trl.GRPOConfig`, and the alignment defaults.

        The GRPO fields keep the values the given config holds, including TRL's
        `vllm_importance_sampling_correction` (True by default there; this class defaults to False, the
        paper's condition), which is logged. `generation_batch_size` is re-derived from
        `steps_per_generation`, as TRL derives one from the other. `overrides` set any field.
        """
        from dataclasses import fields

        values = {f.name: getattr(config, f.name) for f in fields(GRPOConfig) if f.init and hasattr(config, f.name)}
        values["generation_batch_size"] = None  # derived again from steps_per_generation
        values.pop("vllm_importance_sampling_cap", None)  # deprecated alias, already copied into clip_max
        for key in ("logging_dir",):  # filled in by TrainingArguments from output_dir when unset
            values.pop(key, None)
        values.update(overrides)
        upgraded = cls(**values)
        logger.warning(
            "A plain trl.GRPOConfig was upgraded to RoundAlignGRPOConfig (regions %s, profile %s); "
            "vllm_importance_sampling_correction=%s is kept from it.",
            upgraded.roundalign_regions,
            upgraded.roundalign_profile,
            upgraded.vllm_importance_sampling_correction,
        )
        return upgraded

    def __post_init__(self):
        if isinstance(self.roundalign_regions, str):
            self.roundalign_regions = [r for r in self.roundalign_regions.replace(",", " ").split() if r]
        regions = [r for r in (self.roundalign_regions or []) if r.lower() != "none"]
        self.roundalign_regions = list(validate_regions(regions))
        if self.roundalign_profile != "auto" and self.roundalign_profile not in PROFILES:
            raise ValueError(
                f"roundalign_profile={self.roundalign_profile!r} is unknown; use 'auto' or one of {', '.join(PROFILES)}."
            )
        if self.roundalign_lora_forward not in ("merged", "peft"):
            raise ValueError(f"roundalign_lora_forward={self.roundalign_lora_forward!r}: use 'merged' or 'peft'.")
        rows = str(self.roundalign_gemm_block_rows).strip().lower()
        if rows != "auto" and not (rows.isdigit()):
            raise ValueError(
                f"roundalign_gemm_block_rows={self.roundalign_gemm_block_rows!r}: use 'auto' or a whole number of rows "
                "(0: plain F.linear)."
            )
        self.roundalign_gemm_block_rows = rows if rows == "auto" else str(int(rows))
        if self.roundalign_backend in ("none", "None", ""):
            self.roundalign_backend = None
        if self.roundalign_backend not in (None, "triton", "torch"):
            raise ValueError(f"roundalign_backend={self.roundalign_backend!r}: use 'triton', 'torch' or None.")
        if isinstance(self.vllm_engine_kwargs, str):
            try:
                self.vllm_engine_kwargs = json.loads(self.vllm_engine_kwargs)
            except json.JSONDecodeError as exc:
                raise ValueError(f"vllm_engine_kwargs is not valid JSON: {exc}") from None
        if self.vllm_engine_kwargs is not None and not isinstance(self.vllm_engine_kwargs, dict):
            raise ValueError("vllm_engine_kwargs must be a dict (or a JSON object string).")
        if isinstance(self.model_init_kwargs, str):
            self.model_init_kwargs = json.loads(self.model_init_kwargs)
        self.model_init_kwargs = dict(self.model_init_kwargs or {})
        if "torch_dtype" in self.model_init_kwargs and "dtype" not in self.model_init_kwargs:
            self.model_init_kwargs["dtype"] = self.model_init_kwargs.pop("torch_dtype")
        self.model_init_kwargs.setdefault("dtype", "bfloat16")
        if not self.use_cpu and not _has_accelerator():
            global _logged_cpu
            self.use_cpu = True
            if not _logged_cpu:
                logger.warning("No GPU or other accelerator found: training on the CPU (use_cpu=True).")
                _logged_cpu = True
        super().__post_init__()
