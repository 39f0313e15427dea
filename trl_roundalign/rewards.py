"""Reward functions with TRL's reward-function signature.

TRL 1.16 calls every reward function as
`f(prompts=..., completions=..., completion_ids=..., **columns, trainer_state=..., log_extra=..., log_metric=...)`:
`completions` are strings (standard prompts) or one-message conversations
`[{"role": "assistant", "content": ...}]` (conversational prompts), `completion_ids` are the
unpadded token ids of each completion (vLLM's output, EOS included when the model stopped), and
every other dataset column arrives as a list with one entry per completion.

- `r1_math_reward`: the DeepSeek-R1-distill math reward (sail's Sanity-Test sets): a completion
  cut at the length limit scores 0; it must contain exactly one `</think>`; the answer is the last
  `\\boxed{...}` (or `\\fbox{...}`) after it; it matches the ground truth by normalised string
  comparison, then by `math_verify`'s symbolic comparison.
- `boxed_math_reward`: the same without the `</think>` rule, for base models that do not think.
- `arithmetic_reward`: the CPU demo's reward: the last integer of the completion (or of its last
  `\\boxed{}`) equals the answer.
- `arithmetic_partial_reward`: the same with partial credit for a close number (the stability study's
  reward: a dense learning signal for a model that is rarely exactly right).

`REWARD_FUNCS` maps names (as a recipe's `reward_funcs` lists them) to functions, and
`get_reward_funcs` binds what TRL does not pass (`max_completion_length`, `eos_token_ids`).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "REWARD_FUNCS",
    "answers_match",
    "arithmetic_partial_reward",
    "arithmetic_reward",
    "boxed_math_reward",
    "completion_text",
    "get_reward_funcs",
    "is_truncated",
    "last_boxed",
    "normalize_answer",
    "r1_math_reward",
]

Completion = str | Sequence[dict[str, Any]]

# ----------------------------------------------------------------------------------------------
# Reading completions


def completion_text(completion: Completion) -> str:
    """The text of one completion as the model produced it.

    Args:
        completion (`str` or `list[dict]`):
            A string, or a conversation (TRL gives `[{"role": "assistant", "content": ...}]`).

    Returns:
        `str`: the string itself, or the last assistant message's content. When TRL parsed the response
        with a tokenizer response template, the reasoning sits in `reasoning_content` (or `thinking`) and
        the `</think>` was consumed: the text is rebuilt as `reasoning + "</think>" + content`.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    messages = [m for m in completion if isinstance(m, dict)]
    assistant = [m for m in messages if m.get("role", "assistant") == "assistant"] or messages
    if not assistant:
        return ""
    message = assistant[-1]
    content = message.get("content") or ""
    if isinstance(content, list):  # multimodal-style parts
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    reasoning = message.get("reasoning_content", message.get("thinking"))
    if reasoning is not None:
        return f"{reasoning}</think>{content}"
    return str(content)


def is_truncated(
    ids: Sequence[int] | None,
    max_completion_length: int | None,
    eos_token_ids: Sequence[int] | None = None,
) -> bool:
    """Whether a completion was cut at the length limit.

    vLLM stops a completion either at an EOS token (kept in `completion_ids`) or after
    `max_completion_length` tokens. A completion is truncated when it has `max_completion_length`
    (or more) tokens and, if `eos_token_ids` are known, its last token is not one of them (TRL's own
    `completions/clipped_ratio` test). Without `eos_token_ids`, every completion of the full length counts
    as truncated, including the rare one whose EOS is exactly the last allowed token.

    Args:
        ids (`Sequence[int]` or `None`): the completion's token ids; `None` means unknown (not truncated).
        max_completion_length (`int` or `None`): the generation limit; `None` means unknown (not truncated).
        eos_token_ids (`Sequence[int]`, *optional*): the tokens that end a completion (EOS and pad).

    Returns:
        `bool`
    """
    if ids is None or max_completion_length is None:
        return False
    if len(ids) < max_completion_length:
        return False
    if eos_token_ids is not None and len(ids) > 0 and ids[-1] in set(eos_token_ids):
        return False
    return True


def _braced(s: str, start: int) -> int | None:
    """Index just past the group `{...}` opening at `s[start]`, or `None` if unbalanced."""
    depth = 0
    for j in range(start, len(s)):
        if s[j] == "{" and (j == 0 or s[j - 1] != "\\"):
            depth += 1
        elif s[j] == "}" and (j == 0 or s[j - 1] != "\\"):
            depth -= 1
            if depth == 0:
                return j + 1
    return None


_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` or `\\fbox{...}` in `text`.

    Braces nest (`\\boxed{\\frac{a}{b}}` gives `\\frac{a}{b}`). `\\boxed 5` (no braces) gives the token after
    the space, up to whitespace or `$`. An unclosed last box (a cut completion) gives `None`, as does a
    text without any box.
    """
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None
    i = matches[-1].end()
    while i < len(text) and text[i] in " \t":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        token = re.match(r"[^\s$]+", text[i:])
        return token.group(0) if token else None
    end = _braced(text, i)
    return None if end is None else text[i + 1 : end - 1]


# ----------------------------------------------------------------------------------------------
# Normalisation


def _fix_fracs(s: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{x}` -> `\\frac{1}{x}`, `\\frac{a}2` -> `\\frac{a}{2}`."""
    out, i = [], 0
    while True:
        k = s.find("\\frac", i)
        if k < 0:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i : k + 5])
        i = k + 5
        args = []
        for _ in range(2):
            if i < len(s) and s[i] == "{":
                end = _braced(s, i)
                if end is None:
                    break
                args.append(s[i:end])
                i = end
            elif i < len(s) and s[i] not in "\\}":
                args.append("{" + s[i] + "}")
                i += 1
            else:
                break
        out.append("".join(args))


def _fix_sqrt(s: str) -> str:
    """`\\sqrt2` -> `\\sqrt{2}`, `\\sqrt x` stays a one-token argument."""
    return re.sub(r"\\sqrt(?![A-Za-z{\[])\s*([^\s{\\])", r"\\sqrt{\1}", s)


_TEXT_WRAPPERS = ("\\text", "\\textbf", "\\textrm", "\\mathrm", "\\mathbf", "\\mbox", "\\textit", "\\operatorname")


def _unwrap(s: str, commands: Sequence[str]) -> str:
    """Replace `\\cmd{x}` by `x` for the given commands (innermost content kept, braces balanced)."""
    for cmd in sorted(commands, key=len, reverse=True):
        while True:
            m = re.search(re.escape(cmd) + r"\s*\{", s)
            if not m:
                break
            start = m.end() - 1
            end = _braced(s, start)
            if end is None:
                break
            s = s[: m.start()] + s[start + 1 : end - 1] + s[end:]
    return s


_UNIT_RE = re.compile(r"^(.*?[\d}.)])\s*\\(?:text|mbox|mathrm|textrm)\s*\{\s*[A-Za-z][A-Za-z .^0-9]*\}(\^\{?\d\}?)?$")


def normalize_answer(answer: str) -> str:
    """Normalise a LaTeX answer for string comparison.

    Removes whitespace, `\\left`/`\\right`, spacing commands (`\\!`, `\\,`, `\\;`, `\\:`, `\\quad`),
    `\\displaystyle`, dollars, degrees (`^\\circ`, `°`), percent signs, a unit in text after a number
    (`5\\text{ cm}` -> `5`), a trailing period, a leading `x=` (a variable name of at most two
    characters), thousands separators (`1,000`, `1{,}000`) and `\\text{...}`-like wrappers; rewrites
    `\\dfrac`/`\\tfrac` as `\\frac`, `\\frac12` as `\\frac{1}{2}`, `\\sqrt2` as `\\sqrt{2}`, a plain `a/b` of
    integers as `\\frac{a}{b}`, `.5` as `0.5`, `\\le`/`\\ge` as `\\leq`/`\\geq`, and the Unicode minus as `-`.

    Args:
        answer (`str`): a boxed answer or a ground truth.

    Returns:
        `str`: the normalised string (compare two of them with `==`).
    """
    s = str(answer).strip()
    s = s.replace("\n", " ").replace("\u2212", "-").replace("\\$", "").replace("$", "")
    s = re.sub(r"\\(?:left|right)(?![A-Za-z])\s*", "", s)
    s = re.sub(r"\\(?:!|,|;|:| )", " ", s)
    s = re.sub(r"\\(?:quad|qquad|displaystyle)(?![A-Za-z])", " ", s)
    s = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", s)
    s = re.sub(r"\\le(?![A-Za-z])", r"\\leq", s)
    s = re.sub(r"\\ge(?![A-Za-z])", r"\\geq", s)
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "", s).replace("°", "")
    s = s.replace("\\%", "").replace("%", "")
    s = s.strip()
    unit = _UNIT_RE.match(s)
    if unit:
        s = unit.group(1)
    s = _unwrap(s, _TEXT_WRAPPERS)
    s = s.replace("{,}", "")
    s = s.strip().rstrip(".").strip()
    # a leading short variable name: `x = 5`, `k=3` (not `a=b=c`, not `\alpha = 2`)
    m = re.match(r"^([A-Za-z]{1,2}|[A-Za-z]_\{?\w\}?)\s*=\s*(.+)$", s)
    if m and "=" not in m.group(2):
        s = m.group(2)
    s = re.sub(r"\s+", "", s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    s = _fix_sqrt(s)
    s = _fix_fracs(s)
    frac = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if frac:
        s = f"\\frac{{{frac.group(1)}}}{{{frac.group(2)}}}"
    s = re.sub(r"(?<![\d}])\.(\d)", r"0.\1", s)
    return s


# ----------------------------------------------------------------------------------------------
# Comparison


def _math_verify_equal(pred: str, gold: str) -> bool:
    """Symbolic comparison with `math_verify`; `False` on any failure of the comparison.

    `math_verify` bounds parsing and comparison with `signal.alarm`, which only works in the main thread
    (elsewhere `signal.signal` raises `ValueError`). In other threads (TRL runs async reward functions in
    a background event loop) its timeouts are disabled: a pathological expression can then take long.

    Raises:
        ImportError: `math_verify` is not installed (the `[recipes]` extra): one line. Never a silent `False`,
            which would score right answers as wrong.
    """
    from ._extras import require

    math_verify = require("math_verify", "recipes", "the math rewards' symbolic answer check")
    parse, verify = math_verify.parse, math_verify.verify
    main = threading.current_thread() is threading.main_thread()
    parse_timeout = 5 if main else None
    verify_timeout = 5 if main else None
    try:
        gold_parsed = parse(f"${gold}$", parsing_timeout=parse_timeout)
        if not gold_parsed:
            gold_parsed = parse(gold, parsing_timeout=parse_timeout)
        pred_parsed = parse(f"${pred}$", parsing_timeout=parse_timeout)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=verify_timeout))
    except Exception as err:  # noqa: BLE001 - grading must never stop training
        logger.debug("math_verify failed on pred=%r gold=%r: %s", pred, gold, err)
        return False


def answers_match(pred: str, gold: str, *, symbolic: bool = True) -> bool:
    """Whether a predicted answer equals the ground truth.

    Args:
        pred (`str`): the extracted answer (content of the last box).
        gold (`str`): the ground truth (a box in it is unwrapped first).
        symbolic (`bool`, *optional*, defaults to `True`): fall back to `math_verify` when the normalised strings differ.

    Returns:
        `bool`
    """
    gold_box = last_boxed(gold)
    if gold_box is not None:
        gold = gold_box
    if normalize_answer(pred) == normalize_answer(gold):
        return True
    return symbolic and _math_verify_equal(pred, gold)


def _ground_truths(ground_truth, reward_model, answer) -> list[Any]:
    if reward_model is not None:
        out = []
        for i, rm in enumerate(reward_model):
            if isinstance(rm, dict) and rm.get("ground_truth") is not None:
                out.append(rm["ground_truth"])
            elif ground_truth is not None:
                out.append(ground_truth[i])
            elif answer is not None:
                out.append(answer[i])
            else:
                raise ValueError(f"reward_model[{i}] has no 'ground_truth' and there is no ground_truth/answer column.")
        return out
    if ground_truth is not None:
        return list(ground_truth)
    if answer is not None:
        return list(answer)
    raise ValueError(
        "The math rewards need the ground truth: a `reward_model` column with a 'ground_truth' key "
        "(sail/Sanity-Test), or a `ground_truth` or `answer` column."
    )


# ----------------------------------------------------------------------------------------------
# Reward functions


def r1_math_reward(
    completions: Sequence[Completion],
    ground_truth: Sequence[Any] | None = None,
    reward_model: Sequence[dict[str, Any]] | None = None,
    completion_ids: Sequence[Sequence[int]] | None = None,
    max_completion_length: int | None = None,
    eos_token_ids: Sequence[int] | None = None,
    **kwargs,
) -> list[float]:
    """DeepSeek-R1-distill math reward: 1.0 for a correct final answer, else 0.0.

    A completion scores 0 when it is truncated (see `is_truncated`), when it does not contain exactly one
    `</think>`, when no `\\boxed{}`/`\\fbox{}` follows the `</think>`, or when the last box after it does
    not match the ground truth (`answers_match`: normalised strings, then `math_verify`).

    Args:
        completions (`Sequence[str | list[dict]]`): TRL's completions.
        ground_truth (`Sequence`, *optional*): a `ground_truth` column.
        reward_model (`Sequence[dict]`, *optional*): a `reward_model` column whose `"ground_truth"` is the
            answer (sail/Sanity-Test-R1D-1.5B's layout); takes precedence over `ground_truth` and `answer`.
            A ground truth that is a list means "any of these".
        completion_ids (`Sequence[Sequence[int]]`, *optional*): TRL passes each completion's token ids.
        max_completion_length (`int`, *optional*): the generation limit; TRL does not pass it, bind it with
            `get_reward_funcs` (or `functools.partial`). Without it truncation is not detected (a cut
            completion then usually fails the `</think>`/box checks anyway).
        eos_token_ids (`Sequence[int]`, *optional*): EOS/pad ids, to tell a completion that stopped exactly
            at the limit from a cut one; bind it like `max_completion_length`.
        **kwargs: other columns (`answer` is used when the two above are absent) and TRL's extras.

    Returns:
        `list[float]`: one reward per completion.
    """
    return _math_rewards(
        completions,
        _ground_truths(ground_truth, reward_model, kwargs.get("answer")),
        completion_ids,
        max_completion_length,
        eos_token_ids,
        require_think=True,
    )


def boxed_math_reward(
    completions: Sequence[Completion],
    ground_truth: Sequence[Any] | None = None,
    reward_model: Sequence[dict[str, Any]] | None = None,
    completion_ids: Sequence[Sequence[int]] | None = None,
    max_completion_length: int | None = None,
    eos_token_ids: Sequence[int] | None = None,
    **kwargs,
) -> list[float]:
    """Math reward for models without a thinking section (base models): `r1_math_reward` minus the
    `</think>` rule.

    The answer is the last `\\boxed{}`/`\\fbox{}` of the whole completion; a truncated completion scores 0.
    Arguments and ground-truth sources are those of `r1_math_reward`.

    Returns:
        `list[float]`: one reward (1.0 or 0.0) per completion.
    """
    return _math_rewards(
        completions,
        _ground_truths(ground_truth, reward_model, kwargs.get("answer")),
        completion_ids,
        max_completion_length,
        eos_token_ids,
        require_think=False,
    )


def _math_rewards(
    completions: Sequence[Completion],
    truths: list[Any],
    completion_ids: Sequence[Sequence[int]] | None,
    max_completion_length: int | None,
    eos_token_ids: Sequence[int] | None,
    *,
    require_think: bool,
) -> list[float]:
    if len(truths) != len(completions):
        raise ValueError(f"{len(completions)} completions but {len(truths)} ground truths.")
    if completion_ids is not None and len(completion_ids) != len(completions):
        raise ValueError(f"{len(completions)} completions but {len(completion_ids)} completion_ids.")
    rewards = []
    for i, (completion, truth) in enumerate(zip(completions, truths)):
        ids = completion_ids[i] if completion_ids is not None else None
        if is_truncated(ids, max_completion_length, eos_token_ids):
            rewards.append(0.0)
            continue
        text = completion_text(completion)
        if require_think:
            if text.count("</think>") != 1:
                rewards.append(0.0)
                continue
            text = text.split("</think>", 1)[1]
        pred = last_boxed(text)
        if pred is None or truth is None:
            rewards.append(0.0)
            continue
        golds = truth if isinstance(truth, list | tuple) else [truth]
        rewards.append(float(any(answers_match(pred, str(g)) for g in golds)))
    return rewards


_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


def arithmetic_reward(completions: Sequence[Completion], answer: Sequence[Any], **kwargs) -> list[float]:
    """CPU-demo reward: 1.0 when the completion's last number equals the integer answer, else 0.0.

    The number is taken from the last `\\boxed{}` when there is one, else from the whole text; it may be
    negative and may be written with a zero fraction (`12.0`).

    Args:
        completions (`Sequence[str | list[dict]]`): TRL's completions.
        answer (`Sequence[str | int]`): the exact integer answers (strings in the packaged data).
        **kwargs: ignored (TRL's other columns and extras).

    Returns:
        `list[float]`: one reward per completion.
    """
    return [0.0 if e is None else float(e == 0) for e in _arithmetic_errors(completions, answer)]


def _arithmetic_errors(completions: Sequence[Completion], answer: Sequence[Any]) -> list[float | None]:
    """`|last number - answer|` per completion (None without a number): what both arithmetic rewards grade."""
    if len(answer) != len(completions):
        raise ValueError(f"{len(completions)} completions but {len(answer)} answers.")
    errors = []
    for completion, target in zip(completions, answer):
        text = completion_text(completion)
        boxed = last_boxed(text)
        numbers = _NUMBER_RE.findall(boxed if boxed is not None else text)
        errors.append(abs(float(numbers[-1]) - int(str(target).strip())) if numbers else None)
    return errors


def arithmetic_partial_reward(completions: Sequence[Completion], answer: Sequence[Any], **kwargs) -> list[float]:
    """Arithmetic reward with partial credit: 1.0 for the right number, `0.5 * 0.9 ** |error|` for a wrong one,
    0.0 without a number.

    The number is read as in `arithmetic_reward`. A small model rarely gets these prompts exactly right
    (SmolLM2-135M: about 5%), so with the 0/1 reward most groups of completions have equal rewards and GRPO's
    advantages are zero; closeness gives nearly every group a spread, so every step carries a gradient. Credit
    halves about every 7 units of error; no wrong answer earns more than half a right one.

    Args:
        completions (`Sequence[str | list[dict]]`): TRL's completions.
        answer (`Sequence[str | int]`): the exact integer answers (strings in the packaged data).
        **kwargs: ignored (TRL's other columns and extras).

    Returns:
        `list[float]`: one reward per completion.
    """
    return [
        0.0 if e is None else 1.0 if e == 0 else 0.5 * 0.9 ** min(e, 1000.0)
        for e in _arithmetic_errors(completions, answer)
    ]


REWARD_FUNCS: dict[str, Callable[..., list[float]]] = {
    "r1_math_reward": r1_math_reward,
    "boxed_math_reward": boxed_math_reward,
    "arithmetic_reward": arithmetic_reward,
    "arithmetic_partial_reward": arithmetic_partial_reward,
}


def get_reward_funcs(
    names: Sequence[str],
    *,
    max_completion_length: int | None = None,
    eos_token_ids: Sequence[int] | None = None,
) -> list[Callable[..., list[float]]]:
    """Reward functions by name, with the truncation facts TRL does not pass bound in.

    Args:
        names (`Sequence[str]`): keys of `REWARD_FUNCS` (e.g. a recipe's `reward_funcs`).
        max_completion_length (`int`, *optional*): bound into the functions that accept it (the math rewards).
        eos_token_ids (`Sequence[int]`, *optional*): bound likewise (the tokenizer's EOS ids and pad id).

    Returns:
        `list[Callable]`: `functools.partial` objects where something was bound (TRL names them after the
        wrapped function), else the functions themselves.

    Raises:
        ValueError: an unknown name.
    """
    funcs = []
    for name in names:
        if name not in REWARD_FUNCS:
            raise ValueError(f"Unknown reward function {name!r}; known: {', '.join(REWARD_FUNCS)}.")
        func = REWARD_FUNCS[name]
        bound = {}
        if func in (r1_math_reward, boxed_math_reward):
            if max_completion_length is not None:
                bound["max_completion_length"] = max_completion_length
            if eos_token_ids is not None:
                bound["eos_token_ids"] = list(eos_token_ids)
        funcs.append(functools.partial(func, **bound) if bound else func)
    return funcs
