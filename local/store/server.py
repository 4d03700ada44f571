"""The store process: chDB owned by one process, served over ClickHouse's HTTP interface.

    python -m crucible.local.store.server --data DIR [--host 127.0.0.1] [--port 8123]

The same clickhouse-connect code then works against this process and against a real ClickHouse
server. The process takes an exclusive lock on DIR before opening chDB (a second store on the same
directory exits with status 2 and says who owns it), serves until SIGTERM or SIGINT, then finishes
in-flight requests, closes chDB and releases the lock.

There is no authentication: the store is a local component and listens on loopback by default.
Whoever can reach the port can run any SQL with the store's OS permissions (chDB's file() and url()
table functions included), so do not expose it beyond the machine.
"""
from __future__ import annotations

import argparse
import base64
import hmac
import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from http import HTTPStatus
from pathlib import Path
from urllib.parse import urlsplit

from crucible.local.store import codecs
from crucible.local.store.engine import Context, Engine, Outcome
from crucible.local.store.errors import (
    ACCESS_DENIED,
    BAD_ARGUMENTS,
    HTTP_LENGTH_REQUIRED,
    QUERY_IS_TOO_LARGE,
    AUTHENTICATION_FAILED,
    STD_EXCEPTION,
    UNSUPPORTED_METHOD,
    StoreError,
)
from crucible.local.store.lock import DataDirLock, DataDirLocked
from crucible.local.store.request import RequestSpec, build_spec, parse_multipart, parse_query_string
from crucible.shared.http_server import BoundedThreadingHTTPServer, RequestHandler, addressed_to_us, sent_by_a_web_page
from crucible.shared.procs import loopback
from crucible.shared.store.sqltext import split_insert

log = logging.getLogger("crucible.store")

EXIT_LOCKED = 2
HEAD_BYTES = 1 << 20  # the INSERT statement must start within this many bytes of the request
MAX_QUERY_BYTES = 16 << 20  # SQL text (not insert data) larger than this is refused before parsing
MAX_FORM_BYTES = 16 << 20
SPOOL_MEMORY_BYTES = 32 << 20  # insert data beyond this goes to a temporary file in the data directory
KEEP_ALIVE_S = 30  # idle time allowed between requests, and silence allowed in the middle of one
LINGER_S = 2.0  # how long a closing connection keeps reading what the client still sends
LINGER_BYTES = 64 << 20

_CONTENT_TYPES = (
    ("tabseparated", "text/tab-separated-values; charset=UTF-8"),
    ("tsv", "text/tab-separated-values; charset=UTF-8"),
    ("csvwithnames", "text/csv; charset=UTF-8; header=present"),
    ("csv", "text/csv; charset=UTF-8; header=absent"),
    ("jsoneachrow", "application/x-ndjson; charset=UTF-8"),
    ("json", "application/json; charset=UTF-8"),
    ("native", "application/octet-stream"),
    ("rowbinary", "application/octet-stream"),
    ("parquet", "application/octet-stream"),
    ("arrow", "application/octet-stream"),
    ("orc", "application/octet-stream"),
    ("avro", "application/octet-stream"),
)


def content_type_for(fmt: str) -> str:
    lower = fmt.lower()
    for prefix, content_type in _CONTENT_TYPES:
        if lower.startswith(prefix):
            return content_type
    return "text/plain; charset=UTF-8"


class StoreServer(BoundedThreadingHTTPServer):
    """A threading HTTP server that owns the engine and counts in-flight requests for a clean stop."""

    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address, engine: Engine, *, spool_dir: Path, max_body_bytes: int, max_connections: int):
        self.engine = engine
        self.spool_dir = spool_dir
        self.max_body_bytes = max_body_bytes
        self.display_name = socket.gethostname()
        # Credentials from the environment, never the command line (`ps` shows that): with a password
        # set, every query must carry it (HTTP basic auth, X-ClickHouse-User/Key, or user/password).
        self.user = os.environ.get("CRUCIBLE_STORE_USER") or "default"
        self.password = os.environ.get("CRUCIBLE_STORE_PASSWORD", "")
        self._active = 0
        self._idle = threading.Condition()
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, StoreRequestHandler, max_connections)

    def authorized(self, headers, pairs: list[tuple[str, str]]) -> bool:
        if not self.password:
            return True
        params = dict(pairs)
        user, key = headers.get("X-ClickHouse-User"), headers.get("X-ClickHouse-Key")
        auth = headers.get("Authorization", "")
        if auth.startswith("Basic "):
            try:
                user, _, key = base64.b64decode(auth[6:]).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                return False
        user = user or params.get("user") or "default"
        key = key if key is not None else params.get("password", "")
        return hmac.compare_digest(user.encode(), self.user.encode()) & hmac.compare_digest(
            (key or "").encode(), self.password.encode())

    def refuse(self, request) -> None:
        """Past the connection cap: a quick 503, not a thread."""
        try:
            error = StoreError(202, "too many open connections to the store", http_status=503)
            body = error.body(self.engine.version)
            request.sendall(
                b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\n"
                b"Content-Type: text/plain; charset=UTF-8\r\nX-ClickHouse-Exception-Code: 202\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
            )
        except OSError:
            pass
        finally:
            # No lingering here: this runs on the accept loop, which must not wait on a client.
            self.close_request(request)

    def shutdown_request(self, request):
        """Close like nginx's lingering close: after our last byte, read and discard what the client
        is still sending for a moment. Closing with unread data makes the kernel send a reset, which
        can destroy the error response (a 413, say) before the client has read it."""
        try:
            request.shutdown(socket.SHUT_WR)
            request.settimeout(0.5)
            deadline = time.monotonic() + LINGER_S
            drained = 0
            while time.monotonic() < deadline and drained < LINGER_BYTES:
                chunk = request.recv(1 << 16)
                if not chunk:
                    break
                drained += len(chunk)
        except OSError:
            pass
        self.close_request(request)

    def request_started(self) -> None:
        with self._idle:
            self._active += 1

    def request_finished(self) -> None:
        with self._idle:
            self._active -= 1
            self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait for in-flight requests to finish; False if some were still running at the timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._active == 0, timeout)


_SECRET_PARAM = re.compile(r"((?:^|[?&\s])(?:password|key)=)[^&\s]*", re.IGNORECASE)


def _without_secrets(text: str) -> str:
    """A request line or path as logged: a password given in the URL (`?password=`, ClickHouse's way) masked."""
    return _SECRET_PARAM.sub(r"\1***", text)


class StoreRequestHandler(RequestHandler):
    """ClickHouse's HTTP interface: `/` for queries and inserts, `/ping` and `/replicas_status` for health."""

    protocol_version = "HTTP/1.1"
    server_version = "crucible-store"
    sys_version = ""
    timeout = KEEP_ALIVE_S  # socket timeout: a silent client is dropped, never waited on forever
    # Buffer writes so a small response leaves as one segment with its headers; BaseHTTPRequestHandler
    # flushes after every request.
    wbufsize = 64 * 1024
    server: StoreServer

    def setup(self):
        super().setup()
        # Without this, Nagle's algorithm holds the last segment of a response until the client's
        # delayed ACK: 40 ms added to every small query.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def version_string(self) -> str:
        return self.server_version

    def log_message(self, format, *args):  # noqa: A002  (BaseHTTPRequestHandler's signature)
        log.debug("%s %s", self.address_string(), _without_secrets(format % args))

    def do_GET(self):
        self._handle("GET")

    def do_HEAD(self):
        self._handle("HEAD")

    def do_POST(self):
        self._handle("POST")

    # -- request handling --------------------------------------------------------------------

    def _handle(self, method: str) -> None:
        self.server.request_started()
        body: codecs.LengthReader | codecs.ChunkedReader | None = None
        spec = RequestSpec()
        try:
            self._refuse_web_pages()
            url = urlsplit(self.path)
            body = self._open_body(method)
            if url.path in ("/ping", "/replicas_status"):
                self._send(200, b"Ok.\n", {"Content-Type": "text/plain; charset=UTF-8"}, method)
                return
            if url.path not in ("", "/"):
                self._send_not_found(url.path, method)
                return
            pairs = parse_query_string(url.query)
            content_type = self.headers.get("Content-Type", "")
            multipart = content_type.lower().startswith("multipart/form-data")
            if multipart and body is not None:
                form = _read_all(codecs.LimitReader(body, MAX_FORM_BYTES, "The multipart/form-data body"))
                pairs.extend(parse_multipart(form, content_type))
            spec = build_spec(pairs, self.headers, method)
            no_body = body is None or multipart or body.exhausted
            if not spec.query and no_body and method in ("GET", "HEAD"):
                # A bare GET / is a health check on a ClickHouse server too.
                self._send(200, b"Ok.\n", {"Content-Type": "text/plain; charset=UTF-8"}, method)
                return
            if not self.server.authorized(self.headers, pairs):
                raise StoreError(AUTHENTICATION_FAILED, "Authentication failed: password is incorrect, or there is "
                                 "no user with such name.")
            outcome = self._execute(spec, None if multipart else body)
            self._send_outcome(spec, outcome, method)
        except StoreError as error:
            self._send_error(error, spec, method)
        except (BrokenPipeError, ConnectionResetError, TimeoutError, socket.timeout):
            self.close_connection = True  # the client is gone; there is nobody to answer
        except Exception as ex:  # a bug must cost one request, never the server
            log.exception("internal error while handling %s %s", method, _without_secrets(self.path[:200]))
            self._send_error(StoreError(STD_EXCEPTION, f"Internal error in the store: {type(ex).__name__}: {ex}"), spec, method)
        finally:
            if body is not None and not body.exhausted:
                # The rest of the body is still on the socket; it cannot be reused for a next request.
                self.close_connection = True
            self.server.request_finished()

    def _refuse_web_pages(self) -> None:
        """A request a web page made is refused, whatever it asks: a page the user merely visits could
        otherwise read and write the store (and, through chDB's file and url functions, the files of
        whoever runs it). Without a password the request must name this server too (a page that DNS
        rebinding pointed at 127.0.0.1 names its own host, and could read the answers)."""
        if sent_by_a_web_page(self.headers):
            self.close_connection = True
            raise StoreError(ACCESS_DENIED, "The store does not answer requests made by web pages "
                             "(the request carries Origin or Sec-Fetch-Site)", http_status=403)
        if not self.server.password and not addressed_to_us(self.headers.get("Host"), self.server.server_address[0],
                                                            any_address=False):
            self.close_connection = True
            raise StoreError(ACCESS_DENIED, "The request's Host is not this store: without a password it answers "
                             "requests addressed to its own address or localhost only", http_status=403)

    def _open_body(self, method: str):
        """The request body's framing: chunked, Content-Length, or none."""
        transfer = self.headers.get("Transfer-Encoding")
        lengths = self.headers.get_all("Content-Length") or []
        if transfer is not None:
            if transfer.strip().lower() != "chunked":
                self.close_connection = True
                raise StoreError(
                    UNSUPPORTED_METHOD, f"Unsupported Transfer-Encoding '{transfer}'; only chunked is supported", http_status=501
                )
            if lengths:
                self.close_connection = True
                raise StoreError(BAD_ARGUMENTS, "A request must not carry both Transfer-Encoding and Content-Length")
            return codecs.ChunkedReader(self.rfile)
        if lengths:
            if len(set(v.strip() for v in lengths)) != 1 or not lengths[0].strip().isdigit():
                self.close_connection = True
                raise StoreError(BAD_ARGUMENTS, f"Invalid Content-Length header: {lengths!r}")
            length = int(lengths[0])
            if length > self.server.max_body_bytes:
                self.close_connection = True
                raise StoreError(
                    QUERY_IS_TOO_LARGE,
                    f"The request body of {length} bytes is larger than the store's limit of "
                    f"{self.server.max_body_bytes} bytes; split it or raise --max-body-bytes",
                )
            return codecs.LengthReader(self.rfile, length)
        if method == "POST":
            self.close_connection = True
            raise StoreError(
                HTTP_LENGTH_REQUIRED,
                "The Transfer-Encoding is not chunked and there is no Content-Length header for POST request",
            )
        return None

    def _execute(self, spec: RequestSpec, body) -> Outcome:
        engine = self.server.engine
        ctx = Context(
            database=spec.database or "default",
            settings=spec.settings,
            params=spec.params,
            default_format=spec.default_format or "TabSeparated",
        )
        # As on a server, the statement is the `query` parameter, a line break, then the body.
        prefix = (spec.query + "\n").encode("utf-8") if spec.query else b""
        stream: codecs.Reader = codecs.BytesReader(prefix)
        if body is not None:
            decoded = codecs.decoding_reader(body, self.headers.get("Content-Encoding"))
            limited = codecs.LimitReader(decoded, self.server.max_body_bytes, "The request body (after decompression)")
            stream = codecs.ConcatReader(stream, limited)
        head = _read_up_to(stream, HEAD_BYTES)
        split = _decode_sql(lambda: split_insert(head))
        if split is not None:
            if len(head) < HEAD_BYTES:  # the whole body is already in memory
                return engine.insert(split.statement, split.format, [head[split.data_offset:]], ctx)
            data = codecs.ConcatReader(codecs.BytesReader(head[split.data_offset:]), stream)
            with self._spool(data) as spooled:
                return engine.insert(split.statement, split.format, spooled, ctx)
        rest = _read_all(codecs.LimitReader(stream, MAX_QUERY_BYTES, "The query text")) if len(head) == HEAD_BYTES else b""
        sql = _decode_sql(lambda: (head + rest).decode("utf-8"))
        return engine.query(sql, ctx)

    def _spool(self, data: codecs.Reader):
        """Read the whole insert body before touching the engine, so a slow or broken upload never
        holds an engine session and never commits part of its rows."""
        spooled = tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY_BYTES, dir=self.server.spool_dir)
        try:
            while chunk := data.read(codecs.READ_SIZE * 16):
                spooled.write(chunk)
            spooled.seek(0)
        except BaseException:
            spooled.close()
            raise
        return spooled

    # -- responses ---------------------------------------------------------------------------

    def _common_headers(self, spec: RequestSpec) -> dict[str, str]:
        return {
            "X-ClickHouse-Server-Display-Name": self.server.display_name,
            "X-ClickHouse-Query-Id": spec.query_id,
            "X-ClickHouse-Timezone": self.server.engine.timezone,
        }

    def _send_outcome(self, spec: RequestSpec, outcome: Outcome, method: str) -> None:
        headers = self._common_headers(spec)
        headers["X-ClickHouse-Summary"] = json.dumps(outcome.summary(), separators=(",", ":"))
        body = outcome.body
        if outcome.format:
            headers["X-ClickHouse-Format"] = outcome.format
            headers["Content-Type"] = content_type_for(outcome.format)
        else:
            headers["Content-Type"] = "text/plain; charset=UTF-8"
        if spec.http_compression(self.server.engine.http_compression_default):
            encoding = codecs.choose_response_encoding(self.headers.get("Accept-Encoding"))
            if encoding:
                body = codecs.compress(body, encoding, spec.zlib_level())
                headers["Content-Encoding"] = encoding
        self._send(200, body, headers, method)

    def _send_error(self, error: StoreError, spec: RequestSpec, method: str) -> None:
        if error.code == 164 and method in ("GET", "HEAD") and "method GET" not in error.message:
            error.message = (
                error.message.rstrip(".")
                + ". For queries over HTTP, method GET implies readonly. You should use method POST for modifying queries"
            )
        if error.http_status >= 500 and error.code not in (202,):
            log.warning("request failed: %s", error.text())
        else:
            log.info("request refused: %s", error.text())
        headers = self._common_headers(spec)
        headers["X-ClickHouse-Exception-Code"] = str(error.code)
        headers["Content-Type"] = "text/plain; charset=UTF-8"
        try:
            self._send(error.http_status, error.body(self.server.engine.version), headers, method)
        except OSError:
            self.close_connection = True

    def _send_not_found(self, path: str, method: str) -> None:
        text = (
            f"There is no handle {path[:200]}\n\n"
            "Use / or /ping for health checks.\n"
            "Send queries with POST / (the query in the body or in ?query=...), or GET /?query=... for reads.\n"
        )
        self._send(404, text.encode("utf-8", "replace"), {"Content-Type": "text/plain; charset=UTF-8"}, method)

    def _send(self, status: int, body: bytes, headers: dict[str, str], method: str) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        else:
            self.send_header("Connection", "Keep-Alive")
            self.send_header("Keep-Alive", f"timeout={KEEP_ALIVE_S}")
        self.end_headers()
        if method != "HEAD" and body:
            self.wfile.write(body)

    def send_error(self, code, message=None, explain=None):
        """Protocol-level failures (bad request line, oversized headers, unknown method) in ClickHouse's words."""
        self.close_connection = True
        if self.request_version == "HTTP/0.9":  # unparseable request line: answer in HTTP/1.x anyway
            self.request_version = "HTTP/1.0"
        phrase = HTTPStatus(code).phrase if code in HTTPStatus._value2member_map_ else "Error"
        error_code = UNSUPPORTED_METHOD if code == 501 else BAD_ARGUMENTS
        error = StoreError(error_code, f"{phrase}: {message or explain or 'malformed HTTP request'}", http_status=code)
        body = error.body(self.server.engine.version)
        try:
            self.send_response(code)
            self.send_header("X-ClickHouse-Exception-Code", str(error_code))
            self.send_header("Content-Type", "text/plain; charset=UTF-8")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD" and code >= 200 and code not in (204, 304):
                self.wfile.write(body)
        except OSError:
            pass


def _read_up_to(reader: codecs.Reader, limit: int) -> bytes:
    parts = []
    size = 0
    while size < limit:
        chunk = reader.read(min(codecs.READ_SIZE * 4, limit - size))
        if not chunk:
            break
        parts.append(chunk)
        size += len(chunk)
    return b"".join(parts)


def _read_all(reader: codecs.Reader) -> bytes:
    parts = []
    while chunk := reader.read(codecs.READ_SIZE * 4):
        parts.append(chunk)
    return b"".join(parts)


def _decode_sql(fn):
    try:
        return fn()
    except UnicodeDecodeError as ex:
        raise StoreError(
            BAD_ARGUMENTS,
            f"The query text is not valid UTF-8 (invalid byte at offset {ex.start}); "
            "send binary data after a FORMAT clause, not inside the SQL",
        ) from None


# -- the process -------------------------------------------------------------------------------


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m crucible.local.store.server",
        description="Serve a chDB data directory over ClickHouse's HTTP interface.",
    )
    parser.add_argument("--data", required=True, type=Path, help="data directory (created if missing); one store per directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1); beyond loopback "
                        "it needs a password: CRUCIBLE_STORE_USER and CRUCIBLE_STORE_PASSWORD in the environment")
    parser.add_argument("--port", default=8123, type=int, help="port to listen on (default 8123; 0 picks a free one)")
    parser.add_argument("--sessions", default=4, type=int, help="chDB sessions, i.e. queries that run at once (default 4)")
    parser.add_argument("--max-body-bytes", default=4 << 30, type=int, help="largest request body after decompression (default 4 GiB)")
    parser.add_argument("--max-connections", default=256, type=int, help="open client connections beyond which new ones get 503")
    parser.add_argument("--log-level", default="INFO", help="logging level for request errors (default INFO)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s store %(levelname)s %(message)s")
    data_dir = args.data.expanduser().resolve()
    if not os.environ.get("CRUCIBLE_STORE_PASSWORD") and not loopback(args.host):
        print(f"crucible store: refusing to listen on {args.host} without a password (set CRUCIBLE_STORE_PASSWORD)",
              file=sys.stderr, flush=True)
        return 1

    lock = DataDirLock(data_dir)
    try:
        lock.acquire()
    except DataDirLocked as ex:
        print(f"crucible store: {ex}", file=sys.stderr, flush=True)
        return EXIT_LOCKED
    except OSError as ex:
        print(f"crucible store: cannot use {data_dir} as the data directory: {ex}", file=sys.stderr, flush=True)
        return 1

    try:
        spool_dir = data_dir / ".crucible-spool"
        shutil.rmtree(spool_dir, ignore_errors=True)  # leftovers of a killed store
        spool_dir.mkdir()
        try:
            engine = Engine(data_dir, sessions=args.sessions)
        except Exception as ex:
            print(f"crucible store: cannot open chDB on {data_dir}: {ex}", file=sys.stderr, flush=True)
            return 1
        try:
            server = StoreServer(
                (args.host, args.port), engine,
                spool_dir=spool_dir, max_body_bytes=args.max_body_bytes, max_connections=args.max_connections,
            )
        except OSError as ex:
            engine.close()
            print(f"crucible store: cannot listen on {args.host}:{args.port}: {ex}", file=sys.stderr, flush=True)
            return 1

        stopping = threading.Event()

        def stop(signum, _frame):
            if not stopping.is_set():
                stopping.set()
                log.info("received %s, stopping", signal.Signals(signum).name)
                # shutdown() waits for serve_forever to return, so it cannot run on the serving thread.
                threading.Thread(target=server.shutdown, daemon=True).start()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)

        host, port = server.server_address[:2]
        print(f"store ready on http://{host}:{port} data={data_dir} pid={os.getpid()}", file=sys.stderr, flush=True)
        if not loopback(host):
            log.warning("listening on %s: the store has no authentication; anyone who can reach it can run SQL", host)
        try:
            server.serve_forever(poll_interval=0.2)
        finally:
            server.server_close()
            if not server.wait_idle(timeout=30):
                log.warning("requests still running after 30 s; closing the engine anyway")
            engine.close()
            shutil.rmtree(spool_dir, ignore_errors=True)
        print(f"store stopped data={data_dir} pid={os.getpid()}", file=sys.stderr, flush=True)
        return 0
    finally:
        lock.release()


if __name__ == "__main__":
    sys.exit(main())
