"""OpenTelemetry setup shared by every service, and W3C trace context for message headers.

Traces always go to an in-process SDK provider (so spans exist and carry trace
ids even on a laptop); they are written into the store's `otel_traces` table
(shared/span_store.py, unless CRUCIBLE_OTEL_STORE_SPANS=false) and exported over
OTLP when CRUCIBLE_OTEL_ENDPOINT (or the standard OTEL_EXPORTER_OTLP_ENDPOINT) is set.
"""
from __future__ import annotations

import functools

import os
from collections.abc import Iterable, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from crucible.shared.settings import Settings, get_settings

_propagator = TraceContextTextMapPropagator()
# How often a service writes its spans into the store (sooner once 512 wait). Each insert is a new part
# that the store writes and merges later, about 6 ms of its CPU however few rows it holds: every second,
# the services' span inserts took half the store's CPU (~85 ms a step of the built-in recipe). A service
# that stops normally writes what it holds at exit (the provider's shutdown); a killed one loses at most
# this much of its spans.
STORE_SPANS_EVERY_MS = 5000
# Spans written in one insert at most. The SDK's default (512) had the busiest services (the verifier and
# the reward-aggregator, ~250 spans a step each) insert two or three times in 5 s; an insert costs the
# store about as much for 1 row as for 500 (12 against 27 ms of its CPU, measured here).
STORE_SPANS_PER_INSERT = 4096
_configured_service: str | None = None


def setup_telemetry(service_name: str, settings: Settings | None = None) -> None:
    """Installs the tracer provider for this process (once; later calls are no-ops)."""
    global _configured_service
    if _configured_service is not None:
        return
    settings = settings or get_settings()
    resource = Resource.create({"service.name": service_name, "service.namespace": "crucible"})
    endpoint = settings.otel_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")

    tracer_provider = TracerProvider(resource=resource)
    if endpoint:
        tracer_provider.add_span_processor(BatchSpanProcessor(_otlp_span_exporter(endpoint, settings.otel_protocol)))
    if settings.otel_store_spans:
        from crucible.shared.span_store import StoreSpanExporter

        tracer_provider.add_span_processor(BatchSpanProcessor(StoreSpanExporter(settings),
                                                              schedule_delay_millis=STORE_SPANS_EVERY_MS,
                                                              max_export_batch_size=STORE_SPANS_PER_INSERT,
                                                              max_queue_size=4 * STORE_SPANS_PER_INSERT))
    if settings.otel_span_file:
        out = open(settings.otel_span_file, "a", buffering=1)  # line-buffered: a killed service loses no span
        tracer_provider.add_span_processor(SimpleSpanProcessor(
            ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n")))
    trace.set_tracer_provider(tracer_provider)
    _configured_service = service_name


def _otlp_span_exporter(endpoint: str, protocol: str):
    if protocol == "http":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=f"{endpoint.rstrip('/')}/v1/traces")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint, insecure=True)


@functools.cache
def tracer(name: str = "crucible") -> trace.Tracer:
    """One tracer per name for the process (the API's proxy until setup_telemetry sets the provider, then
    the provider's): making one per call cost more than the span it made."""
    return trace.get_tracer(name)


def inject_headers(ctx: otel_context.Context | None = None) -> list[tuple[str, bytes]]:
    """The current (or given) trace context as Kafka-style headers: traceparent, tracestate."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=ctx)
    return [(k, v.encode()) for k, v in carrier.items()]


def extract_context(headers: Iterable[tuple[str, bytes | str]] | None) -> otel_context.Context:
    """A context whose parent span is the one named by traceparent in the headers (if any)."""
    carrier = {}
    for key, value in headers or ():
        if key in ("traceparent", "tracestate"):
            carrier[key] = value.decode("latin-1") if isinstance(value, bytes) else value
    return _propagator.extract(carrier)


def inject_metadata() -> list[tuple[str, str]]:
    """The current trace context as gRPC metadata."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return list(carrier.items())


def current_trace_id() -> str:
    """Hex trace id of the active span, or '' outside any span."""
    span_ctx = trace.get_current_span().get_span_context()
    return format(span_ctx.trace_id, "032x") if span_ctx.is_valid else ""


def header_value(headers: Sequence[tuple[str, bytes]] | None, name: str) -> str | None:
    for key, value in headers or ():
        if key == name:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return None
