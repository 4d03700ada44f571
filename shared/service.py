"""What every service's `__main__` does the same way: logging, traces, metrics, a stop on SIGTERM/SIGINT."""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Awaitable

from crucible.shared import metrics, telemetry
from crucible.shared.settings import Settings, get_settings
from crucible.shared.text import shown


# Allocations of container objects between two collections of the youngest generation (CPython's
# default is 700). A consumer holds a fetched batch (up to 500 records, a few objects each) while it
# handles it: at 700, collections came every hundred-odd records, found the batch alive, moved it on,
# and traversed it again in the next generation. At 10,000 the bus consumer took 6-9% less CPU a
# record and bare aiokafka in the same process none (`bench/bench_kafka.py`, which runs its readers
# with this setting too). The cost is garbage with cycles living a little longer, a few MB at most.
GC_YOUNG_THRESHOLD = 10_000


def tune_gc() -> None:
    """The collector's setting every service process runs with (GC_YOUNG_THRESHOLD)."""
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


class OneLineFormatter(logging.Formatter):
    """A log record's message as one line: the keys, reasons and texts it quotes come from whoever wrote
    a record or a task (a record's key with line breaks in it wrote whole log lines of the service's
    own, in its format), so its line breaks and every character a terminal acts on are written as
    escapes. A traceback after it keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = shown(record.message)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:  # noqa: N802 (logging's name)
        """A traceback's lines, each indented: an exception's text (a record's key in it) begins none."""
        return "\n".join("  " + shown(line) for line in super().formatException(ei).splitlines())


def configure_logging(name: str, level: str) -> None:
    """A service process's log: one line a record (OneLineFormatter), named `name`."""
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter(f"%(asctime)s {name} %(levelname)s %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])


def setup(name: str) -> Settings:
    """Settings for the service `name`, with logging and OpenTelemetry configured for it."""
    settings = get_settings()
    tune_gc()
    if settings.cpu_nice:
        # Before any thread starts (telemetry's exporters, torch's pool, to_thread's workers): each
        # thread takes its priority from the one that started it.
        os.nice(settings.cpu_nice)
    configure_logging(name, settings.log_level)
    telemetry.setup_telemetry(name, settings)
    metrics.setup_metrics(name, settings)
    return settings


def stop_event() -> asyncio.Event:
    """An event set when the process is asked to stop (call from inside the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def run_until(stop: asyncio.Event, *work: Awaitable) -> None:
    """Runs `work` (consumer loops, ...) until `stop` is set, then cancels it and waits for it to end."""
    tasks = [asyncio.ensure_future(w) for w in work]
    waiter = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
    for task in tasks:
        if task in done and task.exception() is not None:
            waiter.cancel()
            raise task.exception()  # a loop that died on its own must take the service down, loudly
    for task in [waiter, *tasks]:
        task.cancel()
    await asyncio.gather(waiter, *tasks, return_exceptions=True)


def dependencies(settings: Settings, *, store: bool = False) -> list[tuple[str, str]]:
    """What a service cannot work without, for its readiness (rpc.RpcServer `depends_on`): the broker,
    and the store for those that write to it."""
    return [("kafka", settings.kafka_bootstrap)] + ([("store", settings.clickhouse_url)] if store else [])
