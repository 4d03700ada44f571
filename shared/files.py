"""Files a user hands us, read with a clear error; folders that appear whole or not at all (written
under a temporary sibling name, then renamed into place)."""
from __future__ import annotations

import os
import secrets
import shutil
import stat
import uuid
from pathlib import Path


def staging(folder: Path) -> Path:
    """A fresh, empty temporary sibling of `folder` to write into (the name says which process owns it)."""
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    return tmp


def replace_folder(tmp: Path, folder: Path) -> Path:
    """Puts the finished `tmp` in place of `folder` (a reader sees the old folder or the new one, never half),
    durably: its files are on disk before the rename publishes them, and the rename is once this returns
    (a crash could leave a folder in place whose files were still empty)."""
    _sync_tree(tmp)
    if folder.exists():
        old = folder.parent / f".{folder.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        folder.rename(old)
        tmp.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(folder)
    sync(folder.parent)
    return folder


def _sync_tree(root: Path) -> None:
    for folder, _, names in os.walk(root):
        for name in names:
            sync(Path(folder) / name)
        sync(Path(folder))


def sync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SecretError(ValueError):
    """A secret file that must not be used; the text says why (never its contents)."""


def secret(path: Path, nbytes: int = 32) -> str:
    """The secret in `path` (hex), made there first if there is none: `nbytes` random bytes, 0600, written
    whole and fsynced before it has its name (a crash never leaves an empty secret behind it; whoever
    links first wins, everyone reads the winner's). SecretError for a file others may read or write, a
    link, or one shorter than `nbytes` bytes of hex (an empty key MACs with the empty key)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(nbytes))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        sync(path.parent)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise SecretError(f"{path} cannot be read ({exc.strerror}: a link is not taken; remove it for a new "
                          "one)") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"{path} is not a regular file")
        if st.st_mode & 0o077:
            raise SecretError(f"{path} may be read or written by others (mode {stat.S_IMODE(st.st_mode):o}): "
                              "chmod 600 it, or remove it for a new one")
        text = f.read(4 * nbytes + 64).strip()
    try:
        if len(bytes.fromhex(text)) >= nbytes:
            return text
    except ValueError:
        pass
    raise SecretError(f"{path} is damaged (not {nbytes} or more bytes of hex): remove it for a new one, and "
                      "restart every service of the deployment")


class Unreadable(ValueError):
    """A user's file that cannot be read as text; the text says why (no traceback reaches the user)."""


MAX_TEXT_BYTES = 256 << 20  # a recipe or a file of tasks; /dev/zero read on until the process was killed


def read_text(path: Path | str) -> str:
    """A user's text file (a recipe, a task file) as UTF-8; Unreadable saying why it cannot be. Only a
    regular file of at most MAX_TEXT_BYTES: a device never ends and a FIFO may never open."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO opens at once, to be refused
    except OSError as exc:
        raise Unreadable(exc.strerror or str(exc)) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Unreadable("not a regular file (a folder, device or pipe)")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(MAX_TEXT_BYTES + 1)
        except OSError as exc:
            raise Unreadable(exc.strerror or str(exc)) from None
    return decode_text(_within(data))


def read_stdin(stream) -> str:
    """What a user piped in (a binary stream), as read_text reads a file."""
    return decode_text(_within(stream.read(MAX_TEXT_BYTES + 1)))


def _within(data: bytes) -> bytes:
    if len(data) > MAX_TEXT_BYTES:
        raise Unreadable(f"larger than {MAX_TEXT_BYTES >> 20} MiB")
    return data


def decode_text(data: bytes) -> str:
    """Bytes a user handed us (a file's, stdin's) as UTF-8 text; Unreadable naming the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Unreadable(f"not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start})") from None
