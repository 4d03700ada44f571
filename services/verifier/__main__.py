"""python -m crucible.services.verifier: crucible.executions + answer-only crucible.rollouts -> crucible.verdicts, gRPC Verifier."""
from __future__ import annotations

import asyncio
import logging

from crucible.v1 import verdict_pb2_grpc
from crucible.services.verifier.consumer import TOPICS, verdict_handler
from crucible.services.verifier.scorer_pool import ScorerPool
from crucible.services.verifier.servicer import VerifierServicer
from crucible.shared import bus, rpc, service

log = logging.getLogger("crucible.verifier")


async def main() -> None:
    settings = service.setup("verifier")
    await bus.ensure_topics([*TOPICS, "verdicts"], settings=settings)
    async with ScorerPool(settings) as scorer:
        servicer = VerifierServicer(scorer, settings.verifier_sandbox_target)
        server = rpc.RpcServer([rpc.Service("crucible.v1.Verifier", servicer,
                                            verdict_pb2_grpc.add_VerifierServicer_to_server)],
                               host=settings.grpc_host, port=settings.verifier_grpc_port,
                               depends_on=service.dependencies(settings))
        # Verdicts and the records they come from move in one transaction: a replay never sends a
        # verdict twice (the aggregator would otherwise open a second, never-complete group for it).
        consumer = bus.Consumer(TOPICS, settings.consumer_group_prefix + "verifier", verdict_handler(scorer),
                                settings=settings, concurrency=scorer.size * 2, transactional=True)
        log.info("scoring with %d processes, %gs limit each", scorer.size, scorer.timeout_s)
        async with server, consumer:
            await service.run_until(service.stop_event(), consumer.run())
        await servicer.close()


if __name__ == "__main__":
    asyncio.run(main())
