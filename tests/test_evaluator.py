"""The evaluator: policy versions scored on the held-out tasks, stored per kind, published for the learner."""
from __future__ import annotations

import asyncio

import pytest

from crucible.ml.policy import transfer
from crucible.ml.policy.checkpoint import fresh_policy, save_checkpoint
from crucible.ml.task_families import digits_tasks
from crucible.services.evaluator.__main__ import run
from crucible.services.verifier.scorer_pool import ScorerPool
from crucible.services.verifier.servicer import VerifierServicer
from crucible.shared import bus, messages, rpc, store
from crucible.v1 import evaluation_pb2, policy_pb2, task_pb2, verdict_pb2_grpc
from tests.test_bus import read_raw

pytestmark = [pytest.mark.kafka, pytest.mark.store]


def version(settings, number: int, folder) -> policy_pb2.PolicyVersion:
    return policy_pb2.PolicyVersion(run_id=settings.run_id, version=number, checkpoint_uri=folder.as_uri(),
                                    checkpoint_sha256=transfer.content_hash(folder))


async def test_versions_are_scored_on_the_heldout_set_stored_and_published(stack_settings, tmp_path, caplog):
    # one run of one deployment: the scorer and the publisher share CRUCIBLE_HOME and the run id, so the key
    async with ScorerPool(stack_settings.model_copy(update={"verifier_workers": 1, "home": tmp_path,
                                                            "run_id": "eval-run"})) as scorer:
        server = rpc.RpcServer([rpc.Service("crucible.v1.Verifier", VerifierServicer(scorer, "127.0.0.1:1"),
                                            verdict_pb2_grpc.add_VerifierServicer_to_server)])
        async with server:
            settings = stack_settings.model_copy(update={
                "home": tmp_path, "run_id": "eval-run", "eval_every": 2, "eval_samples": 3, "max_tokens": 8,
                "evaluator_verifier_target": server.address})
            heldout = [t for t, _ in zip(digits_tasks("heldout", seed=3, group_size=1), range(12))]
            init = save_checkpoint(fresh_policy(0), tmp_path / "v0", {"version": 0})
            other = save_checkpoint(fresh_policy(5), tmp_path / "v2", {"version": 2})
            await bus.ensure_topics(["heldout", "policy", "evaluations"], settings=settings)
            async with bus.Producer(settings) as producer:
                for t in heldout:
                    await producer.send_and_wait("heldout", t, key=t.id)
                trained = task_pb2.Task(id="train-1", kind="exact", prompt="p", group_size=1, split="train",
                                        answer=task_pb2.ExpectedAnswer(answer="x"))
                await producer.send_and_wait("heldout", trained)  # not held out: ignored
                for pv in (version(settings, 0, init), version(settings, 1, init), version(settings, 2, other)):
                    await producer.send_and_wait("policy", pv, key=settings.run_id)
                elsewhere = version(settings, 4, other)
                elsewhere.run_id = "another-run"
                await producer.send_and_wait("policy", elsewhere)
            stop = asyncio.Event()
            evaluator = asyncio.create_task(run(settings, stop))
            try:
                records = await read_raw(settings, "evaluations", 2, timeout=120)
                results = [messages.decode(r.value, evaluation_pb2.Evaluation) for r in records]
                assert [e.policy_version for e in results] == [0, 2]  # every 2nd version, this run's only
                for e in results:
                    assert e.tasks == 12 and e.by_kind["exact"].tasks == 12 and 0 <= e.pass_rate <= 1
                    assert e.passed == e.by_kind["exact"].passed
                    # and eval_samples completions of each task drawn at the training temperature
                    assert e.samples == e.by_kind["exact"].samples == 12 * 3
                    assert e.samples_passed == e.by_kind["exact"].samples_passed <= e.samples
                with pytest.raises(asyncio.TimeoutError):
                    await read_raw(settings, "evaluations", 3, timeout=3)
            finally:
                stop.set()
                await asyncio.wait_for(evaluator, 30)
            assert "refused by the verifier" not in caplog.text  # every completion scored, none counted failed unread
            client = store.connect(settings)
            rows = client.query("SELECT policy_version, task_kind, tasks, samples FROM evaluations FINAL "
                                "WHERE run_id = 'eval-run' ORDER BY policy_version, task_kind").result_rows
            assert rows == [(0, "*", 12, 36), (0, "exact", 12, 36), (2, "*", 12, 36), (2, "exact", 12, 36)]
            stored = client.query("SELECT policy_version, samples_passed FROM evaluations FINAL "
                                  "WHERE run_id = 'eval-run' AND task_kind = '*' ORDER BY policy_version").result_rows
            assert stored == [(e.policy_version, e.samples_passed) for e in results]
            # A restarted evaluator does not score a stored version again.
            stop = asyncio.Event()
            again = asyncio.create_task(run(settings, stop))
            await asyncio.sleep(5)
            stop.set()
            await asyncio.wait_for(again, 30)
            assert len(await read_raw(settings, "evaluations", 2, timeout=5)) == 2
            with pytest.raises(asyncio.TimeoutError):
                await read_raw(settings, "evaluations", 3, timeout=2)


async def test_a_verifier_that_is_down_delays_the_evaluation_and_loses_nothing(stack_settings, tmp_path):
    """The verifier restarting (or stopped before the evaluator at the end of a run): the version is scored
    once it answers again, and the evaluator keeps running (it used to die with the gRPC error)."""
    from crucible.shared.procs import free_port

    port = free_port()
    settings = stack_settings.model_copy(update={
        "home": tmp_path, "run_id": "eval-down", "eval_every": 1, "eval_samples": 1, "max_tokens": 8,
        "evaluator_verifier_target": f"127.0.0.1:{port}"})
    heldout = [t for t, _ in zip(digits_tasks("heldout", seed=4, group_size=1), range(6))]
    init = save_checkpoint(fresh_policy(0), tmp_path / "v0", {"version": 0})
    await bus.ensure_topics(["heldout", "policy", "evaluations"], settings=settings)
    async with bus.Producer(settings) as producer:
        for t in heldout:
            await producer.send_and_wait("heldout", t, key=t.id)
        await producer.send_and_wait("policy", version(settings, 0, init), key=settings.run_id)
    stop = asyncio.Event()
    evaluator = asyncio.create_task(run(settings, stop))
    try:
        with pytest.raises(asyncio.TimeoutError):  # nothing answers on the verifier's address
            await read_raw(settings, "evaluations", 1, timeout=8)
        assert not evaluator.done()
        async with ScorerPool(settings.model_copy(update={"verifier_workers": 1})) as scorer:
            server = rpc.RpcServer([rpc.Service("crucible.v1.Verifier", VerifierServicer(scorer, "127.0.0.1:1"),
                                                verdict_pb2_grpc.add_VerifierServicer_to_server)], port=port)
            async with server:
                records = await read_raw(settings, "evaluations", 1, timeout=60)
        result = messages.decode(records[0].value, evaluation_pb2.Evaluation)
        assert (result.policy_version, result.tasks, result.samples) == (0, 6, 6)
    finally:
        stop.set()
        await asyncio.wait_for(evaluator, 30)


async def test_a_held_out_completion_the_verifier_refuses_counts_as_failed_and_the_rest_are_scored():
    """One refusal (a scorer that breaks on a completion) ended the evaluation and the evaluator with it,
    at every restart (greedy decoding writes the same completion again): no version was scored again.
    A verifier that is away still fails the evaluation, which is tried again."""
    import grpc

    from crucible.ml import evaluation
    from crucible.ml.policy.backends import create_backend
    from crucible.v1 import verdict_pb2

    import itertools

    tasks = list(itertools.islice(digits_tasks("heldout", seed=3), 6))
    backend = create_backend("torch", seed=1)
    breaking = tasks[2].id

    async def verify(request):
        if request.task.id == breaking:
            raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "scoring failed")
        verdict = verdict_pb2.Verdict()
        verdict.sample.passed = True
        return verdict

    result = await evaluation.evaluate(backend, tasks, verify, max_tokens=4)
    assert sum(result.tasks.values()) == 6 and sum(result.passed.values()) == 5 and result.refused == 1

    async def away(request):
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down")

    with pytest.raises(grpc.aio.AioRpcError):
        await evaluation.evaluate(backend, tasks, away, max_tokens=4)

    class Short:  # a backend answering fewer prompts than asked: fewer tasks were scored, quietly
        name = "short"

        def sample(self, prompts, n, params):
            return backend.sample(prompts, n, params)[:-1]

    with pytest.raises(RuntimeError, match="completions for 6 prompts"):
        await evaluation.evaluate(Short(), tasks, verify, max_tokens=4)
