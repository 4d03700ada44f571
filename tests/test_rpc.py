"""gRPC: health, reflection, trace propagation, and INVALID_ARGUMENT for bad calls."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from crucible.v1 import control_pb2, control_pb2_grpc, policy_pb2, policy_pb2_grpc, task_pb2, trajectory_pb2, verdict_pb2
from crucible.services.control.servicer import ControlServicer
from crucible.shared import bus, rpc, store, telemetry


class _TraceEchoLearner(policy_pb2_grpc.LearnerServicer):
    """Answers GetPolicy with the trace id the server saw, so the test can check propagation."""

    async def GetPolicy(self, request, context):
        return policy_pb2.PolicyVersion(run_id=telemetry.current_trace_id())


async def test_health_serving_reflection_and_trace_propagation():
    telemetry.setup_telemetry("test-rpc")
    server = rpc.RpcServer([rpc.Service("crucible.v1.Learner", _TraceEchoLearner(),
                                        policy_pb2_grpc.add_LearnerServicer_to_server)])
    async with server:
        assert await rpc.health_status(server.address) == "SERVING"
        assert await rpc.health_status(server.address, "crucible.v1.Learner") == "SERVING"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rpc.health_status(server.address, "crucible.v1.NoSuchService")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

        async with rpc.channel(server.address) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            async for reply in replies:
                names = {s.name for s in reply.list_services_response.service}
                break
            assert {"crucible.v1.Learner", "grpc.health.v1.Health"} <= names

            with telemetry.tracer("test").start_as_current_span("client call") as span:
                reply = await policy_pb2_grpc.LearnerStub(ch).GetPolicy(policy_pb2.GetPolicyRequest(), timeout=5)
            assert reply.run_id == format(span.get_span_context().trace_id, "032x")
    # After stop the port no longer answers.
    with pytest.raises(grpc.aio.AioRpcError):
        await rpc.health_status(server.address, timeout=1)


@pytest.mark.kafka
async def test_submit_tasks_validates_and_publishes(settings):
    await bus.ensure_topics(["tasks"], settings=settings)
    async with bus.Producer(settings) as producer:
        server = rpc.RpcServer([rpc.Service("crucible.v1.Control", ControlServicer(settings, producer),
                                            control_pb2_grpc.add_ControlServicer_to_server)])
        async with server, rpc.channel(server.address) as ch:
            stub = control_pb2_grpc.ControlStub(ch)
            bad = [
                (control_pb2.SubmitTasksRequest(), "no tasks given"),
                (control_pb2.SubmitTasksRequest(tasks=[task_pb2.Task(id="a", kind="exact", group_size=1,
                                                                     answer=task_pb2.ExpectedAnswer(answer="1"))]),
                 "prompt is empty"),
                (control_pb2.SubmitTasksRequest(tasks=[task_pb2.Task(id="b", kind="haiku", prompt="p",
                                                                     group_size=1)]), "unknown kind 'haiku'"),
                (control_pb2.SubmitTasksRequest(tasks=[task_pb2.Task(id="c", kind="exact", prompt="p",
                                                                     group_size=10_000,
                                                                     answer=task_pb2.ExpectedAnswer(answer="1"))]),
                 "above the limit"),
                # checks that break on their input (a regex too large to compile) refuse the task: they
                # were UNKNOWN, and killed a consumer that met them
                (control_pb2.SubmitTasksRequest(tasks=[task_pb2.Task(id="d", kind="regex", prompt="p", group_size=1,
                                                                     answer=task_pb2.ExpectedAnswer(answer="a{4294967296}"))]),
                 "cannot be checked: OverflowError"),
                # what crucible submit refuses: a held-out task (the generator would dead-letter it), an id
                # given twice (the task log keeps one row an id); a timeout the sandbox refuses every run of
                (control_pb2.SubmitTasksRequest(tasks=[task_pb2.Task(id="h", kind="exact", prompt="p", group_size=1,
                                                                     split="heldout",
                                                                     answer=task_pb2.ExpectedAnswer(answer="1"))]),
                 "never takes a held-out task"),
                (control_pb2.SubmitTasksRequest(tasks=[task_pb2.Task(id="s", kind="exact", prompt=p, group_size=1,
                                                                     answer=task_pb2.ExpectedAnswer(answer="1"))
                                                       for p in ("p", "q")]), "task id 's' is given twice"),
                (control_pb2.SubmitTasksRequest(tasks=[task_pb2.Task(
                    id="t", kind="python_tests", prompt="def f():\n    pass\n", group_size=1,
                    python_tests=task_pb2.PythonTests(entry_point="f", timeout_s=float("nan"),
                                                      test_code="def check(c):\n    assert c() is None\n"))]),
                 "timeout_s nan"),
                # test code of 24 MB was parsed on the event loop for over two minutes, the server answering
                # nothing meanwhile: a task past CRUCIBLE_MAX_TASK_BYTES is refused before any check
                (control_pb2.SubmitTasksRequest(tasks=[task_pb2.Task(
                    id="big", kind="python_tests", prompt="def f():\n    pass\n", group_size=1,
                    python_tests=task_pb2.PythonTests(entry_point="f", test_code="x = 1\n" * 400_000))]),
                 "bytes encoded: at most"),
                # a message too long for the trailers is cut, not RESOURCE_EXHAUSTED
                (control_pb2.SubmitTasksRequest(tasks=[task_pb2.Task(id="e" * 20_000, kind="haiku", prompt="p",
                                                                     group_size=1)] * 5), "characters in all)"),
            ]
            for request, reason in bad:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.SubmitTasks(request, timeout=5)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert reason in err.value.details()
            good = task_pb2.Task(kind="exact", prompt="2+2?", group_size=2, answer=task_pb2.ExpectedAnswer(answer="4"))
            reply = await stub.SubmitTasks(control_pb2.SubmitTasksRequest(tasks=[good]), timeout=10)
            assert len(reply.task_ids) == 1 and reply.task_ids[0]
            # The server is still healthy after the bad calls.
            assert await rpc.health_status(server.address, "crucible.v1.Control") == "SERVING"

    got = []

    async def handler(incoming):
        got.append(incoming.message)

    async with bus.Consumer(["tasks"], "submit", handler, settings=settings) as consumer:
        await consumer.run(max_records=1)
    assert got[0].id == reply.task_ids[0] and got[0].prompt == "2+2?" and got[0].HasField("created_at")


def _learner_server(host: str = "127.0.0.1", security: rpc.Security | None = None, port: int = 0) -> rpc.RpcServer:
    return rpc.RpcServer([rpc.Service("crucible.v1.Learner", _TraceEchoLearner(),
                                      policy_pb2_grpc.add_LearnerServicer_to_server)], host=host, port=port,
                         security=security)


async def test_a_token_guards_every_call_but_health_checks():
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server = _learner_server(security=rpc.Security(token="s3cret-token"))
    async with server:
        assert await rpc.health_status(server.address, security=rpc.Security()) == "SERVING"  # probes: no token
        async with rpc.channel(server.address, rpc.Security()) as ch:  # a stream held open is no probe
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await watch.read()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for sent in (rpc.Security(), rpc.Security(token="wrong")):
            async with rpc.channel(server.address, sent) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await policy_pb2_grpc.LearnerStub(ch).GetPolicy(policy_pb2.GetPolicyRequest(), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "s3cret" not in err.value.details()
        async with rpc.channel(server.address, rpc.Security(token="s3cret-token")) as ch:
            await policy_pb2_grpc.LearnerStub(ch).GetPolicy(policy_pb2.GetPolicyRequest(), timeout=5)
        # the scheme in any case (RFC 6750); two authorization headers, whatever the order, are refused
        # (the first decided: a right token before a wrong one passed)
        async with rpc.channel(server.address, rpc.Security()) as ch:
            stub = policy_pb2_grpc.LearnerStub(ch)
            await stub.GetPolicy(policy_pb2.GetPolicyRequest(), timeout=5,
                                 metadata=(("authorization", "bearer s3cret-token"),))
            for pair in ((("authorization", "Bearer s3cret-token"), ("authorization", "Bearer wrong")),
                         (("authorization", "Bearer wrong"), ("authorization", "Bearer s3cret-token")),
                         (("authorization", "Bearer  s3cret-token"),), (("authorization", "s3cret-token"),)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.GetPolicy(policy_pb2.GetPolicyRequest(), timeout=5, metadata=pair)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, pair


async def test_nothing_of_an_unauthenticated_callers_request_is_parsed(monkeypatch):
    """A call without the token is refused before any of its request is parsed (a 30 MiB one cost the
    server its parse first); with the token, the same call's request is parsed and answered."""
    parsed = []
    tolerant = rpc._tolerant

    def counting(deserialize):  # every request parser the server is given, counted as it parses
        inner = tolerant(deserialize)
        return None if inner is None else (lambda data: parsed.append(len(data)) or inner(data))

    monkeypatch.setattr(rpc, "_tolerant", counting)
    server = _learner_server(security=rpc.Security(token="s3cret-token"))
    request = policy_pb2.GetPolicyRequest(run_id="r" * 1000)
    async with server:
        async with rpc.channel(server.address, rpc.Security()) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await policy_pb2_grpc.LearnerStub(ch).GetPolicy(request, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert parsed == []
        async with rpc.channel(server.address, rpc.Security(token="s3cret-token")) as ch:
            await policy_pb2_grpc.LearnerStub(ch).GetPolicy(request, timeout=5)
        assert parsed == [request.ByteSize()]


async def test_an_unauthenticated_callers_request_is_not_even_received():
    """Refused by a unary handler, each request was received whole first: 12 callers without the token
    sending 30 MB each took the server from 59 MB to 564 MB (92 MB since)."""
    import subprocess
    import sys

    code = ("import asyncio; from crucible.shared import rpc; from crucible.v1 import policy_pb2_grpc\n"
            "from crucible.services.learner.servicer import LearnerServicer\n"
            "async def main():\n"
            "    server = rpc.RpcServer([rpc.Service('crucible.v1.Learner', LearnerServicer('run'), "
            "policy_pb2_grpc.add_LearnerServicer_to_server)], security=rpc.Security(token='s3cret-token'))\n"
            "    async with server:\n"
            "        print(server.address, flush=True)\n"
            "        await asyncio.sleep(120)\n"
            "asyncio.run(main())\n")
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)

    def peak_kb() -> int:
        with open(f"/proc/{server.pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))

    try:
        address = await asyncio.to_thread(server.stdout.readline)
        before = peak_kb()
        blob = b"\x0a" + b"\xff" * (30 << 20)
        channels = [grpc.aio.insecure_channel(address.strip(), options=[("grpc.max_send_message_length", 64 << 20)])
                    for _ in range(12)]

        async def one(channel):
            call = channel.unary_unary("/crucible.v1.Learner/GetPolicy", request_serializer=lambda b: b,
                                       response_deserializer=lambda b: b)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(blob, timeout=30)
            return err.value.code()

        assert set(await asyncio.gather(*(one(c) for c in channels))) == {grpc.StatusCode.UNAUTHENTICATED}
        for channel in channels:
            await channel.close()
        assert peak_kb() - before < 150_000, f"the server grew by {(peak_kb() - before) >> 10} MB"
    finally:
        server.kill()
        server.wait()


async def test_a_port_another_server_holds_is_refused_not_shared():
    """With gRPC's default SO_REUSEPORT a second server bound the first one's port and took half of
    its calls (a run's verifier and generator were once given one port: the verifier's health check
    met the generator, NOT_FOUND, for two minutes)."""
    from crucible.shared.procs import free_ports

    ports = free_ports(16)
    assert len(set(ports)) == 16  # chosen together, never twice
    first = _learner_server()
    async with first:
        port = int(first.address.rsplit(":", 1)[1])
        with pytest.raises(OSError, match="is the port taken"):
            _learner_server(port=port)
        assert await rpc.health_status(first.address, "crucible.v1.Learner") == "SERVING"


async def test_a_server_beyond_loopback_needs_a_token():
    with pytest.raises(PermissionError, match="CRUCIBLE_RPC_TOKEN"):
        _learner_server(host="0.0.0.0", security=rpc.Security())
    _learner_server(host="0.0.0.0", security=rpc.Security(token="t"))  # binds (never started)


async def test_tls_with_a_token(tmp_path):
    import subprocess

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    tls = rpc.Security(token="t0k", tls_cert=cert.read_bytes(), tls_key=key.read_bytes(), tls_ca=cert.read_bytes())
    server = _learner_server(security=tls)
    async with server:
        async with rpc.channel(server.address, tls) as ch:
            await policy_pb2_grpc.LearnerStub(ch).GetPolicy(policy_pb2.GetPolicyRequest(), timeout=5)
        async with rpc.channel(server.address, rpc.Security(token="t0k")) as plain:  # no TLS: no connection
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await policy_pb2_grpc.LearnerStub(plain).GetPolicy(policy_pb2.GetPolicyRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_garbage_request_bytes_are_invalid_argument_and_the_server_keeps_serving():
    server = _learner_server(security=rpc.Security())
    async with server, rpc.channel(server.address, rpc.Security()) as ch:
        for garbage in (b"\xff\xff\xff\xff", b"\x0a" + b"\xff" * 9, b"\x12\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01"):
            call = ch.unary_unary("/crucible.v1.Learner/GetPolicy", request_serializer=lambda b: b,
                                  response_deserializer=policy_pb2.PolicyVersion.FromString)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(garbage, timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (garbage, err.value.code())
            assert "not a valid message" in err.value.details()
        assert await policy_pb2_grpc.LearnerStub(ch).GetPolicy(policy_pb2.GetPolicyRequest(), timeout=5) is not None


class _FailingLearner(policy_pb2_grpc.LearnerServicer):
    async def GetPolicy(self, request, context):
        raise ConnectionError("store at http://default:hunter2@10.1.2.3:8123 refused")


async def test_a_call_that_fails_inside_is_internal_with_an_incident_id_and_nothing_of_the_error(caplog):
    """gRPC answered UNKNOWN with the exception's text: a store's address, credentials, paths."""
    server = rpc.RpcServer([rpc.Service("crucible.v1.Learner", _FailingLearner(),
                                        policy_pb2_grpc.add_LearnerServicer_to_server)])
    async with server, rpc.channel(server.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await policy_pb2_grpc.LearnerStub(ch).GetPolicy(policy_pb2.GetPolicyRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "incident" in err.value.details()
        assert "hunter2" not in err.value.details() and "10.1.2.3" not in err.value.details()
        incident = err.value.details().split("incident ")[1].split(",")[0]
        assert any(incident in r.getMessage() and r.exc_info for r in caplog.records)  # the whole error is logged
        assert await rpc.health_status(server.address) == "SERVING"


class _HeldLearner(policy_pb2_grpc.LearnerServicer):
    def __init__(self):
        self.release = asyncio.Event()
        self.calls = rpc.Admission(2, "GetPolicy calls")

    async def GetPolicy(self, request, context):
        async with self.calls.admit(context):
            await self.release.wait()
            return policy_pb2.PolicyVersion(version=7)


async def test_calls_past_a_servicers_admission_are_resource_exhausted_at_once_not_queued():
    """Generate and Verify calls queued without bound (1,500 Verify calls of 256 KB: 950 MB), and a
    generator sampled for callers long gone ahead of its run's own work."""
    held = _HeldLearner()
    server = rpc.RpcServer([rpc.Service("crucible.v1.Learner", held, policy_pb2_grpc.add_LearnerServicer_to_server)])
    async with server, rpc.channel(server.address) as ch:
        stub = policy_pb2_grpc.LearnerStub(ch)
        first = [asyncio.ensure_future(stub.GetPolicy(policy_pb2.GetPolicyRequest(), timeout=10)) for _ in range(2)]
        while held.calls.taken < 2:
            await asyncio.sleep(0.01)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetPolicy(policy_pb2.GetPolicyRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 2" in err.value.details()
        held.release.set()
        assert [r.version for r in await asyncio.gather(*first)] == [7, 7]
        assert (await stub.GetPolicy(policy_pb2.GetPolicyRequest(), timeout=5)).version == 7
        assert held.calls.taken == 0


@pytest.mark.store
async def test_run_status_is_of_the_run_asked_for(settings, store_client):
    from crucible.services.control.handler import TASK_COLUMNS, task_row
    from crucible.services.reward_aggregator.handler import TRAJECTORY_COLUMNS, trajectory_row
    from crucible.shared.store import migrate

    migrate(store_client)
    for run_id, n in (("run-a", 3), ("run-b", 1)):
        rows = [task_row(task_pb2.Task(id=f"{run_id}-{i}", kind="exact", prompt="p", group_size=1), "", run_id)
                for i in range(n)]
        store_client.insert(store.TASKS_TABLE, rows, column_names=TASK_COLUMNS)
    async with bus.Producer(settings) as producer:
        own = settings.model_copy(update={"run_id": "run-b"})
        server = rpc.RpcServer([rpc.Service("crucible.v1.Control", ControlServicer(own, producer, store_client),
                                            control_pb2_grpc.add_ControlServicer_to_server)])
        async with server, rpc.channel(server.address) as ch:
            stub = control_pb2_grpc.ControlStub(ch)
            a = await stub.GetRunStatus(control_pb2.RunStatusRequest(run_id="run-a"), timeout=10)
            assert (a.run_id, a.tasks_submitted) == ("run-a", 3)
            mine = await stub.GetRunStatus(control_pb2.RunStatusRequest(), timeout=10)
            assert (mine.run_id, mine.tasks_submitted) == ("run-b", 1)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetRunStatus(control_pb2.RunStatusRequest(run_id="no-such-run"), timeout=10)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND and "no-such-run" in err.value.details()
            # trajectories too are the run's asked for (the run id was once ignored: every run's rows came back)
            for run_id in ("run-a", "run-b"):
                t = trajectory_pb2.Trajectory(id=f"{run_id}/0", task_id=f"{run_id}-0", group_id=f"{run_id}/g",
                                              group_size=1, policy_version=1)
                store_client.insert("trajectories", [trajectory_row(verdict_pb2.Verdict(sample=t, task_kind="exact"),
                                                                    t, "", run_id)], column_names=TRAJECTORY_COLUMNS)
            for asked, want in (("run-a", ["run-a/0"]), ("", ["run-b/0"]), ("no-such-run", [])):
                reply = await stub.QueryTrajectories(control_pb2.QueryTrajectoriesRequest(run_id=asked), timeout=10)
                assert [r.trajectory_id for r in reply.rows] == want, asked
            # Paged: every row once, in order (min_policy_version could not get past a version's first page)
            samples = [trajectory_pb2.Trajectory(id=f"c/{v}/{i}", task_id="c", group_id=f"c/g{v}", group_size=3,
                                                 sample_index=i, policy_version=v) for v in (1, 2) for i in range(3)]
            store_client.insert("trajectories", [trajectory_row(verdict_pb2.Verdict(sample=t, task_kind="exact"), t, "",
                                                                "run-c") for t in samples], column_names=TRAJECTORY_COLUMNS)
            seen, token = [], ""
            for _ in range(10):
                reply = await stub.QueryTrajectories(control_pb2.QueryTrajectoriesRequest(
                    run_id="run-c", limit=2, page_token=token), timeout=10)
                seen += [r.trajectory_id for r in reply.rows]
                token = reply.next_page_token
                if not token:
                    break
            assert seen == [t.id for t in samples]
            for bad in ("not a token", "WzEsMl0=", "WzEsICJnIiwgLTFd"):  # garbage, [1,2], [1, "g", -1]
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.QueryTrajectories(control_pb2.QueryTrajectoriesRequest(run_id="run-c", page_token=bad),
                                                 timeout=10)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "page_token" in err.value.details()


async def _status_becomes(address: str, want: str, service: str = "", within_s: float = 10.0) -> str:
    import asyncio
    import time

    deadline, status = time.monotonic() + within_s, ""
    while time.monotonic() < deadline:
        status = await rpc.health_status(address, service)
        if status == want:
            return status
        await asyncio.sleep(0.1)
    return status


async def test_health_is_not_serving_while_a_dependency_does_not_answer_and_serving_again_after():
    import socket

    def listen(port: int = 0) -> socket.socket:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()
        return sock

    broker, store = listen(), listen()
    broker_port, store_port = broker.getsockname()[1], store.getsockname()[1]
    server = rpc.RpcServer([rpc.Service("crucible.v1.Learner", _TraceEchoLearner(),
                                        policy_pb2_grpc.add_LearnerServicer_to_server)],
                           depends_on=[("kafka", f"127.0.0.1:{broker_port}"), ("store", f"http://127.0.0.1:{store_port}")])
    async with server:
        assert await rpc.health_status(server.address) == "SERVING"
        store.close()  # the store goes away
        assert await _status_becomes(server.address, "NOT_SERVING") == "NOT_SERVING"
        assert await rpc.health_status(server.address, "crucible.v1.Learner") == "NOT_SERVING"
        assert server.unreachable == {"store": f"http://127.0.0.1:{store_port}"}
        store = listen(store_port)  # and comes back on its port
        assert await _status_becomes(server.address, "SERVING") == "SERVING"
        broker.close()
        assert await _status_becomes(server.address, "NOT_SERVING", "crucible.v1.Learner") == "NOT_SERVING"
        broker = listen(broker_port)
        assert await _status_becomes(server.address, "SERVING", "crucible.v1.Learner") == "SERVING"
    broker.close()
    store.close()
