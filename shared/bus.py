"""Kafka behind one small seam: protobuf values, trace context in headers, a DLQ for bad input.

Producers put three headers on every record: `schema` (the protobuf full name),
`content-type`, and W3C `traceparent`/`tracestate`. Consumers commit only
after a record is handled and its outputs are acknowledged by the broker
(at-least-once, nothing lost), and send any record they cannot decode or
handle to `<topic>.dlq` with the reason in the `dlq-reason` header, then carry
on with the next one.
"""
from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError
from google.protobuf.message import Message
from opentelemetry import trace

from crucible.shared import messages, telemetry
from crucible.shared.settings import Settings, get_settings

log = logging.getLogger(__name__)

DLQ_SUFFIX = ".dlq"
H_SCHEMA = "schema"
H_CONTENT_TYPE = "content-type"
H_DLQ_REASON = "dlq-reason"
H_DLQ_SOURCE = "dlq-source"  # topic/partition@offset of the original record


class Reject(Exception):
    """Raised by a handler for input that is well-formed but unacceptable; the record goes to the DLQ."""


@dataclass(frozen=True)
class Outgoing:
    """One record a handler wants produced."""

    topic: str
    message: Message
    key: str | bytes | None = None


@dataclass
class Incoming:
    """A decoded record as a handler sees it."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    message: Message
    headers: Sequence[tuple[str, bytes]] = field(default_factory=tuple)


Handler = Callable[[Incoming], Awaitable[Iterable[Outgoing] | None]]


def _key_bytes(key: str | bytes | None) -> bytes | None:
    return key.encode() if isinstance(key, str) else key


class Producer:
    """An idempotent aiokafka producer that sends protobuf messages with schema and trace headers."""

    def __init__(self, settings: Settings | None = None, **producer_options):
        self.settings = settings or get_settings()
        options = dict(
            bootstrap_servers=self.settings.kafka_bootstrap,
            enable_idempotence=True,  # retries never duplicate a record
            acks="all",
            linger_ms=5,
            max_request_size=messages.MAX_MESSAGE_BYTES + 64 * 1024,
        )
        options.update(producer_options)
        self._producer = AIOKafkaProducer(**options)
        self._tracer = telemetry.tracer("crucible.bus")

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
        with self._tracer.start_as_current_span(f"{topic} publish", kind=trace.SpanKind.PRODUCER) as span:
            span.set_attribute("messaging.system", "kafka")
            span.set_attribute("messaging.destination.name", topic)
            headers = [
                (H_SCHEMA, messages.schema_name(message).encode()),
                (H_CONTENT_TYPE, messages.CONTENT_TYPE_PROTOBUF.encode()),
                *telemetry.inject_headers(),
                *extra_headers,
            ]
            return await self._producer.send(topic, messages.encode(message), key=_key_bytes(key), headers=headers)

    async def send_and_wait(self, topic: str, message: Message, key: str | bytes | None = None):
        return await (await self.send(topic, message, key))

    async def send_raw(self, topic: str, value: bytes | None, key: bytes | None, headers: Sequence[tuple[str, bytes]]):
        """Sends bytes as they are (used for the DLQ, which must keep the original value)."""
        return await self._producer.send_and_wait(topic, value, key=key, headers=list(headers))

    async def flush(self) -> None:
        await self._producer.flush()


class Consumer:
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
        settings: Settings | None = None,
        producer: Producer | None = None,
        schemas: dict[str, type[Message]] | None = None,
        max_attempts: int = 3,
        batch_size: int = 100,
        concurrency: int = 1,
        **consumer_options,
    ):
        self.settings = settings or get_settings()
        self.topics = [self.settings.topic(t) for t in topics]
        self.group_id = group_id
        self.handler = handler
        self.max_attempts = max_attempts
        self.batch_size = batch_size
        self.concurrency = concurrency  # records of one batch handled at once (order of outputs then varies)
        # Schema per full topic name: given, or the standard one for the topic.
        self.schemas = {}
        for short, full in zip(topics, self.topics):
            schema = (schemas or {}).get(short) or (schemas or {}).get(full)
            schema = schema or messages.TOPIC_SCHEMAS.get(full.removeprefix(self.settings.topic_prefix))
            if schema is None:
                raise ValueError(f"no message schema known for topic {full!r}: pass schemas={{{short!r}: MessageClass}}")
            self.schemas[full] = schema
        options = dict(
            bootstrap_servers=self.settings.kafka_bootstrap,
            group_id=group_id,
            enable_auto_commit=False,  # commit after handling, never before
            auto_offset_reset="earliest",
            isolation_level="read_committed",
        )
        options.update(consumer_options)
        self._consumer = AIOKafkaConsumer(*self.topics, **options)
        self._own_producer = producer is None
        self.producer = producer or Producer(self.settings)
        self._tracer = telemetry.tracer("crucible.bus")
        self._stopping = asyncio.Event()
        self._paused = False
        self.handled = 0
        self.dead_lettered = 0

    async def start(self) -> "Consumer":
        if self._own_producer:
            await self.producer.start()
        await self._consumer.start()
        return self

    async def stop(self) -> None:
        self._stopping.set()
        await self._consumer.stop()
        if self._own_producer:
            await self.producer.stop()

    async def __aenter__(self) -> "Consumer":
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

    async def run(self, *, max_records: int | None = None, idle_timeout_s: float | None = None) -> int:
        """Handles records until stopped, `max_records` are done, or nothing arrives for `idle_timeout_s`.

        Offsets are committed once per fetched batch, after every output of the
        batch is acknowledged by the broker: a crash replays at most one batch
        (at-least-once; downstream writes are idempotent), and nothing is lost.
        """
        done = 0
        loop = asyncio.get_running_loop()
        idle_since = loop.time()
        while not self._stopping.is_set():
            limit = self.batch_size if max_records is None else min(self.batch_size, max_records - done)
            batches = await self._consumer.getmany(timeout_ms=200, max_records=limit)
            if not batches:
                if idle_timeout_s is not None and loop.time() - idle_since > idle_timeout_s:
                    break
                continue
            idle_since = loop.time()
            pending: list[asyncio.Future] = []
            offsets = {tp: records[-1].offset + 1 for tp, records in batches.items()}
            records = [r for rs in batches.values() for r in rs]
            if self.concurrency <= 1:
                for record in records:
                    pending.extend(await self._process(record))
            else:
                slots = asyncio.Semaphore(self.concurrency)

                async def bounded(record):
                    async with slots:
                        return await self._process(record)

                for futures in await asyncio.gather(*(bounded(r) for r in records)):
                    pending.extend(futures)
            done += len(records)
            if pending:
                await asyncio.gather(*pending)
            await self._consumer.commit(offsets)
            if max_records is not None and done >= max_records:
                break
        return done

    async def _process(self, record: ConsumerRecord) -> list[asyncio.Future]:
        """Decodes and handles one record; returns the delivery futures of its outputs."""
        parent = telemetry.extract_context(record.headers)
        with self._tracer.start_as_current_span(
            f"{record.topic} process", context=parent, kind=trace.SpanKind.CONSUMER
        ) as span:
            span.set_attribute("messaging.system", "kafka")
            span.set_attribute("messaging.destination.name", record.topic)
            span.set_attribute("messaging.kafka.offset", record.offset)
            try:
                message = messages.decode(
                    record.value,
                    self.schemas[record.topic],
                    schema=telemetry.header_value(record.headers, H_SCHEMA),
                    content_type=telemetry.header_value(record.headers, H_CONTENT_TYPE),
                )
            except messages.MessageDecodeError as exc:
                await self._dead_letter(record, f"undecodable: {exc}")
                return []
            incoming = Incoming(record.topic, record.partition, record.offset, record.key, message, record.headers)
            for attempt in range(1, self.max_attempts + 1):
                try:
                    outputs = list(await self.handler(incoming) or ())
                except Reject as exc:
                    await self._dead_letter(record, f"rejected: {exc}")
                    return []
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # a handler bug or a transient outage: retry, then DLQ
                    log.warning("handler failed on %s@%d (attempt %d/%d): %r",
                                record.topic, record.offset, attempt, self.max_attempts, exc)
                    if attempt == self.max_attempts:
                        where = traceback.extract_tb(exc.__traceback__)[-1]
                        await self._dead_letter(
                            record,
                            f"handler failed {attempt} times: {type(exc).__name__}: {exc} "
                            f"(at {where.filename}:{where.lineno})",
                        )
                        return []
                    await asyncio.sleep(0.1 * 2**attempt)
                    continue
                self.handled += 1
                return [await self.producer.send(o.topic, o.message, o.key) for o in outputs]
        return []

    async def _dead_letter(self, record: ConsumerRecord, reason: str) -> None:
        span = trace.get_current_span()
        span.set_status(trace.Status(trace.StatusCode.ERROR, reason[:200]))
        log.warning("dead-lettering %s[%d]@%d: %s", record.topic, record.partition, record.offset, reason)
        kept = [(k, v) for k, v in (record.headers or ()) if k not in (H_DLQ_REASON, H_DLQ_SOURCE)]
        headers = kept + [
            (H_DLQ_REASON, reason.encode("utf-8", "replace")[:4000]),
            (H_DLQ_SOURCE, f"{record.topic}/{record.partition}@{record.offset}".encode()),
        ]
        await self.producer.send_raw(record.topic + DLQ_SUFFIX, record.value, record.key, headers)
        self.dead_lettered += 1


async def ensure_topics(
    names: Iterable[str],
    *,
    settings: Settings | None = None,
    partitions: int = 1,
    with_dlq: bool = True,
) -> list[str]:
    """Creates the topics (and their DLQs) that do not exist yet; returns the ones created."""
    settings = settings or get_settings()
    wanted = []
    for name in names:
        full = settings.topic(name)
        wanted.append(full)
        if with_dlq and not full.endswith(DLQ_SUFFIX):
            wanted.append(full + DLQ_SUFFIX)
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [t for t in wanted if t not in existing]
        if missing:
            try:
                await admin.create_topics(
                    [NewTopic(t, num_partitions=partitions, replication_factor=1) for t in missing]
                )
            except TopicAlreadyExistsError:
                pass  # another service created it first
        return missing
    finally:
        await admin.close()


STANDARD_TOPICS = tuple(messages.TOPIC_SCHEMAS)
