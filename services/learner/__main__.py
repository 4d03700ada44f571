"""python -m crucible.services.learner: crucible.trajectories -> policy steps -> checkpoints + crucible.policy + ClickHouse.

Under torchrun (`torchrun --nproc-per-node N -m crucible.services.learner`) the processes are the
ranks of one learner: rank 0 is the service, the others take each step with it (ranks.py).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal

from crucible.services.learner import checkpoints
from crucible.services.learner.loop import Learner, build_trainer
from crucible.services.learner.ranks import Ranks
from crucible.services.learner.servicer import LearnerServicer
from crucible.shared import bus, rpc, service, store
from crucible.shared.settings import Settings, get_settings
from crucible.v1 import policy_pb2_grpc


async def run(settings: Settings, stop: asyncio.Event, *, servicer: LearnerServicer | None = None,
              ranks: Ranks | None = None):
    await bus.ensure_topics(["trajectories", "policy", "alerts"], settings=settings)
    client = await asyncio.to_thread(store.connect, settings)
    await asyncio.to_thread(store.migrate, client)
    trainer, meta = await asyncio.to_thread(build_trainer, settings, ranks)
    servicer = servicer or LearnerServicer(settings.run_id)
    async with bus.Producer(settings) as producer:
        learner = Learner(settings, client, producer, trainer, meta, on_publish=servicer.publish)
        await learner.run(stop)
    return trainer


def follow(settings: Settings, ranks: Ranks) -> None:
    """A rank other than 0: no bus, no store, no server; the same steps as rank 0, on its share."""
    trainer, meta = build_trainer(settings, ranks)
    # After each step, this rank's part in the checkpoint rank 0 writes (a gather, its optimiser shard).
    trainer.follow(lambda: checkpoints.save(settings, trainer, {}, [], meta["reference_uri"]))
    logging.getLogger("crucible.learner").info("rank %d stopped with rank 0 at version %d", ranks.rank,
                                               trainer.version)


async def follow_on_another_machine(settings: Settings, ranks: Ranks) -> None:
    """The first rank of a machine other than rank 0's also answers gRPC health on the learner's port,
    so its pod is ready while its ranks run (k8s: the learner StatefulSet's readiness probe)."""
    async with rpc.RpcServer([], host=settings.grpc_host, port=settings.learner_grpc_port):
        await asyncio.to_thread(follow, settings, ranks)


async def main() -> None:
    settings = get_settings()
    ranks = Ranks.from_env(settings.learner_sharding, settings.learner_collective_timeout_s)
    try:
        if not ranks.main:
            # It stops when rank 0 says so (a SIGTERM from the launcher reaches rank 0 too, which tells it).
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            service.configure_logging(f"learner[{ranks.rank}]", settings.log_level)
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:
                await follow_on_another_machine(settings, ranks)
            else:
                follow(settings, ranks)
            return
        settings = service.setup("learner")
        servicer = LearnerServicer(settings.run_id)
        server = rpc.RpcServer([rpc.Service("crucible.v1.Learner", servicer,
                                            policy_pb2_grpc.add_LearnerServicer_to_server)],
                               host=settings.grpc_host, port=settings.learner_grpc_port,
                               depends_on=service.dependencies(settings, store=True))
        async with server:
            await run(settings, service.stop_event(), servicer=servicer, ranks=ranks)
    finally:
        ranks.close()


if __name__ == "__main__":
    asyncio.run(main())
