"""Kafka figures: local broker start time, produce and consume rates for 1 KiB messages.

    python bench/bench_kafka.py [--messages 20000] [--rounds 6] [--warmup 1]

Starts its own broker on free ports (fresh storage, so the start time includes
formatting), then measures in the same run:
  - produce: bare aiokafka (bytes, no key, no headers) vs the bus Producer (protobuf, signed
    tasks, keyed, schema and trace headers, idempotent, acks=all), traces sampled and not;
  - consume: bare aiokafka getmany, committing after each batch, on the bare records and on the bus's
    own (keyed, with schema, content-type and traceparent headers, in the bus producer's larger
    batches: against these, what the bus adds to reading the very same records); bare aiokafka on
    the bus's records committing as the bus does (one commit at a time, taking every batch handled
    while the one before travelled: bus.Commits), the like-for-like baseline; vs the bus Consumer
    (each fetched batch's CRC-32C checked with the processor's CRC instruction, shared/fetch_crc.py,
    where aiokafka's own check is table-driven; decode, handler span, commits after outputs are
    acknowledged, as run() makes them), twice: records whose trace is sampled (every one gets a
    consumer span, encoded as the store writer encodes it, then dropped: there is no store here)
    and records whose trace is not (head sampling upstream: only the trace context is carried on).
The five readers take turns, `--rounds` times (the order reversed every other round), each round in fresh
consumer groups, after `--warmup` rounds that are not counted (the broker's fetch path and each reader's
code warm: whichever read first in a cold round read at two thirds of its later rate), and the medians are
printed: each rate, its ratio to the bare baseline, and the reader's own CPU a message (the part of a rate
that is the client's, whatever the broker and the machine's other tenants do meanwhile).
Not a test: nothing gates on it.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import tempfile
import time
from pathlib import Path


from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition  # noqa: E402

from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult  # noqa: E402

from crucible.v1 import task_pb2  # noqa: E402
from crucible.shared import bus, messages, service, span_store, telemetry  # noqa: E402
from crucible.local.kafka import LocalKafka  # noqa: E402
from crucible.shared.procs import free_port  # noqa: E402
from crucible.shared.settings import Settings  # noqa: E402


def payload_task(i: int) -> task_pb2.Task:
    task = task_pb2.Task(id=f"t{i:08d}", kind="exact", group_size=1, answer=task_pb2.ExpectedAnswer(answer="x"))
    task.prompt = "p" * (1024 - len(messages.encode(task)) - 3)  # ~1 KiB encoded
    return task


async def produce_bare(settings: Settings, topic: str, values: list[bytes]) -> float:
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap, linger_ms=5, acks="all",
                                enable_idempotence=True)
    await producer.start()
    started = time.perf_counter()
    futures = [await producer.send(topic, v) for v in values]
    await asyncio.gather(*futures)
    took = time.perf_counter() - started
    await producer.stop()
    return len(values) / took


class EncodeOnly(SpanExporter):
    """What the store's span writer does with each span before its insert (shared/span_store.py)."""

    def export(self, spans):
        span_store.json_rows(spans)
        return SpanExportResult.SUCCESS


async def produce_bus(settings: Settings, tasks: list[task_pb2.Task], topic: str = "tasks") -> float:
    async with bus.Producer(settings) as producer:
        started = time.perf_counter()
        futures = [await producer.send(topic, t, key=t.id) for t in tasks]
        await asyncio.gather(*futures)
        return len(tasks) / (time.perf_counter() - started)


async def produce_unsampled(settings: Settings, tasks: list[task_pb2.Task], topic: str) -> float:
    """The tasks published inside a trace that head sampling left out (its flags say not sampled)."""
    unsampled = trace.NonRecordingSpan(trace.SpanContext(0x1F, 0x2F, is_remote=True,
                                                         trace_flags=trace.TraceFlags(trace.TraceFlags.DEFAULT)))
    with trace.use_span(unsampled):
        return await produce_bus(settings, tasks, topic)


# A reading: messages a second, and this process's CPU a message (microseconds). The rate on a shared
# 2-core machine also waits on the broker; the CPU a message is the reader's own cost.
Reading = tuple[float, float]


async def consume_bare(settings: Settings, topic: str, n: int, round_: int = 0, coalesced: bool = False) -> Reading:
    """getmany, committing each batch's offsets before the next getmany; `coalesced`: as the bus commits
    (bus.Commits: one commit at a time, taking every batch handled meanwhile)."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=settings.kafka_bootstrap,
                                group_id=f"bench-bare-{topic}-{round_}-{coalesced}",
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    commits = bus.Commits(lambda offsets: consumer.commit({TopicPartition(*k): o for k, o in offsets.items()}))
    got = 0
    started = cpu = None
    while got < n:
        batches = await consumer.getmany(timeout_ms=1000, max_records=500)
        if started is None and batches:
            started, cpu = time.perf_counter(), time.process_time()
        for tp, records in batches.items():
            got += len(records)
            if not coalesced:
                await consumer.commit({tp: records[-1].offset + 1})
        if coalesced and batches:
            await commits.owe({(tp.topic, tp.partition): records[-1].offset + 1 for tp, records in batches.items()})
    await commits.flush()
    took, cpu = time.perf_counter() - started, time.process_time() - cpu
    await consumer.stop()
    return n / took, cpu / n * 1e6


async def consume_bus(settings: Settings, n: int, topic: str = "tasks", round_: int = 0) -> Reading:
    async def handler(incoming):
        return None

    async with bus.Consumer([topic], f"bench-bus-{topic}-{round_}", handler, settings=settings, batch_size=500,
                            schemas={topic: task_pb2.Task}) as consumer:
        await consumer.run(max_records=1)  # join the group and fetch before the clock starts
        started, cpu = time.perf_counter(), time.process_time()
        await consumer.run(max_records=n - 1)
        return (n - 1) / (time.perf_counter() - started), (time.process_time() - cpu) / (n - 1) * 1e6


async def run(settings: Settings, n: int, rounds: int = 6, warmup: int = 1) -> None:
    service.tune_gc()  # as every service process runs (service.setup); every reader here runs with it
    telemetry.setup_telemetry("bench-kafka", settings)
    trace.get_tracer_provider().add_span_processor(BatchSpanProcessor(
        EncodeOnly(), schedule_delay_millis=telemetry.STORE_SPANS_EVERY_MS,
        max_export_batch_size=telemetry.STORE_SPANS_PER_INSERT, max_queue_size=4 * telemetry.STORE_SPANS_PER_INSERT))
    await bus.ensure_topics(["tasks", "bare", "unsampled"], settings=settings, with_dlq=True)
    tasks = [payload_task(i) for i in range(n)]
    values = [messages.encode(t) for t in tasks]
    print(f"message size: {len(values[0])} bytes, {n} messages")
    bare_p = await produce_bare(settings, settings.topic("bare"), values)
    bus_p = await produce_bus(settings, tasks)
    bus_pu = await produce_unsampled(settings, tasks, "unsampled")
    print(f"produce  bare aiokafka : {bare_p:10.0f} msg/s  {bare_p * 1024 / 2**20:6.1f} MiB/s")
    print(f"produce  bus.Producer  : {bus_p:10.0f} msg/s  ratio to bare {bus_p / bare_p:.2f} "
          "(traces sampled: a publish span each, encoded as the store writer does; signed, keyed)")
    print(f"produce  bus.Producer  : {bus_pu:10.0f} msg/s  ratio to bare {bus_pu / bare_p:.2f} "
          "(traces not sampled: trace context carried; signed, keyed)")
    del tasks, values  # the bench's own copies of what it published: no reader's heap holds them
    gc.collect()
    # Each reader reads the same records once a round, in turn, each round in consumer groups of its own:
    # on a machine whose speed drifts (and a broker that compiles its fetch path during the first
    # rounds), medians over alternated rounds rather than one reading of each, one after the other.
    readers = {
        "bare": lambda r: consume_bare(settings, settings.topic("bare"), n, r),
        "bare_same": lambda r: consume_bare(settings, settings.topic("unsampled"), n, r),
        "bare_coalesced": lambda r: consume_bare(settings, settings.topic("unsampled"), n, r, coalesced=True),
        "bus": lambda r: consume_bus(settings, n, round_=r),
        "bus_u": lambda r: consume_bus(settings, n, "unsampled", r),
    }
    taken: dict[str, list[Reading]] = {name: [] for name in readers}
    for r in range(-warmup, rounds):
        # In the opposite order every other round: a reader's place in a round moves its reading (in an A/B
        # of two bus readers, whichever read first in a round took more CPU a record, up to a fifth), so a
        # fixed order favoured whoever came later.
        order = list(readers.items())
        for name, read in order if r % 2 == 0 else order[::-1]:
            reading = await read(r)
            if r >= 0:
                taken[name].append(reading)
            # The spans of a sampled run still queued are encoded now, not during the next reading.
            trace.get_tracer_provider().force_flush()
    rate = {name: statistics.median(x[0] for x in v) for name, v in taken.items()}
    cpu = {name: statistics.median(x[1] for x in v) for name, v in taken.items()}
    bare_c, bare_same, bus_c, bus_u = rate["bare"], rate["bare_same"], rate["bus"], rate["bus_u"]
    print(f"consume: medians of {rounds} alternated rounds after {warmup} not counted; the bus unsampled against bare "
          "aiokafka round by round: " + ", ".join(f"{u[0] / b[0]:.2f}" for u, b in zip(taken["bus_u"], taken["bare"]))
          + "; against bare committing as the bus does: "
          + ", ".join(f"{u[0] / b[0]:.2f}" for u, b in zip(taken["bus_u"], taken["bare_coalesced"])))
    print(f"consume  bare aiokafka : {bare_c:10.0f} msg/s  {cpu['bare']:5.2f} us of CPU a message (a commit after each batch)")
    coalesced = rate["bare_coalesced"]
    print(f"consume  bare aiokafka : {coalesced:10.0f} msg/s  {cpu['bare_coalesced']:5.2f} us  ratio to bare "
          f"{coalesced / bare_c:.2f} (the bus's records, committed as the bus commits them: one commit at a "
          f"time, taking every batch handled meanwhile; the bus, unsampled, reads them at {bus_u / coalesced:.2f}x this)")
    print(f"consume  bare aiokafka : {bare_same:10.0f} msg/s  {cpu['bare_same']:5.2f} us  ratio to bare {bare_same / bare_c:.2f} "
          f"(the bus's records: keyed, three headers, larger batches; the bus, unsampled, reads them at "
          f"{bus_u / bare_same:.2f}x this)")
    print(f"consume  bus.Consumer  : {bus_c:10.0f} msg/s  {cpu['bus']:5.2f} us  ratio to bare {bus_c / bare_c:.2f} "
          "(traces sampled: decode, a consumer span encoded as the store writer does, handler; commits as in run())")
    print(f"consume  bus.Consumer  : {bus_u:10.0f} msg/s  {cpu['bus_u']:5.2f} us  ratio to bare {bus_u / bare_c:.2f} "
          "(traces not sampled: decode, trace context carried, handler; commits as in run())")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=6, help="alternated consume rounds (medians reported)")
    parser.add_argument("--warmup", type=int, default=1, help="alternated consume rounds first, not counted")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        broker = LocalKafka(Path(tmp), port=free_port(), controller_port=free_port(), settings=Settings())
        took = broker.start()
        print(f"Kafka start (format + start + first metadata answer): {took:.2f}s")
        try:
            # No store here: spans are encoded for it (EncodeOnly) and dropped.
            # Every trace kept (the "sampled" run); the "unsampled" one publishes under a dropped trace.
            settings = Settings(kafka_bootstrap=broker.bootstrap, topic_prefix="bench.", otel_store_spans=False,
                                otel_trace_ratio=1.0)
            asyncio.run(run(settings, args.messages, args.rounds, args.warmup))
        finally:
            broker.stop()


if __name__ == "__main__":
    main()
