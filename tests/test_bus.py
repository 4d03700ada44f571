"""The bus against a real Kafka broker: round trips, headers, the DLQ, and offsets across restarts."""
from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from google.protobuf import timestamp_pb2
from pydantic import SecretStr
from opentelemetry import trace

from crucible.v1 import (
    alert_pb2,
    execution_pb2,
    policy_pb2,
    rollout_pb2,
    task_pb2,
    trajectory_pb2,
    verdict_pb2,
)
from crucible.shared import bus, messages, telemetry

pytestmark = pytest.mark.kafka


def sample_messages() -> dict[str, object]:
    """One fully populated message per topic."""
    task = task_pb2.Task(
        id="task-1", kind="python_tests", prompt="def add(a, b):", group_size=4, split="train",
        python_tests=task_pb2.PythonTests(entry_point="add", test_code="def check(f): assert f(1, 2) == 3"),
        metadata={"source": "unit"}, created_at=timestamp_pb2.Timestamp(seconds=1_700_000_000),
    )
    group = rollout_pb2.RolloutGroup(
        group_id="g-1", task=task, policy_version=7, temperature=0.7, top_p=0.9, prompt_token_ids=[1, 2],
        backend="torch", rollouts=[rollout_pb2.Rollout(
            id="g-1/0", sample_index=0, completion="    return a + b", token_ids=[5, 6, 7],
            logprobs=[-0.5, -1.25, -0.125], finish_reason=rollout_pb2.FINISH_REASON_STOP)],
    )
    result = execution_pb2.ExecutionResult(
        exit_code=0, tests=[execution_pb2.TestOutcome(name="t1", passed=True)], stdout=b"ok\n",
        isolation=execution_pb2.ISOLATION_LEVEL_FULL, usage=execution_pb2.ResourceUsage(cpu_user_s=0.01),
    )
    sample = trajectory_pb2.Trajectory(
        id="g-1/0", task_id="task-1", group_id="g-1", sample_index=0, group_size=1, policy_version=7,
        prompt_token_ids=[1, 2], completion_token_ids=[5, 6, 7], logprobs=[-0.5, -1.25, -0.125],
        temperature=0.7, top_p=0.9, passed=True)
    verdict = verdict_pb2.Verdict(
        id="v-1", sample=sample, components={"tests_passed": 1.0, "tests_total": 1.0}, reward=1.0,
        execution=result, task_kind="python_tests",
    )
    trained = trajectory_pb2.Trajectory()
    trained.CopyFrom(sample)
    trained.reward, trained.advantage, trained.estimator, trained.group_complete = 1.0, 0.5, "grpo", True
    return {
        "tasks": task,
        "rollouts": group,
        "executions": execution_pb2.Execution(id="e-1", group=group, results=[result]),
        "verdicts": verdict_pb2.VerdictGroup(verdicts=[verdict]),
        "trajectories": trained,
        "policy": policy_pb2.PolicyVersion(run_id="run", version=3, checkpoint_uri="file:///tmp/ckpt",
                                           metrics=policy_pb2.StepMetrics(loss=0.25, kl=0.01)),
        "alerts": alert_pb2.Alert(id="a-1", kind="entropy_collapse", severity=alert_pb2.SEVERITY_WARNING,
                                  message="entropy fell below 0.1", details={"entropy": "0.05"}),
    }


async def collect(consumer: bus.Consumer, n: int, timeout: float = 30.0) -> None:
    await asyncio.wait_for(consumer.run(max_records=n), timeout)


async def publish_tasks(settings, prefix: str, n: int) -> None:
    """Tasks `<prefix>0` .. `<prefix>{n-1}` on the tasks topic, each keyed by its id."""
    await bus.ensure_topics(["tasks"], settings=settings)
    async with bus.Producer(settings) as producer:
        for i in range(n):
            task = task_pb2.Task(id=f"{prefix}{i}", kind="exact", group_size=1)
            await producer.send("tasks", task, key=task.id)
        await producer.flush()


async def read_raw(settings, topic: str, n: int, timeout: float = 20.0):
    """Reads `n` records from the start of a topic with a plain aiokafka consumer."""
    consumer = AIOKafkaConsumer(settings.topic(topic), bootstrap_servers=settings.kafka_bootstrap,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    records = []
    try:
        async def fill():
            while len(records) < n:
                for batch in (await consumer.getmany(timeout_ms=500)).values():
                    records.extend(batch)
        await asyncio.wait_for(fill(), timeout)
    finally:
        await consumer.stop()
    return records


async def test_every_message_type_round_trips_with_headers(settings):
    telemetry.setup_telemetry("test-bus")
    samples = sample_messages()
    await bus.ensure_topics(samples, settings=settings)
    tracer = telemetry.tracer("test")
    sent_trace_ids = {}
    async with bus.Producer(settings) as producer:
        for topic, message in samples.items():
            with tracer.start_as_current_span(f"send {topic}") as span:
                await producer.send_and_wait(topic, message, key=f"k-{topic}")
                sent_trace_ids[topic] = span.get_span_context().trace_id

    received: dict[str, bus.Incoming] = {}
    consumer_trace_ids = {}

    async def handler(incoming: bus.Incoming):
        topic = incoming.topic.removeprefix(settings.topic_prefix)
        received[topic] = incoming
        consumer_trace_ids[topic] = trace.get_current_span().get_span_context().trace_id

    async with bus.Consumer(list(samples), "roundtrip", handler, settings=settings) as consumer:
        await collect(consumer, len(samples))

    assert set(received) == set(samples)
    for topic, message in samples.items():
        got = received[topic]
        assert got.message == message, topic
        assert type(got.message) is type(message)
        assert got.key == f"k-{topic}".encode()
        headers = dict(got.headers)
        assert headers["schema"] == message.DESCRIPTOR.full_name.encode()
        assert headers["content-type"] == b"application/x-protobuf"
        traceparent = headers["traceparent"].decode()
        # 00-<trace id>-<span id>-<flags>: the producer's trace continues in the consumer.
        assert traceparent.split("-")[1] == format(sent_trace_ids[topic], "032x")
        assert consumer_trace_ids[topic] == sent_trace_ids[topic]


async def test_garbage_goes_to_dlq_with_reason_and_consumer_continues(settings):
    await bus.ensure_topics(["tasks"], settings=settings)
    good_before = task_pb2.Task(id="before", kind="exact", prompt="1+1?", group_size=1)
    good_after = task_pb2.Task(id="after", kind="exact", prompt="2+2?", group_size=1)
    raw = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap)
    await raw.start()
    topic = settings.topic("tasks")
    try:
        await raw.send_and_wait(topic, messages.encode(good_before))
        await raw.send_and_wait(topic, b"\xff\x00 this is not protobuf \x13\x37", key=b"junk")
        await raw.send_and_wait(topic, messages.encode(good_before), headers=[("schema", b"crucible.v1.Rollout")])
        await raw.send_and_wait(topic, b'{"id": "json-task", "kind": "exact", "prompt": "3+3?", "group_size": 2}',
                                headers=[("content-type", b"application/json")])
        await raw.send_and_wait(topic, b'{"id": 12, "no_such_field": true}')
        await raw.send_and_wait(topic, messages.encode(good_after))
    finally:
        await raw.stop()

    seen = []

    async def handler(incoming):
        seen.append(incoming.message.id)

    async with bus.Consumer(["tasks"], "dlq", handler, settings=settings) as consumer:
        await collect(consumer, 6)
        assert consumer.dead_lettered == 3

    assert seen == ["before", "json-task", "after"]
    dead = await read_raw(settings, "tasks.dlq", 3)
    reasons = [dict(r.headers)["dlq-reason"].decode() for r in dead]
    assert "undecodable" in reasons[0] and "protobuf" in reasons[0]
    assert dead[0].value == b"\xff\x00 this is not protobuf \x13\x37"  # the original bytes, untouched
    assert dead[0].key == b"junk"
    assert dict(dead[0].headers)["dlq-source"].decode() == f"{topic}/0@1"
    assert "crucible.v1.Rollout" in reasons[1]
    assert "JSON does not match" in reasons[2]


async def test_a_record_too_large_to_send_again_is_dead_lettered_cut_and_the_consumer_goes_on(settings):
    # The broker takes a record a producer may not send (16 MiB): dead-lettering it whole failed, and
    # the consumer stopped at every restart. Both ways a consumer dead-letters (at once, and within its
    # transaction) keep the first MiB and name what was cut.
    import hashlib

    await bus.ensure_topics(["tasks", "heldout"], settings=settings, with_dlq=True)
    huge = b"\x0a" + b"x" * (messages.MAX_MESSAGE_BYTES + 200_000)
    raw = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap, max_request_size=17 << 20)
    await raw.start()
    try:
        for short in ("tasks", "heldout"):
            await raw.send_and_wait(settings.topic(short), huge, key=b"k" * 5000)
            await raw.send_and_wait(settings.topic(short), messages.encode(task_pb2.Task(id=f"after-{short}")))
    finally:
        await raw.stop()
    for short, transactional in (("tasks", False), ("heldout", True)):
        seen = []

        async def handler(incoming):
            seen.append(incoming.message.id)

        async with bus.Consumer([short], f"big-{short}", handler, settings=settings, transactional=transactional,
                                schemas={short: task_pb2.Task}) as consumer:
            await collect(consumer, 2)
            assert consumer.dead_lettered == 1
        assert seen == [f"after-{short}"]
        [dead] = await read_raw(settings, f"{short}.dlq", 1)
        headers = dict(dead.headers)
        assert "exceeds the 16777216-byte limit" in headers["dlq-reason"].decode(), headers
        assert dead.value == huge[:bus.DLQ_MAX_VALUE_BYTES] and dead.key == b"k" * bus.DLQ_MAX_KEY_BYTES
        assert f"value {len(huge)} bytes, sha256 {hashlib.sha256(huge).hexdigest()}" in headers["dlq-cut"].decode()


async def test_committed_offsets_survive_restart_nothing_lost_or_repeated(settings):
    n = 60
    await publish_tasks(settings, "t", n)

    seen: list[str] = []

    async def handler(incoming):
        seen.append(incoming.message.id)

    # Batches of 7: commits travel while the next batches are handled, and the last one lands before
    # run() returns.
    async with bus.Consumer(["tasks"], "restart", handler, settings=settings, batch_size=7) as first:
        await collect(first, 25)
    assert len(seen) == 25
    # A new consumer in the same group resumes exactly after the last committed record.
    async with bus.Consumer(["tasks"], "restart", handler, settings=settings) as second:
        await collect(second, n - 25)
        assert await second.run(idle_timeout_s=1.5) == 0  # and there is nothing more
    assert sorted(seen, key=lambda s: int(s[1:])) == [f"t{i}" for i in range(n)]
    assert len(set(seen)) == n


async def test_batches_handled_while_a_commit_travels_go_with_the_next_commit_and_never_too_many(settings):
    """One commit at a time: the batches handled while it travels are committed together by the next,
    and a commit that does not come back holds the consumer once COMMIT_BATCHES_BEHIND batches are
    uncommitted, counting its own (what a crash would make it read again, with the batch in hand)."""
    n = 60
    await publish_tasks(settings, "c", n)
    seen: list[str] = []
    sent: list[dict] = []
    release = asyncio.Event()

    async def handler(incoming):
        seen.append(incoming.message.id)

    async with bus.Consumer(["tasks"], "coalesced", handler, settings=settings, batch_size=5) as consumer:
        real_commit = consumer.commit

        async def slow(offsets=None):
            sent.append(dict(offsets))
            if len(sent) == 1:
                await release.wait()  # the first commit does not come back until released
            await real_commit(offsets)

        consumer.commit = slow
        run = asyncio.ensure_future(consumer.run(max_records=n))
        for _ in range(100):
            await asyncio.sleep(0.1)
            if len(seen) >= 5 * (1 + bus.COMMIT_BATCHES_BEHIND):
                break
        await asyncio.sleep(0.5)
        assert len(seen) == 5 * (1 + bus.COMMIT_BATCHES_BEHIND)  # held there, not before, not after
        assert len(sent) == 1
        release.set()
        assert await asyncio.wait_for(run, 20) == n
    (topic_partition, first), = sent[0].items()
    assert first == 5
    # The second commit carried the four batches owed while the first travelled, at the last one's offset.
    assert sent[1] == {topic_partition: 5 * (1 + bus.COMMIT_BATCHES_BEHIND)}
    assert sent[-1] == {topic_partition: n} and len(sent) < n // 5
    async with bus.Consumer(["tasks"], "coalesced", handler, settings=settings) as again:
        assert await again.run(idle_timeout_s=1.5) == 0  # everything was committed
    assert seen == [f"c{i}" for i in range(n)]


async def test_offsets_of_a_partition_no_longer_held_are_left_to_its_new_owner_and_the_rest_committed(settings):
    """Offsets owed for a partition a rebalance took away (its records are read again by the member that
    has it now) do not fail the commit of the partitions still held."""
    await publish_tasks(settings, "r", 3)
    async with bus.Reader(["tasks"], "rebalanced", settings=settings) as reader:
        records = await reader.fetch_raw(max_records=3, timeout_ms=10_000)
        assert len(records) == 3
        topic = records[0].topic
        await reader.commit({(topic, 0): 2, (topic, 7): 5, (settings.topic("rollouts"), 0): 9})
        assert await reader._consumer.committed(TopicPartition(topic, 0)) == 2


async def test_a_cancelled_run_is_not_held_by_a_commit_that_hangs_and_loses_nothing(settings):
    """A batch's commit travels while the next batch is handled. When run() is cancelled (a service
    stopping) with a commit that does not come back (a broker gone), run() still ends, cancelled,
    after a bounded wait; what was not committed is read again by the next consumer."""
    n = 30
    await publish_tasks(settings, "h", n)
    seen: list[str] = []
    hung = asyncio.Event()
    stall = [True]

    async def handler(incoming):
        seen.append(incoming.message.id)
        if incoming.message.id == "h12" and stall[0]:
            await asyncio.sleep(3600)  # in the third batch, while the second one's commit is out

    async with bus.Consumer(["tasks"], "hung-commit", handler, settings=settings, batch_size=5) as first:
        await collect(first, 5)  # the first batch, committed as usual

        async def hangs(offsets=None):
            hung.set()
            await asyncio.sleep(3600)

        first.commit = hangs
        run = asyncio.ensure_future(first.run())
        await asyncio.wait_for(hung.wait(), 20)
        await asyncio.sleep(0.2)  # run() is in the handler of h12, the commit still out
        run.cancel()
        started = asyncio.get_running_loop().time()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(run, 20)
        assert asyncio.get_running_loop().time() - started < bus.COMMIT_SETTLE_S + 2
    stall[0] = False
    async with bus.Consumer(["tasks"], "hung-commit", handler, settings=settings) as second:
        await second.run(idle_timeout_s=2.0)
    assert set(seen) == {f"h{i}" for i in range(n)}
    assert seen[:5] == [f"h{i}" for i in range(5)] and seen.count("h0") == 1  # the committed batch is not read again


async def test_records_left_over_from_a_batch_never_wait_for_the_brokers_hold_on_idle_topics(settings):
    """A consumer of two topics, one with more records than a batch, the other idle. Records the
    client still held once a batch was handed out used to stop it fetching their topic while it
    fetched the idle one alone, in a request the broker holds until a record arrives there or the
    fetch wait ends: a new record on the busy topic then waited for that (here 60 s)."""
    await bus.ensure_topics(["tasks", "rollouts"], settings=settings)
    seen: list[str] = []

    async def handler(incoming):
        seen.append(incoming.message.id)
        await asyncio.sleep(0.003)  # a batch of 100 takes longer than the client's 100 ms for leftovers

    async with bus.Producer(settings) as producer:
        for i in range(150):
            await producer.send("tasks", task_pb2.Task(id=f"t{i}", kind="exact", group_size=1), key=f"t{i}")
        await producer.flush()
        async with bus.Consumer(["tasks", "rollouts"], "leftovers", handler, settings=settings,
                                fetch_max_wait_ms=60_000) as consumer:
            await collect(consumer, 150)  # a batch of 100, then the 50 left over
            await asyncio.sleep(0.5)
            await producer.send_and_wait("tasks", task_pb2.Task(id="late", kind="exact", group_size=1), key="late")
            await collect(consumer, 1, timeout=20.0)
    assert seen == [f"t{i}" for i in range(150)] + ["late"]


async def test_records_arriving_while_a_handler_is_slow_never_wait_for_the_brokers_hold_on_idle_topics(settings):
    """A consumer of two topics, one busy, one idle. A record that arrived while the handler was busy
    with another for longer than 100 ms sat in the client's buffer, and the client then fetched the
    idle topic alone, in a request the broker holds until the fetch wait ends (here 60 s): the busy
    topic's next record waited for it (in the pipeline a step's rollouts waited 4 s)."""
    await bus.ensure_topics(["tasks", "rollouts"], settings=settings)
    seen: list[str] = []
    busy = asyncio.Event()

    async def handler(incoming):
        seen.append(incoming.message.id)
        if incoming.message.id == "slow":
            busy.set()
            await asyncio.sleep(1.0)

    def task(name: str) -> task_pb2.Task:
        return task_pb2.Task(id=name, kind="exact", group_size=1)

    async with bus.Producer(settings) as producer:
        async with bus.Consumer(["tasks", "rollouts"], "slow-handler", handler, settings=settings,
                                fetch_max_wait_ms=60_000) as consumer:
            running = asyncio.create_task(collect(consumer, 3, timeout=40.0))
            await producer.send_and_wait("tasks", task("slow"), key="k")
            await asyncio.wait_for(busy.wait(), 20)
            await producer.send_and_wait("tasks", task("during"), key="k")  # arrives while the handler is busy
            while "during" not in seen:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            await producer.send_and_wait("tasks", task("after"), key="k")
            await asyncio.wait_for(running, 20)  # not the 60 s the broker may hold the idle topic's fetch
    assert seen == ["slow", "during", "after"]


async def test_the_end_is_told_beside_the_readers_held_fetch_past_commit_markers_and_nothing_unread_is_lost(
        settings):
    """A reader of a topic written in transactions (a commit marker after each version), whose own
    fetch the broker holds open on the idle topic (here up to 60 s): at_end answers without waiting
    that out (it used to: a generator's start took 5 s), passes the marker after the last record, and
    says no while a record is unread, which the next fetch then returns."""
    await bus.ensure_topics(["policy"], settings=settings)
    topic = TopicPartition(settings.topic("policy"), 0)
    async with bus.Producer(settings, transactional_id="at-end") as producer:
        async def publish(version: int) -> None:
            async with producer._producer.transaction():
                await producer.send("policy", policy_pb2.PolicyVersion(run_id="r", version=version), key="r")
            # Readable once its commit marker is written (after the commit returns): the end moves then.
            watcher = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap, isolation_level="read_committed")
            await watcher.start()
            try:
                while (await watcher.end_offsets([topic]))[topic] < 2 * version:  # a record and a marker each
                    await asyncio.sleep(0.05)
            finally:
                await watcher.stop()

        await publish(1)
        async with bus.Reader(["policy"], None, settings=settings, offsets={"policy": {}}, dead_letters=False,
                              fetch_max_wait_ms=60_000) as reader:
            for version in (1, 2, 3):
                if version > 1:
                    await publish(version)
                assert not await asyncio.wait_for(reader.at_end(), 30)  # the version is not read yet
                got = await reader.fetch(timeout_ms=5000)
                assert [i.message.version for i in got] == [version]
                await asyncio.sleep(1.0)  # the reader's next fetch is sent, and held by the broker
                assert await asyncio.wait_for(reader.at_end(), 30)


async def test_handler_outputs_are_produced_and_rejects_dead_lettered(settings):
    await bus.ensure_topics(["tasks", "rollouts"], settings=settings)
    attempts = {"flaky": 0}

    async def handler(incoming):
        task = incoming.message
        if task.group_size == 0:
            raise bus.Reject(f"task {task.id!r}: group_size must be at least 1")
        if task.id == "flaky" and attempts["flaky"] < 1:
            attempts["flaky"] += 1
            raise ConnectionError("transient outage")
        return [bus.Outgoing("rollouts", rollout_pb2.RolloutGroup(group_id=f"{task.id}-{i}", task=task),
                             key=task.id) for i in range(task.group_size)]

    async with bus.Producer(settings) as producer:
        await producer.send_and_wait("tasks", task_pb2.Task(id="zero", kind="exact", group_size=0))
        await producer.send_and_wait("tasks", task_pb2.Task(id="flaky", kind="exact", group_size=2))
    async with bus.Consumer(["tasks"], "outputs", handler, settings=settings) as consumer:
        await collect(consumer, 2)
    rollouts = await read_raw(settings, "rollouts", 2)
    assert [messages.decode(r.value, rollout_pb2.RolloutGroup).group_id for r in rollouts] == ["flaky-0", "flaky-1"]
    dead = await read_raw(settings, "tasks.dlq", 1)
    assert "group_size must be at least 1" in dict(dead[0].headers)["dlq-reason"].decode()


async def test_a_reader_given_offsets_starts_exactly_there_and_keeps_trace_context(settings):
    """The learner's way in: its checkpoint's positions win over the group's committed offsets."""
    telemetry.setup_telemetry("test-bus")
    await bus.ensure_topics(["tasks"], settings=settings)
    tracer = telemetry.tracer("test")
    async with bus.Producer(settings) as producer:
        with tracer.start_as_current_span("publish") as span:
            for i in range(10):
                await producer.send_and_wait("tasks", task_pb2.Task(id=f"t{i}", kind="exact", prompt="p", group_size=1))
            trace_id = span.get_span_context().trace_id
        await producer.send_and_wait("tasks.dlq", task_pb2.Task(id="unrelated"))  # a topic of its own
    async with bus.Consumer(["tasks"], "seek", lambda incoming: asyncio.sleep(0), settings=settings) as first:
        await collect(first, 8)  # the group has committed 8
    async with bus.Reader(["tasks"], "seek", settings=settings, offsets={"tasks": {0: 3}}) as reader:
        got = []
        while len(got) < 7:
            got += await reader.fetch(max_records=10, timeout_ms=500)
        assert [i.message.id for i in got] == [f"t{i}" for i in range(3, 10)]
        assert reader.positions[(settings.topic("tasks"), 0)] == 10
        parent = trace.get_current_span(got[0].context).get_span_context()
        assert parent.trace_id == trace_id  # work done later on a record joins the producer's trace
        await reader.commit({(settings.topic("tasks"), 0): 5})
    async with bus.Consumer(["tasks"], "seek", lambda incoming: asyncio.sleep(0), settings=settings) as again:
        assert await again.run(max_records=5, idle_timeout_s=5) == 5  # resumes at the committed 5


@pytest.mark.kafka
async def test_sasl_settings_reach_every_client(kafka_broker, settings):
    from tests.conftest import SASL_PASSWORD, SASL_USER

    if kafka_broker is None:
        pytest.skip("an external broker: its SASL listener is not ours to configure")
    sasl = settings.model_copy(update={
        "kafka_bootstrap": f"127.0.0.1:{kafka_broker.sasl_port}", "kafka_security_protocol": "SASL_PLAINTEXT",
        "kafka_sasl_username": SASL_USER, "kafka_sasl_password": SecretStr(SASL_PASSWORD)})
    await bus.ensure_topics(["tasks"], settings=sasl)  # the admin client
    async with bus.Producer(sasl) as producer:
        await producer.send_and_wait("tasks", task_pb2.Task(id="over-sasl", kind="exact", prompt="p", group_size=1))
    seen = []

    async def handle(incoming):
        seen.append(incoming.message.id)
        return []

    async with bus.Consumer(["tasks"], "sasl-reader", handle, settings=sasl, dead_letters=False) as consumer:
        await asyncio.wait_for(consumer.run(max_records=1), 60)
    assert seen == ["over-sasl"]
    wrong = sasl.model_copy(update={"kafka_sasl_password": SecretStr("not-the-password")})
    with pytest.raises(Exception):
        async with bus.Producer(wrong) as producer:
            await asyncio.wait_for(producer.send_and_wait("tasks", task_pb2.Task(id="x", kind="exact", prompt="p")), 20)
    assert SASL_PASSWORD not in repr(sasl) and SASL_PASSWORD not in str(sasl.model_dump())


async def test_topics_whose_consumers_scale_out_get_the_configured_partitions(settings):
    """A consumer group has at most one active member per partition: the work topics get
    kafka_topic_partitions, so several generators or sandboxes share them; the rest keep one."""
    settings = settings.model_copy(update={"kafka_topic_partitions": 3})
    await bus.ensure_topics(["tasks", "rollouts", "verdicts", "policy"], settings=settings)
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**bus.connection(settings))
    await admin.start()
    names = ("tasks", "rollouts", "verdicts", "policy", "tasks" + bus.DLQ_SUFFIX)
    try:
        described = await admin.describe_topics([settings.topic(n) for n in names])
    finally:
        await admin.close()
    by_topic = {d["topic"]: len(d["partitions"]) for d in described}
    counts = {name: by_topic[settings.topic(name)] for name in names}
    assert counts == {"tasks": 3, "rollouts": 3, "verdicts": 1, "policy": 1, "tasks" + bus.DLQ_SUFFIX: 1}
    # Two members of one group on the tasks topic: each is given partitions, so both get work.
    members = [AIOKafkaConsumer(settings.topic("tasks"), group_id=settings.consumer_group_prefix + "gen",
                                **bus.connection(settings)) for _ in range(2)]
    for m in members:
        await m.start()
    try:
        for _ in range(100):
            if all(m.assignment() for m in members):
                break
            await asyncio.gather(*(m.getmany(timeout_ms=100) for m in members))
        assert all(m.assignment() for m in members), [m.assignment() for m in members]
    finally:
        for m in members:
            await m.stop()


async def test_records_handled_in_order_each_run_under_their_own_trace():
    """A consumer handling a batch in order keeps an unsampled trace's context current across its
    records that follow each other; every record's handler still sees its own trace (a sampled one
    under a consumer span of its own, one with no trace context in a new trace), and the context
    before the batch is the context after it."""
    from aiokafka.structs import ConsumerRecord
    from opentelemetry import context as otel_context
    from crucible.shared.settings import Settings

    telemetry.setup_telemetry("test-bus")  # the SDK's provider, which follows a remote parent's flag

    def traceparent(trace_id: int, flags: int) -> tuple[str, bytes]:
        return ("traceparent", f"00-{trace_id:032x}-{trace_id + 1:016x}-{flags:02x}".encode())

    a, b, c = traceparent(0xA, 0), traceparent(0xB, 1), traceparent(0xC, 0)
    sent = [("a1", a), ("a2", a), ("b1", b), ("n1", None), ("a3", a), ("c1", c), ("x1", ("traceparent", b"00-zz")),
            ("a4", a)]
    topic = "in-order.tasks"
    records = [ConsumerRecord(topic, 0, offset, 0, 0, None, messages.encode(task_pb2.Task(id=name, kind="exact")),
                              None, 0, 0, bus.publish_headers(task_pb2.Task()) + ([header] if header else []))
               for offset, (name, header) in enumerate(sent)]
    seen = {}

    async def handler(incoming):
        await asyncio.sleep(0)  # other tasks run meanwhile, as they do
        span = trace.get_current_span()
        seen[incoming.message.id] = (span.get_span_context(), span.is_recording(), getattr(span, "parent", None),
                                     dict(telemetry.inject_headers()))

    consumer = bus.Consumer(["tasks"], "in-order", handler, settings=Settings(topic_prefix="in-order."))
    before = otel_context.get_current()
    assert await consumer._run_batch(records) == {(topic, 0): len(sent)}
    assert otel_context.get_current() is before and consumer.handled == len(sent)
    for name in ("a1", "a2", "a3", "a4", "c1"):  # unsampled: the producer's context as it came, no span made
        context, recording, _, headers = seen[name]
        header = a if name[0] == "a" else c
        assert not recording and headers == {"traceparent": header[1]}, name
        assert (context.trace_id, context.span_id) == (int(name[0], 16), int(name[0], 16) + 1), name
    context, recording, parent, headers = seen["b1"]  # sampled: a consumer span, child of the producer's
    assert recording and context.trace_id == 0xB and context.span_id != 0xC and parent.span_id == 0xC
    assert headers["traceparent"] != b[1]
    for name in ("n1", "x1"):  # no (readable) trace context: a trace of its own
        context, _, parent, _ = seen[name]
        assert parent is None and context.trace_id not in (0xA, 0xB, 0xC), name


async def test_records_are_handed_over_as_fetched_and_positions_follow_what_was_handed():
    """The reader carries what the client fetched as runs of one partition: a fetch may end inside a
    run, positions (and a consumer's commit) are the last handed record's, and a partition taken away
    by a rebalance loses its carried records, nothing else."""
    from aiokafka.structs import ConsumerRecord
    from crucible.shared.settings import Settings

    def run(partition: int, offsets: range) -> list:
        return [ConsumerRecord("carry.tasks", partition, o, 0, 0, None, b"", None, 0, 0, []) for o in offsets]

    reader = bus.Reader(["tasks"], "carry", settings=Settings(topic_prefix="carry."))
    reader._carry([run(0, range(0, 3)), run(1, range(10, 14)), run(0, range(3, 5))])
    assert reader._carried_count == 9

    first = await reader.fetch_raw(max_records=5, timeout_ms=0)
    assert [(r.partition, r.offset) for r in first] == [(0, 0), (0, 1), (0, 2), (1, 10), (1, 11)]
    assert reader.taken == {("carry.tasks", 0): (3, 3), ("carry.tasks", 1): (12, 2)}
    assert reader.positions == {("carry.tasks", 0): 3, ("carry.tasks", 1): 12}
    assert reader._carried_count == 4

    bus._DropCarried(reader).on_partitions_revoked([TopicPartition("carry.tasks", 1)])
    rest = await reader.fetch_raw(max_records=5, timeout_ms=0)
    assert [(r.partition, r.offset) for r in rest] == [(0, 3), (0, 4)]
    assert reader.taken == {("carry.tasks", 0): (5, 2)} and reader.positions[("carry.tasks", 0)] == 5
    assert reader._carried_count == 0 and await reader.fetch_raw(max_records=5, timeout_ms=0) == []

    async def handler(incoming):
        return None

    consumer = bus.Consumer(["tasks"], "carry", handler, settings=Settings(topic_prefix="carry."))
    value, headers = messages.encode(task_pb2.Task(id="t", kind="exact")), bus.publish_headers(task_pb2.Task())
    records = [ConsumerRecord(r.topic, r.partition, r.offset, 0, 0, None, value, None, 0, 0, list(headers))
               for r in run(2, range(7, 9)) + run(3, range(0, 1)) + run(2, range(9, 10))]
    # Offsets of a batch without what fetch_raw took: worked out from the records, the last of each partition.
    assert await consumer._run_batch(records) == {("carry.tasks", 2): 10, ("carry.tasks", 3): 1}
