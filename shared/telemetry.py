"""OpenTelemetry setup shared by every service, and W3C trace context for message headers.

Traces always go to an in-process SDK provider (so spans exist and carry trace
ids even on a laptop); they are written into the store's `otel_traces` table
(shared/span_store.py, unless CRUCIBLE_OTEL_STORE_SPANS=false) and exported over
OTLP when CRUCIBLE_OTEL_ENDPOINT (or the standard OTEL_EXPORTER_OTLP_ENDPOINT) is set.
"""
from __future__ import annotations

import os
import re
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace import sampling
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

from crucible.shared.settings import Settings, get_settings

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

    # OTel's own OTEL_TRACES_SAMPLER, where set, decides instead (the SDK reads it when given no sampler).
    tracer_provider = TracerProvider(resource=resource, sampler=None if os.environ.get("OTEL_TRACES_SAMPLER")
                                     else sampler_for(settings.otel_trace_ratio))
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


def sampler_for(ratio: float) -> sampling.Sampler:
    """Head sampling: a trace begun here (a task published, a root span) is kept with probability
    `ratio`, by its trace id; every later span follows its parent's decision, in every service, so a
    trace is kept whole or not at all."""
    return sampling.DEFAULT_ON if ratio >= 1 else sampling.ParentBased(sampling.TraceIdRatioBased(ratio))


def _otlp_span_exporter(endpoint: str, protocol: str):
    if protocol == "http":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=f"{endpoint.rstrip('/')}/v1/traces")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint, insecure=True)


def tracer(name: str = "crucible") -> trace.Tracer:
    """One tracer per name for the process, the provider's: making one per call cost more than the span
    it made. Before setup_telemetry there is only the API's proxy, which is handed out but not kept."""
    found = _tracers.get(name)
    if found is None:
        found = trace.get_tracer(name)
        if not isinstance(found, trace.ProxyTracer):
            _tracers[name] = found
    return found


_tracers: dict[str, trace.Tracer] = {}


CURRENT = object()  # record_span's parent: the current span (the default)


def record_span(name: str, kind: trace.SpanKind, attributes: dict, *, parent=CURRENT,
                tracer_: trace.Tracer | None = None):
    """A recording span, made current while the `with` block runs, for work done once per record
    (the bus's consumer and publish spans). `parent`: the current span by default, else a
    SpanContext (a remote one from headers) or None (a new trace).

    The SDK's own span costs ~65 us here to start, make current and end: validated attributes
    behind locks, the sampler's call, span-limit bookkeeping, three context-manager layers. This
    one is a plain object until it ends, when the provider's processors get a ReadableSpan like
    the SDK's; it honours the provider's sampler, and exceptions are recorded as the SDK does.
    Where no SDK provider is installed it is the API's span (non-recording). `attributes` becomes
    the span's (pass a dict of your own); `tracer_`: this process's "crucible.bus" tracer by default."""
    tracer_ = tracer_ or tracer("crucible.bus")
    if not isinstance(tracer_, SdkTracer) or not tracer_._is_enabled():
        context = None if parent is CURRENT else _context_of(parent)
        return tracer_.start_as_current_span(name, context=context, kind=kind, attributes=attributes)
    current = parent is CURRENT
    if current:
        parent = trace.get_current_span().get_span_context()
    return carried(parent, tracer_, current) or _RecordScope(_RecordedSpan.start(tracer_, name, kind, attributes,
                                                                                 parent))


def carried(parent: trace.SpanContext | None, tracer_: trace.Tracer | None = None, current: bool = False):
    """The scope of a span under `parent` that the sampler drops by the parent's flag alone (a `with`
    block in which the parent's context is current), or None where a span is to be made. Such a
    span is not made: the SDK's dropped span takes an id of its own that nothing ever records, and cost
    a record ~3 us to start and carry; the parent's context goes on as it came, so records of an
    unsampled trace carry one traceparent, read once. `current`: `parent` is the current span's.
    A caller with attributes to build asks first (bus.consume_span); record_span asks it too."""
    if parent is None or parent.trace_flags not in _NOT_SAMPLED or not parent.is_valid:
        return None
    tracer_ = tracer_ or tracer("crucible.bus")
    if not isinstance(tracer_, SdkTracer) or not tracer_._is_enabled() or not _drops_under(tracer_.sampler, parent):
        return None
    return _Carried(parent, current)


def _context_of(parent: trace.SpanContext | None) -> otel_context.Context:
    if parent is None or not parent.is_valid:
        return otel_context.Context()
    return trace.set_span_in_context(trace.NonRecordingSpan(parent), otel_context.Context())


_UNSET = trace.Status(trace.StatusCode.UNSET)
# The four trace flags a span of this process can carry (sampled or not; random trace id or not), made once.
_FLAGS = {f: trace.TraceFlags(f) for f in (0, trace.TraceFlags.SAMPLED, trace.TraceFlags.RANDOM_TRACE_ID,
                                           trace.TraceFlags.SAMPLED | trace.TraceFlags.RANDOM_TRACE_ID)}


def _follows_parent(sampler: sampling.Sampler, parent: trace.SpanContext) -> bool:
    """Whether `sampler` decides a child of `parent` by the parent's sampled flag alone, as ParentBased
    does with its default delegates (keeping the parent's trace state, adding no attributes)."""
    if type(sampler) is not sampling.ParentBased:
        return False
    if parent.is_remote:
        yes, no = sampler._remote_parent_sampled, sampler._remote_parent_not_sampled
    else:
        yes, no = sampler._local_parent_sampled, sampler._local_parent_not_sampled
    return yes is sampling.ALWAYS_ON and no is sampling.ALWAYS_OFF


# A parent's flags under which ParentBased drops its child and the child's flags are the parent's.
_NOT_SAMPLED = frozenset({0, trace.TraceFlags.RANDOM_TRACE_ID})


def _drops_under(sampler: sampling.Sampler, parent: trace.SpanContext) -> bool:
    """Whether a child of the unsampled `parent` is dropped by the parent's flag alone, and so would the
    child's own children be: ParentBased with its default delegates for local parents and, for a
    remote `parent`, for remote ones."""
    return (_follows_parent(sampler, parent)
            and sampler._local_parent_sampled is sampling.ALWAYS_ON
            and sampler._local_parent_not_sampled is sampling.ALWAYS_OFF)


class _Carried:
    """The scope `carried` gives: the parent's context is made current for the `with` block (it already
    is where the parent is the current span's). The context is kept for the next record of the same
    trace read on the same context (one per consumer task): made once, not per record."""

    __slots__ = ("parent", "_attach", "_token")

    def __init__(self, parent: trace.SpanContext, current: bool):
        self.parent, self._attach = parent, not current

    def __enter__(self) -> trace.Span:
        if not self._attach:
            return trace.NonRecordingSpan(self.parent)
        base = otel_context.get_current()
        made = _CARRIED.get(id(self.parent))
        if made is None or made[0] is not self.parent or made[1] is not base:
            span = trace.NonRecordingSpan(self.parent)
            if len(_CARRIED) >= _CARRIED_MAX:
                _CARRIED.clear()
            made = _CARRIED[id(self.parent)] = (self.parent, base, trace.set_span_in_context(span, base), span)
        self._token = otel_context.attach(made[2])
        return made[3]

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._attach:
            otel_context.detach(self._token)


# id(parent) -> (parent, the context it was made on, that context with the parent's span, the span)
_CARRIED: dict[int, tuple] = {}
_CARRIED_MAX = 256


class _RecordedSpan(trace.Span, ReadableSpan):
    """The span record_span makes: its attributes a plain dict of the caller's own values until it
    ends (what else is set on it goes through the SDK's attribute limits then). It is its own
    ReadableSpan (as the SDK's span is): ending it hands this object to the processors, no copy."""

    @classmethod
    def start(cls, tracer_: SdkTracer, name: str, kind: trace.SpanKind, attributes: dict,
              parent: trace.SpanContext | None) -> trace.Span:
        if parent is not None and not parent.is_valid:
            parent = None
        ids = tracer_.id_generator
        trace_id = ids.generate_trace_id() if parent is None else parent.trace_id
        sampler = tracer_.sampler
        if sampler is sampling.DEFAULT_ON and parent is None:  # always on at the root: no call needed
            sampled = recording = True
            state, extra = None, None
        elif parent is not None and _follows_parent(sampler, parent):  # the parent decided: no call needed
            sampled = recording = parent.trace_flags.sampled
            state, extra = parent.trace_state, None
        else:
            result = sampler.should_sample(_context_of(parent), trace_id, name, kind, attributes, ())
            sampled, recording = result.decision.is_sampled(), result.decision.is_recording()
            state, extra = result.trace_state, result.attributes
        flags = trace.TraceFlags.SAMPLED if sampled else trace.TraceFlags.DEFAULT
        if (ids.is_trace_id_random() if parent is None else parent.trace_flags.random_trace_id):
            flags |= trace.TraceFlags.RANDOM_TRACE_ID
        if not recording:  # dropped, as the SDK drops it: only its context goes on
            return trace.NonRecordingSpan(trace.SpanContext(trace_id, ids.generate_span_id(), False,
                                                            _FLAGS[flags], state))
        span = cls.__new__(cls)
        span._tracer, span._name, span._kind, span._parent = tracer_, name, kind, parent
        span._context = trace.SpanContext(trace_id, ids.generate_span_id(), False, _FLAGS[flags], state)
        span._attributes = {**extra, **attributes} if extra else attributes
        span._extra, span._events, span._links, span._status = None, [], (), _UNSET
        span._resource = tracer_.resource
        span._instrumentation_info, span._instrumentation_scope = (tracer_.instrumentation_info,
                                                                   tracer_._instrumentation_scope)
        span._start_time, span._end_time = time.time_ns(), None
        return span

    def get_span_context(self) -> trace.SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self._end_time is None

    def set_attribute(self, key: str, value) -> None:
        if self._end_time is None:
            self._extra = self._extra or {}
            self._extra[key] = value

    def set_attributes(self, attributes: Mapping) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def add_event(self, name: str, attributes: Mapping | None = None, timestamp: int | None = None) -> None:
        if self._end_time is None:
            limits = self._tracer._span_limits
            if limits.max_events is not None and len(self._events) >= limits.max_events:
                del self._events[0]  # the SDK keeps the newest max_events
            self._events.append(Event(name, BoundedAttributes(limits.max_event_attributes, attributes,
                                                              immutable=True,
                                                              max_value_len=limits.max_attribute_length),
                                      timestamp))

    def record_exception(self, exception: BaseException, attributes: Mapping | None = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        module, qualname = type(exception).__module__, type(exception).__qualname__
        self.add_event("exception", {
            "exception.type": f"{module}.{qualname}" if module and module != "builtins" else qualname,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
            **(attributes or {})}, timestamp)

    def set_status(self, status, description: str | None = None) -> None:
        if self._end_time is not None or self._status.status_code is trace.StatusCode.OK:
            return
        if not isinstance(status, trace.Status):
            status = trace.Status(status, description)
        if status.status_code is not trace.StatusCode.UNSET:
            self._status = status

    def update_name(self, name: str) -> None:
        if self._end_time is None:
            self._name = name

    def end(self, end_time: int | None = None) -> None:
        if self._end_time is not None:
            return
        self._end_time = end_time or time.time_ns()
        if self._extra:
            limits = self._tracer._span_limits
            self._attributes = BoundedAttributes(limits.max_span_attributes, {**self._attributes, **self._extra},
                                                 immutable=True, max_value_len=limits.max_span_attribute_length)
        self._events = tuple(self._events)
        self._tracer.span_processor.on_end(self)


class _RecordScope:
    """Makes a span current for a `with` block, records an exception leaving it (as the SDK's
    use_span does), then ends it."""

    __slots__ = ("span", "_token")

    def __init__(self, span: trace.Span):
        self.span = span

    def __enter__(self) -> trace.Span:
        self._token = otel_context.attach(trace.set_span_in_context(self.span))
        return self.span

    def __exit__(self, exc_type, exc, tb) -> None:
        otel_context.detach(self._token)
        if isinstance(exc, Exception) and self.span.is_recording():
            self.span.record_exception(exc)
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        self.span.end()


def inject_headers(ctx: otel_context.Context | None = None) -> list[tuple[str, bytes]]:
    """The current (or given) trace context as Kafka-style headers: traceparent, tracestate."""
    global _injected
    span_context = trace.get_current_span(ctx).get_span_context()
    last = _injected
    if last[0] is span_context:  # the records a span publishes (and all of an unsampled trace's) share it
        return list(last[1])
    if not span_context.is_valid:
        return []
    headers = [("traceparent", f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-"
                               f"{span_context.trace_flags:02x}".encode())]
    if span_context.trace_state:
        headers.append(("tracestate", span_context.trace_state.to_header().encode()))
    _injected = (span_context, tuple(headers))
    return headers


_injected: tuple = (None, ())  # the span context headers were last written for, and them (one object: thread-safe)


# W3C trace context, as the SDK's propagator reads it (version ff is invalid; version 00 has no suffix).
_TRACEPARENT = re.compile(r"[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)$")
_TRACEPARENT_MAX = 512
_TRACESTATE_MAX = 8192  # the SDK's limit for tracestate headers, all together
# What inject_headers writes (version 00, nothing around it), read without decoding it first.
_TRACEPARENT_00 = re.compile(rb"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def parent_from_headers(headers: Iterable[tuple[str, bytes | str]] | None) -> trace.SpanContext | None:
    """The remote span named by the headers' traceparent (and tracestate), or None where there is
    none or it is malformed (the record then starts a trace of its own, as with the SDK's propagator)."""
    traceparent, tracestate = None, []
    for key, value in headers or ():
        if key == "traceparent":
            traceparent = value
        elif key == "tracestate":
            tracestate.append(value.decode("latin-1") if isinstance(value, bytes) else value)
    if traceparent is None or len(traceparent) > _TRACEPARENT_MAX:
        return None
    if tracestate:
        return _parse_traceparent(traceparent, tracestate)
    # Records of one trace carry one traceparent (a dropped span passes its parent's on): read once.
    found = _READ.get(traceparent, _ABSENT)
    if found is _ABSENT:
        if len(_READ) >= _READ_MAX:
            _READ.clear()
        found = _READ[traceparent] = _parse_traceparent(traceparent, tracestate)
    return found


_READ: dict[bytes | str, trace.SpanContext | None] = {}  # traceparent (without tracestate) -> what it names
_READ_MAX = 4096
_ABSENT = object()


def _parse_traceparent(traceparent: bytes | str, tracestate: list[str]) -> trace.SpanContext | None:
    canonical = _TRACEPARENT_00.fullmatch(traceparent) if isinstance(traceparent, bytes) else None
    if canonical is not None:  # what inject_headers writes: no decoding, no version checks
        trace_id, span_id, flags = canonical.groups()
    else:
        if isinstance(traceparent, bytes):
            traceparent = traceparent.decode("latin-1")
        match = _TRACEPARENT.match(traceparent)
        if match is None:
            return None
        version, trace_id, span_id, flags, rest = match.groups()
        if version == "ff" or (version == "00" and rest):
            return None
    trace_id, span_id, flags = int(trace_id, 16), int(span_id, 16), int(flags, 16)
    if not trace_id or not span_id:
        return None
    state = None
    if tracestate and sum(map(len, tracestate)) + len(tracestate) - 1 <= _TRACESTATE_MAX:
        state = trace.TraceState.from_header(tracestate)
    known = _FLAGS.get(flags)
    return trace.SpanContext(trace_id, span_id, is_remote=True,
                             trace_flags=trace.TraceFlags(flags) if known is None else known, trace_state=state)


def extract_context(headers: Iterable[tuple[str, bytes | str]] | None) -> otel_context.Context:
    """A context whose parent span is the one named by traceparent in the headers (if any)."""
    parent = parent_from_headers(headers)
    if parent is None:
        return otel_context.Context()
    return trace.set_span_in_context(trace.NonRecordingSpan(parent), otel_context.Context())


def inject_metadata() -> list[tuple[str, str]]:
    """The current trace context as gRPC metadata."""
    return [(key, value.decode("latin-1")) for key, value in inject_headers()]


def current_trace_id() -> str:
    """Hex trace id of the active span, or '' outside any span."""
    span_ctx = trace.get_current_span().get_span_context()
    return format(span_ctx.trace_id, "032x") if span_ctx.is_valid else ""


def header_value(headers: Sequence[tuple[str, bytes]] | None, name: str) -> str | None:
    for key, value in headers or ():
        if key == name:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return None
