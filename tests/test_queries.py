"""Saved queries (`crucible query NAME`) over rows written by the services' own row builders."""
from __future__ import annotations

import datetime as dt
import time
import unicodedata
from collections import Counter

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from crucible.cli import rescore, status
from crucible.cli.main import main as crucible_main
from crucible.shared.settings import get_settings
from crucible.ml import envs
from crucible.ml.envs import episode as ep
from crucible.services.evaluator.__main__ import COLUMNS as EVAL_COLUMNS
from crucible.services.evaluator.__main__ import rows as evaluation_rows
from crucible.services.learner.rows import record_alert, record_steps, step_entry
from crucible.services.reward_aggregator.handler import (
    TRAJECTORY_COLUMNS,
    TURN_COLUMNS,
    RewardConfig,
    group_trajectories,
    trajectory_row,
    turn_rows,
)
from crucible.services.verifier.handler import verify_episode
from crucible.shared.procs import free_ports
from crucible.shared.settings import Settings
from crucible.shared.span_store import COLUMNS as SPAN_COLUMNS
from crucible.shared.span_store import span_row
from crucible.shared.store import migrate, queries
from crucible.v1 import alert_pb2, evaluation_pb2, execution_pb2, policy_pb2, trajectory_pb2, verdict_pb2

pytestmark = pytest.mark.store


def a_real_span():
    """A span from the SDK, with a parent, an event and attributes, as a service would make it."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "verifier"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("crucible.test")
    with tracer.start_as_current_span("parent"):
        with tracer.start_as_current_span("score") as span:
            span.set_attribute("task_id", "t-1")
            span.add_event("scored", {"reward": 1.0})
    return exporter.get_finished_spans()


def a_step_trace(start_ns: int) -> list:
    """One group's trace through the pipeline, each service's span at a known time (ms after start):
    sampled 0-100, verified 130-140, its last verdict joined at 200, published at 205, trained at 300."""
    exporter = InMemorySpanExporter()
    tracers = {}
    for service in ("generator", "verifier", "reward-aggregator", "learner"):
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracers[service] = provider.get_tracer("crucible.test")
    at = [start_ns + ms * 1_000_000 for ms in (0, 100, 130, 140, 200, 201, 205, 206, 300, 500)]
    root = tracers["generator"].start_span("crucible.run-1.tasks process", start_time=at[0])
    context = trace.set_span_in_context(root)
    for (service, name), (begin, end) in zip(
            [("verifier", "crucible.run-1.rollouts process"), ("reward-aggregator", "crucible.run-1.verdicts process"),
             ("reward-aggregator", "crucible.run-1.trajectories publish"), ("learner", "learner step")],
            [(at[2], at[3]), (at[4], at[5]), (at[6], at[7]), (at[8], at[9])]):
        tracers[service].start_span(name, context=context, start_time=begin).end(end_time=end)
    root.end(end_time=at[1])
    return exporter.get_finished_spans()


@pytest.fixture
def filled(store_client):
    """One episode group, its turns, the trace of its group, a step, an evaluation and an alert."""
    migrate(store_client)
    env = envs.get("lookup")
    task = next(env.generate("train", seed=2, group_size=2))
    verdicts = []
    for index, text in enumerate(["@lookup " + env.reference(task)[0].split()[-1], "red"]):
        episode = ep.start(task, "group-1", index, [1, 2], temperature=1.0, top_p=1.0, call_format="plain")
        turn = ep.add_turn(episode, text, [3, 4], [-0.5, -0.5], "stop", 0)
        if turn.HasField("call"):
            turn.observation, turn.observation_token_ids[:] = env.reference(task)[1], [5]
            turn.execution_ms = 3.5
            ep.add_turn(episode, env.reference(task)[1], [6], [-0.1], "stop", 0)
        episode.end = 1
        verdicts.append(verify_episode(episode))
    spans = a_real_span()
    trace_id = span_row(spans[0])[1]
    trajectories = group_trajectories(verdicts, RewardConfig("rloo", {}, 0.0, 0), complete=True)
    store_client.insert("trajectories", [trajectory_row(v, t, trace_id) for v, t in zip(verdicts, trajectories)],
                        column_names=TRAJECTORY_COLUMNS)
    store_client.insert("episode_turns", [r for v, t in zip(verdicts, trajectories) for r in turn_rows(v, t)],
                        column_names=TURN_COLUMNS)
    # and one single-turn sample whose code ran in the sandbox
    ran = verdict_pb2.Verdict(
        sample=trajectory_pb2.Trajectory(id="code-1/0", task_id="code-1", group_id="code-1/g", group_size=1,
                                         policy_version=1, passed=True),
        task_kind="python_tests", components={"tests_passed": 1.0}, reward=1.0, completion="def f(): return 1",
        execution=execution_pb2.ExecutionResult(exit_code=0, duration_ms=41.5, usage=execution_pb2.ResourceUsage(
            cpu_user_s=0.03, cpu_system_s=0.01, max_rss_bytes=25_000_000)))
    [code] = group_trajectories([ran], RewardConfig("rloo", {}, 0.0, 0), complete=True)
    step_spans = a_step_trace(time.time_ns())
    store_client.insert("trajectories", [trajectory_row(ran, code, span_row(step_spans[0])[1], "run-1")],
                        column_names=TRAJECTORY_COLUMNS)
    store_client.insert("otel_traces", [span_row(s) for s in spans + step_spans], column_names=SPAN_COLUMNS)
    # the version made by the step that trained on it (version 1 samples make version 2), with its timings
    store_client.insert("policy_versions", [["run-1", 2, "file:///y", 2, dt.datetime.now(dt.timezone.utc),
                                             {"step_ms": 200.0, "checkpoint_ms": 12.0, "publish_ms": 3.0}]],
                        column_names=["run_id", "version", "checkpoint_uri", "step", "created_at", "metrics"])
    record_steps(store_client, "run-1", [step_entry(1, 1, "file:///x", {"reward_mean": 0.5, "kl": 0.01, "step_ms": 12.0,
                                                                        "loss": 0.1}, {}, ["t1"])])
    message = evaluation_pb2.Evaluation(run_id="run-1", policy_version=1, tasks=4, passed=3, pass_rate=0.75,
                                        by_kind={"lookup": evaluation_pb2.KindResult(tasks=4, passed=3)})
    message.created_at.FromDatetime(dt.datetime.now(dt.timezone.utc))
    store_client.insert("evaluations", evaluation_rows(message), column_names=EVAL_COLUMNS)
    alert = alert_pb2.Alert(id="a-1", kind="kl_blowup", message="KL 2.0 at step 6")
    alert.created_at.FromDatetime(dt.datetime.now(dt.timezone.utc))
    record_alert(store_client, alert)
    # the first sample graded again, its reward taken back
    sample = (trajectories[0].id, task.id, task.kind, 1, "red", 1.0, {"answer_correct": 1.0}, 0)
    regraded = verdict_pb2.Verdict(reward=0.0, verifier_version="crucible-verifier/test")
    store_client.insert("rescores", [rescore.row("rescore-1", "run-1", sample, "lookup", regraded)],
                        column_names=rescore.COLUMNS)
    return store_client, task, trajectories


def test_every_saved_query_returns_the_rows_it_is_about(filled):
    client, task, trajectories = filled
    solved = next(t for t in trajectories if t.turns == 2)
    params = {"task": task.id, "trajectory": solved.id, "rescore": "rescore-1", "run": "run-1"}
    for name, query in queries.QUERIES.items():
        columns, rows = queries.run(client, name, **{p: params[p] for p in query.parameters})
        assert rows and len(columns) == len(rows[0]), name
    _, turns = queries.run(client, "episode", trajectory=solved.id)
    assert [r[0] for r in turns] == [1, 2] and turns[0][1] == "lookup"
    _, spans = queries.run(client, "trace", trajectory=solved.id)
    assert {r[1] for r in spans} == {"parent", "score"}
    score = next(r for r in spans if r[1] == "score")
    assert score[4] == next(r for r in spans if r[1] == "parent")[3]  # its parent, by id
    _, heldout = queries.run(client, "heldout")
    assert ("run-1", 1, "lookup", 4, 3, 0.75) in heldout
    columns, [row] = queries.run(client, "step-time", run="run-1")
    # no step names the sample among those it trained on: the version after the one it was sampled with
    assert dict(zip(columns, row)) == {
        "version": 2, "sampled_with": 1, "groups": 1, "sample_ms": 100, "to_verifier_ms": 30, "verify_ms": 10,
        "to_aggregator_ms": 60, "to_learner_ms": 95, "learner_step_ms": 200, "checkpoint_ms": 12, "publish_ms": 3}


def test_step_time_puts_a_group_under_the_step_that_trained_it(filled):
    """Asynchronous, a group sampled with version 1 may be trained by the step that makes version 3: its
    learner figures are that step's, found by the sample ids the step recorded."""
    client, _, _ = filled
    record_steps(client, "run-1", [step_entry(3, 3, "file:///z", {"step_ms": 450.0, "checkpoint_ms": 20.0,
                                                                  "publish_ms": 5.0}, {}, ["code-1/0"])])
    columns, [row] = queries.run(client, "step-time", run="run-1")
    got = dict(zip(columns, row))
    assert (got["version"], got["sampled_with"], got["groups"]) == (3, 1, 1), got
    assert (got["learner_step_ms"], got["checkpoint_ms"], got["publish_ms"]) == (450, 20, 5), got
    assert (got["sample_ms"], got["to_learner_ms"]) == (100, 95), got


def test_a_query_without_its_parameter_or_unknown_says_so(filled):
    client, _, _ = filled
    with pytest.raises(queries.QueryError, match="--task VALUE"):
        queries.run(client, "task")
    with pytest.raises(queries.QueryError, match="saved queries are"):
        queries.run(client, "nosuch")
    with pytest.raises(queries.QueryError, match="query 'alerts' takes no parameters, not --run"):
        queries.run(client, "alerts", run="run-1")  # a filter dropped in silence would show every run's rows


def test_crucible_query_prints_a_table(filled, store_url, store_database, monkeypatch, capsys, request):
    _, task, _ = filled
    monkeypatch.setenv("CRUCIBLE_CLICKHOUSE_URL", store_url)
    monkeypatch.setenv("CRUCIBLE_CLICKHOUSE_DATABASE", store_database)
    get_settings.cache_clear()  # the command reads the process's settings, cached once read
    request.addfinalizer(get_settings.cache_clear)
    assert crucible_main(["query", "task", "--task", task.id]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["group_id", "sample_index", "trajectory_id"] and set(out[1]) <= {"-", " "}
    assert len(out) == 4  # header, rule, two samples
    assert crucible_main(["query", "task"]) == 2
    assert "--task VALUE" in capsys.readouterr().out
    assert crucible_main(["query", "task", "--task", task.id, "--run", "x' OR '1'='1"]) == 2  # not a filter of it
    assert "query 'task' takes --task, not --run" in capsys.readouterr().out
    assert crucible_main(["query"]) == 0 and "reward-by-version" in capsys.readouterr().out


def test_spans_sent_as_the_exporter_sends_them_read_back_exactly(store_client):
    """The span exporter's JSON rows (json_rows) land in otel_traces with every column as the SDK had
    it: nanosecond times (of spans in different seconds too), kind, status, events, links, attributes."""
    from crucible.shared.span_store import json_rows

    migrate(store_client)
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "exporter-test"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("crucible.test", "3.1")
    second = 1_796_000_000 * 10**9
    with tracer.start_as_current_span("first", start_time=second + 999_999_999, kind=trace.SpanKind.CONSUMER,
                                      attributes={"n": 7, "many": [1, 2]}) as first:
        first.add_event("seen", {"why": 'a "quoted"\nline'}, timestamp=second + 10**9 + 5)
    with tracer.start_as_current_span("second", start_time=second + 10**9 + 1,
                                      links=[trace.Link(first.get_span_context(), {"l": "x"})]) as other:
        other.set_status(trace.Status(trace.StatusCode.ERROR, "broken"))
    spans = exporter.get_finished_spans()
    store_client.raw_insert("otel_traces", SPAN_COLUMNS, json_rows(spans), fmt="JSONCompactEachRow")
    rows = store_client.query(
        "SELECT SpanName, toUnixTimestamp64Nano(Timestamp), Duration, SpanKind, StatusCode, StatusMessage, "
        "SpanAttributes, ScopeVersion, `Events.Name`, arrayMap(t -> toUnixTimestamp64Nano(t), `Events.Timestamp`), "
        "`Events.Attributes`, `Links.SpanId`, `Links.Attributes` FROM otel_traces "
        "WHERE ServiceName = 'exporter-test' ORDER BY Timestamp").result_rows
    assert rows == [
        ("first", second + 999_999_999, spans[0].end_time - spans[0].start_time, "SPAN_KIND_CONSUMER",
         "STATUS_CODE_UNSET", "", {"n": "7", "many": "1,2"}, "3.1", ["seen"], [second + 10**9 + 5],
         [{"why": 'a "quoted"\nline'}], [], []),
        ("second", second + 10**9 + 1, spans[1].end_time - spans[1].start_time, "SPAN_KIND_INTERNAL",
         "STATUS_CODE_ERROR", "broken", {}, "3.1", [], [], [], [f"{first.get_span_context().span_id:016x}"],
         [{"l": "x"}]),
    ]


# What a task author or the model can put in stored text: a screen clear, NUL, a right-to-left override,
# a newline, a zero-width space and a line separator.
HOSTILE = "t-\x1b[2J\x1b[H\x00\u202eevil\nline\u200b\u2028"


def raw_controls(printed: str) -> list[str]:
    """Characters a terminal would act on in `printed`, its line breaks aside (split on \\n alone, since
    str.splitlines would also split on, and so hide, the separators looked for)."""
    return [c for line in printed.split("\n") for c in line if unicodedata.category(c) in {"Cc", "Cf", "Zl", "Zp"}]


def test_shown_writes_what_a_terminal_would_act_on_as_escapes():
    assert queries.shown(HOSTILE) == "t-\\x1b[2J\\x1b[H\\x00\\u202eevil\\nline\\u200b\\u2028"
    assert queries.shown("a plain cell, é and 1.5") == "a plain cell, é and 1.5"
    assert queries.shown(3) == "3"
    report = rescore.RescoreReport(rescore_id="rescore-1", run_id=HOSTILE, verifier_version="v\x1b]0;title\x07",
                                   changed_by_task=Counter({HOSTILE: 2}))
    printed = "\n".join(rescore.summary(report))
    assert not raw_controls(printed) and queries.shown(HOSTILE) in printed, printed


def test_query_and_status_print_stored_text_escaped(store_client, store_url, store_database, tmp_path):
    """A task id, completion and alert message holding controls reach the terminal escaped: in
    `crucible query`'s tables and in `crucible status`."""
    migrate(store_client)
    hostile = verdict_pb2.Verdict(
        sample=trajectory_pb2.Trajectory(id="h/0", task_id=HOSTILE, group_id="h/g", group_size=1, policy_version=1),
        task_kind="exact", reward=1.0, completion="\x1b[1A\x1b[2Kforged line")  # up a line, erase it
    [trajectory] = group_trajectories([hostile], RewardConfig("rloo", {}, 0.0, 0), complete=True)
    store_client.insert("trajectories", [trajectory_row(hostile, trajectory, "", HOSTILE)],
                        column_names=TRAJECTORY_COLUMNS)
    store_client.insert("policy_versions", [[HOSTILE, 2, "file:///y", 2, dt.datetime.now(dt.timezone.utc), {}]],
                        column_names=["run_id", "version", "checkpoint_uri", "step", "created_at", "metrics"])
    alert = alert_pb2.Alert(id="a-1", kind="canary_paid", message=f"task {HOSTILE} \x1b[31mFORGED")
    alert.created_at.FromDatetime(dt.datetime.now(dt.timezone.utc))
    record_alert(store_client, alert)
    for name, params, escaped in (("task", {"task": HOSTILE}, queries.shown(hostile.completion)),
                                  ("alerts", {}, queries.shown(alert.message))):
        columns, rows = queries.run(store_client, name, **params)
        printed = queries.table(columns, rows)
        assert rows and not raw_controls(printed) and escaped in printed, printed
    [port] = free_ports(1)  # no broker there: status says so and goes on to the store
    settings = Settings(kafka_bootstrap=f"127.0.0.1:{port}", clickhouse_url=store_url,
                        clickhouse_database=store_database, home=tmp_path)
    lines = []
    status.report(settings, echo=lines.append)
    printed = "\n".join(lines)
    assert not raw_controls(printed) and printed.count(queries.shown(HOSTILE)) == 2, printed


def test_a_setting_the_command_cannot_use_is_named_without_a_traceback_or_its_value(monkeypatch, capsys, request,
                                                                                       tmp_path):
    """A bad CRUCIBLE_* variable ended every command in a pydantic traceback, which printed the value
    (a store URL's password); a store that did not answer was said to have answered."""
    request.addfinalizer(get_settings.cache_clear)
    monkeypatch.setenv("CRUCIBLE_HOME", str(tmp_path / "home"))
    for name, value, said in [
            ("CRUCIBLE_CLICKHOUSE_URL", "http://default:hunter2@127.0.0.1:99999", "port is not a number"),
            ("CRUCIBLE_CLICKHOUSE_URL", "ftp://default:hunter2@127.0.0.1", "http(s)://host[:port]"),
            ("CRUCIBLE_METRICS_PORT", "hunter2", "valid integer")]:
        monkeypatch.setenv(name, value)
        get_settings.cache_clear()
        assert crucible_main(["query", "task", "--task", "t"]) == 2
        out = capsys.readouterr().out
        assert name in out and said in out and "hunter2" not in out, out
        monkeypatch.delenv(name)
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("CRUCIBLE_HOME", str(tmp_path / "a-file"))
    get_settings.cache_clear()
    assert crucible_main(["status"]) == 2 and "CRUCIBLE_HOME cannot be made a folder" in capsys.readouterr().out

    monkeypatch.setenv("CRUCIBLE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CRUCIBLE_CLICKHOUSE_URL", "http://127.0.0.1:1")  # nothing listens there
    get_settings.cache_clear()
    assert crucible_main(["query", "task", "--task", "t"]) == 1
    out = capsys.readouterr().out
    assert "did not answer" in out and "answered:" not in out, out
