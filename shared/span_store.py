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


def span_row(span: ReadableSpan) -> list:
    """One span as a row of otel_traces (COLUMNS order)."""
    ctx = span.get_span_context()
    resource = _resource(span)
    scope = span.instrumentation_scope
    return [
        _time(span.start_time), f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}",
        f"{span.parent.span_id:016x}" if span.parent is not None else "",
        ctx.trace_state.to_header() if ctx.trace_state else "",
        span.name, f"SPAN_KIND_{span.kind.name}", resource.get("service.name", ""), resource,
        scope.name if scope else "", (scope.version or "") if scope else "", _strings(span.attributes),
        max(0, (span.end_time or span.start_time) - span.start_time), f"STATUS_CODE_{span.status.status_code.name}",
        span.status.description or "",
        [_time(e.timestamp) for e in span.events], [e.name for e in span.events],
        [_strings(e.attributes) for e in span.events],
        [f"{link.context.trace_id:032x}" for link in span.links], [f"{link.context.span_id:016x}" for link in span.links],
        [link.context.trace_state.to_header() if link.context.trace_state else "" for link in span.links],
        [_strings(link.attributes) for link in span.links],
    ]


def _stamp(ns: int) -> str:
    """A DateTime64(9) as ClickHouse reads it in JSON: "YYYY-MM-DD hh:mm:ss.nnnnnnnnn" (UTC)."""
    seconds, fraction = divmod(ns, 1_000_000_000)
    return f"{dt.datetime.fromtimestamp(seconds, dt.timezone.utc):%Y-%m-%d %H:%M:%S}.{fraction:09d}"


def json_rows(spans: Sequence[ReadableSpan]) -> bytes:
    """Spans as JSONEachRow for otel_traces: json's C encoder does the work, so exporting spans takes
    little of the service's interpreter (a Native-format insert built in Python costs several times more)."""
    lines = []
    for span in spans:
        row = span_row(span)
        row[0] = _stamp(span.start_time)
        row[15] = [_stamp(e.timestamp) for e in span.events]
        lines.append(json.dumps(dict(zip(COLUMNS, row)), separators=(",", ":")))
    return ("\n".join(lines) + "\n").encode()


class StoreSpanExporter(SpanExporter):
    """Inserts finished spans into otel_traces. A store that is down costs those spans (said once a
    minute in the log), never the service: tracing must not stop the work it traces."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._client = None
        self._last_complaint = 0.0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            if self._client is None:
                from crucible.shared import store

                self._client = store.connect(self.settings)
            self._client.raw_insert("otel_traces", COLUMNS, json_rows(spans), fmt="JSONEachRow")
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
