"""Background processes started by PID file: liveness and a clean stop."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path


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


def terminate(pid: int, timeout: float = 30.0) -> None:
    """SIGTERM, then SIGKILL after `timeout` seconds; returns once the process is gone."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.05)
    if pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
        while pid_alive(pid):
            time.sleep(0.05)


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
