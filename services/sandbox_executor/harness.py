"""The trusted test harness: a slot's process of its own, where the candidate cannot reach.

    harness   (one per cgroup slot, long-lived, pid 1 of a pid namespace of its own: runs the tests
               of the slot's tested jobs one after another, each job's report on a pipe only it holds)
    candidate (each job's jail, a fresh fork, in another pid namespace: runs the program, answers calls)

The candidate's process never has the tests: the supervisor sends them to the
harness with the job's descriptors (the call channel, the report pipe, the
candidate's pidfd), and sends the jail only the program. The candidate cannot
name the harness's pid (it is in no namespace the candidate sees), read its memory
or take its descriptors (not dumpable; seccomp forbids ptrace, process_vm_* and
pidfd_getfd). The tests call the program's
functions through proxies: arguments go over a pipe as plain data, and
results come back as JSON rebuilt into exact builtin values (`plain.py`). So
exiting early, objects whose `__eq__` is always true, patched builtins,
`assert` or `unittest` machinery, hunting for the test file or for the
expected values in memory, writing fake result lines: none of it reaches the
process that decides, which is the only one that can write a result.

Helpers the tests use that the task's prompt defines (HumanEval's
`encode_cyclic`, `poly`, ...) come from running the trusted prompt (the
`prelude`) here, never from the candidate's copy.

Report lines (JSON, on the job's report pipe): the tests about to run {"declared"}, one per test
{"name", "passed", "message"}, one per tamper signal {"tamper", "detail"}, {"gone": stage} when the
candidate's process left on its own (the supervisor, which reaps it, names an exit with code 0),
and {"done": ...} last.

Each job's tests run in a namespace of their own; the harness is replaced after any job it did not
see through (the wall clock, a forbidden call, its own failure), after a job that swelled its memory
(RETIRE_GROWTH_BYTES), after Harness.JOBS jobs, and after a job whose tests changed builtins or a
module they name (_kept_state); the recursion limit is put back and the random module reseeded after
every job. Tests are the task's, from a trusted submitter: a module they change without naming it
(through sys.modules, say) stays changed for the jobs after it in the same harness.

Stdlib only: this module is loaded into the sandbox worker, which has no site-packages.
"""
from __future__ import annotations

import _signal
import _socket
import _thread
import builtins
import collections
import gc
import json
import marshal
import os
import resource
import select
import sys

from crucible.services.sandbox_executor import candidate, plain
from crucible.services.sandbox_executor.jail.linux import recv_fds
from crucible.shared import framing, tamper_patterns, test_report


class CandidateError(Exception):
    """An exception the candidate raised whose class is its own (its name is in the message)."""


class CallFailed(BaseException):
    """A call of the candidate that did not happen as a call in one process would: the arguments could
    not cross, the candidate did not answer, or answered with what is not plain data. A BaseException,
    so a test's `except Exception:` (or `except TypeError:`) does not take it for the candidate's own
    error; and a test during which one was raised fails whatever it catches (`except:` included):
    what was never asked or never answered is never evidence of a pass (Candidate.failed)."""


class CandidateGone(CallFailed):
    """The candidate's process ended, exited, or broke the call protocol; every later call fails too."""


class NotPlainData(CallFailed):
    """The candidate returned something that is not plain data."""


class NotSent(CallFailed):
    """The test passes what cannot cross to the candidate (not plain data, or too much of it)."""


class CandidateBaseException(BaseException):
    """An exception the candidate raised that is not an Exception (a class of its own deriving from
    BaseException, a BaseExceptionGroup): as in one process, `except Exception:` does not catch it."""


# Exceptions a test may legitimately expect from the candidate. StopIteration and its async twin are
# left out: raised through `for r in map(candidate, cases)` they would end a test's loop early, silently.
_NEVER_REPLAYED = (StopIteration, StopAsyncIteration)
_REPLAYED = frozenset(name for name in dir(builtins)
                      if isinstance(getattr(builtins, name), type) and issubclass(getattr(builtins, name), Exception)
                      and not issubclass(getattr(builtins, name), _NEVER_REPLAYED))


class Report:
    """Outcome lines on the report descriptor, which only this process holds."""

    def __init__(self, fd: int):
        self.fd = fd
        self.tampered: set[tuple[str, str]] = set()
        self.failed = 0

    def _line(self, obj: dict) -> None:
        # One write per line, unbuffered: what a wall-clock kill interrupts is only what came after.
        view = memoryview((json.dumps(obj) + "\n").encode())
        while view:
            view = view[os.write(self.fd, view):]

    def outcome(self, name: str, passed: bool, message: str = "") -> None:
        self.failed += not passed
        self._line({"name": name, "passed": passed, "message": _clip(message)})

    def tamper(self, pattern: str, detail: str) -> None:
        key = (str(pattern)[:64], str(detail)[:500])
        if key not in self.tampered:
            self.tampered.add(key)
            self._line({"tamper": key[0], "detail": key[1]})

    def declared(self, names: list[str]) -> None:
        """The tests about to run, written before the candidate is asked anything: whatever cuts the
        run short, the tests that never reported count as failed."""
        self._line({"declared": [str(n)[:200] for n in names[:test_report.MAX_TESTS]]})

    def gone(self, stage: str) -> None:
        """The candidate's process ended, or stopped answering, on its own: before the tests or during
        them. The supervisor, which reaps it, reads its exit status: an exit with code 0 is named."""
        self._line({"gone": stage})

    def done(self, exit_code: int, usage: tuple[float, float, int], retire: bool = False) -> None:
        """The last line: the supervisor sends the result on it, without waiting for the jail to vanish.
        `retire`: this harness takes no more jobs (the supervisor starts a fresh one for the slot)."""
        self._line({"done": True, "exit_code": exit_code, "cpu_user_s": usage[0], "cpu_system_s": usage[1],
                    "max_rss_bytes": usage[2], "retire": retire})


MESSAGE_BYTES = 1000  # a test's failure message, as the report line carries it (JSON: escapes counted)


def _clip(message: str) -> str:
    """The message cut to at most MESSAGE_BYTES in the report's JSON, where a character takes up to 12
    bytes (a non-ASCII one is escaped): however long or foreign every failure message is, a job's report
    stays within what the supervisor reads of it (outcome.REPORT_BYTES), and no outcome crowds out
    those after it."""
    message = message[:MESSAGE_BYTES]
    while len(encoded := json.dumps(message)) - 2 > MESSAGE_BYTES:
        message = message[:len(message) * MESSAGE_BYTES // len(encoded)]
    return message


class Candidate:
    """The harness's end of the call channel to a job's candidate process (the job's jail, in another
    pid namespace: it is watched by a pidfd the supervisor passed, never signalled or reaped here)."""

    def __init__(self, pidfd: int, call_w: int, reply_r: int, report: Report):
        self.pidfd, self.call_w, self.reply_r, self.report = pidfd, call_w, reply_r, report
        self.gone: str | None = None
        self.finishing = False
        self.usage = (0.0, 0.0, 0)  # what the candidate last said it used (informational only)
        self.known: dict = {}  # the prompt's and the tests' names (_run_tests): their exception classes
        self._calling = _thread.allocate_lock()
        self.calls = 0  # calls the tests made (_run_tests: a test that made none passed nothing)
        self.failed = 0  # calls that raised CallFailed (_run_tests: a test with one passed nothing)
        self.failure = ""  # the last one's message
        self.changed: dict[int, object] = {}  # the tests' objects a call's write-back changed, by id
        self._before_tests = True  # what the reply being read is (_read_some reports a loss as such)
        self._replies = framing.Reader(self._read_some, candidate.MAX_FRAME)

    def ready(self) -> dict:
        """The candidate's first message: whether its program loaded, and the functions it defines."""
        return self._receive(before_tests=True)

    def call(self, name: str, args: tuple, kwargs: dict):
        self.calls += 1
        try:
            return self._call(name, args, kwargs)
        except CallFailed as exc:
            self.failed += 1
            self.failure = str(exc)
            raise

    def _call(self, name: str, args: tuple, kwargs: dict):
        if self.gone:
            raise CandidateGone(self.gone)
        try:
            request = {"op": "call", "name": name, "args": plain.to_tree(args), "kwargs": plain.to_tree(kwargs)}
        except plain.NotPlain as exc:
            raise NotSent(f"the test passes {exc} to {name}(); only plain data can cross to the candidate") from None
        # Mutable arguments come back after the call and are written into the test's own objects,
        # so a test sees in-place changes (or their absence) as it would in one process.
        # Whether it returns or raises (a test may check that a failed call left its input alone).
        mutable = any(map(_holds_mutable, (*args, *kwargs.values())))
        request["mutable"] = mutable
        with self._calling:  # tests that call from several threads: one call on the channel at a time
            self._send(request)
            reply = self._receive(before_tests=False)
        if "ok" in reply or (mutable and "args" in reply):
            try:
                resolve = None
                if mutable:
                    new_args, new_kwargs = plain.from_tree(reply["args"])
                    _write_back((*args, *kwargs.values()), (*new_args, *(new_kwargs[k] for k in kwargs)),
                                self.changed)
                    # What the value shares with the arguments is the test's own object there, as updated.
                    resolve = plain.resolver(plain.roots(args, kwargs))
                value = plain.from_tree(reply["ok"], resolve=resolve) if "ok" in reply else None
            except (ValueError, KeyError, TypeError) as exc:
                self.report.tamper("forged_reply", f"{name}() answered with a malformed value: {exc}")
                raise CandidateGone(f"{name}() answered with a malformed value") from None
            except Exception as exc:  # whatever else taking the answer raised: never the test's to catch
                raise NotPlainData(f"{name}() answered with what the tests cannot take: "
                                   f"{type(exc).__name__}") from None
            if "ok" in reply:
                return value
        if reply.get("error") == "non_plain":
            raise NotPlainData(str(reply.get("message", "not plain data"))[:1000])
        if "raise" in reply:
            raised, message = str(reply["raise"]), str(reply.get("message", ""))[:1000]
            if raised in ("SystemExit", "KeyboardInterrupt", "GeneratorExit"):
                raise CandidateGone(f"{name}() raised {raised}: {message}")
            try:
                args = plain.from_tree(reply["exception_args"]) if "exception_args" in reply else (message,)
            except ValueError:
                args = (message,)
            raise _exception(raised, args if type(args) is tuple else (message,), message,
                             str(reply.get("class", raised))[:200], self.known, str(reply.get("module", "")))
        self.report.tamper("forged_reply", f"{name}() answered with {sorted(reply)[:5]}")
        raise CandidateGone("the candidate broke the call protocol")

    def finish(self) -> None:
        """Done with the candidate: its channel closes, so it leaves (the supervisor ends its jail once
        the report says done). Its last tamper signals came with its last reply."""
        self.finishing = True
        for fd in (self.call_w, self.reply_r, self.pidfd):
            try:
                os.close(fd)
            except OSError:
                pass

    # --- wire ---

    def _send(self, obj: dict) -> None:
        try:
            framing.write(self.call_w, plain.dumps(obj), candidate.MAX_FRAME)
        except framing.FrameTooLarge as exc:
            raise NotSent(f"the test passes {exc.size} bytes of data to {obj['name']}(); "
                          f"at most {exc.limit} cross to the candidate") from None
        except OSError:
            self._lost(before_tests=False)

    def _receive(self, before_tests: bool) -> dict:
        self._before_tests = before_tests
        try:
            data = self._replies.frame()  # never None nor cut short: _read_some raises CandidateGone first
        except framing.FrameTooLarge as exc:
            # The candidate's side caps its own replies: this was written by something else.
            self.report.tamper("forged_reply", f"the call channel announced a {exc.size}-byte reply")
            self.gone = "the candidate broke the call protocol"
            raise CandidateGone(self.gone) from None
        try:
            reply = plain.loads(data)
        except ValueError as exc:
            self.report.tamper("forged_reply", f"the call channel carried something that is not a reply: {exc}")
            self.gone = "the candidate broke the call protocol"
            raise CandidateGone(self.gone) from None
        if type(reply) is not dict:
            self.report.tamper("forged_reply", "the call channel carried something that is not a reply")
            self.gone = "the candidate broke the call protocol"
            raise CandidateGone(self.gone)
        usage = reply.get("usage")  # written by the candidate's side, or forged: finite and in range, or ignored
        if type(usage) is list and len(usage) == 3 and all(type(u) in (int, float) and 0 <= u < 2 ** 53 for u in usage):
            self.usage = (float(usage[0]), float(usage[1]), int(usage[2]))
        flags = reply.get("flags")
        if type(flags) is list:
            for item in flags[:64]:
                if type(item) is list and len(item) == 2:
                    pattern, detail = str(item[0]), str(item[1])
                    if pattern in tamper_patterns.PATTERNS:
                        self.report.tamper(pattern, detail)
                    else:  # the candidate's side only sends names from the set: this was written by the program
                        self.report.tamper("forged_reply", f"the call channel carried a signal named {pattern[:40]!r}")
        return reply

    def _read_some(self, n: int) -> bytes:
        """Up to n bytes of the candidate's replies, once there are some; CandidateGone (_lost) once the
        channel closed or the candidate's process ended with nothing left in it."""
        watched = [self.reply_r] + ([self.pidfd] if self.pidfd >= 0 else [])
        readable, _, _ = select.select(watched, [], [])
        if self.reply_r in readable:
            chunk = os.read(self.reply_r, n)
            if chunk:
                return chunk
        elif self.pidfd in readable:
            # Exited, but a child of its own may still hold the pipe: drain what is there, then stop.
            os.set_blocking(self.reply_r, False)
            try:
                chunk = os.read(self.reply_r, n)
            except BlockingIOError:
                chunk = b""
            os.set_blocking(self.reply_r, True)
            if chunk:
                return chunk
        self._lost(self._before_tests)

    def _lost(self, before_tests: bool) -> None:
        """The candidate stopped answering: say so (the supervisor, which reaps it, names an exit that
        claims success) and fail this call and every later one."""
        if not self.finishing and self.gone is None:
            self.report.gone("before_tests" if before_tests else "during_tests")
        self.gone = "the candidate's process ended" if self.gone is None else self.gone
        raise CandidateGone(self.gone)


def serve(control: int, workdir: str | None) -> None:
    """A slot's harness: runs the tests of one tested job after another, as the supervisor sends them on
    `control` (a stream socket): the job's descriptors (the candidate's call channel, the report pipe,
    the candidate's pidfd) with one byte, then the job and its tests as two frames. Returns when the
    socket closes. Each job's tests run in a namespace of their own; nothing of the candidate's but
    plain data ever reaches this process."""
    _harden()
    sock = _socket.socket(fileno=control)
    start_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    while True:
        message, fds = recv_fds(sock, 1, 4)
        if not message:
            return
        if len(fds) != 4:
            raise RuntimeError(f"a job came with {len(fds)} descriptors, not 4")
        call_w, reply_r, report_fd, pidfd = fds
        job, tests = framing.read(control), framing.read(control, TESTS_FRAME_LIMIT)
        if job is None or tests is None:
            return
        if workdir is not None:
            try:
                os.chdir(workdir)  # the job's own /work, mounted by its jail (the slot's mount namespace)
            except OSError:  # the program shut its own folder (chmod 0): its tests run from / (this
                pass         # process went down with the error before, and the next job waited for another)
        retired = run(marshal.loads(job), report_fd, marshal.loads(tests),
                      Candidate(pidfd, call_w, reply_r, Report(report_fd)), start_peak)
        os.close(report_fd)
        if retired:
            return
        if workdir is not None:
            os.chdir("/")


# A job whose data took the harness's peak memory this far above where it started retires it: a later
# job's tests never run in a heap an earlier candidate's replies bloated or fragmented.
RETIRE_GROWTH_BYTES = 64 << 20


def run(job: dict, report_fd: int, tests: dict, child: Candidate, start_peak: int = 0) -> bool:
    """Runs a tested job's tests against its candidate; writes the report, `done` last (its exit code: 0
    when every test passed and nothing was flagged, else 1); whether this harness retires after it."""
    report = child.report
    before = resource.getrusage(resource.RUSAGE_SELF)
    kept = _kept_state(tests)
    try:
        _run_tests(job, tests, child, report)
    except Exception as exc:  # outside any test (each test's own errors are its outcome): this job fails,
        report.outcome("harness", False, _described(exc)[:1000])  # the harness goes on
    finally:
        child.finish()
    code = 1 if report.failed or report.tampered else 0
    own = resource.getrusage(resource.RUSAGE_SELF)
    retire = (own.ru_maxrss * 1024 > start_peak + RETIRE_GROWTH_BYTES or _changed(kept)
              or _held_beyond_the_job(child))
    report.done(code, (own.ru_utime - before.ru_utime + child.usage[0], own.ru_stime - before.ru_stime + child.usage[1],
                       child.usage[2]), retire)
    return retire


def _harden() -> None:
    # The jail made itself non-dumpable before the job arrived (no process of the same uid may read
    # this one's memory or take its descriptors); seccomp forbids ptrace, process_vm_* and pidfd_getfd.
    _signal.signal(_signal.SIGPIPE, _signal.SIG_IGN)  # a candidate closing its end is an EPIPE, not our death


# --- the tests, compiled where compiling is cheap ---------------------------------------------------

PRELUDE_FILE, TESTS_FILE = "/work/prelude.py", "/work/test_program.py"
TESTS_FRAME_LIMIT = 256 << 20  # the supervisor's frame (it takes jobs of at most 8 MiB of text)


class CompiledTests:
    """A tested job's prelude and tests as the harness takes them: compiled by the supervisor and
    marshalled. The supervisor is a warm process, where compiling costs a fraction of what it does in
    a freshly forked harness (the compiler's pages copied on first touch: about 0.5 ms for a HumanEval
    test), and it keeps the last `entries` tasks' frames, so the samples of a group (the same tests,
    many candidates) are compiled once, and so is a task set of some hundreds of tasks that comes
    round again (epochs; HumanEval's 164 cost a fifth of the supervisor's time when only 64 were
    kept). Compiling runs no code; the text is the task's, from a
    trusted submitter, and a text that does not compile becomes the error the harness reports."""

    def __init__(self, entries: int = 512, max_bytes: int = 64 << 20):
        self.entries, self.max_bytes = entries, max_bytes
        self._frames: dict[tuple[str, str], bytes] = {}  # insertion order: least recently used first
        self._bytes = 0
        self._lock = _thread.allocate_lock()  # the supervisor's runner threads share it

    def frame(self, tests: str, prelude: str) -> bytes:
        key = (tests, prelude)
        with self._lock:
            frame = self._frames.pop(key, None)
            if frame is not None:
                self._frames[key] = frame
                return frame
        frame = _frame(tests, prelude)  # outside the lock: a large text holds up no other runner's job
        with self._lock:
            old = self._frames.pop(key, None)
            if old is not None:
                self._bytes -= len(old) + len(tests) + len(prelude)
            self._frames[key] = frame
            self._bytes += len(frame) + len(tests) + len(prelude)
            while self._frames and (len(self._frames) > self.entries or self._bytes > self.max_bytes):
                (old_tests, old_prelude), old = next(iter(self._frames.items()))
                del self._frames[(old_tests, old_prelude)]
                self._bytes -= len(old) + len(old_tests) + len(old_prelude)
        return frame


def _frame(tests: str, prelude: str) -> bytes:
    parts = {"prelude": _compiled(prelude, PRELUDE_FILE) if prelude else None, "tests": _compiled(tests, TESTS_FILE),
             "prelude_source": prelude}
    try:
        return marshal.dumps(parts)
    except ValueError as exc:  # a constant nested deeper than marshal writes
        return marshal.dumps({"prelude": None, "tests": {"error": f"ValueError: {exc}"}, "prelude_source": ""})


def _compiled(source: str, filename: str):
    """The code, or {"error": what compiling said}. Compiled as written (no future statement of ours)."""
    try:
        return compile(source, filename, "exec", dont_inherit=True)
    except Exception as exc:  # SyntaxError, ValueError (a NUL), RecursionError, MemoryError
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}


class _DidNotCompile(Exception):
    pass


MODULE_TEST = "tests"  # the one test that tests made of top-level statements are (python_tests.declared_tests)


def _defines_test_functions(code) -> bool:
    """Whether test code defines check() or test_* functions at its top level (their code objects are
    the module's constants)."""
    return any(getattr(const, "co_name", "") == "check" or getattr(const, "co_name", "").startswith("test_")
               for const in code.co_consts)


def _code(part):
    if type(part) is dict:
        raise _DidNotCompile(part.get("error", "did not compile"))
    return part


def _kept_state(tests: dict) -> tuple:
    """What one job's tests may change of this process that the next job's tests would meet, as it is
    before they run: builtins and the modules the tests name (their attributes), the recursion limit. A
    test that patched `abs` or `math.floor`, or lowered the recursion limit, and never undid it, failed
    another task's correct program later in the same harness (_changed)."""
    names = set()
    for part in (tests.get("prelude"), tests.get("tests")):
        if hasattr(part, "co_names"):
            names |= _names(part)
    modules = [sys.modules[n] for n in names if n in sys.modules and n not in ("sys", "builtins")]
    modules.append(builtins)
    return [(m.__dict__, dict(m.__dict__)) for m in modules], sys.getrecursionlimit()


def _changed(kept: tuple) -> bool:
    """Whether the job's tests changed what `_kept_state` saw (the harness then retires: its successor
    starts clean; a module's attributes put back by hand could disagree with what the module keeps
    itself). The recursion limit is put back and the random module reseeded (a seed a test set is no
    later job's sequence) whatever they did."""
    saved, limit = kept
    if sys.getrecursionlimit() != limit:
        sys.setrecursionlimit(limit)
    generator = sys.modules.get("random")
    if generator is not None:
        generator.seed()
    return any(len(now) != len(then) or any(now.get(k, _MISSING) is not v for k, v in then.items())
               for now, then in saved)


def _run_tests(job: dict, tests: dict, child: Candidate, report: Report) -> None:
    namespace: dict = {"__name__": "__tests__", "__builtins__": builtins}
    try:
        _run_tests_in(namespace, job, tests, child, report)
    finally:
        # The tests' functions hold their namespace (as globals) and it holds them: emptied, the job's
        # objects go now, not at some later collection (_held_beyond_the_job counts who still holds them).
        namespace.clear()


def _run_tests_in(namespace: dict, job: dict, tests: dict, child: Candidate, report: Report) -> None:
    entry = job.get("entry_point") or ""
    prelude = tests.get("prelude_source") or ""
    try:
        if tests.get("prelude") is not None:
            exec(_code(tests["prelude"]), namespace)
        prelude_names = dict(namespace)  # what the prompt defines: the candidate's program has it too
        trusted = set(namespace)
        test_code = _code(tests["tests"])
        # Tests that are statements at the top level (MBPP's `assert f(2) == 4` lines) name the entry
        # point as they load: they run once it stands for the candidate's, as one test, MODULE_TEST.
        module_level = bool(entry) and not _defines_test_functions(test_code)
        if not module_level:
            exec(test_code, namespace)
        # What the tests define (or define again): only these are tests (a prompt's example test_* is not)
        defined_by_tests = {n for n, v in namespace.items() if prelude_names.get(n, _MISSING) is not v}
        used_by_tests = _names(test_code)
    except BaseException as exc:
        report.outcome("load_tests", False, str(exc) if type(exc) is _DidNotCompile else _described(exc))
        return
    selected = []
    if module_level:
        selected.append((MODULE_TEST, lambda: exec(test_code, namespace)))
    if entry and callable(namespace.get("check")) and "check" in defined_by_tests:
        selected.append(("check", lambda: namespace["check"](namespace[entry])))
    selected += [(n, f) for n, f in list(namespace.items())
                 if n.startswith("test_") and callable(f) and n in defined_by_tests]
    if not selected:
        report.outcome("load_tests", False,
                       "the tests define neither check(candidate) with an entry point nor test_* functions")
        return
    report.declared([name for name, _ in selected])

    try:
        ready = child.ready()
        problem = _not_ready(ready)
    except CandidateGone as exc:
        problem = f"the program did not start: {exc}"
    if problem:
        for name, _ in selected:
            report.outcome(name, False, problem)
        return

    # The tests see the entry point and the candidate's functions they name that nothing else
    # defines: never a builtin (a candidate's own `abs` must not judge its answers) nor a name
    # the tests or the trusted prelude define, stubs aside.
    functions = ready.get("functions") if type(ready.get("functions")) is list else []
    own = ready.get("own") if type(ready.get("own")) is list else functions
    proxied = {entry} if entry else set()
    stubs: set[str] | None = None
    for name in functions:
        if type(name) is not str or name == entry or name not in used_by_tests:
            continue
        if name in _BUILTIN_NAMES:  # never proxied; named where the program wrote it, not where it imported it
            if name in own:
                report.tamper("shadows_builtins", f"defines {name}(), which the tests take from builtins")
        elif name not in defined_by_tests:
            if name in trusted:  # the prelude defines it too: the candidate's stands in only for a stub
                if stubs is None:
                    stubs = _stub_names(prelude)
                if name not in stubs:
                    continue
            proxied.add(name)
    for name in proxied:
        namespace[name] = _proxy(child, name)
    # The exception classes a raise of the candidate's may be: the prompt's, which its program shares
    # (never one only the tests define: in one process the candidate could not raise that).
    child.known = {name: value for name, value in prelude_names.items() if name not in proxied}

    for name, test in selected:
        calls, failed = child.calls, child.failed
        try:
            returned = test()
            if type(returned).__name__ in ("coroutine", "generator"):
                returned.close()  # an async or generator test: nothing of it ran
        except CallFailed as exc:
            report.outcome(name, False, str(exc))
        except BaseException as exc:
            report.outcome(name, False, _described(exc))
        else:
            if child.failed != failed:  # the test caught it (`except:`): still no evidence of a pass
                report.outcome(name, False, child.failure)
            elif child.calls == calls:  # no evidence: a test that never reached the program passes nothing
                report.outcome(name, False, "the test never called the program")
            else:
                report.outcome(name, True)


def _held_beyond_the_job(child: Candidate) -> bool:
    """Whether an object a call's write-back changed is still held once the job's tests are gone: by a
    module, or by anything else of this process that outlives the job. A test that passes the candidate
    a module's own list (`keyword.kwlist`) lets the candidate change it; in one process the change would
    end with the job's process, but this harness runs later jobs' tests, which would meet it (another
    task's wrong program was paid, its honest one failed). Such a job retires the harness. The tests'
    own objects are gone with their namespace (_run_tests), cycles collected before the second look."""
    changed = list(child.changed.values())
    child.changed.clear()
    child.known = {}  # (the prelude's objects, held for the job's exception classes)
    if not changed:
        return False
    # A fresh object held only as each changed one is held here (by the list and the loop): its count is
    # what "held by nothing else" reads.
    changed.append([])
    for attempt in range(2):
        counts = [sys.getrefcount(value) for value in changed]
        floor = counts.pop()
        if all(count <= floor for count in counts):
            return False
        if attempt == 0:
            gc.collect()  # a cycle through a changed object (an exception kept with its frames) goes first
    return True


def _described(exc: BaseException) -> str:
    """`Class: message` for an outcome; the class alone where the message cannot be made (a raise of
    the candidate's carrying an int too long to print made the report's own line raise: the job's
    remaining tests went unreported)."""
    try:
        return f"{type(exc).__name__}: {exc}"
    except Exception:
        return f"{type(exc).__name__} (its message cannot be shown)"


def _not_ready(ready: dict) -> str:
    if ready.get("ready") is not True:
        return "the program did not start"
    if "exit" in ready:
        return f"the program exited (code {ready['exit']}) before the tests ran"
    if "error" in ready:
        return f"the program failed while loading: {str(ready['error'])[:500]}"
    return ""


def _proxy(child: Candidate, name: str):
    def call(*args, **kwargs):
        return child.call(name, args, kwargs)

    call.__name__ = call.__qualname__ = name
    return call


def _stub_names(prelude: str) -> set[str]:
    """Functions the prompt only declares (docstring, pass, ...): the candidate's versions are the ones under test.

    `ast` is imported here, in the harness (once in its life), not by the worker: every module the
    worker holds is copied into every jail's page tables at its fork and torn down at its exit (see
    pool.PRELOAD), and no jail uses this one."""
    import ast

    stubs = set()
    for node in ast.parse(prelude, PRELUDE_FILE).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and all(
                isinstance(stmt, ast.Pass) or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))
                or isinstance(stmt, ast.Raise) for stmt in node.body):
            stubs.add(node.name)
    return stubs


_MUTABLE = plain.SHARED_TYPES
_BUILTIN_NAMES = frozenset(dir(builtins))


def _names(code) -> set[str]:
    """Every global or attribute name a code object and the code nested in it refer to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names(const)
    return names


def _holds_mutable(value) -> bool:
    """Whether a call can change the value in place: a mutable container, or a tuple holding one."""
    return type(value) in _MUTABLE or (type(value) is tuple and any(map(_holds_mutable, value)))


def _write_back(originals: tuple, updated: tuple, changed: dict[int, object]) -> None:
    """Copies the candidate's view of each argument into the test's objects, in place; each object it
    changes is noted in `changed` (run() looks for them once the tests are gone: _held_beyond_the_job)."""
    if len(originals) != len(updated):
        raise ValueError("argument count changed")
    for old, new in zip(originals, updated):
        if _holds_mutable(old):
            _update(old, new, changed)


def _update(old, new, changed: dict[int, object]) -> None:
    """Makes `old` (the test's object) what `new` (the candidate's view of it) is, in place and at every
    depth: a container the test may hold inside it is updated where the candidate left it in the same
    place (a test that kept `row = grid[0]` sees the change to `grid[0]`). Every container changed is
    noted in `changed`."""
    if type(new) is not type(old):
        raise TypeError(f"a {type(old).__name__} argument came back as a {type(new).__name__}")
    if type(old) is tuple:  # itself unchanged: only the containers in it can have changed
        if len(new) != len(old):
            raise ValueError("a tuple argument changed its length")
        for was, now in zip(old, new):
            if _holds_mutable(was):  # (the rest no call can change, and rebuilt it may not compare equal:
                _update(was, now, changed)  # NaN, a dict view, an iterator)
    elif type(old) is list and len(old) == len(new):
        for i, (was, now) in enumerate(zip(old, new)):
            if _holds_mutable(was) and type(now) is type(was) and (type(was) is not tuple or len(was) == len(now)):
                _update(was, now, changed)
            elif type(now) is not type(was) or _differs(was, now):
                old[i] = now
                changed[id(old)] = old
    elif type(old) is dict:
        for key in [key for key in old if key not in new]:
            del old[key]
            changed[id(old)] = old
        for key, now in new.items():
            was = old.get(key, _MISSING)
            if _holds_mutable(was) and type(now) is type(was) and (type(was) is not tuple or len(was) == len(now)):
                _update(was, now, changed)
            elif was is _MISSING or type(now) is not type(was) or _differs(was, now):
                old[key] = now
                changed[id(old)] = old
    elif type(old) is set or type(old) is collections.deque:  # (a deque's maxlen is its own: no call changes it)
        if _differs(old, new):
            old.clear()
            (old.extend if type(old) is collections.deque else old.update)(new)
            changed[id(old)] = old
    elif _differs(old, new):  # a list of another length, a bytearray
        old[:] = new
        changed[id(old)] = old


_MISSING = object()
_STDLIB_MODULES = frozenset(sys.stdlib_module_names) - {"builtins"}


def _differs(was, now) -> bool:
    """Whether a value the candidate handed back is not the one the test holds; a comparison that raises
    (a signalling NaN) counts as a change."""
    try:
        return bool(was != now)
    except Exception:
        return True


def _exception(builtin: str, args: tuple, message: str, own: str, known: dict, module: str = "") -> BaseException:
    """The exception the candidate raised, rebuilt here from its arguments (else its message): the class
    of its name that the prompt or the tests define (`except NegativeError:` catches the prompt's
    NegativeError), or the standard library's of its module and name where this process has that module
    loaded (the tests imported it: `except decimal.InvalidOperation:`), else the nearest builtin class it
    derives from (ValueError for a JSONDecodeError), or the first of that class's bases that can be made;
    CandidateError otherwise."""
    theirs = known.get(own)
    if not (isinstance(theirs, type) and issubclass(theirs, Exception)) and module.split(".")[0] in _STDLIB_MODULES:
        theirs = getattr(sys.modules.get(module), own, None)  # never an import: only what is loaded
        if isinstance(theirs, type) and issubclass(theirs, _NEVER_REPLAYED):
            theirs = None  # a builtin class is replayed as _REPLAYED says, whatever module is named
    if isinstance(theirs, type) and issubclass(theirs, Exception):
        for given in (args, (message,)):
            try:
                return theirs(*given)
            except Exception:
                pass
    if builtin in _REPLAYED:
        for klass in getattr(builtins, builtin).__mro__:
            if klass is Exception:
                break
            for given in (args, (message,)):
                try:
                    return klass(*given)
                except Exception:
                    continue
    named = getattr(builtins, builtin, None)
    if isinstance(named, type) and issubclass(named, BaseException) and not issubclass(named, Exception):
        return CandidateBaseException(f"{own}: {message}")  # not what `except Exception:` takes
    return CandidateError(f"{own}: {message}")
