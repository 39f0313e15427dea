"""Every combination of the policy's weight dtype, TRL's `bf16`/`fp16` flags and the engine's dtype is either one the
suite trains aligned, or refused in one line that says what to set.

Trained aligned (with the three regions and a colocated engine):
- bf16 weights, `bf16=True`, the engine in bf16 (its default for a bf16 checkpoint, or `vllm_engine_kwargs`'s
  dtype): every trainer test (`tests/trainer/test_trainer.py`, `tests/trainer/test_trl_options.py`, ...);
- fp16 weights, `fp16=True, bf16=False`, the engine in fp16: `tests/trainer/test_trl_options.py`'s `fp16-policy`.

Everything else is refused before anything loads (`check_options`), e.g. a float16 policy under TRL's default
`bf16=True`: under CPU bf16 autocast an fp16 `nn.Linear` returns bf16, so the training log-probs would be computed in
another dtype than the engine's while the start-up check (outside autocast) still passes.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from trl_roundalign import RoundAlignGRPOConfig
from trl_roundalign.local_models import tiny_model
from trl_roundalign.trainer.options import check_options

POLICY = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
FLAGS = {"bf16=True": {"bf16": True, "fp16": False}, "fp16=True": {"bf16": False, "fp16": True},
         "neither": {"bf16": False, "fp16": False}}  # fmt: skip
ENGINE = {"engine-auto": None, "engine-bf16": "bfloat16", "engine-fp16": "float16", "engine-fp32": "float32"}

# (policy, flags, engine): the combinations the suite trains aligned (see the module docstring). The tiny
# checkpoints are bf16, so the engine's "auto" dtype is bf16.
ALIGNED = {
    ("bf16", "bf16=True", "engine-auto"),
    ("bf16", "bf16=True", "engine-bf16"),
    ("fp16", "fp16=True", "engine-fp16"),
}


@pytest.fixture(scope="module")
def qwen3():
    return str(tiny_model("qwen3"))


def _args(tmp_path, policy, flags, engine):
    kw = dict(output_dir=str(tmp_path), use_vllm=True, vllm_mode="colocate", report_to="none", use_cpu=True,
              model_init_kwargs={"dtype": POLICY[policy]}, **FLAGS[flags])  # fmt: skip
    if ENGINE[engine] is not None:
        kw["vllm_engine_kwargs"] = {"dtype": ENGINE[engine]}
    return RoundAlignGRPOConfig(**kw)


@pytest.mark.parametrize(("policy", "flags", "engine"), list(itertools.product(POLICY, FLAGS, ENGINE)))
def test_each_dtype_combination_is_aligned_or_refused_in_one_line(tmp_path, qwen3, policy, flags, engine):
    args = _args(tmp_path, policy, flags, engine)
    if (policy, flags, engine) in ALIGNED:
        check_options(qwen3, args)
        return
    with pytest.raises(ValueError) as err:
        check_options(qwen3, args)
    msg = str(err.value)
    assert "\n" not in msg and ("Set " in msg or "Load " in msg), msg


@pytest.mark.parametrize("flags", list(FLAGS))
def test_a_policy_object_follows_the_same_table(tmp_path, flags):
    """A model object's dtype is read from its parameters; an fp16 object under bf16=True is refused too."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen3"), dtype=torch.float16)
    args = _args(tmp_path, "fp16", flags, "engine-fp16")
    if flags == "fp16=True":
        check_options(model, args)
    else:
        with pytest.raises(ValueError, match="Set fp16=True and bf16=False"):
            check_options(model, args)


def test_the_refusal_names_what_to_set_for_the_float16_policy_under_the_default_bf16(tmp_path, qwen3):
    with pytest.raises(ValueError) as err:
        check_options(qwen3, _args(tmp_path, "fp16", "bf16=True", "engine-fp16"))
    assert "Set fp16=True and bf16=False" in str(err.value)


def test_why_bf16_autocast_misaligns_a_float16_policy():
    """The reason for the refusal, as torch computes it: under CPU bf16 autocast an fp16 linear returns bf16."""
    linear = torch.nn.Linear(8, 8).to(torch.float16)
    x = torch.randn(2, 8, dtype=torch.float16)
    assert linear(x).dtype == torch.float16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(x).dtype == torch.bfloat16


@pytest.mark.parametrize(("policy", "flags", "engine"), sorted(ALIGNED))
def test_without_alignment_the_dtypes_are_not_policed(tmp_path, qwen3, policy, flags, engine):
    """roundalign_regions=[] (a baseline that measures TRL's defaults): only the refusal that predates this table
    (fp16=True on a non-fp16 policy) applies; the aligned rows stay accepted."""
    args = _args(tmp_path, policy, flags, engine)
    args.roundalign_regions = []
    check_options(qwen3, args)
    args = _args(tmp_path, "fp16", "bf16=True", "engine-bf16")
    args.roundalign_regions = []
    check_options(qwen3, args)
