"""Start, wait for, and stop a store process from Python (services, tests, benchmarks).

Kept apart from the server module so that launching a store never imports chDB into the caller.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from crucible.shared.procs import free_port, stop_processes  # noqa: F401 (free_port: callers import it from here)



def spawn_store(
    data_dir: str | os.PathLike,
    host: str = "127.0.0.1",
    port: int = 8123,
    log_path: str | os.PathLike | None = None,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """Start `python -m crucible.local.store.server` on data_dir; returns at once (see wait_ready).

    With log_path, the store's stdout and stderr are appended to that file (the path is kept on the
    returned object as `log_path` so wait_ready can quote it); otherwise they go to ours.
    """
    cmd = [sys.executable, "-m", "crucible.local.store.server", "--data", str(data_dir), "--host", host, "--port", str(port)]
    cmd += extra_args or []
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    log_file = None
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        log_file = open(log_path, "ab")
    try:
        proc = subprocess.Popen(
            # Its own data folder as the working directory: whatever the engine writes lands there.
            cmd, cwd=str(data_dir), stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
            env={**os.environ, **(env or {})},  # credentials go here, never on the command line
        )
    finally:
        if log_file is not None:
            log_file.close()  # the child has its own copy of the descriptor
    proc.log_path = Path(log_path) if log_path is not None else None  # type: ignore[attr-defined]
    proc.url = f"http://{host}:{port}"  # type: ignore[attr-defined]
    return proc


def log_tail(proc: subprocess.Popen | None, lines: int = 30) -> str:
    """The last lines of a store's log, for error messages ('' when it logs to our stderr)."""
    path = getattr(proc, "log_path", None)
    if not path:
        return ""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def ping(url: str, timeout: float = 2.0) -> bool:
    """True if a ClickHouse HTTP endpoint (the store or a server) answers /ping with Ok."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc.rpartition("@")[2]  # /ping needs no credentials
        ping_url = urlunsplit((parts.scheme, netloc, parts.path.rstrip("/") + "/ping", "", ""))
        with urllib.request.urlopen(ping_url, timeout=timeout) as response:
            return response.status == 200 and response.read().startswith(b"Ok.")
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_ready(url: str, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    """Poll url/ping until it answers; fail fast, with the log tail, if proc exits first."""
    deadline = time.monotonic() + timeout
    while True:
        if ping(url, timeout=1.0):
            return
        if proc is not None and proc.poll() is not None:
            tail = log_tail(proc)
            raise RuntimeError(
                f"the store process for {url} exited with status {proc.returncode} before it was ready"
                + (f"; last log lines ({proc.log_path}):\n{tail}" if tail else "")  # type: ignore[attr-defined]
            )
        if time.monotonic() >= deadline:
            tail = log_tail(proc)
            raise TimeoutError(
                f"the store at {url} did not answer /ping within {timeout:.0f} s"
                + (f"; last log lines:\n{tail}" if tail else "")
            )
        time.sleep(0.1)


def stop_store(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """Stops a store process (SIGTERM, then SIGKILL after `timeout`); returns its exit status."""
    stop_processes([proc], timeout)
    return proc.returncode
