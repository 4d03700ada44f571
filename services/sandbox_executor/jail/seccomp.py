"""The seccomp filter every jailed process installs last: a forbidden syscall never runs, and is named.

A classic-BPF program compiled here once per worker (`prepare`) and inherited by
every job through fork. Where the kernel offers user notification (5.0 and
later), a forbidden call is held by the kernel and reported on a listener
descriptor that each jailed process hands to its supervisor (over a Unix
socket, before any job code runs, keeping no copy): the supervisor names the
call, whichever process of the job made it (a forked child's too, exactly, with
no log to read or rate limit), and ends the job. Elsewhere the call kills the
process that made it (SIGSYS), which names it only when that process is one
the jail watches.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import _socket
import os
import struct

from crucible.services.sandbox_executor.jail.linux import (NAMESPACE_FLAGS, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP,
                                                           SYS_CLONE, SYS_CLONE3, check, libc, prctl, send_fds)

SECCOMP_MODE_FILTER = 2
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
SECCOMP_RET_USER_NOTIF = 0x7FC00000
SYS_SECCOMP, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER = 317, 1, 8
AUDIT_ARCH_X86_64 = 0xC000003E
# ioctl numbers of the listener (_IOWR('!', n, struct)): struct seccomp_notif is 80 bytes, and
# seccomp_notif_resp 24.
NOTIF_RECV, NOTIF_SIZE = 0xC0502100, 80

# Sockets only of the AF_UNIX family: honest code makes them (multiprocessing's pipes are socket
# pairs; glibc asks nscd for user names over one), and the jail's own network namespace keeps them
# inside it. Any other family (the network) kills. connect, bind, listen and accept act only on a
# socket the job could make, so they need no rule of their own.
UNIX_ONLY_X86_64 = {"socket": 41, "socketpair": 53}
AF_UNIX = 1

# Syscalls a candidate program never needs and an escaping one wants.
FORBIDDEN_SYSCALLS_X86_64 = {
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
    "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "mount_setattr": 442, "statmount": 457, "listmount": 458, "open_tree_attr": 467,
    # The template's read-only binds are the host's own files (the standard library, shared libraries,
    # /dev/null): watching them, a job would see other processes' file activity, its neighbours' too.
    "inotify_init": 253, "inotify_init1": 294, "inotify_add_watch": 254,
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
    # A filter of the job's own could answer a forbidden call first (ERRNO, TRAP and KILL_THREAD
    # outrank the listener's USER_NOTIF), so it would go unnamed: no filters but the jail's.
    "seccomp": 317,
}
# Calls a job may not make but honest code might try, refused with EPERM (the job goes on): moving off
# the CPU its worker was given (pool.worker_cpus), onto a neighbour's.
REFUSED_SYSCALLS_X86_64 = {"sched_setaffinity": 203}
# prctl is needed (Python calls it), but not to install a filter: PR_SET_SECCOMP as its first argument.
SYS_PRCTL, PR_SET_SECCOMP_ARG = 157, 22
# The newest call this filter was written against (futex_requeue, Linux 6.7). A newer one, never
# judged here, fails with ENOSYS, as on a kernel that lacks it (libc falls back where it can), so the
# filter stays closed on a kernel newer than its list: those calls have included ways to inspect mounts.
NEWEST_KNOWN_SYSCALL = 456


LD_W_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06  # classic BPF: ld [k]; jeq, jge, jset #k; ret #k
ARCH, NR, ARG0 = 4, 0, 16  # offsets in struct seccomp_data: arch, nr, args[0] (its low word on x86_64)
X32_BIT = 0x40000000


def _stmt(code: int, k: int) -> bytes:
    return struct.pack("HBBI", code, 0, 0, k)


def _jump(code: int, k: int, jt: int, jf: int) -> bytes:
    if not (0 <= jt < 256 and 0 <= jf < 256):
        raise ValueError(f"a jump of {max(jt, jf)} instructions does not fit classic BPF")
    return struct.pack("HBBI", code, jt, jf, k)


def syscall_actions(deny: int) -> dict[int, list[bytes]]:
    """What each syscall number that is not simply allowed comes to: its instructions (each ends in a
    return), with the syscall number loaded."""
    ret = {name: [_stmt(RET, action)] for name, action in (
        ("deny", deny), ("enosys", SECCOMP_RET_ERRNO | errno.ENOSYS), ("eperm", SECCOMP_RET_ERRNO | errno.EPERM))}

    def on_arg0(test: int, k: int, when: int, otherwise: int) -> list[bytes]:
        return [_stmt(LD_W_ABS, ARG0), _jump(test, k, 0, 1), _stmt(RET, when), _stmt(RET, otherwise)]

    tables = [
        {nr: ret["deny"] for nr in FORBIDDEN_SYSCALLS_X86_64.values()},
        {nr: ret["eperm"] for nr in REFUSED_SYSCALLS_X86_64.values()},
        {nr: on_arg0(JEQ, AF_UNIX, SECCOMP_RET_ALLOW, deny) for nr in UNIX_ONLY_X86_64.values()},
        {SYS_CLONE: on_arg0(JSET, NAMESPACE_FLAGS, deny, SECCOMP_RET_ALLOW)},  # clone's flags
        {SYS_PRCTL: on_arg0(JEQ, PR_SET_SECCOMP_ARG, deny, SECCOMP_RET_ALLOW)},  # prctl's option
        # clone3's flags sit behind a pointer BPF cannot read: ENOSYS makes libc fall back to clone.
        {SYS_CLONE3: ret["enosys"]},
    ]
    actions: dict[int, list[bytes]] = {}
    for table in tables:
        if twice := actions.keys() & table.keys():  # one number, one rule: none silently outranks another
            raise ValueError(f"syscall numbers {sorted(twice)} are in two of the filter's tables")
        actions.update(table)
    return actions


def compile_filter(notify: bool = False) -> bytes:
    """The filter: x86_64 only; forbidden syscalls and namespace-creating clones are held for the
    listener (`notify`) or kill; a number newer than any known fails with ENOSYS; the rest are allowed.

    The syscall number is found by binary search over ranges of numbers treated alike (some eight
    comparisons, not one per forbidden call): the kernel runs the filter once for every syscall number
    when it is installed, to learn which it always allows (those skip the filter from then on), and a
    filter is installed in every jail: the install took 131 us as a list of comparisons, 62 now."""
    deny = SECCOMP_RET_USER_NOTIF if notify else SECCOMP_RET_KILL_PROCESS
    allow, enosys = [_stmt(RET, SECCOMP_RET_ALLOW)], [_stmt(RET, SECCOMP_RET_ERRNO | errno.ENOSYS)]
    actions = syscall_actions(deny)
    # Ranges [start, next start) of the numbers below the x32 bit, each with one action; neighbours
    # with the same plain return are one range (acct, settimeofday, mount, ... iopl, ioperm: 163-173). A
    # forbidden call newer than the rest (statmount, listmount) is still named, not ENOSYS.
    ranges: list[tuple[int, list[bytes]]] = []
    for nr in range(max(NEWEST_KNOWN_SYSCALL, *actions) + 2):
        action = actions.get(nr, allow if nr <= NEWEST_KNOWN_SYSCALL else enosys)
        if not (ranges and ranges[-1][1] == action and len(action) == 1):
            ranges.append((nr, action))

    program = _Program()
    refused = program.tail(_stmt(RET, deny))
    program.add(_stmt(LD_W_ABS, ARCH))
    program.jump(JEQ, AUDIT_ARCH_X86_64, when_true=NEXT, when_false=refused)  # another ABI
    program.add(_stmt(LD_W_ABS, NR))
    program.jump(JGE, X32_BIT, when_true=refused, when_false=NEXT)  # x32 (or any number above)

    def search(part: list[tuple[int, list[bytes]]]) -> object:
        """Places the code that finds the range of the number among `part`, after what is placed so far;
        returns where it starts (a plain return's own place at the end)."""
        if len(part) == 1 and len(part[0][1]) == 1:
            return program.tail(part[0][1][0])
        start = object()
        program.place(start)
        if len(part) == 1:
            for instruction in part[0][1]:
                program.add(instruction)
            return start
        middle = len(part) // 2
        jump = program.jump(JGE, part[middle][0], when_true=None, when_false=None)
        jump[3] = search(part[:middle])
        jump[2] = search(part[middle:])
        return start

    search(ranges)  # (more than one range: its code starts right here)
    return program.assemble()


NEXT = object()  # a jump's target: the instruction after it


class _Program:
    """Classic BPF with forward jumps to labels (`place`; NEXT: the following instruction) and returns
    kept once at the end (`tail`); `assemble` works out each jump's distance."""

    def __init__(self):
        self.items: list = []  # bytes (an instruction), a jump [op, k, true, false], or a label (any object)
        self.tails: dict[bytes, object] = {}

    def add(self, instruction: bytes) -> None:
        self.items.append(instruction)

    def place(self, label: object) -> None:
        self.items.append(label)

    def tail(self, instruction: bytes) -> object:
        return self.tails.setdefault(instruction, object())

    def jump(self, op: int, k: int, when_true: object, when_false: object) -> list:
        """The jump, placed; its targets may be set later (items 2 and 3), before `assemble`."""
        jump = [op, k, when_true, when_false]
        self.items.append(jump)
        return jump

    def assemble(self) -> bytes:
        items = list(self.items)
        for instruction, label in self.tails.items():
            items += [label, instruction]
        address, where = 0, {}
        for item in items:
            if isinstance(item, (bytes, list)):
                address += 1
            else:
                where[id(item)] = address
        out: list[bytes] = []
        for item in items:
            if isinstance(item, bytes):
                out.append(item)
            elif isinstance(item, list):
                op, k, true, false = item
                here = len(out)
                out.append(_jump(op, k, *(0 if to is NEXT else where[id(to)] - here - 1 for to in (true, false))))
        return b"".join(out)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class Prepared:
    """The filter as the kernel takes it (a sock_fprog and the instructions it points at), built in the
    worker: a jail passes only a pointer to it. Built in each jail instead, the ctypes objects alone cost
    some 180 us of copy-on-write faults a job."""

    def __init__(self, notify: bool):
        self.notify = notify
        self.program = compile_filter(notify)
        self.buffer = ctypes.create_string_buffer(self.program, len(self.program))
        self.fprog = _SockFprog(len(self.program) // 8, ctypes.addressof(self.buffer))
        self.pointer = ctypes.c_void_p(ctypes.addressof(self.fprog))  # a pointer argument, not a C int


_prepared: Prepared | None = None  # built by prepare(), in the worker, before any job is forked
NOTIFY = False  # whether it reports forbidden calls to a listener (prepare)


def prepare(notify: bool) -> None:
    global _prepared, NOTIFY
    _prepared, NOTIFY = Prepared(notify), notify


def install(listener_to: int = -1) -> None:
    """Installs the filter on this process (irrevocably, and on every process it forks).

    With `listener_to` (a Unix socket to the supervisor), the filter reports to a new listener,
    which is sent there and closed here: no process of the job ever holds it, so none can answer
    for the supervisor.
    """
    notify = listener_to >= 0
    prepared = _prepared if _prepared is not None and _prepared.notify == notify else Prepared(notify)
    prctl(PR_SET_NO_NEW_PRIVS, 1, "prctl(NO_NEW_PRIVS)")
    if not notify:
        check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, prepared.pointer, 0, 0), "prctl(SECCOMP)")
        return
    listener = check(libc.syscall(SYS_SECCOMP, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER,
                                  prepared.pointer), "seccomp(NEW_LISTENER)")
    # Family and type given: the kernel is not asked for them (three calls fewer). Closed with it.
    channel = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET, 0, listener_to)
    try:
        send_fds(channel, b"L", [listener])
    finally:
        channel.close()
        os.close(listener)


def notify_supported() -> bool:
    """Whether this kernel gives a seccomp filter a listener (tried in a throwaway child)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            allow = struct.pack("HBBI", 0x06, 0, 0, SECCOMP_RET_ALLOW)
            buffer = ctypes.create_string_buffer(allow, len(allow))
            fprog = _SockFprog(1, ctypes.addressof(buffer))
            prctl(PR_SET_NO_NEW_PRIVS, 1, "prctl(NO_NEW_PRIVS)")
            check(libc.syscall(SYS_SECCOMP, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER,
                               ctypes.byref(fprog)), "seccomp(NEW_LISTENER)")
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


_NAMES = {nr: name for name, nr in {**FORBIDDEN_SYSCALLS_X86_64, **UNIX_ONLY_X86_64}.items()}


def held_call(listener: int) -> str | None:
    """The forbidden call a process of the job is held in, named; None if it went away meanwhile."""
    buffer = bytearray(NOTIF_SIZE)
    try:
        fcntl.ioctl(listener, NOTIF_RECV, buffer, True)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.EINTR):
            return None  # the process was killed between the poll and the read
        raise
    nr, arch = struct.unpack_from("iI", buffer, 16)
    family = struct.unpack_from("Q", buffer, 32)[0] & 0xFFFFFFFF  # args[0]: a socket's family
    if arch != AUDIT_ARCH_X86_64:
        return f"a call of another ABI (arch {arch:#x})"
    if nr >= 0x40000000:
        return f"an x32 call ({nr - 0x40000000})"
    if nr == SYS_CLONE:
        return "clone into new namespaces"
    if nr == SYS_PRCTL:
        return "prctl(PR_SET_SECCOMP)"
    name = _NAMES.get(nr, f"syscall {nr}")
    return f"{name} (address family {family})" if nr in UNIX_ONLY_X86_64.values() else name
