"""docs/options.md, the table of TRL options, stays complete and honest (issue 28).

It fails when TRL's `GRPOConfig` has a field the page does not name (a TRL upgrade that adds one) or the page names
a field no config has; when a row's status is not one of the page's words; when a cited test node id does not
exist; when a row says "untested"; and when the rows marked "awaiting a test (issue 28)" are not `AWAITING_A_TEST`
(so a test added for one of them means removing it here and from the row, and a new gap means adding it). No
engine, no model: it reads the page and the test files.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "options.md"
STATUSES = ("aligned", "refused", "warned", "no effect", "open")
MARKER = "awaiting a test (issue 28)"
NODE_ID = re.compile(r"(tests/[\w/]+\.py)::(\w+)(?:\[([^\]\s`]+)\])?")

# Rows (by their first field) with a value or path that changes the numerics and that no test exercises yet. Each
# entry says what is missing; the row on the page says the same in words.
AWAITING_A_TEST: dict[str, str] = {}  # none left: every row has its test


@dataclasses.dataclass
class Row:
    fields: list[str]
    status: str
    text: str
    tests: list[str]
    line: int

    @property
    def name(self) -> str:
        return self.fields[0]


def _rows() -> list[Row]:
    rows = []
    for n, line in enumerate(PAGE.read_text().splitlines(), 1):
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 4, f"docs/options.md:{n}: expected 4 cells (field, status, text, test), got {len(cells)}"
        fields = re.findall(r"`(\w+)`", cells[0])
        assert fields, f"docs/options.md:{n}: no field in {cells[0]!r}"
        tests = [m.group(0) for m in NODE_ID.finditer(cells[3])]
        rows.append(Row(fields, cells[1], cells[2], tests, n))
    return rows


ROWS = _rows()


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_the_table_names_every_grpo_config_field_and_only_existing_ones():
    from transformers import TrainingArguments
    from trl import GRPOConfig

    from trl_roundalign import RoundAlignGRPOConfig

    named = [f for r in ROWS for f in r.fields]
    assert len(named) == len(set(named)), sorted({f for f in named if named.count(f) > 1})
    grpo_own = _fields(GRPOConfig) - _fields(TrainingArguments)
    package_own = _fields(RoundAlignGRPOConfig) - _fields(GRPOConfig)
    missing = sorted((grpo_own | package_own) - set(named))
    assert not missing, f"docs/options.md does not name these config fields: {missing}"
    unknown = sorted(set(named) - _fields(RoundAlignGRPOConfig))
    assert not unknown, f"docs/options.md names fields no config has: {unknown}"


def test_every_row_has_a_status():
    bad = [(r.line, r.name, r.status) for r in ROWS if r.status not in STATUSES]
    assert not bad, f"status must be one of {STATUSES}: {bad}"


def test_no_row_says_untested():
    lines = [n for n, line in enumerate(PAGE.read_text().splitlines(), 1) if "untested" in line.lower()]
    assert not lines, f"docs/options.md says 'untested' on lines {lines}"


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


@pytest.mark.parametrize("node_id", sorted({m.group(0) for m in NODE_ID.finditer(PAGE.read_text())}))
def test_every_cited_test_exists(node_id):
    path_s, func, param = NODE_ID.fullmatch(node_id).groups()
    path = ROOT / path_s
    assert path.is_file(), f"{node_id}: no file {path_s}"
    assert func.startswith("test_") and func in _test_names(path), f"{node_id}: no test function {func} in {path_s}"
    if param is not None:
        text = path.read_text()
        assert f'"{param}"' in text or f"'{param}'" in text, (
            f"{node_id}: {param!r} is neither a parametrize id nor a key of the OPTIONS dict in {path_s}"
        )


def test_every_aligned_refused_or_warned_row_cites_a_test_or_awaits_one():
    uncited = [(r.line, r.name) for r in ROWS if r.status in ("aligned", "refused", "warned") and not r.tests
               and r.name not in AWAITING_A_TEST]  # fmt: skip
    assert not uncited, f"rows with no test and not awaiting one: {uncited}"
    open_rows = [(r.line, r.name) for r in ROWS if r.status == "open" and r.name not in AWAITING_A_TEST]
    assert not open_rows, f"'open' rows must be in AWAITING_A_TEST: {open_rows}"


def test_the_rows_awaiting_a_test_are_the_list():
    marked = {r.name for r in ROWS if MARKER in r.text}
    assert marked == set(AWAITING_A_TEST), (
        f"marked on the page but not listed: {sorted(marked - set(AWAITING_A_TEST))}; "
        f"listed but no longer marked (remove them here): {sorted(set(AWAITING_A_TEST) - marked)}"
    )
