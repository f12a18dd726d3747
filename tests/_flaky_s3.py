"""A flaky S3 endpoint for tests: an HTTP proxy on loopback in front of moto's server that
answers some requests with ``503 ServiceUnavailable`` instead of forwarding them.

The faults come from the endpoint, as a real object store's do; the tier and its wrappers
under test are the real ones. Which requests fail is decided by the request, not by chance
or time, so a test sees the same faults every run:

- ``fraction``: a request fails the first ``times`` times it is seen if the hash of its
  method and path (and ``Range``) falls in that fraction; a retry of it then goes through;
- ``down()`` / ``up()``: every request fails while down (an outage).

``requests`` counts the requests received, ``injected`` the 503s sent, ``peak`` the most
requests in flight at once.
"""

from __future__ import annotations

import hashlib
import http.client
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}
_ERROR = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ServiceUnavailable</Code>'
    b"<Message>injected by the flaky endpoint</Message></Error>"
)


class FlakyS3:
    """The proxy; ``endpoint_url`` is what s3fs is given instead of moto's."""

    def __init__(self, upstream: str, *, fraction: float = 0.0, times: int = 1) -> None:
        target = urlsplit(upstream)
        self.upstream = (target.hostname or "127.0.0.1", target.port or 80)
        self.fraction, self.times = fraction, times
        self.requests = self.injected = self.peak = 0
        self._inflight = 0
        self._down = False
        self._failed: Counter[str] = Counter()
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _relay(self) -> None:
                proxy._serve(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def down(self) -> None:
        with self._lock:
            self._down = True

    def up(self) -> None:
        with self._lock:
            self._down = False

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> FlakyS3:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fails(self, key: str) -> bool:
        digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
        chosen = int.from_bytes(digest, "big") / 2**64 < self.fraction
        with self._lock:
            if self._down:
                return True
            if chosen and self._failed[key] < self.times:
                self._failed[key] += 1
                return True
            return False

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        body = _read_body(h)
        with self._lock:
            self.requests += 1
            self._inflight += 1
            self.peak = max(self.peak, self._inflight)
        try:
            key = f"{h.command} {h.path} {h.headers.get('Range', '')}"
            if self._fails(key):
                with self._lock:
                    self.injected += 1
                h.send_response(503)
                h.send_header("Content-Type", "application/xml")
                h.send_header("Content-Length", str(len(_ERROR)))
                h.end_headers()
                if h.command != "HEAD":
                    h.wfile.write(_ERROR)
                return
            conn = http.client.HTTPConnection(*self.upstream, timeout=60)
            try:
                headers = {
                    k: v
                    for k, v in h.headers.items()
                    if k.lower() not in _HOP and k.lower() != "content-length"
                }
                if body or h.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                conn.request(h.command, h.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                h.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP and k.lower() != "content-length":
                        h.send_header(k, v)
                length = resp.getheader("Content-Length")
                h.send_header(
                    "Content-Length", length if h.command == "HEAD" and length else str(len(data))
                )
                h.end_headers()
                if h.command != "HEAD":
                    h.wfile.write(data)
            finally:
                conn.close()
        finally:
            with self._lock:
                self._inflight -= 1


def _read_body(h: BaseHTTPRequestHandler) -> bytes:
    """The request's body, whether sent with a length or chunked."""
    if h.headers.get("Transfer-Encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int(h.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while h.rfile.readline().strip():  # trailers
                    pass
                return b"".join(parts)
            parts.append(h.rfile.read(size))
            h.rfile.readline()
    length = int(h.headers.get("Content-Length") or 0)
    return h.rfile.read(length) if length else b""
