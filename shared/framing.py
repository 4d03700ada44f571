"""Length-prefixed frames: a 4-byte big-endian length, then that many bytes.

Every pipe between two Crucible processes speaks this: the sandbox pool and its
jail workers, a worker and its supervisors, the jail's harness and its candidate
process, the verifier and its scoring processes. What a frame holds (JSON, plain
data, protobuf) is each channel's business; how frames are cut, and how a bad
length is refused, is decided here.

A frame's length is checked against the reading channel's limit before any of
it is read, so a corrupt or forged header cannot make a reader allocate or wait
for gigabytes. A stream that ends exactly between two frames is a clean close
(the reader gets None); one that ends inside a frame is an error (TruncatedFrame).

Standard library only (os and struct, nothing heavier): the sandbox's jail
worker loads this very file into an interpreter without site-packages (see
services/sandbox_executor/jail/__main__.py), and every module loaded there is
inherited by each job it forks.
"""
from __future__ import annotations

import os
import struct

HEADER = struct.Struct(">I")
HEADER_SIZE = HEADER.size
DEFAULT_LIMIT = 64 << 20  # no channel of ours carries more in one frame; a larger length is a broken stream
_CHUNK = 1 << 20
READ_AHEAD = 1 << 16  # what a Reader asks for at once: any frame a call channel usually carries


class FrameTooLarge(ValueError):
    """A frame longer than the channel's limit, refused before it is read or sent."""

    def __init__(self, size: int, limit: int):
        super().__init__(f"a frame of {size} bytes is over this channel's limit of {limit}")
        self.size, self.limit = size, limit


class TruncatedFrame(EOFError):
    """The stream ended inside a frame."""

    def __init__(self, got: int, wanted: int):
        super().__init__(f"stream closed with {wanted - got} of {wanted} bytes unread")
        self.got, self.wanted = got, wanted


def encode(data: bytes, limit: int = DEFAULT_LIMIT) -> bytes:
    """The frame carrying `data`: its length, then the bytes."""
    if len(data) > limit:
        raise FrameTooLarge(len(data), limit)
    return HEADER.pack(len(data)) + data


def decode_length(header: bytes, limit: int = DEFAULT_LIMIT) -> int:
    """The length a frame's header announces; FrameTooLarge past `limit`."""
    (size,) = HEADER.unpack(header)
    if size > limit:
        raise FrameTooLarge(size, limit)
    return size


def join(items: list[bytes], limit: int = DEFAULT_LIMIT) -> bytes:
    """Several payloads as the bytes of one frame (each framed inside it): one write, one wake-up of
    the reader, where a frame each would cost a round trip each."""
    return b"".join(encode(item, limit) for item in items)


def split(data: bytes, limit: int = DEFAULT_LIMIT) -> list[bytes]:
    """The payloads `join` put in `data`; TruncatedFrame if the last one is cut short."""
    items, at = [], 0
    while at < len(data):
        if len(data) - at < HEADER_SIZE:
            raise TruncatedFrame(len(data) - at, HEADER_SIZE)
        size = decode_length(data[at:at + HEADER_SIZE], limit)
        at += HEADER_SIZE
        if len(data) - at < size:
            raise TruncatedFrame(len(data) - at, size)
        items.append(data[at:at + size])
        at += size
    return items


# --- blocking file descriptors (the jail's processes, the scoring processes) ---------------------

def read_exact(fd: int, n: int) -> bytes:
    """Exactly `n` bytes from `fd`; TruncatedFrame if it closes first."""
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, _CHUNK))
        if not chunk:
            raise TruncatedFrame(n - left, n)
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class Reader:
    """Frames from a blocking stream, read ahead: a small frame costs one read, not two (its length, then
    its bytes), on a call-and-answer channel where every message is one. `read_some(n)` returns up to n
    bytes, b"" at the end of the stream. Bytes read past a frame are the start of the next one."""

    def __init__(self, read_some, limit: int = DEFAULT_LIMIT):
        self._read_some, self.limit = read_some, limit
        self._pending = b""

    def frame(self) -> bytes | None:
        """The next frame's bytes; None when the stream closed cleanly before it."""
        if not self._pending:
            self._pending = self._read_some(READ_AHEAD)
            if not self._pending:
                return None
        return self._take(decode_length(self._take(HEADER_SIZE), self.limit))

    def _take(self, n: int) -> bytes:
        if len(self._pending) < n:
            chunks, have = [self._pending], len(self._pending)
            while have < n:
                chunk = self._read_some(min(max(n - have, READ_AHEAD), _CHUNK))
                if not chunk:
                    raise TruncatedFrame(have, n)
                chunks.append(chunk)
                have += len(chunk)
            self._pending = b"".join(chunks)
        taken, self._pending = self._pending[:n], self._pending[n:]
        return taken


def read(fd: int, limit: int = DEFAULT_LIMIT) -> bytes | None:
    """The next frame's bytes; None when the stream closed cleanly before it."""
    first = os.read(fd, HEADER_SIZE)
    if not first:
        return None
    try:
        header = first + read_exact(fd, HEADER_SIZE - len(first))
    except TruncatedFrame:
        raise TruncatedFrame(len(first), HEADER_SIZE) from None
    return read_exact(fd, decode_length(header, limit))


def write(fd: int, data: bytes, limit: int = DEFAULT_LIMIT) -> None:
    """Writes one frame, all of it (a pipe may take a large one in several writes)."""
    frame = encode(data, limit)
    written = os.write(fd, frame)
    if written < len(frame):
        view = memoryview(frame)[written:]
        while view:
            view = view[os.write(fd, view):]


# --- asyncio streams (the services' side of a worker pool) ---------------------------------------

async def read_stream(reader, limit: int = DEFAULT_LIMIT) -> bytes | None:
    """The next frame from an asyncio.StreamReader; None when it closed cleanly before it.

    Written against `readexactly` alone, so this module need not import asyncio (whose
    IncompleteReadError is an EOFError carrying what was read as `partial`).
    """
    try:
        header = await reader.readexactly(HEADER_SIZE)
    except EOFError as exc:
        partial = getattr(exc, "partial", b"")
        if not partial:
            return None
        raise TruncatedFrame(len(partial), HEADER_SIZE) from None
    size = decode_length(header, limit)
    try:
        return await reader.readexactly(size)
    except EOFError as exc:
        raise TruncatedFrame(len(getattr(exc, "partial", b"")), size) from None
