"""The candidate's side of a tested job: runs the program, then answers the harness's calls.

This process is the job's jail (pid 1 of its own pid namespace, forked before
any job existed); the tests never come here (the slot's harness, a process in
another pid namespace, has them and the report pipe). It gets calls (function name and
plain-data arguments) on one pipe and answers with plain data on another.
Nothing it does here can make the harness record a pass: the harness compares
what comes back, rebuilt as exact builtin values, in its own process.

What this module adds is *naming* attempts, so a verdict can say what was
tried: an audit hook (which the program cannot remove) watches for frame and
gc introspection, code patching, opening test-like files or descriptors,
signalling the harness and native code; every preloaded module reports
attribute writes, and a snapshot of builtins shows what the program replaced
through the builtins dict. These signals run inside the
candidate's process, so a determined program can blind them, but never turn
them into a pass.

Stdlib only: loaded into the sandbox worker, which has no site-packages.
"""
from __future__ import annotations

import _thread
import builtins
import itertools
import operator
import os
import re
import resource
import sys
import types

from crucible.services.sandbox_executor import plain
from crucible.shared import framing

MODULE_NAME = "solution"  # not __main__: a completion's `if __name__ == "__main__":` self-test stays off
MAX_FRAME = 8 << 20  # the call channel's limit on a message, either way (the harness reads with it too)

_ASSERT_WORDS = ("assert", "fail", "TestCase", "unittest", "AssertionError")
# File names are read as words (`latest.json` holds no "test", `checkpoint.pkl` no "check"). A program
# reading a file named as tests or their results that is not there looks for them (the tests never come
# to this process: what it wrote itself, or a file the task gave it, it may read by any name; and what it
# writes, under any name, no test reads: a temporary file's `test_` prefix is its own business).
_WORDS = re.compile(r"[^a-z0-9]+").split
_TEST_NAMES = ("test", "harness")  # a word starting with one
_RESULT_NAMES = frozenset({"check", "checks", "checker", "report", "result", "results", "expected", "answer",
                           "answers"})
_INTROSPECTION_EVENTS = frozenset({"sys._getframe", "sys._current_frames", "sys._current_exceptions",
                                   "sys.settrace", "sys.setprofile", "sys.addaudithook"})
_GC_EVENTS = frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents"})
# (A function's __code__ is no frame: reading it, as a decorator reads an arity, shows the program its own
# code; replacing it is code_patching.)
_FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back"})
_NATIVE_EVENTS = frozenset({"ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "ctypes.addressof",
                            "ctypes.string_at", "ctypes.wstring_at", "ctypes.PyObj_FromPtr", "ctypes.call_function",
                            "ctypes.cdata/buffer", "ctypes.create_string_buffer"})
_NATIVE_MODULES = ("ctypes", "_ctypes")
_LOADED_NATIVE = ("ctypes", "ctypes._endian", "_ctypes")  # what the worker's own `import ctypes` loaded
# Files whose ctypes events act for their caller (Watch._caller): the import system's, and ctypes' own
# (it imports _ctypes for whoever imported it, and its Python functions call into C for their callers).
_CTYPES_ON_BEHALF = ("<frozen importlib.", "/importlib/", "/ctypes/")
_CTYPES_USERS = ("/multiprocessing/",)  # the standard library's packages that use ctypes for a program
_WATCHED = (_INTROSPECTION_EVENTS | _GC_EVENTS | _NATIVE_EVENTS
            | {"open", "object.__getattr__", "object.__setattr__",
               "object.__delattr__", "os.kill", "os.killpg", "signal.pthread_kill", "import"})


class Watch:
    """Tamper signals of this process: audit events as they happen, state diffs on demand."""

    def __init__(self, program_file: str, given_fds: frozenset[int] = frozenset()):
        self.program_file = program_file
        self.given_fds = given_fds  # descriptors beyond stdio the process started with (the call channel)
        self.work_dir = program_file.rpartition("/")[0] or "/work"
        self.flags: list[tuple[str, str]] = []
        self._seen: set[tuple[str, str]] = set()
        self._builtins = BUILTINS_SNAPSHOT or dict(builtins.__dict__)
        self._key_values = tuple(self._builtins.get(k, _MISSING) for k in _KEY_BUILTINS)
        self._busy = False
        self._getframe = sys._getframe
        self._this_file = _THIS_FILE

    def flag(self, pattern: str, detail: str) -> None:
        key = (pattern, detail[:200])
        if key not in self._seen:
            self._seen.add(key)
            self.flags.append(key)

    def drain(self) -> list[tuple[str, str]]:
        flags, self.flags = self.flags, []
        return flags

    def install(self) -> None:
        global _ACTIVE
        sys.addaudithook(self._hook)
        _ACTIVE = self

    def module_patched(self, module, name: str, action: str) -> None:
        """A watched module's attribute was set or deleted (see _WatchedModule)."""
        if self._busy or (module is builtins and name == "_"):  # `_`: sys.displayhook's last value
            return
        self._busy = True
        try:
            if self._from_program():
                where = f"{module.__name__}.{name}"
                pattern = "patched_builtins" if module is builtins else "patched_stdlib"
                self.flag(pattern, f"{action} {where}")
                if _any(word in where for word in _ASSERT_WORDS):
                    self.flag("assert_machinery", f"{action} {where}")
        except Exception:
            pass
        finally:
            self._busy = False

    def _from_program(self) -> bool:
        """Whether the code that raised the event is the program's (not the standard library's)."""
        filename = self._caller()
        return filename == self.program_file or (filename.startswith("<") and not filename.startswith("<frozen"))

    def _ctypes_for_program(self) -> bool:
        """Whether a ctypes event (or import) is for anyone but the standard library's own user of ctypes
        (multiprocessing.Value keeps its number in ctypes memory): the program's, or a trampoline's."""
        return not _any(mark in self._caller(_CTYPES_ON_BEHALF) for mark in _CTYPES_USERS)

    def _caller(self, acting_for: tuple[str, ...] = ()) -> str:
        """The file of the code that raised the event ("<none>" where no frame is left). `acting_for`:
        marks of the files of machinery that raises events on its caller's behalf (the import system,
        ctypes' own Python): the caller it acts for is named, not the machinery."""
        frame = self._getframe(2)
        while frame is not None and (frame.f_code.co_filename == self._this_file
                                     or _any(mark in frame.f_code.co_filename for mark in acting_for)):
            frame = frame.f_back  # out of the hook's own frames (and the machinery's), to whoever asked
        return "<none>" if frame is None else frame.f_code.co_filename

    def _hook(self, event: str, args: tuple) -> None:
        if event not in _WATCHED or self._busy:
            return
        self._busy = True  # sys._getframe below raises an event of its own
        try:
            self._classify(event, args)
        except Exception:
            pass  # a malformed event must not break the program's own behaviour
        finally:
            self._busy = False

    def _classify(self, event: str, args: tuple) -> None:
        if event == "open":
            self._opened(args[0], args[2] if _len(args) > 2 and _isinstance(args[2], _int) else 0)
        elif event in _GC_EVENTS:
            self.flag("introspection", f"{event}() walks the interpreter's objects")
        elif event in _INTROSPECTION_EVENTS:
            if self._from_program():
                self.flag("introspection", f"{event}()")
        elif event == "object.__getattr__":
            if args[1] in _FRAME_ATTRS and self._from_program():
                self.flag("introspection", f"reads .{args[1]} of a {_type(args[0]).__name__}")
        elif event in ("object.__setattr__", "object.__delattr__"):
            self._patched(args[0], args[1])
        elif event in ("os.kill", "os.killpg", "signal.pthread_kill"):
            target = args[0]
            if target in (0, -1, 1, os.getppid()) and target != os.getpid():  # not itself (pid 1 here)
                self.flag("kills_harness", f"{event}({target}, {args[1]})")
        elif event in _NATIVE_EVENTS:
            if self._ctypes_for_program():
                self.flag("native_code", f"{event}: ctypes reaches memory the interpreter protects")
        elif event == "import":
            if _str(args[0]).split(".")[0] in _NATIVE_MODULES and self._ctypes_for_program():
                self.flag("native_code", f"imports {args[0]}: ctypes reaches memory the interpreter protects")

    def _opened(self, path, flags: int) -> None:
        if _isinstance(path, _int):
            # A descriptor it made itself (mkstemp, a pipe, os.open) is its own; one it was given (the
            # call channel) or does not hold (a guess: the report descriptor is the harness's, never here)
            # is not.
            if path >= 3 and (path in self.given_fds or not _holds(path)):
                self.flag("writes_report_fd", f"opens file descriptor {path} (the harness reports on its own)")
            return
        text = os.fsdecode(path) if _isinstance(path, _TEXT) else _str(path)
        resolved = os.path.normpath(os.path.join(self.work_dir, text))
        if resolved.startswith(("/dev/fd/", "/proc/self/fd/")):
            self.flag("writes_report_fd", f"opens {resolved}")
        elif resolved.startswith("/proc/"):
            self.flag("introspection", f"opens {resolved}")
        elif resolved != self.program_file and resolved.startswith((self.work_dir + "/", "/tmp/")):
            words = [w for w in _WORDS(os.path.basename(resolved).lower()) if w]
            reads = flags & os.O_ACCMODE == os.O_RDONLY and not flags & os.O_CREAT
            if reads and _any(w.startswith(_TEST_NAMES) or w in _RESULT_NAMES for w in words) \
                    and not os.path.exists(resolved):
                self.flag("reads_test_file", f"opens {resolved}, looking for tests it was never given")

    def _patched(self, obj, name) -> None:
        if name == "__code__":
            if self._from_program():  # the standard library does it too (types.coroutine, for asyncio)
                self.flag("code_patching", f"replaces the code of {_getattr(obj, '__qualname__', '?')}")
            return
        if not _isinstance(obj, _type) or not self._from_program():
            return
        module = _getattr(obj, "__module__", "") or ""
        if module == MODULE_NAME:
            return  # the program's own classes are its business
        where = f"{module}.{_getattr(obj, '__qualname__', '?')}.{name}"
        self.flag("patched_stdlib", f"sets {where}")
        if _any(word in where for word in _ASSERT_WORDS):
            self.flag("assert_machinery", f"sets {where}")

    def check_state(self) -> None:
        """Names builtins the program replaced through the dict (`__builtins__[...] = ...`, which no
        attribute hook sees).

        Attribute patches of watched modules are caught as they happen (_WatchedModule); a full
        diff of every module here would copy-on-write-fault thousands of objects (milliseconds a
        job). Swaps in sys.modules are left to the verifier's reading of the source.
        """
        current = builtins.__dict__
        try:
            same_size = _len(current) == _len(self._builtins)
            if same_size and _all(_map(_is, _map(current.get, _KEY_BUILTINS, _MISSINGS), self._key_values)):
                return  # the check after every call: the same names, the key ones the same objects (in C, ~1 us)
            keys = _KEY_BUILTINS if same_size else _set(self._builtins) | _set(current)
            # (`_` is the interpreter's: sys.displayhook keeps the last value shown there, as doctest runs)
            changed = _sorted(k if _type(k) is _str else "(a key that is not a name)" for k in keys
                              if k != "_" and current.get(k, _MISSING) is not self._builtins.get(k, _MISSING))
        except Exception:  # a key of the program's whose hash or comparison raises: changed all the same
            changed = ["(keys that cannot be compared)"]
        if changed:
            self.flag("patched_builtins", "replaces builtins." + ", builtins.".join(changed[:8]))
            if _any(word in k for k in changed for word in _ASSERT_WORDS):
                self.flag("assert_machinery", "replaces builtins." + ", builtins.".join(
                    k for k in changed if _any(word in k for word in _ASSERT_WORDS)))


_MISSING = object()
_THIS_FILE = __file__
# What a check leans on; looked at one by one (cheap) unless names were added or removed.
_KEY_BUILTINS = ("AssertionError", "Exception", "BaseException", "SystemExit", "isinstance", "issubclass",
                 "type", "len", "print", "repr", "str", "int", "float", "bool", "list", "tuple", "dict", "set",
                 "abs", "round", "sorted", "sum", "min", "max", "all", "any", "open", "exit", "quit", "hash",
                 "id", "getattr", "setattr", "__import__", "__build_class__", "object", "range", "zip", "map")
_MISSINGS = itertools.repeat(_MISSING)
# Bound once at import, in the worker: what the Watch uses stays the real thing when the program replaces
# names in builtins through the dict (the very writes check_state looks for, and which a program could
# make only while it does something watched, putting the real one back before the next check).
_len, _all, _any, _map, _set, _sorted, _is = len, all, any, map, set, sorted, operator.is_
_isinstance, _getattr, _str, _type, _int, _TEXT = isinstance, getattr, str, type, int, (str, bytes)
_fstat = os.fstat


def _holds(fd: int) -> bool:
    """Whether this process has descriptor `fd` open."""
    try:
        _fstat(fd)
    except (OSError, OverflowError, ValueError):
        return False
    return True


_ACTIVE: Watch | None = None  # the Watch of this process, once a candidate runs in it
BUILTINS_SNAPSHOT: dict = {}


class _WatchedModule(types.ModuleType):
    """A module whose attribute writes are reported to the active Watch (none in the worker or harness)."""

    def __setattr__(self, name, value):
        if _ACTIVE is not None:
            _ACTIVE.module_patched(self, name, "sets")
        types.ModuleType.__setattr__(self, name, value)

    def __delattr__(self, name):
        if _ACTIVE is not None:
            _ACTIVE.module_patched(self, name, "deletes")
        types.ModuleType.__delattr__(self, name)


def prepare() -> None:
    """Called once by the worker after preloading, before any job is forked.

    Records builtins and makes every public module loaded so far report
    attribute writes. Done here, not in the candidate's process, where copying
    or touching thousands of objects would copy-on-write-fault every page of
    them (milliseconds a job). Nothing more is imported for it: every module in
    the worker makes every fork dearer (`unittest` alone pulls in a dozen), and
    a patched `unittest.TestCase` is caught by the audit hook all the same.
    """
    global BUILTINS_SNAPSHOT
    for name, module in list(sys.modules.items()):
        if (type(module) is types.ModuleType and name not in ("sys", "__main__")
                and not name.startswith("_") and not name.startswith("crucible")
                and ("." not in name or name.split(".")[0] == "json")):
            try:
                module.__class__ = _WatchedModule
            except TypeError:
                pass
    BUILTINS_SNAPSHOT = dict(builtins.__dict__)
    global JOB_STDIO
    JOB_STDIO = job_stdio()


JOB_STDIO: tuple = ()  # a job's sys.stdin, sys.stdout and sys.stderr, made once (prepare)


def job_stdio() -> tuple:
    """Text streams on descriptors 0, 1 and 2 as a job's process has them (its pipes), made in the worker,
    before any job: descriptors are numbers, so every job's fork writes to and reads from its own. Made
    in each job's process instead, three text-mode `open`s would copy some seventy pages of the worker's io
    machinery each time. Nothing reads or writes them in the worker (its own stdio is the pool's)."""
    return (open(0, "r", encoding="utf-8", errors="replace", closefd=False),
            open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1),
            open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1))


def use_job_stdio() -> None:
    """In a job's process, before its program runs: its sys.stdin, sys.stdout and sys.stderr."""
    sys.stdin, sys.stdout, sys.stderr = JOB_STDIO or job_stdio()


THREAD_STACK_BYTES = 512 << 10


def leave_host() -> None:
    """What a job could read of the host without doing anything forbidden goes, in the zygote (once,
    before any jail is forked: every job inherits it as it is; done in each job's process, the
    module pops alone copied some 150 us of pages a job). The interpreter's command line becomes a
    bare `python3` (the real one held no configuration, but names the interpreter), and the worker's
    own modules leave sys.modules (the code already loaded keeps running, and nothing in a jail
    imports them again; their files carry neutral names anyway), and so does the finder that
    loaded them from the host's folders.

    New threads get small stacks: with the default 8 MiB each, a thread bomb exhausts the address
    space limit after a dozen threads, a failure the kernel counts nowhere; with these it reaches
    the slot's pids.max, which the kernel counts, so the job is named a `processes` violation even
    when it swallows the error."""
    sys.orig_argv = ["python3"]
    for name in [name for name in sys.modules if name == "crucible" or name.startswith("crucible.")]:
        del sys.modules[name]
    # The import system's own finders only: the worker's (jail/__main__.py's JailFinder) knows the host
    # folders it loads the worker's modules from, and nothing in a jail imports them again.
    sys.meta_path[:] = [finder for finder in sys.meta_path
                        if getattr(finder, "__module__", "").startswith("_frozen_importlib")]
    _thread.stack_size(THREAD_STACK_BYTES)


# --- the call channel ---------------------------------------------------------------------------

def read_frame(requests: framing.Reader) -> dict | None:
    """The next message on the call channel (plain data in a frame); None once the other side closed it."""
    data = requests.frame()
    return None if data is None else plain.loads(data)


def write_frame(fd: int, obj: dict) -> None:
    data = plain.dumps(obj)
    if len(data) > MAX_FRAME:  # the harness would take a larger frame for a forgery on the channel
        data = plain.dumps({"error": "non_plain", "message": f"the value is {len(data)} bytes as data; "
                                                             f"at most {MAX_FRAME} cross", "flags": obj.get("flags", [])})
    framing.write(fd, data, MAX_FRAME)


# --- the candidate process ------------------------------------------------------------------------

def serve(job: dict, call_r: int, reply_w: int) -> None:
    """Runs the program, reports ready, answers calls until the harness is done; never returns."""
    use_job_stdio()
    program_file = "/work/" + job["main"]
    sys.argv = [program_file]
    sys.path[:0] = ["/work"]
    # The worker loaded ctypes for itself; forgetting it here makes the program's own import visible.
    # (Named, not searched for: walking sys.modules would copy-on-write-fault a page per module.)
    for name in _LOADED_NATIVE:
        sys.modules.pop(name, None)
    watch = Watch(program_file, frozenset({call_r, reply_w}))
    watch.install()
    module = types.ModuleType(MODULE_NAME)
    module.__file__ = program_file
    sys.modules[MODULE_NAME] = module
    sys.modules["__main__"] = module
    namespace = module.__dict__
    ready: dict = {"ready": True}
    try:
        exec(compile(job["files"][job["main"]], program_file, "exec"), namespace)
    except SystemExit as exc:
        ready["exit"] = _exit_code(exc.code)
        if ready["exit"] == 0:
            watch.flag("exit_before_tests", f"sys.exit({exc.code!r}) while the program was loading")
    except BaseException as exc:
        _print_traceback()
        ready["error"] = f"{_class_name(exc)}: {_message(exc)}"[:1000]
    _flush()
    watch.check_state()
    ready["functions"] = sorted(k for k, v in list(namespace.items())
                                if isinstance(k, str) and not k.startswith("__") and callable(v)
                                and not isinstance(v, type))
    # Those the program defines itself (not imported: `from operator import *` brings an abs)
    ready["own"] = [k for k in ready["functions"] if type(namespace.get(k)) is types.FunctionType
                    and getattr(namespace[k].__code__, "co_filename", "") == program_file]
    ready["flags"] = watch.drain()
    ready["usage"] = _usage()
    write_frame(reply_w, ready)
    if "exit" in ready or "error" in ready:
        os._exit(0)
    requests = framing.Reader(lambda n: os.read(call_r, n), MAX_FRAME)
    while True:
        request = read_frame(requests)
        if request is None:  # the harness is done (it ends this process as it leaves)
            _flush()
            os._exit(0)
        reply = _call(namespace, request, watch)
        _flush()
        watch.check_state()  # after every call: the harness leaves without asking again
        reply["flags"] = watch.drain()
        reply["usage"] = _usage()
        write_frame(reply_w, reply)


def _call(namespace: dict, request: dict, watch: Watch) -> dict:
    name = request.get("name")
    fn = namespace.get(name) if isinstance(name, str) else None
    if fn is None or not callable(fn):
        return {"raise": "NameError", "message": f"the program does not define {name!r}"}
    try:
        args = plain.from_tree(request["args"])
        kwargs = plain.from_tree(request["kwargs"])
    except (KeyError, ValueError) as exc:
        return {"raise": "TypeError", "message": f"arguments did not arrive: {exc}"}
    try:
        result = fn(*args, **kwargs)
    except SystemExit as exc:
        code = _exit_code(exc.code)
        if code == 0:
            watch.flag("exit_during_tests", f"{name}() raised SystemExit({exc.code!r})")
        return {"raise": "SystemExit", "message": f"{name}() exited with code {code}"}
    except BaseException as exc:
        reply = _raised(exc)
        if request.get("mutable"):  # what a call that raised left in its arguments comes back too
            left: list = []
            reply = _arguments(reply, name, args, kwargs, left, watch)
            for pattern, detail in left:
                watch.flag(pattern, f"{name}() left {detail} in its arguments")
        return reply
    flags: list = []
    # What the result shares with the arguments (a row of a grid, the argument itself) crosses as a
    # reference to that place in them: the tests' own object there, as in one process.
    shared = None
    if request.get("mutable") and type(result) not in _SCALARS:
        try:
            shared = plain.places(plain.roots(args, kwargs))
        except Exception:  # whatever the program left in its arguments: the value then crosses as a copy
            pass
    try:
        tree = plain.to_tree(result, flags, places=shared)
    except plain.Raised as raised:  # a returned generator raised as its items were drawn
        # In one process the call returned and the raise came later, as the test drew: not replayed as a
        # raise of the call (a test that wants the call itself to raise would pass), never a value.
        return {"error": "non_plain", "message": f"{name}() returned an iterator that raised "
                                                 f"{_class_name(raised.exc)} as its items were drawn: it is read "
                                                 "whole when the call returns, so only one that ends can be checked"}
    except plain.NotPlain as exc:
        if exc.suspicious:
            watch.flag("non_plain_return", f"{name}() returned {exc}")
        return {"error": "non_plain", "message": f"{name}() returned {exc}, not plain data: only numbers, "
                                                 "strings, bytes and lists, tuples, dicts and sets of them are checked"}
    except RecursionError:
        return {"error": "non_plain", "message": f"{name}() returned a value nested too deeply"}
    except BaseException as exc:  # a value whose very type misbehaves when looked at
        watch.flag("non_plain_return", f"{name}() returned a value that raised {type(exc).__name__} when read")
        return {"error": "non_plain", "message": f"{name}() returned a value that could not be read"}
    reply = {"ok": tree}
    if request.get("mutable"):
        reply = _arguments(reply, name, args, kwargs, flags, watch)
    for pattern, detail in flags:
        watch.flag(pattern, f"{name}() returned {detail}")
    return reply


def _arguments(reply: dict, name: str, args: tuple, kwargs: dict, flags: list, watch: Watch) -> dict:
    """The reply with what the call left in its arguments (the harness writes it into the test's
    objects), or a non_plain error where that is not plain data."""
    try:
        reply["args"] = plain.to_tree((list(args), kwargs), flags)
    except plain.NotPlain as exc:
        if exc.suspicious:
            watch.flag("non_plain_return", f"{name}() left {exc} in its arguments")
        return {"error": "non_plain", "message": f"{name}() left {exc} in its arguments, not plain data"}
    except BaseException:
        watch.flag("non_plain_return", f"{name}() left unreadable values in its arguments")
        return {"error": "non_plain", "message": f"{name}() left unreadable values in its arguments"}
    return reply


def _usage() -> list:
    """CPU seconds (user, system) and peak memory of this process, for the job's result."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return [own.ru_utime, own.ru_stime, own.ru_maxrss * 1024]


def _exit_code(code) -> int:
    if code is None or code is False:
        return 0
    if type(code) is int or code is True:
        return int(code)
    return 1


def _raised(exc: BaseException) -> dict:
    """A call's raise, as the harness rebuilds it: the nearest builtin class the exception's derives from
    (ValueError for a json.JSONDecodeError), the class's own name (the prompt's class of that name is
    raised where it defines one) and its message."""
    reply = {"raise": _builtin_class(exc).__name__, "class": _class_name(exc), "message": _message(exc),
             "module": _module_name(exc)}
    try:  # its arguments too, where they are plain and small (UnicodeDecodeError is made from five)
        reply["exception_args"] = plain.to_tree(tuple(BaseException.__dict__["args"].__get__(exc)), None, 0,
                                                [EXCEPTION_ARGS])
    except Exception:
        pass
    return reply


EXCEPTION_ARGS = 1000  # values of an exception's arguments that cross with it, at most
_SCALARS = frozenset({int, float, bool, str, bytes, complex, type(None)})  # results that hold no container


def _builtin_class(exc: BaseException) -> type:
    for klass in type.__dict__["__mro__"].__get__(type(exc)):  # the real order, whatever a metaclass says
        if getattr(builtins, klass.__name__, None) is klass:
            return klass
    return BaseException


def _class_name(exc: BaseException) -> str:
    return str(type.__dict__["__name__"].__get__(type(exc)))[:200]


def _module_name(exc: BaseException) -> str:
    """The module its class is from, where the class is that module's own (the harness takes it only for a
    class of the standard library's that the tests have loaded: decimal.InvalidOperation); "" for a class
    that only names a module (a program's own `JSONDecodeError` with `__module__ = "json"`: in one process
    the tests' `except json.JSONDecodeError` would not catch it)."""
    try:
        klass = type(exc)
        module = type.__dict__["__module__"].__get__(klass)
        name = type.__dict__["__name__"].__get__(klass)
        if type(module) is str and type(name) is str and getattr(sys.modules.get(module), name, None) is klass:
            return module[:200]
    except BaseException:
        pass
    return ""


def _message(exc: BaseException) -> str:
    """The message, read by the nearest builtin class's own __str__ (SyntaxError's names the line), so no
    __str__ of the program's runs."""
    try:
        return str(_builtin_class(exc).__str__(exc))[:1000]
    except BaseException:
        return ""


def _print_traceback() -> None:
    try:
        import traceback

        traceback.print_exc()
    except BaseException:
        pass


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
