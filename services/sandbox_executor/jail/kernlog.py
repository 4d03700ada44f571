"""Seccomp kills the kernel recorded for a job: any process of the job, a forked child included.

A forbidden system call kills the process that made it (SIGSYS), and only its parent learns how it
ended; a program can fork a child to try a socket and carry on as if nothing happened. The kernel
makes an audit record of every seccomp kill (type 1326, AUDIT_SECCOMP) naming the uid that made
the call, and each sandbox worker runs its jobs under a uid of its own, one job at a time: the
records with that uid made while a job ran are that job's.

The supervisor (root, outside the jail) reads both places the kernel puts those records, marked
when the job starts and read when it ends: the audit netlink multicast group (every record, without
a rate limit, but only in the host's initial network namespace) and /dev/kmsg (everywhere, but the
kernel prints at most 10 audit records per 5 s there and drops the rest under a flood). A record
seen in both counts once. Where neither can be read, nothing is reported from here and the jail's
own signals still count.
"""
from __future__ import annotations

import errno
import os
import re
import select
import socket
import struct

from crucible.services.sandbox_executor.jail.seccomp import FORBIDDEN_SYSCALLS_X86_64, UNIX_ONLY_X86_64

NETLINK_AUDIT, AUDIT_NLGRP_READLOG, AUDIT_SECCOMP = 9, 1, 1326
_FIELDS = re.compile(rb"\buid=(\d+) .*?\bsig=(\d+) .*?\bsyscall=(\d+)")
_SERIAL = re.compile(rb"audit\(\d+\.\d+:(\d+)\)")
_NAMES = {nr: name for name, nr in {**FORBIDDEN_SYSCALLS_X86_64, **UNIX_ONLY_X86_64}.items()}
MAX_READS = 512  # at most this many reads per job


class KernelLog:
    def __init__(self):
        self.sock: socket.socket | None = None
        self.fd = -1
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_AUDIT)
            sock.bind((0, AUDIT_NLGRP_READLOG))
            sock.setblocking(False)
            self.sock = sock
        except (OSError, AttributeError):
            pass
        try:
            self.fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
            os.lseek(self.fd, 0, os.SEEK_END)  # only what is logged from now on
        except OSError:
            self.fd = -1

    GRACE_S = 0.003  # the kernel writes its records from a thread of its own: one made just now may lag

    def seccomp_kills(self, uid: int) -> list[str]:
        """The system calls (by name) whose seccomp kill was recorded for `uid` since the start."""
        records = (self._netlink() if self.sock is not None else []) + (self._kmsg() if self.fd >= 0 else [])
        if not records:
            watched = [f for f in (self.sock, self.fd if self.fd >= 0 else None) if f is not None]
            if watched and select.select(watched, [], [], self.GRACE_S)[0]:
                records = (self._netlink() if self.sock is not None else []) + (self._kmsg() if self.fd >= 0 else [])
        found, seen = [], set()
        for record in records:
            serial = _SERIAL.search(record)
            if serial:
                if serial.group(1) in seen:
                    continue
                seen.add(serial.group(1))
            match = _FIELDS.search(record)
            if match and int(match.group(1)) == uid:
                nr = int(match.group(3))
                found.append(_NAMES.get(nr, f"syscall {nr}"))
        return found

    def _netlink(self) -> list[bytes]:
        out = []
        for _ in range(MAX_READS):
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:  # the subscriber fell behind: what is queued still counts
                    continue
                break
            offset = 0
            while offset + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, offset)
                if length < 16:
                    break
                if kind == AUDIT_SECCOMP:
                    out.append(data[offset + 16: offset + length])
                offset += (length + 3) & ~3
        return out

    def _kmsg(self) -> list[bytes]:
        out = []
        for _ in range(MAX_READS):
            try:
                line = os.read(self.fd, 8192)
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records were overwritten before we read them: go on
                    continue
                break  # EAGAIN: nothing more
            if not line:
                break
            if b"type=1326" in line:
                out.append(line)
        return out

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
