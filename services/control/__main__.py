"""python -m crucible.services.control: Control gRPC plus the task log (crucible.tasks -> ClickHouse `tasks`)."""
from __future__ import annotations

import asyncio
import logging

from crucible.v1 import control_pb2_grpc
from crucible.services.control.handler import TASK_COLUMNS, task_row
from crucible.services.control.servicer import ControlServicer
from crucible.shared import bus, rpc, service, store, telemetry
from crucible.shared.settings import Settings
from crucible.shared.store import writes

log = logging.getLogger("crucible.control")
CONCURRENT_TASKS = 100  # records of a fetched batch recorded together (one insert)
# How long a task's row waits for others' before they are inserted. Each insert is a part the store writes
# and later merges (7-20 ms of its CPU, however few rows): tasks arrive a few at a time (a step's, and
# dynamic sampling's replacements), and at 10 ms they made an insert a step. Nobody waits for the task log
# but this consumer's commit.
ROWS_LINGER_S = 0.5


async def run(settings: Settings, stop: asyncio.Event) -> None:
    await bus.ensure_topics(bus.STANDARD_TOPICS, settings=settings)
    client = await asyncio.to_thread(store.connect, settings)
    applied = await asyncio.to_thread(store.migrate, client)
    if applied:
        log.info("applied migrations %s", applied)

    # The records of a fetched batch are handled together and their rows go to the store in one insert.
    rows = writes.BatchedRows(client, store.TASKS_TABLE, TASK_COLUMNS, linger_s=ROWS_LINGER_S)

    async def record(incoming: bus.Incoming):
        task = incoming.message
        # The log records what trusted code published (a task nobody holding the key signed is skipped:
        # the log is what `crucible rescore --grade-as` signs anew); whether a task is acceptable is
        # decided once, by the generator, which dead-letters the bad ones. A replayed record rewrites the same row
        # (the task log is a ReplacingMergeTree on run and task id).
        await rows.add(task_row(task, telemetry.current_trace_id(), settings.run_id))
        log.info("recorded task %s (%s, group of %d)", task.id, task.kind, task.group_size)

    async with bus.Producer(settings) as producer:
        server = rpc.RpcServer(
            [rpc.Service("crucible.v1.Control", ControlServicer(settings, producer, client),
                         control_pb2_grpc.add_ControlServicer_to_server)],
            host=settings.grpc_host, port=settings.control_grpc_port,
            depends_on=service.dependencies(settings, store=True),
        )
        async with server, bus.Consumer(["tasks"], settings.consumer_group_prefix + "control", record,
                                        settings=settings, producer=producer, dead_letters=False,
                                        trusted=True, concurrency=CONCURRENT_TASKS) as consumer:
            log.info("control ready: gRPC %s, consuming %s", server.address, consumer.topics)
            await service.run_until(stop, consumer.run())
    # Rows still waiting for company when it stopped: written now, or a run that ends here would lack
    # them until the next start reads their uncommitted tasks again.
    await rows.flush()


async def main() -> None:
    settings = service.setup("control")
    await run(settings, service.stop_event())


if __name__ == "__main__":
    asyncio.run(main())
