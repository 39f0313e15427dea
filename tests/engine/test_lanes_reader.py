"""The lanes reader reads the module the engine runs: the last compile's in its Inductor folder.

An engine recompiled into a folder it compiled into before leaves both modules there, and Inductor's fusion choices
can differ between two compiles of the same graph: Gemma 4's layer 0 was seen stored by one compile and recomputed by
the next (docs/numerics.md, "Gemma 4"). Picking the largest module then read the other compile's form, and the exact
mode scored 0% bit-identical. The two modules here are the AVX-512 machine's generated code for Gemma 4
(docs/results/avx512/gemma4-inductor-{auto,plain}.txt: the recompute form, two kernels reading the embedding table,
and the stored form, one); only the choice between them is tested, so any CPU runs it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from trl_roundalign.engine.lanes import _embedding_kernels, _inductor_modules

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results" / "avx512"


def test_the_newest_module_is_the_one_read(tmp_path):
    recompute, stored = RESULTS / "gemma4-inductor-auto.txt", RESULTS / "gemma4-inductor-plain.txt"
    assert (_embedding_kernels(recompute.read_text()), _embedding_kernels(stored.read_text())) == (2, 1)
    a, b = tmp_path / "aa" / "first.py", tmp_path / "bb" / "second.py"
    for dst, src in ((a, recompute), (b, stored)):
        dst.parent.mkdir()
        shutil.copy(src, dst)
    for older, newer, kernels in ((a, b, 1), (b, a, 2)):
        os.utime(older, (1_000_000, 1_000_000))
        os.utime(newer, (2_000_000, 2_000_000))
        modules = _inductor_modules(tmp_path)
        assert len(modules) == 2
        assert _embedding_kernels(modules[-1]) == kernels
