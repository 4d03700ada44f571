"""`python`: a code interpreter for math and data questions. Run code, read its output, answer.

Each call runs in the sandbox. The interpreter keeps its state across calls of one episode: the
earlier cells that ran are run again first, with their output discarded, then the new cell; the
state is gone when the episode ends. The answer is a number: an integer exactly, any other to 1e-6
(relative 1e-9).
"""
from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from decimal import Decimal

from crucible.ml import envs
from crucible.ml.envs.base import Call, Environment, InstanceError, Observation, Tool, program_output, split_of
from crucible.ml.kinds import extract
from crucible.v1 import execution_pb2

RAISED_EXIT = 70  # the runner's exit code for a cell that raised (EX_SOFTWARE)
RAISED = "[the cell raised an exception]"  # what an observation of such a cell begins with (observe)
# The program the sandbox runs: fixed code; the cells arrive as data on its stdin.
RUNNER = f"""\
import contextlib, io, json, sys, traceback
_cells = json.loads(sys.stdin.read())
_g = {{"__name__": "__main__"}}
for _c in _cells[:-1]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            exec(compile(_c, "<earlier cell>", "exec"), _g)
        except BaseException:
            pass
try:
    exec(compile(_cells[-1], "<cell>", "exec"), _g)
except SystemExit:
    raise
except BaseException:
    traceback.print_exc()
    sys.stdout.flush()
    sys.exit({RAISED_EXIT})
"""

QUESTIONS = [
    ("What is the sum of the squares of the integers from 1 to {n} that are divisible by {k}?",
     lambda n, k: sum(i * i for i in range(1, n + 1) if i % k == 0),
     "print(sum(i * i for i in range(1, {n} + 1) if i % {k} == 0))"),
    ("How many prime numbers are there below {n}?",
     lambda n, k: sum(1 for i in range(2, n) if all(i % d for d in range(2, int(i ** 0.5) + 1))),
     "print(sum(1 for i in range(2, {n}) if all(i % d for d in range(2, int(i ** 0.5) + 1))))"),
    ("What is the {k}th Fibonacci number (F1 = F2 = 1)?", lambda n, k: _fib(k),
     "a, b = 1, 1\nfor _ in range({k} - 1):\n    a, b = b, a + b\nprint(a)"),
    ("How many integers from 1 to {n} have a digit sum divisible by {k}?",
     lambda n, k: sum(1 for i in range(1, n + 1) if sum(map(int, str(i))) % k == 0),
     "print(sum(1 for i in range(1, {n} + 1) if sum(map(int, str(i))) % {k} == 0))"),
    ("What is the sum of the digits of {k} to the power {n}?", lambda n, k: sum(map(int, str(k ** n))),
     "print(sum(map(int, str({k} ** {n}))))"),
]  # (question, its answer, code that prints it)


def _fib(k: int) -> int:
    a, b = 1, 1
    for _ in range(k - 1):
        a, b = b, a + b
    return a


def answer_number(answer: str, question: str) -> Decimal | None:
    """The one number an answer gives, exactly as written; None where there is none, or where it writes
    several of its own (a hedge: "256 or 250", every one a candidate for a scorer that takes the first or
    the last). Numbers the question states are a restatement ("250 primes below 1597"), unless the answer
    writes only those: then the last of them ("The 3rd Fibonacci number is 2", where F1 = F2 = 1)."""
    stated = {extract.decimal_of(n) for n in extract.numbers(question)}
    written = [v for v in map(extract.decimal_of, extract.numbers(answer)) if v is not None]
    own = set(v for v in written if v not in stated)
    if own:
        return own.pop() if len(own) == 1 else None
    return written[-1] if written else None


class PythonInterpreter(Environment):
    name = "python"
    description = "Answer a math or data question with the help of a Python interpreter."
    tools = (Tool("python", "Runs Python code and shows what it prints (state is kept between calls: earlier "
                            "cells run again first).",
                  {"code": "the Python code"}, sandboxed=True),)
    max_turns = 5

    def check_instance(self, data: dict) -> None:
        answer = data.get("answer")
        if not isinstance(answer, (int, float)) or isinstance(answer, bool) or not math.isfinite(answer):
            raise InstanceError("python needs 'answer': the (finite) number that answers the question")

    def job(self, task, earlier, call) -> execution_pb2.ExecuteRequest:
        cells = [c.arguments["code"] for c in earlier if c.name == "python"] + [call.arguments["code"]]
        return execution_pb2.ExecuteRequest(language="python", code=RUNNER, stdin=json.dumps(cells).encode(),
                                            timeout_s=10.0)

    def observe(self, task, earlier, call, result=None) -> Observation:
        seen = program_output(result)
        if result is not None and result.exit_code == RAISED_EXIT and not result.signal and not result.violation:
            # Said first, from the result itself: no cut of a long output drops it (episode.py keeps an
            # observation's start), and nothing the cell prints can say it.
            return Observation(f"{RAISED}\n{seen.text}", failed=True)
        if seen.text.startswith(RAISED):  # the cell's own output, begun with the words: not the runner's
            return Observation(f"[exit code {result.exit_code if result is not None else '?'}]\n{seen.text}",
                               failed=seen.failed)
        return seen

    def keeps_failed(self, turn) -> bool:
        """A cell that raised ran up to the raise (what it set before is set, as in a notebook), and the
        runner runs it again so. One that ended its process otherwise (a signal, a limit, os._exit) is
        left out: run again first, it would end every later call the same way. Decided by what the
        runner reported (observe), never by the output: a traceback a cell printed was taken for a raise,
        and a raise after 2,000 characters of output was cut off and taken for none. (A cell that ends
        its process with the runner's own exit code is taken at its word: it harms its episode alone.)"""
        return turn.observation.startswith(RAISED)

    def check_answer(self, task, answer: str, calls: list[Call]) -> dict[str, float]:
        expected, given = self.instance(task)["answer"], answer_number(answer, task.prompt)
        if given is None:
            right = False
        elif type(expected) is int:  # exactly: as a float, 1130577845 was close enough to 1130577844
            right = given == expected
        else:
            right = math.isclose(float(given), expected, rel_tol=1e-9, abs_tol=1e-6)
        return {"answer_correct": float(right), "answer_numeric": float(given is not None)}

    def generate(self, split: str, *, seed: int, group_size: int = 8) -> Iterator:
        rng = random.Random(seed)
        while True:
            index = rng.randrange(len(QUESTIONS))
            template, solve, _ = QUESTIONS[index]
            n, k = rng.randrange(50, 2000), rng.randrange(2, 30)
            question = template.format(n=n, k=k)
            if split_of(question) != split:
                continue
            task = self.task(question, {"answer": solve(n, k), "template": index, "n": n, "k": k}, split=split,
                             key=f"{question}:{rng.randrange(1 << 30)}", group_size=group_size)
            if self.scoring_problems(task):  # the question states its answer (k = 2, F2 = 1): a copy is paid
                continue
            yield task

    def reference(self, task) -> list[str]:
        data = self.instance(task)
        if isinstance(data.get("template"), int) and 0 <= data["template"] < len(QUESTIONS):
            code = QUESTIONS[data["template"]][2].format(n=data.get("n"), k=data.get("k"))
        else:  # a user's question (its instance the answer alone): the answer, printed
            code = f"print({data['answer']!r})"
        return ["@python " + json.dumps({"code": code}), str(data["answer"])]


envs.register(PythonInterpreter())
