"""One job's supervisor: prepares a jail ahead of time, takes the job, runs it, sends the result.

Forked by the worker while the previous job runs. It forks the jail into fresh
namespaces and its cgroup slot and waits until the jail has its root and its
candidate process; then it waits for the next job on the worker's stdin (the
pool's pipe). It reads the job itself, so job code and tests never enter the
long-lived worker's memory, where a later job could dig them out. It enforces
the wall clock and the output cap, and writes exactly one result frame to the
worker's stdout.
"""
from __future__ import annotations

import base64
import json
import os
import select
import signal
import socket
import time

from crucible.services.sandbox_executor.jail import jailed, outcome, seccomp
from crucible.services.sandbox_executor.jail.cgroups import Cgroups
from crucible.services.sandbox_executor.jail.linux import (CLONE_NEWIPC, CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWUTS,
                                                           unshare)
from crucible.shared import framing

# Exit codes the worker reads (worker.serve).
SHUT_DOWN = 3    # the pool closed the worker's stdin while this supervisor waited for a job
RESULT_LOST = 2  # the result (or the error frame in its place) could not be written


def supervise(cfg: dict, cgroups: Cgroups, notify_w: int) -> None:
    """The supervisor process; tells the worker on `notify_w` when it took its job and when it sent
    the result. Never returns."""
    job_id = None
    try:
        prepared = prepare_jail(cfg, cgroups)
        header = framing.read(0)
        if header is None:
            os._exit(SHUT_DOWN)
        header = json.loads(header)
        job_id = header["job_id"]
        body = framing.read(0)
        if body is None:
            raise EOFError("the pool closed the pipe between a job's header and its body")
        # The job is off the shared pipe: the worker may start preparing the next supervisor now.
        os.write(notify_w, (json.dumps({"job_id": job_id, "wall_s": header["limits"]["wall_s"]}) + "\n").encode())
        result, teardown = run_job(prepared, {**header, **json.loads(body)}, cgroups)
        _send({"job_id": job_id, **result})
        os.write(notify_w, b"sent\n")  # from now on the worker must not answer for this job
    except BaseException as exc:
        code = 1
        try:
            _send({"job_id": job_id, "error": f"{type(exc).__name__}: {exc}"})
        except BaseException:
            code = RESULT_LOST
        os._exit(code)
    # After the result, so the next job need not wait for this one's processes to vanish. Nothing
    # may be written to the pool from here on: it has this job's frame and waits for the next.
    try:
        teardown()
        code = 0
    except BaseException:
        code = 4
    os._exit(code)


def _send(result: dict) -> None:
    framing.write(1, json.dumps(result).encode())


def prepare_jail(cfg: dict, cgroups: Cgroups) -> dict:
    """Forks the jail into fresh namespaces and this slot's cgroups; it enters its root, forks its
    candidate process and waits for a job."""
    job_r, job_w = os.pipe()
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    report_r, report_w = os.pipe()
    ready_r, ready_w = os.pipe()
    attached_r, attached_w = os.pipe()
    calls, calls_w = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # seccomp listeners come in here
    if cfg["isolate"]:
        # The mount namespace is the jail's own (it unshares it itself): pivot_root moves every
        # process of a namespace, and the supervisor must keep seeing the host's cgroups.
        unshare(CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)
    pid = os.fork()
    if pid == 0:
        for fd in (job_w, in_w, out_r, err_r, report_r, ready_r, attached_w):
            os.close(fd)
        calls.close()
        jailed.run(cfg, job_r, in_r, out_w, err_w, report_w, ready_w, attached_r, calls_w.detach())
    for fd in (job_r, in_r, out_w, err_w, report_w, ready_w, attached_r):
        os.close(fd)
    calls_w.close()
    cgroups.attach(pid)
    os.write(attached_w, b"a")
    os.close(attached_w)
    if os.read(ready_r, 1) != b"r":
        raise RuntimeError("the jail failed while preparing its root")
    os.close(ready_r)
    # Holding the jail's mount namespace keeps its teardown (an RCU-synchronised unmount of
    # the whole tree) out of the job's latency: it happens when this supervisor exits.
    mnt_ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY) if cfg["isolate"] else -1
    return {"pid": pid, "job_w": job_w, "in_w": in_w, "out_r": out_r, "err_r": err_r, "report_r": report_r,
            "mnt_ns": mnt_ns, "calls": ForbiddenCalls(calls)}


def run_job(prepared: dict, job: dict, cgroups: Cgroups) -> tuple[dict, object]:
    """Runs one job in the prepared jail: (the result, what is left to do once it has been sent).

    A tested job is over when its harness reports `done` (it has killed the candidate by then):
    the result goes out without waiting for the two processes' memory to be torn down, which is
    most of a small job's time; the teardown (wait, empty the cgroup slot) follows.
    """
    limits = job["limits"]
    pid = prepared["pid"]
    out_r, err_r, report_r, in_w = prepared["out_r"], prepared["err_r"], prepared["report_r"], prepared["in_w"]
    memory_events = cgroups.reset_memory_events()
    pids_events = cgroups.pids_events()
    accounting = cgroups.begin_usage()
    calls = prepared["calls"]
    started = time.monotonic()
    tested = "tests" in job
    program = {k: v for k, v in job.items() if k not in ("tests", "prelude")}
    program["has_tests"] = tested
    framing.write(prepared["job_w"], json.dumps(program).encode())
    if tested:  # read by the harness only after the candidate's process is forked
        tests = {"tests": job["tests"], "prelude": job.get("prelude") or ""}
        framing.write(prepared["job_w"], json.dumps(tests).encode())
    os.close(prepared["job_w"])

    stdin_data = base64.b64decode(job.get("stdin_b64") or "")
    cap = limits["output_bytes"]
    out = {out_r: bytearray(), err_r: bytearray(), report_r: bytearray()}
    truncated = {out_r: False, err_r: False, report_r: False}
    violation, detail = "", ""
    deadline = started + limits["wall_s"]
    open_fds = [out_r, err_r, report_r]
    write_fds = [in_w] if stdin_data else []
    if not stdin_data:
        os.close(in_w)
    for fd in open_fds + write_fds:
        os.set_blocking(fd, False)
    done = None
    while open_fds and done is None:
        left = deadline - time.monotonic()
        if left <= 0:
            violation, detail = "timeout", f"wall-clock limit of {limits['wall_s']}s reached"
            break
        readable, writable, _ = select.select(open_fds + calls.fds(), write_fds, [], left)
        if calls.read(readable):
            violation, detail = "forbidden_syscall", calls.detail()
            break
        for fd in readable:
            if fd not in out:
                continue
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                open_fds.remove(fd)
                continue
            room = cap - len(out[fd])
            out[fd] += chunk[:room]
            if fd == report_r and tested and outcome.DONE_PREFIX in out[report_r][-4096:]:
                done = outcome.harness_done(out[report_r])  # None until the line is whole
            if len(chunk) > room and fd == report_r:
                truncated[fd] = True  # a flood of fake reports: keep reading, report stays capped
            elif len(chunk) > room:
                truncated[fd] = True
                violation = "output_cap"
                detail = f"{'stdout' if fd == out_r else 'stderr'} exceeded {cap} bytes"
        if violation:
            break
        for fd in writable:
            try:
                sent = os.write(fd, stdin_data)
            except (BrokenPipeError, BlockingIOError):
                sent = len(stdin_data)
            stdin_data = stdin_data[sent:]
            if not stdin_data:
                os.close(fd)
                write_fds = []
    if not violation and calls.read_pending():  # one made just before the job finished
        violation, detail = "forbidden_syscall", calls.detail()
    if done is not None and not violation:
        drain([out_r, err_r], out, truncated, cap)  # what the killed candidate wrote last
        duration_ms = (time.monotonic() - started) * 1000
        exit_code, sig = done["exit_code"], 0
        user_s, system_s, max_rss = done["cpu_user_s"], done["cpu_system_s"], done["max_rss_bytes"]
        killed_stragglers = 0

        def teardown():
            finish_jail(pid, limits["wall_s"])
            cgroups.reap()
            calls.close()
            for fd in write_fds + [out_r, err_r, report_r]:
                os.close(fd)
    else:
        if not violation:  # its output closed, the jail may still run: the wall clock and the listeners hold
            violation, detail = wait_for_exit(pid, deadline, calls, limits)
        if violation:
            os.kill(pid, signal.SIGKILL)  # pid 1 of the namespace: its death takes every descendant along
        _, status, usage = os.wait4(pid, 0)
        duration_ms = (time.monotonic() - started) * 1000
        drain([out_r, err_r], out, truncated, cap)  # what it wrote before it was stopped
        for fd in write_fds:
            os.close(fd)
        killed_stragglers = cgroups.reap()
        calls.close()
        for fd in (out_r, err_r, report_r):
            os.close(fd)
        exit_code = os.waitstatus_to_exitcode(status)
        sig = -exit_code if exit_code < 0 else 0
        user_s, system_s, max_rss = usage.ru_utime, usage.ru_stime, usage.ru_maxrss * 1024

        def teardown():
            pass

    report = outcome.parse_report(bytes(out[report_r])) if tested else \
        {"tests": [], "tamper": [], "candidate": {}, "declared": []}
    if not violation:
        cpu_s = user_s + system_s  # the program's own (rusage): what its CPU rlimit counts
        # In a tested job the harness outlives a candidate killed by a limit: classify by the candidate's end.
        limit_sig = sig or report["candidate"].get("signal", 0)
        violation, detail = outcome.classify(limit_sig, exit_code, bytes(out[err_r]), cgroups, limits, cpu_s,
                                             memory_events, pids_events)
    # What the job used, as its cgroup slot counted it (every process it started), where the host can.
    measured = cgroups.usage_since(accounting)
    usage_source = "rusage"
    if measured is not None:
        user_s, system_s, max_rss = measured
        usage_source = "cgroup"
    return {
        "exit_code": exit_code if exit_code >= 0 else 128 + sig,
        "signal": sig,
        "stdout_b64": base64.b64encode(bytes(out[out_r])).decode(),
        "stderr_b64": base64.b64encode(bytes(out[err_r])).decode(),
        "stdout_truncated": truncated[out_r],
        "stderr_truncated": truncated[err_r],
        "cpu_user_s": user_s,
        "cpu_system_s": system_s,
        "max_rss_bytes": max_rss,
        "usage_source": usage_source,
        "duration_ms": duration_ms,
        "violation": violation,
        "violation_detail": detail,
        "stragglers_killed": killed_stragglers,
        "tests": report["tests"],
        "tests_declared": report["declared"],
        "tamper": report["tamper"],
    }, teardown


class ForbiddenCalls:
    """The seccomp listeners of a job's processes (seccomp.py), as they arrive on the jail's socket.

    A forbidden call, in whichever process of the job (a forked child's too), waits in the kernel
    until the job is killed; the first one read here ends the job and is named in its result.
    """

    def __init__(self, channel: socket.socket):
        self.channel: socket.socket | None = channel
        self.channel.setblocking(False)
        self.listeners: list[int] = []
        self.named: list[str] = []

    def fds(self) -> list[int]:
        return self.listeners + ([self.channel.fileno()] if self.channel else [])

    def read(self, readable: list[int]) -> bool:
        """Takes new listeners and held calls among `readable`; whether a forbidden call was made."""
        if self.channel and self.channel.fileno() in readable:
            self._take_listeners()
        for fd in [fd for fd in self.listeners if fd in readable]:
            self._read_listener(fd)
        return bool(self.named)

    def read_pending(self) -> bool:
        """Reads whatever is already waiting, without blocking; whether a forbidden call was made."""
        for _ in range(2):  # again for listeners that arrived on the channel in the first pass
            ready, _, _ = select.select(self.fds(), [], [], 0)
            if self.read(ready):
                return True
        return False

    def detail(self) -> str:
        return f"a process of the job made a forbidden system call: {', '.join(self.named)} (seccomp)"

    def _take_listeners(self) -> None:
        while self.channel:
            try:
                message, fds, _, _ = socket.recv_fds(self.channel, 16, 4)
            except BlockingIOError:
                return
            self.listeners += fds
            if not message and not fds:  # every process of the job has sent its listener or gone
                self.channel.close()
                self.channel = None

    def _read_listener(self, fd: int) -> None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        events = poller.poll(0)
        if events and events[0][1] & select.POLLIN:
            name = seccomp.held_call(fd)
            if name:
                self.named.append(name)
        elif events:  # hung up: every process under this filter has exited
            self.listeners.remove(fd)
            os.close(fd)

    def close(self) -> None:
        for fd in self.listeners:
            os.close(fd)
        self.listeners = []
        if self.channel:
            self.channel.close()
            self.channel = None


def wait_for_exit(pid: int, deadline: float, calls: "ForbiddenCalls", limits: dict) -> tuple[str, str]:
    """Until the jail's pid 1 exits: ("", "") then; a violation if it makes a forbidden call or
    outlives the wall clock first (a program that closed its output and went on)."""
    pidfd = os.pidfd_open(pid)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout", f"wall-clock limit of {limits['wall_s']}s reached"
            readable, _, _ = select.select([pidfd] + calls.fds(), [], [], left)
            if calls.read(readable):
                return "forbidden_syscall", calls.detail()
            if pidfd in readable:
                return "", ""
    finally:
        os.close(pidfd)


def drain(fds: list[int], out: dict, truncated: dict, cap: int) -> None:
    """Reads what is already in the pipes, without waiting for their writers to close."""
    for fd in fds:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            room = cap - len(out[fd])
            out[fd] += chunk[:room]
            truncated[fd] = truncated[fd] or len(chunk) > room


def finish_jail(pid: int, wall_s: float) -> None:
    """Waits for a jail that said it is done to exit; kills it if it lingers."""
    deadline = time.monotonic() + min(2.0, wall_s)
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return
        time.sleep(0.001)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
