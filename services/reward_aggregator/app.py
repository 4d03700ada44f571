"""The faust-streaming app: a table keyed by group id joins verdicts; stragglers time out.

    crucible.verdicts --(agent `join`)--> table[group_id] --complete--> crucible.trajectories + ClickHouse
    timer --(key: group_id)--> crucible.aggregator.expire --(agent `expire`)--> incomplete groups

Table writes happen only inside agents (faust records them in the table's changelog, which is
what makes the join survive a restart); the timer therefore does not touch the table itself but
asks, through a topic keyed like the table, for old groups to be flushed.
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import time

import faust
from opentelemetry import trace

from crucible.v1 import verdict_pb2
from crucible.services.reward_aggregator.handler import (
    ALERT_COLUMNS,
    TRAJECTORY_COLUMNS,
    RewardConfig,
    alert_row,
    alerts_for,
    check_verdict,
    group_trajectories,
    trajectory_row,
)
from crucible.shared import messages, telemetry
from crucible.shared.bus import DLQ_SUFFIX, H_CONTENT_TYPE, H_DLQ_REASON, H_DLQ_SOURCE, H_SCHEMA
from crucible.shared.settings import Settings

log = logging.getLogger("crucible.aggregator")


def _headers(event_headers) -> list[tuple[str, bytes]]:
    if not event_headers:
        return []
    items = event_headers.items() if hasattr(event_headers, "items") else event_headers
    return [(k, v if isinstance(v, bytes) else str(v).encode()) for k, v in items]


class Aggregator:
    """Owns the faust app and what its agents need (settings, store client, counters)."""

    def __init__(self, settings: Settings, store_client=None, *, app_id: str | None = None,
                 timer_interval_s: float = 1.0):
        self.settings = settings
        self.store = store_client
        self.config = RewardConfig(settings.aggregator_estimator, settings.reward_weights,
                                   settings.length_penalty, settings.length_target)
        self.groups_emitted = 0
        self.incomplete_emitted = 0
        self.dead_lettered = 0
        self.tracer = telemetry.tracer("crucible.aggregator")
        self.app = faust.App(
            app_id or f"{settings.consumer_group_prefix}reward-aggregator",
            broker=";".join(f"kafka://{b}" for b in settings.kafka_bootstrap.split(",")),
            store="memory://", web_enabled=False, topic_partitions=1,
            value_serializer="raw", key_serializer="raw", producer_acks=-1,
            consumer_auto_offset_reset="earliest",
        )
        self.verdicts = self.app.topic(settings.topic("verdicts"), value_serializer="raw", key_serializer="raw")
        self.expire_topic = self.app.topic(settings.topic("aggregator.expire"), value_serializer="raw",
                                           key_serializer="raw")
        self.trajectories = self.app.topic(settings.topic("trajectories"), value_serializer="raw",
                                           key_serializer="raw")
        self.alerts = self.app.topic(settings.topic("alerts"), value_serializer="raw", key_serializer="raw")
        self.alerts_raised = 0
        self.dlq = self.app.topic(settings.topic("verdicts") + DLQ_SUFFIX, value_serializer="raw",
                                  key_serializer="raw")
        # group id -> JSON {"first_seen": unix seconds, "group_size": n, "verdicts": {index: base64 protobuf}}
        self.groups = self.app.Table("groups", default=None, key_type=bytes, value_type=bytes, partitions=1)
        self.app.agent(self.verdicts, name="join")(self._join)
        self.app.agent(self.expire_topic, name="expire")(self._expire)
        self.app.timer(interval=timer_interval_s)(self._sweep)

    # --- agents ---

    async def _join(self, stream):
        async for event in stream.events():
            headers = _headers(event.headers)
            try:
                verdict = messages.decode(event.value, verdict_pb2.Verdict,
                                          schema=telemetry.header_value(headers, H_SCHEMA),
                                          content_type=telemetry.header_value(headers, H_CONTENT_TYPE))
            except messages.MessageDecodeError as exc:
                await self._dead_letter(event, headers, f"undecodable: {exc}")
                continue
            problem = check_verdict(verdict)
            if problem:
                await self._dead_letter(event, headers, f"rejected: {problem}")
                continue
            group_id = verdict.rollout.group_id
            await self._raise_alerts(verdict)
            with self.tracer.start_as_current_span("aggregate verdict", context=telemetry.extract_context(headers),
                                                   kind=trace.SpanKind.CONSUMER):
                entry = self._entry(group_id.encode()) or {
                    "first_seen": time.time(), "group_size": verdict.rollout.group_size, "verdicts": {}}
                # A replayed verdict overwrites its own slot: the join is idempotent per sample index.
                entry["verdicts"][str(verdict.rollout.sample_index)] = base64.b64encode(event.value).decode()
                if len(entry["verdicts"]) >= entry["group_size"]:
                    await self._emit(group_id, entry, complete=True)
                    self.groups.pop(group_id.encode(), None)
                else:
                    self.groups[group_id.encode()] = json.dumps(entry).encode()

    async def _expire(self, stream):
        async for key, _ in stream.items():
            entry = self._entry(key)
            if entry is None:
                continue  # completed meanwhile
            if time.time() - entry["first_seen"] >= self.settings.aggregator_group_timeout_s:
                await self._emit(key.decode(), entry, complete=False)
                self.groups.pop(key, None)

    async def _sweep(self):
        now = time.time()
        for key in list(self.groups.keys()):
            entry = self._entry(key)
            if entry and now - entry["first_seen"] >= self.settings.aggregator_group_timeout_s:
                await self.expire_topic.send(key=key, value=b"")

    def _entry(self, key: bytes) -> dict | None:
        raw = self.groups.get(key)
        return json.loads(raw) if raw else None

    # --- output ---

    async def _emit(self, group_id: str, entry: dict, *, complete: bool) -> None:
        verdicts = [verdict_pb2.Verdict.FromString(base64.b64decode(v)) for v in entry["verdicts"].values()]
        trajectories = group_trajectories(verdicts, self.config, complete=complete)
        trace_id = telemetry.current_trace_id()
        if self.store is not None:
            rows = [trajectory_row(t, trace_id) for t in trajectories]
            await asyncio.to_thread(self.store.insert, "trajectories", rows, column_names=TRAJECTORY_COLUMNS)
        for t in trajectories:
            headers = {H_SCHEMA: messages.schema_name(t).encode(),
                       H_CONTENT_TYPE: messages.CONTENT_TYPE_PROTOBUF.encode(),
                       **dict(telemetry.inject_headers())}
            await self.trajectories.send(key=group_id.encode(), value=messages.encode(t), headers=headers)
        self.groups_emitted += 1
        if not complete:
            self.incomplete_emitted += 1
            log.info("group %s timed out with %d of %d verdicts", group_id, len(verdicts), entry["group_size"])

    async def _raise_alerts(self, verdict: verdict_pb2.Verdict) -> None:
        alerts = alerts_for(verdict, self.settings.run_id)
        if not alerts:
            return
        if self.store is not None:
            await asyncio.to_thread(self.store.insert, "alerts", [alert_row(a) for a in alerts],
                                    column_names=ALERT_COLUMNS)
        for a in alerts:
            log.warning("alert %s: %s", a.kind, a.message)
            await self.alerts.send(key=a.kind.encode(), value=messages.encode(a),
                                   headers={H_SCHEMA: messages.schema_name(a).encode(),
                                            H_CONTENT_TYPE: messages.CONTENT_TYPE_PROTOBUF.encode()})
        self.alerts_raised += len(alerts)

    async def _dead_letter(self, event, headers, reason: str) -> None:
        self.dead_lettered += 1
        log.warning("dead-lettering verdict at offset %s: %s", event.message.offset, reason)
        source = f"{event.message.topic}/{event.message.partition}@{event.message.offset}"
        kept = {k: v for k, v in headers if k not in (H_DLQ_REASON, H_DLQ_SOURCE)}
        kept[H_DLQ_REASON] = reason.encode("utf-8", "replace")[:4000]
        kept[H_DLQ_SOURCE] = source.encode()
        await self.dlq.send(key=event.key, value=event.value, headers=kept)
