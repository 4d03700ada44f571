"""The chDB engine behind the store: a small pool of sessions over one data directory.

A ClickHouse server gives every HTTP request a fresh context: its own current database and
settings, nothing left over from the previous request. chDB sessions on the same directory are
independent contexts over the same tables (verified: a SET in one is invisible in another, and
they run queries in parallel with the GIL released), so the store keeps a few of them and treats
each as a reusable per-request context:

* a request's settings are applied with SET before it runs; a session whose applied settings are
  not a subset of the next request's is thrown away and replaced (chDB has no way to unset a
  setting, and a fresh session costs ~0.2 ms);
* any statement that can change session state (SET, USE, temporary tables, DDL...) retires its
  session afterwards, so nothing leaks from one request into another.

Results are materialised before they are returned; the HTTP layer sends them after the session is
back in the pool, so a slow reader never holds an engine session.
"""
from __future__ import annotations

import logging
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from crucible.shared.store import sqltext
from crucible.local.store.codecs import Reader
from crucible.local.store.errors import (
    INTO_OUTFILE_NOT_ALLOWED,
    SYNTAX_ERROR,
    TOO_MANY_SIMULTANEOUS_QUERIES,
    UNKNOWN_SETTING,
    StoreError,
)

log = logging.getLogger("crucible.store")

_SETTING_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FORMAT_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
# Output "formats" chDB's Python layer turns into Python objects (pandas, pyarrow) rather than bytes:
# meaningless over HTTP, so refused like any unknown format.
_PYTHON_ONLY_FORMATS = {"dataframe", "arrowtable", "datastore", "debug"}
INSERT_CHUNK = 1 << 20

# chDB's classify_query classes (chdb._chdb.query_class).
READ_ONLY, MUTATING, MUTATING_GLOBAL, CONTROL, UNKNOWN = range(5)


def quote_identifier(name: str) -> str:
    """`name` as a backquoted ClickHouse identifier, safe whatever it contains."""
    return "`" + name.replace("\\", "\\\\").replace("`", "\\`") + "`"


def quote_string(value: str) -> str:
    """`value` as a single-quoted ClickHouse string literal, safe whatever it contains."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


@dataclass
class Outcome:
    """What one statement produced: the result bytes (if it has a result) and the counters for X-ClickHouse-Summary."""

    body: bytes = b""
    format: str | None = None  # set only for statements that produce a result set
    read_rows: int = 0
    read_bytes: int = 0
    written_rows: int = 0
    written_bytes: int = 0
    result_rows: int = 0
    elapsed_s: float = 0.0

    def summary(self) -> dict[str, str]:
        # ClickHouse sends every counter as a string.
        return {
            "read_rows": str(self.read_rows),
            "read_bytes": str(self.read_bytes),
            "written_rows": str(self.written_rows),
            "written_bytes": str(self.written_bytes),
            "total_rows_to_read": str(self.read_rows),
            "result_rows": str(self.result_rows if self.format else self.written_rows),
            "result_bytes": str(len(self.body) if self.format else self.written_bytes),
            "elapsed_ns": str(int(self.elapsed_s * 1e9)),
        }


@dataclass
class Context:
    """The per-request part of a ClickHouse context: database, settings, query parameters."""

    database: str = "default"
    settings: dict[str, str] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    default_format: str = "TabSeparated"


class _Slot:
    """One chDB session plus what has been applied to it; reset() swaps in a fresh session."""

    def __init__(self, open_session):
        self._open = open_session
        self.session = open_session()
        self.database = "default"
        self.settings: dict[str, str] = {}
        self.retire = False

    def close(self) -> None:
        try:
            self.session.close()
        except Exception:  # closing a broken session must not take the request down with it
            log.exception("closing a chDB session failed")

    def reset(self) -> None:
        """A clean context: close this session and open a new one on the same directory."""
        self.retire = True  # stays set if opening the new session fails
        self.close()
        self.session = self._open()
        self.database = "default"
        self.settings = {}
        self.retire = False

    def raw(self):
        # classify_query lives on the engine connection object under the public wrappers
        # (Session -> Connection -> _chdb.connect); there is no public accessor for it.
        return self.session._conn._conn


class Engine:
    """Runs queries and inserts against one chDB data directory with `sessions` concurrent sessions."""

    def __init__(self, data_dir: Path, sessions: int = 4, acquire_timeout: float = 300.0):
        import chdb.session  # imported here so that merely importing the store package does not load chDB

        if "?" in str(data_dir):
            raise ValueError(f"the data directory path must not contain '?': {data_dir}")
        self._session_cls = chdb.session.Session
        self._path = str(Path(data_dir).resolve())
        self._acquire_timeout = acquire_timeout
        self._idle: queue.LifoQueue[_Slot] = queue.LifoQueue()
        self._open_lock = threading.Lock()
        self._closed = False
        first = _Slot(self._open_session)
        info = first.session.query(
            "SELECT version(), timezone(), getSetting('enable_http_compression')", "TabSeparated"
        ).bytes().decode()
        self.version, self.timezone, compression = info.rstrip("\n").split("\t")
        # A server compresses responses when the client accepts it unless this setting says no;
        # its default differs between ClickHouse versions, so take the engine's.
        self.http_compression_default = compression.strip().lower() in ("1", "true")
        self._idle.put(first)
        for _ in range(max(1, sessions) - 1):
            self._idle.put(_Slot(self._open_session))

    # -- session pool --------------------------------------------------------------------------

    def _open_session(self):
        with self._open_lock:
            if self._closed:
                raise _shutting_down()
            return self._session_cls(self._path)

    def _acquire(self) -> _Slot:
        if self._closed:
            raise _shutting_down()
        try:
            slot = self._idle.get(timeout=self._acquire_timeout)
        except queue.Empty:
            raise StoreError(
                TOO_MANY_SIMULTANEOUS_QUERIES,
                f"no engine session became free within {self._acquire_timeout:.0f} s; "
                "too many long queries are running at once",
                http_status=503,
            ) from None
        if slot is _CLOSED:
            self._idle.put(_CLOSED)  # wake the next waiter too
            raise _shutting_down()
        return slot

    def _release(self, slot: _Slot) -> None:
        if self._closed:
            slot.close()
            return
        if slot.retire:
            try:
                slot.reset()
            except StoreError:
                slot.close()
                return  # shutting down
            except Exception:
                log.exception("cannot open a replacement chDB session; the pool is one session smaller")
                slot.close()
                return
        self._idle.put(slot)

    def close(self) -> None:
        """Refuse new work and close the idle sessions; a session still running a query is closed
        when that query returns it (closing it under a running query is not safe)."""
        with self._open_lock:
            self._closed = True
        while True:
            try:
                slot = self._idle.get_nowait()
            except queue.Empty:
                break
            if slot is not _CLOSED:
                slot.close()
        self._idle.put(_CLOSED)  # requests blocked in _acquire wake up and get a 503

    # -- per-request context -----------------------------------------------------------------

    def _prepare(self, slot: _Slot, ctx: Context) -> None:
        """Bring slot to ctx's database and settings, starting from a fresh session if it has
        settings this request does not want (chDB cannot unset a setting)."""
        if slot.retire or any(ctx.settings.get(k) != v for k, v in slot.settings.items()):
            slot.reset()
        missing = {k: v for k, v in ctx.settings.items() if slot.settings.get(k) != v}
        if missing:
            for name in missing:
                if not _SETTING_NAME_RE.fullmatch(name):
                    raise StoreError(UNKNOWN_SETTING, f"Setting name {name!r} is not a valid identifier")
            # readonly goes last: once it is 1 or 2 the session refuses to change it again.
            ordered = sorted(missing.items(), key=lambda kv: kv[0] == "readonly")
            statement = "SET " + ", ".join(f"{k} = {quote_string(v)}" for k, v in ordered)
            try:
                slot.session.query(statement, "TabSeparated")
            except Exception as ex:
                slot.retire = True  # some of the settings may have been applied
                raise StoreError.from_engine(str(ex)) from None
            slot.settings.update(missing)
        if ctx.database != slot.database:
            try:
                slot.session.query(f"USE {quote_identifier(ctx.database)}", "TabSeparated")
            except Exception as ex:
                raise StoreError.from_engine(str(ex)) from None
            slot.database = ctx.database

    # -- execution ---------------------------------------------------------------------------

    def query(self, sql: str, ctx: Context) -> Outcome:
        """Run one SQL statement (anything but an INSERT with inline data) and return its result."""
        if sqltext.is_blank(sql):
            raise StoreError(SYNTAX_ERROR, "Empty query")
        fmt = _check_format(ctx.default_format)
        slot = self._acquire()
        try:
            self._prepare(slot, ctx)
            try:
                info = slot.raw().classify_query(sql)
                statements, qclass = int(info["statement_count"]), int(info["query_class"])
            except Exception:  # classification is advisory; the engine still parses the query itself
                log.debug("classify_query failed", exc_info=True)
                statements, qclass = 1, UNKNOWN
            if statements > 1:
                raise StoreError(SYNTAX_ERROR, "Syntax error (Multi-statements are not allowed)")
            if qclass != READ_ONLY:
                slot.retire = True  # it may change session state (SET, USE, temporary tables...)
            if qclass == CONTROL and sqltext.writes_outfile(sql):
                raise StoreError(
                    INTO_OUTFILE_NOT_ALLOWED,
                    "INTO OUTFILE is not allowed over HTTP: the file would be written on the store's disk",
                )
            started = time.perf_counter()
            try:
                result = slot.session.query(sql, fmt, params=ctx.params)
            except Exception as ex:
                slot.retire = True
                raise StoreError.from_engine(str(ex)) from None
            elapsed = time.perf_counter() - started
            produces_result = qclass == READ_ONLY
            return Outcome(
                body=result.bytes(),
                format=(sqltext.explicit_format(sql) or fmt) if produces_result else None,
                read_rows=result.storage_rows_read(),
                read_bytes=result.storage_bytes_read(),
                written_rows=result.rows_written(),
                written_bytes=result.bytes_written(),
                result_rows=result.rows_read(),
                elapsed_s=elapsed,
            )
        finally:
            self._release(slot)

    def insert(self, statement: str, fmt: str, data: Reader | Iterable[bytes], ctx: Context) -> Outcome:
        """Stream rows in input format fmt into `statement` (an INSERT without its FORMAT clause).

        data is read in 1 MiB pieces and appended to a chDB streaming insert, which is cancelled if
        anything fails. As on a ClickHouse server, an insert larger than one block
        (max_insert_block_size rows) is not atomic: blocks committed before a bad row stay. The HTTP
        layer receives the whole body before calling this, so a broken upload commits nothing.
        """
        _check_format(fmt)
        chunks = _chunks(data)
        slot = self._acquire()
        try:
            self._prepare(slot, ctx)
            started = time.perf_counter()
            try:
                inserter = slot.session.send_insert(statement, fmt)
            except Exception as ex:
                slot.retire = True
                raise StoreError.from_engine(str(ex)) from None
            try:
                for chunk in chunks:
                    if chunk:
                        inserter.append(chunk)
                result = inserter.finish()
            except BaseException as ex:
                slot.retire = True
                try:
                    inserter.cancel()
                except Exception:
                    log.exception("cancelling a failed insert failed")
                if isinstance(ex, StoreError):
                    raise
                if isinstance(ex, Exception):
                    raise StoreError.from_engine(str(ex)) from None
                raise
            return Outcome(
                written_rows=result.rows_written,
                written_bytes=result.bytes_written,
                elapsed_s=time.perf_counter() - started,
            )
        finally:
            self._release(slot)


_CLOSED = object()  # sentinel in the idle queue once the engine is closed


def _shutting_down() -> StoreError:
    return StoreError(TOO_MANY_SIMULTANEOUS_QUERIES, "the store is shutting down; retry against the next one", http_status=503)


def _chunks(data: Reader | Iterable[bytes]) -> Iterable[bytes]:
    if hasattr(data, "read"):
        def gen():
            while chunk := data.read(INSERT_CHUNK):
                yield chunk
        return gen()
    return data


def _check_format(fmt: str) -> str:
    if not _FORMAT_NAME_RE.fullmatch(fmt) or fmt.lower() in _PYTHON_ONLY_FORMATS:
        raise StoreError(73, f"Unknown format {fmt!r}", name="UNKNOWN_FORMAT")
    return fmt


__all__ = ["Engine", "Context", "Outcome", "quote_identifier", "quote_string"]
