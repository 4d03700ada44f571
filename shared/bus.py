"""Kafka behind one small seam: protobuf values, trace context in headers, a DLQ for bad input.

Producers put three headers on every record: `schema` (the protobuf full name),
`content-type`, and W3C `traceparent`/`tracestate`. Consumers commit only
after a record is handled and its outputs are acknowledged by the broker
(at-least-once, nothing lost), and send any record they cannot decode or
handle to `<topic>.dlq` with the reason in the `dlq-reason` header, then carry
on with the next one.

    Producer   send (schema + trace headers), dead_letter (original value and headers + reason)
    Reader     fetch decoded records (undecodable ones dead-lettered), each in a consumer span
               whose parent is the producer's; commit positions; optionally assign + seek to
               offsets a caller saved itself (the learner keeps them in its checkpoints)
    Consumer   a Reader that runs a handler on each record, produces its outputs, then commits
    decode_record / dead_letter_headers / consume_span: the same steps for stream processors
               (faust agents) that fetch records themselves
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import functools
import hashlib
import logging
import traceback
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError
from google.protobuf.message import Message
from opentelemetry import context as otel_context
from opentelemetry import trace

import time
import weakref
from collections import Counter

from opentelemetry.metrics import Observation

from crucible.shared import fetch_crc, integrity, messages, metrics, telemetry
from crucible.shared.settings import Settings, get_settings

log = logging.getLogger(__name__)

DLQ_SUFFIX = ".dlq"
UNKNOWN_TOPIC = 3  # Kafka's UNKNOWN_TOPIC_OR_PARTITION error code
# How long a transactional consumer waits for more of a batch's records to join a transaction: while
# they keep finishing (one at least every COMMIT_LINGER_S), up to COMMIT_LINGER_MAX_S in all.
COMMIT_LINGER_S = 0.015
COMMIT_LINGER_MAX_S = 0.25
# How long a consumer that fails or is cancelled waits for its last batch's commit, still in flight, to land.
COMMIT_SETTLE_S = 2.0
# A consumer's batches whose offsets may be uncommitted, on their way to the broker or waiting for the commit
# on its way, before the consumer waits for that commit (Consumer.run, Commits): what a crash can make it
# read again, beside the batch in hand.
COMMIT_BATCHES_BEHIND = 4
FETCH_WAIT_MS = 5000
# How long Reader.at_end gives the position to pass a commit marker after the last record, and how
# often it looks meanwhile.
AT_END_SETTLE_S = 1.0
AT_END_POLL_MS = 20
# How long one wait of Reader._take_fetched for the client's records lasts (it waits again at once).
TAKE_WAIT_MS = 1000
# The records a transactional consumer's handling of one record produces, sent when that record commits.
_OUTBOX: contextvars.ContextVar[list | None] = contextvars.ContextVar("crucible_bus_outbox", default=None)
H_SCHEMA = "schema"
H_CONTENT_TYPE = "content-type"
H_DLQ_REASON = "dlq-reason"
H_DLQ_SOURCE = "dlq-source"  # topic/partition@offset of the original record
H_DLQ_CUT = "dlq-cut"  # what a dead letter left out of a record too large to send again (dead_letter_record)


RECORDS = metrics.counter("crucible.bus.records", "records by topic and outcome (consumed; dead_lettered among them)",
                          "{record}")
BATCH_MS = metrics.histogram("crucible.bus.batch.duration", "time to handle one fetched batch and have its outputs "
                             "acknowledged (its commit then travels while the next batch is handled)", "ms")
_readers: "weakref.WeakSet[Reader]" = weakref.WeakSet()


def _lag(options):
    """Consumer lag per topic and partition: the broker's high watermark minus the next offset to read."""
    for reader in list(_readers):
        for (topic, partition), position in list(reader.positions.items()):
            try:
                high = reader._consumer.highwater(TopicPartition(topic, partition))
            except Exception:  # noqa: BLE001 -- not assigned any more
                continue
            if high is not None:
                yield Observation(max(0, high - position), {"topic": topic, "partition": str(partition),
                                                            "group": reader.group_id or ""})


LAG = metrics.gauge("crucible.bus.consumer_lag", _lag, "records published and not yet read, per topic and partition",
                    "{record}")


class Reject(Exception):
    """Raised by a handler for input that is well-formed but unacceptable; the record goes to the DLQ."""


@dataclass(frozen=True)
class Outgoing:
    """One record a handler wants produced."""

    topic: str
    message: Message
    key: str | bytes | None = None


@dataclass(slots=True)
class Incoming:
    """A decoded record as a handler sees it; `context` is its consumer span's, for work done later."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    message: Message
    headers: Sequence[tuple[str, bytes]] = field(default_factory=tuple)
    context: otel_context.Context | None = None


Handler = Callable[[Incoming], Awaitable[Iterable[Outgoing] | None]]


def _key_bytes(key: str | bytes | None) -> bytes | None:
    return key.encode() if isinstance(key, str) else key


def publish_headers(message: Message) -> list[tuple[str, bytes]]:
    """The headers every produced record carries: schema, content-type, and the current trace context."""
    return [
        (H_SCHEMA, _schema_header(type(message))),
        _PROTOBUF_HEADER,
        *telemetry.inject_headers(),
    ]


def decode_record(value: bytes | None, headers: Sequence[tuple[str, bytes]] | None,
                  schema: type[Message]) -> Message:
    """One consumed value as `schema`, checked against its headers; MessageDecodeError says why not."""
    if _as_published(value, headers, schema):
        return messages.decode_protobuf(value, schema)  # as publish_headers writes them: nothing to look for
    named = content_type = _ABSENT  # each header's first value, as header_value finds it
    for key, header in headers or ():
        if key == H_SCHEMA and named is _ABSENT:
            named = header
        elif key == H_CONTENT_TYPE and content_type is _ABSENT:
            content_type = header
    return messages.decode(value, schema, schema=_text(named), content_type=_text(content_type))


def header_runs(records: Sequence[ConsumerRecord]) -> list[tuple[int, int]]:
    """(start, end) of each run of records with one topic and equal headers, in order: what is read from
    headers (the schema they name, the trace context) is read once a run. A fetched batch of one
    producer's records in one trace is one run; records of traces of their own are runs of one."""
    runs, start, count = [], 0, len(records)
    while start < count:
        first = records[start]
        topic, headers = first.topic, first.headers
        end = start + 1
        while end < count and (record := records[end]).headers == headers and record.topic == topic:
            end += 1
        runs.append((start, end))
        start = end
    return runs


def decode_records(records: Sequence[ConsumerRecord], schemas: dict[str, type[Message]],
                   runs: list[tuple[int, int]] | None = None) -> list[Message | None]:
    """The messages of records as publish_headers writes them (protobuf, their topic's schema named),
    a topic's decoded together in one parse (messages.decode_protobuf_many); None for any other
    record, and for every record of a topic where one of them does not decode cleanly: decode_record
    decodes those one by one, and says which cannot be decoded and why. `runs`: header_runs(records),
    where the caller has them."""
    out: list[Message | None] = [None] * len(records)
    by_topic: dict[str, list[tuple[int, int]]] = {}
    # _as_published's test once a run of equal headers (in the loop every consumed record passes through,
    # a test a record was a tenth of its handling).
    prefixes = {topic: _published_prefix(schema) for topic, schema in schemas.items()}
    for start, end in header_runs(records) if runs is None else runs:
        first = records[start]
        prefix, headers = prefixes.get(first.topic), first.headers
        if prefix is not None and headers and len(headers) > 1 and headers[0] == prefix[0] and headers[1] == prefix[1]:
            by_topic.setdefault(first.topic, []).append((start, end))
    for topic, spans in by_topic.items():
        whole = spans[0] == (0, len(records)) or sum(end - start for start, end in spans) == len(records)
        indices = range(len(records)) if whole else [i for start, end in spans for i in range(start, end)]
        values = [r.value for r in records] if whole else [records[i].value for i in indices]
        if not all(values):  # a tombstone among them (or an empty value): the others decoded together
            indices = [i for i in indices if records[i].value is not None]
            values, whole = [records[i].value for i in indices], False
        if len(indices) > 1:
            decoded = messages.decode_protobuf_many(values, schemas[topic])
            if whole and decoded is not None:
                return decoded
            for i, message in zip(indices, decoded or ()):
                out[i] = message
    return out


def _as_published(value: bytes | None, headers: Sequence[tuple[str, bytes]] | None, schema: type[Message]) -> bool:
    """Whether a record is as publish_headers writes it: a value, protobuf, this schema named first."""
    return value is not None and bool(headers) and tuple(headers[:2]) == _published_prefix(schema)


@functools.cache
def _published_prefix(schema: type[Message]) -> tuple[tuple[str, bytes], tuple[str, bytes]]:
    """The first two headers publish_headers writes for `schema`."""
    return (H_SCHEMA, _schema_header(schema)), _PROTOBUF_HEADER


_ABSENT = object()
_UNTRACED = contextlib.nullcontext()
_PROTOBUF_HEADER = (H_CONTENT_TYPE, messages.CONTENT_TYPE_PROTOBUF.encode())


@functools.cache
def _schema_header(schema: type[Message]) -> bytes:
    return messages.schema_name(schema).encode()


def _text(value) -> str | None:
    if value is _ABSENT:
        return None
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def dead_letter_headers(topic: str, partition: int, offset: int, headers: Sequence[tuple[str, bytes]] | None,
                        reason: str) -> list[tuple[str, bytes]]:
    """The original headers (trace context included; as many as DLQ_MAX_HEADER_BYTES hold) plus why and
    where the record was rejected."""
    kept, size = [], 0
    for k, v in headers or ():
        size += len(k) + len(v or b"")
        if k not in (H_DLQ_REASON, H_DLQ_SOURCE, H_DLQ_CUT) and size <= DLQ_MAX_HEADER_BYTES:
            kept.append((k, v))
    return kept + [
        (H_DLQ_REASON, reason.encode("utf-8", "replace")[:4000]),
        (H_DLQ_SOURCE, f"{topic}/{partition}@{offset}".encode()),
    ]


# A dead letter keeps at most this much of a record's value, key and headers. A record the broker took
# can be larger than a producer sends (16 MiB, below the broker's limit), and one that could not be
# dead-lettered stopped its consumer at every restart; what is cut is named in `dlq-cut` (sizes and
# SHA-256), and the whole record stays where `dlq-source` says, for the topic's retention.
DLQ_MAX_VALUE_BYTES = 1 << 20
DLQ_MAX_KEY_BYTES = 1 << 10
DLQ_MAX_HEADER_BYTES = 64 << 10


def dead_letter_record(topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
                       headers: Sequence[tuple[str, bytes]] | None, reason: str) -> "Prepared":
    """The record `<topic>.dlq` receives for a rejected one: as it came, with the reason and its source,
    cut to the sizes above."""
    out = dead_letter_headers(topic, partition, offset, headers, reason)
    cut = []
    for name, data, limit in (("value", value, DLQ_MAX_VALUE_BYTES), ("key", key, DLQ_MAX_KEY_BYTES)):
        if data is not None and len(data) > limit:
            cut.append(f"{name} {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}")
    if len(out) < len(headers or ()) + 2:
        cut.append("headers beyond the first 64 KiB")
    if cut:
        out.append((H_DLQ_CUT, "; ".join(cut).encode()))
    return Prepared(topic + DLQ_SUFFIX, None if value is None else value[:DLQ_MAX_VALUE_BYTES],
                    None if key is None else key[:DLQ_MAX_KEY_BYTES], out)


def connection(settings: Settings) -> dict:
    """How every Kafka client of Crucible reaches the brokers: bootstrap servers and, where the
    deployment sets them, TLS and SASL (CRUCIBLE_KAFKA_SECURITY_PROTOCOL, _SASL_*, _SSL_CAFILE)."""
    options: dict = {"bootstrap_servers": settings.kafka_bootstrap,
                     "security_protocol": settings.kafka_security_protocol}
    if settings.kafka_security_protocol in ("SSL", "SASL_SSL"):
        from aiokafka.helpers import create_ssl_context

        options["ssl_context"] = create_ssl_context(cafile=str(settings.kafka_ssl_cafile)
                                                    if settings.kafka_ssl_cafile else None)
    if settings.kafka_security_protocol.startswith("SASL"):
        options.update(sasl_mechanism=settings.kafka_sasl_mechanism,
                       sasl_plain_username=settings.kafka_sasl_username or "",
                       sasl_plain_password=settings.kafka_sasl_password.get_secret_value()
                       if settings.kafka_sasl_password else "")
    return options


def faust_credentials(settings: Settings):
    """The same, as faust wants it (None: plaintext)."""
    import faust

    protocol = settings.kafka_security_protocol
    ssl_context = connection(settings).get("ssl_context")
    if protocol.startswith("SASL"):
        return faust.SASLCredentials(
            username=settings.kafka_sasl_username or "",
            password=settings.kafka_sasl_password.get_secret_value() if settings.kafka_sasl_password else "",
            mechanism=settings.kafka_sasl_mechanism, ssl_context=ssl_context)
    return faust.SSLCredentials(ssl_context) if protocol == "SSL" else None


class Producer:
    """An idempotent aiokafka producer that sends protobuf messages with schema and trace headers."""

    def __init__(self, settings: Settings | None = None, **producer_options):
        self.settings = settings or get_settings()
        options = dict(
            **connection(self.settings),
            enable_idempotence=True,  # retries never duplicate a record
            acks="all",
            linger_ms=5,
            max_request_size=messages.MAX_MESSAGE_BYTES + 64 * 1024,
            # A partition's records go one batch to a produce request, and a request waits for the last
            # one's answer: at aiokafka's 16 KiB a step's 256 verdicts took nine round trips, and the
            # broker nine appends (the buffer grows to what is queued, never to this).
            max_batch_size=1024 * 1024,
        )
        if "transactional_id" in producer_options:
            # A transaction begun while the last one's markers are still being written is refused
            # (CONCURRENT_TRANSACTIONS) and retried after this backoff: 100 ms by default, a whole step here.
            options["retry_backoff_ms"] = 5
        options.update(producer_options)
        self._producer = AIOKafkaProducer(**options)

    async def start(self) -> "Producer":
        await self._producer.start()
        return self

    async def stop(self) -> None:
        await self._producer.stop()

    async def __aenter__(self) -> "Producer":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def send(
        self,
        topic: str,
        message: Message,
        key: str | bytes | None = None,
        extra_headers: Sequence[tuple[str, bytes]] = (),
    ) -> asyncio.Future:
        """Queues one record; await the returned future for the broker's acknowledgement."""
        topic = self.settings.topic(topic)
        self._vouch(message)
        with telemetry.record_span(f"{topic} publish", trace.SpanKind.PRODUCER, _publish_attributes(topic)):
            headers = [*publish_headers(message), *extra_headers]
            return await self._producer.send(topic, messages.encode(message), key=_key_bytes(key), headers=headers)

    def _vouch(self, message: Message) -> None:
        """A task, policy version, verdict group or trajectory a Crucible producer publishes is signed with
        the deployment's key, in place: this process holds the key, so it is trusted
        (shared/integrity.py). Their consumers refuse what nobody holding the key published."""
        if isinstance(message, integrity.SIGNED):
            integrity.sign(message, integrity.key(self.settings))

    async def send_and_wait(self, topic: str, message: Message, key: str | bytes | None = None):
        return await (await self.send(topic, message, key))

    def prepare(self, topic: str, message: Message, key: str | bytes | None = None) -> "Prepared":
        """A record ready to send later (in a transaction), its publish span and trace context taken now."""
        topic = self.settings.topic(topic)
        self._vouch(message)
        with telemetry.record_span(f"{topic} publish", trace.SpanKind.PRODUCER, _publish_attributes(topic)):
            return Prepared(topic, messages.encode(message), _key_bytes(key), publish_headers(message))

    async def commit_transaction(self, records: Sequence["Prepared"], offsets: dict[tuple[str, int], int],
                                 group_id: str) -> None:
        """Sends the records and commits the consumed offsets in one Kafka transaction: a reader at
        read_committed sees all of it or none, so a replica killed in the middle leaves nothing behind
        and its restart (fencing the old one) does the work exactly once."""
        async with self._producer.transaction():
            for r in records:
                await self._producer.send(r.topic, r.value, key=r.key, headers=r.headers)
            await self._producer.send_offsets_to_transaction(
                {TopicPartition(t, p): o for (t, p), o in offsets.items()}, group_id)


    async def dead_letter(self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
                          headers: Sequence[tuple[str, bytes]] | None, reason: str) -> None:
        """Sends one consumed record, as it came, to `<topic>.dlq` with the reason; waits for the broker."""
        span = trace.get_current_span()
        span.set_status(trace.Status(trace.StatusCode.ERROR, reason[:200]))
        log.warning("dead-lettering %s[%d]@%d: %s", topic, partition, offset, reason)
        letter = dead_letter_record(topic, partition, offset, key, value, headers, reason)
        await self._producer.send_and_wait(letter.topic, letter.value, key=letter.key, headers=letter.headers)

    async def flush(self) -> None:
        await self._producer.flush()


@dataclass(frozen=True)
class Prepared:
    topic: str  # full name
    value: bytes | None
    key: bytes | None
    headers: list[tuple[str, bytes]]


_FROM_HEADERS = object()


def consume_span(topic: str, partition: int, offset: int, headers: Sequence[tuple[str, bytes]] | None,
                 name: str = "process", parent=_FROM_HEADERS):
    """The consumer span of one record (a `with` block), child of the span that produced it (trace
    context in the headers; `parent`: what they name, where the caller has read them)."""
    if parent is _FROM_HEADERS:
        parent = telemetry.parent_from_headers(headers)
    return telemetry.carried(parent) or telemetry.record_span(
        f"{topic} {name}", trace.SpanKind.CONSUMER,
        {"messaging.system": "kafka", "messaging.destination.name": topic, "messaging.kafka.partition": partition,
         "messaging.kafka.offset": offset}, parent=parent)


def _publish_attributes(topic: str) -> dict:
    return {"messaging.system": "kafka", "messaging.destination.name": topic}


def schemas_for(settings: Settings, topics: Sequence[str],
                given: dict[str, type[Message]] | None = None) -> dict[str, type[Message]]:
    """The message schema of each (full) topic name: given, or the standard one for the topic."""
    out = {}
    for short in topics:
        full = settings.topic(short)
        schema = (given or {}).get(short) or (given or {}).get(full)
        schema = schema or messages.TOPIC_SCHEMAS.get(full.removeprefix(settings.topic_prefix))
        if schema is None:
            raise ValueError(f"no message schema known for topic {full!r}: pass schemas={{{short!r}: MessageClass}}")
        out[full] = schema
    return out


class _DropCarried(ConsumerRebalanceListener):
    """Forgets a reader's carried records of the partitions a rebalance takes away: whoever gets them
    next (this reader again, too) reads them from the group's committed offset."""

    def __init__(self, reader: "Reader"):
        self.reader = weakref.proxy(reader)

    def on_partitions_revoked(self, revoked) -> None:
        gone = {(tp.topic, tp.partition) for tp in revoked}
        reader = self.reader
        reader._carry([run for run in reader._carried if (run[0].topic, run[0].partition) not in gone])
        if reader._carried_count < reader._carry_below:
            reader._room.set()  # taking from the client goes on at once

    def on_partitions_assigned(self, assigned) -> None:
        pass


class Reader:
    """Fetches and decodes records; what cannot be decoded goes to the DLQ and never reaches the caller.

    By default the reader joins consumer group `group_id` (partitions assigned by the broker,
    positions from the group's committed offsets). With `offsets` it assigns itself every
    partition of its topics instead and starts at those positions ({topic: {partition: offset}};
    partitions not named start at the group's committed offset, else at the beginning): a
    caller that keeps its own positions (beside the state they belong to) resumes exactly there.
    Such a reader may have no group at all (`group_id=None`): it then commits nothing.

    A topic's records are judged once, by the service that acts on them (its owner); a reader
    with `dead_letters=False` only observes (control's task log on crucible.tasks): what it
    cannot decode is skipped and counted, and the owner dead-letters it, once. Where two services
    act on one topic (crucible.rollouts: the sandbox runs code, the verifier scores answers), one of
    them dead-letters what does not decode and the other passes `undecodable_owned=False`: it skips
    those and still dead-letters what it rejects itself.

    `trusted=True`: a record of a signed type (integrity.SIGNED) that no service holding this
    deployment's key signed is refused as one that does not decode (for readers that act on what they
    read without a check of their own: the run's driver, the learner's watch of evaluations).
    """

    def __init__(
        self,
        topics: Sequence[str],
        group_id: str | None,
        *,
        settings: Settings | None = None,
        producer: Producer | None = None,
        schemas: dict[str, type[Message]] | None = None,
        offsets: dict[str, dict[int, int]] | None = None,
        dead_letters: bool = True,
        undecodable_owned: bool = True,
        trusted: bool = False,
        **consumer_options,
    ):
        self.settings = settings or get_settings()
        self.dead_letters = dead_letters
        self.undecodable_owned = undecodable_owned
        self._secret = integrity.key(self.settings) if trusted else None
        self.topics = [self.settings.topic(t) for t in topics]
        self.group_id = group_id
        self.schemas = schemas_for(self.settings, topics, schemas)
        self._start_offsets = None if offsets is None else {
            self.settings.topic(t): {int(p): int(o) for p, o in parts.items()} for t, parts in offsets.items()}
        options = dict(
            **connection(self.settings),
            group_id=group_id,
            enable_auto_commit=False,  # commit after handling, never before
            auto_offset_reset="earliest",
            isolation_level="read_committed",
            # A fetch the broker holds until a record arrives (or this long): a record is delivered as
            # soon as it is written however long this is, and an idle reader costs the broker a request
            # every FETCH_WAIT_MS rather than aiokafka's 500 ms.
            fetch_max_wait_ms=FETCH_WAIT_MS,
            # Every fetched batch's CRC-32C checked, in the processor's CRC instruction where it can be
            # (fetch_crc: a tenth of this reader's CPU a record), else by aiokafka.
            check_crcs=fetch_crc.HARDWARE if fetch_crc.available() else True,
        )
        if group_id is not None and self._start_offsets is None and self.settings.instance_id:
            # Static membership: restarted under the same instance id, this member takes its
            # partitions back at once instead of waiting out the dead one's session.
            options["group_instance_id"] = f"{self.settings.instance_id}/{group_id}"
        options.update(consumer_options)
        # A group member subscribes in start(), with a listener for rebalances; a reader with no group
        # and no offsets reads every partition of its topics.
        self._consumer = (AIOKafkaConsumer(*self.topics, **options) if self._start_offsets is None and group_id is None
                          else AIOKafkaConsumer(**options))
        # Records the client fetched that no caller has been handed yet (fetch_raw takes all it has), as
        # the client hands them over: runs of one partition each, in offset order (never empty).
        self._carried: collections.deque[list[ConsumerRecord]] = collections.deque()
        self._carried_count = 0
        # What the last fetch_raw handed over: per (topic, partition), the next offset and how many records.
        self.taken: dict[tuple[str, int], tuple[int, int]] = {}
        self._carry_below = 500  # taken from the client while fewer are carried: the last fetch_raw's max_records
        self._pump: asyncio.Future | None = None  # _take_fetched, from start()
        self._arrived, self._room = asyncio.Event(), asyncio.Event()
        self._failure: Exception | None = None  # the client's, raised by the next fetch_raw
        self._ends_client: AIOKafkaConsumer | None = None  # at_end's, made when first asked
        self._own_producer = producer is None
        self.producer = producer or Producer(self.settings)
        self._stopping = asyncio.Event()
        self._paused = False
        self.positions: dict[tuple[str, int], int] = {}  # (topic, partition) -> next offset to read
        self.dead_lettered = 0
        self.skipped = 0
        _readers.add(self)

    async def start(self):
        if self._own_producer:
            await self.producer.start()
        if self._start_offsets is None and self.group_id is not None:
            self._consumer.subscribe(self.topics, listener=_DropCarried(self))
        await self._consumer.start()
        if self._start_offsets is not None:
            await self._assign_and_seek()
        self._pump = asyncio.ensure_future(self._take_fetched())
        return self

    async def _take_fetched(self) -> None:
        """Takes whatever the client fetches as soon as it arrives, into the records carried to the next
        fetch_raw, while fewer than that asks for are carried (a reader that falls behind holds at most
        one fetch more than it is handed).

        Records left in the client's buffer keep it from fetching their partition again, and once
        they are 100 ms old it fetches the broker's other partitions alone, in a request the broker
        holds for up to FETCH_WAIT_MS while they are idle; new records of the partition whose records
        were left then wait for that request. Taken only when a handler asked for more, they were
        left whenever it took longer than 100 ms: the verifier (three topics) once held a step's
        rollouts for 4 s, and before that episodes waited 2.5 s at the median. A failure of the
        client is raised by the next fetch_raw, and taking goes on."""
        while True:
            if self._carried_count >= self._carry_below:
                self._room.clear()
                await self._room.wait()
                continue
            try:
                batches = await self._consumer.getmany(timeout_ms=TAKE_WAIT_MS)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._failure = exc
                self._arrived.set()
                self._room.clear()
                await self._room.wait()  # until fetch_raw has raised it
                continue
            for records in batches.values():
                if records:
                    self._carried.append(records)
                    self._carried_count += len(records)
            if self._carried:
                self._arrived.set()

    def _carry(self, runs: Iterable[list[ConsumerRecord]]) -> None:
        self._carried = collections.deque(runs)
        self._carried_count = sum(map(len, self._carried))

    async def _assign_and_seek(self) -> None:
        partitions = await _partitions(self._consumer)
        tps = [TopicPartition(t, p) for t in self.topics for p in sorted(partitions(t) or {0})]
        self._consumer.assign(tps)
        for tp in tps:
            saved = self._start_offsets.get(tp.topic, {}).get(tp.partition)
            if saved is None and self.group_id is not None:
                saved = await self._consumer.committed(tp)
            if saved is None:
                await self._consumer.seek_to_beginning(tp)
            else:
                self._consumer.seek(tp, saved)
                self.positions[(tp.topic, tp.partition)] = saved

    async def stop(self) -> None:
        self._stopping.set()
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        await self._consumer.stop()
        if self._ends_client is not None:
            await self._ends_client.stop()
        if self._own_producer:
            await self.producer.stop()

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def pause(self) -> None:
        """Stops fetching (backpressure); records already fetched are still handled."""
        self._consumer.pause(*self._consumer.assignment())
        self._paused = True

    def resume(self) -> None:
        self._consumer.resume(*self._consumer.assignment())
        self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused

    async def fetch_raw(self, *, max_records: int, timeout_ms: int = 200) -> list[ConsumerRecord]:
        """The next records as they are (positions advance past them), at most `max_records`, waiting
        up to `timeout_ms` for some where none are carried (what the client fetched is taken from it as
        it arrives: _take_fetched)."""
        self._carry_below = max_records
        if not self._carried and self._failure is None and timeout_ms > 0:
            self._arrived.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), timeout_ms / 1000)
        if self._failure is not None:
            failure, self._failure = self._failure, None
            self._room.set()
            raise failure
        # Whole runs where they fit: a partition's position (and what a consumer commits) is its run's
        # last record's, not a dictionary write per record.
        records: list[ConsumerRecord] = []
        taken: dict[tuple[str, int], tuple[int, int]] = {}
        while self._carried and len(records) < max_records:
            run = self._carried[0]
            room = max_records - len(records)
            if len(run) > room:
                run, self._carried[0] = run[:room], run[room:]
            else:
                self._carried.popleft()
            records += run
            last = run[-1]
            key = (last.topic, last.partition)
            taken[key] = (last.offset + 1, taken.get(key, (0, 0))[1] + len(run))
        self._carried_count -= len(records)
        if self._carried_count < max_records:
            self._room.set()
        for key, (position, _) in taken.items():
            self.positions[key] = position
        self.taken = taken
        return records

    async def records_ready(self) -> None:
        """Returns once a fetch would hand over records (or raise the client's failure) without waiting;
        takes none."""
        while not self._carried and self._failure is None:
            self._arrived.clear()
            await self._arrived.wait()

    async def fetch(self, *, max_records: int = 500, timeout_ms: int = 200, traced: bool = True) -> list[Incoming]:
        """The next decodable records, each with its consumer span's context (the span ends here);
        `traced=False`: without one (a reader that only watches a topic, doing nothing for its records'
        traces), each in the context that was current."""
        out = []
        records = await self.fetch_raw(max_records=max_records, timeout_ms=timeout_ms)
        for record, message in zip(records, decode_records(records, self.schemas)):
            with consume_span(record.topic, record.partition, record.offset, record.headers, "receive") \
                    if traced else _UNTRACED:
                incoming = await self.decode(record, message)
                if incoming is not None:
                    out.append(incoming)
        return out

    async def decode(self, record: ConsumerRecord, message: Message | None = None) -> Incoming | None:
        """The record decoded (inside the caller's consumer span), or None once it is dead-lettered;
        `message`: its value decoded already (decode_records)."""
        message = self._checked(record, message)
        if isinstance(message, str):
            await self._undecodable(record, message)
            return None
        return Incoming(record.topic, record.partition, record.offset, record.key, message,
                        tuple(record.headers or ()), otel_context.get_current())

    async def _undecodable(self, record: ConsumerRecord, reason: str) -> None:
        if self.undecodable_owned:
            await self.dead_letter(record, reason)
        else:  # the topic's other consumer dead-letters it
            log.info("skipping %s[%d]@%d (dead-lettered by the topic's other consumer): %s", record.topic,
                     record.partition, record.offset, reason)
            self.skipped += 1

    def _checked(self, record: ConsumerRecord, message: Message | None = None) -> Message | str:
        """The record's message: `message`, its value decoded already (decode_records), or its value
        decoded here; checked for a signature of this run where the reader is `trusted`. Or why it
        cannot be used (a dead letter's reason). Not a coroutine: a record that decodes, nearly every
        one, awaits nothing."""
        if message is None:
            try:
                message = decode_record(record.value, record.headers, self.schemas[record.topic])
            except messages.MessageDecodeError as exc:
                return f"undecodable: {exc}"
            except Exception as exc:  # whatever a decoder raises on some input: that record, never the partition
                return f"undecodable: {type(exc).__name__}: {str(exc)[:300]}"
        if (self._secret is not None and isinstance(message, integrity.SIGNED)
                and not integrity.signed_correctly(message, self._secret)):
            return (f"rejected: a {type(message).__name__} no service of this run signed (unsigned, or signed with "
                    f"{integrity.ANOTHER_KEY}): refused unread")
        return message

    async def reject(self, incoming: Incoming, reason: str) -> None:
        """Dead-letters a record that decoded but cannot be used (the reader's own check), with the reason."""
        record = ConsumerRecord(incoming.topic, incoming.partition, incoming.offset, 0, 0, incoming.key,
                                messages.encode(incoming.message), None, 0, 0, list(incoming.headers))
        await self.dead_letter(record, reason)

    async def dead_letter(self, record: ConsumerRecord, reason: str) -> None:
        if not self.dead_letters:
            log.info("skipping %s[%d]@%d (its owner dead-letters it): %s", record.topic, record.partition,
                     record.offset, reason)
            self.skipped += 1
            return
        outbox = _OUTBOX.get()
        if outbox is not None:  # a transactional consumer: sent with the record's outputs, in its transaction
            log.warning("dead-lettering %s[%d]@%d: %s", record.topic, record.partition, record.offset, reason)
            outbox.append(dead_letter_record(record.topic, record.partition, record.offset, record.key,
                                             record.value, record.headers, reason))
        else:
            await self.producer.dead_letter(record.topic, record.partition, record.offset, record.key,
                                            record.value, record.headers, reason)
        self.dead_lettered += 1
        RECORDS.add(1, {"topic": record.topic, "outcome": "dead_lettered"})

    async def at_end(self, settle_s: float = AT_END_SETTLE_S) -> bool:
        """Whether everything published to this reader's partitions so far has been read.

        The ends are asked on a client of the reader's own. This reader's client keeps a fetch open on
        the broker, which holds it up to FETCH_WAIT_MS while the partitions are idle, and a broker
        answers one request of a connection at a time: asked there, the answer waited for that fetch
        (a generator's start, which reads every policy version before its first task, took 5 s).
        A transaction's commit marker after the last record is never a record, but the reader's
        position passes it only once it is fetched: up to `settle_s` is given for that (records that
        arrive meanwhile make the answer no)."""
        assignment = list(self._consumer.assignment())
        if not assignment or self._carried:
            return False
        if self._ends_client is None:
            self._ends_client = AIOKafkaConsumer(**connection(self.settings), enable_auto_commit=False,
                                                 isolation_level="read_committed")
            await self._ends_client.start()
        ends = await self._ends_client.end_offsets(assignment)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + settle_s
        while not self._carried:  # taken from the client, not handed out yet: not read
            if all([await self._consumer.position(tp) >= end for tp, end in ends.items()]):
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(AT_END_POLL_MS / 1000)  # what is fetched meanwhile is taken (_take_fetched)
        return False

    async def commit(self, offsets: dict[tuple[str, int], int] | None = None) -> None:
        """Commits the given positions ((topic, partition) -> next offset), or everything fetched so far,
        of the partitions this reader still holds: one a rebalance gave to another member is read again
        by that member from its last commit (at-least-once), where committing it would fail the commit."""
        offsets = self.positions if offsets is None else offsets
        if offsets and self.group_id is not None:
            held = self._consumer.assignment()
            ours = {tp: o for (t, p), o in offsets.items() if (tp := TopicPartition(t, p)) in held}
            if ours:
                await self._consumer.commit(ours)


class Consumer(Reader):
    """Consumes protobuf records, runs a handler on each, produces its outputs, then commits.

    The handler turns one Incoming into Outgoing records. A record that does not
    decode, or whose handler raises Reject, or keeps failing after retries, goes
    to `<topic>.dlq`; the consumer never stops on bad input.
    """

    def __init__(
        self,
        topics: Sequence[str],
        group_id: str,
        handler: Handler,
        *,
        max_attempts: int = 3,
        batch_size: int = 100,
        concurrency: int = 1,
        transactional: bool = False,
        **reader_options,
    ):
        settings = reader_options.get("settings") or get_settings()
        if transactional:
            # Its own producer: a transaction holds everything sent on it, so it is never shared.
            reader_options["producer"] = Producer(
                settings, transactional_id=f"{group_id}/{settings.instance}",
                transaction_timeout_ms=settings.transaction_timeout_ms)
        super().__init__(topics, group_id, **reader_options)
        if transactional:
            self._own_producer = True
        self.transactional = transactional
        self.handler = handler
        self.max_attempts = max_attempts
        self.batch_size = batch_size
        self.concurrency = concurrency  # records of one batch handled at once (order of outputs then varies)
        self.handled = 0

    async def run(self, *, max_records: int | None = None, idle_timeout_s: float | None = None) -> int:
        """Handles records until stopped, `max_records` are done, or nothing arrives for `idle_timeout_s`.

        A batch's offsets are committed after every output of the batch is acknowledged
        by the broker, while the next batches are handled: one commit at a time, each
        taking every batch handled since the last one began (a commit is a broker round
        trip that here took twice a batch's handling), and no more than
        COMMIT_BATCHES_BEHIND batches uncommitted, on their way or owed (Commits). A
        crash replays at most those and the batch in hand (at-least-once; downstream
        writes are idempotent), and nothing is lost.
        A transactional consumer sends a batch's outputs (dead letters included) and its
        offsets in one transaction instead: exactly once, for hops whose work is not
        repeatable (sampling the next turn of an episode).
        """
        done = 0
        loop = asyncio.get_running_loop()
        idle_since = loop.time()
        commits = Commits(self.commit)
        try:
            while not self._stopping.is_set():
                limit = self.batch_size if max_records is None else min(self.batch_size, max_records - done)
                records = await self.fetch_raw(max_records=limit)
                if not records:
                    await commits.flush()
                    if idle_timeout_s is not None and loop.time() - idle_since > idle_timeout_s:
                        break
                    continue
                idle_since = loop.time()
                started = time.perf_counter()
                taken = self.taken
                try:
                    offsets = await self._run_batch(records, {key: position for key, (position, _) in taken.items()})
                finally:  # counted per batch: an instrument call per record costs more than the record's decode
                    counts: Counter[str] = Counter()
                    for (topic, _), (_, count) in taken.items():
                        counts[topic] += count
                    for topic, count in counts.items():
                        RECORDS.add(count, {"topic": topic, "outcome": "consumed"})
                    BATCH_MS.record((time.perf_counter() - started) * 1000, {"group": self.group_id or ""})
                done += len(records)
                if offsets:
                    await commits.owe(offsets)
                if max_records is not None and done >= max_records:
                    break
        except BaseException:
            await commits.settle()
            raise
        await commits.flush()
        return done

    async def _run_batch(self, records: list[ConsumerRecord], offsets: dict[tuple[str, int], int] | None = None
                         ) -> dict[tuple[str, int], int]:
        """Handles one fetched batch; returns the offsets to commit once every output is acknowledged
        (none: a transactional batch commits its own). `offsets`: the batch's, where the caller knows them
        (fetch_raw's `taken`)."""
        if offsets is None:
            offsets = {(r.topic, r.partition): r.offset + 1 for r in records}
        pending: list[asyncio.Future] = []
        runs = header_runs(records)
        decoded = decode_records(records, self.schemas, runs)
        if self.transactional:
            await self._run_transactional(records, decoded)
            return {}
        if self.concurrency <= 1:
            pending = await self._run_in_order(records, decoded, runs)
        else:
            slots = asyncio.Semaphore(self.concurrency)

            async def bounded(record, message):
                async with slots:
                    return await self._process(record, message)

            for futures in await asyncio.gather(*(bounded(r, m) for r, m in zip(records, decoded))):
                pending.extend(futures)
        if pending:
            await asyncio.gather(*pending)
        return offsets

    async def _run_transactional(self, records: list[ConsumerRecord], decoded: list[Message | None]) -> None:
        """Handles a batch concurrently; whenever the records handled form a longer prefix of the batch,
        that prefix's outputs and offsets are committed in one transaction. A handler that waits (the
        generator's policy-lag bound) holds back only what follows it, never what went before."""
        slots = asyncio.Semaphore(max(1, self.concurrency))
        finished: dict[int, list[Prepared]] = {}
        committed = 0
        lock = asyncio.Lock()
        progress = asyncio.Event()
        loop = asyncio.get_running_loop()

        def finished_prefix() -> int:
            end = committed
            while end in finished:
                end += 1
            return end

        async def one(index: int, record: ConsumerRecord) -> None:
            nonlocal committed
            outbox: list[Prepared] = []
            _OUTBOX.set(outbox)  # this task's own context: the handler's outputs and dead letters land here
            async with slots:
                await self._process(record, decoded[index])
            finished[index] = outbox
            progress.set()
            async with lock:
                # Back-to-back transactions wait on each other's markers (about 25 ms here), and each
                # costs the broker four appends and a marker per partition, and the readers a fetch:
                # while the batch's other records keep finishing, they join this one instead. A record
                # whose handler waits (the generator's policy-lag bound) holds the others back for
                # COMMIT_LINGER_S, no more.
                now = loop.time()
                cap = now + COMMIT_LINGER_MAX_S
                while (end := finished_prefix()) < len(records) and now < cap:
                    progress.clear()
                    try:
                        await asyncio.wait_for(progress.wait(), min(COMMIT_LINGER_S, cap - now))
                    except TimeoutError:
                        break  # nothing finished for a while: commit what has
                    now = loop.time()
                end = finished_prefix()
                if end == committed:
                    return
                sends = [p for i in range(committed, end) for p in finished.pop(i)]
                offsets = {(r.topic, r.partition): r.offset + 1 for r in records[committed:end]}
                await self.producer.commit_transaction(sends, offsets, self.group_id)
                committed = end

        await asyncio.gather(*(one(i, r) for i, r in enumerate(records)))

    async def _run_in_order(self, records: list[ConsumerRecord], decoded: list[Message | None],
                            runs: list[tuple[int, int]]) -> list[asyncio.Future]:
        """Handles records one after another, each under its consumer span (a sampled trace's) or its
        trace's context carried on (an unsampled one's: telemetry.carried, no span made); returns the
        delivery futures of their outputs. A run of records with equal headers (header_runs: one
        producer's, in one trace) is read for its trace context once, and an unsampled run is handled
        under that context, made current once for them all rather than once each."""
        pending: list[asyncio.Future] = []
        handle, parent_from_headers = self._handle, telemetry.parent_from_headers  # (looked up once a batch)
        for start, end in runs:
            headers = records[start].headers
            parent = parent_from_headers(headers)
            scope = telemetry.carried(parent)
            if scope is not None:
                with scope:
                    pending += await handle(records[start:end], decoded[start:end], otel_context.get_current())
            else:  # a span each
                for record, message in zip(records[start:end], decoded[start:end]):
                    with consume_span(record.topic, record.partition, record.offset, headers, parent=parent):
                        pending += await handle((record,), (message,))
        return pending

    async def _process(self, record: ConsumerRecord, message: Message | None) -> Sequence[asyncio.Future]:
        """Decodes (unless `message` is its value decoded) and handles one record under its consumer
        span; returns the delivery futures of its outputs."""
        with consume_span(record.topic, record.partition, record.offset, record.headers):
            return await self._handle((record,), (message,))

    async def _handle(self, records: Sequence[ConsumerRecord], decoded: Sequence[Message | None],
                      context: otel_context.Context | None = None) -> list[asyncio.Future]:
        """Decodes (where `decoded` has None) and handles a run of records with equal headers (header_runs'
        run, or one record: every Incoming gets the first record's) one after another, all under one
        consumer span or carried context, made current by the caller (`context`, where the caller has
        it); returns the delivery futures of their outputs. One coroutine for the run, not one a record:
        in the loop every consumed record passes through, that was a fifth of its handling."""
        pending: list[asyncio.Future] = []
        handler, checked, checking = self.handler, self._checked, self._secret is not None
        context = context or otel_context.get_current()
        headers = tuple(records[0].headers or ()) if records else ()  # (equal: one tuple for the run)
        for record, message in zip(records, decoded):
            if message is None or checking:  # (decoded already, nothing to check: nearly every record)
                message = checked(record, message)
                if isinstance(message, str):
                    await self._undecodable(record, message)
                    continue
            incoming = Incoming(record.topic, record.partition, record.offset, record.key, message, headers, context)
            try:
                outputs = await handler(incoming)
            except Exception as exc:
                pending += await self._handle_failed(record, incoming, exc)
                continue
            self.handled += 1
            if outputs:
                pending += await self._send(outputs)
        return pending

    async def _handle_failed(self, record: ConsumerRecord, incoming: Incoming, exc: Exception) -> list[asyncio.Future]:
        """After the handler raised `exc` on a record: Reject dead-letters it at once; anything else (a
        handler bug or a transient outage) is retried, then dead-lettered."""
        for attempt in range(1, self.max_attempts + 1):
            if isinstance(exc, Reject):
                await self.dead_letter(record, f"rejected: {exc}")
                return []
            log.warning("handler failed on %s@%d (attempt %d/%d): %r",
                        record.topic, record.offset, attempt, self.max_attempts, exc)
            if attempt == self.max_attempts:
                where = traceback.extract_tb(exc.__traceback__)[-1]
                await self.dead_letter(
                    record,
                    f"handler failed {attempt} times: {type(exc).__name__}: {exc} "
                    f"(at {where.filename}:{where.lineno})",
                )
                return []
            await asyncio.sleep(0.1 * 2**attempt)
            try:
                outputs = await self.handler(incoming)
            except Exception as again:
                exc = again
                continue
            self.handled += 1
            return await self._send(outputs) if outputs else []
        return []

    async def _send(self, outputs: Iterable[Outgoing]) -> list[asyncio.Future]:
        """A handler's outputs sent (their delivery futures), or held in the transaction's outbox."""
        outbox = _OUTBOX.get()
        if outbox is not None:
            outbox.extend(self.producer.prepare(o.topic, o.message, o.key) for o in outputs)
            return []
        return [await self.producer.send(o.topic, o.message, o.key) for o in outputs]


class Commits:
    """A consumer's offset commits: in order, one at a time, each taking the offsets of every batch
    handled since the one before it was sent; what is owed when one lands is sent then. At most
    COMMIT_BATCHES_BEHIND batches are uncommitted (on their way or owed) when owe() returns."""

    def __init__(self, commit: Callable[[dict[tuple[str, int], int]], Awaitable[None]]):
        self._commit = commit
        self._in_flight: asyncio.Future | None = None
        self._in_flight_batches = 0  # the batches whose offsets the commit on its way carries
        self._owed: dict[tuple[str, int], int] = {}  # (topic, partition) -> next offset, not yet sent
        self._behind = 0  # batches whose offsets are owed
        self._waiting = False  # someone awaits the commit on its way (and sends what is owed after it)

    async def owe(self, offsets: dict[tuple[str, int], int]) -> None:
        """A batch handled, its outputs acknowledged: its offsets go with the next commit, sent now unless
        one is on its way (then when it lands, waited for here only past COMMIT_BATCHES_BEHIND)."""
        self._owed.update(offsets)
        self._behind += 1
        if (self._in_flight is not None and not self._in_flight.done()
                and self._in_flight_batches + self._behind <= COMMIT_BATCHES_BEHIND):
            return
        await self._send()

    async def flush(self) -> None:
        """Every owed offset committed (the commit on its way, then the rest)."""
        if self._owed:
            await self._send()
        if self._in_flight is not None:
            await self._landing()

    async def settle(self) -> None:
        """After a failure: the commit on its way gets a moment to land (_settle); what is owed is read
        again."""
        self._owed, self._behind = {}, 0
        if self._in_flight is not None:
            await _settle(self._in_flight)

    async def _send(self) -> None:
        if self._in_flight is not None:
            await self._landing()  # in order: a commit's failure is raised here, before anything later is sent
        self._launch()

    async def _landing(self) -> None:
        """Waits for the commit on its way. Shielded: a wait cancelled (the service stopping) leaves it
        on its way, for settle() to give a moment."""
        self._waiting = True
        try:
            await asyncio.shield(self._in_flight)
        except asyncio.CancelledError:
            raise
        except BaseException:
            self._in_flight = None  # raised here, and so not logged again by settle()
            raise
        finally:
            self._waiting = False
        self._in_flight = None

    def _launch(self) -> None:
        owed, self._owed = self._owed, {}
        self._in_flight_batches, self._behind = self._behind, 0
        self._in_flight = asyncio.ensure_future(self._commit(owed))
        self._in_flight.add_done_callback(self._landed)

    def _landed(self, commit: asyncio.Future) -> None:
        """A commit landed: what was owed meanwhile goes now, not with the next batch or the next idle
        fetch (unless a caller waiting for it sends it). A commit that failed stays, for the next owe()
        or flush() to raise."""
        if (commit is self._in_flight and not self._waiting and self._owed and not commit.cancelled()
                and commit.exception() is None):
            self._launch()


async def _settle(commit: asyncio.Task) -> None:
    """A commit still in flight when run() fails or is cancelled: a moment to land, then dropped (its
    records are read again: at-least-once). A broker that is gone never holds the error or the
    cancellation leaving run(), and the commit's own outcome never replaces it (it is logged)."""
    try:
        if not commit.done():
            await asyncio.wait({commit}, timeout=COMMIT_SETTLE_S)
    finally:
        if not commit.done():
            commit.cancel()
        commit.add_done_callback(_log_commit_failure)


def _log_commit_failure(commit: asyncio.Task) -> None:
    if not commit.cancelled() and commit.exception() is not None:
        log.warning("a commit left behind by a failed or cancelled run did not land (its records are read "
                    "again): %r", commit.exception())


# Topics whose consumers scale out as a consumer group (generators on tasks and observations, sandboxes
# on rollouts and actions, verifiers on executions and episodes): created with
# `kafka_topic_partitions` partitions, since a group has at most one active member per partition.
# The others keep one: the reward-aggregator's table is co-partitioned with verdicts, the learner
# reads every trajectory in order, every generator reads every policy version.
SCALED_TOPICS = frozenset({"tasks", "rollouts", "executions", "actions", "observations", "episodes"})


async def ensure_topics(
    names: Iterable[str],
    *,
    settings: Settings | None = None,
    partitions: int | None = None,
    with_dlq: bool = True,
) -> list[str]:
    """Creates the topics (and their DLQs) that do not exist yet; returns the ones created.
    `partitions`: for every one of them; None: SCALED_TOPICS get `kafka_topic_partitions`, others 1."""
    settings = settings or get_settings()
    wanted, counts = [], {}
    for name in names:
        full = settings.topic(name)
        wanted.append(full)
        counts[full] = partitions or (settings.kafka_topic_partitions if name in SCALED_TOPICS else 1)
        if with_dlq and not full.endswith(DLQ_SUFFIX):
            wanted.append(full + DLQ_SUFFIX)
            counts[full + DLQ_SUFFIX] = 1
    admin = AIOKafkaAdminClient(**connection(settings))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [t for t in wanted if t not in existing]
        if missing:
            try:
                await admin.create_topics(
                    [NewTopic(t, num_partitions=counts[t], replication_factor=1) for t in missing]
                )
            except TopicAlreadyExistsError:
                pass  # another service created it first
        return missing
    finally:
        await admin.close()


async def delete_topics(prefixes: Sequence[str], *, settings: Settings | None = None) -> list[str]:
    """Deletes every topic whose full name starts with one of `prefixes` (ValueError for an empty one:
    it would name every topic); returns the names deleted. The broker removes their data shortly after."""
    if not prefixes or not all(prefixes):
        raise ValueError(f"topic prefixes {list(prefixes)!r}: each must name something")
    settings = settings or get_settings()
    admin = AIOKafkaAdminClient(**connection(settings))
    await admin.start()
    try:
        doomed = sorted(t for t in await admin.list_topics() if t.startswith(tuple(prefixes)))
        deleted = []
        for start in range(0, len(doomed), 500):
            answer = (await admin.delete_topics(doomed[start:start + 500])).to_object()
            for topic in answer["topic_error_codes"]:
                name, code = topic["topic"], topic["error_code"]
                if code in (0, UNKNOWN_TOPIC):  # deleted, or already gone
                    deleted.append(name)
                else:
                    log.warning("topic %s could not be deleted (Kafka error %d)", name, code)
        return sorted(deleted)
    finally:
        await admin.close()


async def _partitions(consumer: AIOKafkaConsumer):
    """Every topic's partitions as the cluster has them now (topic -> set of partition ids, or None).
    Asked of a fresh metadata answer: the consumer's own `partitions_for_topic` answers from the
    metadata its client tracks, which need not hold a topic the consumer does not read (and did not, now
    and then: a resumed run counted 0 tasks published before and fed them all again)."""
    return (await consumer._client.fetch_all_metadata()).partitions_for_topic


async def published(name: str, *, settings: Settings | None = None) -> int:
    """How many records were ever written to topic `name` (its end offsets, summed over partitions);
    0 for a topic that does not exist."""
    settings = settings or get_settings()
    full = settings.topic(name)
    reader = AIOKafkaConsumer(**connection(settings), enable_auto_commit=False)
    await reader.start()
    try:
        partitions = (await _partitions(reader))(full)
        if not partitions:  # no such topic
            return 0
        ends = await reader.end_offsets([TopicPartition(full, p) for p in partitions])
        return sum(ends.values())
    finally:
        await reader.stop()


STANDARD_TOPICS = tuple(messages.TOPIC_SCHEMAS)
