"""One task, one trace: from the submitter through all five services (as processes) to the learner step."""
from __future__ import annotations

import asyncio
import json

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from crucible.cli.recipe import Recipe
from crucible.cli.train import Run
from crucible.ml.policy.checkpoint import fresh_policy, save_checkpoint
from crucible.shared import bus, store, telemetry
from crucible.v1 import task_pb2

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.store, pytest.mark.sandbox]

# The path of a python_tests task, read from the learner step back to the submitter.
HOPS = ["learner", "reward-aggregator", "verifier", "sandbox-executor", "generator"]


def read_spans(path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def test_a_task_is_one_trace_through_all_five_services_and_the_learner_step(stack_settings, tmp_path):
    spans_file = tmp_path / "spans.jsonl"
    settings = stack_settings.model_copy(update={"home": tmp_path, "otel_span_file": spans_file})
    recipe = Recipe.model_validate({"algorithm": {"groups_per_step": 1, "max_policy_lag": -1},
                                    "sampling": {"max_tokens": 6}, "budget": {"steps": 1}})
    run = Run(settings, recipe)
    init = save_checkpoint(fresh_policy(0), tmp_path / "init", {"version": 0})
    await bus.ensure_topics(["tasks", "rollouts", "executions", "verdicts", "trajectories", "policy", "alerts"],
                            settings=run.settings)
    run.start_services(init.as_uri())
    try:
        # The submitter is this process: its spans (the submit span, the bus's publish span) are
        # kept in memory here; the services write theirs to the span file.
        telemetry.setup_telemetry("test-submitter")
        provider = trace.get_tracer_provider()
        assert isinstance(provider, TracerProvider)
        here = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(here))
        submitter = telemetry.tracer("test")
        task = task_pb2.Task(id="traced", kind="python_tests", prompt="def add(a, b):\n", group_size=2,
                             python_tests=task_pb2.PythonTests(entry_point="add",
                                                               test_code="def check(f):\n    assert f(2, 3) == 5\n"))
        with submitter.start_as_current_span("submit") as root:
            async with bus.Producer(run.settings) as producer:
                await producer.send_and_wait("tasks", task, key=task.id)
        trace_id = f"0x{root.get_span_context().trace_id:032x}"
        root_id = f"0x{root.get_span_context().span_id:016x}"
        submitted = {f"0x{s.context.span_id:016x}" for s in here.get_finished_spans()
                     if f"0x{s.context.trace_id:032x}" == trace_id}
        assert root_id in submitted
        for _ in range(300):
            run.check_services()
            spans = [s for s in read_spans(spans_file) if s["context"]["trace_id"] == trace_id]
            if any(s["name"] == "learner step" for s in spans):
                break
            await asyncio.sleep(0.5)
        else:
            pytest.fail(f"no learner step in the task's trace; services seen: "
                        f"{sorted({s['resource']['attributes']['service.name'] for s in spans})}")
    finally:
        run.stop_services()
    otel_context.attach(otel_context.Context())  # nothing of the submitter's context leaks into other tests

    spans = [s for s in read_spans(spans_file) if s["context"]["trace_id"] == trace_id]
    by_id = {s["context"]["span_id"]: s for s in spans}
    service = {i: s["resource"]["attributes"]["service.name"] for i, s in by_id.items()}
    assert set(HOPS) <= set(service.values())
    # Every span's parent is in the trace: one of the submitter's spans, or another service's span.
    orphans = [s["name"] for s in spans if s["parent_id"] not in by_id and s["parent_id"] not in submitted]
    assert not orphans, orphans
    # Walking up from the learner step passes through every service in pipeline order, to the submitter.
    step = next(s for s in spans if s["name"] == "learner step")
    path, at = [], step
    while at is not None:
        name = service[at["context"]["span_id"]]
        if not path or path[-1] != name:
            path.append(name)
        parent = at["parent_id"]
        if parent in submitted:
            break
        at = by_id.get(parent)
    assert path == HOPS, path
    assert trace.SpanKind.CONSUMER.name in {s["kind"].removeprefix("SpanKind.") for s in spans}

    # The same trace is in the store's otel_traces (the services write their spans there), every span
    # of it, with the same parents, in the collector exporter's column values.
    rows = stored_spans(settings, trace_id.removeprefix("0x"), set(HOPS))
    in_store = {r[0]: r for r in rows}
    assert {i.removeprefix("0x") for i in by_id} <= set(in_store), "spans missing from otel_traces"
    for span_id, span in by_id.items():
        row = in_store[span_id.removeprefix("0x")]
        assert row[1] == (span["parent_id"] or "").removeprefix("0x")
        assert row[2] == service[span_id] and row[3] == span["name"]
        assert row[4] == "SPAN_KIND_" + span["kind"].removeprefix("SpanKind.")
    parents = {r[1] for r in rows if r[1]}
    assert parents <= set(in_store) | {i.removeprefix("0x") for i in submitted}

    # The task's samples are stored with what their sandbox runs used, and with this trace's id.
    samples = store.connect(settings).query(
        "SELECT cpu_s, max_rss_bytes, duration_ms, trace_id, position(completion, char(0)) > 0 OR trim(completion) = '' "
        "FROM trajectories FINAL WHERE task_id = 'traced'").result_rows
    assert len(samples) == 2
    for cpu_s, rss, ms, sample_trace, refused in samples:
        assert sample_trace == trace_id.removeprefix("0x")
        if ms == 0:  # not run: only what the sandbox must refuse (this policy samples bytes at random)
            assert refused and (cpu_s, rss) == (0, 0)
        else:
            assert cpu_s > 0 and rss > 1 << 20


def stored_spans(settings, trace_id: str, services: set[str], timeout: float = 20.0) -> list[tuple]:
    """(SpanId, ParentSpanId, ServiceName, SpanName, SpanKind) of the trace's spans in the store's otel_traces."""
    import time

    client = store.connect(settings)
    deadline = time.monotonic() + timeout
    while True:
        rows = client.query("SELECT SpanId, ParentSpanId, ServiceName, SpanName, SpanKind FROM otel_traces "
                            "WHERE TraceId = {t:String}", parameters={"t": trace_id}).result_rows
        if services <= {r[2] for r in rows} or time.monotonic() > deadline:
            return rows
        time.sleep(0.5)
