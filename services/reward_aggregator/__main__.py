"""python -m services.reward_aggregator: crucible.verdicts -> crucible.trajectories + ClickHouse `trajectories`."""
from __future__ import annotations

import asyncio
import logging
import signal

from services.reward_aggregator.app import Aggregator
from shared import bus, store, telemetry
from shared.settings import Settings, get_settings

log = logging.getLogger("crucible.aggregator")


async def prepare(settings: Settings):
    """Topics must exist before faust subscribes (it ignores missing ones); the store gets its schema."""
    await bus.ensure_topics(["verdicts", "trajectories", "alerts", "aggregator.expire"], settings=settings)
    client = await asyncio.to_thread(store.connect, settings)
    await asyncio.to_thread(store.migrate, client)
    return client


async def run(settings: Settings, stop: asyncio.Event, **options) -> Aggregator:
    client = await prepare(settings)
    aggregator = Aggregator(settings, client, **options)
    await aggregator.app.start()
    log.info("reward-aggregator ready (%s advantages, group timeout %.0fs)", settings.aggregator_estimator,
             settings.aggregator_group_timeout_s)
    try:
        await stop.wait()
    finally:
        await aggregator.app.stop()
    return aggregator


async def main() -> None:
    settings = get_settings()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s aggregator %(levelname)s %(message)s")
    telemetry.setup_telemetry("reward-aggregator", settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await run(settings, stop)


if __name__ == "__main__":
    asyncio.run(main())
