"""python -m crucible.services.learner: crucible.trajectories -> policy steps -> checkpoints + crucible.policy + ClickHouse."""
from __future__ import annotations

import asyncio

from crucible.services.learner.loop import Learner, build_trainer
from crucible.services.learner.servicer import LearnerServicer
from crucible.shared import bus, rpc, service, store
from crucible.shared.settings import Settings
from crucible.v1 import policy_pb2_grpc


async def run(settings: Settings, stop: asyncio.Event, *, servicer: LearnerServicer | None = None):
    await bus.ensure_topics(["trajectories", "policy", "alerts"], settings=settings)
    client = await asyncio.to_thread(store.connect, settings)
    await asyncio.to_thread(store.migrate, client)
    trainer, meta = await asyncio.to_thread(build_trainer, settings)
    servicer = servicer or LearnerServicer(settings.run_id)
    async with bus.Producer(settings) as producer:
        learner = Learner(settings, client, producer, trainer, meta, on_publish=servicer.publish)
        await learner.run(stop)
    return trainer


async def main() -> None:
    settings = service.setup("learner")
    servicer = LearnerServicer(settings.run_id)
    server = rpc.RpcServer([rpc.Service("crucible.v1.Learner", servicer, policy_pb2_grpc.add_LearnerServicer_to_server)],
                           host=settings.grpc_host, port=settings.learner_grpc_port,
                           depends_on=service.dependencies(settings, store=True))
    async with server:
        await run(settings, service.stop_event(), servicer=servicer)


if __name__ == "__main__":
    asyncio.run(main())
