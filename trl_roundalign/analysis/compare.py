"""Conditions (region sets under a profile) and their mismatch against the engine, token by token.

The conditions themselves (`Condition`, `build_conditions`, `apply_condition`) live in `conditions`, shared with
`per_layer`; they are re-exported here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import metrics
from ..engine.gemm import PLAIN, GemmSchedule
from ..patching import revert_roundalign
from ..profiles import PAPER_REGIONS, get_profile
from ..scoring import Sample, hf_logprobs
from .conditions import CONDITION_SETS, Condition, apply_condition, build_conditions

logger = logging.getLogger(__name__)

__all__ = [
    "CONDITION_SETS",
    "apply_condition",
    "Condition",
    "EngineRun",
    "build_conditions",
    "compare_engine_run",
    "completion_matrix",
    "condition_stats",
    "region_contributions",
    "run_engine",
    "score_conditions",
]

def score_conditions(
    model_path,
    samples: Sequence[Sample],
    conditions: Sequence[Condition],
    *,
    reduction_lanes: Sequence[int] | None = None,
    attention_block_size: int | None = None,
    attn_implementation: str = "sdpa",
    backend: str | None = None,
    progress: bool = False,
    engine_max_model_len: int | None = None,
    gemm_schedule: GemmSchedule = PLAIN,
    tensor_parallel: int = 1,
) -> dict[str, list[torch.Tensor]]:
    """Score every sample's tokens with the Hugging Face model under each condition.

    The model is loaded once in bf16; each condition is applied, scored and reverted. Sequences
    are scored one at a time (no padding), so positions equal vLLM's.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.bfloat16, attn_implementation=attn_implementation)
    model.eval()
    seqs = [s.token_ids for s in samples]
    out: dict[str, list[torch.Tensor]] = {}
    iterator = conditions
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(conditions, desc="scoring conditions", unit="condition")
    for cond in iterator:
        apply_condition(model, cond, reduction_lanes, attention_block_size, backend, engine_max_model_len, gemm_schedule,
                        tensor_parallel)
        out[cond.name] = hf_logprobs(model, seqs)
    revert_roundalign(model)
    return out


def completion_matrix(samples: Sequence[Sample], per_seq: Sequence[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad the completion-token log-probs of each sample into `[B, T]` values and mask.

    `per_seq` entries are next-token log-probs of whole sequences (as `hf_logprobs` returns);
    `None` takes the samples' own sampler log-probs.
    """
    width = max((len(s.completion_ids) for s in samples), default=0)
    values = torch.full((len(samples), width), float("nan"), dtype=torch.float32)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s.completion_ids)
        if per_seq is None:
            v = torch.tensor(s.sampler_logprobs[:n], dtype=torch.float32)
        else:
            v = per_seq[i][s.completion_slice].float()
        values[i, : len(v)] = v
        mask[i, :n] = 1
    return values, mask


def condition_stats(
    samples: Sequence[Sample],
    train: dict[str, list[torch.Tensor]],
    prefill: Sequence[torch.Tensor],
) -> dict[str, dict[str, dict[str, float]]]:
    """`{condition: {"vs_prefill": metrics, "vs_sampler": metrics}}` over completion tokens."""
    pre, mask = completion_matrix(samples, prefill)
    samp, _ = completion_matrix(samples, None)
    out = {}
    for name, logps in train.items():
        tr, _ = completion_matrix(samples, logps)
        out[name] = {
            "vs_prefill": metrics.token_stats(tr, pre, mask),
            "vs_sampler": metrics.token_stats(tr, samp, mask),
        }
    return out


def region_contributions(
    stats: dict[str, dict[str, dict[str, float]]], conditions: Sequence[Condition], *, against: str = "vs_prefill"
) -> dict[str, dict[str, float | None]]:
    """Each paper region's contribution to lowering the KL (k3).

    `alone`: KL(default) - KL(region alone); `removal`: KL(three regions without it) - KL(three regions).
    Positive means the region lowers the mismatch; a negative value is a region that hurts (as the
    paper saw for SwiGLU on one model). `None` where the needed conditions were not run.
    """
    k3 = {c.regions: stats[c.name][against]["mismatch/kl_k3"] for c in conditions if c.name in stats}
    out = {}
    for r in PAPER_REGIONS:
        alone = k3[()] - k3[(r,)] if () in k3 and (r,) in k3 else None
        rest = tuple(x for x in PAPER_REGIONS if x != r)
        removal = k3[rest] - k3[PAPER_REGIONS] if rest in k3 and PAPER_REGIONS in k3 else None
        out[r] = {"alone": alone, "removal": removal}
    return out


@dataclass
class Comparison:
    """Everything measured for one model: samples, engine log-probs and per-condition statistics."""

    model: str
    conditions: list[Condition]
    samples: list[Sample]
    prefill: list[torch.Tensor]
    train: dict[str, list[torch.Tensor]]
    stats: dict[str, dict[str, dict[str, float]]]
    floors: dict[str, dict[str, float]]
    reduction_lanes: list[int] | None
    per_layer: list[dict] | None = None  # rows of per_layer.csv (`per_layer.per_layer_differences`)


def chat_prompts(tokenizer, n: int, *, seed: int = 0) -> list[list[int]]:
    """`n` chat-formatted prompts (token ids) from the packaged arithmetic set."""
    from ..data import arithmetic_dataset

    rows = arithmetic_dataset().shuffle(seed=seed).select(range(n))
    out = []
    for row in rows:
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        out.append(list(ids))
    return out


@dataclass
class EngineRun:
    """What the engine side of a comparison produced: the samples, vLLM's prefill log-probs of them (batched, and
    one at a time for the floor, when measured), the engine's description, its reduction lanes (read when it is
    a compiled CPU engine) and its KV block size. Picklable: a separate engine process returns one."""

    samples: list[Sample]
    prefill: list[torch.Tensor]
    single: list[torch.Tensor] | None
    info: object
    lanes: list[int] | None
    lanes_error: str | None
    block_size: int


def run_engine(
    llm,
    *,
    prompts: Sequence[Sequence[int]] | None = None,
    num_prompts: int = 4,
    samples_per_prompt: int = 2,
    max_new_tokens: int = 48,
    temperature: float = 1.0,
    seed: int = 0,
    floors: bool = True,
) -> EngineRun:
    """The engine side of `compare_with_engine`: generate with `llm` and score the samples with its prefill."""
    from ..engine import engine_info, inductor_reduction_lanes
    from ..scoring import generate_samples, vllm_prefill_logprobs

    if prompts is None:
        prompts = chat_prompts(llm.get_tokenizer(), num_prompts, seed=seed)
    samples = generate_samples(llm, prompts, n=samples_per_prompt, max_tokens=max_new_tokens, temperature=temperature, seed=seed)
    samples = [s for s in samples if s.completion_ids]
    if not samples:
        raise RuntimeError("vLLM generated no completion tokens; raise max_new_tokens or change the prompts.")
    seqs = [s.token_ids for s in samples]
    prefill = vllm_prefill_logprobs(llm, seqs)
    single = vllm_prefill_logprobs(llm, seqs, one_at_a_time=True) if floors else None
    info = engine_info(llm)
    lanes, lanes_error = None, None
    if info.compiled and info.platform == "cpu":
        try:
            lanes = inductor_reduction_lanes(llm)
        except (FileNotFoundError, ValueError) as e:
            lanes_error = str(e)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    return EngineRun(samples, prefill, single, info, lanes, lanes_error, int(block))


def compare_engine_run(
    model_path,
    run: EngineRun,
    conditions: Sequence[Condition],
    *,
    per_layer: bool = False,
    progress: bool = False,
) -> Comparison:
    """The training side of `compare_with_engine`: score `run`'s samples under each condition, with the statistics."""
    samples, prefill = run.samples, run.prefill
    lanes = run.lanes  # None where not read; a profile without the engine's reduction order ignores the counts
    if any(get_profile(c.profile).reduction == "inductor-cpu" for c in conditions):
        if not run.info.compiled or run.info.platform != "cpu":
            raise ValueError("The exact condition reproduces vLLM-CPU's compiled engine; this engine is not one.")
        if run.lanes is None:
            raise ValueError(f"The engine's reduction lanes could not be read: {run.lanes_error}")
    max_len = getattr(run.info, "max_model_len", None)
    # The engine's linears' GEMM schedule (trl_roundalign.engine.gemm).
    rows = GemmSchedule(getattr(run.info, "gemm_block_rows", None) or 0, getattr(run.info, "gemm_min_rows", None) or 0)
    tp = int(getattr(run.info, "tensor_parallel_size", 1) or 1)  # > 1: row-parallel sums as the engine's ranks (tp)
    train = score_conditions(
        model_path, samples, conditions, reduction_lanes=lanes, attention_block_size=run.block_size, progress=progress,
        engine_max_model_len=max_len, gemm_schedule=rows, tensor_parallel=tp,
    )
    stats = condition_stats(samples, train, prefill)
    floor_stats: dict[str, dict[str, float]] = {}
    if run.single is not None:
        pre, mask = completion_matrix(samples, prefill)
        samp, _ = completion_matrix(samples, None)
        single, _ = completion_matrix(samples, run.single)
        floor_stats["sampler_vs_prefill"] = metrics.token_stats(pre, samp, mask)
        floor_stats["single_vs_batched_prefill"] = metrics.token_stats(single, pre, mask)
    layer_rows = None
    if per_layer:
        from .per_layer import per_layer_differences

        layer_rows = per_layer_differences(
            model_path, [s.token_ids for s in samples], conditions, reduction_lanes=lanes,
            attention_block_size=run.block_size, progress=progress, engine_max_model_len=max_len, gemm_schedule=rows,
            tensor_parallel=tp,
        )
    return Comparison(str(model_path), list(conditions), samples, prefill, train, stats, floor_stats, lanes, layer_rows)


def compare_with_engine(
    model_path,
    llm,
    conditions: Sequence[Condition],
    *,
    prompts: Sequence[Sequence[int]] | None = None,
    num_prompts: int = 4,
    samples_per_prompt: int = 2,
    max_new_tokens: int = 48,
    temperature: float = 1.0,
    seed: int = 0,
    floors: bool = True,
    per_layer: bool = False,
    progress: bool = False,
) -> Comparison:
    """Generate with `llm`, score the same tokens under each condition, and compute the statistics.

    Mismatch is measured against vLLM's prefill scoring of the full sequences (what the training
    side can match) and against the sampler's decode-time log-probs (what the RL loss sees). The
    engine's own floors are measured too: sampler vs prefill, and one-at-a-time vs batched prefill. With
    `per_layer`, each condition's values after every layer are compared with the exact mode's (`per_layer.py`).
    `llm` may also be an `EngineRun` (from `run_engine`, e.g. in a separate engine process).
    """
    run = llm if isinstance(llm, EngineRun) else run_engine(
        llm, prompts=prompts, num_prompts=num_prompts, samples_per_prompt=samples_per_prompt,
        max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, floors=floors,
    )
    return compare_engine_run(model_path, run, conditions, per_layer=per_layer, progress=progress)
