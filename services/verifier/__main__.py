"""python -m services.verifier: crucible.executions + answer-only crucible.rollouts -> crucible.verdicts, gRPC Verifier."""
from __future__ import annotations

import asyncio
import logging
import signal

from crucible.v1 import verdict_pb2_grpc
from services.verifier.consumer import TOPICS, verdict_handler
from services.verifier.scorer_pool import ScorerPool
from services.verifier.servicer import VerifierServicer
from shared import bus, rpc, telemetry
from shared.settings import get_settings

log = logging.getLogger("crucible.verifier")


async def main() -> None:
    settings = get_settings()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s verifier %(levelname)s %(message)s")
    telemetry.setup_telemetry("verifier", settings)
    await bus.ensure_topics([*TOPICS, "verdicts"], settings=settings)
    async with ScorerPool(settings) as scorer:
        servicer = VerifierServicer(scorer, settings.verifier_sandbox_target)
        server = rpc.RpcServer([rpc.Service("crucible.v1.Verifier", servicer,
                                            verdict_pb2_grpc.add_VerifierServicer_to_server)],
                               host=settings.grpc_host, port=settings.verifier_grpc_port)
        consumer = bus.Consumer(TOPICS, settings.consumer_group_prefix + "verifier", verdict_handler(scorer),
                                settings=settings, concurrency=scorer.size * 2)
        log.info("scoring with %d processes, %gs limit each", scorer.size, scorer.timeout_s)
        async with server, consumer:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            runner = asyncio.create_task(consumer.run())
            await stop.wait()
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
        await servicer.close()


if __name__ == "__main__":
    asyncio.run(main())
