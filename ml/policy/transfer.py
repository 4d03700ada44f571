"""Checkpoint folders beyond one filesystem: a content hash, fetching from any fsspec URI, publishing to one.

A PolicyVersion names its checkpoint by URI (file:// or a plain path by default; s3://, gs://,
memory:// ... through fsspec, with options from settings.checkpoint_storage_options) and carries
`content_hash` of the folder, which a generator checks after fetching and before loading.

What the hash covers: every regular file under the folder (subfolders included), in the order of
their relative POSIX paths, each as its path, its size and its bytes. The only files left out are
LEARNER_ONLY: the optimizer state (`optimizer.pt`, or FSDP's folder of shards `optimizer/`), which a
resuming learner reads and sampling never does; it is two to three times the size of the weights,
so it is neither hashed nor published nor fetched.
The same bytes under the same names give the same hash wherever the folder lies.
"""
from __future__ import annotations

import hashlib
import os
import posixpath
import re
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import unquote, urlparse

# = crucible.services.learner.checkpoints.OPTIMIZER_FILE, OPTIMIZER_SHARDS (a file, or a folder and all in it)
LEARNER_ONLY = frozenset({"optimizer.pt", "optimizer"})
CHUNK = 1024 * 1024  # read and hashed a chunk at a time: memory stays flat whatever the size
_LOCAL_SCHEMES = ("", "file", "local")


class ChecksumMismatch(ValueError):
    """A checkpoint's files do not hash to the value its PolicyVersion announced."""


def is_local(uri: str | os.PathLike) -> bool:
    """A plain path, or a file:// (local://) URI: read where it lies, nothing to fetch."""
    return isinstance(uri, os.PathLike) or urlparse(str(uri)).scheme in _LOCAL_SCHEMES


def local_path(uri: str | os.PathLike) -> Path:
    """The folder a file:// URI, a local:// URI or a plain path names."""
    if isinstance(uri, os.PathLike):
        return Path(uri)
    parsed = urlparse(uri)
    if parsed.scheme in ("file", "local"):
        return Path(unquote(parsed.path))
    return Path(uri)


def learner_only(rel: str) -> bool:
    """Whether the file at relative POSIX path `rel` of a checkpoint is the learner's alone."""
    return rel.split("/", 1)[0] in LEARNER_ONLY


def _files(folder: Path) -> list[tuple[str, Path]]:
    """(relative POSIX path, path) of every file that counts, in a stable order."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames.sort()
        for name in filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(folder).as_posix()
            if learner_only(rel) or not path.is_file():
                continue
            out.append((rel, path))
    return sorted(out)


def content_hash(folder: str | os.PathLike) -> str:
    """sha256 (hex) of the folder's files: each one's relative path, size and bytes, read in chunks."""
    folder = local_path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    for rel, path in _files(folder):
        name = rel.encode("utf-8")
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            digest.update(b"F" + len(name).to_bytes(8, "big") + name + size.to_bytes(8, "big"))
            read = 0
            while n := f.readinto(buffer):
                digest.update(view[:n])
                read += n
            if read != size:
                raise OSError(f"{path} changed while it was hashed ({read} bytes read, {size} expected)")
    return digest.hexdigest()


def _filesystem(uri: str, storage_options: Mapping[str, str] | None):
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri, **dict(storage_options or {}))
    return fs, path.rstrip("/")


def _safe_name(uri: str) -> str:
    tail = re.sub(r"[^A-Za-z0-9._-]+", "_", uri.rstrip("/").rsplit("/", 1)[-1])[:40] or "checkpoint"
    return f"{tail}-{hashlib.sha256(uri.encode()).hexdigest()[:16]}"


def fetch(uri: str, cache_dir: str | os.PathLike, storage_options: Mapping[str, str] | None = None, *,
          sha256: str | None = None, keep: int = 4) -> Path:
    """A local folder holding the checkpoint at `uri`.

    Local paths and file:// URIs: the folder itself. Any other fsspec URI: the remote folder is
    copied once into cache_dir/<sha256> (or a safe name made from the URI when no hash is given),
    written under a temporary name and renamed into place, so a folder in the cache is complete;
    later calls return it without reading the remote. The cache keeps the `keep` newest folders.
    The caller checks the hash (see `verify`).
    """
    if is_local(uri):
        return local_path(uri)
    cache_dir = Path(cache_dir)
    target = cache_dir / (sha256 if sha256 and re.fullmatch(r"[0-9a-f]{64}", sha256) else _safe_name(uri))
    if target.is_dir():
        os.utime(target)  # recently used: pruned last
        return target
    fs, root = _filesystem(uri, storage_options)
    if not fs.isdir(root):
        raise FileNotFoundError(f"checkpoint {uri} does not exist (no folder there)")
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        for remote in sorted(fs.find(root)):
            rel = posixpath.relpath(remote.rstrip("/"), root)
            if learner_only(rel) or rel.startswith("..") or posixpath.isabs(rel):
                continue
            local = tmp.joinpath(*rel.split("/"))
            local.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(remote, str(local))
        tmp.mkdir(parents=True, exist_ok=True)  # an empty remote folder is still a (failing) checkpoint
        try:
            tmp.rename(target)
        except OSError:  # another fetcher put it there first
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _prune(cache_dir, keep, target)
    return target


def _prune(cache_dir: Path, keep: int, current: Path) -> None:
    folders = sorted((p for p in cache_dir.iterdir() if p.is_dir() and not p.name.startswith(".")),
                     key=lambda p: p.stat().st_mtime)
    for old in folders[:-keep] if keep > 0 else []:
        if old != current:
            shutil.rmtree(old, ignore_errors=True)


def verify(uri: str, sha256: str, cache_dir: str | os.PathLike,
           storage_options: Mapping[str, str] | None = None) -> Path:
    """The fetched local folder of `uri`, once its content hash equals `sha256`; ChecksumMismatch if not.

    A cached copy that does not match is removed and fetched again once (a damaged cache is not a
    tampered checkpoint); a local folder is hashed where it lies.
    """
    if not sha256:
        raise ChecksumMismatch(f"checkpoint {uri} comes with no checkpoint_sha256: it cannot be verified")
    folder = fetch(uri, cache_dir, storage_options, sha256=sha256)
    actual = content_hash(folder)
    if actual != sha256 and not is_local(uri):
        shutil.rmtree(folder, ignore_errors=True)
        folder = fetch(uri, cache_dir, storage_options, sha256=sha256)
        actual = content_hash(folder)
    if actual != sha256:
        if not is_local(uri):
            shutil.rmtree(folder, ignore_errors=True)
        raise ChecksumMismatch(f"checkpoint {uri} does not match its checkpoint_sha256: "
                               f"announced {sha256}, its files hash to {actual}")
    return folder


def join(base_uri: str, *parts: str) -> str:
    """`base_uri` with path parts appended ('s3://b/ckpt' + 'run' -> 's3://b/ckpt/run')."""
    return "/".join([base_uri.rstrip("/"), *(p.strip("/") for p in parts)])


def publish(folder: str | os.PathLike, base_uri: str, storage_options: Mapping[str, str] | None = None) -> str:
    """Copies the checkpoint folder to base_uri/<folder name> (any fsspec URI) and returns that URI.

    Files in LEARNER_ONLY stay behind. An existing copy there is overwritten file by file; the
    PolicyVersion naming it is sent only after this returns, and readers check the hash anyway.
    """
    folder = local_path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    uri = join(base_uri, folder.name)
    fs, root = _filesystem(uri, storage_options)
    fs.makedirs(root, exist_ok=True)
    for rel, path in _files(folder):
        if "/" in rel:
            fs.makedirs(posixpath.join(root, posixpath.dirname(rel)), exist_ok=True)
        fs.put_file(str(path), posixpath.join(root, rel))
    return uri



VERSION_FOLDER = re.compile(r"v(\d{6,})")  # a version's checkpoint folder: v000123 (the learner's and its copies')


def version_number(name: str) -> int | None:
    """The version a folder named `name` holds (v000123: 123), or None for any other name."""
    m = VERSION_FOLDER.fullmatch(name)
    return int(m.group(1)) if m else None


def prune(base_uri: str, below: int, storage_options: Mapping[str, str] | None = None) -> list[str]:
    """Removes the version folders under base_uri numbered below `below` (the oldest version the learner
    keeps: its own pruning, mirrored; the copies published there were never removed, and a run filled its
    bucket); returns their names. Anything else there is left alone."""
    fs, root = _filesystem(base_uri, storage_options)
    if not fs.isdir(root):
        return []
    gone = []
    for entry in fs.ls(root, detail=False):
        name = posixpath.basename(entry.rstrip("/"))
        number = version_number(name)
        if number is not None and number < below:
            fs.rm(entry, recursive=True)
            gone.append(name)
    return gone
