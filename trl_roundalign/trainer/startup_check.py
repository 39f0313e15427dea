"""Start-up verification: check the rounding profile against the engine that is actually running.

A profile is a claim about where the engine rounds. Before training starts the trainer scores a few
short sequences on both sides and checks the claim:

- the engine's prefill log-probs of the sequences (colocate: `prompt_logprobs`), against
- the policy's log-probs under the chosen profile and under the other candidates.

On a compiled vLLM-CPU engine the exact refinements of `vllm-compiled` (one graph) and
`vllm-compiled-piecewise` (graph split at attention) are scored too: the engine's own reduction order
and attention kernel leave the residual stream's rounding as the only difference, so exactly one of
them is bit-identical, and that one names the engine's profile. Elsewhere (eager engines, GPUs) the
candidates are compared by k3: a candidate at less than half the chosen profile's k3 is a clearly
better match. Either way a mismatch stops the run with one line naming the better profile; an exact
mode that is not 100% bit-identical stops it too.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field

import torch

from .. import metrics
from ..engine import EXACT_REFINEMENTS
from ..ops.attention import DEFAULT_BLOCK_SIZE, vllm_cpu_attention_forward
from ..profiles import ALL_REGIONS, get_profile, is_exact

logger = logging.getLogger(__name__)

__all__ = [
    "ProfileMismatch",
    "PromptHorizon",
    "Verification",
    "prefill_batch_invariant_tokens",
    "server_engine_info",
    "server_prompt_logprobs",
    "verification_sequences",
    "verify_on_main_process",
    "verify_profile",
    "weights_arrive_at_prepare",
    "zero3_gathered",
]

# Fixed text, tokenised by the engine's tokenizer: the same tokens on both sides, no sampling.
_TEXTS = (
    "Question: what is 17 plus 25? Think step by step, then give the answer in a box. The sum of 17 and 25 is 42.",
    "The quick brown fox jumps over the lazy dog while the cat watches from the window, counting to nine.",
    "def add(a, b):\n    return a + b\n\nprint(add(3, 4))  # prints 7, the sum of three and four",
)
# A better candidate must halve the chosen profile's k3 to count as "clearly better".
CLEARLY_BETTER = 0.5
# A rival's lower k3 counts only when the mean of the per-token differences (same tokens, paired) exceeds this many
# standard errors of it: on a tiny model two profiles can differ by a few percent on 140 tokens by chance (measured on
# the Intel AMX machine: vllm-compiled 4.98e-07 vs vllm-compiled-piecewise 4.80e-07 against a one-graph server).
SIGNIFICANCE_Z = 3.0
# Server mode on a vLLM-CPU server (or one whose platform is unknown): no exact refinement can decide (the
# server's reduction lanes are not known), so any candidate with a strictly lower k3 refutes the chosen profile.
STRICTLY_BETTER = 1.0


class ProfileMismatch(ValueError):
    """The chosen profile does not describe the running engine."""


def weights_arrive_at_prepare() -> bool:
    """FSDP with CPU-RAM-efficient loading (`fsdp_cpu_ram_efficient_loading: true`, the FSDP2 recipe's setting):
    transformers loads zeros on every process but each node's first, and accelerate broadcasts process 0's weights
    only when it prepares the model, at `train()`. Until then the policy cannot be scored on those processes."""
    try:
        from transformers.modeling_utils import is_fsdp_enabled
    except ImportError:  # a transformers without FSDP loading
        return False
    return bool(is_fsdp_enabled())


def broadcast_main_weights(model) -> None:
    """Process 0's parameters and buffers, in place, on every process (`weights_arrive_at_prepare`: the others hold
    zeros of the same shapes until accelerate broadcasts them at `prepare`). Server mode's start-up check needs it: every
    process scores the policy against what the main process's client read from the server."""
    import itertools

    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for t in itertools.chain(model.parameters(), model.buffers()):
            dist.broadcast(t.data, src=0)


def zero3_gathered(model):
    """The whole policy gathered on every process under DeepSpeed ZeRO-3 (a no-op otherwise). With `zero3_init_flag`
    (the ZeRO-3 recipe's setting) the parameters are partitioned as they load, empty until DeepSpeed's hooks gather
    them; the start-up check runs before `train()` installs those hooks ('weight' must be 2-D, measured on CPU)."""
    import contextlib

    try:
        from transformers.integrations import is_deepspeed_zero3_enabled
    except ImportError:
        return contextlib.nullcontext()
    if not is_deepspeed_zero3_enabled():
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)


def verify_on_main_process(check):
    """Run the start-up check `check()` on process 0 only and hand its result, or its failure, to every process (see
    `weights_arrive_at_prepare`: a process scoring its placeholder weights refuted every profile, 0.0% bit-identical,
    measured in two-process FSDP2 on CPU). Every process runs the same engine configuration.

    Whatever ends the check on process 0, an `Exception` or a `BaseException` such as `KeyboardInterrupt` or
    `SystemExit`, is broadcast first (no process waits for a payload that never comes), then process 0 re-raises its
    own exception and every other process raises the same reason: the same type for `ProfileMismatch`, `ValueError`,
    `RuntimeError` (and their subclasses), `KeyboardInterrupt` and `SystemExit` (with its exit code), a `RuntimeError`
    with the same message otherwise."""
    payload = [None]
    failure = None
    if torch.distributed.get_rank() == 0:
        try:
            payload = [check()]
        except BaseException as e:  # noqa: BLE001 - broadcast, so that no process waits for a payload that never comes
            failure = e
    return broadcast_from_main(payload, failure)


def broadcast_from_main(payload: list, failure: BaseException | None = None):
    """Process 0's one-element `payload`, on every process; or, where process 0 failed with `failure`, its reason
    raised on every process (`verify_on_main_process`): process 0 re-raises `failure` itself after the broadcast."""
    from accelerate.utils import broadcast_object_list

    if failure is not None:
        payload = [(_FAILED, *_reason(failure))]
    broadcast_object_list(payload, from_process=0)
    if failure is not None:
        raise failure
    if isinstance(payload[0], tuple) and payload[0][:1] == (_FAILED,):
        raise payload[0][1](*payload[0][2])
    return payload[0]


_FAILED = "trl_roundalign: the start-up check failed on process 0"  # marks a broadcast failure


def _reason(e: BaseException) -> tuple:
    """`(type, args)` that every process raises again for process 0's failure `e` (a type pickles by reference)."""
    if isinstance(e, SystemExit):
        return SystemExit, (e.code if isinstance(e.code, (int, str, type(None))) else str(e.code),)
    if isinstance(e, KeyboardInterrupt):
        return KeyboardInterrupt, ()
    return (type(e) if isinstance(e, (ProfileMismatch, ValueError, RuntimeError)) else RuntimeError), (str(e),)


@dataclass
class CandidateScore:
    profile: str
    regions: list[str]
    kl_k3: float
    frac_bitwise_equal: float
    abs_logp_diff_max: float


@dataclass
class Verification:
    """What the start-up check measured (written to the `run_info` header of `mismatch.jsonl`)."""

    chosen: str
    engine_profile: str | None
    candidates: list[CandidateScore] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    verdict: str = ""
    engine: dict | None = None  # server mode: the server's configuration as read from /server_info
    # k3 between the engine's own batched and one-at-a-time prefill of the same sequences (server mode): a rival
    # profile must beat the chosen one by more than this to refute it.
    engine_noise_k3: float | None = None
    # The margin a rival's k3 had to beat: max(engine_noise_k3, SIGNIFICANCE_Z standard errors of the paired
    # per-token difference); None when no k3 decision was made.
    k3_margin: float | None = None
    # Base profiles whose exact refinements all reproduce the engine bit for bit while its configuration names none
    # of them: the check could not tell which one the engine runs (empty when it could).
    tied: list[str] = field(default_factory=list)
    # Exact mode: completion tokens the engine sampled in decode steps of a shrinking batch (`verify_against_sampler`),
    # and the share of them whose recomputed log-prob is the sampler's bit for bit (None: not checked).
    sampler_tokens: int = 0
    sampler_bitwise: float | None = None
    # Exact mode: of the sampler check's requests, how many the engine computed from a prefix-cache hit, in prefill
    # chunks, or after a re-prefill, by its own schedule record (reproduced as recorded; absent where nothing records).
    sampler_forms: dict = field(default_factory=dict)
    # Exact mode: the longest prompt whose prefill is the same in any batch here (`PromptHorizon`; None: no limit).
    prompt_horizon: int | None = None
    # The time of the earlier run on this machine whose passing verdict this is, read back under the whole key of
    # what it depends on (`trainer.kept_check`); None: measured in this run.
    kept: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def verification_sequences(tokenizer, *, max_len: int = 48) -> list[list[int]]:
    """A few short fixed token sequences (at least 8 tokens each) in the engine's vocabulary."""
    seqs = []
    for text in _TEXTS:
        ids = list(tokenizer.encode(text, add_special_tokens=False))[:max_len]
        if len(ids) >= 8:
            seqs.append(ids)
    if not seqs:
        raise ValueError("The tokenizer turned the verification texts into fewer than 8 tokens each.")
    return seqs


def _score(model, sequences, engine_logps, regions, profile, backend, lanes, block_size, max_len=None,
           gdn=None) -> CandidateScore:
    from ..models import takes_engine_lanes
    from ..patching import apply_roundalign, revert_roundalign
    from ..scoring import hf_logprobs

    revert_roundalign(model)
    prof = get_profile(profile)
    use_lanes = lanes if takes_engine_lanes(model, prof) else None
    apply_roundalign(
        model, regions, profile, backend, reduction_lanes=use_lanes, lanes_source="engine" if use_lanes else None,
        positions_from_mask=False, attention_block_size=block_size if prof.attention == "vllm-cpu" else None,
        engine_max_model_len=max_len, gated_delta_net=gdn if "attention" in regions else None,
    )
    mine = hf_logprobs(model, sequences)
    a, b, mask = _padded(mine, engine_logps)
    # The statistics leave non-finite tokens out, so a NaN could read as bit-identical (or, all NaN, compare False
    # both ways): a non-finite log-prob on either side fails the check outright.
    inside = mask != 0
    bad = {side: int((inside & ~torch.isfinite(t)).sum()) for side, t in (("policy", a), ("engine", b))}
    if any(bad.values()):
        sides = " and ".join(f"{n} of {int(inside.sum())} tokens on the {side}'s side" for side, n in bad.items() if n)
        raise ProfileMismatch(
            f"Start-up check under profile {profile!r}: {sides} have a log-prob that is not finite (NaN or inf), so "
            "the profile cannot be verified: the policy's forward or the engine computed NaN/inf on fixed text."
        )
    st = metrics.token_stats(a, b, mask)
    score = CandidateScore(
        profile, list(regions), float(st["mismatch/kl_k3"]), float(st["mismatch/frac_bitwise_equal"]),
        float(st["mismatch/abs_logp_diff/max"]),
    )
    d = a.double()[inside] - b.double()[inside]
    score._token_k3 = torch.expm1(d) - d  # per token, in a fixed order: the paired comparison of two candidates
    return score


def candidate_profiles(info, *, exact: bool = True) -> tuple[list[str], list[str]]:
    """`(base candidates, exact candidates)` worth scoring against an engine (`EngineInfo`).

    `exact=False`: the engine's reduction lanes are not known (a vLLM server), so the exact refinements
    cannot be scored; a compiled vLLM-CPU engine is then checked against the base profiles by k3.
    """
    if info is not None and info.platform == "cpu" and info.compiled:
        from ..ops.attention import vllm_cpu_attention_available

        if exact and vllm_cpu_attention_available():
            # The two exact refinements decide bit for bit; scoring the base profiles too would only add cost.
            return [], list(EXACT_REFINEMENTS)
        return ["vllm-compiled", "vllm-compiled-piecewise", "vllm-eager-cpu", "vllm-eager-cpu-avx2", "none"], []
    if info is not None and info.platform == "cpu":
        return ["vllm-eager-cpu", "vllm-eager-cpu-avx2", "vllm-compiled", "vllm-compiled-piecewise", "none"], []
    return ["vllm-compiled-piecewise", "vllm-compiled", "vllm-eager", "none"], []


# Every base profile: the candidates for a server whose platform is not known.
ALL_BASE_CANDIDATES = (
    "vllm-compiled",
    "vllm-compiled-piecewise",
    "vllm-eager",
    "vllm-eager-cpu",
    "vllm-eager-cpu-avx2",
    "none",
)


def server_engine_info(server_info: dict):
    """`(EngineLayout or None, why)` of a vLLM server, from its full `/server_info` JSON (`config_format=json`): the
    engine's one reader, `engine.layout.layout_or_why`."""
    from ..engine.layout import layout_or_why

    return layout_or_why(server_info)


def _configured_profile(info) -> str | None:
    """The base profile the engine's configuration names (`engine.profile_for_engine`), where the configuration alone
    decides it (compiled engines, GPU engines); None otherwise (no info, an eager vLLM-CPU engine, whose profile
    depends on the kernel library of the process that runs it, or a configuration no profile describes)."""
    from ..engine import UnknownEngineConfiguration, profile_for_engine

    if info is None or (info.platform == "cpu" and not info.compiled):
        return None
    try:  # a TP > 1 engine reaches this only where the trainer computes the TP form (server mode, `verify_server`)
        return get_profile(profile_for_engine(info, tensor_parallel=True)).name
    except (UnknownEngineConfiguration, KeyError, ValueError):
        return None


def _paired_standard_error(a: CandidateScore, b: CandidateScore) -> float:
    """Standard error of the mean per-token k3 difference between two candidates scored on the same tokens."""
    ta, tb = getattr(a, "_token_k3", None), getattr(b, "_token_k3", None)
    if ta is None or tb is None or ta.shape != tb.shape or ta.numel() < 2:
        return 0.0
    d = ta - tb
    return float(d.std() / d.numel() ** 0.5)


def engine_self_k3(batched: list[torch.Tensor], single: list[torch.Tensor]) -> float:
    """k3 between an engine's log-probs of the same sequences scored together and one at a time: its own noise
    (0 where its kernels are batch-invariant)."""
    return float(metrics.token_stats(*_padded(batched, single))["mismatch/kl_k3"])


def _padded(first: list[torch.Tensor], second: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two sides' per-sequence log-probs as `[B, T]` matrices and the mask of `first`'s tokens."""
    width = max(len(x) for x in first)
    a, b = torch.zeros(len(first), width), torch.zeros(len(first), width)
    mask = torch.zeros(len(first), width, dtype=torch.long)
    for i, (x, y) in enumerate(zip(first, second)):
        a[i, : len(x)], b[i, : len(y)], mask[i, : len(x)] = x, y, 1
    return a, b, mask


def server_prompt_logprobs(client, sequences: list[list[int]], temperature: float = 0.0) -> list[torch.Tensor]:
    """A vLLM server's prompt log-probs of each sequence (entry `t` scores token `t + 1`), one request.

    A `/v1/completions` request with `prompt_logprobs` and one generated token, as TRL's
    `VLLMClient.get_sequence_logprobs` sends, but greedy: vLLM computes prompt log-probs from the raw
    logits whatever the temperature, and a batch of greedy requests draws no random numbers, so the check
    leaves the server's sampling stream, which training then draws from, where it was (as the colocated
    check does). A seed would not: vLLM-CPU's sampler draws from the global generator even when every
    request is seeded (`TopKTopPSampler.forward_cpu`). `temperature=1.0` sends TRL's request.
    """
    payload = {
        "model": client.model,
        "prompt": sequences,
        "max_tokens": 1,
        "temperature": temperature,
        "prompt_logprobs": 1,
    }
    choices = sorted(client._post(f"{client.base_url}/v1/completions", json=payload)["choices"], key=lambda c: c["index"])
    result = []
    for choice, seq in zip(choices, sequences):
        entries = choice.get("prompt_logprobs") or []
        lps = [(entries[t] or {}).get(str(seq[t]), {}).get("logprob", math.nan) for t in range(1, len(entries))]
        result.append(torch.tensor(lps, dtype=torch.float32))
    if len(result) != len(sequences):
        raise RuntimeError(
            f"The vLLM server answered {len(result)} of {len(sequences)} prompts; the start-up profile check cannot score it."
        )
    for seq, lps in zip(sequences, result):
        if len(lps) != len(seq) - 1 or not torch.isfinite(lps).all():
            raise RuntimeError(
                f"The vLLM server returned {len(lps)} prompt log-probs for {len(seq)} tokens (or non-finite ones); "
                "the start-up profile check cannot score it."
            )
    return result


def _family_profiles(model) -> tuple[str, ...] | None:
    """The profiles measured for the model's family (`ArchSpec.profiles`; None: all)."""
    from ..models import find_backbone, get_spec

    config = getattr(find_backbone(model), "config", None) or getattr(model, "config", None)
    return get_spec(getattr(config, "model_type", None)).profiles


def verify_profile(
    model,
    engine_logps: list[torch.Tensor],
    sequences: list[list[int]],
    *,
    chosen: str,
    regions,
    info=None,
    backend: str | None = None,
    lanes=None,
    attention_block_size: int | None = None,
    candidates: list[str] | tuple[str, ...] | None = None,
    note: str = "",
    better_ratio: float = CLEARLY_BETTER,
    auto_ok: bool = True,
    engine_noise_k3: float | None = None,
) -> Verification:
    """Score `sequences` under the chosen profile and the candidates; raise `ProfileMismatch` on a mismatch.

    The model's patches are replaced while scoring; the caller re-applies its own afterwards.

    Args:
        model: the policy (bf16 Hugging Face model or a PeftModel around one).
        engine_logps: the engine's log-probs of each sequence (entry `t` scores token `t + 1`).
        sequences: the token ids the engine scored.
        chosen: the profile the run will use.
        regions: the run's regions (the chosen profile is scored with them).
        info: the engine's `EngineInfo` (None: candidates for a GPU engine; server mode passes the one
            `server_engine_info` reads, or `candidates` when the server's platform is unknown).
        backend, lanes: kernel backend, and the engine's reduction lanes (exact profiles).
        attention_block_size: the engine's KV cache block size (exact profiles' attention kernel).
        candidates: base profiles to score instead of `candidate_profiles(info)` (no exact ones then).
        note: appended to a mismatch's message (what is known about the engine, e.g. in server mode).
        better_ratio: a base candidate whose k3 is below `better_ratio` times the chosen profile's is a better
            match (default: it must halve it; 1.0: any strictly lower k3, when no exact refinement can decide).
        auto_ok: whether a mismatch's message may suggest roundalign_profile='auto' (not in server mode).
        engine_noise_k3: how far the engine disagrees with itself on these sequences (k3 of its batched against
            its one-at-a-time prefill; server mode measures it): a base candidate refutes the chosen profile only if
            its k3 is lower by more than this, so that a machine whose engine is not batch-invariant does not
            decide by its own noise. None or 0: any lower k3 within `better_ratio` counts.
    """
    start = time.perf_counter()
    regions = tuple(regions)
    max_len = getattr(info, "max_model_len", None)  # LongRoPE models: the engine's factor set
    gdn = getattr(info, "gated_delta_net", None)  # Qwen3.5: the engine's gated delta-net form
    from ..models import exact_refusal_for

    refusal = None if is_exact(chosen) else exact_refusal_for(model)
    if candidates is None:
        bases, exacts = candidate_profiles(info, exact=lanes is not None and refusal is None)
    else:
        bases, exacts = list(candidates), []
    if refusal is not None and lanes is not None:
        # A family whose exact mode is refused on this machine (Qwen3-MoE under vLLM-CPU's _C library, whose MoE
        # kernel differs from the trainer's as a GPU engine's kernels do) cannot be decided bit for bit: the base
        # profiles are scored by k3, and, as against a GPU engine, a rival must halve the chosen profile's k3.
        note = f" No exact refinement could decide ({refusal.rstrip('.')}), so the profiles were compared by k3." + note
        logger.info("profile check by k3 against the base profiles: no exact mode here (%s)", refusal)
    measured = _family_profiles(model)
    if measured is not None:  # a family measured on some engines only (Gemma 3): the others cannot be scored
        bases, exacts = [p for p in bases if p in measured], [p for p in exacts if p in measured]
    if is_exact(chosen) and chosen not in exacts:
        exacts = [chosen, *exacts]
    base_regions = tuple(r for r in regions if r != "attention") or ("rope", "swiglu", "rmsnorm")
    scores: list[CandidateScore] = []
    with torch.no_grad():
        chosen_score = _score(model, sequences, engine_logps, regions, chosen, backend, lanes, attention_block_size, max_len, gdn)
        scores.append(chosen_score)
        for p in bases:
            if p != chosen or regions != base_regions:
                scores.append(_score(model, sequences, engine_logps, base_regions, p, backend, lanes, attention_block_size, max_len, gdn))
        exact_scores = []
        if lanes is not None:
            for p in exacts:
                if p != chosen:
                    exact_scores.append(_score(model, sequences, engine_logps, ALL_REGIONS, p, backend, lanes, attention_block_size, max_len, gdn))
            scores.extend(exact_scores)
    tokens = sum(len(x) for x in engine_logps)
    result = Verification(chosen, None, scores, tokens, 0.0, engine_noise_k3=engine_noise_k3)
    margin = float(engine_noise_k3 or 0.0)

    def margin_between(x: CandidateScore, y: CandidateScore) -> float:
        """How much lower one k3 must be to count: the engine's noise, or SIGNIFICANCE_Z paired standard errors."""
        return max(float(engine_noise_k3 or 0.0), SIGNIFICANCE_Z * _paired_standard_error(x, y))

    or_auto = " or 'auto'" if auto_ok else ""

    def fail(message: str):
        result.seconds = time.perf_counter() - start
        result.verdict = "mismatch"
        raise ProfileMismatch(message + note)

    def decide_tie(hits: list[str]) -> str | None:
        """The base profile the engine runs among those whose exact refinements are all bit-identical to it: the one
        its configuration names (never the order they were scored in); None, recorded and warned as a tie, where
        the configuration names none of them."""
        bases = list(dict.fromkeys(EXACT_REFINEMENTS[h] for h in hits))
        if len(bases) == 1:
            return bases[0]
        configured = _configured_profile(info)
        if configured in bases:
            return configured
        result.tied = bases
        logger.warning(
            "profile check: a tie: the exact refinements of %s all reproduce the engine bit for bit on %d tokens, and "
            "its configuration names none of them, so the check cannot tell which the engine runs; "
            "`trl-roundalign probe` on longer sequences can.%s", " and ".join(bases), tokens, note,
        )
        return None

    if is_exact(chosen):
        result.engine_profile = chosen if chosen_score.frac_bitwise_equal == 1.0 else None
        also = [s.profile for s in exact_scores if s.frac_bitwise_equal == 1.0]
        if chosen_score.frac_bitwise_equal == 1.0 and also:
            runs = decide_tie([chosen, *also])
            if runs is not None and runs != EXACT_REFINEMENTS[chosen]:
                exact = next(e for e, b in EXACT_REFINEMENTS.items() if b == runs)
                result.engine_profile = exact
                fail(
                    f"Exact mode under {chosen} reproduces the engine bit for bit, but so does {exact}, and the engine's "
                    f"configuration is what {runs!r} describes. Set roundalign_profile='{exact}'{or_auto}."
                )
        if chosen_score.frac_bitwise_equal < 1.0:
            better = [s.profile for s in exact_scores if s.frac_bitwise_equal == 1.0]
            hint = f"; {better[0]} is bit-identical: use it" if better else ""
            fail(
                f"Exact mode under {chosen} reproduces {chosen_score.frac_bitwise_equal:.1%} of the engine's log-probs "
                f"bit for bit, not 100% (k3 {chosen_score.kl_k3:.2e}){hint}. Run `trl-roundalign probe` to see what differs."
            )
    else:
        exact_hits = [s.profile for s in exact_scores if s.frac_bitwise_equal == 1.0]
        chosen_base = get_profile(chosen).name
        if exact_hits:
            runs = decide_tie(exact_hits)
            if runs is None:  # a tie: the chosen profile is not refuted if it is one of the tied ones
                runs = chosen_base if chosen_base in result.tied else None
                if runs is None:
                    fail(
                        f"roundalign_profile={chosen!r} does not describe this engine: the exact modes of "
                        f"{' and '.join(result.tied)} are both bit-identical to it and its configuration names neither. "
                        f"Set roundalign_profile to one of them, or run `trl-roundalign probe`."
                    )
            result.engine_profile = runs
            if chosen_base != runs:
                exact = next(h for h in exact_hits if EXACT_REFINEMENTS[h] == runs)
                fail(
                    f"roundalign_profile={chosen!r} does not describe this engine: {runs} does "
                    f"(its exact mode {exact} is bit-identical to the engine). Set roundalign_profile="
                    f"'{runs}'{or_auto}."
                )
        elif exact_scores:
            best = max(exact_scores, key=lambda s: s.frac_bitwise_equal)
            fail(
                f"Neither exact refinement reproduces this engine bit for bit (best: {best.profile}, "
                f"{best.frac_bitwise_equal:.1%}): it rounds somewhere no profile describes. Run `trl-roundalign probe` "
                "with the same engine settings, or set roundalign_verify_profile=False to train unverified."
            )
        else:
            others = [s for s in scores[1:] if s.regions == list(base_regions) and s.profile != chosen_base]
            best = min(others, key=lambda s: s.kl_k3, default=None)
            result.engine_profile = chosen_base
            if best is not None:
                margin = margin_between(chosen_score, best)
                result.k3_margin = margin
            refutes = (
                best is not None and best.kl_k3 < better_ratio * chosen_score.kl_k3
                and chosen_score.kl_k3 - best.kl_k3 > margin
            )
            if best is not None and best.kl_k3 < chosen_score.kl_k3 and not refutes:
                logger.warning(
                    "profile check: %s scored a lower k3 than %s (%.2e vs %.2e on %d tokens), but not below %g times "
                    "it by more than the margin %.2e (the engine's own noise, or %g standard errors of the per-token "
                    "difference), so the check cannot tell them apart here; `trl-roundalign analyze` compares them on "
                    "more tokens.%s",
                    best.profile, chosen_base, best.kl_k3, chosen_score.kl_k3, tokens, better_ratio, margin, SIGNIFICANCE_Z,
                    note,
                )
            derived = _configured_profile(info)
            if refutes:
                # Among the rivals that k3 cannot tell from the best one, the profile the engine's configuration
                # names is the one to suggest (a tiny model's k3 ties one graph and pieces by chance).
                ties = [s for s in others if s.kl_k3 - best.kl_k3 <= margin_between(s, best)]
                suggested = next((s for s in ties if s.profile == derived), best)
                result.engine_profile = suggested.profile
                fail(
                    f"roundalign_profile={chosen!r} matches this engine worse than {suggested.profile!r} (k3 "
                    f"{chosen_score.kl_k3:.2e} vs {suggested.kl_k3:.2e} on {tokens} tokens"
                    + (f", lower by more than the margin {margin:.2e}" if margin else "")
                    + f"). Set roundalign_profile="
                    f"'{suggested.profile}'{or_auto}, or run `trl-roundalign probe`."
                )
            d = next((s for s in others if s.profile == derived), None)
            if d is not None and d.profile != chosen_base and d.kl_k3 - chosen_score.kl_k3 <= margin_between(chosen_score, d):
                # k3 does not refute the chosen profile, but it cannot confirm it either: the configuration decides.
                result.engine_profile = derived
                fail(
                    f"roundalign_profile={chosen!r} does not describe this engine: its configuration is what {derived!r} "
                    f"describes, and k3 on {tokens} tokens does not show {chosen!r} matching it better ({chosen_score.kl_k3:.2e} "
                    f"vs {d.kl_k3:.2e}). Set roundalign_profile='{derived}'{or_auto}, or run `trl-roundalign probe`."
                )
    result.seconds = time.perf_counter() - start
    result.verdict = "ok"
    return result


def prefill_batch_invariant_tokens(
    head_dim: int, num_heads: int, num_kv_heads: int, *, block_size: int = DEFAULT_BLOCK_SIZE, step: int = 32,
    limit: int = 4096, dtype: torch.dtype = torch.bfloat16,
) -> int | None:
    """The longest prompt (a multiple of `step`) whose prefill this process's kernel computes with the same bits alone
    and beside other sequences in one call, on this process's threads; None where every length up to `limit` is.

    Where an engine computes a step's prompts in one kernel call (not `engine.prefill`'s), a prompt's prefill is
    shared with the batch's other prompts, and the schedule shares the step's work among the threads: where a prompt is longer than one key tile, how its query tiles fall into work
    items changes its bits, so it depends on the batch, which the trainer does not know. Measured, not derived: random
    inputs, each length alone against itself after and before a 1,000-token sequence, from `step` up, stopping at
    the first length that differs."""
    g = torch.Generator().manual_seed(0)
    other = 1000
    for n in range(step, limit + 1, step):
        q = (torch.randn(n + other, num_heads, head_dim, generator=g) * 2).to(dtype)
        k = torch.randn(n + other, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(n + other, num_kv_heads, head_dim, generator=g).to(dtype)
        kw = dict(scale=head_dim**-0.5, block_size=block_size, prefill_alone=False)
        alone = vllm_cpu_attention_forward(q[:n], k[:n], v[:n], seq_lens=[n], **kw)
        first = vllm_cpu_attention_forward(q, k, v, seq_lens=[n, other], **kw)[:n]
        qq, kk, vv = (torch.cat([t[n:], t[:n]]) for t in (q, k, v))
        last = vllm_cpu_attention_forward(qq, kk, vv, seq_lens=[other, n], **kw)[other:]
        if not (torch.equal(alone, first) and torch.equal(alone, last)):
            return n - step
    return None


def model_prompt_horizon(config, *, block_size: int | None = None) -> int | None:
    """`trainer.startup_check.prefill_batch_invariant_tokens` at each of a model's attention layouts (`models.
    attention_layouts`: head dim, query and key-value heads; Gemma 4 has two), the shortest; None where every layout
    is batch-invariant up to the limit."""
    from ..models import attention_layouts

    found = [prefill_batch_invariant_tokens(hd, heads, kv, block_size=block_size or DEFAULT_BLOCK_SIZE)
             for hd, heads, kv in attention_layouts(config)]
    return min((n for n in found if n is not None), default=None)


class PromptHorizon:
    """Exact mode's prompt limit: none where the engine prefills each prompt alone and whole (`EngineLayout.
    prompts_alone`, what the trainer's colocated engine does, `engine.prefill`); else, on this machine, the longest
    prompt whose prefill the engine's attention kernel computes with the same bits in any batch
    (`trainer.startup_check.prefill_batch_invariant_tokens`, measured at start-up at the model's attention shape and this
    process's threads, which a colocated engine shares). A longer prompt's prefill depended on the other prompts of
    its engine step, which the trainer does not reproduce: its completion tokens may differ from the sampler. `check`
    warns once per run when a batch has one (the mismatch metrics show by how much)."""

    def __init__(self, tokens: int | None):
        self.tokens = tokens
        self.warned = False

    @classmethod
    def for_engine(cls, layout, model, block_size: int | None) -> PromptHorizon:
        if layout is not None and layout.prompts_alone:
            logger.info("exact mode: the engine prefills each prompt alone and whole, as the trainer recomputes it: "
                        "prompts of any length are reproduced")
            return cls(None)
        why = ("its attention computes a step's prompts together" if layout is None or not layout.attention_prefill_alone
               else "it may chunk a prompt's prefill" if layout.chunked_prefill is not False
               else "it prefills a prompt's uncached tail only (prefix caching)")
        logger.warning("exact mode: the engine does not prefill each prompt alone and whole (%s; `engine.prefill`): "
                       "the start-up check measures how long a prompt may be", why)
        return cls.measure(model, block_size)

    @classmethod
    def measure(cls, model, block_size: int | None) -> PromptHorizon:
        horizon = cls(model_prompt_horizon(model.config, block_size=block_size))
        logger.info("exact mode: prompts of up to %s tokens are prefilled with the same bits in any batch here",
                    "any number of" if horizon.tokens is None else horizon.tokens)
        return horizon

    def check(self, attention_mask, column: int) -> None:
        if self.tokens is None or self.warned or attention_mask is None:
            return
        longest = int(attention_mask[:, :column].sum(dim=1).max())
        if longest > self.tokens:
            self.warned = True
            logger.warning(
                "exact mode: a prompt of %d tokens is longer than the %d up to which this machine's attention prefill "
                "gives the same bits in any batch (measured at start-up): the engine's prefill of it depended on the "
                "other prompts of its step, which the trainer does not reproduce, so its completions may differ from "
                "the sampler (see mismatch/*). Shorter prompts keep exact mode exact.", longest, self.tokens,
            )
