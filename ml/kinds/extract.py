"""Where a completion states its final answer.

The answer format every answer-only kind asks for, in the order looked for:

1. the last `<answer>...</answer>` (reasoning-gym's convention);
2. the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced;
3. the last line reading `Answer: ...` or `Final answer: ...` (any case, `**` allowed around it);

When none is there, the whole completion (stripped) stands for the answer and
`marked` is False: the kinds still score it, and report `format_ok = 0`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal

MAX_ANSWER_CHARS = 10_000  # what any scorer gets to see: keeps regexes and parsers on bounded input

# Patterns run on model output, so none may backtrack: no two adjacent quantifiers over the same characters.
# "Answer: 42", "Final answer: 42", "The final answer is: 42"; where no line reads so, "The answer is 42".
_LINE = re.compile(r"^[ \t>*_#-]*(?:the )?(?:final )?answer(?: is)?\**[ \t]*[:：](.*)$", re.IGNORECASE | re.MULTILINE)
_LINE_IS = re.compile(r"^[ \t>*_#-]*(?:the )?(?:final )?answer is\**[ \t]+(.*)$", re.IGNORECASE | re.MULTILINE)
# A number as an answer writes it: digits with separators, a sign, a decimal part, an exponent.
NUMBER = re.compile(r"[-+−]?\d[\d,_]*(?:\.\d+)?(?:[eE][-+]?\d+)?")


def numbers(text: str) -> list[str]:
    """The numbers written in `text` (a hedge writes several)."""
    return NUMBER.findall(text)


def hedges(answer: str, expected: str) -> bool:
    """Whether an answer to a question whose expected answer is one number writes other than that one
    number: several numbers, every one a candidate ("20 or 5", "-61 0", where a scorer that finds the
    first, the last or any contained one would pay it), or one of another value ("-20" for 20, which a
    scorer reading digits without the sign took for 20)."""
    wanted = numbers(expected)
    if len(wanted) != 1 or wanted[0] != expected.strip():
        return False
    written = numbers(answer)
    if len(written) != 1:
        return True
    try:
        return value_of(written[0]) != value_of(wanted[0])
    except ValueError:
        return False


def value_of(number: str) -> float:
    """A number as `numbers` finds it, as a float (ValueError, OverflowError where it is none)."""
    return float(_plain_number(number))


def decimal_of(number: str) -> Decimal | None:
    """A number as `numbers` finds it, exactly (a Decimal), or None where it is none (an exponent past any)."""
    try:
        value = Decimal(_plain_number(number))
    except ArithmeticError:
        return None
    return value if value.is_finite() else None


def _plain_number(number: str) -> str:
    return number.replace(",", "").replace("_", "").replace("−", "-")


@dataclass(frozen=True)
class Extracted:
    text: str
    marked: bool  # the completion used one of the answer formats
    how: str      # "tag", "boxed", "line" or "whole"


def final_answer(completion: str) -> Extracted:
    """The completion's final answer. What a closed <think>...</think> holds is reasoning, not the answer:
    only the text after the last `</think>` is read (an answer tag inside the thinking, followed by
    another answer outside it, once won by format rank)."""
    return _marked(completion, lines=False)


def answer_block(completion: str) -> str:
    """A final answer that may take several lines (a row a line), found as final_answer finds one, except
    that an `Answer:` label's answer is the rest of its line and every line after it."""
    return _marked(completion, lines=True).text


def _marked(completion: str, lines: bool) -> Extracted:
    completion = after_thinking(completion)
    tagged = last_tagged(completion)
    if tagged is not None:
        return Extracted(_clip(tagged.strip()), True, "tag")
    boxed = last_boxed(completion)
    if boxed is not None:
        return Extracted(_clip(boxed.strip()), True, "boxed")
    for pattern in (_LINE, _LINE_IS):
        label = _last(pattern, completion)
        if label is None:
            continue
        text = completion[label.start(1):] if lines else label.group(1)
        if not lines and not text.strip().strip("*_").strip():  # "**Answer:**" alone: the answer is on the next line
            text = next(iter(completion[label.end():].strip().splitlines()), "")
        # (a final period is the sentence's, not the answer's: "The answer is 3/4.")
        text = text.strip().strip("*_").strip().removesuffix(".").strip()
        if text:
            return Extracted(_clip(text), True, "line")
    return Extracted(_clip(completion.strip()), False, "whole")


def after_thinking(completion: str) -> str:
    """The text after the last `</think>` (all of it where there is none)."""
    thinking = _last(_THINK_END, completion)
    return completion if thinking is None else completion[thinking.end():]


def _last(pattern: re.Pattern, text: str) -> re.Match | None:
    match = None
    for match in pattern.finditer(text):
        pass
    return match


_THINK_END = re.compile(r"</think>", re.IGNORECASE)  # (found in the text itself: "İ".lower() is two characters)
_TAGS: dict[str, tuple[re.Pattern, re.Pattern]] = {}


def last_tagged(text: str, tag: str = "answer") -> str | None:
    """The content of the last <answer>...</answer> (any case): the last closing tag, and the last opening
    one before it (matched in the text itself, never in a lowered copy whose positions can differ)."""
    opening, closing = _TAGS.get(tag) or _TAGS.setdefault(
        tag, (re.compile(f"<{re.escape(tag)}>", re.IGNORECASE), re.compile(f"</{re.escape(tag)}>", re.IGNORECASE)))
    end = _last(closing, text)
    if end is None:
        return None
    start = _last(opening, text[:end.start()])
    if start is None:
        return None
    return text[start.end():end.start()]


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} or \\fbox{...}, or None when there is none or it never closes."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
        i += 1
    return None


def _clip(text: str) -> str:
    return text[:MAX_ANSWER_CHARS]
