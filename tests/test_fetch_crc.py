"""Fetched batches' CRC-32C checked in hardware (shared/fetch_crc.py): a sound fetch is unpacked without
aiokafka's own check, a corrupt one is refused at the batch that fails, as aiokafka refuses it."""
from __future__ import annotations

import itertools
import os
import random
import struct

import google_crc32c
import pytest
from aiokafka.consumer import fetcher
from aiokafka.errors import CorruptRecordException
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.legacy_records import LegacyRecordBatchBuilder
from aiokafka.structs import TopicPartition

from crucible.v1 import task_pb2
from crucible.shared import bus, fetch_crc

TP = TopicPartition("t", 0)
READ_COMMITTED = 1


def batch(first_offset: int, count: int) -> bytes:
    builder = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=0, producer_id=-1,
                                        producer_epoch=-1, base_sequence=-1, batch_size=1 << 20)
    for i in range(count):
        builder.append(i, timestamp=1_700_000_000_000 + i, key=b"k%d" % (first_offset + i), value=os.urandom(300),
                       headers=[("schema", b"crucible.v1.Task")])
    data = bytearray(builder.build())
    data[0:8] = first_offset.to_bytes(8, "big")  # the batch's base offset (outside the sum)
    return bytes(data)


def unpack(data: bytes, check_crcs) -> tuple[object, list, Exception | None]:
    """The fetch's records as a reader gets them: those before a failure, and the failure."""
    records = fetcher.PartitionRecords(TP, fetcher.MemoryRecords(data), [], 0, None, None, check_crcs, READ_COMMITTED)
    got = []
    try:
        for record in records:
            got.append(record)
    except CorruptRecordException as exc:
        return records, got, exc
    return records, got, None


@pytest.fixture(scope="module", autouse=True)
def installed():
    assert fetch_crc.available(), "google-crc32c's C extension and aiokafka's fetcher hooks are there"


def test_a_sound_fetch_is_checked_here_and_unpacked_without_aiokafkas_own_check():
    data = batch(0, 7) + batch(7, 5) + batch(12, 9)
    records, got, failure = unpack(data, fetch_crc.HARDWARE)
    assert failure is None
    assert records._check_crcs is False  # aiokafka's table-driven sum is not run a second time
    assert [r.offset for r in got] == list(range(21))
    _, stock, _ = unpack(data, True)
    assert [(r.key, r.value, r.headers) for r in got] == [(r.key, r.value, r.headers) for r in stock]


@pytest.mark.parametrize("where", ["header", "record", "last byte"])
def test_a_corrupt_batch_is_refused_where_it_fails_after_the_sound_batches_before_it(where):
    first, second, third = batch(0, 4), batch(4, 6), batch(10, 3)
    at = len(first) + {"header": fetch_crc.CRC_FROM + 3, "record": 200, "last byte": len(second) - 1}[where]
    data = bytearray(first + second + third)
    data[at] ^= 0x10
    records, got, failure = unpack(bytes(data), fetch_crc.HARDWARE)
    assert isinstance(failure, CorruptRecordException)
    assert records._check_crcs is True  # handed to aiokafka's check, which names the failing batch
    assert [r.offset for r in got] == [0, 1, 2, 3]
    _, stock, stock_failure = unpack(bytes(data), True)
    assert isinstance(stock_failure, CorruptRecordException) and len(stock) == len(got)


def test_a_wrong_sum_field_is_refused_too():
    data = bytearray(batch(0, 3))
    data[fetch_crc.CRC_AT] ^= 0x01
    assert not fetch_crc.batches_sound(bytes(data), __import__("google_crc32c").value)
    _, got, failure = unpack(bytes(data), fetch_crc.HARDWARE)
    assert got == [] and isinstance(failure, CorruptRecordException)


def test_a_batch_cut_short_by_the_fetch_limit_is_left_for_the_next_fetch():
    data = batch(0, 5) + batch(5, 5)[:-40]
    records, got, failure = unpack(data, fetch_crc.HARDWARE)
    assert failure is None and records._check_crcs is False
    assert [r.offset for r in got] == [0, 1, 2, 3, 4]
    assert fetch_crc.batches_sound(data[:fetch_crc.LOG_OVERHEAD - 1], __import__("google_crc32c").value)


def test_a_format_this_does_not_check_goes_to_aiokafkas_check():
    builder = LegacyRecordBatchBuilder(magic=1, compression_type=0, batch_size=1 << 20)
    for i in range(3):
        builder.append(i, timestamp=1_700_000_000_000, key=None, value=b"v%d" % i)
    legacy = bytes(builder.build())
    records, got, failure = unpack(legacy, fetch_crc.HARDWARE)
    assert records._check_crcs is True and failure is None and [r.value for r in got] == [b"v0", b"v1", b"v2"]
    broken = bytearray(legacy)
    broken[-1] ^= 0x01
    _, _, failure = unpack(bytes(broken), fetch_crc.HARDWARE)
    assert isinstance(failure, CorruptRecordException)


def test_readers_that_do_not_ask_are_unchanged():
    data = bytearray(batch(0, 3))
    data[100] ^= 0x01
    for check_crcs, refused in ((True, True), (False, False)):
        records, _, failure = unpack(bytes(data), check_crcs)
        assert records._check_crcs is check_crcs and (failure is not None) is refused


def outcome(data: bytes, check_crcs, aborted=(), fetch_offset: int = 0, isolation: int = READ_COMMITTED,
            take: int | None = None) -> tuple:
    """What a reader gets of a fetch: its records (every field), how unpacking ended, and where the next
    fetch starts after each take (a consumer's position, what it commits); `take`: as aiokafka's getone
    (1) or getall hands them over, that many at a time (else all at once)."""
    try:
        records = fetcher.PartitionRecords(TP, fetcher.MemoryRecords(data), list(aborted), fetch_offset, None, None,
                                           check_crcs, isolation)
        got, positions = [], []
        if take is None:
            got += records
        elif take == 1:  # as getone takes them
            while (record := next(records, None)) is not None:
                got.append(record)
                positions.append(records.next_fetch_offset)
        else:  # as getall takes them, a loop over the records left each time
            while len(chunk := list(itertools.islice(records, take))) == take:
                got += chunk
                positions.append(records.next_fetch_offset)
            got += chunk
    except Exception as exc:  # (aiokafka's own errors on lengths it cannot read, alike either way)
        return type(exc).__name__, str(exc)[:80]
    return got, positions + [records.next_fetch_offset]


def test_damaged_fetches_end_as_they_end_under_aiokafkas_own_check():
    """Flipped bits, cut fetches, rewritten lengths and formats: whatever aiokafka's check hands over,
    raises or skips, the hardware check does the same (it may be cheaper, never more lenient)."""
    rng = random.Random(64)
    for _ in range(400):
        parts, first = [], 0
        for _ in range(rng.randint(1, 4)):
            count = rng.randint(1, 5)
            parts.append(batch(first, count))
            first += count
        data = bytearray(b"".join(parts))
        damage = rng.random()
        if damage < 0.4:
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif damage < 0.6:
            data = data[:rng.randrange(len(data) + 1)]
        elif damage < 0.8:
            at = sum(len(p) for p in parts[:rng.randrange(len(parts))])
            struct.pack_into(">i", data, at + 8, rng.choice([-1, -12, 0, 1, 48, 49, 2**31 - 1, -2**31,
                                                              rng.randrange(400)]))
        else:
            data[fetch_crc.MAGIC_AT] = rng.choice([0, 1, 3, 255])
        assert outcome(bytes(data), fetch_crc.HARDWARE) == outcome(bytes(data), True)


def transactional(first_offset: int, count: int, producer_id: int, marker: str | None = None, step: int = 1) -> bytes:
    """A batch of a transaction's records, `step` offsets apart (2: every other one compacted away), or
    (`marker`: "commit", "abort") its control batch."""
    builder = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=1, producer_id=producer_id,
                                        producer_epoch=0, base_sequence=0 if marker is None else -1,
                                        batch_size=1 << 20)
    if marker is None:
        for i in range(count):
            builder.append(i * step, timestamp=1_700_000_000_000 + i, key=None if i % 3 else b"k%d" % i,
                           value=None if i % 4 == 3 else os.urandom(50), headers=[("h", b"%d" % i)] * (i % 2))
    else:  # a control record: version and type (0 abort, 1 commit) as its key
        builder.append(0, timestamp=1_700_000_000_000, key=struct.pack(">hh", 0, marker == "commit"),
                       value=struct.pack(">hi", 0, 0), headers=[])
    data = bytearray(builder.build())
    data[0:8] = first_offset.to_bytes(8, "big")
    if marker is not None:
        data[fetch_crc.CRC_FROM + 1] |= 0x20  # the attributes' control flag, then the sum over them again
        struct.pack_into(">I", data, fetch_crc.CRC_AT, google_crc32c.value(bytes(data[fetch_crc.CRC_FROM:])))
    return bytes(data)


def test_records_are_made_as_aiokafka_makes_them_across_transactions_and_markers():
    """A bus reader's records are made here in one step (fetch_crc's plain unpacking), not by aiokafka:
    over fetches of committed and aborted transactions, control batches, plain batches, offsets inside a
    batch, both isolation levels, iterated or taken a few at a time, every field of every record and
    the next fetch's offset are aiokafka's own."""
    rng = random.Random(65)
    aborts_seen = 0
    for _ in range(300):
        parts, first, aborted = [], 0, []
        open_: dict[int, int] = {}  # producer id -> its open transaction's first offset
        for _ in range(rng.randint(1, 8)):
            producer = rng.choice([1, 2, 3])
            kind = rng.random()
            if kind < 0.2:
                count = rng.randint(1, 4)
                parts.append(batch(first, count))
            elif kind < 0.6 or producer not in open_:
                records, step = rng.randint(1, 6), rng.choice([1, 1, 2])
                count = (records - 1) * step + 1
                open_.setdefault(producer, first)
                parts.append(transactional(first, records, producer, step=step))
            else:
                count, marker = 1, rng.choice(["commit", "abort"])
                if marker == "abort":
                    aborted.append((producer, open_[producer]))
                del open_[producer]
                parts.append(transactional(first, 1, producer, marker))
            first += count
        data = b"".join(parts)
        fetch_offset = rng.choice([0, rng.randrange(first + 1)])
        isolation = rng.choice([READ_COMMITTED, 0])
        take = rng.choice([None, 1, 3])
        ours = outcome(data, fetch_crc.HARDWARE, aborted, fetch_offset, isolation, take)
        assert ours == outcome(data, True, aborted, fetch_offset, isolation, take)
        assert isinstance(ours[0], list) and ours[1][-1] >= fetch_offset
        # (aborted records among them, which a committed read skips, for these fetches to compare)
        aborts_seen += outcome(data, True, aborted, fetch_offset, READ_COMMITTED)[0] != \
            outcome(data, True, aborted, fetch_offset, 0)[0]
    assert aborts_seen >= 30


def test_records_of_compressed_and_legacy_batches_are_made_as_aiokafka_makes_them():
    """Formats v0 and v1 and gzip-compressed batches, fetched from an offset inside one (a compressed batch is
    fetched whole: its records before the fetch's offset are skipped): the same records and next offset as
    aiokafka's own unpacking hands over, whatever that is for the formats Kafka 4 no longer writes."""
    gzip = 1
    rng = random.Random(66)
    for _ in range(60):
        parts, first, magic = [], 0, rng.choice([0, 1, 2])  # (one format a fetch: a log written by one broker)
        for _ in range(rng.randint(1, 4)):
            count, codec = rng.randint(1, 5), rng.choice([0, gzip])
            if magic == 2:
                builder = DefaultRecordBatchBuilder(magic=2, compression_type=codec, is_transactional=0,
                                                    producer_id=-1, producer_epoch=-1, base_sequence=-1,
                                                    batch_size=1 << 20)
                for i in range(count):
                    builder.append(i, timestamp=1_700_000_000_000 + i, key=b"k%d" % i, value=os.urandom(40),
                                   headers=[("h", b"x")])
                data = bytearray(builder.build())
                data[0:8] = first.to_bytes(8, "big")
            else:
                builder = LegacyRecordBatchBuilder(magic=magic, compression_type=codec, batch_size=1 << 20)
                for i in range(count):  # (inside a compressed set, v0 offsets are absolute, v1 relative to the last)
                    builder.append(first + i if magic == 0 else i,
                                   timestamp=None if magic == 0 else 1_700_000_000_000 + i,
                                   key=None if i % 2 else b"k%d" % i, value=os.urandom(40))
                data = bytearray(builder.build())
                if codec:  # the wrapper's offset is its last record's
                    data[0:8] = (first + count - 1).to_bytes(8, "big")
                else:
                    at = 0
                    for i in range(count):  # each message of an uncompressed set carries its own offset
                        data[at:at + 8] = (first + i).to_bytes(8, "big")
                        at += 12 + int.from_bytes(data[at + 8:at + 12], "big")
            parts.append(bytes(data))
            first += count
        data = b"".join(parts)
        fetch_offset = rng.randrange(first)
        ours = outcome(data, fetch_crc.HARDWARE, fetch_offset=fetch_offset)
        assert ours == outcome(data, True, fetch_offset=fetch_offset)
        assert isinstance(ours[0], list) and ours[0][-1].offset == first - 1


def test_records_are_made_here_only_for_plain_readers():
    data = batch(0, 4)
    for deserializer, check_crcs, plain in ((None, fetch_crc.HARDWARE, True), (bytes, fetch_crc.HARDWARE, False),
                                            (None, True, False)):
        records = fetcher.PartitionRecords(TP, fetcher.MemoryRecords(data), [], 0, deserializer, None, check_crcs,
                                           READ_COMMITTED)
        assert records._plain is plain
        assert [r.offset for r in records] == [0, 1, 2, 3]


@pytest.mark.kafka
async def test_a_bus_reader_has_every_fetch_checked_in_hardware_and_its_records_made_here(settings, monkeypatch):
    checked = []
    sound = fetch_crc.batches_sound

    def spy(data, crc32c):
        checked.append(sound(data, crc32c))
        return checked[-1]

    monkeypatch.setattr(fetch_crc, "batches_sound", spy)
    made_here = []
    as_they_are = fetcher.PartitionRecords._as_they_are

    def counted(self):
        for record in as_they_are(self):
            made_here.append(record.offset)
            yield record

    monkeypatch.setattr(fetcher.PartitionRecords, "_as_they_are", counted)
    await bus.ensure_topics(["crc"], settings=settings)
    tasks = [task_pb2.Task(id=f"crc-{i}", kind="exact", prompt="p" * 500) for i in range(40)]
    async with bus.Producer(settings) as producer:
        for task in tasks:
            await producer.send("crc", task, key=task.id)
    seen = []

    async def handler(incoming):
        seen.append(incoming.message.id)

    async with bus.Consumer(["crc"], "crc-reader", handler, settings=settings,
                            schemas={"crc": task_pb2.Task}) as consumer:
        assert consumer._consumer._fetcher._check_crcs is fetch_crc.HARDWARE
        for _ in range(3):
            if len(seen) < len(tasks):
                await consumer.run(max_records=len(tasks) - len(seen), idle_timeout_s=10)
    assert sorted(seen) == sorted(t.id for t in tasks)
    assert checked and all(checked)
    assert sorted(made_here) == list(range(len(tasks)))  # every record made by the plain unpacking, once
