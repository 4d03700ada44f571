"""Crucible's ClickHouse store: the embedded chDB store process or any ClickHouse server, one client API.

`connect()` returns a clickhouse-connect client bound to Crucible's database; `migrate(client)`
brings the schema up to date. The store process itself is `python -m crucible.local.store.server`.

connect is imported on first use, so that the store process (which imports this package) does not
load clickhouse-connect. migrate is imported eagerly: its module has the same name, and an eager
import is the only way to make `crucible.shared.store.migrate` reliably mean the function.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from crucible.shared.store.migrate import migrate

if TYPE_CHECKING:
    from crucible.shared.store.client import connect

__all__ = ["TASKS_TABLE", "connect", "migrate"]

TASKS_TABLE = "run_tasks"  # the task log, one row a run and task (migration 0012; 0003's `tasks` before it)


def __getattr__(name: str):
    if name == "connect":
        from crucible.shared.store.client import connect

        globals()["connect"] = connect
        return connect
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
