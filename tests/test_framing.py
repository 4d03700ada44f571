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


def test_round_trip_through_a_pipe(pipe):
    r, w = pipe
    frames = [b"", b"x", bytes(range(256)) * 4, os.urandom(3 << 20)]  # the last is larger than a pipe holds

    def writer():
        for frame in frames:
            framing.write(w, frame)
        os.close(w)

    thread = threading.Thread(target=writer)
    thread.start()
    received = [framing.read(r) for _ in frames]
    thread.join()
    assert received == frames
    assert framing.read(r) is None  # closed between frames: a clean end, not an error


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


def test_stream_closed_inside_a_frame_is_truncated(pipe):
    r, w = pipe
    os.write(w, framing.encode(b"0123456789")[:-3])
    os.close(w)
    with pytest.raises(framing.TruncatedFrame) as err:
        framing.read(r)
    assert (err.value.got, err.value.wanted) == (7, 10)
    assert isinstance(err.value, EOFError)


def test_stream_closed_inside_a_header_is_truncated(pipe):
    r, w = pipe
    os.write(w, b"\x00\x00")
    os.close(w)
    with pytest.raises(framing.TruncatedFrame):
        framing.read(r)


def test_oversized_frame_is_refused_before_it_is_read(pipe):
    r, w = pipe
    os.write(w, framing.HEADER.pack(1 << 30) + b"only the start")
    with pytest.raises(framing.FrameTooLarge) as err:
        framing.read(r, limit=1 << 20)
    assert (err.value.size, err.value.limit) == (1 << 30, 1 << 20)
    assert os.read(r, 100) == b"only the start"  # nothing of the body was consumed


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
