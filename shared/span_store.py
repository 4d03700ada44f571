"""Spans into the store: the `otel_traces` table, in the OpenTelemetry Collector's ClickHouse-exporter schema.

In the embedded setup every service writes its own spans here (batched, off the request path), so
the same queries and trace views work whether spans come from this writer or from a collector
(deploy/otel-collector: OTLP in, ClickHouse out; then turn this writer off with
CRUCIBLE_OTEL_STORE_SPANS=false). Column values follow the exporter's: SpanKind "SPAN_KIND_SERVER",
StatusCode "STATUS_CODE_ERROR", ids in lower-case hex, attributes as strings.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import time
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, StatusCode

from crucible.shared.settings import Settings

log = logging.getLogger(__name__)

COLUMNS = ["Timestamp", "TraceId", "SpanId", "ParentSpanId", "TraceState", "SpanName", "SpanKind", "ServiceName",
           "ResourceAttributes", "ScopeName", "ScopeVersion", "SpanAttributes", "Duration", "StatusCode",
           "StatusMessage", "Events.Timestamp", "Events.Name", "Events.Attributes", "Links.TraceId", "Links.SpanId",
           "Links.TraceState", "Links.Attributes"]


def _time(ns: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ns / 1e9, dt.timezone.utc)


def _strings(attributes) -> dict[str, str]:
    return {str(k): (",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v))
            for k, v in dict(attributes or {}).items()}


_resources: dict[int, tuple[object, dict[str, str]]] = {}


def _resource(span: ReadableSpan) -> dict[str, str]:
    """The span's resource attributes as strings, worked out once per resource (a process has one)."""
    cached = _resources.get(id(span.resource))
    if cached is None or cached[0] is not span.resource:
        cached = _resources[id(span.resource)] = (span.resource, _strings(span.resource.attributes))
    return cached[1]


def span_row(span: ReadableSpan, stamp=_time) -> list:
    """One span as a row of otel_traces (COLUMNS order); `stamp` turns nanoseconds since the epoch into
    the row's timestamps (datetimes for clickhouse-connect; strings for a JSON insert)."""
    ctx = span.get_span_context()
    resource = _resource(span)
    scope = span.instrumentation_scope
    events, links = span.events, span.links
    return [
        stamp(span.start_time), f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}",
        f"{span.parent.span_id:016x}" if span.parent is not None else "",
        ctx.trace_state.to_header() if ctx.trace_state else "",
        span.name, _KINDS[span.kind], resource.get("service.name", ""), resource,
        scope.name if scope else "", (scope.version or "") if scope else "", _strings(span.attributes),
        max(0, (span.end_time or span.start_time) - span.start_time), _STATUSES[span.status.status_code],
        span.status.description or "",
        [stamp(e.timestamp) for e in events], [e.name for e in events],
        [_strings(e.attributes) for e in events],
        [f"{link.context.trace_id:032x}" for link in links], [f"{link.context.span_id:016x}" for link in links],
        [link.context.trace_state.to_header() if link.context.trace_state else "" for link in links],
        [_strings(link.attributes) for link in links],
    ]


_KINDS = {kind: f"SPAN_KIND_{kind.name}" for kind in SpanKind}
_STATUSES = {code: f"STATUS_CODE_{code.name}" for code in StatusCode}
_second: tuple[int, str] = (-1, "")  # the last whole second _stamp formatted, and its text (one object: thread-safe)


def _stamp(ns: int) -> str:
    """A DateTime64(9) as ClickHouse reads it in JSON: "YYYY-MM-DD hh:mm:ss.nnnnnnnnn" (UTC). A batch's
    spans mostly share their second: it is formatted once."""
    global _second
    seconds, fraction = divmod(ns, 1_000_000_000)
    last = _second
    if last[0] != seconds:
        last = _second = (seconds, f"{dt.datetime.fromtimestamp(seconds, dt.timezone.utc):%Y-%m-%d %H:%M:%S}.")
    return f"{last[1]}{fraction:09d}"


def json_rows(spans: Sequence[ReadableSpan]) -> bytes:
    """Spans as JSONCompactEachRow (one array per span, in COLUMNS order) for otel_traces: the rows
    span_row makes, written straight to text. What is the same for every span of a process (its
    service, resource and scope) is encoded once; json's C encoder does the rest. About a third of
    the cost of encoding span_row's lists (which was a third less than objects with their keys, and
    several times less than a Native-format insert built in Python)."""
    return ("\n".join([_json_row(span) for span in spans]) + "\n").encode()


def _json_row(span: ReadableSpan) -> str:
    encode = _ENCODER.encode  # for the events' and links' lists; strings and string maps are written below
    ctx, parent, status = span.get_span_context(), span.parent, span.status
    events, links = span.events, span.links
    start = span.start_time
    ids = f'"{_stamp(start)}","{ctx.trace_id:032x}","{ctx.span_id:016x}","{parent.span_id:016x}"' \
        if parent is not None else f'"{_stamp(start)}","{ctx.trace_id:032x}","{ctx.span_id:016x}",""'
    state = encode(ctx.trace_state.to_header()) if ctx.trace_state else '""'
    duration = max(0, (span.end_time or start) - start)
    tail = _NO_EVENTS_OR_LINKS if not events and not links else encode([
        [_stamp(e.timestamp) for e in events], [e.name for e in events], [_strings(e.attributes) for e in events],
        [f"{link.context.trace_id:032x}" for link in links], [f"{link.context.span_id:016x}" for link in links],
        [link.context.trace_state.to_header() if link.context.trace_state else "" for link in links],
        [_strings(link.attributes) for link in links]])[1:-1]
    return (f'[{ids},{state},{_quote(span.name)},"{_KINDS[span.kind]}",{_process_part(span)},'
            f'{_string_map(_strings(span.attributes))},{duration},"{_STATUSES[status.status_code]}",'
            f'{_quote(status.description or "")},{tail}]')


_quote = json.encoder.encode_basestring_ascii  # a str as the encoder writes it (ensure_ascii), quotes included


def _string_map(strings: dict[str, str]) -> str:
    """A dict of strings as the encoder writes it, without the encoder's setup for each call (about
    two thirds of the cost of a span's few attributes)."""
    return "{" + ",".join([f"{_quote(k)}:{_quote(v)}" for k, v in strings.items()]) + "}"


_NO_EVENTS_OR_LINKS = "[],[],[],[],[],[],[]"
_process_parts: dict[tuple[int, int], tuple[object, object, str]] = {}


def _process_part(span: ReadableSpan) -> str:
    """ServiceName, ResourceAttributes, ScopeName, ScopeVersion as JSON, encoded once per resource and scope."""
    resource, scope = span.resource, span.instrumentation_scope
    cached = _process_parts.get((id(resource), id(scope)))
    if cached is None or cached[0] is not resource or cached[1] is not scope:
        attributes = _resource(span)
        text = _ENCODER.encode([attributes.get("service.name", ""), attributes, scope.name if scope else "",
                                (scope.version or "") if scope else ""])[1:-1]
        cached = _process_parts[(id(resource), id(scope))] = (resource, scope, text)
    return cached[2]


_ENCODER = json.JSONEncoder(separators=(",", ":"))  # made once: json.dumps with options makes one a call


class StoreSpanExporter(SpanExporter):
    """Inserts finished spans into otel_traces. A store that is down costs those spans (said once a
    minute in the log), never the service: tracing must not stop the work it traces."""

    def __init__(self, settings: Settings):
        from crucible.shared.store import client

        self.settings = settings
        # Imported here, in the thread that sets telemetry up: the first export would otherwise spend half
        # a second importing clickhouse-connect on the exporter's thread, beside the service's work.
        self._connect = client.connect
        self._client = None
        self._last_complaint = 0.0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            if self._client is None:
                self._client = self._connect(self.settings)
            self._client.raw_insert("otel_traces", COLUMNS, json_rows(spans), fmt="JSONCompactEachRow")
            return SpanExportResult.SUCCESS
        except Exception as exc:  # noqa: BLE001 -- any failure of the store: drop these spans, keep serving
            self._client = None
            if time.monotonic() - self._last_complaint > 60:
                self._last_complaint = time.monotonic()
                log.warning("could not write %d spans to the store's otel_traces (%s); spans are dropped "
                            "until it answers", len(spans), str(exc)[:200])
            return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        if self._client is not None:
            self._client.close()
