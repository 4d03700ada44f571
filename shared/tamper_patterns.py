"""The names a tamper signal may carry, in one place: the sandbox's harness and candidate watch, the
source and output scans, and the verdict all draw from this set. A name from anywhere else (a
candidate writing its own "signals", a forged result) is never passed on as it came: it becomes
`forged_reply` (inside the sandbox) or `unknown_signal` (in a verdict), with the name in the detail.

Stdlib only: the sandbox worker imports it.
"""
from __future__ import annotations

PATTERNS = frozenset({
    "exit_before_tests",    # the program ended its process with code 0 before the tests ran
    "exit_during_tests",    # ... or while a test was calling it
    "forged_reply",         # the call channel carried something the candidate's side never sends
    "non_plain_return",     # a function returned an object that steers comparisons (or raised when read)
    "shadows_builtins",     # defines a function the tests take from builtins
    "reads_test_file",      # looks for the tests on disk
    "introspection",        # walks frames or the interpreter's objects, reads /proc
    "patched_builtins",     # changes builtins
    "patched_stdlib",       # changes the standard library's classes or modules
    "assert_machinery",     # changes assertion or test-result machinery
    "writes_report_fd",     # writes to a descriptor it was not given
    "kills_harness",        # signals the harness, its process group or everything
    "native_code",          # reaches memory through ctypes
    "code_patching",        # replaces a function's code
    "always_equal",         # defines an __eq__ that is always true
    "fake_result_output",   # prints lines that look like a test runner's verdict
    "forbidden_syscall",    # a process of the job made a system call the sandbox forbids
    "unknown_signal",       # a result named a signal that is none of these
})


def known(pattern: str, detail: str) -> tuple[str, str]:
    """(pattern, detail) as a verdict may carry them: an unknown name becomes `unknown_signal`."""
    if pattern in PATTERNS:
        return pattern, detail
    return "unknown_signal", f"{pattern[:40]!r}: {detail}"[:500]
