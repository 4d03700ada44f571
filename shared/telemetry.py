"""OpenTelemetry setup shared by every service, and W3C trace context for message headers.

Traces and metrics always go to an in-process SDK provider (so spans exist and
carry trace ids even on a laptop); they are exported over OTLP only when
CRUCIBLE_OTEL_ENDPOINT (or the standard OTEL_EXPORTER_OTLP_ENDPOINT) is set.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from crucible.shared.settings import Settings, get_settings

_propagator = TraceContextTextMapPropagator()
_configured_service: str | None = None


def setup_telemetry(service_name: str, settings: Settings | None = None) -> None:
    """Installs tracer and meter providers for this process (once; later calls are no-ops)."""
    global _configured_service
    if _configured_service is not None:
        return
    settings = settings or get_settings()
    resource = Resource.create({"service.name": service_name, "service.namespace": "crucible"})
    endpoint = settings.otel_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")

    tracer_provider = TracerProvider(resource=resource)
    readers = []
    if endpoint:
        span_exporter, metric_exporter = _otlp_exporters(endpoint, settings.otel_protocol)
        tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
        readers.append(PeriodicExportingMetricReader(metric_exporter, export_interval_millis=10_000))
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))
    _configured_service = service_name


def _otlp_exporters(endpoint: str, protocol: str):
    if protocol == "http":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        base = endpoint.rstrip("/")
        return OTLPSpanExporter(endpoint=f"{base}/v1/traces"), OTLPMetricExporter(endpoint=f"{base}/v1/metrics")
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint, insecure=True), OTLPMetricExporter(endpoint=endpoint, insecure=True)


def tracer(name: str = "crucible") -> trace.Tracer:
    return trace.get_tracer(name)


def meter(name: str = "crucible") -> metrics.Meter:
    return metrics.get_meter(name)


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
