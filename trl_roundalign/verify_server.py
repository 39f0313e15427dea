"""Server mode's start-up check: the policy's log-probs against a vLLM server's, under the profile and its rivals.

Split from `trainer.py`; `verify_server_profile(trainer, args)` is `RoundAlignGRPOTrainer._verify_profile_server`.
"""

from __future__ import annotations

import logging

from .gemm import install_row_blocked_linears
from .profiles import is_exact
from .tp import install_tp_linears

logger = logging.getLogger("trl_roundalign.trainer")  # the trainer's log, where users (and tests) read the check


def verify_server_profile(trainer, args):
    """Server mode: score the server's prompt log-probs against the profile and its alternatives.

    The server reports its configuration at `/server_info` (platform, compile mode, versions), which decides
    the candidates. Its reduction lanes (its compile cache, in another process) are not known, so exact
    profiles are refused here rather than checked against lanes guessed on this side.
    """
    from .engine import EXACT_REFINEMENTS
    from .verify import (
        ALL_BASE_CANDIDATES,
        CLEARLY_BETTER,
        STRICTLY_BETTER,
        ProfileMismatch,
        broadcast_from_main,
        engine_self_k3,
        server_prompt_logprobs,
        verification_sequences,
        verify_profile,
    )

    client = getattr(trainer.vllm_generation, "vllm_client", None)  # the main process's only
    url = client.base_url if client is not None else args.vllm_server_base_url
    if is_exact(trainer.roundalign_profile):
        raise ProfileMismatch(
            f"roundalign_profile={trainer.roundalign_profile!r} is exact, which needs the engine's reduction lanes, read "
            f"from its Inductor code; the vLLM server at {url} compiles in its own process and cache, so they cannot "
            f"be read here. Use colocate mode for exact profiles, or "
            f"roundalign_profile='{EXACT_REFINEMENTS.get(trainer.roundalign_profile, 'vllm-compiled')}' without the "
            "'attention' region in server mode."
        )
    # The server may still hold another run's weights: push the policy's first (every process takes part, as
    # before a generation), then score. The first step's generation need not push them again.
    trainer.vllm_generation.sync_weights()
    trainer._last_loaded_step = trainer.state.global_step
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    sequences = verification_sequences(tokenizer)
    info, about, url = read_server_info(trainer, args)
    if about.startswith("request failed: "):  # every process stops alike with the main process's line
        raise RuntimeError(f"The server-mode start-up check could not query the vLLM server at {url}: "
                           f"{about[len('request failed: '):]}")  # fmt: skip
    payload, failure, interrupted = [None], None, None
    if client is not None:
        try:
            batched = server_prompt_logprobs(client, sequences)
            # The same sequences one request each: how far the engine disagrees with itself (its noise margin).
            single = [server_prompt_logprobs(client, [seq])[0] for seq in sequences]
            payload = [(batched, single)]
        except Exception as e:  # noqa: BLE001 - broadcast, so that no process waits for a payload that never comes
            failure = e
            why = " ".join(f"{type(e).__name__}: {e}".split())
            payload = [f"The server-mode start-up check could not query the vLLM server at {url}: {why}"]
        except BaseException as e:  # Ctrl-C or SystemExit while waiting for the server: every process exits with it
            interrupted = e
    # every process scores (and stops) alike
    payload = [broadcast_from_main(payload, interrupted)]
    if isinstance(payload[0], str):  # the main process's request failed: every process stops with its line
        raise RuntimeError(payload[0]) from failure
    engine_logps, engine_single = payload[0]
    noise = engine_self_k3(engine_logps, engine_single)
    # The server's row blocks and TP sums, on the policy before it is scored (the scoring re-patches the regions).
    rows_before = trainer._roundalign_gemm_rows
    follow_server_layout(trainer, info, url)
    rows = trainer._roundalign_gemm_rows
    for target in _targets(trainer):
        if rows != rows_before:
            install_row_blocked_linears(target, rows)
        if trainer._roundalign_tp > 1:  # after the row blocks, whose forward it replaces on o_proj/down_proj
            install_tp_linears(target, trainer._roundalign_tp, rows)
    if info is None:
        candidates, note = list(ALL_BASE_CANDIDATES), f" The server's platform is unknown: {about}."
        logger.warning(
            "The vLLM server at %s does not say which platform it runs (%s): the profile %r is scored against "
            "every base profile.", url, about, trainer.roundalign_profile,
        )
    else:
        candidates, note = None, f" The vLLM server at {url} runs {about}."
    # Where colocate mode decides by the exact refinements (vLLM-CPU) no exact check is possible here: any
    # strictly better candidate refutes the profile. Elsewhere (a GPU server) the evidence is colocate mode's.
    ratio = CLEARLY_BETTER if info is not None and info.platform != "cpu" else STRICTLY_BETTER
    try:
        result = verify_profile(
            trainer.model, engine_logps, sequences, chosen=trainer.roundalign_profile, regions=args.roundalign_regions,
            info=info, backend=args.roundalign_backend, lanes=None, candidates=candidates, note=note,
            better_ratio=ratio, auto_ok=False, engine_noise_k3=noise,
        )
    finally:
        trainer.roundalign_report = trainer._install_patches(args)
    result.engine = info.as_dict() if info is not None else None
    scored = ", ".join(f"{c.profile} {c.kl_k3:.2e}" for c in result.candidates)
    logger.info(
        "profile %s verified against the vLLM server at %s (%s) in %.1f s (%d tokens; k3: %s)",
        result.chosen, url, about, result.seconds, result.tokens, scored,
    )
    return result


def read_server_info(trainer, args):
    """`(EngineInfo or None, why, url)` of the vLLM server, from its `/server_info`: the main process asks, every
    process takes its answer (so that no process waits on a request that failed). Read once per trainer (kept as
    `trainer._roundalign_server_info`). A request that raised leaves `why` starting with "request failed: "."""
    cached = getattr(trainer, "_roundalign_server_info", None)
    if cached is not None:
        return cached
    from .verify import broadcast_from_main, server_engine_info

    client = getattr(trainer.vllm_generation, "vllm_client", None)
    url = client.base_url if client is not None else args.vllm_server_base_url
    payload, interrupted = [None], None
    if client is not None:
        try:
            response = client.session.get(f"{url}/server_info", params={"config_format": "json"})
            payload = [server_engine_info(response.json()) if response.status_code == 200 else
                       (None, f"its /server_info answered {response.status_code}")]
        except Exception as e:  # noqa: BLE001 - broadcast, so that no process waits for a payload that never comes
            payload = [(None, "request failed: " + " ".join(f"{type(e).__name__}: {e}".split()))]
        except BaseException as e:  # Ctrl-C or SystemExit while waiting for the server: every process exits with it
            interrupted = e
    info, about = broadcast_from_main(payload, interrupted)
    trainer._roundalign_server_info = (info, about, url)
    return info, about, url


def follow_server_layout(trainer, info, url) -> None:
    """The server's GEMM row blocks and tensor-parallel sums, for `_install_patches` to reproduce on the policy."""
    rows = (info.gemm_block_rows or 0) if info is not None else 0
    if rows != trainer._roundalign_gemm_rows:
        logger.info("the vLLM server's linears compute in row blocks of %d rows; the policy's do too", rows)
    trainer._roundalign_gemm_rows = rows
    server_tp(trainer, info, url)


def server_layout_unverified(trainer, args) -> None:
    """An explicit profile with the start-up check off: nothing else reads `/server_info`, so read it here for the
    server's row blocks and TP layout; a server that does not say is warned about (they cannot be followed)."""
    import warnings

    info, about, url = read_server_info(trainer, args)
    if info is None:
        warnings.warn(
            f"The vLLM server at {url} does not report its configuration ({about}) and roundalign_verify_profile=False: "
            "its GEMM row blocks and tensor-parallel layout cannot be followed, and nothing checks the profile.",
            UserWarning,
            stacklevel=4,
        )
    follow_server_layout(trainer, info, url)


def server_profile(trainer, args) -> str:
    """`roundalign_profile='auto'` in server mode: the profile the server's reported configuration implies.

    A server that does not say on which platform it runs, or one whose configuration nobody measured, stops the run
    with one line; nothing is assumed. Its row blocks and TP layout are followed (`follow_server_layout`).
    """
    from .engine import profile_for_engine

    info, about, url = read_server_info(trainer, args)
    if info is None or (info.compile_mode == "None" and not info.enforce_eager):
        raise ValueError(
            f"roundalign_profile='auto' reads the vLLM server's configuration, but the server at {url} does not say "
            f"enough ({about}). Pass the server's profile: 'vllm-compiled-piecewise' for `trl vllm-serve` on a GPU "
            "(vLLM's CUDA default), 'vllm-eager' with --enforce-eager; `trl-roundalign probe` measures other settings."
        )
    profile = profile_for_engine(info, tensor_parallel=True)  # the trainer computes the TP form (`server_tp`)
    follow_server_layout(trainer, info, url)
    logger.info("roundalign_profile='auto': %s, from the vLLM server at %s (%s)", profile, url, about)
    return profile


def _targets(trainer) -> list:
    return [trainer.model] + ([trainer.ref_model] if getattr(trainer, "ref_model", None) is not None else [])


def server_tp(trainer, info, url) -> int:
    """The server's tensor-parallel size (`EngineInfo.tensor_parallel_size`, from /server_info), recorded as
    `trainer._roundalign_tp`: above 1, `_install_patches` computes the policy's (and the reference model's)
    row-parallel linears as the server's ranks sum them (`tp.install_tp_linears`). A TP layout the trainer does not
    reproduce (`engine.profile_for_engine(info, tensor_parallel=True)`: only TP=2 on vLLM-CPU's one-graph engine with
    its `_C` library is measured) stops the run with that function's one line, as does a model family whose
    row-parallel layers are not measured."""
    from .engine import profile_for_engine
    from .tp import ROW_PARALLEL

    tp = int(getattr(info, "tensor_parallel_size", 1) or 1) if info is not None else 1
    if tp > 1:
        profile_for_engine(info, tensor_parallel=True)  # UnknownEngineConfiguration, one line, where not measured
        model_type = getattr(trainer.model.config, "model_type", None)
        if model_type not in ROW_PARALLEL:
            raise ValueError(
                f"The vLLM server at {url} runs tensor_parallel_size={tp}: its row-parallel sums are measured for "
                f"{', '.join(sorted(ROW_PARALLEL))}, not {model_type!r}. Serve it with --tensor-parallel-size 1."
            )
        if trainer._roundalign_tp != tp:
            logger.info("the vLLM server at %s runs tensor_parallel_size=%d: o_proj/down_proj sum %d shards as it does",
                        url, tp, tp)
    trainer._roundalign_tp = tp
    return tp
