"""One way to get a ClickHouse client, whether the store is the embedded chDB process or a real server.

Both speak ClickHouse's HTTP interface, so the only difference is the URL in
CRUCIBLE_CLICKHOUSE_URL (http://127.0.0.1:8123 for the local store by default).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import clickhouse_connect
from clickhouse_connect.driver import options
from clickhouse_connect.driver.binding import quote_identifier
from clickhouse_connect.driver.client import Client

from crucible.shared import files
from crucible.shared.procs import loopback
from crucible.shared.settings import Settings, get_settings, shown_url

_DEFAULT_PORTS = {"http": 8123, "https": 8443}


def _endpoint(url: str) -> dict[str, Any]:
    """Host, port, scheme, optional credentials and proxy path of a ClickHouse HTTP URL."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ValueError(f"ClickHouse URL {shown_url(url)!r} must start with http:// or https://")
    if not parts.hostname:
        raise ValueError(f"ClickHouse URL {shown_url(url)!r} has no host")
    try:
        port = parts.port or _DEFAULT_PORTS[scheme]
    except ValueError:
        raise ValueError(f"ClickHouse URL {shown_url(url)!r} has an invalid port") from None
    endpoint: dict[str, Any] = {"host": parts.hostname, "port": port, "interface": scheme}
    if parts.username is not None:
        endpoint["username"] = unquote(parts.username)
        endpoint["password"] = unquote(parts.password or "")
    path = parts.path.strip("/")
    if path:
        endpoint["proxy_path"] = path  # a ClickHouse behind a reverse proxy at a sub-path
    return endpoint


def _no_dataframes() -> None:
    """Tells clickhouse-connect that this process's rows are never pandas DataFrames nor numpy arrays,
    unless pandas (numpy) is loaded already. Its first insert otherwise imports them only to ask
    whether the rows are one: pandas 2 s of CPU and 70 MB in every service that writes, numpy 0.1-0.15 s
    (measured here), paid by the aggregator and control in the first second of a run, on a machine
    where each second of CPU is taken from the learner. Crucible hands it lists; a process that
    wants `query_df` or `query_np` imports pandas or numpy before it connects."""
    for name, package in (("pd", "pandas"), ("np", "numpy")):
        if name not in vars(options) and package not in sys.modules:
            setattr(options, name, None)  # what clickhouse-connect itself sets where the package is not installed


LOCAL_PASSWORD = "store.password"  # under CRUCIBLE_HOME/secrets: the embedded store's, made by local/stack.py


def password(settings: Settings, host: str | None) -> str:
    """The store's password: CRUCIBLE_CLICKHOUSE_PASSWORD where it is set (an empty one too); else, for a
    store on this machine, the one the embedded store was started with from this CRUCIBLE_HOME (a store
    without a password takes any), else none."""
    if settings.clickhouse_password is not None:
        return settings.clickhouse_password.get_secret_value()
    path = Path(settings.home) / "secrets" / LOCAL_PASSWORD
    if loopback(host) and path.exists():
        return files.secret(path, LOCAL_PASSWORD_BYTES)
    return ""


LOCAL_PASSWORD_BYTES = 16


def _client(endpoint: dict[str, Any], settings: Settings, database: str, **kwargs: Any) -> Client:
    _no_dataframes()
    params: dict[str, Any] = {
        "username": settings.clickhouse_user,
        "password": password(settings, endpoint["host"]),
        # A session id would make the server reject two threads sharing one client; Crucible's
        # clients are shared, and nothing relies on session state.
        "autogenerate_session_id": False,
    }
    params.update(endpoint)
    params.update(kwargs)
    return clickhouse_connect.get_client(database=database, **params)


def connect(
    settings: Settings | None = None,
    *,
    url: str | None = None,
    database: str | None = None,
    create_database: bool = True,
    **client_kwargs: Any,
) -> Client:
    """A clickhouse-connect client bound to Crucible's database, creating the database if missing.

    url defaults to settings.clickhouse_url; credentials in the URL (http://user:pass@host:port)
    override settings.clickhouse_user/password. Extra keyword arguments go to
    clickhouse_connect.get_client (compress=, send_receive_timeout=, settings=, ...).
    """
    settings = settings or get_settings()
    url = url or settings.clickhouse_url
    database = database or settings.clickhouse_database
    endpoint = _endpoint(url)
    if create_database:
        admin = _client(endpoint, settings, "default", **client_kwargs)
        try:
            admin.command(f"CREATE DATABASE IF NOT EXISTS {quote_identifier(database)}")
        finally:
            admin.close()
    return _client(endpoint, settings, database, **client_kwargs)
