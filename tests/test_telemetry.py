"""The bus's per-record spans (telemetry.record_span) and its trace-context headers, against the SDK's own.

record_span stands in for the SDK's span on the hot path: what reaches the exporters must be what the
SDK's span would have given them, the provider's sampler must decide as it would, and the W3C headers
must be read and written exactly as the SDK's propagator reads and writes them.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings as hsettings, strategies as st
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace import sampling
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from crucible.shared import span_store, telemetry

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def provider_with(sampler=None) -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "telemetry-test"}), sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def exported(span, spans) -> dict:
    """What an exporter reads of a span, times aside, with its parent named: a remote span by its ids,
    one of `spans` by its name, or None."""
    local = {s.context.span_id: s.name for s in spans}
    parent = span.parent
    return {"name": span.name, "kind": span.kind, "attributes": dict(span.attributes),
            "parent": None if parent is None else local.get(parent.span_id) if not parent.is_remote
            else (parent.trace_id, parent.span_id),
            "trace": span.context.trace_id if parent is not None and parent.is_remote else len({
                s.context.trace_id for s in spans}),
            "sampled": span.context.trace_flags.sampled, "state": span.context.trace_state,
            "status": (span.status.status_code, span.status.description),
            "events": [(e.name, {k: v for k, v in e.attributes.items() if k != "exception.stacktrace"})
                       for e in span.events],
            "stacktrace": ["exception.stacktrace" in e.attributes for e in span.events],
            "resource": dict(span.resource.attributes), "scope": span.instrumentation_scope,
            "links": span.links}


def both_ways(provider, work, parent_headers=None) -> list[tuple[dict, dict]]:
    """Runs `work(span)` in an SDK span and in a record_span (same name, kind, attributes and parent),
    then pairs what the exporter got from each, children included."""
    exporter = provider._active_span_processor._span_processors[0].span_exporter
    tracer = provider.get_tracer("crucible.bus")
    got = []
    for way in ("sdk", "record"):
        exporter.clear()
        attributes = {"messaging.system": "kafka", "messaging.kafka.offset": 7}
        if way == "sdk":
            scope = tracer.start_as_current_span("t process", kind=trace.SpanKind.CONSUMER, attributes=attributes,
                                                 context=telemetry.extract_context(parent_headers)
                                                 if parent_headers is not None else None)
        else:
            scope = telemetry.record_span("t process", trace.SpanKind.CONSUMER, attributes, tracer_=tracer,
                                          **({"parent": telemetry.parent_from_headers(parent_headers)}
                                             if parent_headers is not None else {}))
        try:
            with scope as span:
                work(span, tracer)
        except ValueError:
            pass
        spans = exporter.get_finished_spans()
        got.append([exported(s, spans) for s in spans])
    return got


def test_a_record_span_exports_what_the_sdks_span_exports():
    provider, _ = provider_with()

    def work(span, tracer):
        span.set_attribute("extra", [1, 2])
        span.add_event("seen", {"why": "because"})
        with tracer.start_as_current_span("child"):
            pass

    for headers in (None, [("traceparent", PARENT.encode()), ("tracestate", b"k=v")], []):
        sdk, record = both_ways(provider, work, headers)
        assert len(sdk) == 2 and sdk == record
    sdk, record = both_ways(provider, work)
    assert sdk[1]["parent"] is None and sdk[0]["parent"] == "t process" and sdk[0]["trace"] == 1
    sdk, record = both_ways(provider, work, [("traceparent", PARENT.encode())])
    assert record[1]["parent"] == (0x0af7651916cd43dd8448eb211c80319c, 0xb7ad6b7169203331)


def test_a_record_span_records_an_exception_leaving_it_and_lets_it_go():
    provider, _ = provider_with()

    def work(span, tracer):
        raise ValueError("boom")

    sdk, record = both_ways(provider, work, [("traceparent", PARENT.encode())])
    assert sdk == record
    assert record[0]["status"] == (trace.StatusCode.ERROR, "ValueError: boom")
    assert record[0]["events"][0][1]["exception.type"] == "ValueError" and record[0]["stacktrace"] == [True]
    with pytest.raises(ValueError):
        with telemetry.record_span("x", trace.SpanKind.INTERNAL, {}, tracer_=provider.get_tracer("t")):
            raise ValueError("goes on")


def test_the_providers_sampler_decides_for_record_spans():
    provider, exporter = provider_with(ParentBased(TraceIdRatioBased(0.0)))
    tracer = provider.get_tracer("crucible.bus")
    with telemetry.record_span("root", trace.SpanKind.PRODUCER, {}, parent=None, tracer_=tracer) as root:
        # Not sampled, but still a context that children and headers carry on.
        assert root.get_span_context().is_valid and not root.get_span_context().trace_flags.sampled
        assert int(telemetry.inject_headers()[0][1][-2:], 16) & trace.TraceFlags.SAMPLED == 0
        with tracer.start_as_current_span("sdk root", context=otel_context.Context()) as sdk_root:
            assert sdk_root.get_span_context().trace_flags == root.get_span_context().trace_flags
        with tracer.start_as_current_span("child") as child:
            assert child.get_span_context().trace_id == root.get_span_context().trace_id
    assert exporter.get_finished_spans() == ()
    # A sampled parent from the headers is followed, as ParentBased says.
    with telemetry.record_span("followed", trace.SpanKind.CONSUMER, {}, tracer_=tracer,
                               parent=telemetry.parent_from_headers([("traceparent", PARENT.encode())])):
        pass
    assert [s.name for s in exporter.get_finished_spans()] == ["followed"]

    # An unsampled parent is followed too: the span is dropped as the SDK drops it, its context goes on.
    unsampled = telemetry.parent_from_headers([("traceparent", (PARENT[:-2] + "02").encode())])
    with telemetry.record_span("dropped", trace.SpanKind.CONSUMER, {}, tracer_=tracer, parent=unsampled) as span:
        sdk_span = tracer.start_span("sdk", context=telemetry.extract_context([("traceparent", (PARENT[:-2] + "02").encode())]))
        assert not span.is_recording() and not sdk_span.is_recording()
        assert span.get_span_context().trace_flags == sdk_span.get_span_context().trace_flags == 0x02
        assert span.get_span_context().trace_id == unsampled.trace_id
    assert [s.name for s in exporter.get_finished_spans()] == ["followed"]

    # A parent-based sampler whose delegates differ from the defaults is asked, as the SDK asks it.
    keeps_all = ParentBased(TraceIdRatioBased(0.0), remote_parent_not_sampled=ALWAYS_ON)
    kept, kept_exporter = provider_with(keeps_all)
    with telemetry.record_span("kept", trace.SpanKind.CONSUMER, {}, tracer_=kept.get_tracer("b"), parent=unsampled):
        pass
    with kept.get_tracer("b").start_as_current_span("sdk kept", context=telemetry.extract_context(
            [("traceparent", (PARENT[:-2] + "02").encode())])):
        pass
    assert [(s.name, s.context.trace_flags.sampled) for s in kept_exporter.get_finished_spans()] == [
        ("kept", True), ("sdk kept", True)]

    off, off_exporter = provider_with(ALWAYS_OFF)
    with telemetry.record_span("never", trace.SpanKind.CONSUMER, {}, tracer_=off.get_tracer("b"),
                               parent=telemetry.parent_from_headers([("traceparent", PARENT.encode())])) as span:
        assert not span.is_recording()
    assert off_exporter.get_finished_spans() == ()


def test_a_dropped_span_is_not_made_and_its_parents_context_goes_on_as_it_came():
    from opentelemetry import baggage

    provider, exporter = provider_with(ParentBased(TraceIdRatioBased(0.0)))
    tracer = provider.get_tracer("crucible.bus")
    unsampled = (PARENT[:-2] + "02").encode()
    outer = otel_context.attach(baggage.set_baggage("run", "r1"))
    try:
        for _ in range(3):  # the context made for the first record is the one the next ones get
            parent = telemetry.parent_from_headers([("traceparent", unsampled)])
            with telemetry.record_span("consume", trace.SpanKind.CONSUMER, {}, tracer_=tracer, parent=parent) as span:
                # The parent's context is current, as it came (no id of its own), with what the context held.
                assert not span.is_recording() and span.get_span_context() == parent
                assert dict(telemetry.inject_headers()) == {"traceparent": unsampled}
                assert baggage.get_baggage("run") == "r1"
                with telemetry.record_span("publish", trace.SpanKind.PRODUCER, {}, tracer_=tracer) as published:
                    assert dict(telemetry.inject_headers()) == {"traceparent": unsampled}
                    assert published.get_span_context() == parent and not published.is_recording()
                with tracer.start_as_current_span("sdk child") as child:
                    assert not child.is_recording() and child.get_span_context().trace_id == parent.trace_id
            assert trace.get_current_span() is trace.INVALID_SPAN and baggage.get_baggage("run") == "r1"
        # Another context the same trace is read on: its own values, not the first one's.
        token = otel_context.attach(baggage.set_baggage("run", "r2", otel_context.Context()))
        try:
            with telemetry.record_span("consume", trace.SpanKind.CONSUMER, {}, tracer_=tracer, parent=parent):
                assert baggage.get_baggage("run") == "r2" and trace.get_current_span().get_span_context() == parent
        finally:
            otel_context.detach(token)
    finally:
        otel_context.detach(outer)
    assert exporter.get_finished_spans() == ()

    # A sampler whose local delegates differ from the defaults decides the children of a dropped span
    # itself: that span is made (an id of its own), as the SDK makes it, and its child is kept.
    keeps_children = ParentBased(TraceIdRatioBased(0.0), local_parent_not_sampled=ALWAYS_ON)
    kept, kept_exporter = provider_with(keeps_children)
    with telemetry.record_span("dropped", trace.SpanKind.CONSUMER, {}, tracer_=kept.get_tracer("b"),
                               parent=parent) as span:
        assert span.get_span_context().span_id != parent.span_id and not span.is_recording()
        with kept.get_tracer("b").start_as_current_span("child"):
            pass
    assert [s.name for s in kept_exporter.get_finished_spans()] == ["child"]


def test_headers_written_for_one_span_are_never_another_spans():
    spans = [trace.NonRecordingSpan(trace.SpanContext(t, s, is_remote=False, trace_flags=trace.TraceFlags(f)))
             for t, s, f in ((1, 2, 0), (1, 3, 1), (4, 2, 0))]
    for span in spans + spans[::-1] + [spans[0]] * 2:
        with trace.use_span(span):
            headers = telemetry.inject_headers()
            context = span.get_span_context()
            assert headers == [("traceparent", f"00-{context.trace_id:032x}-{context.span_id:016x}-"
                                               f"{context.trace_flags:02x}".encode())]
            headers.append(("x", b"changed by its caller"))  # the caller's own list
    with trace.use_span(trace.INVALID_SPAN):
        assert telemetry.inject_headers() == []


def test_traceparents_read_once_are_kept_within_a_bound():
    telemetry._READ.clear()
    for i in range(telemetry._READ_MAX + 10):
        traceparent = f"00-{i + 1:032x}-{i + 1:016x}-00".encode()
        assert telemetry.parent_from_headers([("traceparent", traceparent)]).trace_id == i + 1
        assert len(telemetry._READ) <= telemetry._READ_MAX
    assert telemetry.parent_from_headers([("traceparent", b"00-" + b"0" * 32 + b"-00f067aa0ba902b7-00")]) is None
    assert telemetry.parent_from_headers([("traceparent", b"garbage")]) is None


TRACEPARENTS = [
    PARENT, PARENT.upper(), PARENT[:-2] + "00", PARENT + "-extra", "01" + PARENT[2:] + "-future", "ff" + PARENT[2:],
    "00-" + "0" * 32 + "-b7ad6b7169203331-01", "00-0af7651916cd43dd8448eb211c80319c-" + "0" * 16 + "-01",
    "  " + PARENT, PARENT + "  ", PARENT + "\t", PARENT[:-1], PARENT + "1", PARENT.replace("-", "_"),
    "00-0af7651916cd43dd8448eb211c80319_-b7ad6b7169203331-01", "00-+af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-+1", "00- af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0g", "", "garbage", "0" * 600,
    "01" + PARENT[2:] + "-" + "x" * 500, PARENT + "\n", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b71692033310-01",
]
TRACESTATES = [None, "a=1,b=2", "bad state", "k=" + "v" * 600, "", ",".join(f"{k}={'v' * 200}" for k in "abc")]


@pytest.mark.parametrize("traceparent", TRACEPARENTS)
@pytest.mark.parametrize("tracestate", TRACESTATES)
def test_headers_are_read_as_the_sdks_propagator_reads_them(traceparent, tracestate):
    headers = [("traceparent", traceparent.encode())] + ([("tracestate", tracestate.encode())] if tracestate is not None
                                                          else [])
    carrier = {k: v.decode() for k, v in headers}
    expected = trace.get_current_span(TraceContextTextMapPropagator().extract(carrier)).get_span_context()
    got = telemetry.parent_from_headers(headers)
    assert telemetry.parent_from_headers([(k, v.decode()) for k, v in headers]) == got  # gRPC metadata: str
    if not expected.is_valid:
        assert got is None
    else:
        assert got == expected and got.is_remote and got.trace_state == expected.trace_state


def test_headers_are_written_as_the_sdks_propagator_writes_them():
    provider, _ = provider_with()
    parent = telemetry.parent_from_headers([("traceparent", PARENT.encode()), ("tracestate", b"k=v,a=b")])
    for state_headers in (True, False):
        with telemetry.record_span("out", trace.SpanKind.PRODUCER, {}, tracer_=provider.get_tracer("b"),
                                   parent=parent if state_headers else None):
            carrier: dict[str, str] = {}
            TraceContextTextMapPropagator().inject(carrier)
            assert dict((k, v.decode()) for k, v in telemetry.inject_headers()) == carrier
            assert dict(telemetry.inject_metadata()) == carrier
            assert ("tracestate" in carrier) == state_headers
    token = otel_context.attach(otel_context.Context())
    try:
        assert telemetry.inject_headers() == [] and telemetry.inject_metadata() == []
    finally:
        otel_context.detach(token)


def test_a_share_of_traces_is_kept_whole_by_default():
    """The default keeps an eighth of the traces begun here, chosen by trace id, and a kept trace's
    record spans are kept in every service after it (children follow the parent's flag)."""
    from crucible.shared.settings import Settings

    ratio = Settings.model_fields["otel_trace_ratio"].default
    assert 0 < ratio < 1 and telemetry.sampler_for(1.0) is sampling.DEFAULT_ON
    provider, exporter = provider_with(telemetry.sampler_for(ratio))
    tracer = provider.get_tracer("crucible.bus")
    kept_roots, followed = 0, 0
    for _ in range(2000):
        with telemetry.record_span("tasks publish", trace.SpanKind.PRODUCER, {}, parent=None, tracer_=tracer) as root:
            headers = telemetry.inject_headers()
        kept_roots += root.get_span_context().trace_flags.sampled
        # The next service, from the headers alone.
        with telemetry.record_span("tasks process", trace.SpanKind.CONSUMER, {}, tracer_=tracer,
                                   parent=telemetry.parent_from_headers(headers)) as child:
            assert child.get_span_context().trace_flags.sampled == root.get_span_context().trace_flags.sampled
            assert child.is_recording() == root.get_span_context().trace_flags.sampled
        followed += child.get_span_context().trace_flags.sampled
    assert followed == kept_roots
    assert 2000 * ratio * 0.7 < kept_roots < 2000 * ratio * 1.3
    names = [s.name for s in exporter.get_finished_spans()]
    assert names.count("tasks publish") == names.count("tasks process") == kept_roots


@given(names=st.text(max_size=20), attributes=st.dictionaries(
    st.text(max_size=10), st.one_of(st.text(max_size=30), st.integers(), st.floats(allow_nan=False),
                                    st.booleans(), st.lists(st.integers(), max_size=3)), max_size=5),
       description=st.text(max_size=20))
@hsettings(max_examples=200, deadline=None)
def test_a_spans_json_row_reads_back_as_its_row(names, attributes, description):
    """What the store's span writer sends (json_rows) is the row span_row makes, whatever the strings."""
    provider, exporter = provider_with()
    with provider.get_tracer("crucible.test").start_as_current_span(names, attributes=attributes) as span:
        span.set_status(trace.Status(trace.StatusCode.ERROR, description))
    [finished] = exporter.get_finished_spans()
    row = span_store.span_row(finished, stamp=span_store._stamp)
    assert json.loads(span_store.json_rows([finished])) == row


def test_a_log_record_is_one_line_whatever_its_message_quotes():
    """A record's key, quoted by its dead-letter reason, wrote whole log lines in the service's own format."""
    import io
    import logging

    from crucible.shared.service import OneLineFormatter

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(OneLineFormatter("%(name)s %(levelname)s %(message)s"))
    logger = logging.getLogger("crucible.test.oneline")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        forged = "k\n2099-01-01 learner WARNING alert none: all clear\x1b[2J\r"
        logger.warning("undecodable: key %r said %s", forged, forged)
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed on %s", "a\nb")
    finally:
        logger.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("crucible.test.oneline WARNING undecodable") and "all clear" in lines[0]
    assert "\x1b" not in stream.getvalue() and "\r" not in stream.getvalue()
    assert lines[1] == "crucible.test.oneline ERROR failed on a\\nb" and lines[2].startswith("  Traceback")
    assert all(line.startswith("  ") for line in lines[2:])  # a traceback's lines begin none of a record's
