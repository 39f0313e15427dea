"""Evaluate a checkpoint on AIME 2025 with vLLM: avg@32 (mean accuracy over 32 samples per problem).

    python recipes/eval_aime.py outputs/DeepSeek-R1-Distill-Qwen-1.5B/grpo/three_region \\
        --output outputs/eval/aime25_three_region.json

Sampling follows the usual reasoning-model protocol: 32 samples per problem, temperature 0.6, top-p
0.95, up to `--max-tokens` new tokens (32768). Each prompt is the problem followed by the instruction
to box the final answer, in the model's chat template. A sample is graded with the training reward
(`trl_roundalign.rewards`: `boxed_math_reward` by default, `r1_math_reward` for models that must close
a `</think>` first): the last `\\boxed{}` is compared with the answer by normalised strings, then by
`math_verify`; a sample cut at the length limit scores 0.

Model: a hub id, a local checkpoint folder (what `recipes/grpo.py` saves in `output_dir`) or an offline
name (`smollm2-135m`, `tiny-qwen3`, ...). Data: a hub id (default `math-ai/aime25`, 30 problems) or a
local `.jsonl`/`.json`/`.parquet`/`.csv` file with a problem column (`problem`, `question` or `prompt`)
and an answer column (`answer` or `ground_truth`). `--dataset-config A,B` concatenates configurations
(e.g. `opencompass/AIME2025` with `AIME2025-I,AIME2025-II`).

The JSON written to `--output` holds `avg@N`, the per-problem accuracies and the settings. Bad input
ends with one line `error: ...` and exit code 2 (`TRL_ROUNDALIGN_DEBUG=1` shows the traceback).
"""

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from trl_roundalign.cli import one_line  # light: argparse only, no torch or vLLM

logger = logging.getLogger("recipes.eval_aime")

PROMPT_TEMPLATE = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
PROBLEM_COLUMNS = ("problem", "question", "prompt")
ANSWER_COLUMNS = ("answer", "ground_truth")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="Checkpoint: local folder, hub id, or offline name (smollm2-135m, tiny-qwen3, ...).")
    p.add_argument("--dataset", default="math-ai/aime25", help="Hub id or local .jsonl/.json/.parquet/.csv file.")
    p.add_argument("--dataset-config", default=None, help="Dataset configuration(s), comma separated to concatenate.")
    p.add_argument("--split", default=None, help="Split (default: 'test' for hub datasets, 'train' for local files).")
    p.add_argument(
        "--problem-column", default=None, help=f"Problem column (default: first of {', '.join(PROBLEM_COLUMNS)})."
    )
    p.add_argument(
        "--answer-column", default=None, help=f"Answer column (default: first of {', '.join(ANSWER_COLUMNS)})."
    )
    p.add_argument("--num-samples", "-n", type=int, default=32, help="Samples per problem (avg@N).")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-tokens", type=int, default=32768, help="Generation limit per sample.")
    p.add_argument("--max-model-len", type=int, default=None, help="Engine context (default: max-tokens + 2048).")
    p.add_argument("--reward", default="boxed_math_reward", choices=("boxed_math_reward", "r1_math_reward"))
    p.add_argument("--template", default=PROMPT_TEMPLATE, help="Prompt template with a {problem} field.")
    p.add_argument("--no-chat-template", action="store_true", help="Send the raw prompt text (base models).")
    p.add_argument("--limit", type=int, default=None, help="Evaluate only the first N problems (smoke runs).")
    p.add_argument("--dtype", default="bfloat16", help="Engine dtype.")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--enforce-eager", action="store_true", help="vLLM's eager engine (fast start, e.g. on CPU).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="JSON path (default: outputs/eval/aime25_<model name>.json).")
    return p


def load_problems(args) -> tuple[list[str | list], list[str], list[str]]:
    """`(problems, answers, ids)` from the dataset; problems are text or chat messages."""
    import datasets

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from grpo import _is_path_like, load_dataset_split

    local = _is_path_like(args.dataset)
    split = args.split or ("train" if local else "test")
    configs = [c.strip() for c in (args.dataset_config or "").split(",") if c.strip()] or [None]
    ds = datasets.concatenate_datasets([load_dataset_split(args.dataset, split, config=c) for c in configs])
    columns = list(ds.column_names)

    def pick(given: str | None, candidates: tuple[str, ...], what: str) -> str:
        if given is not None:
            if given not in columns:
                raise ValueError(
                    f"dataset {args.dataset!r} has no {what} column {given!r}; its columns: {', '.join(columns)}"
                )
            return given
        for c in candidates:
            if c in columns:
                return c
        raise ValueError(
            f"dataset {args.dataset!r} has no {what} column (looked for {', '.join(candidates)}; its columns: "
            f"{', '.join(columns)}); pass --{what}-column"
        )

    problem_col = pick(args.problem_column, PROBLEM_COLUMNS, "problem")
    answer_col = pick(args.answer_column, ANSWER_COLUMNS, "answer")
    if args.limit is not None:
        ds = ds.select(range(min(args.limit, len(ds))))
    if len(ds) == 0:
        raise ValueError(f"dataset {args.dataset!r} split {split!r} is empty")
    ids = [str(r.get("id", r.get("problem_idx", i))) for i, r in enumerate(ds)]
    return list(ds[problem_col]), [str(a) for a in ds[answer_col]], ids


def build_prompts(tokenizer, problems: list, args) -> list[dict]:
    """vLLM token prompts: the problem in the template, wrapped in the chat template unless told not to."""
    prompts = []
    for problem in problems:
        if isinstance(problem, list):  # already chat messages
            messages = problem
        else:
            messages = [{"role": "user", "content": args.template.format(problem=problem)}]
        if args.no_chat_template or tokenizer.chat_template is None:
            text = "\n".join(m["content"] for m in messages)
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        else:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        prompts.append({"prompt_token_ids": list(ids)})
    return prompts


def evaluate(args) -> dict:
    """Generate `num_samples` completions per problem, grade them, and return the report."""
    import torch

    from trl_roundalign.local_models import resolve_model
    from trl_roundalign.rewards import REWARD_FUNCS

    if args.num_samples < 1:
        raise ValueError("--num-samples must be at least 1")
    if "{problem}" not in args.template:
        raise ValueError("--template must contain the field {problem}")
    problems, answers, ids = load_problems(args)
    model_path = resolve_model(args.model)
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    kwargs = {}
    if args.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    llm = LLM(
        model=model_path,
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len or args.max_tokens + 2048,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        **kwargs,
    )
    tokenizer = llm.get_tokenizer()
    prompts = build_prompts(tokenizer, problems, args)
    params = SamplingParams(
        n=args.num_samples, temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
    )
    start = time.monotonic()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    gen_seconds = time.monotonic() - start
    eos = sorted({i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None} | _generation_eos(llm))
    reward = REWARD_FUNCS[args.reward]
    per_problem = []
    for out, answer, pid in zip(outputs, answers, ids):
        texts = [c.text for c in out.outputs]
        comp_ids = [list(c.token_ids) for c in out.outputs]
        scores = reward(
            completions=texts,
            answer=[answer] * len(texts),
            completion_ids=comp_ids,
            max_completion_length=args.max_tokens,
            eos_token_ids=eos,
        )
        per_problem.append(
            {
                "id": pid,
                "answer": answer,
                "accuracy": sum(scores) / len(scores),
                "correct": int(sum(scores)),
                "mean_tokens": sum(map(len, comp_ids)) / len(comp_ids),
                "truncated": sum(len(c) >= args.max_tokens for c in comp_ids),
            }
        )
    n = args.num_samples
    avg = sum(p["accuracy"] for p in per_problem) / len(per_problem)
    import vllm

    return {
        "model": str(args.model),
        "model_path": model_path,
        "dataset": args.dataset,
        "dataset_config": args.dataset_config,
        "num_problems": len(per_problem),
        f"avg@{n}": avg,
        "num_samples": n,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "max_tokens": args.max_tokens,
        "reward": args.reward,
        "template": args.template,
        "chat_template": not args.no_chat_template,
        "seed": args.seed,
        "generation_seconds": round(gen_seconds, 1),
        "vllm": vllm.__version__,
        "per_problem": per_problem,
    }


def _generation_eos(llm) -> set[int]:
    try:
        eos = llm.llm_engine.model_config.try_get_generation_config().get("eos_token_id")
    except Exception:  # noqa: BLE001 - optional information
        return set()
    if eos is None:
        return set()
    return set(eos if isinstance(eos, list) else [eos])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        report = evaluate(args)
    except (ValueError, FileNotFoundError, ConnectionError, ImportError) as exc:
        if os.environ.get("TRL_ROUNDALIGN_DEBUG"):
            raise
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    output = Path(args.output or f"outputs/eval/aime25_{Path(str(args.model).rstrip('/')).name}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2))
    key = f"avg@{report['num_samples']}"
    print(f"{report['model']}: {key} = {report[key]:.4f} on {report['num_problems']} problems -> {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
