"""CRC-32C checks of fetched record batches in the processor's CRC instruction, for the bus's readers.

aiokafka checks every fetched batch's CRC-32C (`check_crcs`, on by default) with a table-driven
routine in C: about 0.55 us a 1 KiB record on this machine, a tenth of all the bus spends reading one.
google-crc32c computes the same sum with the CRC32 instruction: ~0.05 us, ~0.15 us with the copy of
the batch it needs. A reader made with `check_crcs=HARDWARE` has each partition's fetched bytes
checked that way, every whole batch, before any record is unpacked. Where a batch fails, or cannot be
checked here (a format before v2, which Kafka 4 no longer writes), aiokafka's own check runs on that
fetch as it always did: it raises CorruptRecordException at the batch that fails, after handing over
the records before it. So a corrupt batch is refused exactly as before; only a sound one is cheaper.

Such a reader without deserializers (every bus reader) also has its records made here, each
ConsumerRecord in one step where aiokafka calls a method a record and a generator's __next__ in Python
between: the same records, the same offsets, transactions and control batches judged by aiokafka's
own bookkeeping (~0.3 us a record, a sixteenth of a bus reader's CPU).

This hooks two names of aiokafka's fetcher module (`MemoryRecords`, built from each partition's
fetched bytes, and `PartitionRecords`, which unpacks them), for aiokafka 0.14 (pyproject pins it).
Readers that do not ask for HARDWARE are unchanged. Where the names are not there, or google-crc32c
has only its pure-Python fallback, `available()` is False and the bus keeps aiokafka's own check and
records.
"""
from __future__ import annotations

import struct

_BATCH_LENGTH = struct.Struct(">i")  # at byte 8 of a batch: the length of what follows it
LOG_OVERHEAD = 12  # base offset (8 bytes) and batch length (4): a batch's length counts neither
MAGIC_AT, CRC_AT, CRC_FROM = 16, 17, 21  # format v2: the sum covers the batch from its attributes to its end
_CRC = struct.Struct(">I")
V2_HEADER = 61  # a v2 batch's header; no whole batch is shorter


class _Hardware:
    """`check_crcs=HARDWARE`: checked, by this module (a true value: aiokafka checks where it is not installed)."""

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "fetch_crc.HARDWARE"


HARDWARE = _Hardware()


def batches_sound(data: bytes, crc32c) -> bool:
    """Whether every whole batch of a partition's fetched bytes is format v2 with its CRC-32C right. A
    batch cut short at the end (a fetch stops at its size limit) is not checked: aiokafka does not
    unpack it either, and fetches it again whole."""
    end, at = len(data), 0
    while end - at >= LOG_OVERHEAD:
        after = at + LOG_OVERHEAD + _BATCH_LENGTH.unpack_from(data, at + 8)[0]
        if after > end:
            break
        if after - at < V2_HEADER or data[at + MAGIC_AT] != 2:
            return False
        if crc32c(data[at + CRC_FROM:after]) != _CRC.unpack_from(data, at + CRC_AT)[0]:
            return False
        at = after
    return True


_installed: bool | None = None


def available() -> bool:
    """Installs the hooks (once) and says whether HARDWARE readers are checked by them."""
    global _installed
    if _installed is None:
        _installed = _install()
    return _installed


def _install() -> bool:
    try:
        import google_crc32c
        from aiokafka.consumer import fetcher
    except ImportError:
        return False
    if google_crc32c.implementation != "c" or not all(hasattr(fetcher, name) for name in (
            "MemoryRecords", "PartitionRecords", "ConsumerRecord", "READ_COMMITTED", "Errors")) or not all(
            hasattr(fetcher.PartitionRecords, name) for name in ("_consume_aborted_up_to", "_contains_abort_marker")):
        return False
    crc32c, memory_records, partition_records = google_crc32c.value, fetcher.MemoryRecords, fetcher.PartitionRecords
    consumer_record = fetcher.ConsumerRecord

    class Fetched:
        """aiokafka's MemoryRecords, keeping the bytes it was made from (its methods are the
        original's own, bound: no call through here)."""

        __slots__ = ("data", "has_next", "next_batch", "size_in_bytes")

        def __init__(self, data: bytes):
            records = memory_records(data)
            self.data = data
            self.has_next, self.next_batch = records.has_next, records.next_batch
            self.size_in_bytes = records.size_in_bytes

    class CheckedPartitionRecords(partition_records):
        def __init__(self, tp, records, aborted_transactions, fetch_offset, key_deserializer, value_deserializer,
                     check_crcs, isolation_level):
            hardware = check_crcs is HARDWARE
            if hardware:  # aiokafka's own check, only where these bytes fail this one
                check_crcs = not (isinstance(records, Fetched) and type(records.data) is bytes
                                  and batches_sound(records.data, crc32c))
            super().__init__(tp, records, aborted_transactions, fetch_offset, key_deserializer, value_deserializer,
                             check_crcs, isolation_level)
            self._plain = hardware and key_deserializer is None and value_deserializer is None
            if self._plain:
                self._records_iterator = self._as_they_are()

        def __iter__(self):
            # Iterated (aiokafka's getall loops over this), a plain reader's records are taken from the
            # generator with no call of __next__ in Python between; next() still goes through it.
            return (self._records_iterator or iter(())) if self._plain else self

        def _as_they_are(self):
            """What aiokafka's _unpack_records hands over for a reader without deserializers (bus readers:
            their values are decoded by the bus, their keys taken as bytes), each record made in one step:
            the same ConsumerRecords, about 0.3 us a record cheaper on real reads."""
            topic, partition, records = self._tp.topic, self._tp.partition, self._records
            committed_only = self._isolation_level == fetcher.READ_COMMITTED
            while records.has_next():
                batch = records.next_batch()
                if self._check_crcs and not batch.validate_crc():
                    raise fetcher.Errors.CorruptRecordException(f"Invalid CRC - {self._tp}")
                if self._skipped(batch, committed_only):
                    self.next_fetch_offset = batch.next_offset
                    continue
                after = self.next_fetch_offset  # (a record before it: one of a compressed batch, already read)
                for record in batch:
                    offset = record.offset
                    if offset >= after:
                        key, value = record.key, record.value
                        self.next_fetch_offset = after = offset + 1
                        yield consumer_record(topic, partition, offset, record.timestamp, record.timestamp_type, key,
                                              value, record.checksum, -1 if key is None else len(key),
                                              -1 if value is None else len(value), tuple(record.headers))
                self.next_fetch_offset = batch.next_offset  # (past records compaction removed from its end)

        def _skipped(self, batch, committed_only: bool) -> bool:
            """Whether no record of `batch` is handed over: a control batch, or, read committed, a batch of a
            transaction that was aborted. Read committed, it also moves aiokafka's own bookkeeping of aborted
            producers past the batch, as its _unpack_records does: call it once a batch, in order."""
            if committed_only and batch.producer_id is not None:
                self._consume_aborted_up_to(batch.base_offset)
                if batch.is_control_batch and self._contains_abort_marker(batch):
                    self._aborted_producers.discard(batch.producer_id)
                if batch.is_transactional and batch.producer_id in self._aborted_producers:
                    return True
            return batch.is_control_batch

    fetcher.MemoryRecords, fetcher.PartitionRecords = Fetched, CheckedPartitionRecords
    return True
