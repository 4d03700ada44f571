"""The one threading HTTP server both of Crucible's HTTP services (the embedded store, the dashboard)
are built on: a thread per connection, a bounded number of them."""
from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer


class BoundedThreadingHTTPServer(ThreadingHTTPServer):
    """A thread per connection, `max_connections` at most: a connection past that is refused at once
    (`refuse`), never given a thread, so slow or idle clients cannot take every thread and descriptor."""

    daemon_threads = True  # idle keep-alive connections must not delay shutdown

    def __init__(self, address, handler, max_connections: int):
        self._connections = threading.BoundedSemaphore(max_connections)
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
