"""The sandbox service's two doors onto one pool: gRPC Sandbox and crucible.rollouts over real Kafka."""
from __future__ import annotations

import asyncio

import grpc
from pydantic import SecretStr
from opentelemetry import trace
import pytest
import pytest_asyncio

from crucible.v1 import execution_pb2, execution_pb2_grpc, rollout_pb2, task_pb2
from crucible.services.sandbox_executor.__main__ import group_handler
from crucible.services.sandbox_executor import pool as pool_module
from crucible.services.sandbox_executor.pool import Job, SandboxPool
from crucible.services.sandbox_executor.servicer import SandboxServicer
from crucible.shared import bus, integrity, rpc
from crucible.shared.settings import Settings
from tests.bus_helpers import publish_unsigned
from tests.test_bus import read_raw

pytestmark = pytest.mark.sandbox
DEPLOYMENT_KEY = bytes(range(32))
KEY = integrity.run_key(DEPLOYMENT_KEY, "local")  # the key of these tests' run: results are sealed with it


def keyed(settings: Settings) -> Settings:
    """The settings of a process holding KEY (a generator: its producer signs the groups it sends)."""
    return settings.model_copy(update={"integrity_key": SecretStr(DEPLOYMENT_KEY.hex())})


async def consume_rollouts(settings: Settings, pool: SandboxPool, group: str, records: int,
                           **options) -> bus.Consumer:
    """Runs the sandbox's rollouts consumer (its group handler, KEY held) over `records` records."""
    consumer_ref = []
    async with bus.Consumer(["rollouts"], group, group_handler(pool, consumer_ref, "test", KEY), settings=settings,
                            **options) as consumer:
        consumer_ref.append(consumer)
        await asyncio.wait_for(consumer.run(max_records=records), 60)
    return consumer


@pytest_asyncio.fixture(scope="module")
async def pool():
    async with SandboxPool(Settings(sandbox_workers=2, sandbox_queue_size=2, sandbox_wall_s=5.0)) as p:
        yield p


@pytest_asyncio.fixture
async def sandbox(pool):
    server = rpc.RpcServer([rpc.Service("crucible.v1.Sandbox", SandboxServicer(pool, KEY),
                                        execution_pb2_grpc.add_SandboxServicer_to_server)])
    async with server, rpc.channel(server.address) as channel:
        yield server, execution_pb2_grpc.SandboxStub(channel)


async def test_execute_and_health(sandbox):
    server, stub = sandbox
    assert await rpc.health_status(server.address, "crucible.v1.Sandbox") == "SERVING"
    reply = await stub.Execute(execution_pb2.ExecuteRequest(
        request_id="r1", code="def sq(x):\n    return x * x\n", test_code="def check(f):\n    assert f(3) == 9\n",
        entry_point="sq"), timeout=10)
    assert reply.request_id == "r1"
    assert reply.result.exit_code == 0 and [t.passed for t in reply.result.tests] == [True]
    assert reply.result.isolation == execution_pb2.ISOLATION_LEVEL_FULL
    reply = await stub.Execute(execution_pb2.ExecuteRequest(code="import time\ntime.sleep(60)", timeout_s=0.5),
                               timeout=10)
    assert reply.result.violation == execution_pb2.VIOLATION_TIMEOUT


@pytest.mark.parametrize("request_kwargs,reason", [
    ({"code": "   "}, "code is empty"),
    ({"code": "print(1)", "language": "cobol"}, "language 'cobol'"),
    ({"code": "print(1)", "timeout_s": 1e6}, "timeout_s"),
    ({"code": "print(1)", "memory_bytes": 1 << 40}, "memory_bytes"),
])
async def test_bad_requests_get_invalid_argument(sandbox, request_kwargs, reason):
    _, stub = sandbox
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Execute(execution_pb2.ExecuteRequest(**request_kwargs), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in err.value.details()
    ok = await stub.Execute(execution_pb2.ExecuteRequest(code="print(1)"), timeout=10)
    assert ok.result.stdout == b"1\n"


async def test_full_pool_answers_resource_exhausted(sandbox):
    _, stub = sandbox
    calls = [stub.Execute(execution_pb2.ExecuteRequest(code="import time\ntime.sleep(0.5)"), timeout=20)
             for _ in range(8)]  # 2 workers + a queue of 2
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    exhausted = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert exhausted and all(o.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for o in exhausted)
    assert sum(isinstance(o, execution_pb2.ExecuteResponse) for o in outcomes) >= 2


async def test_execute_batch_streams_every_result(sandbox):
    _, stub = sandbox

    async def requests():
        for i in range(12):
            yield execution_pb2.ExecuteRequest(request_id=f"b{i}", code=f"print({i} * 2)")
        yield execution_pb2.ExecuteRequest(request_id="bad", code="")

    replies = [r async for r in stub.ExecuteBatch(requests(), timeout=60)]
    by_id = {r.request_id: r for r in replies}
    assert set(by_id) == {f"b{i}" for i in range(12)} | {"bad"}
    for i in range(12):
        assert by_id[f"b{i}"].result.stdout == f"{i * 2}\n".encode()
    assert by_id["bad"].error.startswith("INVALID_ARGUMENT")


async def test_execute_batch_stays_bounded_for_a_client_that_never_reads(pool):
    counted = SandboxServicer(pool, KEY)
    ran = 0
    real_execute = pool.execute

    async def counting(job):
        nonlocal ran
        ran += 1
        return await real_execute(job)

    counted.pool = type("Counted", (), {"execute": staticmethod(counting), "size": pool.size})()
    server = rpc.RpcServer([rpc.Service("crucible.v1.Sandbox", counted, execution_pb2_grpc.add_SandboxServicer_to_server)])
    big = "import sys\nsys.stdout.write('x' * (1 << 20))"  # a reply of the output cap (64 KiB) each

    async def requests():
        for i in range(200):
            yield execution_pb2.ExecuteRequest(request_id=f"big{i}", code=big)

    async with server, rpc.channel(server.address) as channel:
        call = execution_pb2_grpc.SandboxStub(channel).ExecuteBatch(requests(), timeout=60)
        first = await call.read()  # then read nothing for a while
        assert len(first.result.stdout) == pool.limits.output_bytes
        await asyncio.sleep(4)
        held = ran
        await asyncio.sleep(2)
        # jobs stop being taken once replies pile up unread (gRPC's flow-control window, then the
        # servicer's own bound): far fewer than the 200 asked for, which 2 workers finish in 4 s
        assert held < 100 and ran == held, (held, ran)
        call.cancel()
    assert (await pool.execute(Job(code="print(1)"))).stdout == b"1\n"


async def test_two_pools_on_one_host_never_share_a_job_uid(pool):
    async with SandboxPool(Settings(sandbox_workers=2)) as other:
        slots = len(pool_module.SLOTS)  # a uid per cgroup slot of each worker
        assert len(set(pool.uids)) == pool.size * slots and len(set(other.uids)) == other.size * slots
        assert not set(pool.uids) & set(other.uids)
        r = await other.execute(Job(code="import os\nprint(os.getuid())"))
        assert int(r.stdout) in other.uids


@pytest.mark.kafka
async def test_rollouts_become_executions_over_kafka(settings, pool):
    await bus.ensure_topics(["rollouts", "executions"], settings=settings)
    task = task_pb2.Task(id="add", kind="python_tests", prompt="def add(a, b):\n", group_size=2,
                         python_tests=task_pb2.PythonTests(entry_point="add",
                                                           test_code="def check(f):\n    assert f(2, 3) == 5\n"))
    answer_task = task_pb2.Task(id="q", kind="exact", prompt="2+2?", group_size=1,
                                answer=task_pb2.ExpectedAnswer(answer="4"))
    cobol = task_pb2.Task(id="c", kind="python_tests", prompt="x", group_size=1,
                          python_tests=task_pb2.PythonTests(entry_point="f", language="cobol", test_code="t"))
    def group(group_id, t, *completions):
        return rollout_pb2.RolloutGroup(group_id=group_id, task=t, rollouts=[
            rollout_pb2.Rollout(id=f"{group_id}/{i}", sample_index=i, completion=c) for i, c in enumerate(completions)])

    prose = task_pb2.Task(id="prose", kind="python_tests", prompt="Write add(a, b).", group_size=2,
                          python_tests=task.python_tests)
    unsigned = task_pb2.Task()
    unsigned.CopyFrom(task)
    for t in (task, answer_task, cobol, prose):
        integrity.sign(t, KEY)  # as a trusted submitter did
    groups = [
        group("g", task, "    return a + b\n", "    return a - b\n"),
        # the second completion holds no program: recorded as not run (a failure to score), not dead-lettered
        group("p", prose, "```python\ndef add(a, b):\n    return a + b\n```", "   "),
        group("h", answer_task, "4"),
        group("c", cobol, "x"),
        # a task nobody trusted signed: nothing of it is run (the verifier would refuse it after the fact)
        group("u", unsigned, "    import time\n    time.sleep(30)\n"),
    ]
    async with bus.Producer(keyed(settings)) as producer:
        for g in groups:
            await producer.send_and_wait("rollouts", g, key=g.group_id)
    # a group no generator sent (written raw, unsigned), of a signed task: nothing of it is run either
    await publish_unsigned(settings, "rollouts", group("w", task, "    import time\n    time.sleep(30)\n"), b"w")
    await consume_rollouts(settings, pool, "sandbox", 6, concurrency=4)
    records = await read_raw(settings, "executions", 2)
    assert sorted(r.key for r in records) == [b"g", b"p"]  # the answer-only group needs no execution
    e = {x.group.group_id: x for x in (execution_pb2.Execution.FromString(r.value) for r in records)}
    assert e["g"].group.task.id == "add"  # the task travels once, with its group
    first, second = e["g"].results
    assert first.exit_code == 0 and first.tests[0].passed
    assert not second.tests[0].passed
    fenced, empty = e["p"].results
    assert fenced.tests[0].passed
    assert empty.not_run and not empty.tests
    reasons = sorted(dict(r.headers)["dlq-reason"].decode() for r in await read_raw(settings, "rollouts.dlq", 3))
    assert "language 'cobol'" in reasons[0] and "'u'" in reasons[1] and "not signed" in reasons[1], reasons
    assert "rollout group 'w' is not signed" in reasons[2], reasons


async def test_streaming_execute_batch_continues_the_callers_trace(sandbox):
    """Streaming RPCs are traced like unary ones: the server span is the client span's child."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from crucible.shared import telemetry

    telemetry.setup_telemetry("test-sandbox")
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _, stub = sandbox

    async def requests():
        for i in range(3):
            yield execution_pb2.ExecuteRequest(request_id=f"s{i}", code=f"print({i})")

    with telemetry.tracer("test").start_as_current_span("client batch") as client:
        replies = [r async for r in stub.ExecuteBatch(requests(), timeout=60)]
    assert len(replies) == 3
    server = [s for s in exporter.get_finished_spans() if s.name == "crucible.v1.Sandbox/ExecuteBatch"]
    assert len(server) == 1
    assert server[0].context.trace_id == client.get_span_context().trace_id
    assert server[0].parent.span_id == client.get_span_context().span_id
    assert server[0].kind == trace.SpanKind.SERVER


async def test_a_garbage_request_in_an_execute_batch_stream_is_invalid_argument(sandbox):
    server, _ = sandbox
    async with rpc.channel(server.address) as channel:
        call = channel.stream_stream("/crucible.v1.Sandbox/ExecuteBatch", request_serializer=lambda b: b,
                                     response_deserializer=execution_pb2.ExecuteResponse.FromString)

        async def requests():
            yield execution_pb2.ExecuteRequest(request_id="fine", code="print(1)").SerializeToString()
            yield b"\xff\xff\xff\xff"

        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in call(requests(), timeout=30):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.kafka
async def test_a_completion_the_sandbox_refuses_is_scored_not_run_and_its_group_goes_on(settings, pool):
    add = task_pb2.Task(id="add-nul", kind="python_tests", prompt="def add(a, b):\n", group_size=2,
                        python_tests=task_pb2.PythonTests(entry_point="add", test_code="def check(f):\n    assert f(1, 2) == 3\n"))
    integrity.sign(add, KEY)
    group = rollout_pb2.RolloutGroup(group_id="nul", task=add, rollouts=[
        rollout_pb2.Rollout(id="nul/0", completion="    return a + b\x00\n"),
        rollout_pb2.Rollout(id="nul/1", completion="    return a + b\n", sample_index=1)])
    await bus.ensure_topics(["rollouts", "executions"], settings=settings)
    async with bus.Producer(keyed(settings)) as producer:
        await producer.send_and_wait("rollouts", group, key="nul")
    await consume_rollouts(settings, pool, "sandbox-nul", 1)
    [record] = await read_raw(settings, "executions", 1)
    execution = execution_pb2.Execution.FromString(record.value)
    refused, ran = execution.results
    assert "NUL byte" in refused.not_run and ran.tests[0].passed


@pytest.mark.kafka
async def test_a_group_published_again_is_not_run_again(settings, pool):
    """Anyone who can write to crucible.rollouts can copy a genuine record there again, as often as a
    program that passes now and then takes to pass: each run a new throw of the dice. The sandbox runs
    a group once; its copies are not run (and never reach the verifier), the groups after them are."""
    await bus.ensure_topics(["rollouts", "executions"], settings=settings)
    task = task_pb2.Task(id="coin", kind="python_tests", prompt="def coin():\n", group_size=1,
                         python_tests=task_pb2.PythonTests(entry_point="coin",
                                                           test_code="def check(f):\n    assert f() == 1\n"))
    integrity.sign(task, KEY)
    coin = "    import random\n    return random.randint(0, 1)\n"
    first = rollout_pb2.RolloutGroup(group_id="coin", task=task, rollouts=[
        rollout_pb2.Rollout(id="coin/0", completion=coin)])
    after = rollout_pb2.RolloutGroup(group_id="after", task=task, rollouts=[
        rollout_pb2.Rollout(id="after/0", completion=coin)])
    async with bus.Producer(keyed(settings)) as producer:
        await producer.send_and_wait("rollouts", first, key="coin")  # signed for the generator, in place
    for _ in range(3):  # the very record, copied back with a plain client
        await publish_unsigned(settings, "rollouts", first, b"coin")
    async with bus.Producer(keyed(settings)) as producer:
        await producer.send_and_wait("rollouts", after, key="after")
    consumer = await consume_rollouts(settings, pool, "sandbox-replays", 5)
    assert consumer.handled == 5 and consumer.dead_lettered == 0  # copies are not errors: nothing dead-lettered
    await asyncio.sleep(1.0)  # a copy's execution, had it run, would be in by now
    records = await read_raw(settings, "executions", 2)
    assert sorted(r.key for r in records) == [b"after", b"coin"]
    with pytest.raises(asyncio.TimeoutError):
        await read_raw(settings, "executions", 3, timeout=3)


def test_run_once_keeps_the_newest_groups_and_lets_a_failed_run_go():
    from crucible.services.sandbox_executor.__main__ import RunOnce

    runs = RunOnce(kept=2)
    at = {name: ("rollouts", 0, offset) for offset, name in enumerate("abc")}
    assert runs.take("a", at["a"]) and not runs.take("a", ("rollouts", 0, 9)) and runs.copies == 1
    assert runs.take("a", at["a"])  # the same record again (a rebalance before its commit): run again
    runs.let_go("a")  # its run failed: the retry runs it
    assert runs.take("a", ("rollouts", 1, 5)) and runs.take("b", at["b"]) and runs.take("c", at["c"])
    assert runs.take("a", at["a"])  # the oldest of three was forgotten (at most `kept` ids are held)
    assert not runs.take("c", at["b"]) and runs.take("b", at["c"])  # c is held still; b was forgotten
    assert runs.copies == 2


async def test_a_group_whose_handling_failed_is_run_again_by_the_retry(pool, monkeypatch):
    """Whatever fails after a group was taken (its runs, or making its execution message), the group is
    let go: the consumer's retry of the handler runs it, rather than taking it for a copy and dropping it."""
    from crucible.services.sandbox_executor import __main__ as sandbox_main

    task = task_pb2.Task(id="once", kind="python_tests", prompt="def one():\n", group_size=1,
                         python_tests=task_pb2.PythonTests(entry_point="one", test_code="def check(f):\n    assert f() == 1\n"))
    integrity.sign(task, KEY)
    group = rollout_pb2.RolloutGroup(group_id="once", task=task, rollouts=[
        rollout_pb2.Rollout(id="once/0", completion="    return 1\n")])
    integrity.sign(group, KEY)
    incoming = bus.Incoming("rollouts", 0, 7, b"once", group)
    handler = sandbox_main.group_handler(pool, [], "test", KEY)
    made = sandbox_main.execution_message

    def broken(*args):
        raise RuntimeError("broker gone while the message was made")

    monkeypatch.setattr(sandbox_main, "execution_message", broken)
    with pytest.raises(RuntimeError):
        await handler(incoming)
    monkeypatch.setattr(sandbox_main, "execution_message", made)
    [output] = await handler(incoming)  # the retry: run, not dropped as a copy
    assert output.message.results[0].tests[0].passed
    assert await handler(bus.Incoming("rollouts", 0, 8, b"once", group)) == []  # a copy, later: not run
