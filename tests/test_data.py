"""The packaged arithmetic prompt set: deterministic, well-formed, correct."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from trl_roundalign.data import (
    ARITHMETIC_PATH,
    ARITHMETIC_SEED,
    ARITHMETIC_SIZE,
    arithmetic_dataset,
    make_arithmetic_problems,
)
from trl_roundalign.rewards import arithmetic_reward

ROOT = Path(__file__).resolve().parents[1]
PROMPT_RE = re.compile(r"^What is (\d{1,2}) (plus|minus) (\d{1,2})\? Answer with the number only\.$")


def _script():
    spec = importlib.util.spec_from_file_location("make_arithmetic_data", ROOT / "scripts" / "make_arithmetic_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generator_is_deterministic_for_a_seed():
    assert make_arithmetic_problems(50, seed=3) == make_arithmetic_problems(50, seed=3)
    assert make_arithmetic_problems(50, seed=3) != make_arithmetic_problems(50, seed=4)
    # a shorter list is a prefix of a longer one with the same seed
    assert make_arithmetic_problems(500, seed=1)[:20] == make_arithmetic_problems(20, seed=1)
    with pytest.raises(ValueError):
        make_arithmetic_problems(-1)


def test_packaged_file_is_what_the_script_writes(tmp_path):
    script = _script()
    assert script.main(["--check"]) == 0
    out = tmp_path / "a.jsonl"
    assert script.main(["--out", str(out)]) == 0
    assert out.read_bytes() == ARITHMETIC_PATH.read_bytes()
    assert script.main(["--check", "--out", str(out), "--seed", "1"]) == 1


def test_rows_are_well_formed_and_answers_correct():
    lines = ARITHMETIC_PATH.read_text(encoding="utf-8").splitlines()
    assert len(lines) == ARITHMETIC_SIZE
    rows = [json.loads(line) for line in lines]
    assert rows == make_arithmetic_problems(ARITHMETIC_SIZE, ARITHMETIC_SEED)
    seen = set()
    for row in rows:
        assert set(row) == {"prompt", "answer"}
        assert isinstance(row["prompt"], list) and len(row["prompt"]) == 1
        message = row["prompt"][0]
        assert set(message) == {"role", "content"} and message["role"] == "user"
        m = PROMPT_RE.match(message["content"])
        assert m, message["content"]
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        assert 1 <= a <= 99 and 1 <= b <= 99
        expected = a + b if op == "plus" else a - b
        assert row["answer"] == str(expected) and expected >= 0
        seen.add(message["content"])
    assert len(seen) == len(rows)  # no duplicates
    ops = [PROMPT_RE.match(r["prompt"][0]["content"]).group(2) for r in rows]
    assert 0.4 < ops.count("plus") / len(ops) < 0.6
    one_digit = sum(int(PROMPT_RE.match(r["prompt"][0]["content"]).group(1)) < 10 for r in rows)
    assert one_digit > 50  # enough easy problems for a 135M model


def test_dataset_loads_offline_with_the_datasets_library():
    ds = arithmetic_dataset()
    assert len(ds) == ARITHMETIC_SIZE
    assert ds.column_names == ["prompt", "answer"]
    assert ds[0] == json.loads(ARITHMETIC_PATH.read_text(encoding="utf-8").splitlines()[0])
    assert len(arithmetic_dataset("train")) == ARITHMETIC_SIZE
    head, tail = arithmetic_dataset("train[:450]"), arithmetic_dataset("train[450:]")
    assert (len(head), len(tail)) == (450, 50)
    assert tail[0] == ds[450]


def test_answers_score_one_with_the_demo_reward():
    ds = arithmetic_dataset("train[:40]")
    assert arithmetic_reward(ds["answer"], answer=ds["answer"]) == [1.0] * 40
    wrong = [str(int(a) + 1) for a in ds["answer"]]
    assert arithmetic_reward(wrong, answer=ds["answer"]) == [0.0] * 40
