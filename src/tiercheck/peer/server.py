"""The peer-memory daemon: keeps other nodes' blobs and log records in this node's memory.

``tiercheck peer serve`` (and ``python -m tiercheck.peer.server``) runs it; ranks on other
nodes reach it through the ``peer://host:port[/namespace]`` tier. Every client names a
namespace (its rank or store name) in its hello, so several ranks replicate into one
daemon without colliding. The wire protocol is in ``docs/peer-protocol.md``.

Concurrency: one thread per connection, blocking sockets. A rank's client keeps a few
connections open, so a daemon serves tens of connections, not thousands; a blocked
``recv_into`` releases the GIL, and blocking I/O lets a blob be received straight into
the buffer that then stores it, which an asyncio stream (it buffers and copies) would
not. ``max_connections`` bounds the thread count. The store takes one lock for dict
updates only; no bytes are copied under it.

Resources: ``memory_limit`` bounds what the daemon holds across namespaces: every blob
and log record is charged its bytes plus a fixed per-object overhead (``OBJECT_OVERHEAD``,
``RECORD_OVERHEAD``), and a frame over ``RESERVE_MIN`` reserves its length before its body
is received (one that does not fit is read into a small scratch buffer, discarded, and
refused), so frames in flight count too. ``namespace_quota`` bounds one namespace the same
way, and a client may give its namespace a smaller ``budget`` in its hello (the tier option
of that name); a write past any of them is refused (``OverBudget``). Empty blobs and empty
log records are refused (``BadRequest``): an object of no bytes would cost only overhead.
A connection idle between requests for ``idle_timeout`` seconds is closed, and TCP
keepalive probes find a peer whose node died without closing its connections, so a
crashed client's connection slot is freed.

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

import argparse
import contextlib
import hmac
import json
import logging
import os
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiercheck.backends._peer_protocol import (
    DEFAULT_MAX_FRAME,
    HANDSHAKE_MAX_FRAME,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    TOKEN_ENV,
    FrameTooLarge,
    PeerClosed,
    ProtocolError,
    auth_mac,
    decode_body,
    load_token_file,
    send_frame,
    set_keepalive,
    token_from_env,
)
from tiercheck.backends.base import BLOB_ID_RE
from tiercheck.core.sizes import parse_size
from tiercheck.errors import ConfigError

__all__ = [
    "PeerServer",
    "format_address",
    "main",
    "main_serve",
    "main_status",
    "namespace_token",
    "parse_address",
    "parse_size",
    "peer_status",
    "serve",
]

log = logging.getLogger(__name__)

_MAX_NAMESPACE = 255
_MAX_LIST_PAGE = 100_000
_MAX_IDS = 100_000


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


# --- the store -----------------------------------------------------------------------


class _Refused(Exception):
    """A request the daemon answers with an error frame. ``close`` ends the connection."""

    def __init__(self, code: str, message: str, *, close: bool = False, **extra: Any) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.close = close
        self.extra = extra


@dataclass(frozen=True)
class _Session:
    """What a connection's hello established."""

    ns: str
    admin: bool  # proved the daemon's token (not a namespace token)


@dataclass(frozen=True)
class _Request:
    session: _Session
    fields: dict[str, Any]
    data: memoryview | None
    body: bytearray  # the frame buffer, from the pool; ``data`` may point into it

    @property
    def ns(self) -> str:
        return self.session.ns


@dataclass(frozen=True)
class _Reply:
    fields: dict[str, Any]
    data: memoryview | None = None
    keeps_body: bool = False  # the store now owns the request's frame buffer
    done: Callable[[], None] | None = None  # called once the reply is sent


# Frames at least this large are received into recycled buffers.
_POOL_MIN = 1 << 20

#: Bytes charged for each blob besides its payload: its id, its entry in the namespace's
#: dict, its bookkeeping objects and the allocator's rounding. Measured on CPython 3.11
#: (benchmarks/peer_abuse.py, 40,000 one-byte blobs): about 800 bytes of RSS each.
OBJECT_OVERHEAD = 1024
#: Bytes charged for each log record besides its payload (a bytes object and a list slot).
RECORD_OVERHEAD = 128
#: A frame at least this large reserves its length against the memory limit before its
#: body is received; smaller ones (requests, handshakes) are bounded by the connection caps.
RESERVE_MIN = HANDSHAKE_MAX_FRAME
_SCRATCH = 1 << 16
# The "op" of a frame refused for want of memory (never a string, so no client sends it).
_TOO_FULL = object()


def _size_class(n: int) -> int:
    """Capacity of a pooled buffer for ``n`` bytes: ``n`` rounded up to 1/64 of its power
    of two, so at most 1.6% is wasted and equal chunk sizes share a class."""
    step = max(1, (1 << (n.bit_length() - 1)) // 64)
    return -(-n // step) * step


class _BufferPool:
    """Recycles the receive buffers of large frames.

    Storing a blob means receiving it into fresh memory, and first-touch page faults cost
    several times the copy itself (measured here: 4.7 ms to allocate 4 MiB, 0.3 ms to fill
    it warm). Retention deletes old versions while new ones arrive with the same chunk
    sizes, so deleted blobs' buffers are kept (up to ``limit`` bytes) for the next puts.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0
        self._free: dict[int, list[bytearray]] = {}
        self._lock = threading.Lock()

    def take(self, n: int) -> bytearray:
        if n < _POOL_MIN:
            return bytearray(n)
        wanted = _size_class(n)
        with self._lock:
            size = wanted
            for _ in range(4):  # the exact class or up to 3 classes larger (< 5% waste)
                free = self._free.get(size)
                if free:
                    self.bytes -= size
                    return free.pop()
                size = _size_class(size + 1)
        return bytearray(wanted)

    def give(self, buf: bytearray | None) -> None:
        if buf is None:
            return
        n = len(buf)
        if n < _POOL_MIN or n != _size_class(n):
            return
        with self._lock:
            if self.bytes + n <= self.limit:
                self._free.setdefault(n, []).append(buf)
                self.bytes += n


@dataclass(eq=False, slots=True)
class _Blob:
    data: memoryview
    owner: bytearray | None = None  # pooled frame buffer that ``data`` points into
    pins: int = 0  # replies sending ``data`` right now
    dropped: bool = False  # deleted while pinned: recycle ``owner`` at the last unpin
    charge: int = 0  # bytes charged against the memory limit (payload or buffer + overhead)


@dataclass
class _Namespace:
    blobs: dict[str, _Blob] = field(default_factory=dict)
    log: list[bytes] = field(default_factory=list)
    blob_bytes: int = 0
    log_bytes: int = 0
    charged: int = 0  # payload and overhead, against the namespace quota
    budget: int | None = None  # set by the hello of a client that gives one


class _Store:
    """Blobs and log records per namespace, under one memory limit: payload, per-object
    overhead and the frames being received all count (``used + inflight``)."""

    def __init__(
        self, memory_limit: int, pool: _BufferPool, namespace_quota: int | None = None
    ) -> None:
        self.memory_limit = memory_limit
        self.namespace_quota = namespace_quota
        self.used = 0
        self.inflight = 0
        self.pool = pool
        self._lock = threading.Lock()
        self._spaces: dict[str, _Namespace] = {}

    def _drop(self, blob: _Blob) -> None:
        # Called under the lock. A pinned buffer is being sent: recycle it after that.
        if blob.pins:
            blob.dropped = True
        else:
            self.pool.give(blob.owner)

    def _space(self, ns: str) -> _Namespace:
        space = self._spaces.get(ns)
        if space is None:
            space = self._spaces[ns] = _Namespace()
        return space

    def reserve_frame(self, n: int) -> bool:
        """Reserve ``n`` bytes for a frame about to be received; False if they do not fit."""
        with self._lock:
            if self.used + self.inflight + n > self.memory_limit:
                return False
            self.inflight += n
            return True

    def release_frame(self, n: int) -> None:
        with self._lock:
            self.inflight -= n

    def _reserve(
        self, n: int, what: str, space: _Namespace | None = None, charge: int | None = None
    ) -> None:
        """Refuse unless ``n`` more payload bytes (``charge`` more charged ones, payload
        and overhead) fit the namespace's budget, its quota and the memory limit."""
        charge = n if charge is None else charge
        if (
            space is not None
            and self.namespace_quota is not None
            and charge > 0
            and space.charged + charge > self.namespace_quota
        ):
            raise _Refused(
                "TierFull",
                f"namespace quota exceeded: {what} needs {charge} bytes with overhead, "
                f"{space.charged} of {self.namespace_quota} bytes held; drop old "
                "versions or ask for a larger --namespace-quota",
                over_budget=True,
                needed=charge,
                held=space.charged,
                budget=self.namespace_quota,
            )
        if charge > 0 and self.used + self.inflight + charge > self.memory_limit:
            raise _Refused(
                "TierFull",
                f"peer memory full: {what} needs {charge} bytes with overhead, {self.used} of "
                f"{self.memory_limit} bytes in use ({self.inflight} being received); raise "
                "--memory-limit or delete old versions",
                over_budget=True,
                needed=charge,
                held=self.used,
                budget=self.memory_limit,
            )
        if n <= 0:
            return
        if space is not None and space.budget is not None:
            held = space.blob_bytes + space.log_bytes
            if held + n > space.budget:
                raise _Refused(
                    "TierFull",
                    f"namespace budget exceeded: {what} needs {n} bytes, {held} of "
                    f"{space.budget} bytes held; drop old versions or raise the tier's budget",
                    over_budget=True,
                    needed=n,
                    held=held,
                    budget=space.budget,
                )

    def set_budget(self, ns: str, budget: int | None) -> None:
        with self._lock:
            self._space(ns).budget = budget

    def usage(self, ns: str) -> int:
        with self._lock:
            space = self._spaces.get(ns)
            return space.blob_bytes if space else 0

    def put(
        self, ns: str, blob_id: str, data: memoryview, overwrite: bool, owner: bytearray | None
    ) -> bool:
        """Store ``data`` (which points into ``owner``, if given); True if it was stored."""
        with self._lock:
            space = self._space(ns)
            old = space.blobs.get(blob_id)
            if old is not None and not overwrite:
                return False
            delta = data.nbytes - (old.data.nbytes if old is not None else 0)
            # the buffer kept is the whole frame where the payload points into it
            charge = max(data.nbytes, len(owner) if owner is not None else 0) + OBJECT_OVERHEAD
            extra = charge - (old.charge if old is not None else 0)
            self._reserve(delta, f"blob {blob_id}", space, extra)
            space.blobs[blob_id] = _Blob(data, owner, charge=charge)
            space.blob_bytes += delta
            space.charged += extra
            self.used += extra
            if old is not None:
                self._drop(old)
            return True

    def size(self, ns: str, blob_id: str) -> int | None:
        with self._lock:
            space = self._spaces.get(ns)
            blob = space.blobs.get(blob_id) if space else None
            return None if blob is None else blob.data.nbytes

    def checkout(self, ns: str, blob_id: str) -> _Blob | None:
        """The blob, pinned so that its buffer is not recycled until :meth:`checkin`."""
        with self._lock:
            space = self._spaces.get(ns)
            blob = space.blobs.get(blob_id) if space else None
            if blob is not None:
                blob.pins += 1
            return blob

    def checkin(self, blob: _Blob) -> None:
        with self._lock:
            blob.pins -= 1
            if blob.dropped and not blob.pins:
                self.pool.give(blob.owner)

    def has(self, ns: str, ids: list[str]) -> list[str]:
        with self._lock:
            space = self._spaces.get(ns)
            return [i for i in ids if i in space.blobs] if space else []

    def delete(self, ns: str, ids: list[str]) -> int:
        removed = 0
        with self._lock:
            space = self._spaces.get(ns)
            if space is None:
                return 0
            for blob_id in ids:
                blob = space.blobs.pop(blob_id, None)
                if blob is not None:
                    removed += 1
                    space.blob_bytes -= blob.data.nbytes
                    space.charged -= blob.charge
                    self.used -= blob.charge
                    self._drop(blob)
        return removed

    def list_page(self, ns: str, after: str | None, limit: int) -> tuple[list[str], bool]:
        with self._lock:
            space = self._spaces.get(ns)
            ids = list(space.blobs) if space else []
        ids.sort()
        if after is not None:
            ids = [i for i in ids if i > after]
        return ids[:limit], len(ids) > limit

    def append(self, ns: str, record: bytes) -> int:
        with self._lock:
            space = self._space(ns)
            charge = len(record) + RECORD_OVERHEAD
            self._reserve(len(record), "log record", space, charge)
            space.log.append(record)
            space.log_bytes += len(record)
            space.charged += charge
            self.used += charge
            return len(space.log) - 1

    def replace_log_prefix(self, ns: str, count: int, record: bytes) -> None:
        """Replace the first ``count`` records of ``ns``'s log with ``record`` (atomic:
        under the store lock)."""
        with self._lock:
            space = self._spaces.get(ns)
            n = len(space.log) if space else 0
            if space is None or not 1 <= count <= n:
                raise _Refused("OutOfRange", f"count {count} is outside the log of {n} records")
            freed = sum(len(r) for r in space.log[:count])
            extra = len(record) - freed + RECORD_OVERHEAD * (1 - count)
            self._reserve(len(record) - freed, "log checkpoint", space, extra)
            space.log[:count] = [record]
            space.log_bytes += len(record) - freed
            space.charged += extra
            self.used += extra

    def read_log(self, ns: str, start: int, max_bytes: int) -> tuple[list[bytes], bool]:
        with self._lock:
            space = self._spaces.get(ns)
            records = space.log[start:] if space else []
        page: list[bytes] = []
        size = 0
        for record in records:
            # 8 bytes of msgpack tag per record, so tiny records cannot swell the reply.
            if page and size + len(record) + 8 > max_bytes:
                return page, True
            page.append(record)
            size += len(record) + 8
        return page, False

    def stats(self, only: str | None = None) -> dict[str, Any]:
        """Totals, and per namespace; with ``only``, that namespace's alone, totals
        included (a namespace-token client learns nothing of the others)."""
        with self._lock:
            spaces: dict[str, dict[str, Any]] = {
                name: {
                    "blobs": len(s.blobs),
                    "bytes": s.blob_bytes,
                    "records": len(s.log),
                    "log_bytes": s.log_bytes,
                    "charged": s.charged,
                    "budget": s.budget,
                    "quota": self.namespace_quota,
                }
                for name, s in sorted(self._spaces.items())
                if only is None or name == only
            }
            used, inflight = self.used, self.inflight
        if only is not None:
            mine = spaces.get(only, {"bytes": 0, "charged": 0})
            return {
                "blobs": sum(s["blobs"] for s in spaces.values()),
                "bytes": mine["bytes"],
                "memory_used": mine["charged"],
                "memory_limit": min(self.memory_limit, self.namespace_quota or self.memory_limit),
                "namespaces": spaces,
            }
        return {
            "blobs": sum(s["blobs"] for s in spaces.values()),
            "bytes": sum(s["bytes"] + s["log_bytes"] for s in spaces.values()),
            "memory_used": used,
            "memory_inflight": inflight,
            "memory_limit": self.memory_limit,
            "namespace_quota": self.namespace_quota,
            "recycled_buffer_bytes": self.pool.bytes,
            "namespaces": spaces,
        }


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


# --- request arguments ---------------------------------------------------------------


def _blob_id(value: object) -> str:
    if not isinstance(value, str) or not BLOB_ID_RE.match(value):
        raise _Refused("BadRequest", f"invalid blob id {value!r}", close=True)
    return value


def _blob_ids(value: object) -> list[str]:
    if not isinstance(value, list) or len(value) > _MAX_IDS:
        raise _Refused("BadRequest", f"'ids' must be a list of at most {_MAX_IDS}", close=True)
    return [_blob_id(v) for v in value]


def _require_data(data: memoryview | None, op: str) -> memoryview:
    if data is None:
        raise _Refused("BadRequest", f"{op} needs 'data'", close=True)
    return data


def _not_empty(nbytes: int, what: str) -> None:
    if not nbytes:
        raise _Refused(
            "BadRequest",
            f"{what} of 0 bytes is refused: it would hold only overhead (the peer tier "
            "stores none; a client must not send one)",
        )


def _int_arg(fields: dict[str, Any], name: str, default: int) -> int:
    value = fields.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _Refused("BadRequest", f"{name!r} must be a non-negative integer", close=True)
    return value


# --- the server ----------------------------------------------------------------------


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
        pool = _BufferPool(memory_limit // 8 if pool_limit is None else pool_limit)
        self._store = _Store(memory_limit, pool, namespace_quota)
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
        self._ops: dict[str, Callable[[_Request], _Reply]] = {
            "ping": self._op_ping,
            "put": self._op_put,
            "put_many": self._op_put_many,
            "get": self._op_get,
            "size": self._op_size,
            "has": self._op_has,
            "delete": self._op_delete,
            "list": self._op_list,
            "append": self._op_append,
            "read_log": self._op_read_log,
            "replace_log_prefix": self._op_replace_log_prefix,
            "usage": self._op_usage,
            "set_budget": self._op_set_budget,
            "stats": self._op_stats,
        }

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
                raise _Refused(
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
                self._answer(sock, _Request(session, *frame))
        except _Refused as exc:
            log.error("%s: %s; closing the connection", name, exc)
            self._refuse(sock, exc)
        except FrameTooLarge as exc:
            log.error("%s: %s; closing the connection", name, exc)
            self._refuse(sock, _Refused("FrameTooLarge", str(exc), close=True))
        except PeerClosed as exc:
            if exc.mid_frame:
                log.error("%s: %s; request dropped", name, exc)
            else:
                log.debug("%s: %s", name, exc)
        except ProtocolError as exc:
            log.error("%s: %s; closing the connection", name, exc)
            self._refuse(sock, _Refused("BadFrame", str(exc), close=True))
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
        (False); ``_Refused`` if it proves neither."""
        assert self._token is not None
        if isinstance(mac, bytes):
            if hmac.compare_digest(mac, auth_mac(self._token, nonce)):
                return True
            ns_token = namespace_token(self._token, ns)
            if hmac.compare_digest(mac, auth_mac(ns_token, nonce)):
                return False
        raise _Refused(
            "AuthFailed",
            "authentication failed: wrong or missing token (a namespace token opens its "
            "own namespace only)",
            close=True,
        )

    def _handshake(self, sock: socket.socket, name: str, deadline: float, conn_id: int) -> _Session:
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
            raise _Refused("BadRequest", "the first request must be a hello", close=True)
        if hello.get("version") != PROTOCOL_VERSION:
            raise _Refused(
                "ProtocolVersion",
                f"protocol version {hello.get('version')!r} is not supported "
                f"(daemon speaks {PROTOCOL_VERSION})",
                close=True,
            )
        ns = hello.get("namespace")
        if not isinstance(ns, str) or not 0 < len(ns) <= _MAX_NAMESPACE or not ns.isprintable():
            raise _Refused(
                "BadRequest",
                f"namespace must be 1 to {_MAX_NAMESPACE} printable characters, got {ns!r}",
                close=True,
            )
        admin = True if self._token is None else self._authorise(hello.get("mac"), nonce, ns)
        budget = hello.get("budget")
        if budget is not None:
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
                raise _Refused("BadRequest", "'budget' must be a non-negative integer", close=True)
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
        return _Session(ns, admin)

    def _answer(self, sock: socket.socket, request: _Request) -> None:
        reply: _Reply | None = None
        sock.settimeout(self._frame_timeout)
        try:
            op = request.fields.get("op")
            if op is _TOO_FULL:  # see _read_request: its body was not kept
                length = request.fields["length"]
                raise _Refused(
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
                raise _Refused("BadRequest", "a request needs a string 'op'", close=True)
            handler = self._ops.get(op)
            if handler is None:
                raise _Refused("Unsupported", f"unknown request {op!r}")
            reply = handler(request)
        except _Refused as exc:
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
    def _refuse(sock: socket.socket, exc: _Refused) -> None:
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

    # --- requests ---

    def _op_ping(self, req: _Request) -> _Reply:
        return _Reply({})

    def _op_put(self, req: _Request) -> _Reply:
        blob_id = _blob_id(req.fields.get("id"))
        payload = _require_data(req.data, "put")
        _not_empty(payload.nbytes, "a blob")
        # Usually the payload points into the frame buffer, which the store then keeps.
        owner = req.body if payload.obj is req.body else None
        overwrite = bool(req.fields.get("overwrite", False))
        written = self._store.put(req.ns, blob_id, payload.toreadonly(), overwrite, owner)
        return _Reply({"written": written}, keeps_body=written and owner is not None)

    def _op_put_many(self, req: _Request) -> _Reply:
        ids = _blob_ids(req.fields.get("ids"))
        sizes = req.fields.get("sizes")
        payload = _require_data(req.data, "put_many")
        if (
            not isinstance(sizes, list)
            or len(sizes) != len(ids)
            or not all(isinstance(s, int) and s > 0 for s in sizes)
            or sum(sizes) != payload.nbytes
        ):
            raise _Refused(
                "BadRequest",
                "put_many 'sizes' do not match 'ids' and data, or name an empty blob "
                "(refused: it would cost only overhead)",
            )
        written = 0
        pos = 0
        for blob_id, size in zip(ids, sizes):
            # Copy each small blob out so that one kept blob does not pin the whole frame.
            piece = memoryview(bytes(payload[pos : pos + size]))
            pos += size
            try:
                written += self._store.put(req.ns, blob_id, piece, False, None)
            except _Refused as exc:
                exc.extra["written"] = written
                raise
        return _Reply({"written": written})

    def _op_get(self, req: _Request) -> _Reply:
        blob_id = _blob_id(req.fields.get("id"))
        length = req.fields.get("length")
        if length is not None and (not isinstance(length, int) or length < 0):
            raise _Refused("BadRequest", "get 'length' must be a non-negative int")
        blob = self._store.checkout(req.ns, blob_id)
        if blob is None:
            raise _Refused("NotFound", f"blob {blob_id} not found in namespace {req.ns!r}")
        data = blob.data if length is None else blob.data[:length]  # length: a prefix (head)
        return _Reply({}, data, done=lambda: self._store.checkin(blob))

    def _op_size(self, req: _Request) -> _Reply:
        blob_id = _blob_id(req.fields.get("id"))
        size = self._store.size(req.ns, blob_id)
        if size is None:
            raise _Refused("NotFound", f"blob {blob_id} not found in namespace {req.ns!r}")
        return _Reply({"size": size})

    def _op_has(self, req: _Request) -> _Reply:
        return _Reply({"ids": self._store.has(req.ns, _blob_ids(req.fields.get("ids")))})

    def _op_delete(self, req: _Request) -> _Reply:
        return _Reply({"removed": self._store.delete(req.ns, _blob_ids(req.fields.get("ids")))})

    def _op_list(self, req: _Request) -> _Reply:
        after = req.fields.get("after")
        if after is not None and not isinstance(after, str):
            raise _Refused("BadRequest", "'after' must be a string", close=True)
        # A page of ids (about 67 bytes each in msgpack) must fit in one reply frame.
        page_max = min(_MAX_LIST_PAGE, self.max_frame // 80)
        limit = min(_int_arg(req.fields, "limit", page_max), page_max)
        ids, more = self._store.list_page(req.ns, after, max(limit, 1))
        return _Reply({"ids": ids, "more": more})

    def _op_append(self, req: _Request) -> _Reply:
        record = bytes(_require_data(req.data, "append"))
        _not_empty(len(record), "a log record")
        return _Reply({"index": self._store.append(req.ns, record)})

    def _op_read_log(self, req: _Request) -> _Reply:
        start = _int_arg(req.fields, "start", 0)
        records, more = self._store.read_log(req.ns, start, self.max_frame // 2)
        return _Reply({"records": records, "next": start + len(records), "more": more})

    def _op_replace_log_prefix(self, req: _Request) -> _Reply:
        record = bytes(_require_data(req.data, "replace_log_prefix"))
        _not_empty(len(record), "a log record")
        count = _int_arg(req.fields, "count", 0)
        self._store.replace_log_prefix(req.ns, count, record)
        return _Reply({})

    def _op_set_budget(self, req: _Request) -> _Reply:
        budget = req.fields.get("budget")
        if budget is not None and (
            not isinstance(budget, int) or isinstance(budget, bool) or budget < 0
        ):
            raise _Refused("BadRequest", "'budget' must be a non-negative integer or nil")
        self._store.set_budget(req.ns, budget)
        return _Reply({})

    def _op_usage(self, req: _Request) -> _Reply:
        return _Reply({"bytes": self._store.usage(req.ns)})

    def _op_stats(self, req: _Request) -> _Reply:
        return _Reply({"stats": self.stats(None if req.session.admin else req.ns)})


# --- running it ----------------------------------------------------------------------


def serve(
    listen: str,
    *,
    memory_limit: int,
    token: bytes | None,
    max_frame: int = DEFAULT_MAX_FRAME,
    insecure_no_auth: bool = False,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
    keepalive: float | None = DEFAULT_KEEPALIVE,
    announce: Callable[[str], None] | None = None,
    stop: threading.Event | None = None,
    **limits: Any,
) -> None:
    """Run the daemon until SIGTERM/SIGINT (or until ``stop`` is set, when given).

    A token is required unless ``insecure_no_auth``. ``announce`` is called with the bound
    ``HOST:PORT`` once clients can connect. Without ``stop`` this must run on the main
    thread: it blocks SIGTERM and SIGINT and waits for them with ``sigwait``. ``limits``
    are :class:`PeerServer`'s other keyword arguments (deadlines, unauthenticated caps,
    the namespace quota).
    """
    if token is None and not insecure_no_auth:
        raise ConfigError(
            "the peer daemon needs a shared-secret token: pass --token-file FILE or set "
            f"{TOKEN_ENV}; --insecure-no-auth disables authentication"
        )
    if token is not None and insecure_no_auth:
        raise ConfigError("a token and --insecure-no-auth were both given; choose one")
    server = PeerServer(
        listen,
        memory_limit=memory_limit,
        token=token,
        max_frame=max_frame,
        max_connections=max_connections,
        idle_timeout=idle_timeout,
        keepalive=keepalive,
        **limits,
    )
    if token is None and server._host not in ("127.0.0.1", "::1", "localhost"):
        log.warning("authentication is OFF on a non-loopback address %s", listen)
    if stop is not None:
        server.start()
        try:
            if announce is not None:
                announce(server.address)
            stop.wait()
        finally:
            server.stop()
        return
    signals = {signal.SIGTERM, signal.SIGINT}
    # Blocked before any thread starts, so every thread inherits the mask and a signal
    # waits, pending, for sigwait below (no handler runs in the middle of anything).
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        server.start()
        try:
            if announce is not None:
                announce(server.address)
            received = signal.sigwait(signals)
            log.info("received %s, shutting down", signal.Signals(received).name)
        finally:
            server.stop()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def peer_status(
    address: str,
    *,
    token: bytes | str | None = None,
    token_file: str | None = None,
    timeout: float = 10.0,
) -> dict[str, Any]:
    """Ask the daemon at ``HOST:PORT`` what it holds (the ``stats`` reply as a dict).

    The token comes from ``token``, ``token_file`` or ``TIERCHECK_PEER_TOKEN``. Raises
    ``TierUnavailable`` when the daemon cannot be reached.
    """
    from tiercheck.backends._peer import PeerTier

    tier = PeerTier(f"peer://{address}", token=token, token_file=token_file, timeout=timeout)
    try:
        return tier.stats()
    finally:
        tier.close()


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tiercheck peer serve`` (shared with ``python -m``)."""
    parser.add_argument("--listen", required=True, metavar="HOST:PORT", help="address to bind")
    parser.add_argument(
        "--memory-limit",
        required=True,
        type=parse_size,
        metavar="SIZE",
        help="bytes of blobs and log records to hold, e.g. 64GiB",
    )
    parser.add_argument(
        "--token-file", metavar="FILE", help=f"shared-secret token file (else ${TOKEN_ENV})"
    )
    parser.add_argument(
        "--insecure-no-auth", action="store_true", help="accept clients without a token"
    )
    parser.add_argument(
        "--max-frame",
        type=parse_size,
        default=DEFAULT_MAX_FRAME,
        metavar="SIZE",
        help="largest frame accepted (default 64MiB)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help=f"authenticated connections (default {DEFAULT_MAX_CONNECTIONS})",
    )
    parser.add_argument(
        "--max-unauthenticated",
        type=int,
        default=DEFAULT_MAX_UNAUTHENTICATED,
        metavar="N",
        help="connections still in their handshake, counted apart from authenticated ones "
        f"(default {DEFAULT_MAX_UNAUTHENTICATED})",
    )
    parser.add_argument(
        "--max-unauthenticated-per-address",
        type=int,
        default=DEFAULT_MAX_UNAUTHENTICATED_PER_ADDRESS,
        metavar="N",
        help=f"of those, from one address (default {DEFAULT_MAX_UNAUTHENTICATED_PER_ADDRESS})",
    )
    parser.add_argument(
        "--handshake-timeout",
        type=float,
        default=DEFAULT_HANDSHAKE_TIMEOUT,
        metavar="SECONDS",
        help=f"total time from connect to hello answered (default {DEFAULT_HANDSHAKE_TIMEOUT:g})",
    )
    parser.add_argument(
        "--frame-timeout",
        type=float,
        default=DEFAULT_FRAME_TIMEOUT,
        metavar="SECONDS",
        help="time a frame may take from its first byte, besides its length at "
        f"--min-rate (default {DEFAULT_FRAME_TIMEOUT:g})",
    )
    parser.add_argument(
        "--min-rate",
        type=parse_size,
        default=DEFAULT_MIN_RATE,
        metavar="SIZE",
        help="bytes a second a frame's body must keep up (default 1MiB)",
    )
    parser.add_argument(
        "--namespace-quota",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="most one namespace may hold, payload and overhead (default: the memory limit)",
    )
    parser.add_argument(
        "--idle-timeout",
        type=_seconds_or_off,
        default=DEFAULT_IDLE_TIMEOUT,
        metavar="SECONDS",
        help="close a connection that sends nothing for this long; 0 never "
        f"(default {DEFAULT_IDLE_TIMEOUT:g})",
    )
    parser.add_argument(
        "--keepalive",
        type=_seconds_or_off,
        default=DEFAULT_KEEPALIVE,
        metavar="SECONDS",
        help="TCP keepalive probes after this much silence, to drop connections of dead "
        f"nodes; 0 off (default {DEFAULT_KEEPALIVE:g})",
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")


def _seconds_or_off(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if value < 0 or value != value:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value or None


def run_serve(args: argparse.Namespace) -> int:
    """Run ``tiercheck peer serve`` from parsed arguments; prints ``listening on HOST:PORT``."""
    logging.basicConfig(
        level=str(args.log_level).upper(),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        token = load_token_file(args.token_file) if args.token_file else token_from_env()
        if args.insecure_no_auth and not args.token_file:
            token = None
        serve(
            args.listen,
            memory_limit=args.memory_limit,
            token=token,
            max_frame=args.max_frame,
            insecure_no_auth=args.insecure_no_auth,
            max_connections=args.max_connections,
            idle_timeout=args.idle_timeout,
            keepalive=args.keepalive,
            announce=lambda address: print(f"listening on {address}", flush=True),
            max_unauthenticated=args.max_unauthenticated,
            max_unauthenticated_per_address=args.max_unauthenticated_per_address,
            handshake_timeout=args.handshake_timeout,
            frame_timeout=args.frame_timeout,
            min_rate=args.min_rate,
            namespace_quota=args.namespace_quota,
        )
    except (ConfigError, ValueError, OSError) as exc:
        print(f"tiercheck peer serve: error: {exc}", file=sys.stderr)
        return 2
    return 0


def main_serve(argv: Sequence[str] | None = None) -> int:
    """``tiercheck peer serve --listen HOST:PORT --memory-limit SIZE [...]``."""
    parser = argparse.ArgumentParser(
        prog="tiercheck peer serve", description="Run the peer-memory daemon."
    )
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tiercheck peer status``."""
    parser.add_argument("address", metavar="HOST:PORT")
    parser.add_argument(
        "--token-file", metavar="FILE", help=f"shared-secret token file (else ${TOKEN_ENV})"
    )
    parser.add_argument("--timeout", type=float, default=10.0)


def run_status(args: argparse.Namespace) -> int:
    """Print the daemon's stats as JSON; exit status 1 when it cannot be reached."""
    from tiercheck.errors import TiercheckError

    try:
        stats = peer_status(args.address, token_file=args.token_file, timeout=args.timeout)
    except TiercheckError as exc:
        print(f"tiercheck peer status: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=2, sort_keys=True))
    return 0


def main_status(argv: Sequence[str] | None = None) -> int:
    """``tiercheck peer status HOST:PORT [--token-file F]``."""
    parser = argparse.ArgumentParser(
        prog="tiercheck peer status", description="Show what a peer daemon holds."
    )
    add_status_arguments(parser)
    return run_status(parser.parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tiercheck.peer.server [serve] --listen ...`` or ``... status HOST:PORT``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["status"]:
        return main_status(args[1:])
    if args[:1] == ["serve"]:
        args = args[1:]
    return main_serve(args)


if __name__ == "__main__":
    sys.exit(main())
