"""The task-kind registry, scored without services: answers, math, reasoning-gym, python_tests verdict logic."""
from __future__ import annotations

import json
from collections import deque
from datetime import date, datetime, time, timedelta, timezone, tzinfo
from decimal import Decimal
from fractions import Fraction

import pytest

from crucible.v1 import execution_pb2, task_pb2
from crucible.services.sandbox_executor import plain
from crucible.ml import kinds
from crucible.ml.kinds import builtin_sets, tamper_scan
from crucible.ml.kinds.extract import final_answer
from crucible.ml.kinds.python_tests import program
from crucible.ml.kinds.reasoning_gym_kind import generators, instance
from crucible.ml.tasks import task_problems
from crucible.shared.text import shown


def answer_task(kind: str, answer: str, case_sensitive: bool = False) -> task_pb2.Task:
    return task_pb2.Task(id="t", kind=kind, prompt="question?", group_size=1,
                         answer=task_pb2.ExpectedAnswer(answer=answer, case_sensitive=case_sensitive))


def score(task, completion, execution=None):
    return kinds.get(task.kind).score(task, completion, execution)


# --- registry ----------------------------------------------------------------------------------

def test_registry_knows_the_built_in_kinds():
    assert set(kinds.known()) >= {"python_tests", "math_answer", "exact", "regex", "reasoning_gym"}
    with pytest.raises(kinds.UnknownKind, match="unknown kind 'poetry': known kinds are .*python_tests"):
        kinds.get("poetry")


def test_task_problems_consult_the_registry():
    unknown = task_pb2.Task(id="x", kind="poetry", prompt="p", group_size=1)
    assert any("unknown kind 'poetry'" in p for p in task_problems(unknown))
    wrong_payload = task_pb2.Task(id="x", kind="exact", prompt="p", group_size=1,
                                  python_tests=task_pb2.PythonTests(entry_point="f", test_code="x"))
    assert any("needs a 'answer' payload" in p for p in task_problems(wrong_payload))
    bad_regex = answer_task("regex", "(unclosed")
    assert any("not a valid regular expression" in p for p in task_problems(bad_regex))
    bad_generator = task_pb2.Task(id="x", kind="reasoning_gym", prompt="p", group_size=1,
                                  generator=task_pb2.GeneratorSpec(name="no_such_generator"))
    assert any("not a reasoning-gym generator" in p for p in task_problems(bad_generator))
    bad_tests = task_pb2.Task(id="x", kind="python_tests", prompt="p", group_size=1,
                              python_tests=task_pb2.PythonTests(entry_point="f", test_code="def check(:"))
    assert any("does not compile" in p for p in task_problems(bad_tests))
    # tests the sandbox could never run are refused when the task comes in, not failed for every answer
    pytest_tests = task_pb2.Task(id="x", kind="python_tests", prompt="p", group_size=1, python_tests=task_pb2.PythonTests(
        entry_point="f", test_code="import pytest, json\nfrom numpy import array\ndef test_f():\n    assert f(1)\n"))
    assert any("imports numpy, pytest: the sandbox has the standard library only" in p
               for p in task_problems(pytest_tests)), task_problems(pytest_tests)
    assert task_problems(builtin_sets.humaneval()[0]) == []
    # more tests than the sandbox reports: a perfect answer to 1,500 was paid 1,000 of them
    many = "".join(f"def test_{i}():\n    assert f(1) == 1\n" for i in range(1001))
    too_many = task_pb2.Task(id="x", kind="python_tests", prompt="p", group_size=1,
                             python_tests=task_pb2.PythonTests(entry_point="f", test_code=many))
    assert any("declares 1001 tests: the sandbox reports at most 1000" in p for p in task_problems(too_many))
    # test code in which nothing would call the program is refused when the task comes in
    for test_code in ("import unittest\nclass T(unittest.TestCase):\n    def test_a(self):\n        assert f(1)\n",
                      "if __name__ == '__main__':\n    assert f(1)\n", "x = 1\n"):
        vacuous = task_pb2.Task(id="x", kind="python_tests", prompt="p", group_size=1,
                                python_tests=task_pb2.PythonTests(entry_point="f", test_code=test_code))
        assert any("nothing in it would test the program" in p for p in task_problems(vacuous)), test_code
    # tests that define the entry point themselves would judge their own definition: the program's never ran
    for test_code in ("def f(x):\n    return 2 * x\n\ndef check(candidate):\n    assert candidate(1) == f(1)\n",
                      "from math import sqrt as f\n\ndef test_f():\n    assert f(4) == 2\n",
                      "if True:\n    f = abs\nassert f(-1) == 1\n",
                      "from math import *\n\ndef check(candidate):\n    assert candidate(4) == f(4)\n",
                      "def _setup():\n    global f\n    f = abs\n\n_setup()\nassert f(-1) == 1\n"):
        own = task_pb2.Task(id="x", kind="python_tests", prompt="p", group_size=1,
                            python_tests=task_pb2.PythonTests(entry_point="f", test_code=test_code))
        assert any("defines f itself" in p for p in task_problems(own)), test_code
    for test_code in ("def check(candidate):\n    g = candidate\n    assert g(1) == f(1)\n",
                      "assert [f(x) for f in [f] for x in (1,)] == [1]\n",
                      "if __name__ == '__main__':\n    def f(x):\n        return x\nassert f(1) == 1\n"):
        calls_it = task_pb2.Task(id="x", kind="python_tests", prompt="p", group_size=1,
                                 python_tests=task_pb2.PythonTests(entry_point="f", test_code=test_code))
        assert task_problems(calls_it) == [], test_code
    mbpp = task_pb2.Task(id="x", kind="python_tests", prompt="p", group_size=1,
                         python_tests=task_pb2.PythonTests(entry_point="f", test_code="assert f(1) == 2\n"))
    assert task_problems(mbpp) == []
    stamped = answer_task("exact", "1")
    stamped.created_at.seconds = 2**62
    assert any("created_at" in p for p in task_problems(stamped))
    # a payload that breaks its kind's check is a problem of the task, never an exception of the reader
    for kind, payload in [("regex", task_pb2.ExpectedAnswer(answer="a{4294967296}")),
                          ("regex", task_pb2.ExpectedAnswer(answer="(" * 5000 + ")" * 5000)),
                          ("python_tests", task_pb2.PythonTests(entry_point="f", test_code="-" * 100_000 + "1")),
                          ("python_tests", task_pb2.PythonTests(entry_point="f", test_code="1" + "+1" * 200_000))]:
        task = task_pb2.Task(id="x", kind=kind, prompt="p", group_size=1, **{
            "answer" if kind == "regex" else "python_tests": payload})
        assert task_problems(task), (kind, str(payload)[:40])


@pytest.mark.parametrize("task_id", ["t-\x1b[2J\x1b]0;title\x07", "t-nul\x00", "t-\u202eevil", "t-new\nline",
                                     "t-\u200b", "t-\u2028"])
def test_task_ids_with_characters_a_terminal_acts_on_are_refused(task_id):
    task = answer_task("exact", "1")
    task.id = task_id
    [problem] = task_problems(task)
    assert problem.startswith(f"id '{shown(task_id)}' holds control or invisible characters"), problem
    assert shown(problem) == problem  # the message names the id escaped, never raw


@pytest.mark.parametrize("task_id", ["a ", " a", "a\u00a0", "\u3000a"])
def test_task_ids_with_surrounding_whitespace_are_refused(task_id):
    task = answer_task("exact", "1")
    task.id = task_id
    [problem] = task_problems(task)
    assert "begins or ends with whitespace" in problem and shown(task_id) in problem, problem


@pytest.mark.parametrize("task_id", ["digits-6fd37d3c-24134339", "humaneval/55", "rg/chain_sum/3#2", "two words",
                                     "tâche-é", "a\\x1b"])
def test_ordinary_task_ids_are_taken(task_id):
    task = answer_task("exact", "1")
    task.id = task_id
    assert task_problems(task) == []


def test_prompts_carry_the_answer_format():
    assert "\\boxed{}" in kinds.render_prompt(answer_task("math_answer", "1"))
    assert "Answer:" in kinds.get("exact").render_prompt(answer_task("exact", "1"))
    raw = answer_task("exact", "1")
    raw.metadata["prompt_format"] = "raw"
    assert kinds.get("exact").render_prompt(raw) == "question?"
    humaneval = builtin_sets.humaneval()[0]
    assert kinds.get("python_tests").render_prompt(humaneval) == humaneval.prompt


# --- answer extraction ---------------------------------------------------------------------------

@pytest.mark.parametrize("completion,text,how", [
    ("think... <answer> 42 </answer>", "42", "tag"),
    ("<answer>1</answer> then <answer>2</answer>", "2", "tag"),
    ("so \\boxed{\\frac{1}{2}} and finally \\boxed{\\frac{3}{\\sqrt{4}}}", "\\frac{3}{\\sqrt{4}}", "boxed"),
    ("work\n**Final Answer:** 7\n", "7", "line"),
    ("steps\nAnswer: Paris.", "Paris", "line"),  # (the sentence's period is not the answer's)
    ("just 12", "just 12", "whole"),
    ("unclosed \\boxed{12", "unclosed \\boxed{12", "whole"),
])
def test_final_answer(completion, text, how):
    found = final_answer(completion)
    assert (found.text, found.how, found.marked) == (text, how, how != "whole")


# --- exact and regex -----------------------------------------------------------------------------

def test_exact_answers():
    task = answer_task("exact", "Paris")
    assert score(task, "It is...\nAnswer: paris.").reward == 1.0
    assert score(task, "Answer: Lyon").reward == 0.0
    assert score(task, 'Answer: "Paris".').reward == 1.0 and score(task, "The answer is `Paris`.").reward == 1.0
    assert score(task, "Paris").components == {"answer_correct": 1.0, "format_ok": 0.0}
    assert score(answer_task("exact", "Paris", case_sensitive=True), "Answer: paris").reward == 0.0


def test_regex_answers_must_match_whole():
    task = answer_task("regex", r"\d{3}-\d{4}")
    assert score(task, "<answer>555-1234</answer>").reward == 1.0
    assert score(task, "<answer>call 555-1234 now</answer>").reward == 0.0
    assert score(answer_task("regex", "yes|true"), "Answer: YES").reward == 1.0


# --- math ------------------------------------------------------------------------------------------

HALF = ["1/2", "0.5", "\\frac{1}{2}", "\\dfrac{1}{2}", "\\frac12", "2/4", "0.50", "\\tfrac{1}{2}"]


@pytest.mark.parametrize("expected", ["1/2", "0.5", "\\frac{1}{2}"])
@pytest.mark.parametrize("answer", HALF)
def test_math_verify_equivalences(expected, answer):
    task = answer_task("math_answer", expected)
    boxed = score(task, f"so the result is \\boxed{{{answer}}}")
    assert boxed.reward == 1.0 and boxed.components["format_ok"] == 1.0
    assert score(task, f"Answer: {answer}").reward == 1.0


@pytest.mark.parametrize("answer", ["1/3", "2", "-1/2", "x", "\\frac{2}{1}", "none"])
def test_math_wrong_answers(answer):
    assert score(answer_task("math_answer", "\\frac{1}{2}"), f"\\boxed{{{answer}}}").reward == 0.0


def test_math_without_a_marked_answer_still_reads_it_but_says_so():
    result = score(answer_task("math_answer", "12"), "Adding them gives 12")
    assert result.reward == 1.0 and result.components["format_ok"] == 0.0


def test_builtin_math_set_reference_answers_score_one():
    tasks = builtin_sets.load("math", 30)
    assert {t.metadata["generator"] for t in tasks} == set(builtin_sets.MATH_GENERATORS)
    for task in tasks:
        assert task_problems(task) == []
        reference = task.answer.answer.strip("$")
        assert score(task, f"\\boxed{{{reference}}}").reward == 1.0, (task.id, task.answer.answer)
        assert score(task, "\\boxed{123456789.5}").reward == 0.0, task.id


# --- reasoning-gym -------------------------------------------------------------------------------

USED_GENERATORS = sorted(set(builtin_sets.DEFAULT_GENERATORS) | set(builtin_sets.MATH_GENERATORS))


@pytest.mark.parametrize("generator", USED_GENERATORS)
def test_reasoning_gym_reference_answer_scores_one_and_wrong_less(generator):
    for task in builtin_sets.reasoning_gym(generator, 3, seed=11):
        assert task_problems(task) == []
        reference = json.loads(task.generator.entry_json)["answer"]
        right = score(task, f"Let me think.\n<answer>{reference}</answer>")
        assert right.reward == 1.0 and right.components["answer_correct"] == 1.0, (task.id, reference, right.detail)
        wrong = score(task, "<answer>certainly not the answer 0xdeadbeef</answer>")
        assert wrong.reward < 1.0, (task.id, wrong.detail)


@pytest.mark.parametrize("generator", ["products", "lcm", "chain_sum", "gsm_symbolic", "spell_backward"])
def test_reasoning_gym_pays_the_answer_not_partial_credit_or_hedges(generator):
    # reasoning-gym's scorers gave "26600" for 2660 0.8, "20 0 1 2 3" for 20 (first number) 1.0, and
    # "I don't know" for a spelling 0.125: each was the reward.
    task = builtin_sets.reasoning_gym(generator, 1, seed=3)[0]
    reference = json.loads(task.generator.entry_json)["answer"]
    assert score(task, f"<answer>{reference}</answer>").reward == 1.0
    for wrong in (f"<answer>{reference}0</answer>", f"<answer>{reference} 0 1 2 3</answer>", f"<answer>-{reference}</answer>",
                  f"<answer>{reference} or 5</answer>", "<answer>I don't know</answer>"):
        paid = score(task, wrong)
        assert paid.reward == 0.0 and paid.components["answer_correct"] == 0.0, (wrong, paid.detail)


def _rounded(reference: str) -> str:
    return json.dumps([str(round(float(v))) for v in json.loads(reference.replace("'", '"'))])


# A red team's: answers these scorers paid in full that are not the answer (a tolerance of one, a float sum of
# per-letter credit just above 1, the right answer read and what follows or precedes it ignored), and one they
# could not read at all (the scorer raised). Each instance's scorer is probed once; where it pays what is not
# its reference, only the reference as it is written is paid.
NOT_THE_ANSWER = [
    ("number_sorting", 1, _rounded),
    ("number_sorting", 1, lambda ref: json.dumps([repr(float(v) + 0.99) for v in json.loads(ref.replace("'", '"'))])),
    ("spell_backward", 0, lambda ref: ref + "X"),
    ("spell_backward", 0, lambda ref: f"{ref} is the answer, or maybe {ref[:-2]}ih"),
    ("word_sorting", 0, lambda ref: ref + ", zzz"),
    ("knights_knaves", 0, lambda ref: "banana " + ref),
    ("prime_factorization", 0, lambda ref: "I don't know"),
    ("coin_flip", 0, lambda ref: "1e999"),
]


@pytest.mark.parametrize("generator, seed, wrong", NOT_THE_ANSWER, ids=[f"{g}-{i}" for i, (g, _, _) in enumerate(NOT_THE_ANSWER)])
def test_reasoning_gym_pays_no_answer_its_scorer_overlooks(generator, seed, wrong):
    task = builtin_sets.reasoning_gym(generator, 1, seed=seed)[0]
    reference = str(json.loads(task.generator.entry_json)["answer"])
    answer = wrong(reference)
    paid = score(task, f"<answer>{answer}</answer>")
    assert paid.reward == 0.0 and paid.components["answer_correct"] == 0.0, (answer, paid.detail)
    assert score(task, f"<answer>{reference}</answer>").reward == 1.0
    if generator == "number_sorting":  # the reference in JSON's quotes and spacing is the reference
        assert score(task, f"<answer>{json.dumps(json.loads(reference.replace(chr(39), chr(34))))}</answer>").reward == 1.0


@pytest.mark.parametrize("expected, answer, paid", [
    ("9", "\\boxed{7 \\approx 9}", 0.0), ("9", "\\boxed{7 + 0 \\cdot 9}", 0.0), ("1", "\\boxed{1e2}", 0.0),
    ("5", "\\boxed{x=3, y=5}", 0.0),
    ("0.0000004", "\\boxed{0.0000001}", 0.0), ("0.1", "\\boxed{0.10001}", 0.0), ("0.1", "\\boxed{0.1}", 1.0),
    ("\\{0.0000004\\}", "\\boxed{\\{0.0000001\\}}", 0.0), ("(0.0000004, 1)", "\\boxed{(0.0000001, 1)}", 0.0),
    ("\\frac{1}{3}", "\\boxed{0.333333}", 1.0), ("3/4", "Answer: 3/4.", 1.0), ("3/4", "The answer is 3/4.", 1.0),
    ("0.0000004", "\\boxed{4 \\times 10^{-7}}", 1.0), ("2.5", "\\boxed{2.5000001}", 1.0), ("250.5", "\\boxed{250.50000001}", 1.0),
    # A red team's: two values joined by a connective (or a statement) were read as the last one, and paid.
    ("9", "\\boxed{7 \\lor 9}", 0.0), ("9", "\\boxed{7 \\vee 9}", 0.0), ("9", "\\boxed{7 & 9}", 0.0),
    ("9", "\\boxed{7 \\\\ 9}", 0.0), ("9", "\\boxed{7 \\to 9}", 0.0), ("9", "\\boxed{7 \\equiv 9}", 0.0),
    ("9", "\\boxed{7 = 9}", 0.0), ("9", "\\boxed{x = 7 \\lor x = 9}", 0.0), ("9", "\\boxed{7 \\lor 8 \\lor 10 \\lor 9}", 0.0),
    ("9", "\\boxed{x = 9}", 1.0), ("9", "\\boxed{9}", 1.0), ("[0, 1]", "\\boxed{[0, 1]}", 1.0),
    ("0 \\le x \\le 1", "\\boxed{0 \\le x \\le 1}", 1.0)])
def test_math_pays_one_reading_of_the_answer_within_a_tolerance_relative_to_the_expected(expected, answer, paid):
    # The LaTeX and the plain reading of an answer once both counted (7 \approx 9 read 7 and 9), and numbers
    # compared to 6 decimal places whatever their size.
    assert score(answer_task("math_answer", expected), answer).reward == paid, (expected, answer)


def test_answers_are_read_after_the_thinking_and_from_plain_answer_lines():
    task = answer_task("exact", "42")
    assert score(task, "<think>maybe <answer>42</answer></think>\nAnswer: 41").reward == 0.0
    assert score(task, "<think>Answer: 41? no.</think>\n<answer>42</answer>").reward == 1.0
    assert score(task, "Six times seven.\nThe answer is 42.").reward == 1.0
    assert score(task, "Six times seven.\nThe final answer is: 42").reward == 1.0
    # an "answer is" line is the answer only where no line says `Answer:`
    assert score(task, "Answer: 42\nThe answer is consistent with the check above.").reward == 1.0
    # positions found in the text itself ("İ".lower() is two characters)
    assert score(answer_task("exact", "Istanbul"), "<think>İzmir? İ</think><answer>Istanbul</answer>").reward == 1.0
    assert score(task, "<think>İİİ</think>\nAnswer: 42").reward == 1.0
    # math_answer finds an unmarked answer itself: after the thinking too, never in it
    math = answer_task("math_answer", "9")
    for thought in ("<think>it is \\boxed{9}</think>\nThe result: 7", "<think>\\boxed{9}</think>",
                    "<think>hmm, 9</think>\nI refuse to answer."):
        assert score(math, thought).reward == 0.0, thought
    assert score(math, "<think>7? no</think>\nThe result is 9").reward == 1.0
    # a task no answer can fail: refused when it comes in
    assert any("empty once normalized" in p for p in task_problems(answer_task("exact", "...")))
    assert any("matches an empty answer" in p for p in task_problems(answer_task("regex", "a*")))
    assert task_problems(answer_task("regex", "a+")) == []


def test_reasoning_gym_instance_is_recreated_from_name_seed_and_config():
    spec = task_pb2.GeneratorSpec(name="chain_sum", seed=5, config_json=json.dumps({"min_terms": 4, "max_terms": 4}))
    _, entry = instance(spec)
    assert entry["question"].count("+") + entry["question"].count("-") >= 3
    task = task_pb2.Task(id="c", kind="reasoning_gym", prompt=entry["question"], group_size=1, generator=spec)
    assert score(task, f"<answer>{entry['answer']}</answer>").reward == 1.0


def test_reasoning_gym_pays_no_answer_that_ignores_the_question():
    """Scorers that compare with NaN (always false) paid a list of NaNs for any sorting and NaN for any
    complex sum; one scorer paid any answer at all. A red team's finds; the defence is general: non-finite
    answers are never paid where the reference is finite, and an instance whose scorer pays an answer that
    ignores it is refused when its task comes in."""
    from crucible.ml.kinds.extract import NUMBER

    for name in ("number_sorting", "complex_arithmetic", "basic_arithmetic"):
        for seed in range(3):
            spec = task_pb2.GeneratorSpec(name=name, seed=seed)
            _, entry = instance(spec)
            task = task_pb2.Task(id="t", kind="reasoning_gym", prompt=entry["question"], group_size=1, generator=spec)
            assert task_problems(task) == [], (name, seed)
            assert score(task, f"<answer>{entry['answer']}</answer>").reward == 1.0
            count = len(NUMBER.findall(str(entry["answer"])))
            for junk in (NUMBER.sub("NaN", str(entry["answer"])), "NaN", "nan", "Infinity", "ｎａｎ",
                         NUMBER.sub("inf", str(entry["answer"])),
                         "[" + ", ".join(['"\\u006ean"'] * count) + "]"):  # a scorer's json.loads reads it as nan
                assert score(task, f"<answer>{junk}</answer>").reward == 0.0, (name, seed, junk)
    spec = task_pb2.GeneratorSpec(name="game_of_life_halting", seed=0)
    _, entry = instance(spec)
    task = task_pb2.Task(id="g", kind="reasoning_gym", prompt=entry["question"], group_size=1, generator=spec)
    assert any("ignores the question" in p for p in task_problems(task))


@pytest.mark.slow
def test_every_generator_with_an_oracle_scores_its_reference_answer_one():
    failures = []
    for name in generators():
        try:
            task = builtin_sets.reasoning_gym(name, 1, seed=3)[0]
        except Exception as exc:  # generators that need a config (e.g. composite) are not usable bare
            failures.append((name, f"no default instance: {exc}"))
            continue
        reference = json.loads(task.generator.entry_json).get("answer")
        if reference is None:
            continue  # open-ended generators (several valid answers): no single oracle to check
        right = score(task, f"<answer>{reference}</answer>")
        if right.reward != 1.0:
            failures.append((name, right.detail))
    assert [f for f in failures if "no default instance" not in f[1]] == []


# --- python_tests verdicts (pure: execution results made by hand) --------------------------------

def python_task(prompt="def add(a, b):\n    '''a + b'''\n", test_code="def check(c):\n    assert c(1, 2) == 3\n"):
    return task_pb2.Task(id="p", kind="python_tests", prompt=prompt, group_size=1,
                         python_tests=task_pb2.PythonTests(entry_point="add", test_code=test_code))


def execution(*passed: bool, **fields) -> execution_pb2.ExecutionResult:
    result = execution_pb2.ExecutionResult(
        tests=[execution_pb2.TestOutcome(name=f"t{i}", passed=p) for i, p in enumerate(passed)],
        isolation=execution_pb2.ISOLATION_LEVEL_FULL, **fields)
    return result


def test_python_tests_score_is_the_pass_fraction():
    three = python_task(test_code="".join(f"def test_{n}():\n    assert add(1, 2) == 3\n" for n in "abc"))
    ran = execution_pb2.ExecutionResult(tests=[execution_pb2.TestOutcome(name=f"test_{n}", passed=p)
                                               for n, p in zip("abc", (True, True, False))],
                                        isolation=execution_pb2.ISOLATION_LEVEL_FULL)
    result = score(three, "    return a + b\n", ran)
    assert result.reward == pytest.approx(2 / 3) and not result.tampered
    assert result.components["tests_passed"] == 2 and result.components["tests_total"] == 3
    assert result.components["compiled"] == 1.0


def test_python_tests_without_an_execution_is_refused():
    with pytest.raises(ValueError, match="sandbox run"):
        score(python_task(), "    return a + b\n")


def test_harness_tamper_signals_zero_the_reward():
    result = score(python_task(), "    return a + b\n", execution(
        True, tamper=[execution_pb2.TamperSignal(pattern="non_plain_return", detail="x")]))
    assert result.reward == 0.0 and result.tampered and result.patterns == ("non_plain_return",)


def test_timeouts_and_compile_errors_are_components():
    timed_out = score(python_task(), "    while True: pass\n",
                      execution(False, violation=execution_pb2.VIOLATION_TIMEOUT))
    assert timed_out.components["timed_out"] == 1.0
    broken = score(python_task(), "    return a +\n", execution(False))
    assert broken.components["compiled"] == 0.0


def test_program_continues_the_prompt_or_stands_alone():
    task = python_task()
    assert program(task, "    return a + b\n") == (task.prompt + "    return a + b\n", 3)
    whole = "Sure!\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    assert program(task, whole) == ("def add(a, b):\n    return a + b\n", 1)
    prose = task_pb2.Task(kind="python_tests", prompt="Write add.", python_tests=task_pb2.PythonTests(entry_point="add"))
    assert program(prose, "def helper():\n    pass\n")[0] == "def helper():\n    pass\n"


@pytest.mark.parametrize("source,pattern", [
    ("import os\nos.write(3, b'x')\n", "writes_report_fd"),
    ("f = open(4, 'w')\n", "writes_report_fd"),
    ("class A:\n    def __eq__(self, o):\n        return True\n", "always_equal"),
    ("class A:\n    __ne__ = lambda s, o: False\n", "always_equal"),
    ("import builtins\nbuiltins.print = None\n", "patched_builtins"),
    ("__builtins__['len'] = None\n", "patched_builtins"),
    ("setattr(__builtins__, 'len', None)\n", "patched_builtins"),
    ("import unittest\nunittest.TestCase.assertTrue = lambda *a: None\n", "assert_machinery"),
    ("AssertionError = Exception\n", "assert_machinery"),
    ("import gc\nx = gc.get_referrers(1)\n", "introspection"),
    ("import sys\nf = sys._getframe().f_back.f_locals\n", "introspection"),
    ("def f():\n    pass\nf.__code__ = (lambda: 1).__code__\n", "code_patching"),
    ("import json\njson.loads = None\n", "patched_stdlib"),
    ("import json as j\nj.loads = None\n", "patched_stdlib"),
    ("import sys\nsys.modules['ast'] = None\n", "patched_stdlib"),
    # the module itself, inside a function that binds no name of its own over it
    ("import json\ndef f():\n    json.loads = None\n", "patched_stdlib"),
    ("import copy\ndef f():\n    global copy\n    copy = None\n    copy.deepcopy = None\n", "patched_stdlib"),
    ("import unittest\nunittest.TestCase.failUnlessEqual = None\n", "assert_machinery"),
    ("import unittest\nt = unittest.TestCase\nt.assertEqual = None\n", "assert_machinery"),
])
def test_source_scan_names_patterns(source, pattern):
    assert pattern in [p for p, _ in tamper_scan.scan_source(source)]


@pytest.mark.parametrize("source", [
    "failures = 0\nfail_count = 1\nassert_ok = True\n",
    "import sys, io\nsys.stdout = io.StringIO()\nsys.setrecursionlimit(5000)\n",
    "class P:\n    def __eq__(self, o):\n        return self.x == o.x\n",
    "import os\nos.write(1, b'hello')\nopen('data.txt', 'w')\n",
    "import collections\nc = collections.Counter('abc')\n",
    "class T:\n    def __init__(self):\n        self.failures = []\n        self.assertions = 0\n",
    # names that are modules only where an import binds them: a linked list's copy, a tree's ast node
    "def clone(head):\n    copy = Node(head.val)\n    copy.next = None\n    return copy\n",
    "def build(tree):\n    ast = Node()\n    ast.left = tree\n    return ast\n",
    "def link(node, root):\n    node.fail_link = root\n    node.fail = root\n",
    "def link(child, root, job):\n    child.failLink = root\n    job.assert_ok = True\n",
    # a function's own name hides the module an import bound to it
    "import copy\ndef clone(n):\n    copy = N()\n    copy.value = n\n    return copy\n",
    "import json\ndef parse(json):\n    json.cache = {}\n",
    "import ast\ndef walk():\n    for ast in nodes:\n        ast.seen = True\n",
])
def test_source_scan_leaves_honest_code_alone(source):
    assert tamper_scan.scan_source(source) == []


def test_source_scan_ignores_the_trusted_prompt():
    prompt = "import sys\nf = sys._getframe()\n"
    assert tamper_scan.scan_source(prompt + "x = 1\n", first_line=3) == []


@pytest.mark.parametrize("out,fake", [
    (b'{"name": "check", "passed": true}\n', True),
    (b"All tests passed!\n", True),
    (b"===== 3 passed in 0.02s =====\n", True),
    (b"Ran 3 tests in 0.001s\n\nOK\n", True),
    (b"PASSED\n", True),
    (b"test_add ... ok\n", True),
    (b"42\n[1, 2, 3]\nthe answer passed through\n", False),
    (b'{"status": "computing", "input": 3, "bypass": false}\n', False),
    (b'{"status": "passed"}\n', True),
    (b'{"password_set": true, "status": "ok"}\n', False),
    (b'{"user": "a", "pass_rate": 0.5, "result": "success"}\n', False),
    (b"OK\n", False),
    (b"", False),
])
def test_output_scan(out, fake):
    assert bool(tamper_scan.scan_output(out, b"")) is fake


# --- the plain-data wall ---------------------------------------------------------------------------

@pytest.mark.parametrize("value", [
    None, True, 0, -5, 2 ** 70, 1.5, -0.0, float("inf"), float("nan"), 1 + 2j, "", "é\x00", b"\x00\xff",
    bytearray(b"ab"), [1, [2, (3, {4})]], (), {"a": 1, 2: [3], (4, 5): None}, frozenset({1, "x"}),
    pytest.param(10 ** 5000, id="int_of_5000_digits"),
    Fraction(-7, 3), Decimal("1.10"), Decimal("-Infinity"), date(2024, 2, 29), datetime(2024, 1, 2, 3, 4, 5, 6),
    datetime(2024, 1, 2, tzinfo=timezone(timedelta(hours=-3))), time(23, 59, 1), timedelta(-1, 5, 7), range(1, 9, 2),
    deque([1, [2]], maxlen=4), [Fraction(2 ** 100, 3), {"d": deque()}],
    datetime(2024, 11, 3, 1, 30, fold=1), time(1, 2, tzinfo=timezone(timedelta(hours=1), "CET")),
])
def test_plain_values_round_trip_exactly(value):
    back = plain.from_tree(plain.loads(plain.dumps(plain.to_tree(value))))
    if value != value:  # nan
        assert back != back
    else:
        assert back == value and type(back) is type(value)
        if isinstance(value, (datetime, time)):  # what equality does not compare
            assert (back.fold, back.tzname()) == (value.fold, value.tzname())


def test_subclasses_cross_as_their_base_and_are_flagged_when_they_steer():
    class Sneaky(int):
        def __eq__(self, other):
            return True

    class Honest(dict):
        pass

    flags = []
    tree = plain.to_tree([Sneaky(3), Honest(a=1)], flags)
    back = plain.from_tree(tree)
    assert back == [3, {"a": 1}] and type(back[0]) is int and type(back[1]) is dict
    assert [f[0] for f in flags] == ["non_plain_return"]


def test_a_buffer_that_is_not_a_bytearray_is_not_plain_data():
    """An array.array or a memoryview compares unequal to its items' list or its bytes in one process:
    read as a bytearray through its buffer, it would cross as something else. A bytearray's subclass
    still crosses as the bytearray it holds."""
    import array

    class Buffer(bytearray):
        pass

    for value in (array.array("i", [0, 1, 4]), memoryview(b"ab"), array.array("b", b"ab")):
        with pytest.raises(plain.NotPlain):
            plain.to_tree(value)
    back = plain.from_tree(plain.to_tree(Buffer(b"ab")))
    assert back == bytearray(b"ab") and type(back) is bytearray


def test_only_the_standard_librarys_own_value_classes_cross():
    """A subclass of Fraction (its methods its author's), a datetime in a zone with methods of its own:
    not plain data."""
    class Third(Fraction):
        def __eq__(self, other):
            return True

    class Zone(tzinfo):
        def utcoffset(self, when):
            return timedelta(0)

    for value in (Third(1, 3), datetime(2024, 1, 1, tzinfo=Zone()), time(1, tzinfo=Zone())):
        with pytest.raises(plain.NotPlain):
            plain.to_tree(value)


@pytest.mark.parametrize("tree", [["Q", "1", 0], ["Q", 1, 0], ["D", "zz"], ["R", "a", 1, 1], ["R", 1, 2, 0], ["q", "x", 1],
                                  ["Y", 5], ["S", 1, 2], ["q"], ["W", "2024-13-01"]])
def test_malformed_standard_library_values_are_refused(tree):
    with pytest.raises(ValueError):
        plain.from_tree(tree)


@pytest.mark.parametrize("tree", [["x", 1], {"a": 1}, ["d", 1], ["s", ["l"]], ["b", "!!"], ["c", 1, "a"],
                                  ["F", "1.5"], ["I", "zz"]])
def test_malformed_trees_are_refused(tree):
    with pytest.raises(ValueError):
        plain.from_tree(tree)


def test_messages_are_json_as_the_standard_library_writes_it_and_read_back_whole():
    message = {"ok": plain.to_tree([1, "é\u2028\x00", 2.5, None, True, {"k": (1,)}]), "flags": [["a", "b"]],
               "usage": [0.25, 0, 1 << 40]}
    data = plain.dumps(message)
    assert data == json.dumps(message, separators=(",", ":"), allow_nan=False).encode() and data.isascii()
    assert plain.loads(data) == message


@pytest.mark.parametrize("data", [b"", b" {}", b"{} ", b'{"a":1}{"b":2}', b'{"a":1', b"\xff", "{}".encode("utf-16")])
def test_anything_but_one_json_value_is_refused(data):
    with pytest.raises(ValueError):
        plain.loads(data)


@pytest.mark.parametrize("value, error", [(float("nan"), ValueError), ([float("inf")], ValueError),
                                          ({"x": object()}, TypeError), ({"x": b"raw"}, TypeError)])
def test_what_json_cannot_hold_is_never_written(value, error):
    with pytest.raises(error):
        plain.dumps(value)


def test_deep_or_huge_replies_are_refused():
    with pytest.raises(ValueError):
        plain.loads(b"[" * 100_000 + b"]" * 100_000)
    deep = ["l"]
    for _ in range(plain.MAX_DEPTH + 5):
        deep = ["l", deep]
    with pytest.raises(ValueError, match="deeper"):
        plain.from_tree(deep)


def test_scans_of_hostile_output_stay_linear():
    import time

    hostile = ["<answer>" * 20_000, "Answer: x" + " " * 100_000 + "y", "\n" * 100_000 + "x", " " * 65_536 + "x",
               "PASS" + " " * 65_536 + "x", "test_x ..." + " " * 65_536]
    started = time.perf_counter()
    for text in hostile:
        final_answer(text)
        tamper_scan.scan_output(text.encode()[:65_536], b"")
        program(python_task(), text)
    assert time.perf_counter() - started < 2.0
