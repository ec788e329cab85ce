"""`python -m deployments.local`'s wait for the first model group, against a real HTTP server (no Ray): the
seconds it reports count from the start of the command it is given, not from when the wait began; a server
that never becomes ready ends the wait with the timeout's message."""
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deployments.local import wait_ready


def readyz_server(status: int) -> ThreadingHTTPServer:
    """A server whose /readyz answers `status` (anything else 404), serving on a thread of its own."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status if self.path == "/readyz" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_ready_seconds_count_from_the_start_of_the_command():
    server = readyz_server(200)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        started = time.monotonic() - 30.0            # a command that started Ray and Serve 30 s ago
        assert wait_ready(url, 10.0, since=started) >= 30.0
        assert wait_ready(url, 10.0) < 30.0          # without a start given: from the wait's own start
    finally:
        server.shutdown()
        server.server_close()


def test_a_group_never_ready_ends_the_wait_with_the_timeout():
    server = readyz_server(503)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(TimeoutError, match=r"no model group was ready within 0\.5 s; see the Ray logs"):
            wait_ready(url, 0.5, since=time.monotonic() - 30.0)
    finally:
        server.shutdown()
        server.server_close()
