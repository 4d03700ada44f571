"""The Linux interface the jail needs and the standard library lacks: flag numbers and libc calls.

Numbers are x86_64's where they differ by architecture (the seccomp filter is
written for x86_64 only; isolation.py reports seccomp missing elsewhere).
"""
from __future__ import annotations

import _socket
import ctypes
import os
import struct

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWCGROUP = 0x10000000, 0x20000000, 0x40000000, 0x02000000
NAMESPACE_FLAGS = (CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
                   | CLONE_NEWCGROUP)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 4, 38, 22
SYS_CLONE, SYS_PIVOT_ROOT, SYS_CLONE3 = 56, 155, 435

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.unshare.argtypes = [ctypes.c_int]
libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
libc.syscall.restype = ctypes.c_long
libc.sched_getcpu.argtypes = []


def check(result: int, what: str) -> int:
    """Raises OSError (with errno's text) when a libc call returned -1."""
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    check(libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(), flags,
                     data and data.encode()), f"mount {source} on {target}")


def unshare(flags: int, what: str = "unshare") -> None:
    check(libc.unshare(flags), what)


def setns(fd: int, nstype: int, what: str = "setns") -> None:
    check(libc.setns(fd, nstype), what)


def pivot_root(new_root: bytes, put_old: bytes) -> None:
    check(libc.syscall(SYS_PIVOT_ROOT, new_root, put_old), "pivot_root")


def umount_detached(target: bytes) -> None:
    check(libc.umount2(target, MNT_DETACH), f"umount {target.decode()}")


def prctl(option: int, arg: int, what: str) -> None:
    check(libc.prctl(option, arg, 0, 0, 0), what)


def set_hostname(name: bytes) -> None:
    libc.sethostname(name, len(name))


# Descriptor passing (SCM_RIGHTS) on the C-level sockets: what socket.send_fds and socket.recv_fds do,
# without importing the socket module into the worker before its zygote is forked. Its enums of every
# address family, socket kind and flag took ~0.45 MB that every jail's fork copied into its page
# tables (see pool.PRELOAD).
_INT = struct.calcsize("i")


def send_fds(sock: _socket.socket, data: bytes, fds: list[int]) -> None:
    """Sends `data` with the descriptors `fds` on a Unix socket."""
    sock.sendmsg([data], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))])


def recv_fds(sock: _socket.socket, size: int, max_fds: int) -> tuple[bytes, list[int]]:
    """One message of at most `size` bytes and the descriptors that came with it (at most `max_fds`)."""
    data, ancillary, _, _ = sock.recvmsg(size, _socket.CMSG_LEN(max_fds * _INT))
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds += struct.unpack(f"{len(payload) // _INT}i", payload[:len(payload) - len(payload) % _INT])
    return data, fds


def release_free_heap() -> None:
    """Gives the C heap's free pages back to the kernel (glibc's malloc_trim: the top of the heap, and
    free chunks within it, which stay mapped otherwise). What a process maps but no longer uses is
    still copied into every fork's page tables."""
    try:
        libc.malloc_trim(0)
    except AttributeError:  # not glibc: nothing to give back this way
        pass


def current_cpu() -> int:
    """The CPU the calling thread runs on (-1 where the kernel cannot say)."""
    return libc.sched_getcpu()
