"""`python_tests`: code checked by unit tests in the sandbox (HumanEval style).

The completion either continues the prompt (a signature and docstring, then
the body) or is a whole program defining the entry point; a fenced ```python
block is taken out of surrounding prose. The sandbox runs the tests in its
harness, where the candidate's process cannot reach the results; the prompt
goes along as the harness's trusted prelude (helpers the tests call come from
it, never from the candidate). The verdict adds what reading the source and
the output shows (`tamper_scan.py`); any tamper signal pays zero.
"""
from __future__ import annotations

import ast
import functools
import math
import re
import sys

from crucible.v1 import execution_pb2, task_pb2
from crucible.ml.kinds import tamper_scan
from crucible.ml.kinds.registry import Kind, Score, register
from crucible.shared import tamper_patterns, test_report

# (No two runs of the same characters side by side: "```" and a long run of spaces with no newline cost
# time quadratic in the run, on the services' event loops, where rollouts are made into jobs.)
_FENCE = re.compile(r"```[ \t]*(?:(?:python3?|py)[ \t]*)?\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
TIMED_OUT = {execution_pb2.VIOLATION_TIMEOUT, execution_pb2.VIOLATION_CPU}


def _defines(code: str, entry: str) -> bool:
    return bool(entry) and re.search(rf"^[ \t]*(async[ \t]+)?def[ \t]+{re.escape(entry)}[ \t]*\(", code,
                                     re.MULTILINE) is not None


def code_of(task: task_pb2.Task, completion: str) -> str:
    """The code in a completion: a fenced block if there is one (the one defining the entry point first)."""
    blocks = _FENCE.findall(completion)
    if not blocks:
        return completion
    entry = task.python_tests.entry_point
    return next((b for b in blocks if _defines(b, entry)), blocks[0])


def _compiles(source: str) -> bool:
    try:
        compile(source, "<prompt>", "exec")
        return True
    except (SyntaxError, ValueError):
        return False


def continues_prompt(task: task_pb2.Task) -> bool:
    """Whether the prompt is code the completion continues (a signature and docstring, maybe without a body)."""
    return _compiles(task.prompt) or _compiles(task.prompt + "    pass\n")


def program(task: task_pb2.Task, completion: str) -> tuple[str, int]:
    """(the program a completion stands for, the first line that is the completion's own).

    A completion that defines the entry point, or answers a prompt that is not
    code, is a whole program; otherwise it continues the prompt.
    """
    code = code_of(task, completion)
    entry = task.python_tests.entry_point
    if not entry or _defines(code, entry) or not continues_prompt(task):
        return code, 1
    return task.prompt + code, task.prompt.count("\n") + 1


def prelude(task: task_pb2.Task) -> str:
    """The prompt's code (prompt_code), when the tests use something it defines (HumanEval/38's tests
    call the prompt's encode_cyclic): run by the harness before the tests, never by the candidate, and
    what it defines is the task's, never taken from the candidate (the harness takes a candidate's
    version only of what the prelude merely declares). Empty otherwise, which spares the harness
    parsing a prompt no test needs."""
    return _prelude(task.prompt, task.python_tests.test_code, task.python_tests.entry_point)


@functools.lru_cache(maxsize=4096)
def _prelude(prompt: str, tests: str, entry_point: str) -> str:
    code = prompt_code(prompt)
    try:
        prompt_tree, tests_tree = ast.parse(code), ast.parse(tests)
    except (SyntaxError, ValueError):
        return ""
    defined = set()  # anywhere in the prompt, not only at its top level (a helper defined under try:)
    for node in ast.walk(prompt_tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
    used = {n.id for n in ast.walk(tests_tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return code if (defined - {entry_point}) & used else ""


def _is_test_name(name: str) -> bool:
    return name == "check" or name.startswith("test_")


def prompt_code(prompt: str) -> str:
    """The Python a prompt gives: the prompt itself where it compiles (a last signature without a body,
    as a completion continues it, given one), else the definitions and imports of its fenced blocks (a
    prompt in prose showing a helper; their other statements, examples of use, are left out); empty
    when there is none."""
    for source in (prompt, prompt + "    pass\n"):
        if _compiles(source):
            return source
    kept = []
    for block in _FENCE.findall(prompt):
        for source in (block, block + "\n    pass\n"):
            try:
                tree = ast.parse(source)
            except (SyntaxError, ValueError):
                continue
            kept += [node for node in tree.body if isinstance(node, (
                ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom))
                and not _is_test_name(getattr(node, "name", ""))]  # (an example test shown is no test)
            break
    return ast.unparse(ast.Module(body=kept, type_ignores=[])) + "\n" if kept else ""


# The one test that test code of top-level statements is (MBPP's `assert f(2) == 4` lines, with an
# entry point): the harness runs it once the entry point is the candidate's (harness.MODULE_TEST).
MODULE_TEST = "tests"


def declared_tests(task: task_pb2.Task) -> list[str]:
    """The tests the task's test code declares, read here (outside the sandbox, before anything runs):
    check(candidate) when there is an entry point, then every top-level test_* function, in order;
    with neither, its top-level statements as one test (MODULE_TEST). The reward is counted against
    these, never against what a run happened to report."""
    return list(_declared(task.python_tests.test_code, bool(task.python_tests.entry_point)))


@functools.lru_cache(maxsize=4096)
def _declared(test_code: str, has_entry: bool) -> tuple[str, ...]:
    try:
        tree = ast.parse(test_code)
    except (SyntaxError, ValueError):
        return ()
    defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    names = ["check"] if has_entry and "check" in defined else []
    names += [n for n in defined if n.startswith("test_")]
    if not names and has_entry:
        names = [MODULE_TEST]
    return tuple(dict.fromkeys(names))


def _named_at_top_level(test_code: str, name: str) -> bool:
    """Whether a statement the module runs as it loads (not a def, a class, or a __main__ guard) names `name`."""
    for node in ast.parse(test_code).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.If) and "__name__" in {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}:
            continue
        if any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node)):
            return True
    return False


def _binds_at_top_level(test_code: str, name: str) -> bool:
    """Whether the tests' module-level code binds `name` as it loads: a def, a class, an assignment, an
    import (a star import may: refused too), a for, with or except target, or a function declaring it
    global. Code under `if __name__ == "__main__":` never runs there; comprehensions and lambdas have
    scopes of their own."""
    todo = list(ast.parse(test_code).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Global) and name in node.names:
            return True
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == name:
                return True
            todo += [n for n in ast.walk(node) if isinstance(n, ast.Global)]  # `global f` inside a helper
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(alias.name == "*" or (alias.asname or alias.name.split(".")[0]) == name for alias in node.names):
                return True
            continue
        if isinstance(node, ast.ExceptHandler) and node.name == name:
            return True
        if isinstance(node, ast.If) and _is_main_guard(node.test):
            todo += node.orelse
            continue
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.stmt, ast.ExceptHandler)):
                todo.append(child)
            elif not isinstance(child, _OWN_SCOPES) and _stores(child, name):
                return True
    return False


_OWN_SCOPES = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Lambda)


def _stores(expression: ast.AST, name: str) -> bool:
    """Whether `expression` binds `name` in the scope it runs in (not inside a comprehension or lambda of it)."""
    todo = [expression]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store):
            return True
        todo += [child for child in ast.iter_child_nodes(node) if not isinstance(child, _OWN_SCOPES)]
    return False


def _is_main_guard(test: ast.expr) -> bool:
    """`__name__ == "__main__"` (either way round)."""
    return (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
            and {_constant_or_name(test.left), _constant_or_name(test.comparators[0])} == {"__name__", "'__main__'"})


def _constant_or_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return repr(node.value)
    return None


def _not_in_the_sandbox(test_code: str) -> list[str]:
    """Modules the tests import that the sandbox cannot give them (it runs the standard library only)."""
    found = []
    for node in ast.walk(ast.parse(test_code)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
        found += [n.split(".")[0] for n in names if n.split(".")[0] not in sys.stdlib_module_names]
    return sorted(set(found))


class PythonTestsKind(Kind):
    name = "python_tests"
    payload = "python_tests"

    def problems(self, task: task_pb2.Task) -> list[str]:
        problems = super().problems(task)
        if problems:
            return problems
        tests = task.python_tests
        if tests.language not in ("", "python"):
            problems.append(f"python_tests.language {tests.language!r} is not supported: use 'python'")
        if not tests.test_code.strip():
            problems.append("python_tests.test_code is empty: give check(candidate) or test_* functions")
        else:
            try:
                compile(tests.test_code, "<tests>", "exec")
            except SyntaxError as exc:
                problems.append(f"python_tests.test_code does not compile: {exc.msg} (line {exc.lineno})")
            else:
                if tests.entry_point and declared_tests(task) == [MODULE_TEST] and \
                        not _named_at_top_level(tests.test_code, tests.entry_point):
                    problems.append(
                        f"python_tests.test_code has no check(candidate), no test_* function and no top-level "
                        f"statement that calls {tests.entry_point}: nothing in it would test the program "
                        "(unittest.TestCase classes and code under `if __name__ == '__main__':` are not run)")
                if tests.entry_point and _binds_at_top_level(tests.test_code, tests.entry_point):
                    problems.append(
                        f"python_tests.test_code defines {tests.entry_point} itself, or may (a star import): its "
                        f"tests would judge that definition, not the program's (name a reference solution "
                        f"otherwise, e.g. reference_{tests.entry_point}, and import names one by one)")
                declared = declared_tests(task)
                if len(declared) > test_report.MAX_TESTS:
                    problems.append(f"python_tests.test_code declares {len(declared)} tests: the sandbox reports at "
                                    f"most {test_report.MAX_TESTS} (join some into one)")
                missing = _not_in_the_sandbox(tests.test_code)
                if missing:
                    problems.append(f"python_tests.test_code imports {', '.join(missing)}: the sandbox has the "
                                    "standard library only (plain asserts work: a failed one fails the test)")
            if not tests.entry_point and "def test_" not in tests.test_code:
                problems.append("python_tests.entry_point is empty: check(candidate) needs the function to test")
        if not (math.isfinite(tests.timeout_s) and tests.timeout_s >= 0):
            problems.append(f"python_tests.timeout_s {tests.timeout_s} must be a number >= 0 (0: the sandbox's default)")
        return problems

    def render_prompt(self, task: task_pb2.Task) -> str:
        if continues_prompt(task) or task.metadata.get("prompt_format") == "raw":
            return task.prompt  # code to continue, HumanEval style
        return (f"{task.prompt.rstrip()}\n\nAnswer with a complete Python program in a ```python block "
                f"that defines `{task.python_tests.entry_point}`.")

    def execution(self, task: task_pb2.Task, completion: str) -> execution_pb2.ExecuteRequest:
        tests = task.python_tests
        code, _ = program(task, completion)
        return execution_pb2.ExecuteRequest(
            language=tests.language or "python", code=code, test_code=tests.test_code,
            entry_point=tests.entry_point, timeout_s=tests.timeout_s, test_prelude=prelude(task))

    def score(self, task: task_pb2.Task, completion: str,
              execution: execution_pb2.ExecutionResult | None = None) -> Score:
        if execution is None:
            raise ValueError("a python_tests completion is scored from its sandbox run: pass the execution result")
        code, first_line = program(task, completion)
        try:
            compile(code, "<candidate>", "exec")
            compiled = 1.0
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            compiled = 0.0
        signals = [tamper_patterns.known(t.pattern, t.detail) for t in execution.tamper]
        signals += tamper_scan.scan_run(execution.violation, execution.violation_detail)
        signals += tamper_scan.scan_source(code, first_line)
        signals += tamper_scan.scan_output(execution.stdout, execution.stderr)
        # Counted against the declared tests: the task's own (read here), and any more the harness
        # collected before the candidate ran (tests made at run time). A test with no outcome did not
        # run to completion (a hang, a flood, a kill, an exit): it failed. An outcome for anything
        # else is not a test of this task and pays nothing; a test reported twice counts once, first.
        expected = list(dict.fromkeys(declared_tests(task) + list(execution.tests_declared)))
        outcomes: dict[str, bool] = {}
        for t in execution.tests:
            outcomes.setdefault(t.name, t.passed)
        if not expected:  # nothing declared anywhere (not a tested run): what was reported, which fails
            expected = list(outcomes) or [MODULE_TEST]
        passed = sum(outcomes.get(name) is True for name in expected)
        total = len(expected)
        unfinished = [name for name in expected if name not in outcomes]
        timed_out = float(execution.violation in TIMED_OUT)
        components = {"tests_passed": float(passed), "tests_total": float(total), "compiled": compiled,
                      "format_ok": compiled, "timed_out": timed_out, "tampered": float(bool(signals))}
        failed = [t for t in execution.tests if not t.passed]
        detail = f"{passed}/{total} tests passed"
        if failed:
            detail += f"; {failed[0].name}: {failed[0].message[:200]}"
        if unfinished:
            detail += f"; did not finish: {', '.join(unfinished[:5])}"
        if execution.not_run:
            detail += f"; not run: {execution.not_run}"
        if execution.violation:
            detail += f"; {execution_pb2.Violation.Name(execution.violation)}: {execution.violation_detail}"
        if execution.isolation != execution_pb2.ISOLATION_LEVEL_FULL:
            detail += f"; isolation {execution_pb2.IsolationLevel.Name(execution.isolation)}"
        if signals:
            detail += "; tampering: " + "; ".join(f"{p}: {d}" for p, d in signals[:5])
        patterns = tuple(dict.fromkeys(p for p, _ in signals))
        return Score(components, passed / total if total else 0.0, tampered=bool(signals), patterns=patterns,
                     detail=detail[:2000])


register(PythonTestsKind())
