"""python -m crucible.services.sandbox_executor: the jail pool behind gRPC Sandbox and crucible.rollouts -> crucible.executions."""
from __future__ import annotations

import argparse
import asyncio
import logging
import socket

from crucible.v1 import execution_pb2_grpc
from crucible.services.sandbox_executor.handler import execution_message, job_for_rollout, needs_execution
from crucible.services.sandbox_executor.pool import JobRejected, PoolFull, SandboxPool
from crucible.services.sandbox_executor.servicer import SandboxServicer
from crucible.shared import bus, rpc, service

log = logging.getLogger("crucible.sandbox")


def rollout_handler(pool: SandboxPool, consumer_ref: list, executor_id: str):
    async def handle(incoming: bus.Incoming):
        rollout = incoming.message
        if not needs_execution(rollout):
            return []  # answer-only kinds go straight from rollouts to the verifier
        try:
            job = job_for_rollout(rollout)
        except ValueError as exc:
            raise bus.Reject(f"rollout {rollout.id!r}: {exc}") from exc
        while True:
            try:
                result = await pool.execute(job)
                break
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
            except JobRejected as exc:
                raise bus.Reject(f"rollout {rollout.id!r}: {exc}") from exc
        return [bus.Outgoing("executions", execution_message(rollout, result, executor_id), key=rollout.group_id)]

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
        handler = rollout_handler(pool, consumer_ref, f"{socket.gethostname()}/sandbox")
        consumer = bus.Consumer(["rollouts"], settings.consumer_group_prefix + "sandbox-executor", handler,
                                settings=settings, concurrency=pool.size * 2)
        consumer_ref.append(consumer)
        async with server, consumer:
            await service.run_until(service.stop_event(), consumer.run())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m crucible.services.sandbox_executor")
    parser.add_argument("--allow-weak-isolation", action="store_true",
                        help="run even where a primitive is missing (every result names what is missing)")
    asyncio.run(main(parser.parse_args().allow_weak_isolation))
