"""`math_answer`: the final answer checked for mathematical equivalence with math-verify.

`1/2`, `0.5`, `\\frac{1}{2}` and `\\boxed{\\dfrac12}` are all the same answer;
sets, intervals, equations and symbolic expressions compare as math-verify
compares them. Both sides are parsed as LaTeX (wrapped in `$...$`) and as
plain expressions; any pairing that math-verify calls equal counts.
"""
from __future__ import annotations

import threading

from crucible.v1 import execution_pb2, task_pb2
from crucible.ml.kinds.extract import MAX_ANSWER_CHARS, final_answer
from crucible.ml.kinds.registry import Kind, Score, register

TIMEOUT_S = 3  # math-verify's own (SIGALRM) limit per parse and comparison, where it can use one


def _math_verify():
    import math_verify  # sympy behind it takes ~0.5 s to import: only where math is scored

    return math_verify


def _timeouts() -> int | None:
    # math-verify's timeouts are SIGALRM, which only the main thread can take; elsewhere the
    # caller's hard limit (the verifier's scoring process) is the only one.
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def parsed(text: str) -> list:
    """math-verify's readings of `text`: as LaTeX, then as a plain expression (empty when neither parses)."""
    mv = _math_verify()
    timeout = _timeouts()
    readings = []
    for candidate in (f"${text}$", text):
        result = mv.parse(candidate, parsing_timeout=timeout)
        if result:
            readings.append(result)
    return readings


def equivalent(expected: str, answer: str) -> bool:
    mv = _math_verify()
    timeout = _timeouts()
    golds = parsed(expected)
    for gold in golds:
        for pred in parsed(answer):
            if mv.verify(gold, pred, timeout_seconds=timeout):
                return True
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
        # Without a marked answer, math-verify finds one itself (last boxed, "the answer is", last number).
        answer = found.text if found.marked else completion[-MAX_ANSWER_CHARS:]
        correct = equivalent(task.answer.answer, answer)
        return Score({"answer_correct": float(correct), "format_ok": float(found.marked)}, float(correct),
                     detail=f"answer {found.text[:80]!r} ({found.how})")


register(MathAnswerKind())
