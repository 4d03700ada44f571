"""Writes that survive a store outage: the one way services insert rows.

A store that does not answer (restarting, a network blip) is retried with growing pauses, 0.2 s up
to 5 s apart, for up to `patience_s`; meanwhile the caller waits, so the record it holds stays
uncommitted on the bus and nothing is lost. A store that answers and refuses the rows (a schema
error) is not retried. Every table is a ReplacingMergeTree keyed on the row's identity, so a retry of
an insert that had in fact landed leaves one row (read with FINAL).

An insert names its columns; their types are asked of the store once per client and table, not before
every insert (clickhouse-connect's `insert` otherwise sends a DESCRIBE TABLE first, which doubled the
requests the store served). `BatchedRows` lets concurrent handlers share one insert.
"""
from __future__ import annotations

import asyncio
import logging
import time
import weakref

log = logging.getLogger("crucible.store")
PATIENCE_S = 300.0
_COLUMN_TYPES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # client -> {(table, columns): types}


def transient(exc: BaseException) -> bool:
    """Whether the store failed to answer (retry) rather than refused the request (do not)."""
    from clickhouse_connect.driver.exceptions import OperationalError

    return isinstance(exc, (OperationalError, ConnectionError, TimeoutError, OSError))


def insert(client, table: str, rows: list, column_names: list[str], *, patience_s: float = PATIENCE_S) -> None:
    delay, deadline, failures = 0.2, time.monotonic() + patience_s, 0
    while True:
        try:
            client.insert(table, rows, column_names=column_names,
                          column_types=column_types(client, table, column_names))
            if failures:
                log.info("store write to %s went through after %d failed attempts", table, failures)
            return
        except Exception as exc:
            if not transient(exc) or time.monotonic() + delay > deadline:
                raise
            failures += 1
            if failures == 1 or failures % 10 == 0:
                log.warning("store write to %s failed (%s); retrying, %.0f s of patience left", table,
                            type(exc).__name__, deadline - time.monotonic())
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def column_types(client, table: str, column_names: list[str]) -> list:
    """The ClickHouse types of `column_names` in `table`, described once per client (the schema is
    migrated before a service starts writing)."""
    known = _COLUMN_TYPES.setdefault(client, {})
    key = (table, tuple(column_names))
    if key not in known:
        known[key] = list(client.create_insert_context(table, column_names).column_types)
    return known[key]


class BatchedRows:
    """One insert for the rows that handlers running at the same time add; each `add` returns once its
    rows are in the store (or raises what the insert raised), so a handler's record is committed on the
    bus only after its rows landed. Rows wait at most `linger_s` for company, or until `max_rows` wait."""

    def __init__(self, client, table: str, column_names: list[str], *, linger_s: float = 0.01,
                 max_rows: int = 1000):
        self.client, self.table, self.column_names = client, table, column_names
        self.linger_s, self.max_rows = linger_s, max_rows
        self._pending: list[tuple[list[list], asyncio.Future]] = []
        self._waiting = 0  # rows in _pending
        self._timer: asyncio.TimerHandle | None = None
        self._writing: set[asyncio.Task] = set()  # held here: the loop keeps only weak references to tasks

    async def add(self, row: list) -> None:
        await self.add_all([row])

    def add_all(self, rows: list[list]) -> asyncio.Future:
        """Adds several rows; the returned future is done once they are all in the store."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        if not rows:
            done.set_result(None)
            return done
        self._pending.append((rows, done))
        self._waiting += len(rows)
        if self._waiting >= self.max_rows:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.linger_s, self._flush)
        return done

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending, self._waiting = self._pending, [], 0
        if batch:
            task = asyncio.ensure_future(self._write(batch))
            self._writing.add(task)
            task.add_done_callback(self._writing.discard)

    async def flush(self) -> None:
        """Writes what waits now, and returns once every insert begun so far has ended."""
        self._flush()
        if self._writing:
            await asyncio.gather(*self._writing, return_exceptions=True)

    async def _write(self, batch: list[tuple[list[list], asyncio.Future]]) -> None:
        try:
            await asyncio.to_thread(insert, self.client, self.table, [row for rows, _ in batch for row in rows],
                                    self.column_names)
        except Exception as exc:  # every waiting handler fails as the insert did
            for _, done in batch:
                if not done.done():
                    done.set_exception(exc)
            return
        for _, done in batch:
            if not done.done():
                done.set_result(None)
