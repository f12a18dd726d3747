"""The peer-memory daemon's TCP server: connections, handshakes, frames and their deadlines.

``tiercheck peer serve`` (and ``python -m tiercheck.peer.daemon``) runs it; ranks on other
nodes reach it through the ``peer://host:port[/namespace]`` tier. Every client names a
namespace (its rank or store name) in its hello, so several ranks replicate into one
daemon without colliding. The wire protocol is in ``docs/peer-protocol.md``.

Concurrency: one thread per connection, blocking sockets. A rank's client keeps a few
connections open, so a daemon serves tens of connections, not thousands; a blocked
``recv_into`` releases the GIL, and blocking I/O lets a blob be received straight into
the buffer that then stores it, which an asyncio stream (it buffers and copies) would
not. ``max_connections`` bounds the thread count. The store takes one lock for dict
updates only; no bytes are copied under it.

Resources (:mod:`tiercheck.peer.memory`): ``memory_limit`` bounds what the daemon holds
across namespaces: every blob and log record is charged its bytes plus a fixed per-object
overhead (``OBJECT_OVERHEAD``, ``RECORD_OVERHEAD``), and a frame over ``RESERVE_MIN``
reserves its length before its body is received (one that does not fit is read into a
small scratch buffer, discarded, and refused), so frames in flight count too.
``namespace_quota`` bounds one namespace the same way, and a client may give its
namespace a smaller ``budget`` in its hello (the tier option of that name); a write past
any of them is refused (``OverBudget``). Empty blobs and empty log records are refused
(``BadRequest``): an object of no bytes would cost only overhead. A connection idle
between requests for ``idle_timeout`` seconds is closed, and TCP keepalive probes find a
peer whose node died without closing its connections, so a crashed client's
connection slot is freed.

Hostile clients: the handshake has a total deadline (``handshake_timeout``, from accept to
hello), and so does each frame once its first byte arrived (``frame_timeout`` plus its
length at ``min_rate`` bytes a second), so a client trickling bytes is cut. Connections
that have not authenticated yet are capped apart (``max_unauthenticated``, and
``max_unauthenticated_per_address`` from one address) from authenticated ones
(``max_connections``): unauthenticated clients never take an authenticated client's slot.

Authorisation: clients prove the daemon's token (the *admin* token: every namespace, and
``stats`` of all) or a *namespace token*, ``namespace_token(admin, ns)`` (HMAC-SHA256 of the
namespace under the admin token, hex): it opens that namespace only, so a rank given its
own namespace's token cannot read, overwrite or delete another rank's.

Robustness: a client that sends a wrong token, a frame over the limit (refused from its
length, before the body is read), bytes that are not a msgpack map of the expected shape,
or half a frame, loses its connection (with an error frame where it can still be read,
and an error in the log); the daemon keeps serving everyone else. A request is applied
only after its whole frame has arrived, so a log append is all or nothing.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import selectors
import socket
import threading
import time
from typing import Any

from tiercheck.backends._peer_protocol import (
    DEFAULT_MAX_FRAME,
    HANDSHAKE_MAX_FRAME,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    FrameTooLarge,
    PeerClosed,
    ProtocolError,
    auth_mac,
    decode_body,
    send_frame,
    set_keepalive,
)
from tiercheck.errors import ConfigError
from tiercheck.peer.handlers import Handlers, Reply, Request, Session
from tiercheck.peer.memory import RESERVE_MIN, BufferPool, MemoryStore
from tiercheck.peer.validation import MAX_NAMESPACE, Refused

__all__ = [
    "DEFAULT_FRAME_TIMEOUT",
    "DEFAULT_HANDSHAKE_TIMEOUT",
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_KEEPALIVE",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_UNAUTHENTICATED",
    "DEFAULT_MAX_UNAUTHENTICATED_PER_ADDRESS",
    "DEFAULT_MIN_RATE",
    "PeerServer",
    "format_address",
    "namespace_token",
    "parse_address",
]

log = logging.getLogger(__name__)

# the receive buffer of a frame refused for want of memory, whose body is discarded
_SCRATCH = 1 << 16
# The "op" of a frame refused for want of memory (never a string, so no client sends it).
_TOO_FULL = object()


class _Idle(Exception):
    """A connection sent nothing for the idle timeout: it is closed."""


DEFAULT_IDLE_TIMEOUT = 600.0
DEFAULT_KEEPALIVE = 60.0
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_MAX_UNAUTHENTICATED = 64
DEFAULT_MAX_UNAUTHENTICATED_PER_ADDRESS = 8
DEFAULT_HANDSHAKE_TIMEOUT = 10.0
DEFAULT_FRAME_TIMEOUT = 60.0
DEFAULT_MIN_RATE = 1 << 20  # bytes/s a frame's body must keep up, past its timeout


def parse_address(text: str) -> tuple[str, int]:
    """Parse ``HOST:PORT`` or ``[V6HOST]:PORT``; an empty host means all interfaces."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"invalid address {text!r}: expected HOST:PORT, e.g. 127.0.0.1:7480")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port_text)


def namespace_token(admin: bytes, namespace: str) -> bytes:
    """The token that opens ``namespace`` only, derived from the daemon's (admin) token.

    Give each rank the token of its own namespace (``tiercheck peer token NS``) instead of
    the admin token, and no rank can touch another's data.
    """
    return (
        hmac.new(admin, b"tiercheck-namespace\0" + namespace.encode(), "sha256")
        .hexdigest()
        .encode()
    )


def format_address(host: str, port: int) -> str:
    """``HOST:PORT``, with brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class PeerServer:
    """The daemon, runnable in-process: ``port = PeerServer(...).start()``, then ``stop()``.

    ``token`` is the shared secret clients prove with HMAC-SHA256 of a per-connection nonce;
    None turns authentication off (say so explicitly: :func:`serve` refuses it unless
    ``insecure_no_auth``); a client may also prove ``namespace_token(token, ns)``, which
    opens namespace ``ns`` only. ``memory_limit`` bounds the payload bytes held (blobs and
    log records of all namespaces); ``max_frame`` bounds one frame. ``idle_timeout``
    (seconds, None: never) closes a connection that sends no request for that long;
    ``keepalive`` (seconds of silence before TCP keepalive probes, None: off) lets the
    kernel notice a peer that vanished without closing its connection.

    Against hostile clients: ``handshake_timeout`` is the total time from accept to a
    hello answered; a frame, once its first byte arrived, must be whole within
    ``frame_timeout`` seconds plus its length at ``min_rate`` bytes a second.
    ``max_connections`` bounds authenticated connections; ``max_unauthenticated`` (and
    ``max_unauthenticated_per_address`` from one address) those still in their handshake,
    which are refused (``Busy``) past it without touching the authenticated ones.
    ``namespace_quota`` bounds what one namespace holds (payload and overhead).
    """

    def __init__(
        self,
        listen: str = "127.0.0.1:0",
        *,
        memory_limit: int,
        token: bytes | None,
        max_frame: int = DEFAULT_MAX_FRAME,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
        frame_timeout: float = DEFAULT_FRAME_TIMEOUT,
        pool_limit: int | None = None,
        idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
        keepalive: float | None = DEFAULT_KEEPALIVE,
        min_rate: int = DEFAULT_MIN_RATE,
        max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED,
        max_unauthenticated_per_address: int = DEFAULT_MAX_UNAUTHENTICATED_PER_ADDRESS,
        namespace_quota: int | None = None,
    ) -> None:
        if idle_timeout is not None and idle_timeout <= 0:
            raise ConfigError(f"idle timeout must be positive, got {idle_timeout}")
        if keepalive is not None and keepalive < 1:
            raise ConfigError(f"keepalive must be at least 1 second, got {keepalive}")
        if memory_limit <= 0:
            raise ConfigError(f"memory limit must be positive, got {memory_limit}")
        if max_frame < HANDSHAKE_MAX_FRAME:
            raise ConfigError(f"max frame must be at least {HANDSHAKE_MAX_FRAME} bytes")
        if token is not None and not token:
            raise ConfigError("the token is empty")
        if handshake_timeout <= 0 or frame_timeout <= 0 or min_rate <= 0:
            raise ConfigError("handshake and frame timeouts and the minimum rate must be positive")
        if min(max_connections, max_unauthenticated, max_unauthenticated_per_address) < 1:
            raise ConfigError("connection limits must be at least 1")
        if namespace_quota is not None and namespace_quota <= 0:
            raise ConfigError(f"namespace quota must be positive, got {namespace_quota}")
        self._host, self._port = parse_address(listen)
        self._token = token
        self.max_frame = max_frame
        self.max_connections = max_connections
        self._handshake_timeout = handshake_timeout
        self._frame_timeout = frame_timeout
        self.min_rate = min_rate
        self.max_unauthenticated = max_unauthenticated
        self.max_unauthenticated_per_address = max_unauthenticated_per_address
        self.idle_timeout = idle_timeout
        self.keepalive = keepalive
        #: Connections closed for being idle (for tests and ``stats``).
        self.idle_closed = 0
        #: Connections cut for missing the handshake or a frame deadline, and refused for
        #: the unauthenticated caps (for tests and ``stats``).
        self.deadline_closed = 0
        self.refused_unauthenticated = 0
        pool = BufferPool(memory_limit // 8 if pool_limit is None else pool_limit)
        self._store = MemoryStore(memory_limit, pool, namespace_quota)
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._conns: dict[int, tuple[socket.socket, threading.Thread]] = {}
        # connections still in their handshake: id -> the peer's address (host only)
        self._unauthenticated: dict[int, str] = {}
        self._next_conn = 0
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._started_at = time.monotonic()
        self.address = ""
        self._ops = Handlers(self._store, max_frame=max_frame, stats=self.stats).ops

    # --- lifecycle ---

    def start(self) -> int:
        """Bind, start accepting on a background thread, and return the bound port."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self._host or "0.0.0.0", self._port))
            listener.listen(128)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        host, port = listener.getsockname()[:2]
        port = int(port)
        self._port = port
        self.address = format_address(str(host), port)
        self._started_at = time.monotonic()
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"peer-accept-{port}", daemon=True
        )
        self._accept_thread.start()
        log.info(
            "serving on %s (memory limit %d bytes, max frame %d bytes, auth %s)",
            self.address,
            self._store.memory_limit,
            self.max_frame,
            "on" if self._token is not None else "OFF",
        )
        return port

    @property
    def port(self) -> int:
        return self._port

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, close every connection and wait (bounded) for their threads."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._accept_thread is not None:
            self._accept_thread.join(timeout)
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            conns = list(self._conns.values())
        for sock, _ in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout
        for _, thread in conns:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._wake_r.close()
        self._wake_w.close()
        log.info("stopped %s", self.address)

    def __enter__(self) -> PeerServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stats(self, only: str | None = None) -> dict[str, Any]:
        """What the daemon holds and how much memory it uses (the ``stats`` reply);
        ``only``: list that namespace alone (a namespace-token client's view)."""
        with self._lock:
            connections = len(self._conns)
            unauthenticated = len(self._unauthenticated)
        base = {
            "server": "tiercheck-peer",
            "version": PROTOCOL_VERSION,
            "address": self.address,
            "auth": self._token is not None,
            "max_frame": self.max_frame,
            "idle_timeout": self.idle_timeout,
            "uptime_s": round(time.monotonic() - self._started_at, 3),
        }
        if only is not None:  # a namespace-token client: nothing about other clients
            return {**base, **self._store.stats(only)}
        return {
            **base,
            "connections": connections - unauthenticated,
            "unauthenticated": unauthenticated,
            "max_connections": self.max_connections,
            "max_unauthenticated": self.max_unauthenticated,
            "max_unauthenticated_per_address": self.max_unauthenticated_per_address,
            "handshake_timeout": self._handshake_timeout,
            "frame_timeout": self._frame_timeout,
            "min_rate": self.min_rate,
            "idle_closed": self.idle_closed,
            "deadline_closed": self.deadline_closed,
            "refused_unauthenticated": self.refused_unauthenticated,
            **self._store.stats(None),
        }

    # --- accepting ---

    def _accept_loop(self) -> None:
        assert self._listener is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self._stopping.is_set():
                for key, _ in sel.select():
                    if key.fileobj is self._wake_r:
                        return
                    try:
                        sock, peer = self._listener.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError as exc:
                        # Out of descriptors or similar: back off instead of spinning.
                        log.error("accept failed on %s: %s", self.address, exc)
                        self._stopping.wait(0.1)
                        continue
                    self._admit(sock, peer)

    def _admit(self, sock: socket.socket, peer: Any) -> None:
        """Serve a new connection on a thread of its own, unless the unauthenticated caps
        are reached: then it is refused (``Busy``) at once, and nothing waits on it."""
        host = str(peer[0])
        name = format_address(host, int(peer[1]))
        with self._lock:
            from_host = sum(1 for h in self._unauthenticated.values() if h == host)
            busy = (
                len(self._unauthenticated) >= self.max_unauthenticated
                or from_host >= self.max_unauthenticated_per_address
            )
            if busy:
                self.refused_unauthenticated += 1
            else:
                conn_id = self._next_conn
                self._next_conn += 1
                thread = threading.Thread(
                    target=self._serve_connection,
                    args=(conn_id, sock, name),
                    name=f"peer-conn-{name}",
                    daemon=True,
                )
                self._conns[conn_id] = (sock, thread)
                self._unauthenticated[conn_id] = host
        if busy:
            log.warning(
                "%s: refused, %d connections in their handshake (%d from this address)",
                name,
                len(self._unauthenticated),
                from_host,
            )
            # never wait on it here: the accept loop must not be held by a client
            with contextlib.suppress(OSError):
                sock.setblocking(False)
                send_frame(
                    sock,
                    {
                        "ok": False,
                        "error": "Busy",
                        "message": "busy: too many connections in their handshake; retry later",
                        "close": True,
                    },
                )
            sock.close()
            return
        sock.setblocking(True)
        thread.start()

    def _authenticated(self, conn_id: int) -> None:
        """Move a connection whose hello passed to the authenticated ones; ``Busy`` if
        ``max_connections`` of those are open."""
        with self._lock:
            authenticated = len(self._conns) - len(self._unauthenticated)
            if authenticated >= self.max_connections:
                raise Refused(
                    "Busy",
                    f"busy: too many connections ({self.max_connections} open); retry later",
                    close=True,
                )
            self._unauthenticated.pop(conn_id, None)

    # --- one connection ---

    def _serve_connection(self, conn_id: int, sock: socket.socket, name: str) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.keepalive is not None:
                set_keepalive(sock, self.keepalive)
            deadline = time.monotonic() + self._handshake_timeout
            session = self._handshake(sock, name, deadline, conn_id)
            while True:
                frame = self._read_request(sock, self.max_frame, idle_ok=True)
                if frame is None:
                    log.debug("%s: disconnected", name)
                    return
                self._answer(sock, Request(session, *frame))
        except Refused as exc:
            log.error("%s: %s; closing the connection", name, exc)
            self._refuse(sock, exc)
        except FrameTooLarge as exc:
            log.error("%s: %s; closing the connection", name, exc)
            self._refuse(sock, Refused("FrameTooLarge", str(exc), close=True))
        except PeerClosed as exc:
            if exc.mid_frame:
                log.error("%s: %s; request dropped", name, exc)
            else:
                log.debug("%s: %s", name, exc)
        except ProtocolError as exc:
            log.error("%s: %s; closing the connection", name, exc)
            self._refuse(sock, Refused("BadFrame", str(exc), close=True))
        except _Idle:
            with self._lock:
                self.idle_closed += 1
            log.info("%s: idle for %s s; closing the connection", name, self.idle_timeout)
        except TimeoutError:
            with self._lock:
                self.deadline_closed += 1
            log.error("%s: missed the deadline of its handshake or of a frame; closed", name)
        except OSError as exc:
            if not self._stopping.is_set():
                log.error("%s: %s", name, exc)
        except Exception:  # a bug must cost one connection, never the daemon
            log.exception("%s: internal error; closing the connection", name)
        finally:
            sock.close()
            with self._lock:
                self._conns.pop(conn_id, None)
                self._unauthenticated.pop(conn_id, None)

    def _read_request(
        self, sock: socket.socket, limit: int, *, idle_ok: bool, deadline: float | None = None
    ) -> tuple[dict[str, Any], memoryview | None, bytearray] | None:
        """One request frame ``(fields, data, body)``, or None at a clean end of connection
        between frames.

        ``deadline`` (monotonic) bounds the whole frame, first byte included (the
        handshake's); otherwise the frame must be whole within ``frame_timeout`` plus its
        length at ``min_rate`` from its first byte, and before that the connection may be
        idle (``idle_ok``) for ``idle_timeout``. ``TimeoutError`` past a deadline.
        """
        header = memoryview(bytearray(4))
        idle_since = time.monotonic()
        if deadline is None and idle_ok:
            # idle between frames is fine for a while (the wait is cut into frame_timeout
            # slices, so a stop or an idle close is noticed)
            wait = self._frame_timeout
            if self.idle_timeout is not None:
                wait = min(wait, self.idle_timeout)
            while True:
                sock.settimeout(wait)
                try:
                    n = sock.recv_into(header)
                    break
                except TimeoutError:
                    if self._stopping.is_set():
                        raise
                    if (
                        self.idle_timeout is not None
                        and time.monotonic() - idle_since >= self.idle_timeout
                    ):
                        raise _Idle() from None
            if n == 0:
                return None
            done = n
        else:
            done = 0
        if deadline is None:
            deadline = time.monotonic() + self._frame_timeout
        done = self._recv_by(sock, header, done, deadline)
        if done == 0:
            return None
        length = int.from_bytes(header, "big")
        if length > limit:
            raise FrameTooLarge(length, limit)
        if length == 0:
            raise ProtocolError("empty frame")
        deadline += length / self.min_rate
        reserved = length if length >= RESERVE_MIN else 0
        if reserved and not self._store.reserve_frame(reserved):
            self._discard(sock, length, deadline)
            return {"op": _TOO_FULL, "length": length}, None, bytearray()
        try:
            body = self._store.pool.take(length)
            try:
                view = memoryview(body)[:length]
                self._recv_by(sock, view, 0, deadline, whole=True)
                fields, data = decode_body(view)
            except BaseException:
                self._store.pool.give(body)
                raise
        finally:
            # the request is applied next: what it stores is charged then
            if reserved:
                self._store.release_frame(reserved)
        return fields, data, body

    @staticmethod
    def _recv_by(
        sock: socket.socket, view: memoryview, done: int, deadline: float, *, whole: bool = False
    ) -> int:
        """Fill ``view[done:]`` before ``deadline``; return how much is filled: all of it,
        or 0 if the connection ended cleanly before a first byte (not ``whole``).
        ``PeerClosed`` if it ended in the middle, ``TimeoutError`` past the deadline."""
        while done < len(view):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"frame not whole by its deadline ({done}/{len(view)} bytes)")
            sock.settimeout(left)
            n = sock.recv_into(view[done:])
            if n == 0:
                if done == 0 and not whole:
                    return 0
                raise PeerClosed(done, len(view), mid_frame=True)
            done += n
        return done

    def _discard(self, sock: socket.socket, length: int, deadline: float) -> None:
        """Receive a frame's ``length`` body bytes into a small scratch buffer, keeping
        none: a frame whose length does not fit the memory limit is refused after it."""
        scratch = memoryview(bytearray(min(length, _SCRATCH)))
        left = length
        while left:
            n = self._recv_by(sock, scratch[: min(left, len(scratch))], 0, deadline, whole=True)
            left -= n

    def _authorise(self, mac: object, nonce: bytes, ns: str) -> bool:
        """Whether ``mac`` proves the admin token (True) or ``ns``'s namespace token
        (False); ``Refused`` if it proves neither."""
        assert self._token is not None
        if isinstance(mac, bytes):
            if hmac.compare_digest(mac, auth_mac(self._token, nonce)):
                return True
            ns_token = namespace_token(self._token, ns)
            if hmac.compare_digest(mac, auth_mac(ns_token, nonce)):
                return False
        raise Refused(
            "AuthFailed",
            "authentication failed: wrong or missing token (a namespace token opens its "
            "own namespace only)",
            close=True,
        )

    def _handshake(self, sock: socket.socket, name: str, deadline: float, conn_id: int) -> Session:
        """Challenge, hello, answer: all of it before ``deadline`` (``TimeoutError``); the
        connection counts as authenticated from the answer on (``Busy`` if none is free)."""
        nonce = os.urandom(NONCE_BYTES)
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        send_frame(
            sock,
            {
                "op": "challenge",
                "version": PROTOCOL_VERSION,
                "server": "tiercheck-peer",
                "auth": self._token is not None,
                "nonce": nonce,
            },
        )
        request = self._read_request(sock, HANDSHAKE_MAX_FRAME, idle_ok=False, deadline=deadline)
        if request is None:
            raise PeerClosed(0, 4, mid_frame=False)
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        hello = request[0]
        if hello.get("op") != "hello":
            raise Refused("BadRequest", "the first request must be a hello", close=True)
        if hello.get("version") != PROTOCOL_VERSION:
            raise Refused(
                "ProtocolVersion",
                f"protocol version {hello.get('version')!r} is not supported "
                f"(daemon speaks {PROTOCOL_VERSION})",
                close=True,
            )
        ns = hello.get("namespace")
        if not isinstance(ns, str) or not 0 < len(ns) <= MAX_NAMESPACE or not ns.isprintable():
            raise Refused(
                "BadRequest",
                f"namespace must be 1 to {MAX_NAMESPACE} printable characters, got {ns!r}",
                close=True,
            )
        admin = True if self._token is None else self._authorise(hello.get("mac"), nonce, ns)
        budget = hello.get("budget")
        if budget is not None:
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
                raise Refused("BadRequest", "'budget' must be a non-negative integer", close=True)
            self._store.set_budget(ns, budget)
        self._authenticated(conn_id)
        send_frame(
            sock,
            {
                "ok": True,
                "version": PROTOCOL_VERSION,
                "namespace": ns,
                "max_frame": self.max_frame,
                "memory_limit": self._store.memory_limit,
                "idle_timeout": self.idle_timeout,
            },
        )
        log.debug("%s: hello, namespace %r%s", name, ns, "" if admin else " (namespace token)")
        return Session(ns, admin)

    def _answer(self, sock: socket.socket, request: Request) -> None:
        reply: Reply | None = None
        sock.settimeout(self._frame_timeout)
        try:
            op = request.fields.get("op")
            if op is _TOO_FULL:  # see _read_request: its body was not kept
                length = request.fields["length"]
                raise Refused(
                    "TierFull",
                    f"peer memory full: a frame of {length} bytes does not fit "
                    f"{self._store.memory_limit} bytes with what is held and being received; "
                    "raise --memory-limit or delete old versions",
                    over_budget=True,
                    needed=length,
                    held=self._store.used,
                    budget=self._store.memory_limit,
                )
            if not isinstance(op, str):
                raise Refused("BadRequest", "a request needs a string 'op'", close=True)
            handler = self._ops.get(op)
            if handler is None:
                raise Refused("Unsupported", f"unknown request {op!r}")
            reply = handler(request)
        except Refused as exc:
            if exc.close:
                raise
            send_frame(sock, {"ok": False, "error": exc.code, "message": exc.message, **exc.extra})
            return
        finally:
            if reply is None or not reply.keeps_body:
                self._store.pool.give(request.body)
        try:
            send_frame(sock, {"ok": True, **reply.fields}, reply.data)
        finally:
            if reply.done is not None:
                reply.done()

    @staticmethod
    def _refuse(sock: socket.socket, exc: Refused) -> None:
        """Send a closing error frame so the client can read why, then end the connection.

        Half-closing and draining what the client was still sending avoids a reset that
        could discard the error frame before the client reads it.
        """
        try:
            sock.settimeout(1.0)
            send_frame(
                sock,
                {"ok": False, "error": exc.code, "message": exc.message, "close": True},
            )
            sock.shutdown(socket.SHUT_WR)
            drained = 0
            while drained < (4 << 20):
                n = len(sock.recv(65536))
                if n == 0:
                    break
                drained += n
        except OSError:
            pass
