"""One cgroup slot of a worker (v1 or v2), as the jail sees it: join it, read its counters, empty it.

The pool creates the slots and writes their limits (pool.py, make_cgroups);
a host without cgroups gives empty slots, on which everything here is a no-op.
"""
from __future__ import annotations

import os
import signal
import time

# Tasks a slot's pids.max allows beyond the job's own `processes`: the jail's pid 1 and its helpers.
JAIL_OWN_TASKS = 8


class Cgroups:
    """A slot's directories by controller ("unified" for v2); empty when the host has none.

    With `keep_open` (a worker's own slots, read and written several times a job), each control
    file is opened once and then read and written in place (pread/pwrite at offset 0, which the
    kernel answers afresh each time), instead of an open, a Python file object and a close per
    access. Leaves about to be removed are read the plain way."""

    def __init__(self, paths: dict, keep_open: bool = False):
        self.paths = paths  # controller -> directory
        self.keep_open = keep_open
        self._fds: dict[tuple[str, str], int] = {}

    def _read(self, path: str, name: str) -> bytes:
        if not self.keep_open:
            with open(os.path.join(path, name), "rb") as f:
                return f.read()
        fd = self._fd(path, name, os.O_RDONLY)
        chunks, offset = [], 0
        while True:
            chunk = os.pread(fd, 65536, offset)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            offset += len(chunk)

    def _write(self, path: str, name: str, data: bytes) -> None:
        if not self.keep_open:
            with open(os.path.join(path, name), "wb") as f:
                f.write(data)
            return
        os.pwrite(self._fd(path, name, os.O_WRONLY), data, 0)

    def _fd(self, path: str, name: str, mode: int) -> int:
        key = (os.path.join(path, name), "w" if mode == os.O_WRONLY else "r")
        fd = self._fds.get(key)
        if fd is None:
            fd = self._fds[key] = os.open(key[0], mode | os.O_CLOEXEC)
        return fd

    def attach(self, pid: int) -> None:
        for path in self.paths.values():
            self._write(path, "cgroup.procs", str(pid).encode())

    def pids(self) -> list[int]:
        path = self.paths.get("pids") or self.paths.get("unified") or self.paths.get("memory")
        if not path:
            return []
        try:
            return [int(x) for x in self._read(path, "cgroup.procs").split()]
        except OSError:
            return []

    def memory_events(self) -> int:
        """How many times the memory limit was hit (v1 failcnt / v2 max+oom events)."""
        try:
            if "memory" in self.paths:
                return int(self._read(self.paths["memory"], "memory.failcnt"))
            if "unified" in self.paths:
                fields = dict(line.split() for line in self._read(self.paths["unified"], "memory.events").splitlines())
                return int(fields.get(b"oom_kill", 0)) + int(fields.get(b"max", 0))
        except (OSError, ValueError):
            pass
        return 0

    def pids_events(self) -> int:
        """How many times a fork or clone was refused at the slot's pids.max (a counter that only grows)."""
        path = self.paths.get("pids") or self.paths.get("unified")
        if not path:
            return 0
        try:
            return int(dict(line.split() for line in self._read(path, "pids.events").splitlines()).get(b"max", 0))
        except (OSError, ValueError):
            return 0

    def begin_usage(self) -> dict | None:
        """At a job's start: the slot's CPU counters, with its peak-memory mark reset; None where the
        slot cannot account for the job (no cgroups, or a v2 host: its memory.peak cannot be reset
        for a reused slot; rusage is reported there instead)."""
        cpu = self._cpu_ns()
        memory = self.paths.get("memory")
        if cpu is None or memory is None:
            return None
        try:
            self._write(memory, "memory.max_usage_in_bytes", b"0")
        except OSError:
            return None
        return {"cpu": cpu}

    def usage_since(self, begun: dict | None) -> tuple[float, float, int] | None:
        """(user CPU s, system CPU s, peak memory bytes) of everything the slot ran since `begun`:
        every process and thread of the job, the ones it forked and never waited for included."""
        if begun is None:
            return None
        cpu = self._cpu_ns()
        try:
            peak = int(self._read(self.paths["memory"], "memory.max_usage_in_bytes"))
        except (OSError, ValueError):
            return None
        if cpu is None:
            return None
        # cpuacct.usage is exact (the scheduler's nanoseconds); its user/system split is sampled at
        # timer ticks, so a job of a few milliseconds may show none: split the exact total by it.
        total, user, system = (now - then for now, then in zip(cpu, begun["cpu"]))
        user_s = total * user / (user + system) if user + system > 0 else total
        return user_s / 1e9, (total - user_s) / 1e9, peak

    def _cpu_ns(self) -> tuple[int, int, int] | None:
        """(total, user, system) CPU nanoseconds the slot has used (cgroup v1 cpuacct)."""
        path = self.paths.get("cpuacct")
        if not path:
            return None
        try:
            values = [int(self._read(path, name)) for name in ("cpuacct.usage", "cpuacct.usage_user", "cpuacct.usage_sys")]
            return values[0], values[1], values[2]
        except (OSError, ValueError):
            return None

    def reset_memory_events(self) -> int:
        """Zeroes the v1 counter; returns the count now (cgroup v2 counters only grow: compare to it)."""
        if "memory" in self.paths:
            try:
                self._write(self.paths["memory"], "memory.failcnt", b"0")
            except OSError:
                pass
        return self.memory_events()

    def reap(self) -> int:
        """Kills anything still in the slot (belt and braces after the pid namespace ends); how many."""
        killed = 0
        for _ in range(200):
            pids = self.pids()
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
