"""`make mutate`'s table stays applicable (`scripts/mutate.py`): every mutation's snippet occurs exactly once in its
file and every test it names exists, so an edit of the numerics core that moves a snippet fails here, in `make test`,
not only in the next mutation run (the row floor's edit of the sampler head's GEMM call went unseen until then)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mutations():
    spec = importlib.util.spec_from_file_location("roundalign_mutate_table", ROOT / "scripts" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module.MUTATIONS


@pytest.mark.parametrize("mutation", _mutations(), ids=lambda m: m.name)
def test_each_mutation_applies_once_and_names_existing_tests(mutation):
    text = (ROOT / mutation.file).read_text()
    assert text.count(mutation.find) == 1, f"{mutation.name}: snippet occurs {text.count(mutation.find)} times"
    for node in mutation.tests:
        path, _, name = node.partition("::")
        source = (ROOT / path).read_text()
        assert f"def {name.split('[')[0]}(" in source, f"{mutation.name}: {node} does not exist"
