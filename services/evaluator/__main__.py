"""python -m crucible.services.evaluator: crucible.policy + crucible.heldout -> crucible.evaluations + ClickHouse.

Scores policy version 0 and every `eval_every`-th version of the run on the held-out tasks
(published to crucible.heldout, which nothing trains on), greedily and by `eval_samples` completions
a task drawn at the training temperature, through the Verifier, so the same task
kinds and the same sandbox judge them as in training. Each result is stored per task kind in the
`evaluations` table and published on crucible.evaluations, where the learner's health monitor reads
it (`reward_without_heldout`). A version is scored once: a restarted evaluator skips what is stored.
"""
from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import socket

import grpc

from crucible.ml import evaluation
from crucible.ml.policy import transfer
from crucible.ml.policy.backends import backend_for
from crucible.ml.tasks import is_heldout, task_problems
from crucible.shared import bus, integrity, service, store, telemetry
from crucible.shared.settings import Settings
from crucible.shared.store import writes
from crucible.v1 import evaluation_pb2, policy_pb2, task_pb2

log = logging.getLogger("crucible.evaluator")

COLUMNS = ["run_id", "policy_version", "task_kind", "tasks", "passed", "pass_rate", "eval_ms", "ts", "samples",
           "samples_passed"]
ALL_KINDS = "*"
RETRY_S = 2.0  # before a version whose scoring could not reach the verifier is scored again


def evaluation_message(settings: Settings, version: int, result: evaluation.Result,
                       evaluator_id: str) -> evaluation_pb2.Evaluation:
    message = evaluation_pb2.Evaluation(
        run_id=settings.run_id, policy_version=version, tasks=sum(result.tasks.values()),
        passed=sum(result.passed.values()), pass_rate=result.pass_rate, evaluator_id=evaluator_id,
        eval_ms=result.eval_ms, samples=sum(result.samples.values()),
        samples_passed=sum(result.samples_passed.values()),
        by_kind={k: evaluation_pb2.KindResult(tasks=n, passed=result.passed[k], samples=result.samples[k],
                                              samples_passed=result.samples_passed[k])
                 for k, n in result.tasks.items()})
    message.created_at.FromDatetime(dt.datetime.now(dt.timezone.utc))
    return message


def rows(message: evaluation_pb2.Evaluation) -> list[list]:
    ts = message.created_at.ToDatetime(tzinfo=dt.timezone.utc)
    kinds = {ALL_KINDS: message, **message.by_kind}
    return [[message.run_id, message.policy_version, kind, r.tasks, r.passed, r.passed / r.tasks if r.tasks else 0.0,
             message.eval_ms, ts, r.samples, r.samples_passed] for kind, r in kinds.items()]


class Evaluator:
    def __init__(self, settings: Settings, client, producer: bus.Producer):
        self.settings = settings
        self.store = client
        self.producer = producer
        self.id = f"{socket.gethostname()}-{os.getpid()}"
        self.tasks: dict[str, task_pb2.Task] = {}
        self.pending: dict[int, tuple[policy_pb2.PolicyVersion, object]] = {}
        self.done: set[int] = set()
        self.tracer = telemetry.tracer("crucible.evaluator")
        self.secret = integrity.key(settings)

    def wants(self, pv: policy_pb2.PolicyVersion) -> bool:
        if not (pv.run_id == self.settings.run_id and pv.version % self.settings.eval_every == 0
                and pv.version not in self.done):
            return False
        if not integrity.signed_correctly(pv, self.secret):
            log.warning("ignoring policy version %d: not signed by the run's learner", pv.version)
            return False
        return True

    def take_task(self, task: task_pb2.Task) -> str | None:
        """Adds a held-out task to the set it scores; else says why it cannot (the record is dead-lettered)."""
        try:  # the signature first: nothing of an unsigned task is looked at further
            integrity.check_task(task, self.secret)
        except integrity.IntegrityError as exc:
            return f"task {task.id[:200]!r} on the held-out topic: {exc}"
        problems = task_problems(task, self.settings)
        if problems or not is_heldout(task):
            return (f"task {task.id!r} on the held-out topic: "
                    + ("; ".join(problems) or f"its split is {task.split!r}, not heldout"))
        self.tasks[task.id] = task
        return None

    async def run(self, stop: asyncio.Event) -> None:
        s = self.settings
        self.done = set(await asyncio.to_thread(self._stored_versions))
        heldout = bus.Reader(["heldout"], None, settings=s, producer=self.producer, offsets={"heldout": {}})
        policy = bus.Reader(["policy"], None, settings=s, producer=self.producer, offsets={"policy": {}},
                            dead_letters=False)  # the generators judge policy versions
        async with heldout, policy:
            log.info("evaluator ready: run %s, every %d versions, verifier %s", s.run_id, s.eval_every,
                     s.evaluator_verifier_target)
            while not stop.is_set():
                for incoming in await heldout.fetch(timeout_ms=100):
                    problem = self.take_task(incoming.message)
                    if problem:  # read again from the start after a restart: dead-lettered again then
                        await heldout.reject(incoming, problem)
                for incoming in await policy.fetch(timeout_ms=200):
                    if self.wants(incoming.message):
                        self.pending[incoming.message.version] = (incoming.message, incoming.context)
                # Score only once every held-out task published so far is in: a partial set is a different test.
                if self.pending and self.tasks and await heldout.at_end():
                    version = min(self.pending)
                    pv, context = self.pending.pop(version)
                    if not await self.evaluate(pv, context):
                        self.pending[version] = (pv, context)
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(stop.wait(), RETRY_S)

    async def evaluate(self, pv: policy_pb2.PolicyVersion, context) -> bool:
        """Scores one version, stores and publishes the result; False where it is to be tried again (the
        verifier or sandbox could not be reached: restarting, or stopped before this service)."""
        s = self.settings
        with self.tracer.start_as_current_span("evaluate policy version", context=context) as span:
            span.set_attribute("crucible.policy_version", pv.version)
            try:
                folder = await asyncio.to_thread(transfer.fetch, pv.checkpoint_uri, s.home / "cache" / "checkpoints",
                                                 s.checkpoint_storage_options, sha256=pv.checkpoint_sha256 or None)
                backend = await asyncio.to_thread(backend_for, s, folder.as_uri())
            except Exception as exc:  # pruned, unreachable or tampered: that version goes unscored, the next will not
                log.warning("cannot score version %d (%s): %s", pv.version, pv.checkpoint_uri, exc)
                return True
            try:
                # episodes' tools run in the same sandbox the verifier uses
                async with evaluation.verifier(s.evaluator_verifier_target) as verify, \
                        evaluation.sandbox(s.verifier_sandbox_target) as execute:
                    result = await evaluation.evaluate(backend, list(self.tasks.values()), verify,
                                                       max_tokens=s.max_tokens, execute=execute,
                                                       max_episode_tokens=s.max_episode_tokens,
                                                       samples=s.eval_samples, temperature=s.temperature,
                                                       top_p=s.top_p)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                log.warning("version %d: scoring could not reach the verifier (%s) or its sandbox (%s): %s: %s; "
                            "scored again in %.0f s", pv.version, s.evaluator_verifier_target,
                            s.verifier_sandbox_target, exc.code().name, exc.details(), RETRY_S)
                return False
            message = evaluation_message(s, pv.version, result, self.id)
            await asyncio.to_thread(writes.insert, self.store, "evaluations", rows(message), COLUMNS)
            await self.producer.send_and_wait("evaluations", message, key=s.run_id)
            self.done.add(pv.version)
            log.info("version %d: held-out pass rate %.3f on %d tasks (%s), sampled %.3f of %d, in %.0f ms%s",
                     pv.version, message.pass_rate, message.tasks,
                     ", ".join(f"{k} {r.passed}/{r.tasks}" for k, r in sorted(message.by_kind.items())),
                     result.sampled_pass_rate, message.samples, message.eval_ms,
                     f"; {result.refused} completions the verifier refused, counted as failed" if result.refused else "")
            return True

    def _stored_versions(self) -> list[int]:
        return [r[0] for r in self.store.query(
            "SELECT DISTINCT policy_version FROM evaluations FINAL WHERE run_id = {r:String} AND task_kind = '*'",
            parameters={"r": self.settings.run_id}).result_rows]


async def run(settings: Settings, stop: asyncio.Event) -> None:
    await bus.ensure_topics(["heldout", "policy", "evaluations"], settings=settings)
    client = await asyncio.to_thread(store.connect, settings)
    await asyncio.to_thread(store.migrate, client)
    async with bus.Producer(settings) as producer:
        await Evaluator(settings, client, producer).run(stop)


async def main() -> None:
    settings = service.setup("evaluator")
    await run(settings, service.stop_event())


if __name__ == "__main__":
    asyncio.run(main())
