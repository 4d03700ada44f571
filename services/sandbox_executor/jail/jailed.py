"""The confined processes the zygote forks: a job's jail, and a slot's harness.

    jail     (pid 1 of fresh pid and ipc namespaces, in its slot's net, uts and mount ones: fresh
              /work, a non-root uid, seccomp, then the job's rlimits; runs an untested program in
              the already-loaded interpreter, or is a tested job's candidate, answering the calls
              of the slot's harness)
    harness  (run_harness: pid 1 of a pid namespace of its own, confined the same way; runs the
              tests of the slot's tested jobs, one after another: harness.serve)

A jail is set up before any job exists (the supervisor forks it while the previous job runs):
its uid dropped and its seccomp filter installed, which every process of the job inherits (one
filter, one listener). The job arrives as one frame, marshalled by the supervisor (trusted,
and before any job code runs: in a freshly forked process the first json.loads costs some
200 us of copied pages, marshal.loads half that). A tested job's tests never come here: the
supervisor gives them to the slot's harness, with this process's end of the call channel.
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
import types

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


def run(cfg: dict, job_r: int, stdin_r: int, out_w: int, err_w: int, call_r: int, reply_w: int,
        ready_w: int, attached_r: int, calls_w: int) -> None:
    """The jail process: prepares its root and confines itself before any job exists, then runs one
    job (an untested program, or a tested job's candidate, answering its harness); never returns."""
    code = 120
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PDEATHSIG)")  # the supervisor's death ends the jail
        # Wait until the supervisor has put us in our cgroups: every process of the job inherits them.
        if os.read(attached_r, 1) != ATTACHED:
            os._exit(0)
        os.close(attached_r)
        # Not dumpable (nor after the uid drop): no process of the job's uid may read its memory or
        # take its descriptors (the slot's harness runs under that uid too, in another pid namespace).
        prctl(PR_SET_DUMPABLE, 0, "prctl(DUMPABLE)")
        os.setsid()
        if cfg["isolate"]:
            rootfs.enter(cfg)
        else:
            os.chdir(cfg["work_dir"])  # the slot's folder (zygote.slot_config), its uid's
        # From here on this process, and every process it forks (the program's children), is the
        # job's uid under the job's seccomp filter.
        confine(cfg, calls_w)
        os.write(ready_w, b"r")
        os.close(ready_w)
        # Blocks until the supervisor has a job for us. A tested job's tests never come here: the
        # supervisor gives them to the slot's harness, which calls this process over call_r/reply_w.
        program = framing.read(job_r)
        if program is None:
            os._exit(0)  # the worker is shutting down
        os.close(job_r)
        job = marshal.loads(program)
        write_files(job)
        tested = bool(job.get("has_tests"))
        # Final places: 0-2 stdio and, for a tested job, 5 and 6 the call channel. Everything else closes.
        keep = [(stdin_r, 0), (out_w, 1), (err_w, 2)]
        if tested:
            keep += [(call_r, 5), (reply_w, 6)]
        place_fds(keep)
        set_limits(cfg, job)
        if tested:
            candidate.serve(job, 5, 6)  # never returns
        code = execute(job)
    except BaseException as exc:  # setup failures must surface, not hang
        try:
            os.write(2, f"sandbox setup failed: {type(exc).__name__}: {exc}\n".encode())
        except OSError:
            pass
        code = 121
    finally:
        os._exit(code)


def run_harness(cfg: dict, control: int, ready_w: int, attached_r: int, calls_w: int) -> None:
    """A slot's harness process: confined as a jail is (the job's uid and seccomp filter, in a pid
    namespace of its own, where no job's process is), it runs the tests of the slot's tested jobs
    one after another (harness.serve); never returns."""
    code = 120
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PDEATHSIG)")
        if os.read(attached_r, 1) != ATTACHED:
            os._exit(0)
        os.close(attached_r)
        prctl(PR_SET_DUMPABLE, 0, "prctl(DUMPABLE)")
        os.setsid()
        # Isolated: each job's /work is entered as the job begins (harness.serve). Without namespaces the
        # slot's folder is entered now, while this process may still pass the runtime folder (root's, 0700).
        os.chdir("/" if cfg["isolate"] else cfg["work_dir"])
        confine(cfg, calls_w)
        for res, value in harness_limits(cfg):
            _lower_limit(res, value, value)
        os.write(ready_w, b"r")
        os.close(ready_w)
        harness.serve(control, "/work" if cfg["isolate"] else None)
        code = 0
    except BaseException as exc:
        try:
            os.write(2, f"sandbox harness failed: {type(exc).__name__}: {exc}\n".encode())
        except OSError:
            pass
        code = 121
    finally:
        os._exit(code)


ATTACHED = b"a"  # the supervisor's go-ahead: the jail is in its cgroups
HARNESS_TASKS = 8  # the tasks (processes and threads) a slot's harness may hold under the slot's uid


def harness_limits(cfg: dict) -> list[tuple[int, int]]:
    """A harness's rlimits: the service's memory limit, no core, no file of its own beyond the job's
    folder size. CPU is the wall clock's (a harness that overruns it is replaced)."""
    return [(resource.RLIMIT_AS, cfg["harness_memory_bytes"]), (resource.RLIMIT_CORE, 0),
            (resource.RLIMIT_FSIZE, cfg["work_bytes"]), (resource.RLIMIT_MEMLOCK, 0),
            (resource.RLIMIT_MSGQUEUE, 0)]


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
    # backstop behind it, looser by the harness's tasks: the uid is the slot's own (pool.SLOTS), held by
    # this job's processes and the slot's harness, no other job's (a slot takes its next job once this
    # one's are gone).
    nproc = limits["processes"] + (JAIL_OWN_TASKS if cfg["pids_cgroup"] else 1) + HARNESS_TASKS
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
    # The program's module is __main__ as Python runs a file: pickle (multiprocessing's pools) finds its
    # functions there by name.
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__ = "/work/" + job["main"], builtins
    sys.modules["__main__"] = main
    namespace = main.__dict__
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
