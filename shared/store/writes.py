"""Writes that survive a store outage: the one way services insert rows.

A store that does not answer (restarting, a network blip) is retried with growing pauses, 0.2 s up
to 5 s apart, for up to `patience_s`; meanwhile the caller waits, so the record it holds stays
uncommitted on the bus and nothing is lost. A store that answers and refuses the rows (a schema
error) is not retried. Every table is a ReplacingMergeTree keyed on the row's identity, so a retry of
an insert that had in fact landed leaves one row (read with FINAL).
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger("crucible.store")
PATIENCE_S = 300.0


def transient(exc: BaseException) -> bool:
    """Whether the store failed to answer (retry) rather than refused the request (do not)."""
    from clickhouse_connect.driver.exceptions import OperationalError

    return isinstance(exc, (OperationalError, ConnectionError, TimeoutError, OSError))


def insert(client, table: str, rows: list, column_names: list[str], *, patience_s: float = PATIENCE_S) -> None:
    delay, deadline, failures = 0.2, time.monotonic() + patience_s, 0
    while True:
        try:
            client.insert(table, rows, column_names=column_names)
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
