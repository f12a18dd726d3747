"""The peer-memory tier: blobs and log records in another node's ``tiercheck peer serve``.

URL ``peer://HOST:PORT[/NAMESPACE]``. Options: ``token`` (bytes or str) or ``token_file``
(else ``TIERCHECK_PEER_TOKEN``): the daemon's token or the namespace's own token
(``tiercheck peer token NS``); ``namespace`` (else the URL path, else ``"default"``),
``timeout`` (seconds per connect and per socket operation), ``read_only``,
``max_connections`` (the pool size), ``budget`` (most bytes this namespace may hold in the
daemon, a size such as ``"8GiB"``; the daemon refuses writes past it with ``OverBudget``,
as it does past its own ``--memory-limit``) and ``keepalive`` (seconds of silence before
TCP keepalive probes, None: off). Content survives losing this node, not the daemon's.

Thread safety: a small pool of connections; a call takes one for its whole
request/response, so concurrent calls from the engine's threads run in parallel on
separate connections. A connection that fails is dropped, never reused; the next call
connects again (lazily), so a restarted daemon is picked up without reopening the tier.
A pooled connection idle for half the daemon's idle timeout, or already closed by the
daemon, is dropped instead of used.
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

from tiercheck.backends._peer_protocol import (
    PeerConnection,
    PeerRejected,
    ProtocolError,
    load_token_file,
    token_from_env,
)
from tiercheck.backends.base import (
    Buffer,
    Capabilities,
    FailureDomain,
    Tier,
    check_blob_id,
    invalid_url,
    parse_budget,
)
from tiercheck.errors import (
    ConfigError,
    NotFound,
    NotSupported,
    OverBudget,
    TierError,
    TierFull,
    TierUnavailable,
)

__all__ = ["PeerTier"]

PEER_CAPABILITIES = Capabilities(
    survives=FailureDomain.NODE,
    shared=False,
    persistent=False,
    speed_rank=20,
    empty_objects=False,
)

# Blobs at least this large travel one per frame (received in place by the daemon);
# smaller ones are batched into put_many frames of up to _BATCH_BYTES.
_LARGE_BLOB = 256 * 1024
_BATCH_BYTES = 8 * 1024 * 1024
_ID_BATCH = 8192
# Room for the fields of a frame around its payload, and per id (64 hex + msgpack tags).
_FRAME_OVERHEAD = 4096
_ID_BYTES = 80


def _byte_len(data: Buffer) -> int:
    return memoryview(data).nbytes


class PeerTier(Tier):
    """Client of a peer-memory daemon; see the module docstring."""

    scheme = "peer"

    def __init__(
        self,
        url: str,
        *,
        token: bytes | str | None = None,
        token_file: str | None = None,
        namespace: str | None = None,
        timeout: float | None = 30.0,
        read_only: bool = False,
        max_connections: int = 4,
        budget: int | str | None = None,
        keepalive: float | None = 60.0,
    ) -> None:
        super().__init__(url, capabilities=PEER_CAPABILITIES, read_only=read_only)
        self.host, self.port, url_namespace = _parse_url(url)
        if namespace is not None and url_namespace and namespace != url_namespace:
            raise invalid_url(
                url, f"namespace {namespace!r} conflicts with {url_namespace!r} in the URL"
            )
        self.namespace = namespace or url_namespace or "default"
        if not 0 < len(self.namespace) <= 255 or not self.namespace.isprintable():
            raise invalid_url(url, f"namespace {self.namespace!r}: 1 to 255 printable characters")
        if token is not None and token_file is not None:
            raise ConfigError("pass token= or token_file=, not both")
        if token_file is not None:
            try:
                self._token: bytes | None = load_token_file(token_file)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"cannot read token file {token_file!r}: {exc}") from exc
        elif token is not None:
            self._token = token.encode() if isinstance(token, str) else bytes(token)
        else:
            self._token = token_from_env()
        if max_connections < 1:
            raise ConfigError(f"max_connections must be at least 1, got {max_connections}")
        self.timeout = timeout
        self.budget = parse_budget(budget, url)
        self.keepalive = keepalive
        self._idle: list[PeerConnection] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._max_frame = 0  # learned from the daemon's hello reply
        self._closed = False

    # --- connections ---

    def _connect(self) -> PeerConnection:
        try:
            conn = PeerConnection(
                self.host,
                self.port,
                namespace=self.namespace,
                token=self._token,
                timeout=self.timeout,
                budget=None if self.read_only else self.budget,
                keepalive=self.keepalive,
            )
        except PeerRejected as exc:
            if exc.code == "Busy":
                raise TierUnavailable(f"peer daemon is busy: {exc.message}", url=self.url) from exc
            raise TierError(
                f"peer daemon refused the connection ({exc.code}): {exc.message}", url=self.url
            ) from exc
        except (OSError, ProtocolError) as exc:
            raise self._unavailable(exc) from exc
        self._max_frame = conn.max_frame
        return conn

    def _unavailable(self, exc: BaseException) -> TierUnavailable:
        what = str(exc) or type(exc).__name__
        return TierUnavailable(
            f"peer daemon at {self.host}:{self.port} unreachable ({type(exc).__name__}: {what})",
            url=self.url,
        )

    def _request(
        self,
        fields: Mapping[str, Any],
        data: Buffer | Sequence[Buffer] | None = None,
        *,
        out: memoryview | None = None,
        key: str = "",
    ) -> tuple[dict[str, Any], memoryview | None, bool]:
        if self._closed:
            raise TierError("tier is closed", url=self.url)
        with self._slots:
            conn = None
            while conn is None:
                with self._lock:
                    conn = self._idle.pop() if self._idle else None
                if conn is None:
                    conn = self._connect()
                elif conn.stale():
                    conn.close()
                    conn = None
            try:
                reply, payload, in_out = conn.request(fields, data, out)
            except (OSError, ProtocolError) as exc:
                conn.close()
                raise self._unavailable(exc) from exc
            except BaseException:
                conn.close()
                raise
            if reply.get("close"):
                conn.close()
            else:
                with self._lock:
                    self._idle.append(conn)
        if reply.get("ok") is not True:
            raise self._error(reply, key)
        return reply, payload, in_out

    def _error(self, reply: Mapping[str, Any], key: str) -> Exception:
        code = str(reply.get("error", "Error"))
        message = f"peer daemon: {reply.get('message', code)}"
        if code == "NotFound":
            return NotFound(message, url=self.url, key=key)
        if code == "TierFull" and reply.get("over_budget"):
            budget = reply.get("budget")
            return OverBudget(
                message,
                url=self.url,
                key=key,
                needed=int(reply.get("needed", 0)),
                held=int(reply.get("held", 0)),
                budget=budget if isinstance(budget, int) else None,
            )
        if code == "TierFull":
            return TierFull(message, url=self.url, key=key)
        if code == "Busy":
            return TierUnavailable(message, url=self.url, key=key)
        if code == "OutOfRange":
            return ValueError(message)
        if code == "Unsupported":
            return NotSupported(message, url=self.url, key=key)
        return TierError(f"{message} ({code})", url=self.url, key=key)

    def _frame_budget(self) -> int:
        if not self._max_frame:
            self._request({"op": "ping"})
        return self._max_frame - _FRAME_OVERHEAD

    def _id_batch(self) -> int:
        return max(1, min(_ID_BATCH, self._frame_budget() // _ID_BYTES))

    # --- blobs ---

    def _not_empty(self, size: int, what: str, key: str = "") -> None:
        """The daemon refuses objects of 0 bytes (``capabilities.empty_objects``)."""
        if not size:
            raise NotSupported(
                f"{what} of 0 bytes: the peer daemon refuses empty objects (each would hold "
                "only overhead)",
                url=self.url,
                key=key,
            )

    def put(self, blob_id: str, data: Buffer, *, overwrite: bool = False) -> bool:
        self._check_writable("put")
        check_blob_id(blob_id, self.url)
        size = _byte_len(data)
        self._not_empty(size, "a blob", blob_id)
        if size > self._frame_budget():
            raise NotSupported(
                f"blob of {size} bytes exceeds the peer daemon's frame limit of "
                f"{self._max_frame} bytes; start it with a larger --max-frame",
                url=self.url,
                key=blob_id,
            )
        reply, _, _ = self._request(
            {"op": "put", "id": blob_id, "overwrite": overwrite}, data, key=blob_id
        )
        return bool(reply.get("written"))

    def put_many(self, items: Iterable[tuple[str, Buffer]]) -> int:
        self._check_writable("put")
        written = 0
        ids: list[str] = []
        parts: list[Buffer] = []
        batch_bytes = 0
        budget = min(_BATCH_BYTES, self._frame_budget())

        def flush() -> int:
            nonlocal batch_bytes
            if not ids:
                return 0
            reply, _, _ = self._request(
                {"op": "put_many", "ids": ids, "sizes": [_byte_len(p) for p in parts]},
                parts,
                key=ids[0],
            )
            ids.clear()
            parts.clear()
            batch_bytes = 0
            return int(reply.get("written", 0))

        for blob_id, data in items:
            check_blob_id(blob_id, self.url)
            size = _byte_len(data)
            self._not_empty(size, "a blob", blob_id)
            if size >= _LARGE_BLOB:
                written += self.put(blob_id, data)
                continue
            if batch_bytes + size + _ID_BYTES > budget or len(ids) >= _ID_BATCH:
                written += flush()
            ids.append(blob_id)
            parts.append(data)
            batch_bytes += size + _ID_BYTES
        return written + flush()

    def get(self, blob_id: str, out: memoryview | None = None) -> memoryview:
        check_blob_id(blob_id, self.url)
        _, payload, in_out = self._request({"op": "get", "id": blob_id}, out=out, key=blob_id)
        if payload is None:
            raise TierError("peer daemon sent a get reply without data", url=self.url, key=blob_id)
        if in_out or out is None:
            return payload
        return self._copy_out(payload, out, self.url, blob_id)

    def head(self, blob_id: str, nbytes: int = 64) -> bytes:
        """The first ``nbytes`` of a blob: the daemon sends only those (``get`` with a
        ``length``; a daemon that ignores the field sends the whole blob, sliced here)."""
        check_blob_id(blob_id, self.url)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        _, payload, _ = self._request({"op": "get", "id": blob_id, "length": nbytes}, key=blob_id)
        if payload is None:
            raise TierError("peer daemon sent a get reply without data", url=self.url, key=blob_id)
        return bytes(payload[:nbytes])

    def size(self, blob_id: str) -> int:
        check_blob_id(blob_id, self.url)
        reply, _, _ = self._request({"op": "size", "id": blob_id}, key=blob_id)
        return int(reply["size"])

    def has(self, blob_ids: Iterable[str]) -> set[str]:
        present: set[str] = set()
        for batch in _batches(blob_ids, self.url, self._id_batch()):
            reply, _, _ = self._request({"op": "has", "ids": batch})
            present.update(reply["ids"])
        return present

    def delete(self, blob_ids: Iterable[str]) -> int:
        self._check_writable("delete")
        removed = 0
        for batch in _batches(blob_ids, self.url, self._id_batch()):
            reply, _, _ = self._request({"op": "delete", "ids": batch})
            removed += int(reply["removed"])
        return removed

    def list(self) -> Iterator[str]:
        after: str | None = None
        while True:
            reply, _, _ = self._request({"op": "list", "after": after})
            ids: builtins.list[str] = reply["ids"]
            yield from ids
            if not reply.get("more") or not ids:
                return
            after = ids[-1]

    # --- log ---

    def append(self, record: bytes, *, blobs: Iterable[tuple[str, Buffer]] = ()) -> None:
        self._check_writable("append")
        self._not_empty(len(record), "a log record")
        self.put_many(blobs)
        if len(record) > self._frame_budget():
            raise NotSupported(
                f"log record of {len(record)} bytes exceeds the peer daemon's frame limit of "
                f"{self._max_frame} bytes",
                url=self.url,
            )
        self._request({"op": "append"}, record)

    def read_log(self) -> builtins.list[bytes]:
        records: builtins.list[bytes] = []
        while True:
            reply, _, _ = self._request({"op": "read_log", "start": len(records)})
            page: builtins.list[bytes] = reply["records"]
            records.extend(page)
            if not reply.get("more") or not page:
                return records

    def replace_log_prefix(self, count: int, record: bytes) -> None:
        """The daemon replaces the records under its store lock (atomic)."""
        self._check_writable("compact the log")
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        self._not_empty(len(record), "a log checkpoint")
        if len(record) > self._frame_budget():
            raise NotSupported(
                f"log checkpoint of {len(record)} bytes exceeds the peer daemon's frame limit "
                f"of {self._max_frame} bytes",
                url=self.url,
            )
        self._request({"op": "replace_log_prefix", "count": count}, record)

    def set_budget(self, nbytes: int | str | None) -> None:
        """Set this namespace's budget in the daemon (and in later hellos)."""
        self.budget = parse_budget(nbytes, self.url)
        self._request({"op": "set_budget", "budget": self.budget})

    def usage(self) -> int:
        """Bytes of blobs this namespace holds in the daemon."""
        reply, _, _ = self._request({"op": "usage"})
        return int(reply["bytes"])

    def free_memory(self) -> int | None:
        """What the daemon's memory limit leaves free (None if it reports no limit)."""
        stats = self.stats()
        limit, used = stats.get("memory_limit"), stats.get("memory_used")
        if isinstance(limit, int) and isinstance(used, int):
            return max(0, limit - used)
        return None

    # --- extras ---

    def stats(self) -> dict[str, Any]:
        """The daemon's content and memory use (all namespaces); see ``peer_status``."""
        reply, _, _ = self._request({"op": "stats"})
        stats: dict[str, Any] = reply["stats"]
        return stats

    def ping(self) -> None:
        """Round trip to the daemon; ``TierUnavailable`` if it cannot be reached."""
        self._request({"op": "ping"})

    def close(self) -> None:
        self._closed = True
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _parse_url(url: str) -> tuple[str, int, str]:
    parts = urlsplit(url)
    if parts.scheme.lower() != "peer":
        raise invalid_url(url, "expected peer://HOST:PORT[/NAMESPACE]")
    try:
        port = parts.port
    except ValueError as exc:
        raise invalid_url(url, f"bad port ({exc})") from exc
    if not parts.hostname or port is None:
        raise invalid_url(url, "expected peer://HOST:PORT[/NAMESPACE] with a host and a port")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise invalid_url(url, "query, fragment and user info are not supported")
    return parts.hostname, port, unquote(parts.path.strip("/"))


def _batches(blob_ids: Iterable[str], url: str, size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for blob_id in blob_ids:
        check_blob_id(blob_id, url)
        batch.append(blob_id)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
