"""The sandbox worker: a pre-forked, stdlib-only process that runs each job in a fresh jail.

Started by the pool as `python -I -S -B jail.py CONFIG_JSON` with an empty
environment, so it never holds a secret of the service. It is a fork server:

    worker (this loop, root, never reads job code)
      └─ supervisor  (one per job: reads the job, sets up cgroups, collects output, enforces the wall clock)
           └─ jail   (pid 1 of fresh pid/mount/net/ipc/uts namespaces, tmpfs root, non-root uid,
                      rlimits, seccomp; runs the code inside the already-loaded interpreter)

The next supervisor and its jail are forked and set up (namespaces, root) while
the current job runs, so a job's latency holds no fork, unshare or mount.

Protocol on the worker's stdin/stdout: the pool writes a frame (4-byte length +
JSON header, then `payload_len` bytes of JSON payload); the waiting supervisor
reads header and payload itself, so job code and tests never enter the
long-lived worker's memory (a later job cannot dig them out). Exactly one
result frame comes back per job.

Kept free of third-party imports on purpose: `-S` means no site-packages.
"""
from __future__ import annotations

import base64
import builtins
import ctypes
import errno
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
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 38, 22
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
}
SYS_CLONE, SYS_CLONE3 = 56, 435
NAMESPACE_FLAGS = CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWCGROUP

SECCOMP_PROGRAM = b""  # built once per worker, at start

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

    def reset_memory_events(self) -> None:
        if "memory" in self.paths:
            try:
                with open(os.path.join(self.paths["memory"], "memory.failcnt"), "w") as f:
                    f.write("0")
            except OSError:
                pass


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
                ready_w: int) -> None:
    """The jail process: prepares its root before any job exists, then runs one job; never returns."""
    code = 120
    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the supervisor's death ends the jail
        os.setsid()
        name = b"sandbox"
        libc.sethostname(name, len(name))
        if cfg["isolate"]:
            enter_root(cfg)
        else:
            os.chdir(cfg["root_dir"])
        os.write(ready_w, b"r")
        os.close(ready_w)
        # Blocks until the supervisor has a job for us and has put us in our cgroups.
        chunks = []
        while chunk := os.read(job_r, 1 << 20):
            chunks.append(chunk)
        if not chunks:
            os._exit(0)  # the worker is shutting down
        job = json.loads(b"".join(chunks))
        write_files(cfg, job)
        os.dup2(stdin_r, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.dup2(report_w, 3)
        os.closerange(4, 65536)
        drop_privileges(cfg, job)
        for sig in (signal.SIGXFSZ, signal.SIGPIPE, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)  # exceeding a file limit kills, so it is reported
        if cfg["seccomp"]:
            install_seccomp()
        os.environ.clear()
        code = execute(job)
    except BaseException as exc:  # setup failures must surface, not hang
        try:
            os.write(2, f"sandbox setup failed: {type(exc).__name__}: {exc}\n".encode())
        except OSError:
            pass
        code = 121
    finally:
        os._exit(code)


def execute(job: dict) -> int:
    """Runs the program (and its tests) in this already-jailed interpreter; returns the exit code."""
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
    if "tests" in job:
        exit_code = run_tests(job, namespace, exit_code)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    return exit_code & 0xFF if isinstance(exit_code, int) else 1


def run_tests(job: dict, namespace: dict, exit_code: int) -> int:
    """Runs the test code against the program's namespace; one outcome per test, written to fd 3.

    HumanEval-style tests define check(candidate) and are called with the entry
    point; other tests are every callable named test_*. (Candidate code shares
    this process, so outcomes here are not tamper-proof: the verifier adds that.)
    """
    report = open(3, "w", encoding="utf-8", closefd=False, buffering=1)
    if exit_code != 0:
        report.write(json.dumps({"name": "program", "passed": False, "message": f"exit code {exit_code}"}) + "\n")
        return exit_code
    tests = []
    try:
        exec(compile(job["tests"], "/work/test_program.py", "exec"), namespace)
        entry = job.get("entry_point") or ""
        if "check" in namespace and callable(namespace["check"]) and entry:
            if entry not in namespace:
                raise NameError(f"entry point {entry!r} is not defined by the program")
            candidate = namespace[entry]
            tests.append(("check", lambda: namespace["check"](candidate)))
        tests += [(n, f) for n, f in list(namespace.items()) if n.startswith("test_") and callable(f)]
        if not tests:
            raise LookupError("the tests define neither check(candidate) with an entry point nor test_* functions")
    except BaseException as exc:
        report.write(json.dumps({"name": "load_tests", "passed": False,
                                 "message": f"{type(exc).__name__}: {exc}"[:1000]}) + "\n")
        return 1
    failed = 0
    for name, test in tests:
        try:
            test()
            outcome = {"name": name, "passed": True}
        except BaseException as exc:
            failed += 1
            outcome = {"name": name, "passed": False, "message": f"{type(exc).__name__}: {exc}"[:1000]}
        report.write(json.dumps(outcome) + "\n")
    return 1 if failed else 0


# --- the supervisor (one per job) ---------------------------------------------------------------

def supervisor(cfg: dict, cgroups: Cgroups, notify_w: int) -> None:
    """One job's supervisor: prepares a jail ahead of time, takes the next job from fd 0, runs it,
    writes the result frame to fd 1. Never returns."""
    job_id = None
    try:
        prepared = prepare_jail(cfg)
        try:
            header = read_frame(0)
        except EOFError:
            os._exit(3)  # the pool closed our stdin: shut down
        job_id = header["job_id"]
        payload = read_exact(0, header["payload_len"])
        # The job is off the shared pipe: the worker may start preparing the next supervisor now.
        os.write(notify_w, json.dumps({"job_id": job_id, "wall_s": header["limits"]["wall_s"]}).encode())
        os.close(notify_w)
        result = run_job(prepared, header, payload, cgroups)
        write_frame(1, {"job_id": job_id, **result})
        code = 0
    except BaseException as exc:
        code = 1
        try:
            write_frame(1, {"job_id": job_id, "error": f"{type(exc).__name__}: {exc}"})
        except BaseException:
            code = 2
    os._exit(code)


def prepare_jail(cfg: dict) -> dict:
    """Forks the jail into fresh namespaces; it enters its root and waits for a job."""
    job_r, job_w = os.pipe()
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    report_r, report_w = os.pipe()
    ready_r, ready_w = os.pipe()
    if cfg["isolate"]:
        # The mount namespace is the jail's own (it unshares it itself): pivot_root moves every
        # process of a namespace, and the supervisor must keep seeing the host's cgroups.
        _check(libc.unshare(CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    pid = os.fork()
    if pid == 0:
        for fd in (job_w, in_w, out_r, err_r, report_r, ready_r):
            os.close(fd)
        run_in_jail(cfg, job_r, in_r, out_w, err_w, report_w, ready_w)
    for fd in (job_r, in_r, out_w, err_w, report_w, ready_w):
        os.close(fd)
    if os.read(ready_r, 1) != b"r":
        raise RuntimeError("the jail failed while preparing its root")
    os.close(ready_r)
    # Holding the jail's mount namespace keeps its teardown (an RCU-synchronised unmount of
    # the whole tree) out of the job's latency: it happens when this supervisor exits.
    mnt_ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY) if cfg["isolate"] else -1
    return {"pid": pid, "job_w": job_w, "in_w": in_w, "out_r": out_r, "err_r": err_r, "report_r": report_r,
            "mnt_ns": mnt_ns}


def run_job(prepared: dict, header: dict, payload: bytes, cgroups: Cgroups) -> dict:
    job = {**header, **json.loads(payload)}
    limits = job["limits"]
    pid = prepared["pid"]
    out_r, err_r, report_r, in_w = prepared["out_r"], prepared["err_r"], prepared["report_r"], prepared["in_w"]
    cgroups.reset_memory_events()
    cgroups.attach(pid)
    started = time.monotonic()
    view = memoryview(json.dumps(job).encode())
    while view:
        view = view[os.write(prepared["job_w"], view):]
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
    while open_fds:
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
    if not violation:
        cpu_s = usage.ru_utime + usage.ru_stime
        violation, detail = classify(sig, exit_code, bytes(out[err_r]), cgroups, limits, cpu_s)
    return {
        "exit_code": exit_code if exit_code >= 0 else 128 + sig,
        "signal": sig,
        "stdout_b64": base64.b64encode(bytes(out[out_r])).decode(),
        "stderr_b64": base64.b64encode(bytes(out[err_r])).decode(),
        "stdout_truncated": truncated[out_r],
        "stderr_truncated": truncated[err_r],
        "cpu_user_s": usage.ru_utime,
        "cpu_system_s": usage.ru_stime,
        "max_rss_bytes": usage.ru_maxrss * 1024,
        "duration_ms": duration_ms,
        "violation": violation,
        "violation_detail": detail,
        "stragglers_killed": killed_stragglers,
        "tests": parse_report(bytes(out[report_r])) if "tests" in job else [],
    }


def parse_report(data: bytes) -> list[dict]:
    """Per-test outcomes the harness wrote to fd 3, one JSON object per line; malformed lines are dropped."""
    outcomes = []
    for line in data.splitlines()[:1000]:
        try:
            item = json.loads(line)
            outcomes.append({"name": str(item["name"])[:200], "passed": item["passed"] is True,
                             "message": str(item.get("message", ""))[:1000]})
        except (ValueError, KeyError, TypeError):
            continue
    return outcomes


def classify(sig: int, exit_code: int, stderr: bytes, cgroups: Cgroups, limits: dict,
             cpu_s: float) -> tuple[str, str]:
    """Names the limit a finished program ran into, from its signal, cgroup counters and last error.

    A program can only make itself look worse by faking the stderr patterns, so
    reading them is safe; the signals and counters cannot be faked from inside.
    """
    tail = stderr.rstrip()[-300:]
    if sig == signal.SIGSYS:
        return "forbidden_syscall", "a forbidden system call was made (seccomp)"
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= limits["cpu_s"] - 0.05):
        return "cpu", f"CPU limit of {limits['cpu_s']}s reached"
    if cgroups.memory_events() > 0 or (exit_code != 0 and tail.endswith(b"MemoryError")):
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

def main() -> None:
    global SECCOMP_PROGRAM
    cfg = json.loads(sys.argv[1])
    cgroups = Cgroups(cfg.get("cgroups", {}))
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
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    write_frame(1, {"ready": True, "pid": os.getpid()})
    serve(cfg, cgroups)


def spawn_supervisor(cfg: dict, cgroups: Cgroups) -> dict:
    notify_r, notify_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(notify_r)
        supervisor(cfg, cgroups, notify_w)
    os.close(notify_w)
    return {"pid": pid, "pidfd": os.pidfd_open(pid), "notify_r": notify_r, "job_id": None, "deadline": None}


def serve(cfg: dict, cgroups: Cgroups) -> None:
    """The worker loop: always one supervisor prepared and waiting; the next is forked as soon as
    the current one has taken its job, so jail set-up overlaps the previous job's run."""
    waiting = spawn_supervisor(cfg, cgroups)
    running: list[dict] = []
    while True:
        watched = [waiting["notify_r"], waiting["pidfd"]] + [r["pidfd"] for r in running]
        deadlines = [r["deadline"] for r in running]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        readable, _, _ = select.select(watched, [], [], timeout)
        if waiting["notify_r"] in readable:
            note = os.read(waiting["notify_r"], 4096)
            if note:
                info = json.loads(note)
                # The supervisor enforces the wall clock; this is the backstop if it hangs.
                waiting.update(job_id=info["job_id"], deadline=time.monotonic() + info["wall_s"] + 10)
                os.close(waiting["notify_r"])
                running.append(waiting)
                waiting = spawn_supervisor(cfg, cgroups)
                continue
        if waiting["pidfd"] in readable:  # died before taking a job
            _, status = os.waitpid(waiting["pid"], 0)
            os.close(waiting["pidfd"])
            os.close(waiting["notify_r"])
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3:
                for r in running:
                    os.waitpid(r["pid"], 0)
                return  # stdin closed: the pool is shutting us down
            waiting = spawn_supervisor(cfg, cgroups)
        now = time.monotonic()
        for r in list(running):
            if r["pidfd"] in readable or now > r["deadline"]:
                if r["pidfd"] not in readable:
                    os.kill(r["pid"], signal.SIGKILL)
                _, status = os.waitpid(r["pid"], 0)
                os.close(r["pidfd"])
                running.remove(r)
                if os.WIFSIGNALED(status) or os.waitstatus_to_exitcode(status) == 2:
                    write_frame(1, {"job_id": r["job_id"], "error": "the job's supervisor died"})


if __name__ == "__main__":
    main()
