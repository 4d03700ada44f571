"""What an HTTP request asks the store to do, read the way ClickHouse's HTTP handler reads it.

URL parameters (and, for multipart/form-data, form fields) split into: the query text, the
database, the default output format, `param_<name>` query parameters, transport-only parameters
that are not settings (session_id, query_id, wait_end_of_query, ...), and everything else, which
is a setting applied to the query's context, exactly as a server does. Headers X-ClickHouse-Database
and X-ClickHouse-Format take precedence over the parameters, as on a server.
"""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from email.message import Message
from urllib.parse import parse_qsl

from crucible.local.store.errors import BAD_ARGUMENTS, NOT_IMPLEMENTED, READONLY, StoreError

# ClickHouse's reserved_param_names: transport parameters that must not become settings.
RESERVED_PARAMS = frozenset({
    "compress", "decompress", "user", "password", "quota_key", "query_id", "stacktrace", "buffer_size",
    "wait_end_of_query", "session_id", "session_timeout", "session_check", "client_protocol_version",
    "close_session", "role",
})
MAX_PARAMS = 10_000
_TRUE = frozenset({"1", "true", "yes", "on"})


@dataclass
class RequestSpec:
    query: str = ""
    database: str = ""
    default_format: str = ""
    query_id: str = ""
    params: dict[str, str] = field(default_factory=dict)
    settings: dict[str, str] = field(default_factory=dict)

    def http_compression(self, default: bool) -> bool:
        """Whether to compress the response per Accept-Encoding (the enable_http_compression setting)."""
        value = self.settings.get("enable_http_compression")
        return default if value is None else value.strip().lower() in _TRUE

    def zlib_level(self) -> int:
        """http_zlib_compression_level for gzip and deflate responses (ClickHouse's default is 3)."""
        try:
            return min(9, max(1, int(self.settings.get("http_zlib_compression_level", "3"))))
        except ValueError:
            return 3


def parse_query_string(query_string: str) -> list[tuple[str, str]]:
    """URL parameters as (name, value) pairs; non-UTF-8 escapes are a client error, not mojibake."""
    try:
        return parse_qsl(query_string, keep_blank_values=True, errors="strict", max_num_fields=MAX_PARAMS)
    except UnicodeDecodeError as ex:
        raise StoreError(BAD_ARGUMENTS, f"URL parameters are not valid UTF-8 ({ex.reason} at byte {ex.start})") from None
    except ValueError as ex:
        raise StoreError(BAD_ARGUMENTS, f"Invalid URL parameters: {ex}") from None


def build_spec(pairs: list[tuple[str, str]], headers: Message, method: str) -> RequestSpec:
    """Sort parameters into query, database, format, query parameters and settings."""
    spec = RequestSpec(
        database=headers.get("X-ClickHouse-Database", "") or "",
        default_format=headers.get("X-ClickHouse-Format", "") or "",
        query_id=headers.get("X-ClickHouse-Query-Id", "") or "",
    )
    for key, value in pairs:
        if key == "query":
            spec.query = value
        elif key == "database":
            spec.database = spec.database or value
        elif key == "default_format":
            spec.default_format = spec.default_format or value
        elif key.startswith("param_"):
            spec.params[key[len("param_"):]] = value
        elif key == "query_id":
            spec.query_id = value
        elif key in ("compress", "decompress"):
            if value.strip().lower() in _TRUE:
                raise StoreError(
                    NOT_IMPLEMENTED,
                    f"{key}=1 (ClickHouse's internal block compression) is not supported by the store; "
                    "use HTTP compression instead (Content-Encoding / enable_http_compression=1 with Accept-Encoding)",
                )
        elif key and key not in RESERVED_PARAMS:
            spec.settings[key] = value
    spec.query_id = spec.query_id or str(uuid.uuid4())
    if method in ("GET", "HEAD"):
        # As on a server: GET is read-only. Here readonly=1 whatever the request asks (its other settings are
        # applied before it): at 2, chDB still runs file() and url(), and a GET is what a page's <img> sends,
        # with no header saying so in some browsers (http://0.0.0.0, Safari before 16.4).
        if spec.settings.get("readonly", "1").strip() == "0":
            raise StoreError(
                READONLY,
                "Cannot modify 'readonly' setting in readonly mode: an HTTP GET is read-only; use POST for modifying queries",
            )
        spec.settings["readonly"] = "1"
    return spec


_DISPOSITION_PARAM_RE = re.compile(r';\s*([A-Za-z*]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)')


def parse_multipart(body: bytes, content_type: str) -> list[tuple[str, str]]:
    """Form fields of a multipart/form-data body (clickhouse-connect sends long query parameters this way).

    Only plain fields are supported; a part with a filename is ClickHouse "external data" (a
    temporary table shipped with the query), which the store does not implement.
    """
    match = re.search(r'boundary=(?:"([^"]+)"|([^;\s]+))', content_type)
    if not match:
        raise StoreError(BAD_ARGUMENTS, "multipart/form-data request without a boundary")
    boundary = (match.group(1) or match.group(2)).encode("latin-1", "replace")
    delimiter = b"\r\n--" + boundary
    pieces = (b"\r\n" + body).split(delimiter)
    if len(pieces) < 2 or not pieces[-1].startswith(b"--"):
        raise StoreError(BAD_ARGUMENTS, "Malformed multipart/form-data body: the closing boundary is missing")
    fields: list[tuple[str, str]] = []
    for piece in pieces[1:-1]:
        if not piece.startswith(b"\r\n"):
            raise StoreError(BAD_ARGUMENTS, "Malformed multipart/form-data body: a boundary is not followed by CRLF")
        head, sep, content = piece[2:].partition(b"\r\n\r\n")
        if not sep:
            raise StoreError(BAD_ARGUMENTS, "Malformed multipart/form-data body: a part has no header end")
        disposition = ""
        for line in head.split(b"\r\n"):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-disposition":
                disposition = value
        params = {k.lower(): v.strip('"') for k, v in _DISPOSITION_PARAM_RE.findall(disposition)}
        if "filename" in params or "filename*" in params:
            raise StoreError(
                NOT_IMPLEMENTED,
                "External data (a file part in multipart/form-data) is not supported by the store; "
                "load the data into a table first",
            )
        if "name" not in params:
            raise StoreError(BAD_ARGUMENTS, "Malformed multipart/form-data body: a part has no name")
        try:
            fields.append((params["name"], content.decode("utf-8")))
        except UnicodeDecodeError:
            raise StoreError(BAD_ARGUMENTS, f"Form field {params['name']!r} is not valid UTF-8") from None
    return fields
