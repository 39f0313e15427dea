"""`RoundAlignGRPOTrainer`: TRL's `GRPOTrainer` with the policy rounded where vLLM rounds.

A drop-in subclass. In `__init__` it:

1. checks the options (guard clauses with actionable errors) and that the TRL internals it relies
   on are where it expects them;
2. loads the policy in bf16 (unless the user chose a dtype), applies the vLLM-CPU weight-sync fix
   and builds the colocated engine with any extra engine options, in its own compile cache;
3. derives the rounding profile from the engine it built (`roundalign_profile="auto"`);
4. patches the policy (and the reference model) in place, before the first weight sync;
5. keeps fp32 master weights when the parameters are bf16 and nothing else does;
6. attaches `MismatchCallback`, fed with the training log-probs `_compute_loss` computes anyway.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import weakref

import torch
from trl import GRPOTrainer

from .. import __version__
from ..engine import (
    close_colocated_engine,
    engine_layout,
    exact_profile_for,
    inductor_reduction_lanes,
    profile_for_engine,
)
from ..engine.gemm import GemmSchedule
from ..engine.layout import LayoutMismatch, apply_to_policy, layout_differences, policy_facts
from ..models import takes_engine_lanes
from ..ops.sampled_forms import sampled_from
from ..patching import apply_roundalign, get_patch_report, restore_fp32_rope_frequencies
from ..profiles import is_exact
from .callbacks import MismatchCallback
from .config import RoundAlignGRPOConfig
from .engine_plan import engine_awake, plan_engine, rng_untouched
from .logprobs import install as install_sampler_logprobs
from .logprobs import sampler_logprobs
from .logprobs import supports as logprobs_supports
from .masters import MasterWeightsOptimizer, aligned_fsdp2_policy, distributed_precision, noop_comm_hook
from .old_logps import OLD_FROM_SAMPLER_KEY, OLD_FROM_SAMPLER_METRIC, reuses_sampler_logps, sampler_old_logps
from .options import check_dtypes, check_options
from .routing import ROUTES_KEY, install_routing_replay
from .unreproduced import (
    CUTS_KEY,
    REPREFILL_KEY,
    UNREPRODUCED_KEY,
    UnreproducedStep,
    reproduce_reprefills,
    row_cuts,
)

logger = logging.getLogger(__name__)

__all__ = ["RoundAlignGRPOTrainer"]

# TRL internals this trainer relies on, with the parameters it passes or reads (checked at init).
_TRL_HOOKS = {
    "_get_per_token_logps_and_entropies": ("model", "input_ids", "attention_mask", "logits_to_keep"),
    "_compute_loss": ("model", "inputs"),
    "_generate_and_score_completions": ("inputs",),
}


def check_trl_internals(cls=GRPOTrainer) -> None:
    """Raise if a TRL private method this trainer relies on moved or changed its signature."""
    import trl

    for name, params in _TRL_HOOKS.items():
        fn = getattr(cls, name, None)
        if fn is None:
            raise RuntimeError(
                f"trl {trl.__version__}: GRPOTrainer.{name} is gone. trl-roundalign {__version__} was built against "
                "trl 1.16; install trl==1.16.* or upgrade trl-roundalign."
            )
        have = list(inspect.signature(fn).parameters)[1:]
        if list(have[: len(params)]) != list(params):
            raise RuntimeError(
                f"trl {trl.__version__}: GRPOTrainer.{name}{tuple(have)} no longer takes {params} first; "
                "trl-roundalign was built against trl 1.16. Install trl==1.16.*."
            )


class RoundAlignGRPOTrainer(GRPOTrainer):
    """GRPO with rounding alignment; accepts exactly what `trl.GRPOTrainer` accepts.

    `args` should be a `RoundAlignGRPOConfig` (a plain `GRPOConfig` is upgraded with the defaults). After construction,
    `roundalign_profile`, `roundalign_report` (a `PatchReport`) and `roundalign_layout` say what was aligned to what.
    """

    # MismatchCallback.attach reads this: the trainer records the log-probs itself (no import of this class there).
    feeds_mismatch_callback = True

    def __init__(self, model, reward_funcs=None, args=None, *posargs, **kwargs):
        check_trl_internals()
        if isinstance(model, os.PathLike):
            model = os.fspath(model)  # a checkpoint directory, e.g. what `build_tiny_model` returns
        args = self._upgrade_args(model, args)
        check_options(model, args)  # trainer.options: every refusal that needs no engine
        self._check_tp_lora(model, args, kwargs.get("peft_config"))
        self._roundalign_capture = False
        self._roundalign_horizon = None  # exact mode's prompt limit (`startup_check.PromptHorizon`), set at start-up
        self._roundalign_schedule = None  # exact mode's schedule records per generation (`unreproduced.ScheduleCapture`)
        self._roundalign_reprefill = (None, None)  # the batch's re-prefill points and cuts while its log-probs are computed
        self._roundalign_routing = None  # routing replay (`trainer.routing`), with `roundalign_routing_replay`
        self._roundalign_generating = False
        # Exact mode's stand-in for TRL's old log-probs (`old_logps`): the sampler's log-probs, then whether they stood in
        self._roundalign_stand_in, self._roundalign_old_from_sampler = None, None
        self._roundalign_seen: dict[int, weakref.ref] = {}
        self._mismatch_callback: MismatchCallback | None = None

        # The engine's preparation, one decision (`engine_plan.plan_engine`); the engine's layout
        # (`engine.layout.EngineLayout`), read once it runs, is the home of every engine fact the policy reproduces.
        plan = plan_engine(model, args)
        colocate, planned_rows = plan.colocate, plan.gemm_schedule
        self.roundalign_layout = None
        self._roundalign_colocated = colocate
        self._roundalign_gemm_report = plan.gemm_report
        with plan.contexts():
            super().__init__(model, reward_funcs, args, *posargs, **kwargs)

        self.roundalign_verification = None
        self._roundalign_lanes = None
        try:
            if args.use_vllm and getattr(self, "vllm_generation", None) is not None:
                from .lora import install_lossless_peft_sync

                if install_lossless_peft_sync(self.vllm_generation):
                    logger.info("PEFT weight sync: merged weights computed out of place (the base weights stay bit-exact)")
                    if args.roundalign_lora_forward == "merged":
                        from .lora import install_merged_lora_forward

                        n = install_merged_lora_forward(self.model)
                        logger.info("LoRA forward: %d layers compute with the merged weight vLLM receives", n)
            if colocate:
                self.roundalign_layout = engine_layout(self.vllm_generation.llm)
                engine_rows = self._gemm_schedule
                if planned_rows is not None and engine_rows != planned_rows:
                    raise RuntimeError(
                        f"The colocated engine's linears compute with {engine_rows.describe()}, not the "
                        f"{planned_rows.describe()} decided for this run: something else loaded the engine's linears. "
                        "Build the trainer in a fresh process."
                    )
            elif args.use_vllm and args.vllm_mode == "server" and args.roundalign_regions:
                self.roundalign_layout = self._server_check().layout()[0]
            self._roundalign_sampler_logprobs = False
            if args.roundalign_regions:
                why_not = logprobs_supports(self.model)
                if why_not is None:
                    install_sampler_logprobs()  # TRL's fused LM head computes log-probs as vLLM's sampler does
                    self._roundalign_sampler_logprobs = True
                else:
                    logger.warning("log-probs: TRL's fused LM head, not the sampler's formula (%s)", why_not)
            self.roundalign_profile = self._resolve_profile()
            self._check_layout(fields=("dtype",))  # what the policy was loaded in, before anything is patched
            self.roundalign_report = self._install_patches()
            self._check_layout()  # the whole layout, read back from the patched policy
            if args.use_vllm and is_exact(self.roundalign_profile):
                if self.roundalign_engine is not None:  # the runtime prompt check, every rank, checked or not
                    from .startup_check import PromptHorizon

                    self._roundalign_horizon = PromptHorizon.for_engine(self.roundalign_layout, self.model,
                                                                        self._engine_block_size())
                from .server_exact import capture_schedules  # each request's schedule record, with every generation

                self._roundalign_schedule = capture_schedules(
                    self.vllm_generation, self.accelerator, stop=args.roundalign_stop_on_unreproduced,
                    server=getattr(self, "_roundalign_server", None))
            if args.roundalign_routing_replay:
                self._roundalign_routing = install_routing_replay(self)
            if args.roundalign_verify_profile:
                # Scoring the engine runs it and the policy: neither may move the random state the first generation
                # samples from, or turning alignment on would change what is sampled from step 1 on.
                with rng_untouched(), engine_awake(self):
                    self.roundalign_verification = self._verify_profile()
        except BaseException:
            self.close()  # the colocated engine is built by now; a failed trainer must not keep it
            raise
        if args.log_mismatch:
            log_file = args.mismatch_log_file or os.path.join(args.output_dir, "mismatch.jsonl")
            cb = MismatchCallback(log_file=log_file, run_info=self.roundalign_run_info())
            cb.attach(self)
            self.add_callback(cb)
            self._mismatch_callback = cb

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Shut the colocated vLLM engine down and free its memory (KV cache, weights, graphs); in server mode, close
        the weight-transfer group with the server's ranks (its socket and rendezvous store).

        Call it when you are done with the trainer (or use `with RoundAlignGRPOTrainer(...) as trainer:`), above all
        before building another trainer or engine in the same process: vLLM freezes the garbage collector when its
        engine starts, so a dropped trainer is otherwise never freed (about 1 GiB each on CPU, the KV cache), and a
        server-mode trainer's open group keeps the process waiting on peers that may be gone when it exits. The
        model, its patches and the saved outputs stay usable; training or generating again after `close()` is not
        possible. Does nothing when called twice."""
        close_colocated_engine(self)
        client = getattr(getattr(self, "vllm_generation", None), "vllm_client", None)
        if client is not None and getattr(client, "communicator", None) is not None:
            client.close_communicator()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def roundalign_engine(self):
        """The colocated engine's layout (`EngineLayout`); None in server mode (see `roundalign_layout`)."""
        return self.roundalign_layout if getattr(self, "_roundalign_colocated", False) else None

    @property
    def _gemm_schedule(self) -> GemmSchedule:
        """The GEMM schedule the engine's linears compute with, which the policy's reproduce."""
        layout = getattr(self, "roundalign_layout", None)
        return GemmSchedule(int(layout.gemm_block_rows or 0), int(layout.gemm_min_rows or 0)) if layout else GemmSchedule()

    @property
    def _tp(self) -> int:
        """The engine's tensor-parallel size the policy's row-parallel linears sum as (1 without aligned regions)."""
        layout = getattr(self, "roundalign_layout", None)
        if layout is None or not self.args.roundalign_regions:
            return 1
        return int(layout.tensor_parallel_size or 1)

    def _server_check(self):
        args = self.args
        if getattr(self, "_roundalign_server", None) is None:
            from .server_check import ServerCheck

            self._roundalign_server = ServerCheck(
                self.vllm_generation, args.vllm_server_base_url, getattr(self.model.config, "model_type", None)
            )
        return self._roundalign_server

    # ------------------------------------------------------------------ setup

    @staticmethod
    def _upgrade_args(model, args):
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            return RoundAlignGRPOConfig(output_dir=f"{str(name).rstrip('/').split('/')[-1]}-GRPO-roundalign")
        if isinstance(args, RoundAlignGRPOConfig):
            return args
        from trl import GRPOConfig

        if isinstance(args, GRPOConfig):
            return RoundAlignGRPOConfig.from_grpo_config(args)
        raise TypeError(f"args must be a RoundAlignGRPOConfig or a trl.GRPOConfig, got {type(args).__name__}.")

    @staticmethod
    def _check_tp_lora(model, args: RoundAlignGRPOConfig, peft_config) -> None:
        """LoRA on a row-parallel layer with a colocated TP > 1 engine: refused before anything loads (in server mode
        the server's TP size is known only from its /server_info, and `tp.install_tp_linears` refuses it there)."""
        from ..engine.tp import lora_targets_row_parallel, tp_lora_refusal

        tp = int(args.vllm_tensor_parallel_size or 1)
        if peft_config is None or tp <= 1 or not args.roundalign_regions or not args.use_vllm or args.vllm_mode != "colocate":
            return
        if isinstance(model, str):
            from transformers import AutoConfig

            model_type = getattr(AutoConfig.from_pretrained(model), "model_type", None)
        else:
            model_type = getattr(getattr(model, "config", None), "model_type", None)
        if layers := lora_targets_row_parallel(peft_config, model_type):
            raise ValueError(tp_lora_refusal(layers, tp))

    def _resolve_profile(self) -> str:
        args = self.args
        wants_exact = "attention" in args.roundalign_regions
        server = args.use_vllm and args.vllm_mode == "server"
        if args.roundalign_profile != "auto":
            if server and not args.roundalign_verify_profile:
                self.roundalign_layout = self._server_check().unverified_layout()
            if server and is_exact(args.roundalign_profile):
                self._server_check().require_exact(args.roundalign_profile)
            return args.roundalign_profile
        if not args.use_vllm:
            return "none"  # no engine to align with (regions are refused without one): HF's own rounding
        if server:  # what the server reports at /server_info (and /collective_rpc: its workers' facts)
            self.roundalign_layout = self._server_check().layout()[0]
            return self._server_check().profile(exact=wants_exact)
        # A TP > 1 engine passes where its layout is measured; the trainer then computes the TP form (_install_patches).
        profile = profile_for_engine(self.roundalign_engine, tensor_parallel=self._tp > 1)
        if wants_exact:
            if not self.roundalign_engine.compiled or self.roundalign_engine.platform != "cpu":
                raise ValueError(
                    "Exact mode (region 'attention') reproduces vLLM-CPU's compiled engine; this engine is "
                    f"{self.roundalign_engine.platform}/{profile}. Drop 'attention' from roundalign_regions."
                )
            profile = exact_profile_for(profile)
        return profile

    def _check_layout(self, fields=None) -> None:
        """The start-up comparison of the engine's layout, whole, with what the policy computes (read back from it):
        a field that differs stops the run with one line naming it and both values (`engine.layout.layout_differences`).
        Default BF16 (no regions) is the stock trainer and aligns nothing."""
        layout = self.roundalign_layout
        if not self.args.roundalign_regions:
            return
        if layout is not None:
            differences = layout_differences(layout, policy_facts(self.model), tensor_parallel=True, fields=fields)
            if differences:
                raise LayoutMismatch(differences[0])
        if self.args.use_vllm and fields is not None and "dtype" in fields:
            # The loaded policy's dtype against TRL's bf16/fp16 flags (check_options could not know it, e.g. "auto").
            check_dtypes(next(self.model.parameters()).dtype, self.args)

    def _engine_lanes(self):
        """The colocated engine's reduction lanes (read once), or None without a compiled vLLM-CPU engine."""
        info = self.roundalign_engine
        if self._roundalign_lanes is None and info is not None and info.compiled and info.platform == "cpu":
            self._roundalign_lanes = inductor_reduction_lanes(self.vllm_generation.llm)
        elif self._roundalign_lanes is None and info is None and self.roundalign_layout is not None:
            self._roundalign_lanes = self._server_check().lanes()  # as the server's workers read them
        return self._roundalign_lanes

    def _engine_block_size(self) -> int | None:
        """The engine's KV cache block size (selects vLLM-CPU's attention kernel path), from its layout."""
        return None if self.roundalign_layout is None else self.roundalign_layout.kv_block_size

    def _install_patches(self):
        args, lanes, source = self.args, None, None
        if self.roundalign_layout is not None and takes_engine_lanes(self.model, self.roundalign_profile):
            lanes, source = self._engine_lanes(), "engine"  # Gemma 4 reads its layer-0 form with them (any profile)
        targets = [self.model] + ([self.ref_model] if getattr(self, "ref_model", None) is not None else [])
        report, layout = None, self.roundalign_layout
        for target in targets:
            if restore_fp32_rope_frequencies(target):  # ZeRO-3's zero.Init loaded them in bf16
                logger.info("RoPE frequencies recomputed in fp32 (they were loaded in %s)", self.model.dtype)
            report_t = apply_roundalign(
                target,
                args.roundalign_regions,
                self.roundalign_profile,
                args.roundalign_backend,
                reduction_lanes=lanes,
                lanes_source=source,
                positions_from_mask=args.roundalign_positions_from_mask,
                attention_block_size=self._engine_block_size() if "attention" in args.roundalign_regions else None,
                engine_max_model_len=getattr(layout, "max_model_len", None),
                # A server's kernel threads are its own (a colocated engine computes with this process's).
                attention_threads=None if self._roundalign_colocated else getattr(layout, "attention_threads", None),
                gated_delta_net=getattr(layout, "gated_delta_net", None),
            )
            report = report or report_t
            apply_to_policy(target, self.roundalign_layout, tensor_parallel=self._tp)
        logger.info("RoundAlignGRPOTrainer: %s", report)
        if not self._gemm_schedule.plain:
            logger.info("linear layers: %s on both sides", self._gemm_schedule.describe())
        return report

    def _verify_profile(self):
        """Check the profile against the running engine (see `trl_roundalign.trainer.startup_check`); None when not checked."""
        args = self.args
        if not args.roundalign_regions:
            return None  # default BF16: nothing is aligned, so no profile to check
        if self.roundalign_engine is None:
            return self._verify_profile_server()
        from .startup_check import verify_on_main_process, weights_arrive_at_prepare, zero3_gathered

        if weights_arrive_at_prepare():  # the other processes hold placeholder weights until accelerate prepares
            return verify_on_main_process(self._verify_colocated)
        with zero3_gathered(self.model):
            return self._verify_colocated()

    def _verify_colocated(self):  # a passing verdict is kept per machine under all it depends on (`kept_check`)
        from .kept_check import colocated_key, kept_verification
        from .startup_check import verification_sequences

        llm = self.vllm_generation.llm
        sequences = verification_sequences(llm.get_tokenizer())
        key = colocated_key(self.roundalign_run_info(), llm, self.model, lanes=self._engine_lanes(), sequences=sequences)
        return kept_verification(key, lambda: self._check_colocated(llm, sequences))

    def _check_colocated(self, llm, sequences):
        args = self.args
        from ..scoring import vllm_prefill_logprobs
        from .sampler_check import llm_sampler, long_prompt_tokens, sequence_limit, verify_against_sampler
        from .startup_check import verify_profile

        engine_logps = vllm_prefill_logprobs(llm, sequences)
        lanes = self._engine_lanes() if self.roundalign_engine.compiled and self.roundalign_engine.platform == "cpu" else None
        try:
            result = verify_profile(
                self.model, engine_logps, sequences, chosen=self.roundalign_profile, regions=args.roundalign_regions,
                info=self.roundalign_engine, backend=args.roundalign_backend, lanes=lanes,
                attention_block_size=self._engine_block_size(),
            )
        finally:
            self.roundalign_report = self._install_patches()
        if is_exact(self.roundalign_profile):
            capture = self._roundalign_schedule  # the engine's record of the check's requests: their forms
            layout = self.roundalign_layout
            shared = long_prompt_tokens(self._engine_block_size(), getattr(layout, "max_num_batched_tokens", None),
                                        sequence_limit(self.model, getattr(layout, "max_model_len", None)))
            forms = None if capture is None else (lambda: list(zip(capture.generations[-1], capture.kinds[-1])))
            verify_against_sampler(self.model, llm_sampler(llm, forms), sequences, result, shared_tokens=shared,
                                   layout=layout)
            result.prompt_horizon = self._roundalign_horizon.tokens
        logger.info("profile %s verified in %.1f s (%d tokens; sampler: %d)", result.chosen, result.seconds, result.tokens,
                    result.sampler_tokens)
        return result

    def _verify_profile_server(self):
        """Server mode's start-up check (`server_check.ServerCheck.verify`) on the policy computing with the server's
        layout. The server may still hold another run's weights: push the policy's first (every process takes part, as
        before a generation), then score; the first step's generation need not push them again."""
        from .startup_check import broadcast_main_weights, weights_arrive_at_prepare, zero3_gathered

        args = self.args
        check = self._server_check()
        self.roundalign_layout = check.layout()[0]
        if weights_arrive_at_prepare():  # the other processes hold zeros until accelerate prepares; all of them score
            broadcast_main_weights(self.model)
        check.push_weights(self.model)  # TRL's push gathers each ZeRO-3 parameter itself (nested gathers are refused)
        self._last_loaded_step = self.state.global_step
        with zero3_gathered(self.model):
            self.roundalign_report = self._install_patches()  # the server's row blocks and TP sums on the policy
            tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
            try:
                result = check.verify(self.model, tokenizer, profile=self.roundalign_profile,
                                      regions=args.roundalign_regions, backend=args.roundalign_backend)
            finally:
                self.roundalign_report = self._install_patches()
            if is_exact(self.roundalign_profile):
                check.verify_weights(self.model, when="start-up, after the first push")
                check.verify_sampler(self.model, tokenizer, result)
        return result

    def roundalign_verify_server_weights(self):  # on demand, every process: `ServerCheck.verify_weights`

        return self._server_check().verify_weights(self.model)

    def roundalign_run_info(self) -> dict:
        """Versions, engine mode, profile and regions: the first line of the mismatch JSONL."""
        import transformers
        import trl

        info = {
            "trl_roundalign": __version__,
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "profile": self.roundalign_profile,
            "regions": list(self.args.roundalign_regions),
            "backend": self.args.roundalign_backend,
            "positions_from_mask": self.args.roundalign_positions_from_mask,
            "vllm_mode": self.args.vllm_mode if self.args.use_vllm else None,
            "importance_sampling_correction": bool(self.args.vllm_importance_sampling_correction),
            "model": getattr(self.model.config, "_name_or_path", None),
            "model_dtype": str(next(self.model.parameters()).dtype),
            "fp32_master_weights": self._uses_master_weights(),
        }
        if self.roundalign_layout is not None:  # the engine's whole layout, colocated engine or server
            info["engine"] = self.roundalign_layout.as_dict()
        info["logprobs"] = "vllm-sampler" if getattr(self, "_roundalign_sampler_logprobs", False) else "trl-fused-head"
        info["gemm"] = {
            "block_rows": self._gemm_schedule.block_rows,
            "min_rows": self._gemm_schedule.min_rows,
            "measured": self._roundalign_gemm_report.as_dict() if self._roundalign_gemm_report is not None else None,
        }
        info["tensor_parallel_size"] = self._tp  # >1: the row-parallel linears sum the engine's shards
        if self._tp > 1 and self.roundalign_layout is not None:  # the ranks' all-reduce transport, read from a worker
            info["all_reduce"] = self.roundalign_layout.all_reduce
        if self.roundalign_verification is not None:
            info["verification"] = self.roundalign_verification.as_dict()
        report = get_patch_report(self.model) if self.args.roundalign_regions or self.args.roundalign_positions_from_mask else None
        if report is not None:
            info["patched"] = report.as_dict()
        return info

    # ------------------------------------------------------------------ FSDP2

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        self._align_fsdp2_policy()

    def _align_fsdp2_policy(self) -> None:
        """Under FSDP2, replace accelerate's mixed-precision policy by `optim.aligned_fsdp2_policy` (logged).

        accelerate's policy casts every sharded decoder layer's inputs (and outputs) to bf16, which rounds the
        aligned layers' fp32 residual stream at each layer boundary; the replacement keeps the compute dtype,
        reduces gradients in fp32 and casts nothing at module boundaries. Runs before the model is prepared.
        """
        state = getattr(getattr(self, "accelerator", None), "state", None)
        if not getattr(state, "is_fsdp2", False) or not self.args.roundalign_regions:
            return
        plugin = state.fsdp_plugin
        before = plugin.mixed_precision_policy
        plugin.mixed_precision_policy = aligned_fsdp2_policy(before)
        logger.info("FSDP2 mixed precision for the aligned model: %s (was %s)", plugin.mixed_precision_policy, before)

    # ------------------------------------------------------------------ optimizer

    def _has_low_precision_params(self) -> bool:
        return any(p.dtype in (torch.bfloat16, torch.float16) for p in self.model.parameters() if p.requires_grad)

    def _uses_master_weights(self) -> bool:
        engine, _, _ = distributed_precision(getattr(self, "accelerator", None))
        return self._has_low_precision_params() and engine is None and self.args.roundalign_fp32_master_weights

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model) if "model" in inspect.signature(super().create_optimizer).parameters else super().create_optimizer()
        low = self._has_low_precision_params()
        # A second train() finds accelerate's AcceleratedOptimizer around the master optimizer: reuse it as it is.
        if not low or isinstance(getattr(optimizer, "optimizer", optimizer), MasterWeightsOptimizer):
            return optimizer
        engine, keeps, why = distributed_precision(getattr(self, "accelerator", None))
        if engine is not None:
            if keeps:
                logger.info("fp32 master weights: kept by %s (%s)", engine, why)
                return optimizer
            raise ValueError(
                f"The trainable parameters are bf16/fp16 and {why}: updates below half a bf16 ulp (most of them at lr "
                "1e-6) would round away. Train with mixed precision: bf16=True (accelerate --mixed_precision bf16), "
                "and for DeepSpeed a config with \"bf16\": {\"enabled\": \"auto\"}."
            )
        if not self.args.roundalign_fp32_master_weights:
            raise ValueError(
                "The trainable parameters are bf16/fp16 and no DeepSpeed/FSDP mixed precision keeps fp32 master "
                "weights: with roundalign_fp32_master_weights=False, updates below half an ulp (most of them at lr "
                "1e-6) round away. Set roundalign_fp32_master_weights=True or train under ZeRO/FSDP."
            )
        groups = [{k: v for k, v in g.items()} for g in optimizer.param_groups]
        self.optimizer = MasterWeightsOptimizer(groups, type(optimizer))
        logger.info("fp32 master weights: %d tensors, inner optimizer %s", len(self.optimizer.masters), type(optimizer).__name__)
        return self.optimizer

    def _master_optimizer(self) -> MasterWeightsOptimizer | None:
        opt = getattr(self, "optimizer", None)
        opt = getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps ours
        return opt if isinstance(opt, MasterWeightsOptimizer) else None

    def training_step(self, model, inputs, num_items_in_batch):
        opt = self._master_optimizer()
        if opt is not None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            if not getattr(model, "_roundalign_noop_hook", False):
                # The masters' fp32 gradients are averaged at step time; DDP's bf16 reduction would only move zeros.
                model.register_comm_hook(None, noop_comm_hook)
                model._roundalign_noop_hook = True
        return super().training_step(model, inputs, num_items_in_batch)

    def _loss_scaler(self):
        """The GradScaler accelerate's optimizer wrapper steps with (fp16 on an accelerator), else None.

        The masters hold loss-scaled gradients until it unscales them. The trainer clips the masters instead of
        calling accelerate's `clip_grad_norm_` (which unscales first), so the master optimizer unscales them itself.
        """
        return getattr(getattr(self, "optimizer", None), "scaler", None)

    def _clip_grad_norm(self, model):
        opt = self._master_optimizer()
        if opt is None:
            return super()._clip_grad_norm(model)
        return opt.clip_grad_norm_(self.args.max_grad_norm, scaler=self._loss_scaler())

    def _get_grad_norm(self, model, grad_norm=None):
        opt = self._master_optimizer()
        if opt is None or grad_norm is not None:
            return super()._get_grad_norm(model, grad_norm=grad_norm)
        return opt.clip_grad_norm_(float("inf"), scaler=self._loss_scaler())

    # ------------------------------------------------------------------ mismatch capture

    def _generate(self, prompts):
        out = super()._generate(prompts)
        if (share := getattr(self._roundalign_schedule, "share", None)) is not None:
            share()  # a server's records, from the main process's client to every process
        if self._roundalign_schedule is not None and reuses_sampler_logps(
                self.args, exact=is_exact(self.roundalign_profile), recorded=True):
            self._roundalign_stand_in = out[4]  # the sampler's log-probs, for TRL's old log-probs (`old_logps`)
        return out

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        sampling, self._roundalign_stand_in = self._roundalign_stand_in, None
        if sampling is not None and self._roundalign_generating and model is self.model:  # TRL's old log-probs, first
            codes = self._roundalign_schedule.codes(attention_mask[:, -int(logits_to_keep):])
            old = sampler_old_logps(sampling, codes, pad_to_multiple_of=self.pad_to_multiple_of, device=input_ids.device)
            self._roundalign_old_from_sampler = old is not None
            if old is not None:
                return old, None, None
        if self._roundalign_routing is not None:  # the engine's experts for these rows (`trainer.routing`)
            self._roundalign_routing.hold(input_ids, attention_mask, int(logits_to_keep), self._roundalign_generating)
        reprefill, cuts = self._schedule_of(input_ids.shape[0], int(logits_to_keep))
        main_cuts = None if cuts is None else [row_cuts(cuts, r, 0) for r in range(input_ids.shape[0])]
        out = self._logps_in_form(model, input_ids, attention_mask, logits_to_keep, *args, cuts=main_cuts, **kwargs)
        here = reprefill is not None and bool((reprefill > 0).any())
        if here or (self._roundalign_schedule is not None and self.accelerator.num_processes > 1):  # forwards agree
            entropy = bool(kwargs.get("compute_entropy", args[1] if len(args) > 1 else False))
            if here and any(kwargs.get(k) is not None for k in ("pixel_values", "token_type_ids", "mm_token_type_ids")):
                raise UnreproducedStep(
                    "Exact mode: the engine preempted and re-prefilled a multimodal request, and the trainer reproduces "
                    "re-prefills of text requests only. Give the engine enough KV cache for a step's sequences.")
            out = reproduce_reprefills(
                lambda ids, mask, keep, c: self._logps_in_form(model, ids, mask, keep, compute_entropy=entropy, cuts=c),
                input_ids, attention_mask, int(logits_to_keep), reprefill, out, cuts, accelerator=self.accelerator)
        if self._roundalign_capture:
            self._roundalign_captured = out[0].detach()
        return out

    def _logps_in_form(self, model, input_ids, attention_mask, logits_to_keep, *args, cuts=None, **kwargs):
        """TRL's log-probs, with the completions (the last `logits_to_keep` columns) in the engine's decode form and
        each row's prefill in the chunks `cuts` gives (`unreproduced.CUTS_KEY`)."""
        with contextlib.ExitStack() as scope:
            if getattr(self, "_roundalign_sampler_logprobs", False):
                scope.enter_context(sampler_logprobs(self._gemm_schedule))
            if "attention" in self.args.roundalign_regions and self.roundalign_layout is not None:
                # The completions (the last `logits_to_keep` columns) were sampled one decode step per token.
                column = input_ids.shape[1] - int(logits_to_keep)
                scope.enter_context(sampled_from(column, None if cuts is None or not any(cuts) else cuts))
                if (horizon := getattr(self, "_roundalign_horizon", None)) is not None:
                    horizon.check(attention_mask, column)
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

    def _schedule_of(self, rows: int, logits_to_keep: int):
        """`(re-prefill points, prefill cuts)` (`unreproduced.REPREFILL_KEY`, `CUTS_KEY`) of the rows whose log-probs
        are being computed: the training batch's (`_compute_loss`), or, while a batch is generated (TRL's old and
        reference log-probs), the generation's own; None for each where there are none."""
        reprefill, cuts = self._roundalign_reprefill
        if reprefill is None and self._roundalign_generating and self._roundalign_schedule is not None:
            reprefill = self._roundalign_schedule.reprefills((rows, logits_to_keep))
            cuts = self._roundalign_schedule.cuts(rows)
        if reprefill is None or tuple(reprefill.shape) != (rows, logits_to_keep):
            return None, None
        return reprefill, cuts if cuts is not None and cuts.shape[0] == rows else None

    def _generate_and_score_completions(self, inputs):
        """TRL's generation step; in exact mode the batch also carries, per completion token, whether the engine
        computed it in a form the trainer reproduces (`unreproduced.UNREPRODUCED_KEY`, from the engine's records)."""
        capture = self._roundalign_schedule
        if capture is not None:
            capture.reset()
        if self._roundalign_routing is not None:
            self._roundalign_routing.before_generation()
        self._roundalign_generating = True
        try:
            out = super()._generate_and_score_completions(inputs)
        finally:
            self._roundalign_generating = False
        if self._roundalign_routing is not None:
            self._roundalign_routing.annotate(out)
        stood_in, self._roundalign_old_from_sampler = self._roundalign_old_from_sampler, None
        if stood_in:
            out[OLD_FROM_SAMPLER_KEY] = torch.ones(len(out["completion_mask"]), device=out["completion_mask"].device)
        if capture is not None and self.model.training:
            for name, value in capture.schedule_metrics().items():
                self._metrics["train"][name].append(value)
            if stood_in is not None:
                self._metrics["train"][OLD_FROM_SAMPLER_METRIC].append(float(stood_in))
            out[UNREPRODUCED_KEY] = capture.codes(out["completion_mask"])
            reprefill, cuts = capture.reprefills(tuple(out["completion_mask"].shape)), capture.cuts(len(out["completion_mask"]))
            if reprefill is not None:
                out[REPREFILL_KEY] = reprefill.to(out["completion_mask"].device)
                out[CUTS_KEY] = cuts.to(out["completion_mask"].device)
        return out

    def _seen(self, t: torch.Tensor) -> bool:
        ref = self._roundalign_seen.get(id(t))
        return ref is not None and ref() is t

    def _compute_loss(self, model, inputs):
        cb = self._mismatch_callback
        sampling = inputs.get("sampling_per_token_logps")
        # Each generated batch is scored once, at the weights vLLM sampled with: with num_iterations > 1 the
        # same buffered inputs come back after updates (TRL then keeps old_per_token_logps from generation time).
        want = cb is not None and self.model.training and sampling is not None and not self._seen(sampling)
        # The loss forward's log-probs are the step's check where TRL's old log-probs are none or the sampler's own.
        own = inputs.get("old_per_token_logps") is None or OLD_FROM_SAMPLER_KEY in inputs
        self._roundalign_capture = want and own
        self._roundalign_captured = None
        self._roundalign_reprefill = (inputs.get(REPREFILL_KEY), inputs.get(CUTS_KEY))
        if self._roundalign_routing is not None:
            self._roundalign_routing.pending = inputs.get(ROUTES_KEY)
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._roundalign_capture = False
            self._roundalign_reprefill = (None, None)
        if self._roundalign_routing is not None and self.model.training:
            self._roundalign_routing.log(self._metrics["train"])
        if want:
            train_logps = self._roundalign_captured if own else inputs.get("old_per_token_logps")
            mask = inputs["completion_mask"]
            if "tool_mask" in inputs:
                mask = mask * inputs["tool_mask"]
            codes = inputs.get(UNREPRODUCED_KEY)  # exact mode's per-token schedule codes (`unreproduced`)
            cb.record(train_logps, sampling, mask, **({} if codes is None else {"unreproduced": codes}))
            self._roundalign_seen = {k: r for k, r in self._roundalign_seen.items() if r() is not None}
            self._roundalign_seen[id(sampling)] = weakref.ref(sampling)
        self._roundalign_captured = None
        return loss
