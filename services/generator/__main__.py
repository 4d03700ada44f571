"""python -m crucible.services.generator: crucible.tasks -> crucible.rollouts (one RolloutGroup per task), weights from crucible.policy, gRPC Generator."""
from __future__ import annotations

import asyncio
import logging
import os
import socket

from crucible.v1 import generator_pb2_grpc
from crucible.services.generator.batcher import Batcher, LagBound
from crucible.services.generator.handler import group_id_for, render_prompt, rollout_group
from crucible.services.generator.servicer import GeneratorServicer, sampling_params
from crucible.shared import bus, rpc, service
from crucible.ml.policy.backends import create_backend
from crucible.ml.policy.checkpoint import path_from_uri
from crucible.ml.policy.hf import is_builtin
from crucible.shared.settings import Settings
from crucible.ml.tasks import is_heldout, task_problems

log = logging.getLogger("crucible.generator")


def build_backend(settings: Settings):
    name = settings.generator_backend
    if name == "auto":
        builtin = not settings.init_checkpoint or is_builtin(path_from_uri(settings.init_checkpoint))
        name = "torch" if builtin else "hf"
    options = {"checkpoint": settings.init_checkpoint}
    if name == "torch":
        options["seed"] = settings.seed
    else:
        if not settings.init_checkpoint:
            raise ValueError(f"the {name} backend needs a model: set init_checkpoint (CRUCIBLE_INIT_CHECKPOINT)")
        options.update(chat_template=settings.chat_template, system_prompt=settings.system_prompt)
    return create_backend(name, **options)


def task_handler(settings: Settings, batcher: Batcher, generator_id: str):
    params = sampling_params(settings)

    async def handle(incoming: bus.Incoming):
        task = incoming.message
        problems = task_problems(task, settings)
        if problems:
            raise bus.Reject(f"task {task.id!r}: " + "; ".join(problems))
        if is_heldout(task):
            raise bus.Reject(f"task {task.id!r} is held out (split {task.split!r}): it is never sampled for "
                             "training; the evaluator scores held-out tasks through Generator.Generate")
        completions, version, ms = await batcher.sample(render_prompt(task), task.group_size, params)
        group_id = group_id_for(task.id, f"{incoming.topic}/{incoming.partition}@{incoming.offset}")
        group = rollout_group(task, group_id, completions, params, policy_version=version,
                              backend=batcher.backend.name, generator_id=generator_id, sample_ms=ms)
        return [bus.Outgoing("rollouts", group, key=group_id)]

    return handle


def policy_handler(batcher: Batcher):
    async def handle(incoming: bus.Incoming):
        policy = incoming.message
        if not policy.checkpoint_uri:
            raise bus.Reject(f"policy version {policy.version} has no checkpoint_uri")
        batcher.offer_weights(policy.version, policy.checkpoint_uri)
        return []

    return handle


async def run(settings: Settings, stop: asyncio.Event) -> None:
    generator_id = f"{socket.gethostname()}-{os.getpid()}"
    await bus.ensure_topics(["tasks", "rollouts", "policy"], settings=settings)
    backend = await asyncio.to_thread(build_backend, settings)
    log.info("backend %s ready at policy version %d", backend.name, backend.version)
    batcher = Batcher(backend, max_tasks=settings.generator_batch_tasks, wait_ms=settings.generator_batch_wait_ms,
                      lag=LagBound(settings.max_policy_lag, settings.groups_per_step))
    batcher.start()
    server = rpc.RpcServer([rpc.Service("crucible.v1.Generator", GeneratorServicer(settings, batcher, generator_id),
                                        generator_pb2_grpc.add_GeneratorServicer_to_server)],
                           host=settings.grpc_host, port=settings.generator_grpc_port)
    async with bus.Producer(settings) as producer, server:
        tasks = bus.Consumer(["tasks"], settings.consumer_group_prefix + "generator",
                             task_handler(settings, batcher, generator_id), settings=settings, producer=producer,
                             concurrency=settings.generator_batch_tasks * 2)
        # Every generator instance must see every policy version: a consumer group of its own.
        policy = bus.Consumer(["policy"], f"{settings.consumer_group_prefix}generator-policy-{generator_id}",
                              policy_handler(batcher), settings=settings, producer=producer)
        async with tasks, policy:
            await service.run_until(stop, tasks.run(), policy.run())
    await batcher.stop()


async def main() -> None:
    settings = service.setup("generator")
    await run(settings, service.stop_event())


if __name__ == "__main__":
    asyncio.run(main())
