"""Store fixtures: one real store process per test session, one fresh database per test.

Set CRUCIBLE_TEST_CLICKHOUSE_URL (e.g. http://default:@127.0.0.1:8123) to run the same tests
against a ClickHouse server you already have instead of a spawned store.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from crucible.shared.settings import Settings
from crucible.shared.store.client import connect
from crucible.local.store.launcher import free_port, log_tail, spawn_store, stop_store, wait_ready

EXTERNAL_URL_ENV = "CRUCIBLE_TEST_CLICKHOUSE_URL"


def external_clickhouse_url() -> str | None:
    return os.environ.get(EXTERNAL_URL_ENV) or None


class StoreProcess:
    """A store process started for a test, stopped (and its exit status kept) by stop()."""

    def __init__(
        self, data_dir: Path, port: int | None = None, log_path: Path | None = None, extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
    ):
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or self.data_dir.parent / f"store-{self.port}.log"
        self.proc = spawn_store(self.data_dir, port=self.port, log_path=self.log_path, extra_args=extra_args, env=env)
        self.returncode: int | None = None

    def wait_ready(self, timeout: float = 60.0) -> StoreProcess:
        wait_ready(self.url, timeout=timeout, proc=self.proc)
        return self

    def stop(self) -> int:
        self.returncode = stop_store(self.proc)
        return self.returncode

    def log(self) -> str:
        return log_tail(self.proc, lines=200)


@pytest.fixture(scope="session")
def store_url(tmp_path_factory) -> str:
    """URL of the session's ClickHouse endpoint: a spawned store, or CRUCIBLE_TEST_CLICKHOUSE_URL."""
    external = external_clickhouse_url()
    if external:
        yield external
        return
    store = StoreProcess(tmp_path_factory.mktemp("store") / "data").wait_ready()
    try:
        yield store.url
    finally:
        code = store.stop()
        if code != 0:
            raise AssertionError(f"the session store exited with status {code}; log tail:\n{store.log()}")


@pytest.fixture
def store_database() -> str:
    """A database name no other test uses."""
    return f"test_{uuid.uuid4().hex[:12]}"


@pytest.fixture
def store_client(store_url, store_database):
    """A clickhouse-connect client bound to a fresh database, dropped after the test."""
    client = connect(Settings(), url=store_url, database=store_database)
    try:
        yield client
    finally:
        try:
            client.command(f"DROP DATABASE IF EXISTS `{store_database}`")
        finally:
            client.close()


@pytest.fixture
def spawned_store(tmp_path):
    """Start store processes on directories of the test's choosing; all are stopped at the end."""
    if external_clickhouse_url():
        pytest.skip(f"needs its own store process ({EXTERNAL_URL_ENV} is set)")
    started: list[StoreProcess] = []

    def start(data_dir: Path | None = None, wait: bool = True, extra_args: list[str] | None = None,
              env: dict[str, str] | None = None) -> StoreProcess:
        store = StoreProcess(
            data_dir or tmp_path / "data", log_path=tmp_path / f"store-{len(started)}.log", extra_args=extra_args,
            env=env,
        )
        started.append(store)
        return store.wait_ready() if wait else store

    yield start
    for store in started:
        if store.proc.poll() is None:
            store.stop()
