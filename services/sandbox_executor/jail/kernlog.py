"""Seccomp kills the kernel logged for a job: any process of the job, a forked child included.

A forbidden system call kills the process that made it (SIGSYS), and only its parent learns how it
ended; a program can fork a child to try a socket and carry on as if nothing happened. The kernel
logs every seccomp kill as an audit record (type=1326) with the uid that made it, and each sandbox
worker runs its jobs under a uid of its own, one job at a time: the records with that uid logged
while a job ran are that job's. The supervisor (root, outside the jail) marks the log's end when
the job starts and reads what came after when it ends. Where the log cannot be read (no
/dev/kmsg, not root), nothing is reported from it and the jail's own signals still count.
"""
from __future__ import annotations

import errno
import os
import re

from crucible.services.sandbox_executor.jail.seccomp import FORBIDDEN_SYSCALLS_X86_64, UNIX_ONLY_X86_64

_RECORD = re.compile(rb"type=1326 .*?\buid=(\d+) .*?\bsig=(\d+) .*?\bsyscall=(\d+)")
_NAMES = {nr: name for name, nr in {**FORBIDDEN_SYSCALLS_X86_64, **UNIX_ONLY_X86_64}.items()}
MAX_RECORDS = 512  # read at most this many lines of the log per job


class KernelLog:
    def __init__(self, path: str = "/dev/kmsg"):
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            os.lseek(self.fd, 0, os.SEEK_END)  # only what is logged from now on
        except OSError:
            self.fd = -1

    def seccomp_kills(self, uid: int) -> list[str]:
        """The system calls (by name) whose seccomp kill was logged for `uid` since the mark."""
        found: list[str] = []
        if self.fd < 0:
            return found
        for _ in range(MAX_RECORDS):
            try:
                line = os.read(self.fd, 8192)
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records were overwritten before we read them: go on
                    continue
                break  # EAGAIN: nothing more
            if not line:
                break
            match = _RECORD.search(line)
            if match and int(match.group(1)) == uid:
                nr = int(match.group(3))
                found.append(_NAMES.get(nr, f"syscall {nr}"))
        return found

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
