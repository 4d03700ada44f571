"""The faust-streaming app: a table keyed by group id joins verdicts; stragglers time out.

    crucible.verdicts --(agent `join`)--> table[group_id] --complete--> crucible.trajectories + ClickHouse
    timer --(key: group_id)--> crucible.aggregator.expire --(agent `expire`)--> incomplete groups

Table writes happen only inside agents (faust records them in the table's changelog, which is
what makes the join survive a restart); the timer therefore does not touch the table itself but
asks, through a topic keyed like the table, for old groups to be flushed.

Faust owns the join's state (the table, its changelog, the expire topic). Everything else goes
through the bus like any other service: decoding by schema header, the DLQ, trace context in
and out, and the outputs, which are acknowledged before faust commits the verdict's offset.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import json
import logging
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import faust
from faust import streams as faust_streams
from opentelemetry import context as otel_context
from opentelemetry import trace

from crucible.services.reward_aggregator.handler import (
    TRAJECTORY_COLUMNS,
    RewardConfig,
    alerts_for,
    check_record,
    group_trajectories,
    trajectory_row,
    turn_rows,
    TURN_COLUMNS,
)
from crucible.services.reward_aggregator.batches import batches
from crucible.services.reward_aggregator.detectors import WindowDetectors
from crucible.shared import alerts as alert_rows
from crucible.shared import bus, integrity, messages, metrics, telemetry
from crucible.shared.settings import Settings
from crucible.shared.store import writes
from crucible.v1 import alert_pb2, verdict_pb2

log = logging.getLogger("crucible.aggregator")


def _headers(event_headers) -> list[tuple[str, bytes]]:
    if not event_headers:
        return []
    items = event_headers.items() if hasattr(event_headers, "items") else event_headers
    return [(k, v if isinstance(v, bytes) else str(v).encode()) for k, v in items]


# Records joined before the groups they complete are written: a batch closes once 5 ms pass without a
# record, 50 ms after its first at the latest, or at JOIN_BATCH records. faust hands records over one by
# one, fetched together (a step's 256 verdicts, when each was a record, took 26-51 ms here): a batch
# closed 10 ms after its first took part of them, and their trajectories went out in 6 produce requests
# a step (now 1). A group's verdicts come in one record (VerdictGroup), so a group joined whole never
# touches the table; one whose records straddle two batches goes through it.
JOIN_BATCH, JOIN_LINGER_S, JOIN_IDLE_S = 256, 0.05, 0.005
# How long a finished group's rows wait for others' before they are inserted. Each insert is a part the
# store writes and later merges (10-20 ms of its CPU, however few rows): batches 10 ms apart made two or
# three a step, and at 0.25 s one a step. Nobody waits for these rows (their verdicts' acks do, off the
# join's path).
ROWS_LINGER_S = 0.5
# The window detectors' state, one row a run (migration 0014), written after each window they judge.
DETECTOR_STATE, DETECTOR_STATE_COLUMNS = "detector_state", ["run_id", "windows", "state"]
# Batches whose trajectories and rows may still be on their way while later batches are joined; at this
# many the join waits for the oldest (a slow store slows the join instead of piling batches up). Batches
# close 10 ms apart at the most: more than a linger's worth, so a store that keeps up never stalls it.
MAX_WRITING = 64
FLUSH_WAIT_S = 10.0


@contextlib.contextmanager
def _as_event(event):
    """Table changes made inside are made as `event`'s (faust sends them to its changelog partition)."""
    current = faust_streams._current_event.set(weakref.ref(event))
    try:
        yield
    finally:
        faust_streams._current_event.reset(current)


@dataclass
class Emission:
    """A finished group, ready to be written: its trajectories, its store rows, its trace context."""

    group_id: str
    trajectories: list
    rows: list
    turns: list
    context: otel_context.Context
    complete: bool


GROUPS = metrics.counter("crucible.aggregator.groups", "groups emitted, by kind and whether complete", "{group}")
REWARD = metrics.histogram("crucible.aggregator.reward", "rewards after weighting, by kind (mean and spread)")
COPIES = metrics.counter("crucible.aggregator.verdicts_emitted_already",
                         "verdicts of a sample this process emitted already (its group complete, or timed out): "
                         "not joined again", "{verdict}")
FINISHED_GROUPS_KEPT = 1 << 16  # the groups last emitted, kept with their samples' indices (~10 MB)

def _frozen(entry: dict) -> bytes:
    """An open group's entry as the table keeps it (JSON, each verdict as base64 protobuf)."""
    encoded = {i: base64.b64encode(v.SerializeToString()).decode() for i, v in entry["verdicts"].items()}
    return json.dumps({**entry, "verdicts": encoded}).encode()


def _thawed(raw: bytes) -> dict:
    """A table entry as the join works on it (its verdicts decoded)."""
    entry = json.loads(raw)
    entry["verdicts"] = {i: verdict_pb2.Verdict.FromString(base64.b64decode(v)) for i, v in entry["verdicts"].items()}
    return entry


class Aggregator:
    """Owns the faust app and what its agents need (settings, bus producer, store client, counters)."""

    def __init__(self, settings: Settings, producer: bus.Producer, store_client=None, *, app_id: str | None = None,
                 timer_interval_s: float = 1.0):
        self.settings = settings
        self.producer = producer
        self.secret = integrity.key(settings)  # verdict groups are the verifier's, signed with it
        self.store = store_client
        if store_client is not None:
            self.trajectory_rows = writes.BatchedRows(store_client, "trajectories", TRAJECTORY_COLUMNS,
                                                      linger_s=ROWS_LINGER_S)
            self.turn_rows = writes.BatchedRows(store_client, "episode_turns", TURN_COLUMNS, linger_s=ROWS_LINGER_S)
        self.config = RewardConfig.of(settings.run_config())
        self.detectors = self._new_detectors()
        if store_client is not None:
            self._restore_detectors()
        self.cooldown = alert_rows.Cooldown(settings.detect_cooldown_s)
        self.groups_emitted = 0
        self.incomplete_emitted = 0
        self.dead_lettered = 0
        self.alerts_raised = 0
        # A batch whose trajectories or rows could not be written (the store refused them, or did not
        # answer within writes.PATIENCE_S): no later batch is acked after it, so the service stops
        # (run() raises it) and its restart reads them all again.
        self.failure: BaseException | None = None
        self.failed = asyncio.Event()
        self.tracer = telemetry.tracer("crucible.aggregator")
        self._open: dict[bytes, tuple[dict | None, object]] = {}  # the joining batch's groups: entry (None: done), last event
        # Groups this process emitted (the newest FINISHED_GROUPS_KEPT), each with the sample indices it
        # emitted: a verdict of one of those is not joined again. A completed group leaves the table, so a
        # genuine record published again once opened it anew and emitted its trajectories a second time: a
        # sample trained on twice once the learner's memory of ids had moved on. A straggler of a group
        # that timed out (a sample not emitted) still joins, and is emitted once. A process that starts
        # anew knows none: a crash replays its uncommitted batches against the table as it was.
        self.finished: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._expiring: dict[bytes, asyncio.Future] = {}  # groups timed out whose emission is being written
        self._first_seen: dict[bytes, float] = {}  # open groups' first verdict times, as _sweep has read them
        # Groups a batch completed whose entries stay in the table until that batch has landed (each with
        # the event its removal is made as): removed at once, a batch that failed to land lost the
        # verdicts of earlier batches (committed, their entry gone) when the restart read it again.
        self._leaving: dict[bytes, object] = {}
        self._writing: list[asyncio.Future] = []  # the join's batches on their way to the bus and the store
        self.copies_skipped = 0
        app_id = app_id or f"{settings.consumer_group_prefix}reward-aggregator"
        datadir = settings.home / "faust" / app_id
        datadir.parent.mkdir(parents=True, exist_ok=True)
        self.app = faust.App(
            app_id,
            broker=";".join(f"kafka://{b}" for b in settings.kafka_bootstrap.split(",")),
            store="memory://", web_enabled=False, topic_partitions=1,
            value_serializer="raw", key_serializer="raw", producer_acks=-1,
            consumer_auto_offset_reset="earliest",
            broker_credentials=bus.faust_credentials(settings),
            # A member killed without leaving holds its partitions until its session times out: faust's
            # default (60 s) kept a restarted aggregator idle for about a minute.
            broker_session_timeout=10.0, broker_heartbeat_interval=3.0,
            # static membership (see Settings.instance_id): a restart rejoins without a rebalance
            consumer_group_instance_id=f"{settings.instance_id}/{app_id}" if settings.instance_id else None,
            datadir=str(datadir),  # faust creates it at start: never in the working directory
            # A stop (or a rebalance) commits what is acked and goes: by default faust waits until every
            # event read is acked, and a batch that failed to land never is, so the service that was to
            # stop and read it again from its last commit waited for ever.
            stream_wait_empty=False,
        )
        self.verdicts = self.app.topic(settings.topic("verdicts"), value_serializer="raw", key_serializer="raw")
        self.expire_topic = self.app.topic(settings.topic("aggregator.expire"), value_serializer="raw",
                                           key_serializer="raw")
        # group id -> JSON {"first_seen": unix seconds, "group_size": n, "trace": headers of the first verdict,
        #                   "verdicts": {index: base64 protobuf}} (_frozen; in memory, _thawed: Verdicts)
        self.groups = self.app.Table("groups", default=None, key_type=bytes, value_type=bytes, partitions=1)
        self.app.agent(self.verdicts, name="join")(self._join)
        self.app.agent(self.expire_topic, name="expire")(self._expire)
        self.app.timer(interval=timer_interval_s)(self._sweep)

    # --- agents ---

    async def _join(self, stream):
        # Verdicts in small batches: the groups a batch completes are published together, and their rows
        # go to the store with those of the batches around them (one insert per group cost ~10 ms each,
        # a quarter of a step; ROWS_LINGER_S). The table is written once per batch, for the groups the batch leaves open: a group whose
        # verdicts arrive together (the verifier publishes a group's at once) never touches it, where
        # every verdict used to rewrite its group's entry and send it to the changelog. Offsets are
        # committed only after the batch has landed, so a crash replays it against the table as it was.
        writing = self._writing  # batches' trajectories and rows on their way, oldest first
        async for events in batches(stream, JOIN_BATCH, JOIN_LINGER_S, JOIN_IDLE_S):
            completed: list[Emission] = []
            self._open = {}
            try:
                for event in events:
                    m = event.message
                    headers = _headers(event.headers)
                    with bus.consume_span(m.topic, m.partition, m.offset, headers):
                        done = await self._join_one(event, headers)
                    if done is not None:
                        completed.append(done)
                leaving = self._store_open()
            finally:
                self._open = {}
            # An earlier batch whose writing failed fails this one (the agent stops, nothing of either
            # is acked); too many still on their way hold this one back.
            while writing and (writing[0].done() or len(writing) >= MAX_WRITING):
                await writing.pop(0)
            if completed:
                # The trajectories go out now; the batch is acked once they and its rows have landed,
                # while the next batches are joined.
                landing = asyncio.ensure_future(self._land(completed, await self._send(completed), leaving))
                landing.add_done_callback(self._landed)
                writing.append(landing)
                events.after(landing)

    def _landed(self, landing: asyncio.Future) -> None:
        if not landing.cancelled() and landing.exception() is not None and self.failure is None:
            self.failure = landing.exception()
            log.error("a batch's trajectories or rows could not be written (%r): stopping, to read it again "
                      "from the last commit", self.failure)
            self.failed.set()

    async def flush(self) -> None:
        """Writes the rows waiting for company now; returns once every insert begun has ended and the
        batches on their way have landed (or FLUSH_WAIT_S has passed: those are read again at the next
        start), so that a normal stop commits them."""
        if self.store is not None:
            await asyncio.gather(self.trajectory_rows.flush(), self.turn_rows.flush())
        if self._writing:
            await asyncio.wait(list(self._writing), timeout=FLUSH_WAIT_S)
        await asyncio.sleep(0.05)  # a moment for the batches they held back to be acked before faust's last commit

    def _store_open(self) -> list[bytes]:
        """The batch's changes to the table: open groups' entries written. Each change is made as its
        last event (faust sends it to that event's changelog partition). Returns the groups the batch
        completed that are in the table: they leave it once the batch has landed (_forget)."""
        leaving = []
        for key, (entry, event) in self._open.items():
            if entry is None:
                if key in self.groups:  # else completed within the batch: it never reached the table
                    self._leaving[key] = event
                    leaving.append(key)
                continue
            self._leaving.pop(key, None)  # opened anew (a copy `finished` had forgotten): it stays
            with _as_event(event):
                self.groups[key] = _frozen(entry)
        return leaving

    def _forget(self, keys: list[bytes]) -> None:
        """Completed groups whose batch has landed: out of the table."""
        for key in keys:
            event = self._leaving.pop(key, None)
            if event is None:
                continue  # completed again meanwhile (a copy, once `finished` had forgotten it): removed already
            with _as_event(event):
                self.groups.pop(key, None)
            self._first_seen.pop(key, None)

    async def _join_one(self, event, headers) -> "Emission | None":
        """Joins one record's verdicts (a group's, or some of them) into their group (in the batch's open
        entries); the group's emission once it is complete (else None). A record any of whose verdicts
        cannot join goes to the DLQ whole."""
        m = event.message
        try:
            record = bus.decode_record(event.value, headers, verdict_pb2.VerdictGroup)
        except messages.MessageDecodeError as exc:
            return await self._dead_letter(event, headers, f"undecodable: {exc}")
        if not integrity.signed_correctly(record, self.secret):
            return await self._dead_letter(event, headers, "rejected: the verdicts are not signed by a verifier of "
                                           f"this run (unsigned, or signed with {integrity.ANOTHER_KEY}): only a "
                                           "verifier sets rewards")
        key = record.verdicts[0].sample.group_id.encode() if record.verdicts else b""
        expiring = self._expiring.get(key)
        if expiring is not None:  # its group timing out, being written: joined once that is done (it was
            await asyncio.wait([expiring])  # joined meanwhile into the entry being written, emitted twice or lost)
        open_entry = self._entry(key) if key else None
        problem = check_record(record, self.config, list(open_entry["verdicts"].values()) if open_entry else ())
        if problem:
            return await self._dead_letter(event, headers, f"rejected: {problem}")
        first = record.verdicts[0].sample
        group_id = first.group_id
        verdicts = list(record.verdicts)
        emitted = self.finished.get(key)
        if emitted is not None:
            verdicts = [v for v in verdicts if v.sample.sample_index not in emitted]
            copies = len(record.verdicts) - len(verdicts)
            if copies:
                self.copies_skipped += copies
                COPIES.add(copies, {"kind": record.verdicts[0].task_kind})
                log.info("%d verdicts of group %s at %s@%d: emitted already, not joined again", copies, group_id,
                         m.topic, m.offset)
            if not verdicts:
                return None
        entry = open_entry or {
            "first_seen": time.time(), "group_size": first.group_size, "verdicts": {},
            "trace": {k: v.decode("latin-1") for k, v in headers if k in ("traceparent", "tracestate")}}
        for verdict in verdicts:
            # The first verdict of a slot stands: a replay (the same verdict again, or a verdict of another
            # run of the same sample: a second throw of the dice for a program that passes now and then)
            # never replaces it, nor reaches the detectors (copies of a clean verdict would dilute what
            # they watch). The join is idempotent per sample index.
            slot = str(verdict.sample.sample_index)
            if slot not in entry["verdicts"]:
                entry["verdicts"][slot] = verdict
                await self._raise_alerts(verdict)
        log.debug("%d verdicts joined group %s at %s@%d", len(record.verdicts), group_id, m.topic, m.offset)
        if len(entry["verdicts"]) >= entry["group_size"]:
            self._open[key] = (None, event)
            self._finished(key, entry)
            return self._emission(group_id, entry, complete=True)
        self._open[key] = (entry, event)
        return None

    async def _expire(self, stream):
        async for key, _ in stream.items():
            entry = None if key in self._open else self._entry(key)
            if entry is None:
                continue  # completed meanwhile, or being joined right now (not stale, then)
            if time.time() - entry["first_seen"] >= self.settings.group_timeout_s:
                parent = telemetry.extract_context(list(entry.get("trace", {}).items()))
                with self.tracer.start_as_current_span("aggregate group (timed out)", context=parent):
                    emission = self._emission(key.decode(), entry, complete=False)
                # Until it is written and out of the table, a verdict of the group waits (_join_one): then it
                # is a straggler of a finished group, emitted once.
                self._expiring[key] = written = asyncio.get_running_loop().create_future()
                try:
                    await self._write([emission])
                    self.groups.pop(key, None)
                    self._first_seen.pop(key, None)  # a straggler opens the group anew, with a time of its own
                    self._finished(key, entry)
                finally:
                    written.set_result(None)
                    del self._expiring[key]

    async def _sweep(self):
        now = time.time()
        keys = list(self.groups.keys())
        for key in keys:
            if key in self._leaving:
                continue
            # A group's first_seen never changes: read from its entry once (each read decoded the whole
            # entry, every group's every second, on the join's loop: 614 ms a second with 4,000 open).
            first_seen = self._first_seen.get(key)
            if first_seen is None:
                entry = self._entry(key)
                if not entry:
                    continue
                first_seen = self._first_seen[key] = entry["first_seen"]
            if now - first_seen >= self.settings.group_timeout_s:
                await self.expire_topic.send(key=key, value=b"")
        if len(self._first_seen) > 2 * len(keys) + 1024:  # groups gone from the table meanwhile
            self._first_seen = {k: self._first_seen[k] for k in keys if k in self._first_seen}

    def _finished(self, key: bytes, entry: dict) -> None:
        """The group's samples in `entry` are emitted: remembered with any it emitted before."""
        self.finished[key] = tuple(sorted({*self.finished.pop(key, ()), *map(int, entry["verdicts"])}))
        if len(self.finished) > FINISHED_GROUPS_KEPT:
            self.finished.popitem(last=False)

    def _entry(self, key: bytes) -> dict | None:
        """A group's entry as the batch being joined has left it, else as the table holds it; None once
        complete (or never seen)."""
        if key in self._open:
            return self._open[key][0]
        if key in self._leaving:
            return None
        raw = self.groups.get(key)
        return _thawed(raw) if raw else None

    # --- output ---

    def _emission(self, group_id: str, entry: dict, *, complete: bool) -> "Emission":
        """A finished group's trajectories and rows, in the current span's trace (which they continue)."""
        verdicts = list(entry["verdicts"].values())
        trajectories = group_trajectories(verdicts, self.config, complete=complete)
        kind = verdicts[0].task_kind if verdicts else ""
        GROUPS.add(1, {"kind": kind, "complete": str(complete).lower()})
        for t in trajectories:
            REWARD.record(t.reward, {"kind": kind})
        by_id = {v.sample.id: v for v in verdicts}
        trace_id = telemetry.current_trace_id()
        created = trajectories[0].created_at.ToDatetime(tzinfo=dt.timezone.utc) if trajectories else None
        rows = [trajectory_row(by_id[t.id], t, trace_id, self.settings.run_id, created) for t in trajectories]
        turns = [row for t in trajectories for row in turn_rows(by_id[t.id], t)]
        if not complete:
            log.info("group %s timed out with %d of %d verdicts", group_id, len(verdicts), entry["group_size"])
        return Emission(group_id, trajectories, rows, turns, otel_context.get_current(), complete)

    async def _write(self, emissions: list["Emission"]) -> None:
        """The groups' trajectories onto the bus, each in its own group's trace, then their rows into the
        store; all acknowledged before faust may commit their verdicts."""
        await self._land(emissions, await self._send(emissions))

    async def _send(self, emissions: list["Emission"]) -> list[asyncio.Future]:
        """Queues the groups' trajectories on the producer, each in its own group's trace; their
        acknowledgements."""
        sent = []
        for e in emissions:
            token = otel_context.attach(e.context)
            try:
                sent += [await self.producer.send("trajectories", t, key=e.group_id) for t in e.trajectories]
            finally:
                otel_context.detach(token)
        return sent

    async def _land(self, emissions: list["Emission"], sent: list[asyncio.Future], leaving: list[bytes] = ()
                    ) -> None:
        """Waits for the trajectories' acknowledgements, then for the groups' rows in the store; then the
        `leaving` groups (completed, in the table) leave it.

        The bus first: the learner waits for the trajectories, nobody waits for the rows, so the insert
        is not on a step's critical path. A crash between the two replays the batch (its verdicts are
        not committed yet): the learner skips samples it has (by id) and the store's tables keep one
        row per id (ReplacingMergeTree), so both end up with every group once."""
        await asyncio.gather(*sent)
        if self.store is not None:
            await asyncio.gather(self.trajectory_rows.add_all([r for e in emissions for r in e.rows]),
                                 self.turn_rows.add_all([r for e in emissions for r in e.turns]))
        self._forget(leaving)
        self.groups_emitted += len(emissions)
        self.incomplete_emitted += sum(not e.complete for e in emissions)

    async def _raise_alerts(self, verdict: verdict_pb2.Verdict) -> None:
        """The verdict's own alerts (tamper, canary) and the window detectors' (detectors.py): each goes
        to crucible.alerts, the alerts table and, with its evidence, the current span as an event."""
        found = [a for a in alerts_for(verdict, self.settings.run_id, self.config) if self._admit(a)]
        windows = self.detectors.windows
        found += self.detectors.observe(verdict)
        if self.detectors.windows != windows and self.store is not None:  # a window judged: kept for a restart
            await asyncio.to_thread(writes.insert, self.store, DETECTOR_STATE, [
                [self.settings.run_id, self.detectors.windows, json.dumps(self.detectors.state())]],
                DETECTOR_STATE_COLUMNS)
        if not found:
            return
        span = trace.get_current_span()
        for a in found:
            span.add_event(f"alert {a.kind}", {"message": a.message, **dict(a.details)})
        if self.store is not None:
            await asyncio.to_thread(writes.insert, self.store, "alerts", [alert_rows.row(a) for a in found],
                                    alert_rows.COLUMNS)
        for a in found:
            log.warning("alert %s: %s", a.kind, a.message)
            await self.producer.send_and_wait("alerts", a, key=a.kind)
        self.alerts_raised += len(found)

    def _new_detectors(self) -> WindowDetectors:
        s = self.settings
        return WindowDetectors(s.run_id, window=s.detect_window, tamper_rate=s.detect_tamper_rate,
                               component_gain=s.detect_component_gain)

    def _restore_detectors(self) -> None:
        """The detectors as the run's last aggregator left them (a run id's, in the store), if any."""
        rows = self.store.query(f"SELECT state FROM {DETECTOR_STATE} FINAL WHERE run_id = {{run:String}}",
                                parameters={"run": self.settings.run_id}).result_rows
        if not rows:
            return
        try:
            self.detectors.restore(json.loads(rows[0][0]))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # a row no aggregator of this build wrote
            self.detectors = self._new_detectors()  # (restore may have set part of the old one)
            log.warning("the detectors' stored state for run %r does not read (%s: %s): they judge against a new "
                        "baseline, the next window", self.settings.run_id, type(exc).__name__, str(exc)[:200])
            return
        log.info("detectors resumed after %d windows, against the run's baseline", self.detectors.windows)

    def _admit(self, alert: alert_pb2.Alert) -> bool:
        """A per-sample alert starts an incident, or is counted in the one under way (Cooldown)."""
        new, held = self.cooldown.admit(alert.kind)
        if new and held:
            alert.details["previous_incident_more_events"] = str(held)
        return new

    async def _dead_letter(self, event, headers, reason: str) -> None:
        m = event.message
        await self.producer.dead_letter(m.topic, m.partition, m.offset, event.key, event.value, headers, reason)
        self.dead_lettered += 1
