"""Reading what a job's processes left into its result: the harness's report, and the limit hit.

Nothing read here is trusted further than it can be: report lines come from the
harness's descriptor (which only it holds) and are capped and type-checked; the
stderr patterns a program could fake can only make its own result look worse.
"""
from __future__ import annotations

import json
import signal

from crucible.services.sandbox_executor.jail.cgroups import Cgroups
from crucible.shared import test_report

DONE_PREFIX = b'{"done": '  # the start of the harness's last report line (harness.Report.done)
# What the supervisor reads of a tested job's report: more than the harness writes for any job (its lines
# are bounded: at most MAX_REPORT_LINES, a failure message at most harness.MESSAGE_BYTES), never the job's
# output cap, which a test suite of long failure messages would fill, cutting off the passes after them.
MAX_REPORT_LINES = 2000
REPORT_BYTES = 8 << 20


def harness_done(report: bytes) -> dict | None:
    """The harness's last line, once it is whole: {"exit_code", "cpu_user_s", "cpu_system_s", "max_rss_bytes",
    "retire"} (retire: the harness takes no more jobs)."""
    for line in report.splitlines()[::-1]:
        if line.startswith(DONE_PREFIX):
            try:
                done = json.loads(line)
                return {"exit_code": int(done["exit_code"]), "cpu_user_s": float(done["cpu_user_s"]),
                        "cpu_system_s": float(done["cpu_system_s"]), "max_rss_bytes": int(done["max_rss_bytes"]),
                        "retire": done.get("retire") is True}
            except (ValueError, KeyError, TypeError):
                return None
    return None


def parse_report(data: bytes) -> dict:
    """What the harness wrote to the report pipe: per-test outcomes, tamper signals and whether the
    candidate's process left before the tests were done ("gone": "before_tests" or "during_tests");
    malformed lines are dropped."""
    tests, tamper, gone, declared = [], [], "", []
    for line in data.splitlines()[:MAX_REPORT_LINES]:
        try:
            item = json.loads(line)
            if "declared" in item:
                declared = [str(n)[:200] for n in item["declared"]][:test_report.MAX_TESTS]
            elif "tamper" in item:
                tamper.append({"pattern": str(item["tamper"])[:64], "detail": str(item.get("detail", ""))[:500]})
            elif "gone" in item:
                gone = "before_tests" if item["gone"] == "before_tests" else "during_tests"
            else:
                tests.append({"name": str(item["name"])[:200], "passed": item["passed"] is True,
                              "message": str(item.get("message", ""))[:1000]})
        except (ValueError, KeyError, TypeError):
            continue
    return {"tests": tests[:test_report.MAX_TESTS], "tamper": tamper[:100], "gone": gone, "declared": declared}


PROCESS_LIMIT_SIGNS = (b"[Errno 11] Resource temporarily unavailable", b"can't start new thread")


def classify(sig: int, exit_code: int, stderr: bytes, cgroups: Cgroups, limits: dict,
             cpu_s: float, memory_events_before: int = 0, pids_events_before: int = 0) -> tuple[str, str]:
    """(violation, detail): the limit a finished program ran into, from its signal, the cgroup's
    counters and its last error; ("", "") when none.

    A program can only make itself look worse by faking the stderr patterns, so
    reading them is safe; the signals and counters cannot be faked from inside.
    """
    tail = stderr.rstrip()[-300:]
    if sig == signal.SIGSYS:
        return "forbidden_syscall", "a forbidden system call was made (seccomp)"
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= limits["cpu_s"] - 0.05):
        return "cpu", f"CPU limit of {limits['cpu_s']}s reached"
    if cgroups.memory_events() > memory_events_before or (exit_code != 0 and tail.endswith(b"MemoryError")):
        return "memory", f"memory limit of {limits['memory_bytes']} bytes reached"
    if cgroups.pids_events() > pids_events_before:
        # Counted by the kernel in any process or thread of the job, whatever its output looks like.
        return "processes", f"process limit of {limits['processes']} reached"
    if sig == signal.SIGXFSZ or (exit_code != 0 and b"[Errno 27] File too large" in tail):
        return "file_size", f"file size limit of {limits['file_bytes']} bytes reached"
    if exit_code != 0 and b"[Errno 28] No space left on device" in tail:
        return "file_size", f"work directory limit of {limits['work_bytes']} bytes reached"
    # A refused fork or thread start, wherever it shows in the output: many processes failing at
    # once interleave their tracebacks, so the last lines need not be the telling ones.
    if exit_code != 0 and any(sign in stderr for sign in PROCESS_LIMIT_SIGNS):
        return "processes", f"process limit of {limits['processes']} reached"
    return "", ""
