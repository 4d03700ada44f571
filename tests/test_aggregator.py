"""The reward-aggregator: pure group math, then the faust app over real Kafka and the real store."""
from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaProducer

from crucible.shared.settings import RunConfig
from crucible.v1 import alert_pb2, trajectory_pb2, verdict_pb2
from crucible.services.reward_aggregator.__main__ import run
from crucible.services.reward_aggregator.handler import RewardConfig, group_trajectories
from crucible.shared import bus, messages, store
from tests.test_bus import read_raw


def verdict(group: str, index: int, size: int, reward: float, *, tampered: bool = False,
            components: dict | None = None) -> verdict_pb2.Verdict:
    sample = trajectory_pb2.Trajectory(id=f"{group}/{index}", task_id=f"task-{group}", group_id=group,
                                       sample_index=index, group_size=size, policy_version=3,
                                       completion_token_ids=[1, 2], logprobs=[-0.5, -0.5], temperature=1.0,
                                       top_p=1.0, passed=reward >= 1.0 and not tampered, tampered=tampered)
    return verdict_pb2.Verdict(id=f"v-{group}-{index}", sample=sample, task_kind="exact", reward=reward,
                               tampered=tampered, completion=str(index),
                               components=components or {"answer_correct": reward})


def config(estimator: str = "grpo", **fields) -> RewardConfig:
    return RewardConfig.of(RunConfig(estimator=estimator, **fields))


def test_a_verdict_whose_reward_is_not_finite_joins_no_group():
    from crucible.services.reward_aggregator.handler import check_verdict

    assert check_verdict(verdict("g", 0, 2, 1.0)) is None
    for bad in (verdict("g", 0, 2, float("nan")), verdict("g", 0, 2, 1.0, components={"answer_correct": float("inf")})):
        assert "not finite" in check_verdict(bad)


def test_group_advantages_by_hand():
    vs = [verdict("g", i, 4, r) for i, r in enumerate([1.0, 0.0, 0.0, 1.0])]
    grpo = group_trajectories(list(reversed(vs)), config("grpo"), complete=True)
    # mean 0.5, population std 0.5: advantages +-1 (minus the 1e-6 guard)
    assert [t.sample_index for t in grpo] == [0, 1, 2, 3]
    assert all(t.completion_token_ids == [1, 2] and t.estimator == "grpo" for t in grpo)  # the flat sample
    assert [round(t.advantage, 4) for t in grpo] == [1.0, -1.0, -1.0, 1.0]
    rloo = group_trajectories(vs, config("rloo"), complete=True)
    # r_i - mean of the other three: 1 - 1/3, 0 - 2/3
    assert [round(t.advantage, 4) for t in rloo] == [0.6667, -0.6667, -0.6667, 0.6667]
    reinforce = group_trajectories(vs, config("reinforce"), complete=True)
    assert [t.advantage for t in reinforce] == [0.5, -0.5, -0.5, 0.5]


def test_tampered_samples_earn_zero_and_weights_apply():
    vs = [verdict("g", 0, 2, 1.0, tampered=True), verdict("g", 1, 2, 1.0)]
    ts = group_trajectories(vs, config("grpo"), complete=True)
    assert [t.reward for t in ts] == [0.0, 1.0]
    weighted = group_trajectories([verdict("h", 0, 1, 0.3, components={"a": 1.0, "b": 0.5})],
                                  config("grpo", reward_weights={"a": 0.2, "b": 2.0}), complete=True)
    assert weighted[0].reward == pytest.approx(0.2 * 1.0 + 2.0 * 0.5)
    penalised = group_trajectories([verdict("k", 0, 1, 1.0)],
                                   config("grpo", length_penalty=0.1, length_target=0), complete=True)
    assert penalised[0].reward == pytest.approx(1.0 - 0.1 * 2)


def test_records_that_disagree_with_their_group_or_pay_beyond_bounds_are_refused():
    """Each record was checked alone: a record of another size or task under a group id made one group of
    two; one sample id at two indices stalled the learner (it counts samples by id); rewards of 1e300
    overflowed the group's variance and stopped the join."""
    from crucible.services.reward_aggregator.handler import check_record

    def record(*vs):
        return verdict_pb2.VerdictGroup(verdicts=vs)

    joined = [verdict("g", 0, 4, 1.0), verdict("g", 1, 4, 0.0)]
    assert check_record(record(verdict("g", 2, 4, 1.0)), config(), joined) is None
    assert check_record(record(verdict("g", 1, 4, 0.0)), config(), joined) is None  # a replay: the first stands
    other_size = verdict("g", 2, 8, 1.0)
    other_task = verdict("g", 2, 4, 1.0)
    other_task.sample.task_id = "another task"
    same_id = verdict("g", 3, 4, 1.0)
    same_id.sample.id = "g/0"
    for bad, said in [(other_size, "size 8"), (other_task, "another task"), (same_id, "at sample indices 0 and 3")]:
        assert said in check_record(record(bad), config(), joined)
    twin = verdict("h", 1, 2, 0.0)
    twin.sample.id = "h/0"
    assert "at sample indices 0 and 1" in check_record(record(verdict("h", 0, 2, 1.0), twin))
    huge = [verdict("k", 0, 2, 1e300), verdict("k", 1, 2, 0.0)]
    assert "beyond" in check_record(record(*huge), config())
    weighted = verdict("m", 0, 1, 1.0, components={"answer_correct": 1.0, "format_ok": 1e10})
    assert check_record(record(weighted), config()) is None
    assert "beyond" in check_record(record(weighted), config(reward_weights={"format_ok": 1.0}))


def test_a_canary_paid_by_the_runs_reward_weights_is_caught():
    """The canary check read the verifier's default reward, not what the run pays."""
    from crucible.services.reward_aggregator.handler import alerts_for

    canary = verdict("c", 0, 1, 0.0, components={"answer_correct": 0.0, "format_ok": 1.0})
    canary.canary = True
    weights = config(reward_weights={"answer_correct": 1.0, "format_ok": 0.5})
    assert alerts_for(canary, "run") == []
    [alert] = alerts_for(canary, "run", weights)
    assert alert.kind == "canary_passed" and "0.50" in alert.message


async def test_a_verdict_arriving_while_its_group_times_out_is_emitted_once(tmp_path):
    """The timed-out group's entry stayed in the table while its emission was written: a straggler joined
    it meanwhile, and its samples were emitted twice (complete now) or the straggler was lost."""
    from crucible.services.reward_aggregator.app import Aggregator
    from crucible.shared import integrity
    from crucible.shared.settings import Settings

    agg = Aggregator(Settings(home=tmp_path, group_timeout_s=0.001), producer=None)
    agg.groups = {}  # the faust table's part here (the app is not started)
    written, entered, gate = [], asyncio.Event(), asyncio.Event()

    async def write(emissions):  # the bus and the store, slow to acknowledge
        entered.set()
        await gate.wait()
        written.extend(emissions)

    agg._write = write

    class Event:
        def __init__(self, vs, offset):
            message = verdict_pb2.VerdictGroup(verdicts=vs)
            integrity.sign(message, agg.secret)
            self.value, self.headers = messages.encode(message), bus.publish_headers(message)
            self.message = type("M", (), {"topic": "crucible.verdicts", "partition": 0, "offset": offset})()

    async def join(event):
        agg._open = {}
        done = await agg._join_one(event, event.headers)
        agg._store_open()
        agg._open = {}
        return done

    class Expiring:
        def items(self):
            async def one():
                yield b"G", b""
            return one()

    group = [verdict("G", i, 3, r) for i, r in enumerate([1.0, 0.0, 1.0])]
    assert await join(Event(group[:2], 1)) is None
    await asyncio.sleep(0.01)  # past its timeout
    expiring = asyncio.create_task(agg._expire(Expiring()))
    await asyncio.wait_for(entered.wait(), 5)
    straggler = asyncio.create_task(join(Event(group[2:], 2)))
    await asyncio.sleep(0.1)
    gate.set()
    await expiring
    assert await straggler is None  # not completing the group it came too late for
    assert [(e.complete, [t.sample_index for t in e.trajectories]) for e in written] == [(False, [0, 1])]
    assert agg.finished[b"G"] == (0, 1) and b"G" in agg.groups  # the straggler waits in its own entry, once


@pytest.mark.kafka
@pytest.mark.store
class HandedOver:
    """The parts of a faust stream `batches` uses, handing over what the test puts in one by one (as
    faust's passive drainer does), each after the event loop has run once."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.enable_acks, self.should_stop, self.current_event = True, False, None
        self._processors, self.acked = [], []

    def add_processor(self, processor):
        self._processors.append(processor)

    @property
    def channel(self):
        return self

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.queue.get()

    def _enable_passive(self, events):
        async def drain():
            async for event in events:
                await asyncio.sleep(0)
                self.current_event = event
                for processor in self._processors:
                    await processor(event)
        self._drainer = asyncio.ensure_future(drain())

    async def wait(self, event):
        await event.wait()

    async def wait_for_stopped(self, event, timeout=None):
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        return False

    async def ack(self, event):
        self.acked.append(event)


async def test_a_burst_handed_over_one_by_one_is_one_batch_and_a_pause_closes_it():
    from crucible.services.reward_aggregator.batches import batches

    stream, got = HandedOver(), []
    for i in range(40):  # a burst: handed over one per turn of the loop
        stream.queue.put_nowait(i)

    async def later():
        await asyncio.sleep(0.5)  # a pause well past idle_s
        for i in range(40, 43):
            stream.queue.put_nowait(i)

    feeder = asyncio.ensure_future(later())
    async for batch in batches(stream, max_events=32, linger_s=2.0, idle_s=0.1):
        got.append(list(batch))
        if sum(map(len, got)) == 43:
            break
    await feeder
    stream._drainer.cancel()
    assert got == [list(range(32)), list(range(32, 40)), [40, 41, 42]]  # full at 32; the rest of the burst; after the pause
    assert stream.acked == list(range(40))  # each batch acked once the next one is asked for


async def test_joins_groups_times_out_stragglers_and_replays_without_duplicates(stack_settings):
    settings = stack_settings.model_copy(update={"group_timeout_s": 2.0})
    stop = asyncio.Event()
    service = asyncio.create_task(run(settings, stop, timer_interval_s=0.5))
    await asyncio.sleep(0.5)
    complete = [verdict("A", i, 4, r) for i, r in enumerate([1.0, 0.0, 0.0, 1.0])]
    complete[1].tampered = True
    complete[1].tamper_patterns.append("exit_before_tests")
    straggling = [verdict("B", i, 3, r) for i, r in enumerate([1.0, 0.0])]  # the third never comes
    # Group A's verdicts in two records, one of them alone (as an episode's comes), B's in one; then
    # a record that mixes two groups, and one whose two verdicts are the same sample: refused whole.
    # A's first sample also comes again failed (another run of its program, replayed into the open
    # group): the first verdict stands.
    records = [complete[:1], [verdict("A", 0, 4, 0.0)], straggling, complete[1:3], complete[3:]]
    mixed = [verdict("C", 0, 2, 1.0), verdict("D", 1, 2, 1.0)]
    twice = [verdict("E", 0, 2, 1.0), verdict("E", 0, 2, 0.0)]
    try:
        async with bus.Producer(settings) as producer:
            for vs in records + [mixed, twice]:
                await producer.send_and_wait("verdicts", verdict_pb2.VerdictGroup(verdicts=vs),
                                             key=vs[0].sample.group_id)
        raw = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap)
        await raw.start()
        await raw.send_and_wait(settings.topic("verdicts"), b"\x00garbage\xff", key=b"A")
        await raw.stop()

        records = await read_raw(settings, "trajectories", 6, timeout=60)
        trajectories = [messages.decode(r.value, trajectory_pb2.Trajectory) for r in records]
        by_group = {}
        for t in trajectories:
            by_group.setdefault(t.group_id, []).append(t)
        assert sorted(t.advantage > 0 for t in by_group["A"]) == [False, False, True, True]
        assert [t.passed for t in sorted(by_group["A"], key=lambda t: t.sample_index)] == [True, False, False, True]
        assert all(t.group_complete and t.group_received == 4 for t in by_group["A"])
        assert all(not t.group_complete and t.group_received == 2 for t in by_group["B"])
        assert {r.key for r in records} == {b"A", b"B"}
        alerts = await read_raw(settings, "alerts", 1, timeout=30)
        assert b"exit_before_tests" in alerts[0].value and alerts[0].key == b"tamper"
        dead = await read_raw(settings, "verdicts.dlq", 3, timeout=30)
        reasons = [dict(d.headers)["dlq-reason"].decode() for d in dead]
        assert [r.split(":")[0] for r in reasons] == ["rejected", "rejected", "undecodable"]
        assert "'D'" in reasons[0] and "'C'" in reasons[0] and "sample_index 0 twice" in reasons[1]

        client = store.connect(settings)
        query = "SELECT group_id, count(), sum(reward) FROM trajectories FINAL GROUP BY group_id ORDER BY group_id"
        # The rows follow the trajectories (the bus first, then the store, before the verdicts commit).
        expected = [("A", 4, 2.0), ("B", 2, 1.0)]
        assert await rows_within(client, query, expected, 10) == expected
        assert client.query("SELECT kind, details['patterns'] FROM alerts FINAL").result_rows == [
            ("tamper", "exit_before_tests")]
        # A copy of a finished group's verdicts (anyone re-publishing a genuine record), and of a sample of
        # the group that timed out, are not joined again: no sample is emitted a second time (it would be
        # trained on twice once the learner forgot its id). B's straggler, never emitted, is, once its
        # group times out again. Then a new group, after them in the same partition: once it is out, they
        # have been read.
        later = [verdict("F", i, 2, r) for i, r in enumerate([1.0, 0.0])]
        async with bus.Producer(settings) as producer:
            for vs in ([complete, [straggling[0]], [verdict("B", 2, 3, 1.0)], later]):
                await producer.send_and_wait("verdicts", verdict_pb2.VerdictGroup(verdicts=vs), key="A")
        records = await read_raw(settings, "trajectories", 9, timeout=60)
        trajectories = [messages.decode(r.value, trajectory_pb2.Trajectory) for r in records[6:]]
        assert sorted((t.group_id, t.sample_index) for t in trajectories) == [("B", 2), ("F", 0), ("F", 1)]
        with pytest.raises(asyncio.TimeoutError):
            await read_raw(settings, "trajectories", 10, timeout=3)
        expected = [("A", 4, 2.0), ("B", 3, 2.0), ("F", 2, 1.0)]
        assert await rows_within(client, query, expected, 10) == expected
    finally:
        stop.set()
        await asyncio.wait_for(service, 30)
    assert (settings.home / "faust").is_dir()  # faust's state lives under CRUCIBLE_HOME, nowhere else


@pytest.mark.kafka
@pytest.mark.store
async def test_a_batch_that_fails_to_land_loses_no_verdict_of_an_earlier_batch(stack_settings):
    """A group completed by a batch whose rows the store refused: the service stops, and its restart
    reads the batch again. The group's earlier verdicts, joined and committed in an earlier batch,
    were gone from the table (removed as the group completed, before the batch landed): the restart
    made a group of the replayed verdict alone, which timed out without the rest."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    settings = stack_settings.model_copy(update={"group_timeout_s": 8.0})
    client = store.connect(settings)
    topic, app_id = settings.topic("verdicts"), f"{settings.consumer_group_prefix}reward-aggregator"

    async def committed() -> int:
        reader = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap, group_id=app_id)
        await reader.start()
        try:
            parts = reader.partitions_for_topic(topic) or {0}
            return sum([await reader.committed(TopicPartition(topic, p)) or 0 for p in parts])
        finally:
            await reader.stop()

    async def publish(vs) -> None:
        async with bus.Producer(settings) as producer:
            await producer.send_and_wait("verdicts", verdict_pb2.VerdictGroup(verdicts=vs), key="A")

    group = [verdict("A", i, 2, r) for i, r in enumerate([1.0, 0.0])]
    stop = asyncio.Event()
    service = asyncio.create_task(run(settings, stop, timer_interval_s=0.5))
    try:
        await publish(group[:1])
        deadline = asyncio.get_running_loop().time() + 30
        while await committed() < 1:  # the first verdict joined, in the table, and its record committed
            assert asyncio.get_running_loop().time() < deadline, "the first verdict was never committed"
            await asyncio.sleep(0.3)
        client.command("RENAME TABLE trajectories TO trajectories_away")  # the store refuses the next rows
        await publish(group[1:])
        with pytest.raises(RuntimeError, match="could not write a batch"):
            await asyncio.wait_for(service, 60)
    finally:
        stop.set()
        if not service.done():
            await asyncio.wait_for(service, 30)
    client.command("RENAME TABLE trajectories_away TO trajectories")
    stop = asyncio.Event()
    service = asyncio.create_task(run(settings, stop, timer_interval_s=0.5))
    try:
        query = "SELECT sample_index FROM trajectories FINAL WHERE group_id = 'A' ORDER BY sample_index"
        assert await rows_within(client, query, [(0,), (1,)], 20) == [(0,), (1,)]
    finally:
        stop.set()
        await asyncio.wait_for(service, 30)


async def rows_within(client, query: str, expected: list, timeout: float) -> list:
    """The query's rows once they are `expected`, or what it returns after `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (rows := client.query(query).result_rows) != expected and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
    return rows


async def test_the_sweep_reads_each_open_group_once_not_every_second(tmp_path, monkeypatch):
    """Each sweep decoded every open group's whole entry on the join's loop: 4,000 open groups cost 614 ms
    a second. A group's first verdict time never changes; a group opened anew gets its own."""
    from crucible.services.reward_aggregator import app
    from crucible.shared.settings import Settings

    agg = app.Aggregator(Settings(home=tmp_path, group_timeout_s=3600.0), producer=None)
    agg.groups = {f"g{i}".encode(): app._frozen({"first_seen": 1e12, "group_size": 2, "verdicts": {
        "0": verdict(f"g{i}", 0, 2, 1.0)}}) for i in range(100)}
    thawed = []
    monkeypatch.setattr(app, "_thawed", lambda raw: thawed.append(1) or app.json.loads(raw))
    for _ in range(3):
        await agg._sweep()
    assert len(thawed) == 100


@pytest.mark.kafka
@pytest.mark.store
async def test_a_restarted_aggregator_judges_against_the_runs_baseline_not_the_first_window_after_it(stack_settings):
    """The detectors' baseline is the run's first window. A restart used to make the first window after
    it the baseline: a policy that learnt a hack meanwhile was judged against itself, and never alerted."""
    settings = stack_settings.model_copy(update={"detect_window": 8, "group_timeout_s": 30.0})
    sent = 0

    async def serve(groups: list[list[verdict_pb2.Verdict]]):
        nonlocal sent
        stop = asyncio.Event()
        service = asyncio.create_task(run(settings, stop, timer_interval_s=0.5))
        try:
            async with bus.Producer(settings) as producer:
                for vs in groups:
                    await producer.send_and_wait("verdicts", verdict_pb2.VerdictGroup(verdicts=vs),
                                                 key=vs[0].sample.group_id)
            sent += sum(map(len, groups))
            await read_raw(settings, "trajectories", sent, timeout=60)
        finally:
            stop.set()
        return await asyncio.wait_for(service, 30)

    def window(tag: str, format_ok) -> list[list[verdict_pb2.Verdict]]:  # half solved, as before and after
        return [[verdict(f"{tag}{g}", i, 2, float(i == 0), components={"answer_correct": float(i == 0),
                                                                      "format_ok": format_ok(g, i)})
                 for i in range(2)] for g in range(4)]

    first = await serve(window("a", lambda g, i: float(g % 2)))  # format right half the time
    assert first.detectors.windows == 1 and first.detectors.baseline.mean("format_ok") == 0.5
    second = await serve(window("b", lambda g, i: 1.0))  # format always right, nothing more solved
    assert second.detectors.windows == 2
    assert second.detectors.baseline.counts() == first.detectors.baseline.counts()
    alerts = [messages.decode(r.value, alert_pb2.Alert) for r in await read_raw(settings, "alerts", 1, timeout=30)]
    assert [(a.kind, a.details["component"], a.details["window"]) for a in alerts] == [
        ("component_without_correctness", "format_ok", "2")]
    # A state no aggregator of this build wrote (damaged, or a newer one's): it starts, from a new baseline.
    client = store.connect(settings)
    client.insert("detector_state", [[settings.run_id, 9, '{"windows": 9, "baseline": {"count": "x"}}']],
                  column_names=["run_id", "windows", "state"])
    third = await serve(window("c", lambda g, i: 1.0))
    assert third.detectors.windows == 1 and third.detectors.baseline.mean("format_ok") == 1.0


def test_an_episodes_turn_rows_carry_why_the_sandbox_stopped_a_call_even_a_violation_this_build_does_not_know():
    """Protobuf enums are open: a newer sandbox's violation is stored by its number, not a failed row."""
    from crucible.services.reward_aggregator.handler import TURN_COLUMNS, turn_rows
    from crucible.v1 import execution_pb2

    v = verdict_pb2.Verdict(sample=trajectory_pb2.Trajectory(id="e/0"))
    v.episode.turns.add(sandboxed=True, violation=execution_pb2.VIOLATION_FORBIDDEN_SYSCALL)
    v.episode.turns.add(sandboxed=True, violation=99)
    v.episode.turns.add(text="the answer")
    rows = turn_rows(v, v.sample)
    assert [dict(zip(TURN_COLUMNS, r))["violation"] for r in rows] == ["forbidden_syscall", "violation_99", ""]
