"""The processes inside a jail: its pid 1, and for a tested job the candidate's process beside it.

    jail (pid 1 of fresh pid and ipc namespaces, in its slot's net, uts and mount ones: fresh /work,
      │   a non-root uid, seccomp, then the job's rlimits; runs an untested program in the
      │   already-loaded interpreter, or, for a tested job, is the test harness)
      └─ candidate  (a tested job's program, answering the harness's calls; idle otherwise)

Both are set up before any job exists (the supervisor forks the jail while the
previous job runs); only then do they wait for the job. The jail drops its uid and
installs the seccomp filter before it forks the candidate's process, which inherits
both (one filter, one listener, for every process of the job). The candidate's process is
forked ahead when the supervisor expects a tested job (the last one was); otherwise
it is forked once a job turns out to be tested, still before its tests are read. The job arrives as two
frames on one pipe: the program, then (for a tested job) the tests. The jail
reads only the first and passes it to the candidate's process, which never held
the job pipe; the harness reads the tests after that (harness.py), so the
process running the candidate's code never has them. Both frames are marshalled by the
supervisor (trusted, and before any job code runs): in a freshly forked process the first
json.loads costs some 200 us of copied pages, marshal.loads half that.
"""
from __future__ import annotations

import _signal
import builtins
import fcntl
import marshal
import os
import resource
import signal
import sys

from crucible.services.sandbox_executor import candidate, harness
from crucible.services.sandbox_executor.jail import rootfs, seccomp
from crucible.services.sandbox_executor.jail.cgroups import JAIL_OWN_TASKS
from crucible.services.sandbox_executor.jail.linux import PR_SET_DUMPABLE, PR_SET_PDEATHSIG, prctl
from crucible.shared import framing

# Signals the worker ignores or handles that a jailed program must feel: exceeding a file limit
# or writing to a closed pipe kills, so the result can say so.
_DEFAULT_SIGNALS = (int(signal.SIGXFSZ), int(signal.SIGPIPE), int(signal.SIGINT), int(signal.SIGTERM))
# What a program may expect of its environment, none of it the host's: `~` expands without a
# password-database lookup, and the user has a name. The worker (started with an empty environment)
# sets it once, before the zygote exists, so every job inherits it as it is.
JOB_ENVIRONMENT = {"HOME": "/tmp", "USER": "sandbox", "LOGNAME": "sandbox", "LANG": "C.UTF-8"}


def run(cfg: dict, job_r: int, stdin_r: int, out_w: int, err_w: int, report_w: int,
        ready_w: int, attached_r: int, calls_w: int) -> None:
    """The jail process: prepares its root, confines itself and forks its candidate process before any
    job exists, then runs one job; never returns."""
    code = 120
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PDEATHSIG)")  # the supervisor's death ends the jail
        # Wait until the supervisor has put us in our cgroups: the candidate forked below inherits
        # them. The byte says whether it expects a tested job ("t"), or an untested one ("u").
        expected = os.read(attached_r, 1)
        if expected not in (b"t", b"u"):
            os._exit(0)
        os.close(attached_r)
        # Not dumpable (nor after the uid drop): a tested job's candidate runs under the same uid as
        # this process, its harness, and must not read its memory or take its descriptors.
        prctl(PR_SET_DUMPABLE, 0, "prctl(DUMPABLE)")
        os.setsid()
        if cfg["isolate"]:
            rootfs.enter(cfg)
        else:
            os.chdir(cfg["root_dir"])
            if os.geteuid() == 0:  # the job's files are written after the uid drop, by the job's uid
                os.chown(".", cfg["uid"], cfg["uid"])
        # From here on this process, and every process it forks (the candidate's, the program's
        # children), is the job's uid under the job's seccomp filter.
        confine(cfg, calls_w)
        # The candidate's process, when a tested job is expected: forked now, off the job's latency.
        candidate = fork_candidate(cfg, job_r, stdin_r, out_w, err_w, report_w, ready_w) \
            if expected == b"t" else None
        os.write(ready_w, b"r")
        os.close(ready_w)
        # Blocks until the supervisor has a job for us. Only the program's frame is read here; a
        # tested job's tests stay in the pipe for the harness.
        program = framing.read(job_r)
        if program is None:
            os._exit(0)  # the worker is shutting down
        job = marshal.loads(program)
        write_files(job)
        tested = bool(job.get("has_tests"))
        if tested and candidate is None:  # not expected: forked now, before the tests leave the pipe
            candidate = fork_candidate(cfg, job_r, stdin_r, out_w, err_w, report_w, -1)
        candidate_pid, call_w, reply_r = candidate or (0, -1, -1)
        if tested:
            framing.write(call_w, program)  # the program (no tests in this frame) to the candidate's process
        # Final places: 0-2 stdio, 3 report, and for a tested job 4 the rest of the job pipe (the
        # tests), 5 and 6 the call channel. Everything else closes; untested, the candidate's
        # process sees its channel close and leaves.
        keep = [(stdin_r, 0), (out_w, 1), (err_w, 2), (report_w, 3)]
        if tested:
            keep += [(job_r, 4), (call_w, 5), (reply_r, 6)]
        place_fds(keep)
        if not tested and candidate_pid:  # its channel is closed: it leaves, and the program has no
            os.waitpid(candidate_pid, 0)    # child it did not make
        set_limits(cfg, job)
        code = harness.run(job, 3, 4, candidate_pid, 5, 6) if tested else execute(job)
    except BaseException as exc:  # setup failures must surface, not hang
        try:
            os.write(2, f"sandbox setup failed: {type(exc).__name__}: {exc}\n".encode())
        except OSError:
            pass
        code = 121
    finally:
        os._exit(code)


def fork_candidate(cfg: dict, job_r: int, stdin_r: int, out_w: int, err_w: int, report_w: int,
                   ready_w: int) -> tuple[int, int, int]:
    """Forks a tested job's candidate process (confined already: it inherits the jail's uid, seccomp
    filter and signal dispositions); (its pid, the call pipe's write end, the reply pipe's read end).
    It holds neither the job pipe nor the report pipe, ever (nor `ready_w`, where open)."""
    call_r, call_w = os.pipe()
    reply_r, reply_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        for fd in (job_r, report_w, ready_w, call_w, reply_r):
            if fd >= 0:
                os.close(fd)
        run_candidate(cfg, call_r, reply_w, stdin_r, out_w, err_w)
    os.close(call_r)
    os.close(reply_w)
    return pid, call_w, reply_r


def run_candidate(cfg: dict, call_r: int, reply_w: int, stdin_r: int, out_w: int, err_w: int) -> None:
    """A tested job's candidate process: waits (in the jail, confined) for the program, takes the
    job's limits and runs it; never returns."""
    code = 122
    try:
        if not cfg["isolate"]:  # in a pid namespace the harness's death (its pid 1) ends this process
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PDEATHSIG)")
        program = framing.read(call_r)
        if program is None:
            os._exit(0)  # the job is untested: nothing to do
        job = marshal.loads(program)
        place_fds([(stdin_r, 0), (out_w, 1), (err_w, 2), (call_r, 5), (reply_w, 6)])
        set_limits(cfg, job)
        candidate.serve(job, 5, 6)
    except EOFError:
        code = 0  # the harness left in the middle of a frame
    except BaseException as exc:
        try:
            os.write(2, f"sandbox setup failed (candidate): {type(exc).__name__}: {exc}\n".encode())
        except OSError:
            pass
    finally:
        os._exit(code)


def write_files(job: dict) -> None:
    """The job's files in /work (the current folder), written by the job's uid (confined already).
    Written with plain descriptor calls: a text-mode `open` would copy some seventy pages of the
    worker's io machinery."""
    for name, content in job["files"].items():
        if "/" in name or name.startswith("."):
            raise ValueError(f"bad file name {name!r}")
        data = content.encode("utf-8")
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)


def place_fds(pairs: list[tuple[int, int]]) -> None:
    """Moves each descriptor to its target number and closes every other one (from 0 up)."""
    high = [(fcntl.fcntl(fd, fcntl.F_DUPFD, 64), target) for fd, target in pairs]  # clear of every target
    for fd, target in high:
        os.dup2(fd, target)
    top = max(target for _, target in pairs) + 1
    used = {target for _, target in pairs}
    for fd in range(top):
        if fd not in used:
            try:
                os.close(fd)
            except OSError:
                pass
    os.closerange(top, 65536)


def confine(cfg: dict, listener_to: int) -> None:
    """The jail's confinement, before any job exists, in this order: the uid drop (which needs
    privileges), default signal handling, seccomp (which forbids what came before; its listener
    leaves on `listener_to`, which closes). Every process the jail forks inherits all three, so a
    tested job's candidate is confined by the same steps, made once. The environment is
    JOB_ENVIRONMENT already (inherited from the worker); the job's rlimits come with the job
    (`set_limits`: lowering a limit needs no privilege).

    Everything here runs in a fresh fork, where each page of the worker's memory it touches is
    copied (a fault of a few microseconds): `_signal.signal` sets a disposition without the enum
    conversions of `signal.signal`, about 60 copied pages fewer."""
    drop_privileges(cfg)
    for sig in _DEFAULT_SIGNALS:
        _signal.signal(sig, _signal.SIG_DFL)
    if cfg["seccomp"] and seccomp.NOTIFY:
        seccomp.install(listener_to)
    else:
        os.close(listener_to)
        if cfg["seccomp"]:
            seccomp.install()


def drop_privileges(cfg: dict) -> None:
    if os.geteuid() != 0:
        return  # weak isolation without root: rlimits only, as the service reported
    uid = cfg["uid"]
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    # Changing credentials clears the parent-death signal: set it again, so a supervisor that dies
    # (the worker's backstop) still takes its jail along.
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PDEATHSIG)")


def set_limits(cfg: dict, job: dict) -> None:
    """The job's rlimits on this process (and what it forks from now on), just before job code runs.
    Unprivileged: a limit above the hard limit this process has is held at that hard limit."""
    limits = job["limits"]
    # With a pids cgroup, the slot's pids.max (processes + the jail's own) is the limit that refuses a
    # fork or a thread, and the kernel counts each refusal (pids.events): a job that hits it is named a
    # `processes` violation even when it swallows the error. RLIMIT_NPROC (per uid) stays a looser
    # backstop behind it. The uid is shared by the jail's own processes (harness and candidate) in each
    # of the worker's slots: the prepared next jail's, and the last job's while it is torn down.
    slots = cfg.get("cgroups") or [{}, {}, {}]
    has_pids = any("pids" in slot or "unified" in slot for slot in slots)
    nproc = limits["processes"] + (len(slots) * JAIL_OWN_TASKS if has_pids else 2 * len(slots))
    for res, value in [
        (resource.RLIMIT_AS, limits["memory_bytes"]),
        (resource.RLIMIT_FSIZE, limits["file_bytes"]),
        (resource.RLIMIT_NOFILE, limits["open_files"]),
        (resource.RLIMIT_NPROC, nproc),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_MEMLOCK, 0),
        (resource.RLIMIT_MSGQUEUE, 0),
    ]:
        _lower_limit(res, value, value)
    # SIGXCPU at the soft limit names the violation; the hard limit a second later is the backstop.
    _lower_limit(resource.RLIMIT_CPU, limits["cpu_s"], limits["cpu_s"] + 1)


def _lower_limit(res: int, soft: int, hard: int) -> None:
    try:
        resource.setrlimit(res, (soft, hard))
    except ValueError:  # above this process's hard limit, which only a privileged process may raise
        ceiling = resource.getrlimit(res)[1]
        resource.setrlimit(res, (min(soft, ceiling), min(hard, ceiling)))


def execute(job: dict) -> int:
    """Runs an untested program in this already-jailed interpreter; returns the exit code.

    Tested jobs never come here: `harness.run` keeps the tests out of the program's process.
    """
    candidate.use_job_stdio()
    sys.argv = [job["main"]]
    sys.path[:0] = ["/work"]
    sys.modules.pop("__main__", None)
    namespace = {"__name__": "__main__", "__file__": "/work/" + job["main"], "__builtins__": builtins}
    exit_code = 0
    try:
        source = job["files"][job["main"]]
        exec(compile(source, "/work/" + job["main"], "exec"), namespace)
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        exit_code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    return exit_code & 0xFF if isinstance(exit_code, int) else 1
