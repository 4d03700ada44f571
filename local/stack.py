"""The one-machine stack: the local Kafka broker and the chDB store as background processes."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from crucible.local.kafka import LocalKafka
from crucible.local.store.launcher import wait_ready
from crucible.shared import files
from crucible.shared.procs import read_pid, terminate
from crucible.shared.settings import Settings, get_settings, shown_url
from crucible.shared.store import client as store_client


class StackError(RuntimeError):
    pass


@dataclass
class LocalStore:
    """The chDB store process serving ClickHouse's HTTP interface on CRUCIBLE_CLICKHOUSE_URL."""

    root: Path
    host: str = "127.0.0.1"
    port: int = 8123
    user: str = "default"
    password: str = ""  # with one set, the store checks every query's credentials

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> "LocalStore":
        settings = settings or get_settings()
        url = urlparse(settings.clickhouse_url)
        if url.hostname not in ("127.0.0.1", "localhost"):
            raise StackError(f"CRUCIBLE_CLICKHOUSE_URL={shown_url(settings.clickhouse_url)} is not local: "
                             "the embedded store only serves on 127.0.0.1")
        if settings.clickhouse_password is not None:
            password = settings.clickhouse_password.get_secret_value()
        else:  # one of its own, which every client of this CRUCIBLE_HOME reads (store.client.password): without
            # one, any process of the machine could read the user's files through chDB's file() (a web page could,
            # until the store refused them)
            password = files.secret(settings.home / "secrets" / store_client.LOCAL_PASSWORD,
                                    store_client.LOCAL_PASSWORD_BYTES)
        return cls(settings.home / "store", "127.0.0.1", url.port or 8123, settings.clickhouse_user, password)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid_file(self) -> Path:
        return self.root / "store.pid"

    @property
    def log_file(self) -> Path:
        return self.root / "store.log"

    def pid(self) -> int | None:
        return read_pid(self.pid_file, str(self.root / "data").encode())

    def start(self, *, timeout: float = 60.0, echo=print) -> float:
        if (pid := self.pid()) is not None:
            wait_ready(self.url, timeout=timeout)
            echo(f"store already running (pid {pid}) on {self.url}")
            return 0.0
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(self.log_file, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "crucible.local.store.server", "--data", str(data),
                 "--host", self.host, "--port", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, "CRUCIBLE_STORE_USER": self.user, "CRUCIBLE_STORE_PASSWORD": self.password},
            )
        self.pid_file.write_text(f"{proc.pid}\n")
        try:
            wait_ready(self.url, timeout=timeout, proc=proc)
        except Exception:
            self.stop()
            raise
        return time.monotonic() - started

    def stop(self, *, timeout: float = 30.0) -> bool:
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        terminate(pid, timeout)
        self.pid_file.unlink(missing_ok=True)
        return True


def kafka(settings: Settings | None = None) -> LocalKafka:
    return LocalKafka.from_settings(settings)


def store(settings: Settings | None = None) -> LocalStore:
    return LocalStore.from_settings(settings)
