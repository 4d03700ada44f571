"""`math_answer`: the final answer checked for mathematical equivalence with math-verify.

`1/2`, `0.5`, `\\frac{1}{2}` and `\\boxed{\\dfrac12}` are all the same answer;
sets, intervals, equations and symbolic expressions compare as math-verify
compares them. Each side is read once: as LaTeX (wrapped in `$...$`), or as a plain expression where
that finds nothing. Numbers compare to a tolerance relative to the expected one.
"""
from __future__ import annotations

import math
import re
import threading

from crucible.v1 import execution_pb2, task_pb2
from crucible.ml.kinds.extract import MAX_ANSWER_CHARS, after_thinking, final_answer, numbers, value_of
from crucible.ml.kinds.registry import Kind, Score, register

TIMEOUT_S = 3  # math-verify's own (SIGALRM) limit per parse and comparison, where it can use one
ROUNDING, MAX_ROUNDING = 6, 15  # decimal places compared: math-verify's default, and its numeric precision


def _math_verify():
    import math_verify  # sympy behind it takes ~0.5 s to import: only where math is scored

    return math_verify


def _timeouts() -> int | None:
    # math-verify's timeouts are SIGALRM, which only the main thread can take; elsewhere the
    # caller's hard limit (the verifier's scoring process) is the only one.
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def parsed(text: str, latex_first: bool = True) -> list:
    """math-verify's reading of `text`: as LaTeX, else (where that finds nothing) as a plain expression;
    empty when neither parses. One reading, never both: the two can differ (`7 \\approx 9` reads 7 as
    LaTeX and 9 as plain text), and paying either pairing paid a hedge for both answers.
    `latex_first=False`: prose, where math-verify finds the answer itself (the last boxed, "the answer
    is", the last number)."""
    mv = _math_verify()
    timeout = _timeouts()
    for candidate in ((f"${text}$", text) if latex_first else (text,)):
        result = mv.parse(candidate, parsing_timeout=timeout)
        if result:
            return result
    return []


def equivalent(expected: str, answer: str, marked: bool = True) -> bool:
    """Whether `answer` (a marked final answer, else the completion's prose) is the expected one."""
    mv = _math_verify()
    timeout = _timeouts()
    gold, pred = parsed(expected), parsed(answer, latex_first=marked)
    return bool(gold and pred) and mv.verify(gold, pred, float_rounding=_rounding(expected), timeout_seconds=timeout)


def _rounding(expected: str) -> int:
    """The decimal places numbers are compared at: math-verify's 6, or more where the expected answer writes
    a smaller number, so that each is compared to 6 significant digits (at 6 places, 0.0000001 was paid
    for 0.0000004, in a set or a tuple too)."""
    sizes = []
    for number in numbers(expected):
        try:
            size = abs(value_of(number))
        except (ValueError, OverflowError):
            continue
        if math.isfinite(size) and size > 0:
            sizes.append(size)
    if not sizes:
        return ROUNDING
    return min(MAX_ROUNDING, max(ROUNDING, ROUNDING - 1 - math.floor(math.log10(min(sizes)))))


# Connectives between two expressions (logic, sets, arrows, relations, alignment): an answer that joins two
# with one is two answers, or a statement, not one value. math-verify reads such an answer as one of its
# operands (the last: `7 \lor 9`, `7 & 9`, `7 \to 9` were paid for 9). An expected answer that holds one
# (an interval's \le, a set's \cup) lets an answer hold it too.
_CONNECTIVE = re.compile(r"\\(?:lor|vee|land|wedge|cup|cap|setminus|to|rightarrow|Rightarrow|leftarrow|Leftarrow|"
                         r"leftrightarrow|Leftrightarrow|iff|implies|impliedby|equiv|sim|simeq|cong|colon|approx|"
                         r"neq|ne|leq|le|geq|ge|lt|gt|ll|gg|mid|parallel|perp|in|notin|subset|subseteq|supset|"
                         r"supseteq|text\s*\{\s*(?:or|and)\s*\})(?![A-Za-z])|&|\\\\|[<>≤≥≠≈∨∧∪∩→⇒⇔≡∼∈]")
_NAME = re.compile(r"\s*(?:[A-Za-z]|\\[A-Za-z]+)(?:_\{?[A-Za-z0-9]+\}?)?\s*")


def joins_answers(answer: str, expected: str) -> bool:
    """Whether a marked answer is more than one value where the expected answer is one: two expressions
    joined by a connective the expected answer does not hold, or an equation whose left side is not a
    bare name (`x = 9` is an answer; `7 = 9` is a statement, read as 9)."""
    inner = answer.strip()
    if inner.startswith("\\boxed{") and inner.endswith("}"):
        inner = inner[len("\\boxed{"):-1]
    if _CONNECTIVE.search(inner) and not _CONNECTIVE.search(expected):
        return True
    if "=" in inner and "=" not in expected:
        return not all(_NAME.fullmatch(side) for side in inner.split("=")[:-1])
    return False


class MathAnswerKind(Kind):
    name = "math_answer"
    payload = "answer"
    format_hint = "Put your final answer within \\boxed{}."

    def problems(self, task: task_pb2.Task) -> list[str]:
        problems = super().problems(task)
        if not problems and not task.answer.answer.strip():
            problems.append("answer.answer is empty: give the expected answer as a number or LaTeX expression")
        return problems

    def score(self, task: task_pb2.Task, completion: str,
              execution: execution_pb2.ExecutionResult | None = None) -> Score:
        found = final_answer(completion)
        # Without a marked answer, math-verify finds one itself (last boxed, "the answer is", last number),
        # in what follows the thinking, as every kind reads an answer: never in the thinking itself.
        answer = found.text if found.marked else after_thinking(completion)[-MAX_ANSWER_CHARS:]
        correct = equivalent(task.answer.answer, answer, found.marked) and not (
            found.marked and joins_answers(answer, task.answer.answer))
        return Score({"answer_correct": float(correct), "format_ok": float(found.marked)}, float(correct),
                     detail=f"answer {found.text[:80]!r} ({found.how})")


register(MathAnswerKind())
