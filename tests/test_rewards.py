"""Reward functions on tricky answers, in TRL's calling convention."""

from __future__ import annotations

import functools
import threading

import pytest

from trl_roundalign.rewards import (
    REWARD_FUNCS,
    answers_match,
    arithmetic_partial_reward,
    arithmetic_reward,
    boxed_math_reward,
    completion_text,
    get_reward_funcs,
    is_truncated,
    last_boxed,
    normalize_answer,
    r1_math_reward,
)


def r1(answer_part: str, thinking: str = "Let me compute. Maybe \\boxed{999} first?") -> str:
    """A DeepSeek-R1-distill completion: the chat template already opened <think>."""
    return f"{thinking}\n</think>\n\n{answer_part}"


def conv(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def score(completion, truth, **kwargs) -> float:
    return r1_math_reward([completion], reward_model=[{"ground_truth": truth, "style": "rule"}], **kwargs)[0]


@pytest.mark.parametrize(
    "boxed, truth",
    [
        (r"\frac{1}{2}", r"\frac{1}{2}"),
        (r"\dfrac12", r"\frac{1}{2}"),
        (r"\tfrac{1}{2}", r"\frac12"),
        ("0.5", r"\frac{1}{2}"),  # symbolic (math_verify)
        (r"\frac{1}{2}", "0.5"),
        ("1/2", r"\dfrac{1}{2}"),
        (r"5\text{ cm}", "5"),
        ("5", r"5\text{ cm}"),
        (r"90^\circ", "90"),
        (r"50\%", "50"),
        (r"\$18.90", "18.90"),
        ("x = 3", "3"),
        ("-7", "-7"),
        ("\u22127", "-7"),  # Unicode minus
        (r"\sqrt2", r"\sqrt{2}"),
        (r"2\sqrt{2}", r"\sqrt{8}"),  # symbolic
        (r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt3}{2}"),
        (r"[1, 3)", "[1,3)"),
        (r"\left(-\infty, 2\right]", r"(-\infty,2]"),
        ("1{,}000", "1000"),
        ("10.", "10"),
        (r"\{1,2\}", r"\{2,1\}"),  # symbolic: sets
    ],
)
def test_correct_answers(boxed, truth):
    assert score(r1(f"The answer is $\\boxed{{{boxed}}}$."), truth) == 1.0


@pytest.mark.parametrize(
    "boxed, truth",
    [
        ("3", "4"),
        ("-7", "7"),
        (r"\frac{1}{3}", "0.5"),
        (r"\sqrt{3}", r"\sqrt{2}"),
        ("(1,3)", "[1,3]"),  # open vs closed interval
        ("[1,3)", "(1,3]"),
        ("12", "1.2"),
    ],
)
def test_wrong_answers(boxed, truth):
    assert score(r1(f"\\boxed{{{boxed}}}"), truth) == 0.0


def test_nested_braces_and_fbox():
    assert score(r1(r"\boxed{\frac{a}{b}}"), r"\frac{a}{b}") == 1.0
    assert score(r1(r"\boxed{\frac{2^{10}}{3}}"), r"\frac{1024}{3}") == 1.0
    assert score(r1(r"\fbox{42}"), "42") == 1.0
    assert score(r1(r"so \boxed 42"), "42") == 1.0


def test_last_box_after_think_wins():
    assert score(r1(r"First \boxed{3}, no wait: \boxed{4}"), "4") == 1.0
    assert score(r1(r"First \boxed{4}, no wait: \boxed{3}"), "4") == 0.0
    # a box inside the thinking does not count
    assert score(r1("I give up.", thinking=r"It is \boxed{4}"), "4") == 0.0


def test_format_failures_score_zero():
    assert score(r1("The answer is 4."), "4") == 0.0  # no box
    assert score(r"Thinking \boxed{4}", "4") == 0.0  # no </think>
    assert score(r"a</think>b</think>\boxed{4}", "4") == 0.0  # two </think>
    assert score(r1(r"\boxed{4"), "4") == 0.0  # unclosed box


def test_truncated_completions_score_zero():
    text = r1(r"\boxed{4}")
    eos = 151643
    assert score(text, "4", completion_ids=[[1, 2, 3]], max_completion_length=4) == 1.0
    assert score(text, "4", completion_ids=[[1, 2, 3, 4]], max_completion_length=4) == 0.0  # hit the limit
    # with EOS ids known, stopping on the last allowed token is not a truncation
    assert score(text, "4", completion_ids=[[1, 2, 3, eos]], max_completion_length=4, eos_token_ids=[eos]) == 1.0
    assert score(text, "4", completion_ids=[[1, 2, 3, 4]], max_completion_length=4, eos_token_ids=[eos]) == 0.0
    # without the limit, truncation cannot be told (documented)
    assert score(text, "4", completion_ids=[[1, 2, 3, 4]]) == 1.0


def test_boxed_math_reward_needs_no_think():
    truth = [{"ground_truth": r"\frac{1}{2}"}]
    assert boxed_math_reward([r"So \boxed{0.5}."], reward_model=truth) == [1.0]
    assert boxed_math_reward([r"\boxed{1} no, \boxed{\dfrac12}"], reward_model=truth) == [1.0]
    assert boxed_math_reward([r"a</think>b</think>\boxed{0.5}"], reward_model=truth) == [1.0]  # think is ignored
    assert boxed_math_reward(
        [r"\boxed{0.5}"], reward_model=truth, completion_ids=[[1, 2]], max_completion_length=2
    ) == [0.0]
    assert boxed_math_reward(["one half"], reward_model=truth) == [0.0]


def test_is_truncated():
    assert not is_truncated([1, 2], 3)
    assert is_truncated([1, 2, 3], 3)
    assert not is_truncated([1, 2, 0], 3, eos_token_ids=[0])
    assert not is_truncated(None, 3)
    assert not is_truncated([1, 2, 3], None)


def test_ground_truth_sources_and_batch():
    comps = [r1(r"\boxed{4}"), r1(r"\boxed{5}"), conv(r1(r"\boxed{\frac12}"))]
    assert r1_math_reward(comps, ground_truth=["4", "4", "0.5"]) == [1.0, 0.0, 1.0]
    assert r1_math_reward(comps, answer=["4", "5", r"\frac{1}{2}"]) == [1.0, 1.0, 1.0]
    rm = [{"ground_truth": "4"}, {"ground_truth": "5"}, {"ground_truth": r"\boxed{\frac{1}{2}}"}]
    # reward_model wins over the other columns
    assert r1_math_reward(comps, reward_model=rm, ground_truth=["0", "0", "0"]) == [1.0, 1.0, 1.0]
    assert r1_math_reward([r1(r"\boxed{6}")], ground_truth=[["5", "6"]]) == [1.0]  # any of several
    with pytest.raises(ValueError, match="ground truth"):
        r1_math_reward(comps)
    with pytest.raises(ValueError, match="completion_ids"):
        r1_math_reward(comps, answer=["4"] * 3, completion_ids=[[1]])


def test_trl_calling_convention():
    """TRL passes prompts, completion_ids, every column, trainer_state, log_extra and log_metric."""
    comps = [conv(r1(r"\boxed{4}")), conv(r1(r"\boxed{3}"))]
    out = r1_math_reward(
        prompts=[[{"role": "user", "content": "2+2?"}]] * 2,
        completions=comps,
        completion_ids=[[5, 6], [5, 6]],
        reward_model=[{"ground_truth": "4"}] * 2,
        data_source=["math"] * 2,
        trainer_state=None,
        log_extra=lambda *a: None,
        log_metric=lambda *a: None,
    )
    assert out == [1.0, 0.0]


def test_parsed_reasoning_is_rebuilt():
    """With a response template TRL splits off the reasoning and consumes </think>."""
    msg = [{"role": "assistant", "reasoning_content": "think think", "content": r"\boxed{4}"}]
    assert completion_text(msg) == r"think think</think>\boxed{4}"
    assert score(msg, "4") == 1.0
    assert completion_text([{"role": "assistant", "thinking": "t", "content": "c"}]) == "t</think>c"
    assert completion_text("plain") == "plain"
    assert completion_text([{"role": "assistant", "content": None}]) == ""


def test_symbolic_fallback_outside_the_main_thread():
    """math_verify's signal-based timeouts only work in the main thread: they are turned off elsewhere."""
    results = []
    thread = threading.Thread(target=lambda: results.append(answers_match("0.5", r"\frac{1}{2}")))
    thread.start()
    thread.join(60)
    assert results == [True]


def test_helpers():
    assert last_boxed(r"\boxed{a} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"
    assert last_boxed("nothing") is None
    assert last_boxed(r"\boxed{open") is None
    assert last_boxed(r"\boxedx{1}") is None
    assert normalize_answer(r"\left( 1, 2 \right]") == "(1,2]"
    assert normalize_answer(r"k = \dfrac12") == r"\frac{1}{2}"
    assert normalize_answer(r"10\text{ cm}^2") == "10"
    assert normalize_answer(r"\text{(A)}") == "(A)"
    assert normalize_answer(".5") == "0.5"
    assert normalize_answer("a=b=c") == "a=b=c"


@pytest.mark.parametrize(
    "text, answer, expected",
    [
        ("12", "12", 1.0),
        ("The answer is 12.", "12", 1.0),
        ("7 plus 5 is 12", "12", 1.0),
        ("7 + 5 = 13", "12", 0.0),
        ("12.0", "12", 1.0),
        ("12.5", "12", 0.0),
        ("It is -5", "-5", 1.0),
        ("It is 5", "-5", 0.0),
        (r"\boxed{12} and then 3", "12", 1.0),  # the box wins over a later number
        ("no number", "3", 0.0),
        ("", "3", 0.0),
    ],
)
def test_arithmetic_reward(text, answer, expected):
    assert arithmetic_reward([text], answer=[answer]) == [expected]
    assert arithmetic_reward([conv(text)], answer=[answer], prompts=[None], completion_ids=[[1]]) == [expected]


def test_arithmetic_reward_checks_lengths():
    with pytest.raises(ValueError):
        arithmetic_reward(["1", "2"], answer=["1"])


@pytest.mark.parametrize(
    "text, answer, expected",
    [
        ("The answer is 12", "12", 1.0),
        ("13", "12", 0.45),
        ("10", "12", 0.5 * 0.81),
        ("-5", "5", 0.5 * 0.9**10),
        (r"\boxed{12} and then 3", "12", 1.0),
        ("no number", "3", 0.0),
        ("1" * 40, "3", 0.0),  # a huge number: credit ~1e-46, no overflow
    ],
)
def test_arithmetic_partial_reward(text, answer, expected):
    assert arithmetic_partial_reward([text], answer=[answer]) == pytest.approx([expected], abs=1e-12)
    assert arithmetic_partial_reward([conv(text)], answer=[answer]) == pytest.approx([expected], abs=1e-12)


def test_arithmetic_partial_reward_never_beats_a_right_answer():
    rewards = arithmetic_partial_reward([str(v) for v in range(-50, 150)], answer=["72"] * 200)
    assert max(rewards) == 1.0 and sorted(rewards)[-2] == 0.45
    with pytest.raises(ValueError):
        arithmetic_partial_reward(["1", "2"], answer=["1"])


def test_registry_and_binding():
    assert set(REWARD_FUNCS) == {"r1_math_reward", "boxed_math_reward", "arithmetic_reward", "arithmetic_partial_reward"}
    funcs = get_reward_funcs(["r1_math_reward", "arithmetic_reward"], max_completion_length=4, eos_token_ids=[0])
    assert isinstance(funcs[0], functools.partial) and funcs[0].func is r1_math_reward
    assert funcs[0].keywords == {"max_completion_length": 4, "eos_token_ids": [0]}
    assert funcs[1] is arithmetic_reward
    text = r1(r"\boxed{4}")
    assert funcs[0]([text], completion_ids=[[1, 2, 3, 9]], answer=["4"]) == [0.0]
    assert funcs[0]([text], completion_ids=[[1, 2, 3, 0]], answer=["4"]) == [1.0]
    assert get_reward_funcs(["r1_math_reward"]) == [r1_math_reward]
    assert get_reward_funcs(["boxed_math_reward"], max_completion_length=8)[0].keywords == {"max_completion_length": 8}
    with pytest.raises(ValueError, match="Unknown reward"):
        get_reward_funcs(["nope"])
