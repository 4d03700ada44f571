"""One store process per data directory, enforced with an exclusive flock that names its owner.

chDB refuses a second engine on the same directory too, but with an error that does not say who
holds it. The store takes this lock before it opens chDB, so a second store fails at once with a
message naming the directory, the PID that owns it, and what to do about it. The kernel drops the
lock when the owner dies, however it dies, so a stale lock file never blocks a restart.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_NAME = ".crucible-store.lock"


class DataDirLocked(RuntimeError):
    """Another live process owns the data directory."""

    def __init__(self, data_dir: Path, owner_pid: int | None):
        self.data_dir = data_dir
        self.owner_pid = owner_pid
        owner = f"process {owner_pid}" if owner_pid else "another process (its PID is not recorded)"
        hint = f"stop it (kill {owner_pid}) or " if owner_pid else "stop it or "
        super().__init__(
            f"the store data directory {data_dir} is already in use by {owner}; "
            f"{hint}start this store with a different --data directory"
        )


class DataDirLock:
    """Exclusive, non-blocking ownership of a data directory for the life of this process."""

    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir)
        self.path = self.data_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock and write our PID into it; raise DataDirLocked if someone else holds it."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _read_pid(fd)
            os.close(fd)
            raise DataDirLocked(self.data_dir, owner) from None
        except BaseException:
            os.close(fd)
            raise
        # Only the holder writes, so a reader that lost the race sees a whole PID or an empty file.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        """Clear our PID and drop the lock. The file stays: unlinking it would let two processes
        lock two different inodes of the same path."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DataDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() else None
    except OSError:
        return None
