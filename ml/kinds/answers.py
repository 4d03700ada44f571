"""`exact` and `regex`: a final answer compared with the task's literal or pattern."""
from __future__ import annotations

import re

from crucible.v1 import execution_pb2, task_pb2
from crucible.ml.kinds.extract import final_answer
from crucible.ml.kinds.registry import Kind, Score, register

ANSWER_HINT = "End your response with a final line of the form `Answer: <your answer>`."


def normalize(text: str, case_sensitive: bool) -> str:
    """Whitespace collapsed, surrounding quotes, `$` and a final period dropped; case folded unless it matters."""
    text = " ".join(text.split())
    before = None
    while before != text:  # `"42".`: the period, then the quotes it kept in
        before, text = text, text.strip("`'\"$ ").rstrip(".").strip()
    return text if case_sensitive else text.casefold()


class ExactKind(Kind):
    name = "exact"
    payload = "answer"
    format_hint = ANSWER_HINT

    def problems(self, task: task_pb2.Task) -> list[str]:
        problems = super().problems(task)
        if not problems and not normalize(task.answer.answer, task.answer.case_sensitive):
            # ("..." is empty once normalized: an empty completion matched it)
            problems.append("answer.answer is empty once normalized (whitespace, quotes, `$` and a final "
                            "period dropped): give the expected answer")
        return problems

    def score(self, task: task_pb2.Task, completion: str,
              execution: execution_pb2.ExecutionResult | None = None) -> Score:
        found = final_answer(completion)
        expected = task.answer
        correct = normalize(found.text, expected.case_sensitive) == normalize(expected.answer, expected.case_sensitive)
        return Score({"answer_correct": float(correct), "format_ok": float(found.marked)}, float(correct),
                     detail=f"answer {found.text[:80]!r} ({found.how})")


class RegexKind(Kind):
    name = "regex"
    payload = "answer"
    format_hint = ANSWER_HINT

    def problems(self, task: task_pb2.Task) -> list[str]:
        problems = super().problems(task)
        if not problems:
            try:
                pattern = re.compile(task.answer.answer)
            except re.error as exc:
                problems.append(f"answer.answer is not a valid regular expression: {exc}")
            else:
                if pattern.fullmatch("") is not None:
                    problems.append("answer.answer matches an empty answer: an empty completion would be paid")
        return problems

    def score(self, task: task_pb2.Task, completion: str,
              execution: execution_pb2.ExecutionResult | None = None) -> Score:
        found = final_answer(completion)
        flags = 0 if task.answer.case_sensitive else re.IGNORECASE
        # The whole answer must match (fullmatch): a pattern never rewards an answer that merely contains it.
        correct = re.fullmatch(task.answer.answer, found.text.strip(), flags) is not None
        return Score({"answer_correct": float(correct), "format_ok": float(found.marked)}, float(correct),
                     detail=f"answer {found.text[:80]!r} ({found.how})")


register(ExactKind())
register(RegexKind())
