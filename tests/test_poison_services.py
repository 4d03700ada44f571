"""Poison against the running services: a corpus of malformed records on every topic a service
consumes, and malformed calls to every RPC. Each record reaches its topic's DLQ with a reason, each
call is INVALID_ARGUMENT, no service restarts, and a valid task published after the poison still
becomes trajectories. (The same inputs, fuzzed, against each decoder and check: test_poison.py.)
"""
from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from grpc_health.v1 import health_pb2

from crucible.cli.recipe import Recipe
from crucible.cli.train import Run
from crucible.ml.policy.checkpoint import fresh_policy, save_checkpoint
from crucible.ml.task_families import digits_tasks
from crucible.ml import envs
from crucible.ml.envs import episode as ep
from crucible.shared import bus, integrity, messages, rpc
from crucible.v1 import (alert_pb2, control_pb2, episode_pb2, execution_pb2, generator_pb2, policy_pb2,
                         rollout_pb2, task_pb2, trajectory_pb2, verdict_pb2)

from tests.bus_helpers import read_all

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.store, pytest.mark.sandbox]

# Every topic a service acts on (the owner dead-letters what it cannot take).
CONSUMED = ("tasks", "rollouts", "executions", "verdicts", "trajectories", "policy", "heldout", "actions",
            "observations", "episodes")

# Well-formed messages no service may act on: unsigned, unsealed, or missing what makes them whole.
SEMANTIC = {
    "tasks": task_pb2.Task(id="poison-unsigned", prompt="2+2=", kind="exact", group_size=2),
    "heldout": task_pb2.Task(id="poison-heldout", prompt="2+2=", kind="exact", group_size=2),
    "rollouts": rollout_pb2.RolloutGroup(group_id="poison-group"),
    "executions": execution_pb2.Execution(),
    # whole and well-formed, only unsigned: a reward nobody but the verifier (and an advantage nobody but
    # the aggregator) may set
    "verdicts": verdict_pb2.VerdictGroup(verdicts=[verdict_pb2.Verdict(
        id="poison/v", reward=1.0, components={"answer_correct": 1.0}, sample=trajectory_pb2.Trajectory(
            id="poison/0", group_id="poison-g", group_size=1, prompt_token_ids=[1], completion_token_ids=[2],
            logprobs=[-0.1], temperature=1.0, top_p=1.0))]),
    "trajectories": trajectory_pb2.Trajectory(id="poison/0", group_id="poison-g", group_size=1, group_received=1,
                                              prompt_token_ids=[1], completion_token_ids=[2], logprobs=[-0.1],
                                              temperature=1.0, top_p=1.0, reward=1.0, advantage=5.0),
    "policy": policy_pb2.PolicyVersion(version=1_000_000, checkpoint_uri="file:///tmp/x", checkpoint_sha256="ab"),
    "actions": episode_pb2.Episode(id="poison-episode"),
    "observations": episode_pb2.Episode(id="poison-episode"),
    "episodes": episode_pb2.Episode(id="poison-episode"),
}


def forged_samples(secret: bytes) -> dict:
    """Whole samples of tasks a trusted submitter signed, written by someone who does not hold the key:
    tokens the policy never sampled, which would be paid for a correct answer and then learned."""
    task = integrity.sign(next(digits_tasks("train", seed=3, group_size=1)), secret)
    code = integrity.sign(task_pb2.Task(id="forged-code", kind="python_tests", prompt="def f():\n", group_size=1,
                                        python_tests=task_pb2.PythonTests(entry_point="f", test_code="def check(f):\n"
                                                                          "    assert f() == 1\n")), secret)

    def group(t):
        return rollout_pb2.RolloutGroup(group_id=f"forged-{t.id}", task=t, temperature=1.0, top_p=1.0,
                                        prompt_token_ids=[1], rollouts=[rollout_pb2.Rollout(
                                            id=f"forged-{t.id}/0", completion="    return 1\n", token_ids=[2, 3],
                                            logprobs=[-0.1, -0.1])])

    env_task = integrity.sign(next(envs.get("lookup").generate("train", seed=0, group_size=1)), secret)
    episode = ep.start(env_task, "forged-episode", 0, [1], temperature=1.0, top_p=1.0, call_format="plain")
    ep.add_turn(episode, "red", [5], [-0.1], "stop", 0)
    return {"rollouts": group(task),
            "executions": execution_pb2.Execution(id="forged/exec", group=group(code), results=[
                execution_pb2.ExecutionResult(tests=[execution_pb2.TestOutcome(name="check", passed=True)])]),
            "actions": episode, "observations": episode, "episodes": episode}


def corpus(topic: str, run_id: str, secret: bytes) -> list[tuple[bytes | None, list[tuple[str, bytes]]]]:
    schema = messages.TOPIC_SCHEMAS[topic].DESCRIPTOR.full_name.encode()
    semantic = SEMANTIC[topic]
    if topic == "policy":
        semantic.run_id = run_id
    forged = forged_samples(secret).get(topic)
    return [
        *([(messages.encode(forged), [(bus.H_SCHEMA, schema)])] if forged is not None else []),
        (b"\xff\xfe\x00 not a message", [(bus.H_SCHEMA, schema)]),
        (None, [(bus.H_SCHEMA, schema)]),                                      # a tombstone
        (b"[" * 10_000 + b"]" * 10_000, [(bus.H_CONTENT_TYPE, messages.CONTENT_TYPE_JSON.encode())]),
        (messages.encode(alert_pb2.Alert(kind="x")), [(bus.H_SCHEMA, b"crucible.v1.Alert")]),  # another topic's
        (os.urandom(3000), []),                                                # no headers at all
        (b"", [(bus.H_SCHEMA, schema)]),                                       # the empty message
        (messages.encode(semantic), [(bus.H_SCHEMA, schema)]),
    ]


async def dead_letters(settings, topic: str, counts: dict | None = None) -> dict[int, str]:
    """{offset of the original record: reason} for everything in `topic`'s DLQ (read raw); `counts`, where
    given, gets how often each offset was dead-lettered."""
    consumer = AIOKafkaConsumer(settings.topic(topic) + bus.DLQ_SUFFIX, **bus.connection(settings),
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    found = {}
    try:
        while True:
            batch = await consumer.getmany(timeout_ms=1000)
            if not batch:
                return found
            for records in batch.values():
                for r in records:
                    headers = dict(r.headers or [])
                    source = headers.get(bus.H_DLQ_SOURCE, b"").decode()
                    if source.startswith(settings.topic(topic) + "/"):
                        offset = int(source.rsplit("@", 1)[1])
                        found[offset] = headers.get(bus.H_DLQ_REASON, b"").decode()
                        if counts is not None:
                            counts[offset] = counts.get(offset, 0) + 1
    finally:
        await consumer.stop()


def rpc_methods():
    """(service full name, method, request type, streaming) for every RPC Crucible serves."""
    from crucible.v1 import control_pb2 as c, execution_pb2 as e, generator_pb2 as g, policy_pb2 as p, verdict_pb2 as v

    for module in (c, e, g, p, v):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                yield service.full_name, method.name, method.client_streaming


# A call each RPC must refuse as INVALID_ARGUMENT though its bytes parse.
MALFORMED = {
    "SubmitTasks": control_pb2.SubmitTasksRequest(tasks=[task_pb2.Task()]),
    "GetRunStatus": control_pb2.RunStatusRequest(run_id="../../etc\n" * 50),
    "QueryTrajectories": control_pb2.QueryTrajectoriesRequest(limit=10_000_000),
    "Execute": execution_pb2.ExecuteRequest(),
    "ExecuteBatch": execution_pb2.ExecuteRequest(),
    "Generate": generator_pb2.GenerateRequest(),
    "GetPolicy": policy_pb2.GetPolicyRequest(run_id="\x00" * 300),
    "Verify": verdict_pb2.VerifyRequest(),
    # each request of a batch is answered on its own (a refusal each, tested in test_verifier_service);
    # the call itself is refused for holding more than a call takes
    "VerifyBatch": verdict_pb2.VerifyBatchRequest(requests=[verdict_pb2.VerifyRequest()] * 1025),
}


@pytest.mark.timeout(600)
async def test_poison_on_every_topic_and_every_rpc_is_refused_and_nothing_restarts(stack_settings, tmp_path):
    settings = stack_settings.model_copy(update={"home": tmp_path})
    run = Run(settings, Recipe.model_validate({"algorithm": {"groups_per_step": 1},
                                               "sampling": {"group_size": 2, "max_tokens": 4}}))
    s = run.settings
    await bus.ensure_topics(list(messages.TOPIC_SCHEMAS), settings=s)
    init = save_checkpoint(fresh_policy(0), tmp_path / "init", {"version": 0})
    run.start_services(init.as_uri())
    ports = {name: run.services.env[f"CRUCIBLE_{name.upper()}_GRPC_PORT"]
             for name in ("control", "sandbox", "verifier", "generator", "learner")}
    service_port = {"crucible.v1.Control": ports["control"], "crucible.v1.Sandbox": ports["sandbox"],
                    "crucible.v1.Verifier": ports["verifier"], "crucible.v1.Generator": ports["generator"],
                    "crucible.v1.Learner": ports["learner"]}
    try:
        for service, port in service_port.items():
            await rpc.wait_serving(f"127.0.0.1:{port}", service, timeout=120)
        pids = {name: p.pid for name, p in run.processes.items()}

        producer = AIOKafkaProducer(**bus.connection(s))
        await producer.start()
        sent: dict[str, list[int]] = {}
        try:
            for topic in CONSUMED:
                for value, headers in corpus(topic, s.run_id, integrity.key(s)):
                    meta = await producer.send_and_wait(s.topic(topic), value, key=b"poison", headers=headers)
                    sent.setdefault(topic, []).append(meta.offset)
        finally:
            await producer.stop()
        # a valid task after all of it: the pipeline still turns it into trajectories
        task = next(digits_tasks("train", seed=11, group_size=2))
        async with bus.Producer(s) as good:
            await good.send_and_wait("tasks", task, key=task.id)

        # every RPC: garbage bytes, and a request that parses but is not acceptable
        for service, method, streaming in rpc_methods():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{service_port[service]}") as channel:
                path = f"/{service}/{method}"
                for request in (b"\xff\xff\xff\xff\x0f", messages.encode(MALFORMED[method])):
                    if streaming:
                        call = channel.stream_stream(path)(iter([request]))
                        with pytest.raises(grpc.aio.AioRpcError) as err:
                            async for reply in call:
                                if reply:  # ExecuteBatch answers a bad item in its stream
                                    assert b"INVALID_ARGUMENT" in reply, (path, reply[:200])
                                    raise grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, None, None)
                    else:
                        with pytest.raises(grpc.aio.AioRpcError) as err:
                            await channel.unary_unary(path)(request, timeout=30)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, request[:20], err.value)
                health = await channel.unary_unary("/grpc.health.v1.Health/Check")(
                    health_pb2.HealthCheckRequest(service=service).SerializeToString(), timeout=10)
                assert health_pb2.HealthCheckResponse.FromString(health).status == health_pb2.HealthCheckResponse.SERVING

        deadline = time.monotonic() + 240
        missing: dict = {}
        while time.monotonic() < deadline:
            run.check_services()
            missing = {}
            for topic, offsets in sent.items():
                lettered = await dead_letters(s, topic)
                gone = [o for o in offsets if o not in lettered or not lettered[o]]
                if gone:
                    missing[topic] = gone
            trajectories = [m for m in await read_all(s, "trajectories") if m.task_id == task.id]
            if not missing and len(trajectories) == 2:
                break
            await asyncio.sleep(2)
        assert missing == {}, f"not dead-lettered (topic: offsets): {missing}"
        for topic in ("verdicts", "trajectories"):  # the corpus's last record: whole, only unsigned
            assert "not signed" in (await dead_letters(s, topic))[sent[topic][-1]], topic
        for topic in ("rollouts", "executions", "actions", "observations", "episodes"):  # the first record: whole
            # samples of a signed task, only unsigned
            assert "is not signed" in (await dead_letters(s, topic))[sent[topic][0]], topic
        # crucible.rollouts has two consumers (the sandbox and the verifier): each bad record is judged once
        counts: dict = {}
        await dead_letters(s, "rollouts", counts)
        assert counts and all(n == 1 for n in counts.values()), counts
        assert len(trajectories) == 2, "the valid task did not become trajectories after the poison"
        assert run.services.restarts == {} and {n: p.pid for n, p in run.processes.items()} == pids
        assert all(p.poll() is None for p in run.processes.values())
    finally:
        run.stop_services()
