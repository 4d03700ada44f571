"""The verifier service: Kafka executions/rollouts -> verdicts (DLQ for the unverifiable), gRPC Verify, scoring limits."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio

from crucible.v1 import execution_pb2, execution_pb2_grpc, rollout_pb2, task_pb2, verdict_pb2, verdict_pb2_grpc
from crucible.services.sandbox_executor.pool import SandboxPool
from crucible.services.sandbox_executor.servicer import SandboxServicer
from crucible.services.verifier import handler
from crucible.services.verifier.consumer import TOPICS, verdict_handler
from crucible.services.verifier.scorer_pool import ScorerPool
from crucible.services.verifier.servicer import VerifierServicer
from crucible.shared import bus, rpc
from crucible.ml.kinds import builtin_sets
from crucible.shared.settings import Settings
from tests.conftest import free_port
from tests.test_bus import read_raw

ADD = task_pb2.Task(id="add", kind="python_tests", prompt="def add(a, b):\n    '''a + b'''\n", group_size=2,
                    python_tests=task_pb2.PythonTests(entry_point="add",
                                                      test_code="def check(f):\n    assert f(2, 3) == 5\n"))
CAPITAL = task_pb2.Task(id="capital", kind="exact", prompt="Capital of France?", group_size=1,
                        answer=task_pb2.ExpectedAnswer(answer="Paris"))
HALF = task_pb2.Task(id="half", kind="math_answer", prompt="1 divided by 2?", group_size=1,
                     answer=task_pb2.ExpectedAnswer(answer="\\frac{1}{2}"))


def rollout(rid: str, task: task_pb2.Task, completion: str, group: str = "g") -> rollout_pb2.Rollout:
    return rollout_pb2.Rollout(id=rid, task=task, group_id=group, completion=completion, token_ids=[1, 2, 3])


def outcome(*passed: bool, **fields) -> execution_pb2.ExecutionResult:
    return execution_pb2.ExecutionResult(
        tests=[execution_pb2.TestOutcome(name="check", passed=p) for p in passed],
        isolation=execution_pb2.ISOLATION_LEVEL_FULL, **fields)


@pytest_asyncio.fixture(scope="module")
async def scorer():
    async with ScorerPool(Settings(verifier_workers=2)) as pool:
        yield pool


# --- pure routing --------------------------------------------------------------------------------

def test_routing_is_by_kind():
    assert handler.request_for(rollout("r", ADD, "    return a + b\n")) is None  # the sandbox runs it first
    assert handler.request_for(rollout("r", CAPITAL, "Paris")).rollout.id == "r"
    execution = execution_pb2.Execution(rollout=rollout("r", ADD, "x"), result=outcome(True))
    assert handler.request_for(execution).execution.tests[0].passed
    with pytest.raises(handler.Unverifiable, match="unknown kind 'poetry'"):
        handler.request_for(rollout("r", task_pb2.Task(id="p", kind="poetry", prompt="p"), "x"))


def test_verdict_carries_components_and_length():
    verdict = handler.verify(verdict_pb2.VerifyRequest(rollout=rollout("r", CAPITAL, "Answer: Paris")))
    assert verdict.reward == 1.0 and verdict.components["answer_correct"] == 1.0
    assert verdict.components["length"] == 3.0 and verdict.components["truncated"] == 0.0
    assert verdict.verifier_version == handler.VERIFIER_VERSION and verdict.id == "r/verdict"
    assert not verdict.HasField("execution")


# --- Kafka ---------------------------------------------------------------------------------------

@pytest.mark.kafka
async def test_executions_and_answer_rollouts_become_verdicts(settings, scorer):
    await bus.ensure_topics([*TOPICS, "verdicts"], settings=settings)
    rg_task = builtin_sets.reasoning_gym("gcd", 1, seed=4)[0]
    rg_answer = __import__("json").loads(rg_task.generator.entry_json)["answer"]
    executions = [
        execution_pb2.Execution(id="e0", rollout=rollout("x0", ADD, "    return a + b\n"), result=outcome(True)),
        execution_pb2.Execution(id="e1", rollout=rollout("x1", ADD, "    return a - b\n"), result=outcome(False)),
        execution_pb2.Execution(id="e2", rollout=rollout("x2", ADD, "    print('All tests passed')\n    return a + b\n"),
                                result=outcome(True, stdout=b"All tests passed\n")),
    ]
    rollouts = [
        rollout("a0", CAPITAL, "Answer: Paris", group="h"),
        rollout("a1", HALF, "so \\boxed{0.5}", group="h"),
        rollout("a2", rg_task, f"<answer>{rg_answer}</answer>", group="k"),
        rollout("a3", ADD, "    return a + b\n"),  # python_tests: the sandbox's, not ours
        rollout("bad0", task_pb2.Task(id="p", kind="poetry", prompt="write"), "roses"),
        rollout("bad1", task_pb2.Task(id="r", kind="regex", prompt="?", answer=task_pb2.ExpectedAnswer(answer="(")), "x"),
    ]
    async with bus.Producer(settings) as producer:
        for e in executions:
            await producer.send_and_wait("executions", e, key=e.rollout.group_id)
        for r in rollouts:
            await producer.send_and_wait("rollouts", r, key=r.group_id)
    async with bus.Consumer(TOPICS, "verifier", verdict_handler(scorer), settings=settings, concurrency=4) as consumer:
        await asyncio.wait_for(consumer.run(max_records=len(executions) + len(rollouts)), 60)
    verdicts = {}
    for record in await read_raw(settings, "verdicts", 6):
        v = verdict_pb2.Verdict.FromString(record.value)
        verdicts[v.rollout.id] = v
        assert record.key == v.rollout.group_id.encode()
    assert set(verdicts) == {"x0", "x1", "x2", "a0", "a1", "a2"}
    assert verdicts["x0"].reward == 1.0 and verdicts["x0"].execution.tests[0].passed
    assert verdicts["x1"].reward == 0.0 and verdicts["x1"].components["tests_total"] == 1.0
    assert verdicts["x2"].tampered and list(verdicts["x2"].tamper_patterns) == ["fake_result_output"]
    assert verdicts["x2"].reward == 0.0
    assert [verdicts[r].reward for r in ("a0", "a1", "a2")] == [1.0, 1.0, 1.0]
    dead = {dict(r.headers)["dlq-reason"].decode() for r in await read_raw(settings, "rollouts.dlq", 2)}
    assert any("unknown kind 'poetry': known kinds are" in d for d in dead), dead
    assert any("not a valid regular expression" in d for d in dead), dead


# --- gRPC ----------------------------------------------------------------------------------------

@pytest_asyncio.fixture(scope="module")
async def sandbox_address():
    async with SandboxPool(Settings(sandbox_workers=2, sandbox_wall_s=5.0)) as pool:
        server = rpc.RpcServer([rpc.Service("crucible.v1.Sandbox", SandboxServicer(pool),
                                            execution_pb2_grpc.add_SandboxServicer_to_server)])
        async with server:
            yield server.address


@pytest_asyncio.fixture
async def verifier(scorer, sandbox_address):
    servicer = VerifierServicer(scorer, sandbox_address)
    server = rpc.RpcServer([rpc.Service("crucible.v1.Verifier", servicer,
                                        verdict_pb2_grpc.add_VerifierServicer_to_server)])
    async with server, rpc.channel(server.address) as channel:
        yield verdict_pb2_grpc.VerifierStub(channel)
    await servicer.close()


@pytest.mark.sandbox
async def test_verify_runs_python_tests_in_the_sandbox(verifier):
    good = await verifier.Verify(verdict_pb2.VerifyRequest(rollout=rollout("v0", ADD, "    return a + b\n")), timeout=30)
    assert good.reward == 1.0 and good.execution.tests[0].passed
    assert good.execution.isolation == execution_pb2.ISOLATION_LEVEL_FULL
    forged = await verifier.Verify(verdict_pb2.VerifyRequest(rollout=rollout(
        "v1", ADD, "    class A:\n        __eq__ = lambda s, o: True\n    return A()\n")), timeout=30)
    assert forged.reward == 0.0 and forged.tampered and "non_plain_return" in forged.tamper_patterns
    given = await verifier.Verify(verdict_pb2.VerifyRequest(rollout=rollout("v2", ADD, "    return a + b\n"),
                                                            execution=outcome(False)), timeout=30)
    assert given.reward == 0.0  # an execution that comes along is scored as it is


@pytest.mark.sandbox
async def test_verify_scores_answers_directly(verifier):
    v = await verifier.Verify(verdict_pb2.VerifyRequest(rollout=rollout("v3", HALF, "\\boxed{\\frac{2}{4}}")), timeout=30)
    assert v.reward == 1.0 and v.components["format_ok"] == 1.0


@pytest.mark.sandbox
@pytest.mark.parametrize("request_,reason", [
    (verdict_pb2.VerifyRequest(), "carries no task"),
    (verdict_pb2.VerifyRequest(rollout=rollout("u", task_pb2.Task(id="p", kind="poetry"), "x")), "unknown kind 'poetry'"),
    (verdict_pb2.VerifyRequest(rollout=rollout("w", task_pb2.Task(id="e", kind="exact", prompt="?"), "x")),
     "needs a 'answer' payload"),
])
async def test_bad_verify_requests_get_invalid_argument(verifier, request_, reason):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await verifier.Verify(request_, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in err.value.details()


async def test_verify_says_when_the_sandbox_is_unreachable(scorer):
    servicer = VerifierServicer(scorer, f"127.0.0.1:{free_port()}")
    server = rpc.RpcServer([rpc.Service("crucible.v1.Verifier", servicer,
                                        verdict_pb2_grpc.add_VerifierServicer_to_server)])
    async with server, rpc.channel(server.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await verdict_pb2_grpc.VerifierStub(channel).Verify(
                verdict_pb2.VerifyRequest(rollout=rollout("v", ADD, "    return a + b\n")), timeout=30)
    await servicer.close()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "CRUCIBLE_VERIFIER_SANDBOX_TARGET" in err.value.details()


# --- the scoring limit -----------------------------------------------------------------------------

async def test_a_completion_that_hangs_its_scorer_gets_a_failed_verdict():
    evil = task_pb2.Task(id="re", kind="regex", prompt="?", answer=task_pb2.ExpectedAnswer(answer="(a+)+$"))
    async with ScorerPool(Settings(verifier_workers=1), timeout_s=1.0) as pool:
        slow = await pool.verify(verdict_pb2.VerifyRequest(rollout=rollout("s", evil, "Answer: " + "a" * 40 + "!")))
        assert slow.reward == 0.0 and slow.components["scoring_failed"] == 1.0 and "longer than 1s" in slow.detail
        after = await pool.verify(verdict_pb2.VerifyRequest(rollout=rollout("t", evil, "Answer: aaa")))
        assert after.reward == 1.0 and pool.failures == 1
