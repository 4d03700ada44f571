"""python -m crucible.services.sandbox_executor: the jail pool behind gRPC Sandbox and crucible.rollouts -> crucible.executions."""
from __future__ import annotations

import argparse
import asyncio
import logging
import socket

from crucible.v1 import execution_pb2_grpc
from crucible.services.sandbox_executor.handler import (
    NothingToRun,
    execution_message,
    job_for_rollout,
    needs_execution,
    not_run_result,
    result_message,
)
from crucible.services.sandbox_executor.pool import JobRejected, PoolFull, SandboxPool
from crucible.services.sandbox_executor.servicer import SandboxServicer
from crucible.shared import bus, rpc, service

log = logging.getLogger("crucible.sandbox")


def group_handler(pool: SandboxPool, consumer_ref: list, executor_id: str):
    """Runs every rollout of a group that needs running, all at once through the pool."""

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

    async def run_one(task, rollout):
        try:
            job = job_for_rollout(task, rollout)
        except NothingToRun as exc:
            return not_run_result(str(exc))
        return result_message(await execute(job))

    async def handle(incoming: bus.Incoming):
        group = incoming.message
        if not needs_execution(group):
            return []  # answer-only kinds go straight from rollouts to the verifier
        try:
            results = await asyncio.gather(*(run_one(group.task, r) for r in group.rollouts))
        except (JobRejected, ValueError) as exc:  # the task asks for something no job can be (its language, ...)
            raise bus.Reject(f"group {group.group_id!r} (task {group.task.id!r}): {exc}") from exc
        return [bus.Outgoing("executions", execution_message(group, results, executor_id), key=group.group_id)]

    return handle


async def main(allow_weak: bool) -> None:
    settings = service.setup("sandbox-executor")
    await bus.ensure_topics(["rollouts", "executions"], settings=settings)
    async with SandboxPool(settings, allow_weak=allow_weak or None) as pool:
        log.info("isolation: %s", pool.report.describe())
        server = rpc.RpcServer([rpc.Service("crucible.v1.Sandbox", SandboxServicer(pool),
                                            execution_pb2_grpc.add_SandboxServicer_to_server)],
                               host=settings.grpc_host, port=settings.sandbox_grpc_port)
        consumer_ref: list = []
        handler = group_handler(pool, consumer_ref, f"{socket.gethostname()}/sandbox")
        consumer = bus.Consumer(["rollouts"], settings.consumer_group_prefix + "sandbox-executor", handler,
                                settings=settings, concurrency=2)
        consumer_ref.append(consumer)
        async with server, consumer:
            await service.run_until(service.stop_event(), consumer.run())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m crucible.services.sandbox_executor")
    parser.add_argument("--allow-weak-isolation", action="store_true",
                        help="run even where a primitive is missing (every result names what is missing)")
    asyncio.run(main(parser.parse_args().allow_weak_isolation))
