"""python -m crucible.services.generator: crucible.tasks -> crucible.rollouts (one RolloutGroup per task),
an environment's tasks and crucible.observations -> turns of episodes (crucible.actions, crucible.episodes),
weights from crucible.policy, gRPC Generator."""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket

from crucible.v1 import generator_pb2_grpc, policy_pb2
from crucible.services.generator import episodes
from crucible.services.generator.batcher import Batcher, LagBound
from crucible.services.generator.handler import group_id_for, render_prompt, rollout_group
from crucible.services.generator.servicer import GeneratorServicer, sampling_params
from crucible.shared import bus, integrity, metrics, rpc, service
from crucible.ml.policy import transfer
from crucible.ml.policy.backends import backend_for
from crucible.shared.settings import Settings
from crucible.ml import envs
from crucible.ml.tasks import is_heldout, task_problems

log = logging.getLogger("crucible.generator")
TASKS = metrics.counter("crucible.generator.tasks", "tasks taken in, by kind and outcome", "{task}")


def build_backend(settings: Settings):
    return backend_for(settings, settings.init_checkpoint)


def task_handler(settings: Settings, batcher: Batcher, generator_id: str):
    params = sampling_params(settings)
    secret = integrity.key(settings)

    async def handle(incoming: bus.Incoming):
        task = incoming.message
        try:  # the signature first: nothing of an unsigned task is looked at further
            integrity.check_task(task, secret)
            problems = task_problems(task, settings)
        except integrity.IntegrityError as exc:
            problems = [str(exc)]
        TASKS.add(1, {"kind": task.kind if not problems else "", "outcome": "refused" if problems else "taken"})
        if problems:
            raise bus.Reject(f"task {task.id!r}: " + "; ".join(problems))
        if is_heldout(task):
            raise bus.Reject(f"task {task.id!r} is held out (split {task.split!r}): it is never sampled for "
                             "training; the evaluator scores held-out tasks through Generator.Generate")
        group_id = group_id_for(task.id, f"{incoming.topic}/{incoming.partition}@{incoming.offset}")
        if not envs.is_environment(task):
            too_long = batcher.backend.too_long(render_prompt(task), params.max_tokens)
            if too_long:
                TASKS.add(1, {"kind": task.kind, "outcome": "refused"})
                raise bus.Reject(f"task {task.id!r}: {too_long}")
        if envs.is_environment(task):
            return await episodes.start(task, group_id, batcher, params, settings=settings, generator_id=generator_id)
        completions, version, ms = await batcher.sample(render_prompt(task), task.group_size, params,
                                                        min_version=task.min_policy_version)
        group = rollout_group(task, group_id, completions, params, policy_version=version,
                              backend=batcher.backend.name, generator_id=generator_id, sample_ms=ms)
        return [bus.Outgoing("rollouts", group, key=group_id)]

    return handle


class CheckpointVerifier:
    """Fetches a policy's checkpoint (transfer.verify: into a local cache when remote) and checks it
    against its hash, off the event loop. The loader and the judge of one generator ask for the same
    version at about the same time: they share one check, in flight or finished less than `reuse_s`
    ago. A check that failed is not kept (a transient error is tried again next time)."""

    def __init__(self, settings: Settings, reuse_s: float = 60.0):
        self.cache_dir = settings.home / "cache" / "checkpoints"
        self.storage_options = dict(settings.checkpoint_storage_options)
        self.reuse_s = reuse_s
        self._checks: dict[tuple[str, str], tuple[asyncio.Future, float]] = {}  # -> (check, started)

    async def verify(self, uri: str, sha256: str) -> str:
        """The local folder holding the checkpoint, as a path; transfer.ChecksumMismatch if it does not match."""
        now = asyncio.get_running_loop().time()
        self._checks = {k: (f, t) for k, (f, t) in self._checks.items()
                        if not f.done() or (now - t < self.reuse_s and not f.cancelled() and f.exception() is None)}
        key = (uri, sha256)
        if key not in self._checks:
            check = asyncio.ensure_future(asyncio.to_thread(
                transfer.verify, uri, sha256, self.cache_dir, self.storage_options))
            self._checks[key] = (check, now)
        return str(await asyncio.shield(self._checks[key][0]))


def policy_problem(settings: Settings, policy: policy_pb2.PolicyVersion) -> str | None:
    """Why this generator can never load the version, judged from the message alone; None when it may."""
    if policy.run_id != settings.run_id:
        return (f"policy version {policy.version} belongs to run {policy.run_id!r}, "
                f"not to this generator's run {settings.run_id!r}")
    if not policy.checkpoint_uri:
        return f"policy version {policy.version} has no checkpoint_uri"
    if not policy.checkpoint_sha256:
        return f"policy version {policy.version} has no checkpoint_sha256: its checkpoint cannot be verified"
    try:  # only the run's learner publishes versions: a forged one (say 1,000,000) is never believed
        integrity.check_policy(policy, integrity.key(settings))
    except integrity.IntegrityError as exc:
        return str(exc)
    return None


def policy_handler(settings: Settings, batcher: Batcher, verifier: CheckpointVerifier):
    """The loader: every version of the policy topic reaches every generator. A version of this run
    newer than what the batcher holds or has checked is offered; the batcher checks its hash beside
    sampling and swaps it in between batches. What it refuses is logged here, not dead-lettered:
    the judge (policy_judge) does that, once for all generators."""

    async def handle(incoming: bus.Incoming):
        policy = incoming.message
        problem = policy_problem(settings, policy)
        if problem:
            raise bus.Reject(problem)
        uri, sha256 = policy.checkpoint_uri, policy.checkpoint_sha256
        if not batcher.offer_weights(policy.version, uri, functools.partial(verifier.verify, uri, sha256)):
            raise bus.Reject(f"policy version {policy.version} is not newer than version {batcher.newest_version} "
                             "held or pending here")
        return []

    return handle


def policy_judge(settings: Settings, verifier: CheckpointVerifier):
    """The judge: one generator at a time (a consumer group all generators share) decides, for the
    dead-letter queue, whether a PolicyVersion is acceptable: of this run, with a URI and a hash, newer
    than the newest version of the run it accepted before (a re-announcement of that same checkpoint is
    fine), and whose fetched checkpoint hashes to what it says. A refusal reaches crucible.policy.dlq
    once, not once per generator. The newest accepted version is remembered per process: right after
    the judge moves to another generator, an older version may pass here (every loader still refuses it)."""
    newest: dict[str, tuple[int, str, str]] = {}

    async def handle(incoming: bus.Incoming):
        policy = incoming.message
        problem = policy_problem(settings, policy)
        if problem:
            raise bus.Reject(problem)
        this = (policy.version, policy.checkpoint_uri, policy.checkpoint_sha256)
        before = newest.get(policy.run_id)
        if before is not None and before[0] >= policy.version:
            if this == before:
                return []  # the learner announcing its current version again (a restart)
            raise bus.Reject(f"policy version {policy.version} is not newer than version {before[0]} "
                             f"already published for run {policy.run_id!r}")
        try:
            await verifier.verify(policy.checkpoint_uri, policy.checkpoint_sha256)
        except (transfer.ChecksumMismatch, FileNotFoundError) as exc:
            raise bus.Reject(f"policy version {policy.version}: {exc}") from exc
        newest[policy.run_id] = this
        return []

    return handle


async def run(settings: Settings, stop: asyncio.Event) -> None:
    generator_id = f"{socket.gethostname()}-{os.getpid()}"
    await bus.ensure_topics(["tasks", "rollouts", "policy", "actions", "observations", "episodes"], settings=settings)
    backend = await asyncio.to_thread(build_backend, settings)
    log.info("backend %s ready at policy version %d", backend.name, backend.version)
    batcher = Batcher(backend, max_tasks=settings.generator_batch_tasks, wait_ms=settings.generator_batch_wait_ms,
                      lag=LagBound(settings.max_policy_lag, settings.groups_a_step_may_take()))
    batcher.start()

    def policy_gauges(options):  # the version sampled with, and how many groups wait for a newer one
        from opentelemetry.metrics import Observation

        yield Observation(batcher.backend.version, {"measure": "policy_version"})
        yield Observation(batcher.lag.waiting, {"measure": "waiting_for_policy"})
        yield Observation(batcher.lag.groups_at_version, {"measure": "groups_at_version"})

    metrics.gauge("crucible.generator.policy", policy_gauges, "the policy version sampled with, and the lag bound")
    server = rpc.RpcServer([rpc.Service("crucible.v1.Generator", GeneratorServicer(settings, batcher, generator_id),
                                        generator_pb2_grpc.add_GeneratorServicer_to_server)],
                           host=settings.grpc_host, port=settings.generator_grpc_port,
                           depends_on=service.dependencies(settings))
    async with bus.Producer(settings) as producer, server:
        # Sampling is not repeatable: what a task or an observation leads to is published, and the
        # record consumed, in one Kafka transaction (exactly once, across kill -9 and restarts).
        tasks = bus.Consumer(["tasks"], settings.consumer_group_prefix + "generator",
                             task_handler(settings, batcher, generator_id), settings=settings,
                             concurrency=settings.generator_batch_tasks * 2, transactional=True)
        turns = bus.Consumer(["observations"], settings.consumer_group_prefix + "generator-turns",
                             episodes.continue_handler(settings, batcher, sampling_params(settings)),
                             settings=settings, concurrency=settings.generator_batch_tasks * 8, transactional=True)
        verifier = CheckpointVerifier(settings)
        # Every generator must see every policy version: no group, every partition from the beginning
        # (the newest version of the run is the one loaded). It dead-letters nothing...
        policy = bus.Consumer(["policy"], None, policy_handler(settings, batcher, verifier), settings=settings,
                              producer=producer, offsets={"policy": {}}, dead_letters=False)
        # ...the judge does, in one group for all generators: each refused version reaches the DLQ once.
        judge = bus.Consumer(["policy"], settings.consumer_group_prefix + "generator-policy",
                             policy_judge(settings, verifier), settings=settings, producer=producer)
        async with tasks, turns, policy, judge:
            await catch_up(policy, batcher)
            await service.run_until(stop, tasks.run(), turns.run(), policy.run(), judge.run())
    await batcher.stop()


async def catch_up(policy: bus.Consumer, batcher: Batcher, timeout_s: float = 30.0) -> None:
    """A (re)started generator reads every version published so far, and readies the newest, before
    it takes a task: otherwise its first batch is sampled with old weights and dropped as stale."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline and not await policy.at_end():
        try:
            await asyncio.wait_for(policy.run(max_records=1), max(0.1, deadline - loop.time()))
        except asyncio.TimeoutError:
            break
    await batcher.settle(max(0.1, deadline - loop.time()))


async def main() -> None:
    settings = service.setup("generator")
    await run(settings, service.stop_event())


if __name__ == "__main__":
    asyncio.run(main())
