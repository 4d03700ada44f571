"""python -m crucible.services.sandbox_executor: the jail pool behind gRPC Sandbox, crucible.rollouts ->
crucible.executions, and the environments' tool calls: crucible.actions -> crucible.observations."""
from __future__ import annotations

import argparse
import asyncio
import logging
import socket
from collections import OrderedDict

from crucible.v1 import execution_pb2_grpc, rollout_pb2
from crucible.services.sandbox_executor.handler import (
    NothingToRun,
    execution_message,
    job_for_request,
    needs_execution,
    not_run_result,
    request_for_rollout,
    result_message,
)
from crucible.services.sandbox_executor.pool import JobRejected, PoolFull, SandboxPool
from crucible.services.sandbox_executor.servicer import SandboxServicer
from crucible.ml import envs
from crucible.ml.envs import episode as ep
from crucible.shared import bus, integrity, metrics, rpc, service

log = logging.getLogger("crucible.sandbox")
REPLAYS = metrics.counter("crucible.sandbox.replays_not_run",
                          "records of a sampled group this process had run already: not run again", "{record}")
RUN_GROUPS_KEPT = 1 << 16  # the groups last run, kept to know a copy of one (~10 MB)


class RunOnce:
    """Which groups this process has taken to run (the newest `kept`), each with the record it came in:
    the first record of a sampled group is run; another record of it (anyone re-publishing a genuine
    group, as often as a program that passes now and then takes to pass) is not, so no run is a second
    throw of the dice. The same record delivered again (a rebalance before its commit) is run again, as
    at-least-once delivery has it; so is a group whose run failed (let go: its handler's retry runs
    it). A process that starts anew knows none."""

    def __init__(self, kept: int = RUN_GROUPS_KEPT):
        self.kept = kept
        self._taken: OrderedDict[str, tuple[str, int, int]] = OrderedDict()
        self.copies = 0  # records not run

    def take(self, group_id: str, record: tuple[str, int, int]) -> bool:
        """Whether the group is this caller's to run from `record` (topic, partition, offset): never
        taken, let go since, or taken from this very record."""
        if self._taken.setdefault(group_id, record) != record:
            self.copies += 1
            return False
        if len(self._taken) > self.kept:
            self._taken.popitem(last=False)
        return True

    def let_go(self, group_id: str) -> None:
        self._taken.pop(group_id, None)


def backpressured(pool: SandboxPool, consumer_ref: list):
    """Runs a job through the pool; while the pool is full, the consumer stops fetching."""

    async def execute(job) -> object:
        while True:
            try:
                return await pool.execute(job)
            except PoolFull:
                # Backpressure: stop fetching until gRPC callers leave room, then carry on.
                consumer = consumer_ref[0]
                if not consumer.paused:
                    consumer.pause()
                    log.info("pool full: paused consuming %s", consumer.topics)
                while not pool.has_capacity():
                    await asyncio.sleep(0.01)
                if consumer.paused:
                    consumer.resume()

    return execute


def group_handler(pool: SandboxPool, consumer_ref: list, executor_id: str, secret: bytes):
    """Runs every rollout of a group that needs running, all at once through the pool; each result
    sealed for the job it ran (shared/integrity.py)."""
    execute = backpressured(pool, consumer_ref)
    runs = RunOnce()

    def task_refused(task) -> bool:
        """Whether the sandbox refuses the task itself (its language, its limits), whatever the completion."""
        try:
            pool.check(job_for_request(request_for_rollout(task, rollout_pb2.Rollout(completion="pass\n"))))
        except NothingToRun:
            return False
        except (JobRejected, ValueError):
            return True
        return False

    async def run_one(task, rollout):
        request = request_for_rollout(task, rollout)
        try:
            job = job_for_request(request)
            pool.check(job)
        except NothingToRun as exc:
            return integrity.seal(not_run_result(str(exc)), request, secret, rollout.id)
        except (JobRejected, ValueError) as exc:
            if task_refused(task):
                raise  # the group goes to the DLQ with the reason
            # the model's output is what the sandbox will not take (a NUL byte, a huge program): that
            # sample is scored as not run, a failure; the group's others are run as usual
            return integrity.seal(not_run_result(f"the sandbox refused this completion: {exc}"), request, secret,
                                  rollout.id)
        # sealed for this rollout: the verifier takes for it only this run's result (integrity.seal)
        return integrity.seal(result_message(await execute(job)), request, secret, rollout.id)

    async def handle(incoming: bus.Incoming):
        group = incoming.message
        if not needs_execution(group):
            return []  # answer-only kinds go straight from rollouts to the verifier
        try:  # nothing is run that no generator sampled, of a task no trusted submitter signed (the verifier
            integrity.check_sampled(group, secret)  # would refuse it after)
        except integrity.IntegrityError as exc:
            raise bus.Reject(str(exc)) from None
        if not runs.take(group.group_id, (incoming.topic, incoming.partition, incoming.offset)):
            REPLAYS.add(1)
            if runs.copies & (runs.copies - 1) == 0:  # the 1st, 2nd, 4th, 8th...: a flood of copies is no flood of logs
                log.warning("group %r (%s@%d) was run already by this process: not run again (%d such records)",
                            group.group_id, incoming.topic, incoming.offset, runs.copies)
            return []
        sent = False
        try:
            try:
                results = await asyncio.gather(*(run_one(group.task, r) for r in group.rollouts))
            except (JobRejected, ValueError) as exc:  # the task asks for what no job can be (its language, ...)
                raise bus.Reject(f"group {group.group_id!r} (task {group.task.id!r}): {exc}") from exc
            outputs = [bus.Outgoing("executions", execution_message(group, results, executor_id), key=group.group_id)]
            sent = True
            return outputs
        finally:
            if not sent:  # failed: not run, as far as a retry is concerned
                runs.let_go(group.group_id)

    return handle


def action_handler(pool: SandboxPool, consumer_ref: list, secret: bytes):
    """Carries out the last turn's tool call of an episode: through the jail for sandboxed tools
    (code, SQL), in the environment's own code otherwise. A call that is malformed, names no tool,
    or fails is an observation that says so; the episode goes back to the generator (or on to the
    verifier when the environment ends it)."""
    run_job = backpressured(pool, consumer_ref)

    async def execute(request):
        try:
            return integrity.seal(result_message(await run_job(job_for_request(request))), request, secret)
        except (NothingToRun, JobRejected) as exc:
            return integrity.seal(not_run_result(str(exc)), request, secret)

    async def handle(incoming: bus.Incoming):
        episode = incoming.message
        try:  # as for rollout groups: nothing is run that a generator did not send, of a task no trusted
            integrity.check_sampled(episode, secret)  # submitter signed
        except integrity.IntegrityError as exc:
            raise bus.Reject(str(exc)) from None
        if not envs.is_environment(episode.task):
            raise bus.Reject(f"episode {episode.id!r}: task kind {episode.task.kind!r} is not an environment")
        if not episode.turns or not episode.turns[-1].HasField("call") or episode.end:
            raise bus.Reject(f"episode {episode.id!r} has no call waiting for an observation")
        if episode.turns[-1].observation or episode.turns[-1].call_failed:
            raise bus.Reject(f"episode {episode.id!r}: its last call was carried out already")
        env = envs.get(episode.task.kind)
        try:
            await ep.act(env, episode, execute)
        except envs.InstanceError as exc:
            raise bus.Reject(f"episode {episode.id!r} (task {episode.task.id!r}): {exc}") from exc
        topic = "episodes" if episode.end else "observations"
        return [bus.Outgoing(topic, episode, key=episode.group_id)]

    return handle


async def main(allow_weak: bool) -> None:
    settings = service.setup("sandbox-executor")
    await bus.ensure_topics(["rollouts", "executions", "actions", "observations", "episodes"], settings=settings)
    async with SandboxPool(settings, allow_weak=allow_weak or None) as pool:
        log.info("isolation: %s", pool.report.describe())
        secret = integrity.key(settings)
        server = rpc.RpcServer([rpc.Service("crucible.v1.Sandbox", SandboxServicer(pool, secret),
                                            execution_pb2_grpc.add_SandboxServicer_to_server)],
                               host=settings.grpc_host, port=settings.sandbox_grpc_port,
                               depends_on=service.dependencies(settings))
        consumer_ref: list = []
        handler = group_handler(pool, consumer_ref, f"{socket.gethostname()}/sandbox", secret)
        # crucible.rollouts is the verifier's too: it dead-letters what does not decode, once.
        consumer = bus.Consumer(["rollouts"], settings.consumer_group_prefix + "sandbox-executor", handler,
                                settings=settings, concurrency=2, undecodable_owned=False)
        consumer_ref.append(consumer)
        # A tool call is carried out, and its observation published, once: in one Kafka transaction
        # with the consumed record (code the model wrote may not be repeatable).
        actions_ref: list = []
        actions = bus.Consumer(["actions"], settings.consumer_group_prefix + "sandbox-executor-actions",
                               action_handler(pool, actions_ref, secret), settings=settings, concurrency=8,
                               transactional=True)
        actions_ref.append(actions)
        async with server, consumer, actions:
            await service.run_until(service.stop_event(), consumer.run(), actions.run())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m crucible.services.sandbox_executor")
    parser.add_argument("--allow-weak-isolation", action="store_true",
                        help="run even where a primitive is missing (every result names what is missing)")
    asyncio.run(main(parser.parse_args().allow_weak_isolation))
