"""The sandbox worker: a pre-forked, stdlib-only process that runs each job in a fresh jail.

Started by the pool as `python -I -S -B jail.py CONFIG_JSON` with an empty
environment, so it never holds a secret of the service. It is a fork server:

    worker (this loop, root, never reads job code)
      └─ supervisor  (one per job: reads the job, sets up cgroups, collects output, enforces the wall clock)
           └─ jail   (pid 1 of fresh pid/mount/net/ipc/uts namespaces, tmpfs root, non-root uid,
                │     rlimits, seccomp; runs an untested program inside the already-loaded
                │     interpreter, or, for a tested job, is the test harness)
                └─ candidate  (a tested job's program, answering the harness's calls; unused otherwise)

The next supervisor, its jail and the jail's candidate process are forked and
set up (namespaces, root, cgroups) while the current job runs, so a job's
latency holds no fork, unshare or mount. Each worker has three cgroup slots: the
prepared jail sits in one, the running job fills another, the last job's
teardown (after its result was sent) empties the third.

Protocol on the worker's stdin/stdout: the pool writes a frame (4-byte length +
JSON header, then `payload_len` bytes of JSON payload); the waiting supervisor
reads header and payload itself, so job code and tests never enter the
long-lived worker's memory (a later job cannot dig them out). Exactly one
result frame comes back per job.

The supervisor hands the jail the job as two frames on one pipe: the program,
then (for a tested job) the tests. The jail reads only the first and passes it
to the candidate's process, which never held the job pipe; the harness reads
the tests after that (`harness.py`), so the process running the candidate's
code never has them.

Kept free of third-party imports on purpose: `-S` means no site-packages.
"""
from __future__ import annotations

import base64
import builtins
import ctypes
import errno
import fcntl
import json
import os
import resource
import select
import signal
import struct
import sys
import time

# --- Linux constants (x86_64 numbers where they differ by architecture) -------------------------
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWCGROUP = 0x10000000, 0x20000000, 0x40000000, 0x02000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 4, 38, 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
AUDIT_ARCH_X86_64 = 0xC000003E

# Syscalls a candidate program never needs and an escaping one wants. Any of
# them kills the whole process (SIGSYS), which the result reports as a
# forbidden-syscall violation.
FORBIDDEN_SYSCALLS_X86_64 = {
    "socket": 41, "connect": 42, "accept": 43, "bind": 49, "listen": 50, "socketpair": 53, "accept4": 288,
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
    "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442,
    "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176,
    "reboot": 169, "swapon": 167, "swapoff": 168, "syslog": 103, "acct": 163, "quotactl": 179,
    "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "fanotify_init": 300,
    "keyctl": 250, "add_key": 248, "request_key": 249,
    "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "open_by_handle_at": 304, "name_to_handle_at": 303,
    "sethostname": 170, "setdomainname": 171, "settimeofday": 164, "clock_settime": 227, "adjtimex": 159,
    "iopl": 172, "ioperm": 173, "vhangup": 153, "personality": 135, "lookup_dcookie": 212,
    # A tested job's candidate shares a uid with its harness: it must not take the harness's
    # descriptors (the report, the tests) or compare its memory.
    "pidfd_getfd": 438, "process_madvise": 440, "kcmp": 312,
}
SYS_CLONE, SYS_CLONE3 = 56, 435
NAMESPACE_FLAGS = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWCGROUP

SECCOMP_PROGRAM = b""  # built once per worker, at start
HARNESS = None  # harness.py, loaded once per worker at start (before the jail hides the host's files)

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.unshare.argtypes = [ctypes.c_int]
libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
libc.syscall.restype = ctypes.c_long


def _check(result: int, what: str) -> int:
    if result != 0 and result == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
                      data and data.encode()), f"mount {source} on {target}")


# --- seccomp ------------------------------------------------------------------------------------

def seccomp_program() -> bytes:
    """A classic-BPF seccomp filter: x86_64 only, forbidden syscalls and namespace clones kill."""
    def stmt(code, k):
        return struct.pack("HBBI", code, 0, 0, k)

    def jump(code, k, jt, jf):
        return struct.pack("HBBI", code, jt, jf, k)

    LD_W_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    denied = sorted(FORBIDDEN_SYSCALLS_X86_64.values())
    prog = [
        stmt(LD_W_ABS, 4),                          # seccomp_data.arch
        jump(JEQ, AUDIT_ARCH_X86_64, 1, 0),
        stmt(RET, SECCOMP_RET_KILL_PROCESS),        # another ABI: refuse
        stmt(LD_W_ABS, 0),                          # seccomp_data.nr
        jump(JGE, 0x40000000, 0, 1),                # the x32 ABI
        stmt(RET, SECCOMP_RET_KILL_PROCESS),
        jump(JEQ, SYS_CLONE3, 0, 1),                # clone3's flags sit behind a pointer BPF cannot
        stmt(RET, SECCOMP_RET_ERRNO | errno.ENOSYS),  # read: ENOSYS makes libc fall back to clone
        jump(JEQ, SYS_CLONE, 0, 3),
        stmt(LD_W_ABS, 16),                         # clone's flags (args[0], low word)
        jump(JSET, NAMESPACE_FLAGS, 0, 1),
        stmt(RET, SECCOMP_RET_KILL_PROCESS),
        stmt(LD_W_ABS, 0),
    ]
    # Each forbidden number jumps forward to the final KILL; otherwise fall through to ALLOW.
    for i, nr in enumerate(denied):
        remaining = len(denied) - i - 1
        prog.append(jump(JEQ, nr, remaining + 1, 0))
    prog.append(stmt(RET, SECCOMP_RET_ALLOW))
    prog.append(stmt(RET, SECCOMP_RET_KILL_PROCESS))
    return b"".join(prog)


def install_seccomp() -> None:
    program = SECCOMP_PROGRAM or seccomp_program()
    count = len(program) // 8
    buffer = ctypes.create_string_buffer(program, len(program))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(count, ctypes.addressof(buffer))
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "prctl(SECCOMP)")


# --- framing ------------------------------------------------------------------------------------

def read_exact(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError(f"stream closed with {left} of {n} bytes unread")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def write_frame(fd: int, obj: dict) -> None:
    data = json.dumps(obj).encode()
    view = memoryview(struct.pack(">I", len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def read_frame(fd: int) -> dict:
    (n,) = struct.unpack(">I", read_exact(fd, 4))
    return json.loads(read_exact(fd, n))


# --- cgroups ------------------------------------------------------------------------------------

class Cgroups:
    """This worker's own cgroups (v1 or v2), prepared by the pool; empty dict when the host has none."""

    def __init__(self, paths: dict):
        self.paths = paths  # controller -> directory ("unified" for v2)

    def attach(self, pid: int) -> None:
        for path in self.paths.values():
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(pid))

    def pids(self) -> list[int]:
        path = self.paths.get("pids") or self.paths.get("unified") or self.paths.get("memory")
        if not path:
            return []
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                return [int(x) for x in f.read().split()]
        except OSError:
            return []

    def memory_events(self) -> int:
        """How many times the memory limit was hit (v1 failcnt / v2 max+oom events)."""
        try:
            if "memory" in self.paths:
                with open(os.path.join(self.paths["memory"], "memory.failcnt")) as f:
                    return int(f.read())
            if "unified" in self.paths:
                with open(os.path.join(self.paths["unified"], "memory.events")) as f:
                    fields = dict(line.split() for line in f)
                return int(fields.get("oom_kill", 0)) + int(fields.get("max", 0))
        except (OSError, ValueError):
            pass
        return 0

    def reset_memory_events(self) -> int:
        """Zeroes the v1 counter; returns the count now (cgroup v2 counters only grow: compare to it)."""
        if "memory" in self.paths:
            try:
                with open(os.path.join(self.paths["memory"], "memory.failcnt"), "w") as f:
                    f.write("0")
            except OSError:
                pass
        return self.memory_events()


# --- the jail (pid 1 of the new namespaces) ----------------------------------------------------

def build_template(cfg: dict) -> None:
    """Builds, once per worker, the read-only root every job of this worker starts from.

    The worker moves into a mount namespace of its own and mounts a tmpfs at
    root_dir holding only read-only binds of the interpreter's standard library
    and the shared libraries it loads, a few device nodes, and empty mount
    points; then makes it read-only. Each job's own mount namespace is a copy
    of this one, so a job costs one tmpfs mount and a pivot_root, not a dozen mounts.
    """
    root = cfg["root_dir"]
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    mount("jail", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=1024,mode=0755")
    for path in cfg["ro_binds"]:
        target = root + path
        if os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "a").close()
        mount(path, target, None, MS_BIND | MS_REC)
        mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    for path in cfg["hidden"]:  # e.g. the interpreter's site-packages: an empty read-only tmpfs over it
        target = root + path
        if os.path.isdir(target):
            mount("hidden", target, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0555")
    for link, dest in cfg["symlinks"].items():
        os.makedirs(os.path.dirname(root + link), exist_ok=True)
        os.symlink(dest, root + link)
    os.makedirs(root + "/dev", exist_ok=True)
    for dev in ("null", "zero", "urandom", "random"):
        open(f"{root}/dev/{dev}", "a").close()
        mount(f"/dev/{dev}", f"{root}/dev/{dev}", None, MS_BIND)
        mount(None, f"{root}/dev/{dev}", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    os.makedirs(root + "/work")
    os.makedirs(root + "/.old")
    os.symlink("/work", root + "/tmp")
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def enter_root(cfg: dict) -> None:
    """In the job's fresh mount namespace: a private tmpfs /work, then pivot into the template root."""
    root = cfg["root_dir"]
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    mount("work", root + "/work", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
          f"size={cfg['work_bytes']},nr_inodes=4096,mode=0700,uid={cfg['uid']},gid={cfg['uid']}")
    os.chdir(root)
    _check(libc.syscall(155, b".", b".old"), "pivot_root")  # pivot_root(new_root, put_old)
    os.chdir("/")
    _check(libc.umount2(b"/.old", MNT_DETACH), "umount old root")  # the host's tree is gone for good
    os.chdir("/work")


def write_files(cfg: dict, job: dict) -> None:
    for name, content in job["files"].items():
        if "/" in name or name.startswith("."):
            raise ValueError(f"bad file name {name!r}")
        with open(name, "w") as f:
            f.write(content)
        if os.geteuid() == 0:
            os.chown(name, cfg["uid"], cfg["uid"])


def drop_privileges(cfg: dict, job: dict) -> None:
    limits = job["limits"]
    for res, value in [
        (resource.RLIMIT_AS, limits["memory_bytes"]),
        (resource.RLIMIT_FSIZE, limits["file_bytes"]),
        (resource.RLIMIT_NOFILE, limits["open_files"]),
        (resource.RLIMIT_NPROC, limits["processes"]),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_MEMLOCK, 0),
        (resource.RLIMIT_MSGQUEUE, 0),
    ]:
        resource.setrlimit(res, (value, value))
    # SIGXCPU at the soft limit names the violation; the hard limit a second later is the backstop.
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    if os.geteuid() != 0:
        return  # weak isolation without root: rlimits only, as the service reported
    uid = cfg["uid"]
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def run_in_jail(cfg: dict, job_r: int, stdin_r: int, out_w: int, err_w: int, report_w: int,
                ready_w: int, attached_r: int) -> None:
    """The jail process: prepares its root and its candidate process before any job exists, then
    runs one job; never returns."""
    code = 120
    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the supervisor's death ends the jail
        # Wait until the supervisor has put us in our cgroups: the candidate forked below inherits them.
        if os.read(attached_r, 1) != b"a":
            os._exit(0)
        os.close(attached_r)
        # Not dumpable (nor after the uid drop): a tested job's candidate runs under the same uid as
        # this process, its harness, and must not read its memory or take its descriptors.
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
        os.setsid()
        name = b"sandbox"
        libc.sethostname(name, len(name))
        if cfg["isolate"]:
            enter_root(cfg)
        else:
            os.chdir(cfg["root_dir"])
        # The candidate's process, ready for a tested job: forked now, off the job's latency. It
        # holds neither the job pipe nor the report pipe, ever.
        call_r, call_w = os.pipe()
        reply_r, reply_w = os.pipe()
        candidate_pid = os.fork()
        if candidate_pid == 0:
            for fd in (job_r, report_w, ready_w, call_w, reply_r):
                os.close(fd)
            run_candidate(cfg, call_r, reply_w, stdin_r, out_w, err_w)
        os.close(call_r)
        os.close(reply_w)
        os.write(ready_w, b"r")
        os.close(ready_w)
        # Blocks until the supervisor has a job for us and has put us in our cgroups. Only the
        # program's frame is read here; a tested job's tests stay in the pipe for the harness.
        try:
            job = read_frame(job_r)
        except EOFError:
            os._exit(0)  # the worker is shutting down
        write_files(cfg, job)
        tested = bool(job.get("has_tests"))
        if tested:
            write_frame(call_w, job)  # the program (no tests in this frame) to the candidate's process
        # Final places: 0-2 stdio, 3 report, and for a tested job 4 the rest of the job pipe (the
        # tests), 5 and 6 the call channel. Everything else closes; untested, the candidate's
        # process sees its channel close and leaves.
        keep = [(stdin_r, 0), (out_w, 1), (err_w, 2), (report_w, 3)]
        if tested:
            keep += [(job_r, 4), (call_w, 5), (reply_r, 6)]
        place_fds(keep)
        drop_privileges(cfg, job)
        for sig in (signal.SIGXFSZ, signal.SIGPIPE, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)  # exceeding a file limit kills, so it is reported
        if cfg["seccomp"]:
            install_seccomp()
        os.environ.clear()
        code = HARNESS.run(job, 3, 4, candidate_pid, 5, 6) if tested else execute(job)
    except BaseException as exc:  # setup failures must surface, not hang
        try:
            os.write(2, f"sandbox setup failed: {type(exc).__name__}: {exc}\n".encode())
        except OSError:
            pass
        code = 121
    finally:
        os._exit(code)


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


def run_candidate(cfg: dict, call_r: int, reply_w: int, stdin_r: int, out_w: int, err_w: int) -> None:
    """A tested job's candidate process: waits (as root, in the jail) for the program, then jails
    itself like the harness (rlimits, uid, seccomp) and runs it; never returns."""
    code = 122
    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        job = read_frame(call_r)  # EOFError when the job is untested: nothing to do
        place_fds([(stdin_r, 0), (out_w, 1), (err_w, 2), (call_r, 5), (reply_w, 6)])
        drop_privileges(cfg, job)
        for sig in (signal.SIGXFSZ, signal.SIGPIPE, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        if cfg["seccomp"]:
            install_seccomp()
        os.environ.clear()
        HARNESS.candidate.serve(job, 5, 6)
    except EOFError:
        code = 0
    except BaseException as exc:
        try:
            os.write(2, f"sandbox setup failed (candidate): {type(exc).__name__}: {exc}\n".encode())
        except OSError:
            pass
    finally:
        os._exit(code)


def execute(job: dict) -> int:
    """Runs an untested program in this already-jailed interpreter; returns the exit code.

    Tested jobs never come here: `harness.run` keeps the tests out of the program's process.
    """
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)
    sys.stdin = open(0, "r", encoding="utf-8", errors="replace", closefd=False)
    sys.argv = [job["main"]]
    sys.path[:0] = ["/work"]
    for name in [m for m in sys.modules if m in ("__main__",)]:
        del sys.modules[name]
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


# --- the supervisor (one per job) ---------------------------------------------------------------

def supervisor(cfg: dict, cgroups: Cgroups, notify_w: int) -> None:
    """One job's supervisor: prepares a jail ahead of time, takes the next job from fd 0, runs it,
    writes the result frame to fd 1. Never returns."""
    job_id = None
    try:
        prepared = prepare_jail(cfg, cgroups)
        try:
            header = read_frame(0)
        except EOFError:
            os._exit(3)  # the pool closed our stdin: shut down
        job_id = header["job_id"]
        payload = read_exact(0, header["payload_len"])
        # The job is off the shared pipe: the worker may start preparing the next supervisor now.
        os.write(notify_w, (json.dumps({"job_id": job_id, "wall_s": header["limits"]["wall_s"]}) + "\n").encode())
        result, teardown = run_job(prepared, header, payload, cgroups)
        write_frame(1, {"job_id": job_id, **result})
        os.write(notify_w, b"sent\n")  # from now on the worker must not answer for this job
    except BaseException as exc:
        code = 1
        try:
            write_frame(1, {"job_id": job_id, "error": f"{type(exc).__name__}: {exc}"})
        except BaseException:
            code = 2
        os._exit(code)
    # After the result, so the next job need not wait for this one's processes to vanish. Nothing
    # may be written to the pool from here on: it has this job's frame and waits for the next.
    try:
        teardown()
        code = 0
    except BaseException:
        code = 4
    os._exit(code)


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
    if cfg["isolate"]:
        # The mount namespace is the jail's own (it unshares it itself): pivot_root moves every
        # process of a namespace, and the supervisor must keep seeing the host's cgroups.
        _check(libc.unshare(CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    pid = os.fork()
    if pid == 0:
        for fd in (job_w, in_w, out_r, err_r, report_r, ready_r, attached_w):
            os.close(fd)
        run_in_jail(cfg, job_r, in_r, out_w, err_w, report_w, ready_w, attached_r)
    for fd in (job_r, in_r, out_w, err_w, report_w, ready_w, attached_r):
        os.close(fd)
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
            "mnt_ns": mnt_ns}


def run_job(prepared: dict, header: dict, payload: bytes, cgroups: Cgroups) -> tuple[dict, object]:
    """Runs one job in the prepared jail: (the result, what is left to do once it has been sent).

    A tested job is over when its harness reports `done` (it has killed the candidate by then):
    the result goes out without waiting for the two processes' memory to be torn down, which is
    most of a small job's time; the teardown (wait, empty the cgroup slot) follows.
    """
    job = {**header, **json.loads(payload)}
    limits = job["limits"]
    pid = prepared["pid"]
    out_r, err_r, report_r, in_w = prepared["out_r"], prepared["err_r"], prepared["report_r"], prepared["in_w"]
    memory_events = cgroups.reset_memory_events()
    started = time.monotonic()
    tested = "tests" in job
    program = {k: v for k, v in job.items() if k not in ("tests", "prelude")}
    program["has_tests"] = tested
    write_frame(prepared["job_w"], program)
    if tested:  # read by the harness only after the candidate's process is forked
        write_frame(prepared["job_w"], {"tests": job["tests"], "prelude": job.get("prelude") or ""})
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
        readable, writable, _ = select.select(open_fds, write_fds, [], left)
        for fd in readable:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                open_fds.remove(fd)
                continue
            room = cap - len(out[fd])
            out[fd] += chunk[:room]
            if fd == report_r and tested and b'{"done": ' in out[report_r][-4096:]:
                done = harness_done(out[report_r])  # None until the line is whole
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
    if done is not None and not violation:
        drain([out_r, err_r], out, truncated, cap)  # what the killed candidate wrote last
        duration_ms = (time.monotonic() - started) * 1000
        exit_code, sig = done["exit_code"], 0
        user_s, system_s, max_rss = done["cpu_user_s"], done["cpu_system_s"], done["max_rss_bytes"]
        killed_stragglers = 0

        def teardown():
            finish_jail(pid, limits["wall_s"])
            reap_cgroup(cgroups)
            for fd in write_fds + [out_r, err_r, report_r]:
                os.close(fd)
    else:
        if violation:
            os.kill(pid, signal.SIGKILL)  # pid 1 of the namespace: its death takes every descendant along
        _, status, usage = os.wait4(pid, 0)
        duration_ms = (time.monotonic() - started) * 1000
        for fd in write_fds:
            os.close(fd)
        killed_stragglers = reap_cgroup(cgroups)
        for fd in (out_r, err_r, report_r):
            os.close(fd)
        exit_code = os.waitstatus_to_exitcode(status)
        sig = -exit_code if exit_code < 0 else 0
        user_s, system_s, max_rss = usage.ru_utime, usage.ru_stime, usage.ru_maxrss * 1024

        def teardown():
            pass

    report = parse_report(bytes(out[report_r])) if tested else {"tests": [], "tamper": [], "candidate": {}}
    if not violation:
        cpu_s = user_s + system_s
        # In a tested job the harness outlives a candidate killed by a limit: classify by the candidate's end.
        limit_sig = sig or report["candidate"].get("signal", 0)
        violation, detail = classify(limit_sig, exit_code, bytes(out[err_r]), cgroups, limits, cpu_s,
                                     memory_events)
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
        "duration_ms": duration_ms,
        "violation": violation,
        "violation_detail": detail,
        "stragglers_killed": killed_stragglers,
        "tests": report["tests"],
        "tamper": report["tamper"],
    }, teardown


def harness_done(report: bytes) -> dict | None:
    """The harness's last line, once it is there: {"done": true, "exit_code", "cpu_user_s", ...}."""
    for line in report.splitlines()[::-1]:
        if line.startswith(b'{"done": '):
            try:
                done = json.loads(line)
                return {"exit_code": int(done["exit_code"]), "cpu_user_s": float(done["cpu_user_s"]),
                        "cpu_system_s": float(done["cpu_system_s"]), "max_rss_bytes": int(done["max_rss_bytes"])}
            except (ValueError, KeyError, TypeError):
                return None
    return None


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


def parse_report(data: bytes) -> dict:
    """What the harness wrote to fd 3 (only it holds that descriptor): per-test outcomes, tamper
    signals and how the candidate's process ended; malformed lines are dropped."""
    tests, tamper, candidate = [], [], {}
    for line in data.splitlines()[:2000]:
        try:
            item = json.loads(line)
            if "tamper" in item:
                tamper.append({"pattern": str(item["tamper"])[:64], "detail": str(item.get("detail", ""))[:500]})
            elif "candidate" in item:
                candidate = {"exit_code": int(item["candidate"]["exit_code"]),
                             "signal": int(item["candidate"]["signal"])}
            else:
                tests.append({"name": str(item["name"])[:200], "passed": item["passed"] is True,
                              "message": str(item.get("message", ""))[:1000]})
        except (ValueError, KeyError, TypeError):
            continue
    return {"tests": tests[:1000], "tamper": tamper[:100], "candidate": candidate}


def classify(sig: int, exit_code: int, stderr: bytes, cgroups: Cgroups, limits: dict,
             cpu_s: float, memory_events_before: int = 0) -> tuple[str, str]:
    """Names the limit a finished program ran into, from its signal, cgroup counters and last error.

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
    if sig == signal.SIGXFSZ or (exit_code != 0 and b"[Errno 27] File too large" in tail):
        return "file_size", f"file size limit of {limits['file_bytes']} bytes reached"
    if exit_code != 0 and b"[Errno 28] No space left on device" in tail:
        return "file_size", f"work directory limit of {limits['work_bytes']} bytes reached"
    if exit_code != 0 and b"[Errno 11] Resource temporarily unavailable" in tail:
        return "processes", f"process limit of {limits['processes']} reached"
    return "", ""


def reap_cgroup(cgroups: Cgroups) -> int:
    """Kills anything still in this worker's cgroup (belt and braces after the pid namespace ends)."""
    killed = 0
    for _ in range(200):
        pids = cgroups.pids()
        if not pids:
            break
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.005)
    return killed


# --- the worker loop ----------------------------------------------------------------------------

def load_harness() -> None:
    """Imports the test harness from this checkout; it and its modules are stdlib-only."""
    global HARNESS
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, root)
    try:
        from crucible.services.sandbox_executor import harness

        HARNESS = harness
    finally:
        sys.path.remove(root)


def main() -> None:
    global SECCOMP_PROGRAM
    cfg = json.loads(sys.argv[1])
    load_harness()
    slots = [Cgroups(paths) for paths in cfg.get("cgroups") or [{}, {}, {}]]
    if cfg["isolate"]:
        build_template(cfg)
    if cfg["seccomp"]:
        SECCOMP_PROGRAM = seccomp_program()
    # Modules imported here are inherited by every job through fork, so a job
    # that imports typing or re does not pay for it again (zygote preloading).
    for name in cfg.get("preload", ()):
        try:
            __import__(name)
        except ImportError:
            pass
    HARNESS.candidate.prepare()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    write_frame(1, {"ready": True, "pid": os.getpid()})
    serve(cfg, slots)


def spawn_supervisor(cfg: dict, slots: list[Cgroups], slot: int) -> dict:
    notify_r, notify_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(notify_r)
        supervisor(cfg, slots[slot], notify_w)
    os.close(notify_w)
    return {"pid": pid, "pidfd": os.pidfd_open(pid), "notify_r": notify_r, "job_id": None, "deadline": None,
            "slot": slot}


def serve(cfg: dict, slots: list[Cgroups]) -> None:
    """The worker loop: always one supervisor prepared and waiting; the next is forked as soon as
    the current one has taken its job, so jail set-up overlaps the previous job's run.

    Each supervisor takes a cgroup slot no other live supervisor holds. A supervisor sends its
    result before it has torn its jail down, so with three slots the next jail is prepared in a
    free one while the last job's teardown finishes in its own (and the running job fills the
    third); if none is free, preparing waits until one is.
    """
    waiting: dict | None = spawn_supervisor(cfg, slots, 0)
    running: list[dict] = []
    while True:
        if waiting is None:
            busy = {r["slot"] for r in running}
            free = [i for i in range(len(slots)) if i not in busy]
            if free:
                waiting = spawn_supervisor(cfg, slots, free[0])
        watched = [r["pidfd"] for r in running] + [r["notify_r"] for r in running if r["notify_r"] >= 0]
        if waiting is not None:
            watched += [waiting["notify_r"], waiting["pidfd"]]
        deadlines = [r["deadline"] for r in running]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        readable, _, _ = select.select(watched, [], [], timeout)
        if waiting is not None and waiting["notify_r"] in readable:
            note = os.read(waiting["notify_r"], 4096)
            if note:
                info = json.loads(note.split(b"\n")[0])
                # The supervisor enforces the wall clock; this is the backstop if it hangs.
                waiting.update(job_id=info["job_id"], deadline=time.monotonic() + info["wall_s"] + 10,
                               sent=b"sent\n" in note)
                running.append(waiting)
                waiting = None
                continue
        if waiting is not None and waiting["pidfd"] in readable:  # died before taking a job
            _, status = os.waitpid(waiting["pid"], 0)
            os.close(waiting["pidfd"])
            os.close(waiting["notify_r"])
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3:
                for r in running:
                    os.waitpid(r["pid"], 0)
                return  # stdin closed: the pool is shutting us down
            waiting = None
        now = time.monotonic()
        for r in list(running):
            if r["notify_r"] in readable:
                note = os.read(r["notify_r"], 4096)
                r["sent"] = r["sent"] or b"sent\n" in note
                if not note:
                    os.close(r["notify_r"])
                    r["notify_r"] = -1
            if r["pidfd"] in readable or now > r["deadline"]:
                if r["pidfd"] not in readable:
                    os.kill(r["pid"], signal.SIGKILL)
                _, status = os.waitpid(r["pid"], 0)
                os.close(r["pidfd"])
                if r["notify_r"] >= 0:
                    r["sent"] = r["sent"] or b"sent\n" in _read_all(r["notify_r"])
                    os.close(r["notify_r"])
                running.remove(r)
                died = os.WIFSIGNALED(status) or os.waitstatus_to_exitcode(status) == 2
                if died and not r["sent"]:
                    write_frame(1, {"job_id": r["job_id"], "error": "the job's supervisor died"})


def _read_all(fd: int) -> bytes:
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    return b"".join(chunks)


if __name__ == "__main__":
    main()
