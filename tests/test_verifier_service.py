"""The verifier service: Kafka executions/rollouts -> verdicts (DLQ for the unverifiable), gRPC Verify, scoring limits."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import pytest_asyncio

from crucible.v1 import execution_pb2, execution_pb2_grpc, rollout_pb2, task_pb2, verdict_pb2, verdict_pb2_grpc
from crucible.services.sandbox_executor.handler import request_for_rollout
from crucible.services.sandbox_executor.pool import SandboxPool
from crucible.services.sandbox_executor.servicer import SandboxServicer
from crucible.services.verifier import handler
from crucible.services.verifier.consumer import TOPICS, verdict_handler
from crucible.services.verifier.scorer_pool import ScorerPool
from crucible.services.verifier.servicer import VerifierServicer
from crucible.ml import evaluation
from crucible.shared import bus, integrity, rpc
from crucible.ml.kinds import builtin_sets
from crucible.shared.settings import Settings
from crucible.shared.procs import free_port
from pydantic import SecretStr
from tests.bus_helpers import publish_unsigned
from tests.test_bus import read_raw

ADD = task_pb2.Task(id="add", kind="python_tests", prompt="def add(a, b):\n    '''a + b'''\n", group_size=2,
                    python_tests=task_pb2.PythonTests(entry_point="add",
                                                      test_code="def check(f):\n    assert f(2, 3) == 5\n"))
CAPITAL = task_pb2.Task(id="capital", kind="exact", prompt="Capital of France?", group_size=1,
                        answer=task_pb2.ExpectedAnswer(answer="Paris"))
HALF = task_pb2.Task(id="half", kind="math_answer", prompt="1 divided by 2?", group_size=1,
                     answer=task_pb2.ExpectedAnswer(answer="\\frac{1}{2}"))


# The deployment's integrity key in these tests, and the key of their run ("local", the default run id):
# tasks are signed with it, results sealed.
DEPLOYMENT_KEY = bytes(range(32))
KEY = integrity.run_key(DEPLOYMENT_KEY, "local")


def signed(task: task_pb2.Task) -> task_pb2.Task:
    copy = task_pb2.Task()
    copy.CopyFrom(task)
    return integrity.sign_task(copy, KEY)


def sealed(result: execution_pb2.ExecutionResult, task: task_pb2.Task, completion: str,
           rollout_id: str | None = None) -> execution_pb2.ExecutionResult:
    """The result as a sandbox holding KEY would have sealed it for this completion of this task: run for the
    rollout `rollout_id` (None: for a call of Sandbox.Execute)."""
    return integrity.seal(result, request_for_rollout(task, rollout("any", completion)), KEY, rollout_id)


def rollout(rid: str, completion: str, index: int = 0) -> rollout_pb2.Rollout:
    return rollout_pb2.Rollout(id=rid, sample_index=index, completion=completion, token_ids=[1, 2, 3])


def request(rid: str, task: task_pb2.Task, completion: str, **fields) -> verdict_pb2.VerifyRequest:
    return verdict_pb2.VerifyRequest(task=signed(task), rollout=rollout(rid, completion), **fields)


def group(group_id: str, task: task_pb2.Task, *completions: str) -> rollout_pb2.RolloutGroup:
    """A group as a generator holding KEY sends it (signed), of the task as a trusted submitter signed it."""
    return integrity.sign(rollout_pb2.RolloutGroup(
        group_id=group_id, task=signed(task), policy_version=3, temperature=0.7, top_p=0.9, prompt_token_ids=[9, 9],
        rollouts=[rollout(f"{group_id}/{i}", c, i) for i, c in enumerate(completions)]), KEY)


def keyed(settings: Settings) -> Settings:
    """The settings of a process holding KEY (its producer signs what it sends with it)."""
    return settings.model_copy(update={"integrity_key": SecretStr(DEPLOYMENT_KEY.hex())})


def outcome(*passed: bool, **fields) -> execution_pb2.ExecutionResult:
    return execution_pb2.ExecutionResult(
        tests=[execution_pb2.TestOutcome(name="check", passed=p) for p in passed],
        isolation=execution_pb2.ISOLATION_LEVEL_FULL, **fields)


@pytest_asyncio.fixture(scope="module")
async def scorer():
    async with ScorerPool(Settings(verifier_workers=2, integrity_key=DEPLOYMENT_KEY.hex())) as pool:
        yield pool


# --- pure routing --------------------------------------------------------------------------------

def test_routing_is_by_kind():
    assert handler.requests_for(group("g", ADD, "    return a + b\n")) == []  # the sandbox runs it first
    assert [r.rollout.id for r in handler.requests_for(group("h", CAPITAL, "Paris", "Rome"))] == ["h/0", "h/1"]
    execution = execution_pb2.Execution(group=group("g", ADD, "x"), results=[outcome(True)])
    assert handler.requests_for(execution)[0].execution.tests[0].passed
    with pytest.raises(handler.Unverifiable, match="unknown kind 'poetry'"):
        handler.requests_for(group("p", task_pb2.Task(id="p", kind="poetry", prompt="p"), "x"))
    with pytest.raises(handler.Unverifiable, match="1 results for 2 rollouts"):
        handler.requests_for(execution_pb2.Execution(id="e", group=group("g", ADD, "x", "y"), results=[outcome(True)]))


async def test_an_unsigned_record_costs_a_signature_check_not_the_checks_of_its_task(monkeypatch):
    """Anyone who can write to a topic can send a task whose checks (a compile, walks of its tests) are
    slow; the signature is checked first, so what no trusted service wrote never reaches them."""
    from types import SimpleNamespace

    from crucible.ml import kinds

    checked = []
    monkeypatch.setattr(kinds, "problems_of", lambda kind, task: checked.append(task.id) or [])
    async def nothing_to_score(requests):
        assert requests == []
        return []

    handle = verdict_handler(SimpleNamespace(secret=KEY, verify_group=nothing_to_score))
    other_key = bytes(32)

    def forged(record):
        return integrity.sign(record, other_key)

    unsigned = rollout_pb2.RolloutGroup()
    unsigned.CopyFrom(group("u", CAPITAL, "Paris"))
    unsigned.ClearField("signature")
    for record in (execution_pb2.Execution(id="e", group=forged(group("g", ADD, "x")), results=[outcome(True)]),
                   forged(group("h", CAPITAL, "Paris")), unsigned):
        with pytest.raises(bus.Reject):
            await handle(bus.Incoming("t", 0, 0, None, record))
    # a group to be run first is the sandbox's, signed or not: not checked here at all
    for record in (group("a", ADD, "x"), forged(group("b", ADD, "x"))):
        assert await handle(bus.Incoming("t", 0, 0, None, record)) == []
    assert checked == []


def test_code_fences_are_found_in_time_linear_in_the_completion():
    """A completion of a fence and a long run of spaces (no newline) once cost time quadratic in the run,
    on the event loops of the services that make rollouts into jobs: 2 s for 64k spaces. Run in a process
    of its own: a regex holds the interpreter until it is done, so only a kill can stop a slow one."""
    import subprocess
    import sys

    probe = ("from crucible.ml.kinds import python_tests\n"
             "from crucible.v1 import task_pb2\n"
             "completion = '```' + ' ' * 2_000_000 + 'py' + ' ' * 2_000_000\n"
             "assert python_tests.code_of(task_pb2.Task(), completion) == completion\n"
             "print('ok')\n")
    try:  # linear: well under a second here; quadratic: hours
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("finding the code fences of 4 MB of spaces took over a minute")
    assert done.stdout.strip() == "ok", done.stderr[-2000:]
    assert python_tests_code("text\n```python  \ndef add(a, b):\n    return a + b\n```\n") == \
        "def add(a, b):\n    return a + b\n"


def python_tests_code(completion: str) -> str:
    from crucible.ml.kinds import python_tests

    return python_tests.code_of(ADD, completion)


def test_verdict_is_a_flat_sample_with_components():
    verdict = handler.verify(request("r", CAPITAL, "Answer: Paris"))
    assert verdict.reward == 1.0 and verdict.components["answer_correct"] == 1.0
    assert verdict.components["length"] == 3.0 and verdict.components["truncated"] == 0.0
    assert verdict.verifier_version == handler.VERIFIER_VERSION and verdict.id == "r/verdict"
    assert not verdict.HasField("execution")
    assert verdict.sample.passed and verdict.sample.task_id == "capital" and verdict.task_kind == "exact"
    assert not verdict.sample.heldout
    held = task_pb2.Task()
    held.CopyFrom(CAPITAL)
    held.split = "heldout"
    assert handler.verify(request("r", held, "Answer: Paris")).sample.heldout
    whole = handler.in_group(verdict, group("h", CAPITAL, "Answer: Paris"))
    s = whole.sample
    assert (s.group_id, s.group_size, s.policy_version, list(s.prompt_token_ids)) == ("h", 1, 3, [9, 9])
    assert s.temperature == pytest.approx(0.7) and s.top_p == pytest.approx(0.9)
    assert CAPITAL.prompt.encode() not in whole.SerializeToString()  # the task does not travel past the verifier


def test_a_groups_verdicts_are_counted_by_label_set_and_its_mean_of_each_component_recorded_once(monkeypatch):
    from opentelemetry.sdk.metrics import MeterProvider

    from crucible.services.verifier import consumer
    from crucible.shared import metrics

    reader = metrics.PrometheusReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("t")
    monkeypatch.setattr(consumer, "VERDICTS", meter.create_counter("crucible.verifier.verdicts"))
    monkeypatch.setattr(consumer, "COMPONENTS", meter.create_histogram("crucible.verifier.reward_component"))
    verdicts = [handler.verify(request(f"r{i}", CAPITAL, answer))
                for i, answer in enumerate(["Answer: Paris", "Answer: Paris", "Answer: Lyon", "Paris"])]
    consumer.observe(verdicts)
    lines = reader.render().splitlines()
    assert 'crucible_verifier_verdicts_total{kind="exact",passed="true",tampered="false"} 3' in lines
    assert 'crucible_verifier_verdicts_total{kind="exact",passed="false",tampered="false"} 1' in lines
    # One value a component for the group: its mean over the four samples.
    assert 'crucible_verifier_reward_component_count{component="answer_correct",kind="exact"} 1' in lines
    assert 'crucible_verifier_reward_component_sum{component="answer_correct",kind="exact"} 0.75' in lines
    expected_format = sum(v.components["format_ok"] for v in verdicts) / 4
    assert f'crucible_verifier_reward_component_sum{{component="format_ok",kind="exact"}} {expected_format}' in lines


# --- Kafka ---------------------------------------------------------------------------------------

@pytest.mark.kafka
async def test_executions_and_answer_rollouts_become_verdicts(settings, scorer):
    await bus.ensure_topics([*TOPICS, "verdicts"], settings=settings)
    rg_task = builtin_sets.reasoning_gym("gcd", 1, seed=4)[0]
    rg_answer = __import__("json").loads(rg_task.generator.entry_json)["answer"]
    executions = [
        execution_pb2.Execution(
            id="e", group=group("x", ADD, "    return a + b\n", "    return a - b\n",
                                "    print('All tests passed')\n    return a + b\n", ""),
            results=[sealed(outcome(True), ADD, "    return a + b\n", "x/0"),
                     sealed(outcome(False), ADD, "    return a - b\n", "x/1"),
                     sealed(outcome(True, stdout=b"All tests passed\n"), ADD,
                            "    print('All tests passed')\n    return a + b\n", "x/2"),
                     sealed(execution_pb2.ExecutionResult(not_run="code is empty"), ADD, "", "x/3")]),
    ]
    groups = [
        group("h", CAPITAL, "Answer: Paris"),
        group("m", HALF, "so \\boxed{0.5}"),
        group("k", rg_task, f"<answer>{rg_answer}</answer>"),
        group("a", ADD, "    return a + b\n"),  # python_tests: the sandbox's, not ours
        group("bad0", task_pb2.Task(id="p", kind="poetry", prompt="write"), "roses"),
        group("bad1", task_pb2.Task(id="r", kind="regex", prompt="?", answer=task_pb2.ExpectedAnswer(answer="(")), "x"),
    ]
    async with bus.Producer(keyed(settings)) as producer:
        for e in executions:
            await producer.send_and_wait("executions", e, key=e.group.group_id)
        for g in groups:
            await producer.send_and_wait("rollouts", g, key=g.group_id)
    async with bus.Consumer(TOPICS, "verifier", verdict_handler(scorer), settings=settings, concurrency=4) as consumer:
        await asyncio.wait_for(consumer.run(max_records=len(executions) + len(groups)), 60)
    verdicts, records = {}, await read_raw(settings, "verdicts", 4)
    for record in records:  # one record a group, holding all its verdicts
        held = verdict_pb2.VerdictGroup.FromString(record.value).verdicts
        assert {v.sample.group_id.encode() for v in held} == {record.key}
        verdicts.update((v.sample.id, v) for v in held)
    assert sorted(record.key for record in records) == [b"h", b"k", b"m", b"x"]
    assert set(verdicts) == {"x/0", "x/1", "x/2", "x/3", "h/0", "m/0", "k/0"}
    assert verdicts["x/0"].reward == 1.0 and verdicts["x/0"].execution.tests[0].passed and verdicts["x/0"].sample.passed
    assert verdicts["x/1"].reward == 0.0 and verdicts["x/1"].components["tests_total"] == 1.0
    assert verdicts["x/2"].tampered and list(verdicts["x/2"].tamper_patterns) == ["fake_result_output"]
    assert verdicts["x/2"].reward == 0.0 and not verdicts["x/2"].sample.passed
    assert not verdicts["x/2"].execution.stdout  # scored: output is not carried past the verifier
    assert verdicts["x/3"].reward == 0.0 and "not run" in verdicts["x/3"].detail
    assert all(v.sample.group_size == 4 for k, v in verdicts.items() if k.startswith("x/"))
    assert [verdicts[r].reward for r in ("h/0", "m/0", "k/0")] == [1.0, 1.0, 1.0]
    dead = {dict(r.headers)["dlq-reason"].decode() for r in await read_raw(settings, "rollouts.dlq", 2)}
    assert any("unknown kind 'poetry': known kinds are" in d for d in dead), dead
    assert any("not a valid regular expression" in d for d in dead), dead


# --- gRPC ----------------------------------------------------------------------------------------

async def test_a_group_larger_together_than_a_scoring_process_takes_is_scored_in_parts(scorer):
    """A signed task of 1.1 MB and a group of 64: the record fits Kafka, but the group's requests (each
    holding the task) are 70 MB together, over a scoring frame's limit: scored in parts, every one paid."""
    tests = "DATA = '" + "a" * 1_100_000 + "'\ndef check(f):\n    assert f(2, 3) == 5\n"
    task = task_pb2.Task(id="big", kind="python_tests", prompt=ADD.prompt, group_size=64,
                         python_tests=task_pb2.PythonTests(entry_point="add", test_code=tests))
    honest = "    return a + b\n"
    big = group("big", task, *[honest] * 64)
    record = execution_pb2.Execution(id="big", group=big, results=[
        sealed(outcome(True), big.task, honest, r.id) for r in big.rollouts])
    failures, restarts = scorer.failures, scorer._workers.restarts
    [out] = await verdict_handler(scorer)(bus.Incoming("executions", 0, 0, b"big", record))
    assert [v.reward for v in out.message.verdicts] == [1.0] * 64
    assert (scorer.failures, scorer._workers.restarts) == (failures, restarts)  # no part failed, no process restarted


@pytest_asyncio.fixture(scope="module")
async def sandbox_address():
    async with SandboxPool(Settings(sandbox_workers=2, sandbox_wall_s=5.0)) as pool:
        server = rpc.RpcServer([rpc.Service("crucible.v1.Sandbox", SandboxServicer(pool, KEY),
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
    good = await verifier.Verify(request("v0", ADD, "    return a + b\n"), timeout=30)
    assert good.reward == 1.0 and good.execution.tests[0].passed
    # the verifier's own run comes back unsealed: a caller may ask again until a flaky program passes, and
    # must not take away a seal for the rollout it named
    assert not good.execution.seal
    assert good.execution.isolation == execution_pb2.ISOLATION_LEVEL_FULL
    forged = await verifier.Verify(request(
        "v1", ADD, "    class A:\n        __eq__ = lambda s, o: True\n    return A()\n"), timeout=30)
    assert forged.reward == 0.0 and forged.tampered and "non_plain_return" in forged.tamper_patterns
    given = await verifier.Verify(request("v2", ADD, "    return a + b\n",
                                          execution=sealed(outcome(False), ADD, "    return a + b\n", "v2")), timeout=30)
    assert given.reward == 0.0  # a sealed execution that comes along is scored as it is


@pytest.mark.sandbox
async def test_verify_scores_answers_directly(verifier):
    v = await verifier.Verify(request("v3", HALF, "\\boxed{\\frac{2}{4}}"), timeout=30)
    assert v.reward == 1.0 and v.components["format_ok"] == 1.0


@pytest.mark.sandbox
@pytest.mark.parametrize("request_,reason", [
    (verdict_pb2.VerifyRequest(), "carries no task"),
    (request("u", task_pb2.Task(id="p", kind="poetry"), "x"), "unknown kind 'poetry'"),
    (request("w", task_pb2.Task(id="e", kind="exact", prompt="?"), "x"), "needs a 'answer' payload"),
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
                request("v", ADD, "    return a + b\n"), timeout=30)
    await servicer.close()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "CRUCIBLE_VERIFIER_SANDBOX_TARGET" in err.value.details()


class CountingServicer(VerifierServicer):
    """The verifier, noting the size of every VerifyBatch call it takes."""

    def __init__(self, *args):
        super().__init__(*args)
        self.batches: list[int] = []

    async def VerifyBatch(self, request, context):
        self.batches.append(len(request.requests))
        return await super().VerifyBatch(request, context)


def comparable(verdict: verdict_pb2.Verdict) -> tuple:
    """What a verdict says, without when it was made or how long the run took."""
    return (verdict.id, verdict.reward, verdict.tampered, list(verdict.tamper_patterns), dict(verdict.components),
            verdict.sample.passed, [(t.name, t.passed) for t in verdict.execution.tests], verdict.detail)


@pytest.mark.sandbox
async def test_a_batch_is_answered_request_by_request_as_verify_answers_each(verifier):
    honest = "    return a + b\n"
    requests = [
        request("b0", ADD, honest),  # run in the sandbox, paid
        request("b1", ADD, "    class A:\n        __eq__ = lambda s, o: True\n    return A()\n"),  # tampering
        verdict_pb2.VerifyRequest(),  # no task
        request("b3", HALF, "\\boxed{\\frac{2}{4}}"),  # scored without the sandbox
        verdict_pb2.VerifyRequest(task=ADD, rollout=rollout("b4", honest)),  # a task nobody signed
        request("b5", ADD, honest, execution=outcome(True)),  # a result no sandbox sealed
        request("b6", ADD, "   \n"),  # nothing to run
        request("b7", task_pb2.Task(id="p", kind="poetry"), "x"),  # no such kind
        request("b8", HALF, "\\boxed{3}"),
    ]
    batch = await verifier.VerifyBatch(verdict_pb2.VerifyBatchRequest(requests=requests), timeout=60)
    assert [o.WhichOneof("outcome") for o in batch.outcomes] == [
        "verdict", "verdict", "refusal", "verdict", "refusal", "refusal", "verdict", "refusal", "verdict"]
    rewards = [o.verdict.reward for o in batch.outcomes]
    assert (rewards[0], rewards[1], rewards[3], rewards[6], rewards[8]) == (1.0, 0.0, 1.0, 0.0, 0.0)
    assert batch.outcomes[1].verdict.tampered
    for sent, got in zip(requests, batch.outcomes):
        try:
            alone = await verifier.Verify(sent, timeout=30)
        except grpc.aio.AioRpcError as err:
            assert got.WhichOneof("outcome") == "refusal", sent.rollout.id
            assert (got.refusal.code, got.refusal.message) == (err.code().value[0], err.details())
        else:
            assert comparable(got.verdict) == comparable(alone), sent.rollout.id
    refused = {r.rollout.id: o.refusal for r, o in zip(requests, batch.outcomes) if o.HasField("refusal")}
    assert all(r.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] for r in refused.values())
    assert "carries no task" in refused[""].message and "not signed" in refused["b4"].message
    assert "execution result" in refused["b5"].message and "unknown kind 'poetry'" in refused["b7"].message


async def test_verify_calls_made_at_once_travel_in_batches_and_each_gets_its_own_answer(scorer):
    servicer = CountingServicer(scorer, f"127.0.0.1:{free_port()}")  # answer kinds only: no sandbox is asked
    server = rpc.RpcServer([rpc.Service("crucible.v1.Verifier", servicer,
                                        verdict_pb2_grpc.add_VerifierServicer_to_server)])
    answers = ["\\boxed{\\frac{1}{2}}", "\\boxed{3}"]
    sent = [request(f"c{i}", HALF, answers[i % 2]) for i in range(10)]
    sent.insert(5, request("bad", task_pb2.Task(id="p", kind="poetry"), "x"))
    async with server, evaluation.verifier(server.address, batch_max=4) as verify:
        got = await asyncio.gather(*(verify(r) for r in sent), return_exceptions=True)
        alone = await verify(sent[0])
        async with rpc.channel(server.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:  # more than the verifier takes in one call
                await verdict_pb2_grpc.VerifierStub(channel).VerifyBatch(
                    verdict_pb2.VerifyBatchRequest(requests=[sent[0]] * 1025), timeout=30)
    await servicer.close()
    assert sorted(servicer.batches[:3]) == [3, 4, 4] and servicer.batches[3:] == [1, 1025]  # the first three at once
    refused = got.pop(5)
    assert isinstance(refused, grpc.aio.AioRpcError) and refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown kind 'poetry'" in refused.details()
    assert [v.id for v in got] == [f"c{i}/verdict" for i in range(10)]
    assert [v.reward for v in got] == [1.0, 0.0] * 5
    assert comparable(alone) == comparable(got[0])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 1024" in err.value.details()


# --- the scoring limit -----------------------------------------------------------------------------

async def test_a_completion_that_hangs_its_scorer_gets_a_failed_verdict():
    evil = task_pb2.Task(id="re", kind="regex", prompt="?", answer=task_pb2.ExpectedAnswer(answer="(a+)+$"))
    async with ScorerPool(Settings(verifier_workers=1, integrity_key=DEPLOYMENT_KEY.hex()), timeout_s=1.0) as pool:
        slow = await pool.verify(request("s", evil, "Answer: " + "a" * 40 + "!"))
        assert slow.reward == 0.0 and slow.components["scoring_failed"] == 1.0 and "longer than 1s" in slow.detail
        after = await pool.verify(request("t", evil, "Answer: aaa"))
        assert after.reward == 1.0 and pool.failures == 1


async def test_a_group_scored_together_fails_only_the_completion_that_hangs():
    """A group travels to one scoring process in one frame; when one of its completions hangs that
    process, the others are still scored (each alone) and only the one at fault pays nothing."""
    evil = task_pb2.Task(id="re", kind="regex", prompt="?", answer=task_pb2.ExpectedAnswer(answer="(a+)+$"))
    async with ScorerPool(Settings(verifier_workers=2, integrity_key=DEPLOYMENT_KEY.hex()), timeout_s=1.0) as pool:
        fine = await pool.verify_group([request(f"f{i}", evil, "Answer: " + "a" * i) for i in range(1, 6)])
        assert [v.reward for v in fine] == [1.0] * 5 and [v.id for v in fine] == [f"f{i}/verdict" for i in range(1, 6)]
        mixed = await pool.verify_group([request("a", evil, "Answer: aa"), request("s", evil, "Answer: " + "a" * 40 + "!"),
                                         request("b", evil, "Answer: b")])
        assert [v.id for v in mixed] == ["a/verdict", "s/verdict", "b/verdict"]
        assert [v.reward for v in mixed] == [1.0, 0.0, 0.0]
        assert mixed[1].components["scoring_failed"] == 1.0 and "scoring_failed" not in mixed[2].components
        assert pool.failures == 1
        with pytest.raises(handler.Unverifiable):  # one completion of a forged task: the group is refused
            await pool.verify_group([request("c", evil, "Answer: a"),
                                     verdict_pb2.VerifyRequest(task=evil, rollout=rollout("d", "Answer: a"))])


async def test_requests_scored_each_on_its_own_cost_each_other_nothing():
    """verify_each (the batch call's scoring): a completion that hangs its scoring process, or a task
    nobody signed, costs only that request its verdict; the others are scored as they would be alone."""
    evil = task_pb2.Task(id="re", kind="regex", prompt="?", answer=task_pb2.ExpectedAnswer(answer="(a+)+$"))
    async with ScorerPool(Settings(verifier_workers=2, integrity_key=DEPLOYMENT_KEY.hex()), timeout_s=1.0) as pool:
        outcomes = await pool.verify_each([
            request("a", evil, "Answer: aa"), request("s", evil, "Answer: " + "a" * 40 + "!"),
            verdict_pb2.VerifyRequest(task=evil, rollout=rollout("u", "Answer: a")), request("b", evil, "Answer: b"),
            request("c", evil, "Answer: a")])
        assert isinstance(outcomes[2], handler.Unverifiable) and "not signed" in str(outcomes[2])
        verdicts = [o for i, o in enumerate(outcomes) if i != 2]
        assert [v.id for v in verdicts] == ["a/verdict", "s/verdict", "b/verdict", "c/verdict"]
        assert [v.reward for v in verdicts] == [1.0, 0.0, 0.0, 1.0]
        assert verdicts[1].components["scoring_failed"] == 1.0 and "scoring_failed" not in verdicts[2].components
        assert pool.failures == 1
        assert await pool.verify_each([]) == []


# --- trust ------------------------------------------------------------------------------------------

@pytest.mark.sandbox
async def test_what_a_reward_is_computed_from_must_be_trusted(verifier):
    honest = "    return a + b\n"
    forged_results = {
        "unsealed": outcome(True),
        "sealed with another key": integrity.seal(outcome(True), request_for_rollout(ADD, rollout("x", honest)),
                                                  bytes(32)),
        "changed after sealing": sealed(outcome(False), ADD, honest, "f"),
        "for other code": sealed(outcome(True), ADD, "    return 5\n", "f"),
        # the very job, sealed for a call of Sandbox.Execute (which anyone may repeat until a run passes),
        # or for another rollout's run
        "for a call, not a run": sealed(outcome(True), ADD, honest),
        "for another rollout": sealed(outcome(True), ADD, honest, "g/0"),
    }
    forged_results["changed after sealing"].tests[0].passed = True
    for name, result in forged_results.items():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await verifier.Verify(request("f", ADD, honest, execution=result), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert "execution result" in err.value.details(), (name, err.value.details())
    # a task nobody signed, or one whose tests were changed after signing
    unsigned = verdict_pb2.VerifyRequest(task=ADD, rollout=rollout("u", honest))
    lenient = signed(ADD)
    lenient.python_tests.test_code = "def check(f):\n    pass\n"
    for bad, why in [(unsigned, "not signed"), (verdict_pb2.VerifyRequest(task=lenient, rollout=rollout("l", "    return 0\n")),
                                                "signature does not match")]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await verifier.Verify(bad, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in err.value.details()
    # an execution result sent with an answer-only kind: nothing ran it, and it would reach the verdict
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await verifier.Verify(request("a", CAPITAL, "Answer: Paris", execution=outcome(True, violation_detail="x")),
                              timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "scored from the answer alone" in err.value.details()
    # the honest way still works: the verifier runs the sandbox, whose result is sealed
    assert (await verifier.Verify(request("ok", ADD, honest), timeout=30)).reward == 1.0


@pytest.mark.kafka
async def test_forged_groups_on_the_topics_are_dead_lettered_not_paid(settings, scorer):
    await bus.ensure_topics([*TOPICS, "verdicts"], settings=settings)
    honest = "    return a + b\n"
    forged = execution_pb2.Execution(id="f", group=group("fx", ADD, honest), results=[outcome(True)])
    unsigned = rollout_pb2.RolloutGroup(group_id="fu", task=CAPITAL, rollouts=[rollout("fu/0", "Answer: Paris")])
    # Samples nobody holding the key sampled: a group written whole with a signed task (raw, so no producer
    # of Crucible signs it), and a sealed execution of a group whose tokens and log-probs were changed after
    # the generator sent it (a correct answer is paid, and what else the sample holds would be learned).
    written = rollout_pb2.RolloutGroup(group_id="fw", task=signed(CAPITAL), rollouts=[rollout("fw/0", "Answer: Paris")])
    retouched = execution_pb2.Execution(id="r", group=group("fr", ADD, honest),
                                        results=[sealed(outcome(True), ADD, honest, "fr/0")])
    retouched.group.rollouts[0].token_ids[:] = [6, 6, 6]
    retouched.group.rollouts[0].logprobs[:] = [-40.0, -40.0, -40.0]
    async with bus.Producer(keyed(settings)) as producer:
        await producer.send_and_wait("executions", forged, key="fx")
        await producer.send_and_wait("rollouts", unsigned, key="fu")
        await producer.send_and_wait("executions", retouched, key="fr")
    await publish_unsigned(settings, "rollouts", written, b"fw")
    async with bus.Consumer(TOPICS, "verifier", verdict_handler(scorer), settings=settings) as consumer:
        await asyncio.wait_for(consumer.run(max_records=4), 60)
    reasons = {dict(r.headers)["dlq-reason"].decode() for topic in ("executions.dlq", "rollouts.dlq")
               for r in await read_raw(settings, topic, 2)}
    assert len(reasons) == 4, reasons
    assert any("not sealed by a sandbox" in r for r in reasons), reasons
    assert any("not signed by a trusted submitter" in r for r in reasons), reasons
    assert any("rollout group 'fw' is not signed" in r for r in reasons), reasons
    assert any("rollout group 'fr': its signature does not match" in r for r in reasons), reasons
    with pytest.raises(asyncio.TimeoutError):  # none of them was paid
        await read_raw(settings, "verdicts", 1, timeout=2)
