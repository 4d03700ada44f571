"""The supervisor: the worker's own process. It takes each job, runs it in a prepared jail, sends the result.

It asks the zygote (zygote.py, forked from this process before any job
existed) for a jail in a free cgroup slot, joins the jail to the slot and waits
until the jail has its root and is confined (and, where the slot has none, for
the slot's harness); only then does it read the next job from stdin (the pool's
pipe). Each job runs on a runner thread (one per cgroup slot, started once),
which gives a tested job's tests and call channel to the slot's harness, enforces
the wall clock and the output cap, writes exactly one result frame to stdout,
and tears the jail down after the result has gone. The next jail is prepared
while a job runs, so a job's latency holds no fork, unshare or mount.

A tested job costs one process, not two: its jail is the candidate's process, and
the slot's harness, a process of its own that lives across jobs (warm: none of a
fresh fork's copied pages), runs its tests. Before, the harness was the jail's pid 1
and forked the candidate: per HumanEval check a second fork, exit and some 600
copied pages (2 workers, 164 checks x 6, alternated: 174-190 exec/s before against
226-262 after).

Job code, tests and results enter this process, which never forks again: only
the zygote's memory is inherited by jails and harnesses, and it never holds a job.
"""
from __future__ import annotations

import _socket
import base64
import json
import marshal
import os
import queue
import select
import signal
import socket
import threading
import time

from crucible.services.sandbox_executor import harness
from crucible.services.sandbox_executor.jail import jailed, linux, outcome, seccomp, zygote
from crucible.services.sandbox_executor.jail.cgroups import Cgroups
from crucible.shared import framing

EXIT_WAIT_S = 10  # after a jail was killed: how long its exit may take to be reported before the worker gives up
ZYGOTE_GRACE_S = 0.2  # a job failed: how long the zygote's socket may take to say it died with it
GONE_GRACE_S = 0.2  # a candidate that stopped answering: how long it may take to exit before it is killed


class ZygoteGone(RuntimeError):
    """The zygote exited or broke its protocol: the worker cannot prepare or reap jails any more."""


class Zygote:
    """The supervisor's side of the zygote's socket: prepared jails, and the exits it reaped."""

    def __init__(self, pid: int, channel: _socket.socket):
        self.pid, self.channel = pid, channel
        self.prepared: queue.Queue = queue.Queue()
        self.exits: dict[int, tuple[int, tuple[float, float, int]]] = {}
        self.forgotten: set[int] = set()  # jails whose end nobody waits for (their exit is dropped)
        self.changed = threading.Condition()
        self.asking = threading.Lock()  # one request at a time: replies come back in order
        self.gone = False
        threading.Thread(target=self._listen, name="zygote", daemon=True).start()

    def prepare(self, slot: int, kind: bytes = b"prepare") -> tuple[int, dict[str, int]]:
        """A new jail for cgroup slot `slot` (or, kind b"harness", the slot's harness): its pid and the
        descriptors zygote.PASSED (PASSED_HARNESS) names."""
        with self.asking:
            if self.gone:
                raise ZygoteGone("the sandbox zygote is gone")
            try:
                self.channel.send(b"%s %d" % (kind, slot))
            except OSError as exc:  # its end of the socket is closed: it died
                raise ZygoteGone(f"the sandbox zygote is gone ({exc})") from None
            reply = self.prepared.get()
            if reply is None:
                self.prepared.put(None)  # for whoever asks next
                raise ZygoteGone("the sandbox zygote is gone")
        return reply

    def exit_status(self, pid: int, timeout: float) -> tuple[int, tuple[float, float, int]] | None:
        """(wait status, (user s, system s, peak bytes)) once the zygote has reaped `pid`; None after `timeout`."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while pid not in self.exits:
                left = deadline - time.monotonic()
                if self.gone:
                    raise ZygoteGone("the sandbox zygote is gone")
                if left <= 0:
                    return None
                self.changed.wait(left)
            return self.exits.pop(pid)

    def wait_gone(self, timeout: float) -> bool:
        """Whether the zygote is gone, or goes within `timeout` (its socket closing tells)."""
        with self.changed:
            return self.changed.wait_for(lambda: self.gone, timeout)

    def forget(self, pid: int) -> None:
        """Nobody will wait for `pid`'s end: drop its exit, now or when it comes."""
        with self.changed:
            if self.exits.pop(pid, None) is None:
                self.forgotten.add(pid)

    def close(self) -> None:
        """Ends the zygote (it leaves when its socket has no more requests) and reaps it."""
        try:
            self.channel.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        os.waitpid(self.pid, 0)
        self.channel.close()

    def _listen(self) -> None:
        try:
            while True:
                message, fds = linux.recv_fds(self.channel, zygote.MESSAGE_BYTES,
                                              max(len(zygote.PASSED), len(zygote.PASSED_HARNESS)))
                if not message:
                    break
                kind, *fields = message.split()  # b"prepared <pid>", b"exit <pid> <status> <user s> <system s> <peak bytes>"
                if kind == b"prepared":
                    names = zygote.PASSED if len(fds) == len(zygote.PASSED) else zygote.PASSED_HARNESS
                    self.prepared.put((int(fields[0]), dict(zip(names, fds))))
                else:
                    pid, status = int(fields[0]), int(fields[1])
                    with self.changed:
                        if pid in self.forgotten:
                            self.forgotten.discard(pid)
                        else:
                            self.exits[pid] = (status, (float(fields[2]), float(fields[3]), int(fields[4])))
                            self.changed.notify_all()
        except (OSError, ValueError):
            pass
        with self.changed:
            self.gone = True
            self.changed.notify_all()
        self.prepared.put(None)


class Jail:
    """A prepared jail, as its supervisor holds it."""

    def __init__(self, zygote_link: Zygote, pid: int, fds: dict[str, int]):
        self.zygote, self.pid = zygote_link, pid
        self.pidfd = fds["pidfd"]
        self.job_w, self.in_w, self.out_r, self.err_r, self.call_w, self.reply_r = (
            fds["job_w"], fds["in_w"], fds["out_r"], fds["err_r"], fds["call_w"], fds["reply_r"])
        self.calls = ForbiddenCalls(socket.socket(fileno=fds["calls"]))
        self.report_r = -1  # a tested job's report pipe, from its harness
        self.reaped = False

    def kill(self) -> None:
        """SIGKILL to the jail's pid 1: its death takes every process of its pid namespace along."""
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self) -> tuple[int, tuple[float, float, int]]:
        """Its wait status and usage, once it has exited (kill it first to be sure it will)."""
        ended = self.zygote.exit_status(self.pid, EXIT_WAIT_S)
        if ended is None:
            raise RuntimeError(f"the jail (pid {self.pid}) was not reaped within {EXIT_WAIT_S}s")
        self.reaped = True
        return ended

    def finish(self, wall_s: float) -> None:
        """Waits for a jail that said it is done to exit; kills it if it lingers."""
        if self.zygote.exit_status(self.pid, min(2.0, wall_s)) is None:
            self.kill()
            self.wait()
        self.reaped = True

    def alive(self) -> bool:
        """Whether its process is still there (a prepared jail can be killed before a job reaches it)."""
        return _alive(self.pidfd)

    def close_stdin(self) -> None:
        """The program's stdin ends (all of it was written, or there was none)."""
        os.close(self.in_w)
        self.in_w = -1

    def release(self) -> None:
        """Closes what the supervisor held of it (closing the job pipe of an unused jail ends it)."""
        if not self.reaped:
            self.zygote.forget(self.pid)
            self.reaped = True
        self.calls.close()
        for fd in (self.pidfd, self.job_w, self.in_w, self.out_r, self.err_r, self.call_w, self.reply_r, self.report_r):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.pidfd = self.job_w = self.in_w = self.out_r = self.err_r = self.call_w = self.reply_r = self.report_r = -1

    def hand_over_call_channel(self) -> tuple[int, int]:
        """(call_w, reply_r), no longer held here: once the harness has them, only it and the candidate
        hold the channel, so either one leaving is seen by the other."""
        ends = self.call_w, self.reply_r
        self.call_w = self.reply_r = -1
        return ends


class Harness:
    """A slot's harness (harness.serve, in a confined process of its own), as its supervisor holds it.
    It runs the tests of the slot's tested jobs one after another, so a tested job costs one process
    (the candidate's), not two. It is replaced after any job it did not finish, and every
    `JOBS` jobs."""

    JOBS = 256

    def __init__(self, zygote_link: Zygote, pid: int, fds: dict[str, int]):
        self.zygote, self.pid = zygote_link, pid
        self.pidfd, self.control = fds["pidfd"], socket.socket(fileno=fds["control"])
        self.calls = ForbiddenCalls(socket.socket(fileno=fds["calls"]))
        self.jobs = 0

    def alive(self) -> bool:
        return _alive(self.pidfd)

    def send(self, job: dict, tests: bytes, fds: list[int]) -> None:
        """A job's descriptors (call_w, reply_r, report_w, the candidate's pidfd), its entry point and
        its tests (frames), on the control socket."""
        self.jobs += 1
        linux.send_fds(self.control, b"J", fds)
        framing.write(self.control.fileno(), marshal.dumps(job))
        framing.write(self.control.fileno(), tests, harness.TESTS_FRAME_LIMIT)

    def worn(self) -> bool:
        return self.jobs >= self.JOBS

    def close(self) -> None:
        """Ends it (SIGKILL: it may be inside a test) and drops what this process held of it."""
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except (ProcessLookupError, OSError):
            pass
        self.zygote.forget(self.pid)
        self.calls.close()
        self.control.close()
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


class Supervisor:
    """Jobs from stdin, results to stdout; one prepared jail ahead, each job on a runner thread.

    A job runs while it holds a cgroup slot, so at most one job per slot runs at a time: one runner
    thread per slot, started once, never waits for another (a thread started per job cost a
    clone, a stack mapping and its teardown every job)."""

    def __init__(self, cfg: dict, slots: list[Cgroups], zygote_link: Zygote):
        self.cfg, self.slots, self.zygote = cfg, slots, zygote_link
        self.harness_cgroup = Cgroups(cfg.get("harness_cgroup") or {}, keep_open=True)  # shared by the harnesses
        self.free = set(range(len(slots)))
        self.slot_freed = threading.Condition()
        self.send_lock = threading.Lock()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()  # (jail, job, slot), or None: no more
        self.runners = [threading.Thread(target=self._runner, name=f"runner {i}", daemon=True)
                        for i in range(len(slots))]
        # Each slot's harness, started with the slot's first jail and replaced (by the next prepare of
        # the slot) when a job ends without it finishing; only the slot's runner uses it in between.
        self.harnesses: list[Harness | None] = [None] * len(slots)
        self.job_cpus = JobCpus()

    def serve(self) -> None:
        """Until stdin closes: prepare a jail, take a job, hand it to a runner, prepare the next."""
        for runner in self.runners:
            runner.start()
        while True:
            slot = self._take_slot()
            jail, problem = self._try_prepare(slot)
            header = framing.read(0)
            if header is None:
                if jail is not None:
                    jail.release()
                break
            job_id = None
            try:
                header = json.loads(header)
                job_id = header["job_id"]
                body = framing.read(0)
                if body is None:
                    raise EOFError("the pool closed the pipe between a job's header and its body")
                job = {**header, **json.loads(body)}
                if jail is not None and not jail.alive():
                    # Killed while it waited for this job (the job would have met a broken pipe and failed):
                    # a fresh one takes it.
                    jail.release()
                    jail, problem = self._try_prepare(slot)
                if jail is None:
                    raise RuntimeError(f"the jail could not be prepared: {problem}")
            except ZygoteGone:  # (its prepared jail died with it) the worker ends; the pool fails this job alone
                raise
            except Exception as exc:
                self.send({"job_id": job_id, "error": f"{type(exc).__name__}: {exc}"})
                if jail is not None:
                    jail.kill()
                    jail.release()
                self._free_slot(slot)
                continue
            self.jobs.put((jail, job, slot))
        for _ in self.runners:
            self.jobs.put(None)
        for runner in self.runners:
            runner.join()
        for h in self.harnesses:
            if h is not None:
                h.close()
        self.harness_cgroup.reap()  # until they have gone: the pool removes the group after this worker

    def _try_prepare(self, slot: int) -> tuple[Jail | None, str]:
        """A prepared jail for the slot, or None and why not (the job that comes is answered with it); a
        zygote gone ends the worker."""
        try:
            return self.prepare(slot), ""
        except ZygoteGone:
            raise
        except Exception as exc:
            return None, f"{type(exc).__name__}: {exc}"

    def _runner(self) -> None:
        while (work := self.jobs.get()) is not None:
            try:
                self.run(*work)
            except BaseException as exc:  # its jail released and slot freed (run's finally); keep serving
                os.write(2, f"sandbox runner: {type(exc).__name__}: {exc}\n".encode())

    def prepare(self, slot: int) -> Jail:
        """A jail from the zygote, joined to this slot's cgroups, with its root, confined; and the slot's
        harness, when it has none (or a worn or dead one)."""
        cgroups = self.slots[slot]
        pid, fds = self.zygote.prepare(slot)
        jail = Jail(self.zygote, pid, fds)
        try:
            _go(fds, "the jail failed while preparing its root", lambda: cgroups.attach(pid))
        except BaseException:
            jail.kill()
            jail.release()
            raise
        try:
            self._harness(slot)
        except BaseException:
            jail.kill()
            jail.release()
            raise
        return jail

    def _harness(self, slot: int) -> Harness:
        """The slot's harness: a fresh one where it has none, or a worn or dead one (this slot's
        runner, or the thread preparing the slot's next jail, is the only one asking)."""
        current = self.harnesses[slot]
        if current is not None and not current.worn() and current.alive():
            return current
        self._drop_harness(slot)
        pid, fds = self.zygote.prepare(slot, b"harness")
        fresh = Harness(self.zygote, pid, fds)
        try:
            _go(fds, "the slot's harness failed while starting", lambda: self.harness_cgroup.attach(pid))
        except BaseException:
            fresh.close()
            raise
        self.harnesses[slot] = fresh
        return fresh

    def run(self, jail: Jail, job: dict, slot: int) -> None:
        """One job on a runner thread: the result out, then the teardown; the slot is free once it is empty."""
        cgroups = self.slots[slot]
        tested = "tests" in job
        cpu = None
        try:
            try:
                harness_ = self._harness(slot) if tested else None
                if harness_ is not None:
                    cpu = self.job_cpus.take([jail.pid, harness_.pid])
                result, teardown = run_job(jail, job, cgroups, harness_)
            except Exception as exc:
                # A job whose jail or harness died with the zygote: no jail or harness can be made or
                # reaped any more, so the worker leaves and the pool starts a new one.
                if isinstance(exc, ZygoteGone) or self.zygote.wait_gone(ZYGOTE_GRACE_S):
                    os.write(2, b"sandbox worker: its zygote is gone; the worker leaves\n")
                    os._exit(1)
                jail.kill()
                result, teardown = {"error": f"{type(exc).__name__}: {exc}"}, cgroups.reap
            if tested and not result.get("harness_finished"):  # inside a test, or retiring: a fresh one next
                self._drop_harness(slot)
            result.pop("harness_finished", None)
            self.send({"job_id": job["job_id"], **result})
            try:
                teardown()
            except Exception:
                jail.kill()
                cgroups.reap()
        finally:
            self.job_cpus.give_back(cpu)
            jail.release()
            self._free_slot(slot)

    def _drop_harness(self, slot: int) -> None:
        harness_ = self.harnesses[slot]
        if harness_ is not None:
            harness_.close()
            self.harnesses[slot] = None

    def send(self, result: dict) -> None:
        with self.send_lock:
            framing.write(1, json.dumps(result).encode())

    def _take_slot(self) -> int:
        with self.slot_freed:
            while not self.free:
                self.slot_freed.wait()
            return self.free.pop()

    def _free_slot(self, slot: int) -> None:
        with self.slot_freed:
            self.free.add(slot)
            self.slot_freed.notify()


class JobCpus:
    """The CPU each running tested job of this worker is kept on, where the worker may use several (a
    worker pinned to one CPU, pool.worker_cpus, has its jobs there already).

    A tested job's two processes, its candidate and the harness running its tests, call each other for
    every call a test makes: on one CPU, each wakes the other where it runs. Left to the scheduler, the
    one woken went to the idle CPU at each call, and a call took 3x as long (bench_sandbox.py's call row,
    one worker on two cores: ~170-185 -> ~58-67 us). The worker's jobs running at once get CPUs of their
    own (the least taken; the runner's own among equals): both on one would leave the other idle. A job
    can use one core's time (its cgroup's quota) and cannot move itself (seccomp refuses sched_setaffinity)."""

    def __init__(self):
        self.allowed = sorted(os.sched_getaffinity(0))
        self.taken = {cpu: 0 for cpu in self.allowed}
        self.lock = threading.Lock()

    def take(self, pids: list[int]) -> int | None:
        """Keeps `pids` (one job's) on a CPU until give_back; None where there is no choice to make."""
        if len(self.allowed) < 2:
            return None
        here = linux.current_cpu()
        with self.lock:
            cpu = min(self.allowed, key=lambda c: (self.taken[c], c != here))
            self.taken[cpu] += 1
        for pid in pids:
            try:
                os.sched_setaffinity(pid, (cpu,))
            except OSError:  # gone already (the job's own wait sees its end), or the CPU taken away
                pass
        return cpu

    def give_back(self, cpu: int | None) -> None:
        if cpu is not None:
            with self.lock:
                self.taken[cpu] -= 1


def _go(fds: dict[str, int], failed: str, attach=None) -> None:
    """Puts a prepared jail in its cgroups (`attach`), lets it go on and waits until it is confined (or
    a harness); the two descriptors of that handshake are closed whatever happens."""
    try:
        if attach is not None:
            attach()
        os.write(fds["attached_w"], jailed.ATTACHED)
        ready = os.read(fds["ready_r"], 1)
    except OSError:  # it died setting up
        ready = b""
    finally:
        os.close(fds["attached_w"])
        os.close(fds["ready_r"])
    if ready != b"r":
        raise RuntimeError(failed)


COMPILED_TESTS = harness.CompiledTests()  # the frames tested jobs' harnesses read their tests from


def _alive(pidfd: int) -> bool:
    """Whether the process of `pidfd` is still there (its pidfd turns readable when it exits)."""
    return pidfd >= 0 and not select.select([pidfd], [], [], 0)[0]


def run_job(jail: Jail, job: dict, cgroups: Cgroups, harness_: Harness | None = None) -> tuple[dict, object]:
    """Runs one job in the prepared jail (for a tested job, with the slot's harness): (the result,
    what is left to do once it has been sent; "harness_finished": whether the harness saw the job
    through, and can take the next).

    A tested job is over when its harness reports `done`: the candidate's process is killed and the
    result goes out without waiting for its memory to be torn down, which is most of a small job's
    time; the teardown (wait, empty the cgroup slot) follows.
    """
    limits = job["limits"]
    out_r, err_r = jail.out_r, jail.err_r
    memory_events = cgroups.reset_memory_events()
    pids_events = cgroups.pids_events()
    accounting = cgroups.begin_usage()
    calls = jail.calls
    started = time.monotonic()
    tested = "tests" in job
    program = {k: v for k, v in job.items() if k not in ("tests", "prelude")}
    program["has_tests"] = tested
    report_r, watched = -1, []
    if tested:
        if harness_ is None:
            raise RuntimeError("the slot has no harness")
        # The tests go to the harness only: the candidate's process never has them.
        report_r, report_w = os.pipe()
        jail.report_r = report_r  # closed with the jail's other descriptors
        call_w, reply_r = jail.hand_over_call_channel()
        try:
            harness_.send({"entry_point": job.get("entry_point") or ""},
                          COMPILED_TESTS.frame(job["tests"], job.get("prelude") or ""),
                          [call_w, reply_r, report_w, jail.pidfd])
        finally:
            for fd in (call_w, reply_r, report_w):
                os.close(fd)
        watched = [harness_.pidfd]
    framing.write(jail.job_w, marshal.dumps(program))

    stdin_data = base64.b64decode(job.get("stdin_b64") or "")
    cap = limits["output_bytes"]
    out = {out_r: bytearray(), err_r: bytearray(), report_r: bytearray()}
    truncated = {out_r: False, err_r: False, report_r: False}
    violation, detail = "", ""
    deadline = started + limits["wall_s"]
    open_fds = [out_r, err_r] + ([report_r] if tested else [])
    harness_calls = harness_.calls if tested else None
    write_fds = [jail.in_w] if stdin_data else []
    if not stdin_data:
        jail.close_stdin()
    for fd in open_fds + write_fds:
        os.set_blocking(fd, False)
    done, harness_lost = None, ""
    while open_fds and done is None:
        left = deadline - time.monotonic()
        if left <= 0:
            violation, detail = "timeout", f"wall-clock limit of {limits['wall_s']}s reached"
            break
        readable, writable, _ = select.select(open_fds + calls.fds() + watched + (harness_calls.fds() if tested else []),
                                              write_fds, [], left)
        if calls.read(readable):
            violation, detail = "forbidden_syscall", calls.detail()
            break
        if tested and harness_calls.read(readable):
            violation, detail = "forbidden_syscall", "the tests made a forbidden system call: " \
                                                     f"{', '.join(harness_calls.named)} (seccomp)"
            break
        if watched and watched[0] in readable and report_r not in readable:
            harness_lost = "the harness ended before the tests were done"
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
            room = (outcome.REPORT_BYTES if fd == report_r else cap) - len(out[fd])
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
                jail.close_stdin()
                write_fds = []
    if not violation and calls.read_pending():  # one made just before the job finished
        violation, detail = "forbidden_syscall", calls.detail()
    report = outcome.parse_report(bytes(out[report_r])) if tested else \
        {"tests": [], "tamper": [], "gone": "", "declared": []}
    finished = done is not None and not violation
    limit_sig = 0
    if finished:
        drain([out_r, err_r], out, truncated, cap)  # what the candidate wrote last
        duration_ms = (time.monotonic() - started) * 1000
        exit_code, sig = done["exit_code"], 0
        user_s, system_s, max_rss = done["cpu_user_s"], done["cpu_system_s"], done["max_rss_bytes"]
        killed_stragglers = 0
        if report["gone"]:
            # The candidate's process left before the tests were done: how it ended names it.
            ended = jail.zygote.exit_status(jail.pid, GONE_GRACE_S)
            if ended is None:  # it closed the channel but lingers
                jail.kill()
                ended = jail.wait()
            jail.reaped = True
            code = os.waitstatus_to_exitcode(ended[0])
            if code == 0:
                when = "before the tests ran" if report["gone"] == "before_tests" else "while a test was calling it"
                report["tamper"].append({"pattern": "exit_" + report["gone"],
                                         "detail": f"the program ended its own process with exit code 0 {when}"})
                exit_code = 1
            limit_sig = -code if code < 0 else 0
            # What the kernel counted, not what the candidate last said: a limit's kill (as pid 1 of its
            # namespace it ignores SIGXCPU; the hard limit's SIGKILL ends it) is named from these.
            user_s, system_s, max_rss = (max(user_s, ended[1][0]), max(system_s, ended[1][1]),
                                         max(max_rss, ended[1][2]))

            def teardown():
                cgroups.reap()
        else:
            jail.kill()  # it tears its memory down while the result goes out

            def teardown():
                jail.wait()
                cgroups.reap()
    else:
        if not violation and not harness_lost:  # its output closed, the jail may still run: the wall clock and the listeners hold
            violation, detail = wait_for_exit(jail.pidfd, deadline, calls, limits)
        if violation or harness_lost:
            jail.kill()
        status, (user_s, system_s, max_rss) = jail.wait()
        duration_ms = (time.monotonic() - started) * 1000
        drain([out_r, err_r], out, truncated, cap)  # what it wrote before it was stopped
        killed_stragglers = cgroups.reap()
        exit_code = os.waitstatus_to_exitcode(status)
        sig = limit_sig = -exit_code if exit_code < 0 else 0
        if harness_lost:  # a failed verdict (the tests it did not report count as failed), not a worker's error
            violation, detail, exit_code, sig = "", harness_lost, 1, 0

        def teardown():
            pass

    if not violation and not harness_lost:
        cpu_s = user_s + system_s  # the program's own (rusage): what its CPU rlimit counts
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
        "harness_finished": finished and not done["retire"],
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
                message, fds = linux.recv_fds(self.channel, 16, 4)
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


def wait_for_exit(pidfd: int, deadline: float, calls: "ForbiddenCalls", limits: dict) -> tuple[str, str]:
    """Until the jail's pid 1 exits: ("", "") then; a violation if it makes a forbidden call or
    outlives the wall clock first (a program that closed its output and went on)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return "timeout", f"wall-clock limit of {limits['wall_s']}s reached"
        readable, _, _ = select.select([pidfd] + calls.fds(), [], [], left)
        if calls.read(readable):
            return "forbidden_syscall", calls.detail()
        if pidfd in readable:
            return "", ""


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
