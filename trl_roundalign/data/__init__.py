"""Packaged prompt sets.

`arithmetic.jsonl` is the CPU demo's prompt set: additions and subtractions of one- and two-digit
numbers, small enough that SmolLM2-135M-Instruct answers some of them right, so GRPO has reward
variance to learn from. Each row has `prompt` (a one-message conversation) and `answer` (the exact
integer, as a string; never negative). `scripts/make_arithmetic_data.py` writes the file from
`make_arithmetic_problems`, which is deterministic for a seed.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import datasets

__all__ = ["ARITHMETIC_PATH", "ARITHMETIC_SEED", "ARITHMETIC_SIZE", "arithmetic_dataset", "make_arithmetic_problems"]

ARITHMETIC_PATH: Path = Path(__file__).with_name("arithmetic.jsonl")
ARITHMETIC_SEED: int = 0
ARITHMETIC_SIZE: int = 500

_TEMPLATE = "What is {a} {op} {b}? Answer with the number only."


def _operand(rng: random.Random) -> int:
    """A one-digit (1-9) or two-digit (10-99) number, each with probability 1/2."""
    return rng.randint(1, 9) if rng.random() < 0.5 else rng.randint(10, 99)


def make_arithmetic_problems(n: int = ARITHMETIC_SIZE, seed: int = ARITHMETIC_SEED) -> list[dict]:
    """Distinct addition/subtraction problems, deterministic for `(n, seed)`.

    Args:
        n (`int`, *optional*, defaults to `500`): number of problems (at most the 2 * 99 * 99 distinct ones).
        seed (`int`, *optional*, defaults to `0`): seed of the `random.Random` that draws them.

    Returns:
        `list[dict]`: rows `{"prompt": [{"role": "user", "content": ...}], "answer": str}`. Half the problems
        (in expectation) are additions; subtractions put the larger operand first, so answers are `>= 0`.
    """
    if not 0 <= n <= 2 * 99 * 99:
        raise ValueError(f"n must lie in [0, {2 * 99 * 99}], got {n}.")
    rng = random.Random(seed)
    seen: set[tuple[int, str, int]] = set()
    rows = []
    while len(rows) < n:
        a, b = _operand(rng), _operand(rng)
        op = "plus" if rng.random() < 0.5 else "minus"
        if op == "minus" and a < b:
            a, b = b, a
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        answer = a + b if op == "plus" else a - b
        content = _TEMPLATE.format(a=a, op=op, b=b)
        rows.append({"prompt": [{"role": "user", "content": content}], "answer": str(answer)})
    return rows


def arithmetic_dataset(split: str | None = None) -> datasets.Dataset:
    """The packaged arithmetic prompt set as a `datasets.Dataset` (read offline from the package).

    Args:
        split (`str`, *optional*):
            A `datasets` split expression over the file's single split `"train"`: `None` or `"train"` for all
            rows, or a slice such as `"train[:90%]"` / `"train[450:]"`.

    Returns:
        `datasets.Dataset` with columns `prompt` (list of `{"role", "content"}`) and `answer` (`str`).
    """
    import datasets

    if not ARITHMETIC_PATH.is_file():
        raise FileNotFoundError(
            f"{ARITHMETIC_PATH} is missing: run `python scripts/make_arithmetic_data.py` or reinstall the package."
        )
    features = datasets.Features(
        {
            "prompt": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
            "answer": datasets.Value("string"),
        }
    )
    return datasets.load_dataset(
        "json", data_files={"train": str(ARITHMETIC_PATH)}, split=split or "train", features=features
    )
