"""HTTP bodies as ClickHouse reads and writes them: framing, compression, and the limits around both.

Requests arrive with a Content-Length or chunked, optionally compressed (Content-Encoding lz4, zstd,
gzip, deflate, or none). Every reader here has the same shape, `read(n) -> bytes` with b"" at the
end, never returns more than n bytes (so a 6 KB zstd bomb cannot inflate to gigabytes in one call),
and reports a malformed or truncated body as a `StoreError` the client can act on.

Responses are compressed whole (the store buffers a result before sending it), in one frame, which
is what clickhouse-connect's streaming decompressors expect.
"""
from __future__ import annotations

import gzip
import zlib
from typing import Protocol

import lz4.frame
from backports import zstd  # the stdlib-shaped zstd API (decompress(max_length), eof, needs_input)

from crucible.local.store.errors import (
    CANNOT_DECOMPRESS,
    CANNOT_READ_ALL_DATA,
    QUERY_IS_TOO_LARGE,
    UNKNOWN_COMPRESSION_METHOD,
    StoreError,
)

READ_SIZE = 64 * 1024
_MAX_CHUNK_LINE = 4096


class Reader(Protocol):
    def read(self, n: int) -> bytes: ...


class BytesReader:
    """A Reader over bytes already in memory."""

    def __init__(self, data: bytes):
        self._data = memoryview(data)
        self._pos = 0

    def read(self, n: int) -> bytes:
        chunk = self._data[self._pos:self._pos + n]
        self._pos += len(chunk)
        return bytes(chunk)


class ConcatReader:
    """Readers one after the other: the URL's query text, then the request body."""

    def __init__(self, *readers: Reader):
        self._readers = list(readers)

    def read(self, n: int) -> bytes:
        while self._readers:
            chunk = self._readers[0].read(n)
            if chunk:
                return chunk
            self._readers.pop(0)
        return b""


class LengthReader:
    """Exactly `length` bytes of a socket file; a client that sends fewer gets CANNOT_READ_ALL_DATA."""

    def __init__(self, raw, length: int):
        self._raw = raw
        self.remaining = length

    def read(self, n: int) -> bytes:
        if self.remaining <= 0:
            return b""
        chunk = self._raw.read(min(n, self.remaining))
        if not chunk:
            raise _truncated(f"the request body ended {self.remaining} bytes before its Content-Length")
        self.remaining -= len(chunk)
        return chunk

    @property
    def exhausted(self) -> bool:
        return self.remaining <= 0


class ChunkedReader:
    """Transfer-Encoding: chunked (clickhouse-connect streams inserts this way)."""

    def __init__(self, raw):
        self._raw = raw
        self._left = 0  # bytes left in the current chunk
        self.exhausted = False

    def _line(self) -> bytes:
        line = self._raw.readline(_MAX_CHUNK_LINE + 1)
        if not line:
            raise _truncated("the chunked request body ended before its last chunk")
        if len(line) > _MAX_CHUNK_LINE or not line.endswith(b"\n"):
            raise _bad_body("a chunk header line of the request body is too long or cut off")
        return line

    def read(self, n: int) -> bytes:
        if self.exhausted:
            return b""
        if self._left == 0:
            size_field = self._line().split(b";", 1)[0].strip()
            try:
                if not size_field or size_field.startswith((b"-", b"+")):
                    raise ValueError(size_field)
                self._left = int(size_field, 16)
            except ValueError:
                raise _bad_body(f"invalid chunk size {size_field[:32]!r} in the chunked request body") from None
            if self._left == 0:
                while self._line() not in (b"\r\n", b"\n"):  # trailers, ignored
                    pass
                self.exhausted = True
                return b""
        chunk = self._raw.read(min(n, self._left))
        if not chunk:
            raise _truncated("the chunked request body ended in the middle of a chunk")
        self._left -= len(chunk)
        if self._left == 0 and self._raw.read(2) not in (b"\r\n",):
            raise _bad_body("a chunk of the request body is not followed by CRLF")
        return chunk


class LimitReader:
    """Refuses to produce more than `limit` bytes: the cap on a decompressed request body."""

    def __init__(self, inner: Reader, limit: int, what: str):
        self._inner = inner
        self._left = limit
        self._limit = limit
        self._what = what

    def read(self, n: int) -> bytes:
        chunk = self._inner.read(min(n, self._left + 1))
        self._left -= len(chunk)
        if self._left < 0:
            raise StoreError(
                QUERY_IS_TOO_LARGE,
                f"{self._what} is larger than the store's limit of {self._limit} bytes; "
                "split it into smaller requests or restart the store with a larger --max-body-bytes",
            )
        return chunk


class _ZlibAdapter:
    """zlib's decompressobj behind the lz4/zstd interface (decompress(data, max_length), eof, needs_input)."""

    def __init__(self, wbits: int):
        self._obj = zlib.decompressobj(wbits)
        self._tail = b""
        # A call that filled max_length may have left output inside zlib even with no input left
        # over; the next call must then drain it before asking for more input.
        self._full = False

    @property
    def eof(self) -> bool:
        return self._obj.eof

    @property
    def needs_input(self) -> bool:
        return not self._tail and not self._obj.eof and not self._full

    @property
    def unused_data(self) -> bytes:
        return self._obj.unused_data

    def decompress(self, data: bytes, max_length: int) -> bytes:
        out = self._obj.decompress(self._tail + data, max_length)
        self._tail = self._obj.unconsumed_tail
        self._full = len(out) >= max_length
        return out


def _deflate_factory(first: bytes):
    # HTTP "deflate" is zlib-wrapped (RFC 9110), which is what ClickHouse sends; some clients send
    # a raw deflate stream instead, recognisable by the missing zlib header.
    if len(first) >= 2 and (first[0] & 0x0F) == 8 and ((first[0] << 8) | first[1]) % 31 == 0:
        return _ZlibAdapter(zlib.MAX_WBITS)
    return _ZlibAdapter(-zlib.MAX_WBITS)


_DECOMPRESSORS = {
    "lz4": lambda first: lz4.frame.LZ4FrameDecompressor(),
    "zstd": lambda first: zstd.ZstdDecompressor(),
    "gzip": lambda first: _ZlibAdapter(16 + zlib.MAX_WBITS),
    "x-gzip": lambda first: _ZlibAdapter(16 + zlib.MAX_WBITS),
    "deflate": _deflate_factory,
}
_DECOMPRESS_ERRORS = (RuntimeError, zlib.error, zstd.ZstdError, EOFError, ValueError, OSError)


class DecompressingReader:
    """Decompresses a stream of concatenated frames (lz4 and zstd: one per insert block; gzip members).

    A stream that stops inside a frame is an error, not a silent short read: a truncated body must
    never become a partial insert.
    """

    def __init__(self, inner: Reader, method: str):
        self._inner = inner
        self._method = method
        self._factory = _DECOMPRESSORS[method]
        self._dec = None
        self._pending = b""  # compressed bytes read but not yet fed
        self._done = False

    def read(self, n: int) -> bytes:
        try:
            return self._read(n)
        except StoreError:
            raise
        except _DECOMPRESS_ERRORS as ex:
            raise StoreError(
                CANNOT_DECOMPRESS,
                f"Cannot decompress the request body as {self._method} (Content-Encoding: {self._method}): {ex}",
                http_status=400,
            ) from None

    def _read(self, n: int) -> bytes:
        while not self._done:
            if self._dec is None:
                if not self._pending:
                    self._pending = self._inner.read(READ_SIZE)
                    if not self._pending:
                        self._done = True  # clean end between frames
                        break
                self._dec = self._factory(self._pending)
            if self._dec.eof:
                self._pending = (self._dec.unused_data or b"") + self._pending
                self._dec = None
                continue
            if self._dec.needs_input and not self._pending:
                self._pending = self._inner.read(READ_SIZE)
                if not self._pending:
                    raise EOFError("the compressed body ends in the middle of a frame")
            data, self._pending = (self._pending, b"") if self._dec.needs_input else (b"", self._pending)
            out = self._dec.decompress(data, n)
            if self._dec.eof:
                self._pending = (self._dec.unused_data or b"") + self._pending
                self._dec = None
            if out:
                return out
        return b""


def decoding_reader(body: Reader, content_encoding: str | None) -> Reader:
    """Wrap body in the decompressor Content-Encoding names; identity and none pass through."""
    method = (content_encoding or "").strip().lower()
    if method in ("", "identity", "none"):
        return body
    if method not in _DECOMPRESSORS:
        raise StoreError(
            UNKNOWN_COMPRESSION_METHOD,
            f"Unknown Content-Encoding '{content_encoding}'; the store accepts lz4, zstd, gzip, deflate or none",
            http_status=415,
        )
    return DecompressingReader(body, method)


# Response encodings the store can produce, in the order it prefers them when the client lists several
# with equal weight.
_RESPONSE_ENCODINGS = ("zstd", "lz4", "gzip", "deflate")


def choose_response_encoding(accept_encoding: str | None) -> str | None:
    """Pick the response compression from Accept-Encoding, honouring q=0; None means identity."""
    if not accept_encoding:
        return None
    offered: list[tuple[float, int, str]] = []
    for item in accept_encoding.split(","):
        name, _, params = item.strip().partition(";")
        name = name.strip().lower()
        q = 1.0
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if name in _RESPONSE_ENCODINGS and q > 0:
            offered.append((-q, _RESPONSE_ENCODINGS.index(name), name))
    return min(offered)[2] if offered else None


def compress(data: bytes, encoding: str, zlib_level: int = 3) -> bytes:
    """One whole response body, compressed as a single frame / member."""
    if encoding == "zstd":
        return zstd.compress(data)
    if encoding == "lz4":
        return lz4.frame.compress(data)
    if encoding == "gzip":
        return gzip.compress(data, compresslevel=zlib_level, mtime=0)
    if encoding == "deflate":
        return zlib.compress(data, zlib_level)
    raise ValueError(encoding)


def _truncated(what: str) -> StoreError:
    return StoreError(CANNOT_READ_ALL_DATA, f"Cannot read all data: {what}", http_status=400)


def _bad_body(what: str) -> StoreError:
    return StoreError(CANNOT_READ_ALL_DATA, f"Malformed request body: {what}", http_status=400)
