"""Local processes: free ports, liveness, and one way to stop them (SIGTERM, a deadline, SIGKILL)."""
from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterable


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # the largest glibc takes (half its 64 MiB heap) on 64-bit machines


def keep_freed_memory() -> bool:
    """Makes this process's malloc keep what it frees for its next allocations: one arena for every
    thread, freed memory never trimmed back to the system, and blocks up to 32 MiB from the heap rather
    than from a fresh mmap each. Call it before the process has a second thread (crucible/services
    does, as a service starts). False where the C library is not glibc (nothing is changed there).

    A service's work comes round again and again with the same sizes (a learner step's activations and
    gradients, a sampled batch). Run on whichever thread `asyncio.to_thread` picks, each thread had an
    arena of its own, and what one step freed went back to the system, to be faulted in again page by
    page by the next: the built-in recipe's learner took 4,000-50,000 page faults a step (17,000 on
    average) and up to three times a step's CPU (630 ms against 200). With this, 2,200-2,600 on average,
    nearly all in its first three steps, and 231-249 ms of learner CPU a step against 284-314
    (`bench/bench_pipeline.py --runs async`, seed 2, 20 steps, a step's faults counted in the learner)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # glibc's own: musl's mallopt does nothing
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    taken = [mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX), (_M_TRIM_THRESHOLD, 2**31 - 1))]
    return all(taken)  # each one asked for, whether or not another was refused


def loopback(host: str | None) -> bool:
    """Whether a host name or address is this machine's loopback (localhost, 127/8, ::1, bracketed or not)."""
    if not host:
        return False
    try:
        return host.lower() == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the OS picks it); good enough for tests and local runs."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` different ports that were free a moment ago. Each is held until all are chosen: ports
    asked for one after another can repeat (the OS hands a port it just had back again), and two
    services of one run were once given the same one."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def host_port(address: str) -> tuple[str, int]:
    """(host, port) of `address`: host:port, the first entry of a bootstrap list, or a URL."""
    from urllib.parse import urlparse

    parsed = urlparse(address if "://" in address else f"tcp://{address.split(',')[0].strip()}")
    return parsed.hostname or "127.0.0.1", parsed.port or (443 if parsed.scheme == "https" else 80)


def answers(address: str, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections at `address` (see host_port)."""
    try:
        with socket.create_connection(host_port(address), timeout=timeout):
            return True
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie child of ours is reaped and counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:  # not our child
        try:
            return ") Z" not in Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False


def stop_processes(processes: Iterable[subprocess.Popen | int], timeout: float = 30.0) -> None:
    """Stops processes together: SIGTERM to each, then one deadline, `timeout` seconds away, shared
    by all of them to leave; SIGKILL to any still running at it. Returns once every one is gone.

    A process is a Popen, or a PID when only that is known (a background service started by an
    earlier command, found through its PID file).
    """
    handles = [_ByPid(p) if isinstance(p, int) else p for p in processes]
    for handle in handles:
        if handle.poll() is None:
            handle.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for handle in handles:
        try:
            handle.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            handle.kill()
            handle.wait()


def terminate(pid: int, timeout: float = 30.0) -> None:
    """Stops one process known by its PID (see stop_processes)."""
    stop_processes([pid], timeout)


class _ByPid:
    """A process that may not be our child, with the part of Popen's interface stop_processes uses."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self) -> int | None:
        return None if pid_alive(self.pid) else 0  # its real status is not ours to read

    def send_signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while pid_alive(self.pid):
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.05)
        return 0


def read_pid(pid_file: Path, must_contain: bytes) -> int | None:
    """The PID in `pid_file` if that process runs and its command line contains `must_contain`.

    Checking the command line keeps a stale PID file from naming (and getting
    us to kill) an unrelated process that reused the number.
    """
    try:
        pid = int(pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if must_contain in cmdline and pid_alive(pid) else None
