"""The one threading HTTP server Crucible's HTTP services (the embedded store, the dashboard, every
service's /metrics) are built on: a thread per connection, a bounded number of them, each request's
head read within a deadline, and clients that hang up not reported as the server's errors."""
from __future__ import annotations

import ipaddress
import logging
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from crucible.shared.procs import loopback

log = logging.getLogger(__name__)

# A request's line and headers arrive within this, however slowly they trickle in (a socket timeout
# bounds each read alone: a byte every few seconds held a connection, and with the cap every one, for
# as long as the client liked).
HEAD_DEADLINE_S = 15.0
_GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError, socket.timeout)


def addressed_to_us(host_header: str | None, bound_host: str, *, any_address: bool = True) -> bool:
    """Whether a request's Host names this server. A page that DNS rebinding pointed at us sends its own
    name, never an IP address or localhost; the port is not checked (an SSH tunnel changes it). With
    `any_address=False` only the bound address, localhost and the loopback addresses name it: a page's
    request to http://0.0.0.0 reaches a server on 127.0.0.1 on Linux, with no Fetch Metadata (0.0.0.0
    is no "potentially trustworthy" address) and that Host."""
    match = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[^:\[\]]+)(:[0-9]{1,5})?", host_header or "")
    if not match:
        return False
    name = match[1].lower()
    if name.strip("[]") == bound_host.lower() or loopback(name):
        return True
    if not any_address:
        return False
    try:
        ipaddress.ip_address(name.strip("[]"))
        return True
    except ValueError:
        return False


def sent_by_a_web_page(headers) -> bool:
    """Whether a browser sent the request for a page's script, form or image (cross-site or not): it
    names the page's origin (Origin), or the context it came from (Sec-Fetch-Site) unless the user
    asked for the address themselves ("none"). Any web page may send requests to 127.0.0.1, with no
    header of its own choosing and a body a form can make; a program's client sends neither header."""
    site = headers.get("Sec-Fetch-Site")
    return headers.get("Origin") is not None or (site is not None and site.strip().lower() != "none")


class BoundedThreadingHTTPServer(ThreadingHTTPServer):
    """A thread per connection, `max_connections` at most: a connection past that is refused at once
    (`refuse`), never given a thread, so slow or idle clients cannot take every thread and descriptor.
    With a RequestHandler, a connection whose request head is not in by HEAD_DEADLINE_S is shut."""

    daemon_threads = True  # idle keep-alive connections must not delay shutdown

    def __init__(self, address, handler, max_connections: int):
        self._connections = threading.BoundedSemaphore(max_connections)
        self._heads: dict[socket.socket, float] = {}  # connection -> when its request head is due
        self._heads_lock = threading.Lock()
        self._watchdog: threading.Thread | None = None
        super().__init__(address, handler)

    def refuse(self, request) -> None:
        """A connection past the cap; closed here (a server may answer it first). Runs on the accept loop,
        which must not wait on a client."""
        self.close_request(request)

    def process_request(self, request, client_address):
        if not self._connections.acquire(blocking=False):
            return self.refuse(request)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._connections.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._connections.release()

    def handle_error(self, request, client_address):
        """A client that hung up or went silent is no error of the server's (each printed a traceback)."""
        error = sys.exc_info()[1]
        if isinstance(error, _GONE):
            log.debug("client %s went away: %r", client_address, error)
            return
        super().handle_error(request, client_address)

    def head_due(self, connection: socket.socket, deadline_s: float | None) -> None:
        """Watches `connection` until its request head is in (None: it is)."""
        with self._heads_lock:
            if deadline_s is None:
                self._heads.pop(connection, None)
                return
            self._heads[connection] = time.monotonic() + deadline_s
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._shut_late_heads, name="http-heads", daemon=True)
                self._watchdog.start()

    def _shut_late_heads(self) -> None:
        while True:
            time.sleep(1.0)
            now = time.monotonic()
            with self._heads_lock:  # held while shutting: a head that is in meanwhile is never cut off
                for c in [c for c, due in self._heads.items() if due <= now]:
                    del self._heads[c]
                    try:
                        c.shutdown(socket.SHUT_RDWR)  # the handler's blocked read returns; its thread ends
                    except OSError:
                        pass


class RequestHandler(BaseHTTPRequestHandler):
    """A handler for BoundedThreadingHTTPServer: each request's head must arrive within HEAD_DEADLINE_S."""

    def handle_one_request(self):
        # The deadline runs from a request's first byte: the wait for it, between the requests of a kept-alive
        # connection, is the socket timeout's alone (the store offers keep-alive for 30 s).
        try:
            if not self.rfile.peek(1):
                self.close_connection = True  # the client closed the connection
                return
        except (TimeoutError, OSError):
            self.close_connection = True
            return
        self.server.head_due(self.connection, HEAD_DEADLINE_S)
        try:
            super().handle_one_request()
        finally:
            self.server.head_due(self.connection, None)

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        self.server.head_due(self.connection, None)  # the head is in: handling it is the handler's time
        return parsed
