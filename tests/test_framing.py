"""crucible.shared.framing: frames survive a pipe whole; a cut or oversized frame is refused."""
from __future__ import annotations

import asyncio
import os
import threading

import pytest

from crucible.shared import framing


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


def frames_of(kind: str, fd: int, limit: int = framing.DEFAULT_LIMIT):
    """The next-frame function of each way to read frames from a descriptor: `read` (exactly a frame's
    bytes) and a `Reader` (reading ahead, one per stream)."""
    if kind == "read":
        return lambda: framing.read(fd, limit)
    return framing.Reader(lambda n: os.read(fd, n), limit).frame


READS = ["read", "Reader"]


@pytest.mark.parametrize("kind", READS)
def test_round_trip_through_a_pipe(pipe, kind):
    r, w = pipe
    # The third is larger than a Reader reads ahead, the last larger than a pipe holds.
    frames = [b"", b"x", bytes(range(256)) * 400, os.urandom(3 << 20), b"y" * 5]
    next_frame = frames_of(kind, r)

    def writer():
        for frame in frames:
            framing.write(w, frame)
        os.close(w)

    thread = threading.Thread(target=writer)
    thread.start()
    received = [next_frame() for _ in frames]
    thread.join()
    assert received == frames
    assert next_frame() is None  # closed between frames: a clean end, not an error


def test_a_reader_takes_frames_that_arrive_together_and_split(pipe):
    r, w = pipe
    frames = [b"first", b"", b"third" * 3]
    joined = b"".join(framing.encode(f) for f in frames)
    os.write(w, joined[:7])  # the first header and a byte, then the rest with the others in one write
    reads = []
    reader = framing.Reader(lambda n: reads.append(n) or os.read(r, n))

    def rest():
        os.write(w, joined[7:])
        os.close(w)

    thread = threading.Thread(target=rest)
    thread.start()
    received = [reader.frame(), reader.frame(), reader.frame(), reader.frame()]
    thread.join()
    assert received == [*frames, None]
    assert len(reads) <= 4  # the rest came in one read (or two, split by the pipe), then the end


def test_encode_is_a_big_endian_length_then_the_bytes():
    assert framing.encode(b"abc") == b"\x00\x00\x00\x03abc"
    assert framing.decode_length(b"\x00\x00\x01\x00") == 256


def test_joined_payloads_split_back_and_a_cut_one_is_refused():
    items = [b"", b"a", bytes(range(256)) * 3, b"\x00\x00\x00\x09"]  # the last looks like a header
    joined = framing.join(items)
    assert framing.split(joined) == items and framing.split(b"") == []
    for cut in (2, 6, 8, 100, len(joined) - 1):  # inside a header, inside a payload, one byte short
        with pytest.raises(framing.TruncatedFrame):
            framing.split(joined[:cut])
    with pytest.raises(framing.FrameTooLarge):
        framing.split(framing.join([b"x" * 100]), limit=10)


@pytest.mark.parametrize("kind", READS)
def test_stream_closed_inside_a_frame_is_truncated(pipe, kind):
    r, w = pipe
    os.write(w, framing.encode(b"0123456789")[:-3])
    os.close(w)
    with pytest.raises(framing.TruncatedFrame) as err:
        frames_of(kind, r)()
    assert (err.value.got, err.value.wanted) == (7, 10)
    assert isinstance(err.value, EOFError)


@pytest.mark.parametrize("kind", READS)
def test_stream_closed_inside_a_header_is_truncated(pipe, kind):
    r, w = pipe
    os.write(w, b"\x00\x00")
    os.close(w)
    with pytest.raises(framing.TruncatedFrame):
        frames_of(kind, r)()


@pytest.mark.parametrize("kind", READS)
def test_oversized_frame_is_refused_before_it_is_read(pipe, kind):
    r, w = pipe
    os.write(w, framing.HEADER.pack(1 << 30) + b"only the start")
    asked = []
    next_frame = frames_of(kind, r, limit=1 << 20) if kind == "read" else \
        framing.Reader(lambda n: asked.append(n) or os.read(r, n), limit=1 << 20).frame
    with pytest.raises(framing.FrameTooLarge) as err:
        next_frame()
    assert (err.value.size, err.value.limit) == (1 << 30, 1 << 20)
    if kind == "read":
        assert os.read(r, 100) == b"only the start"  # nothing of the body was consumed
    else:
        assert asked == [framing.READ_AHEAD]  # one read ahead, no wait for the gigabyte announced


def test_oversized_frame_is_refused_before_it_is_written(pipe):
    r, w = pipe
    with pytest.raises(framing.FrameTooLarge):
        framing.write(w, b"x" * 11, limit=10)
    framing.write(w, b"x" * 10, limit=10)
    assert framing.read(r, limit=10) == b"x" * 10  # the refused frame left nothing in the pipe


def test_the_default_limit_refuses_a_corrupt_length():
    with pytest.raises(framing.FrameTooLarge):
        framing.decode_length(b"\xff\xff\xff\xff")


async def test_asyncio_stream_round_trip_and_clean_end():
    reader = asyncio.StreamReader()
    reader.feed_data(framing.encode(b"one") + framing.encode(b"") + framing.encode(b"three"))
    reader.feed_eof()
    assert [await framing.read_stream(reader) for _ in range(3)] == [b"one", b"", b"three"]
    assert await framing.read_stream(reader) is None


@pytest.mark.parametrize("cut", [2, 6])  # inside the header, inside the body
async def test_asyncio_stream_closed_inside_a_frame_is_truncated(cut):
    reader = asyncio.StreamReader()
    reader.feed_data(framing.encode(b"0123456789")[:cut])
    reader.feed_eof()
    with pytest.raises(framing.TruncatedFrame):
        await framing.read_stream(reader)


async def test_asyncio_stream_oversized_frame_is_refused():
    reader = asyncio.StreamReader()
    reader.feed_data(framing.HEADER.pack(100) + b"x" * 100)
    with pytest.raises(framing.FrameTooLarge):
        await framing.read_stream(reader, limit=99)
