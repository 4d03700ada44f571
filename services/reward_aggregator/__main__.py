"""python -m crucible.services.reward_aggregator: crucible.verdicts -> crucible.trajectories + ClickHouse `trajectories`."""
from __future__ import annotations

import asyncio
import logging

from crucible.services.reward_aggregator.app import Aggregator
from crucible.shared import bus, service, store
from crucible.shared.settings import Settings

log = logging.getLogger("crucible.aggregator")


async def prepare(settings: Settings):
    """Topics must exist before faust subscribes (it ignores missing ones); the store gets its schema."""
    await bus.ensure_topics(["verdicts", "trajectories", "alerts", "aggregator.expire"], settings=settings)
    client = await asyncio.to_thread(store.connect, settings)
    await asyncio.to_thread(store.migrate, client)
    return client


async def run(settings: Settings, stop: asyncio.Event, **options) -> Aggregator:
    client = await prepare(settings)
    async with bus.Producer(settings) as producer:
        aggregator = Aggregator(settings, producer, client, **options)
        await aggregator.app.start()
        log.info("reward-aggregator ready (%s advantages, group timeout %.0fs)", settings.estimator,
                 settings.group_timeout_s)
        try:
            waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(aggregator.failed.wait())]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for wait in waits:
                wait.cancel()
            if aggregator.failure is not None:
                raise RuntimeError("the reward-aggregator could not write a batch") from aggregator.failure
            await aggregator.flush()  # rows lingering for company: written, so a normal stop replays nothing
            if aggregator.failure is not None:
                raise RuntimeError("the reward-aggregator could not write a batch") from aggregator.failure
        finally:
            await aggregator.app.stop()
    return aggregator


async def main() -> None:
    settings = service.setup("reward-aggregator")
    await run(settings, service.stop_event())


if __name__ == "__main__":
    asyncio.run(main())
