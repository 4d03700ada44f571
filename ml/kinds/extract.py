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

MAX_ANSWER_CHARS = 10_000  # what any scorer gets to see: keeps regexes and parsers on bounded input

# Patterns run on model output, so none may backtrack: no two adjacent quantifiers over the same characters.
# ("Answer: 42", "Final answer: 42", "The answer is 42", "The final answer is: 42")
_LINE = re.compile(r"^[ \t>*_#-]*(?:the )?(?:final )?answer(?:\**[ \t]*[:：]| is\**[ \t]*[:：]?)(.*)$",
                   re.IGNORECASE | re.MULTILINE)
# A number as an answer writes it: digits with separators, a sign, a decimal part, an exponent.
_NUMBER = re.compile(r"[-+−]?\d[\d,_]*(?:\.\d+)?(?:[eE][-+]?\d+)?")


def numbers(text: str) -> list[str]:
    """The numbers written in `text` (a hedge writes several)."""
    return _NUMBER.findall(text)


def hedges(answer: str, expected: str) -> bool:
    """Whether an answer to a question whose expected answer is one number writes several numbers: every
    one of them a candidate ("20 or 5", "-61 0"), where a scorer that finds the first, the last or any
    contained one would pay it."""
    wanted = numbers(expected)
    return len(wanted) == 1 and wanted[0] == expected.strip() and len(numbers(answer)) > 1


@dataclass(frozen=True)
class Extracted:
    text: str
    marked: bool  # the completion used one of the answer formats
    how: str      # "tag", "boxed", "line" or "whole"


def final_answer(completion: str) -> Extracted:
    """The completion's final answer. What a closed <think>...</think> holds is reasoning, not the answer:
    only the text after the last `</think>` is read (an answer tag inside the thinking, followed by
    another answer outside it, once won by format rank)."""
    end = completion.lower().rfind("</think>")
    if end >= 0:
        completion = completion[end + len("</think>"):]
    tagged = last_tagged(completion)
    if tagged is not None:
        return Extracted(_clip(tagged.strip()), True, "tag")
    boxed = last_boxed(completion)
    if boxed is not None:
        return Extracted(_clip(boxed.strip()), True, "boxed")
    line = None
    for line in _LINE.finditer(completion):
        pass
    if line is not None and line.group(1).strip().strip("*_").strip():
        return Extracted(_clip(line.group(1).strip().strip("*_").strip()), True, "line")
    return Extracted(_clip(completion.strip()), False, "whole")


def last_tagged(text: str, tag: str = "answer") -> str | None:
    """The content of the last <answer>...</answer> (any case), found by scanning back, never by backtracking."""
    lowered = text.lower()
    end = lowered.rfind(f"</{tag}>")
    if end < 0:
        return None
    start = lowered.rfind(f"<{tag}>", 0, end)
    if start < 0:
        return None
    return text[start + len(tag) + 2:end]


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
