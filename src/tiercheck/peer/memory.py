"""The peer daemon's memory: blobs and log records per namespace, under one limit.

``memory_limit`` bounds what the daemon holds across namespaces: every blob and log record
is charged its bytes plus a fixed per-object overhead (``OBJECT_OVERHEAD``,
``RECORD_OVERHEAD``), and a frame over ``RESERVE_MIN`` reserves its length before its body
is received (:meth:`MemoryStore.reserve_frame`), so frames in flight count too.
``namespace_quota`` bounds one namespace the same way, and a client may give its namespace
a smaller ``budget``; a write past any of them is refused (``TierFull``, ``over_budget``).

The store takes one lock for dict updates only; no bytes are copied under it. Large frames
are received into buffers of a :class:`BufferPool`, which the store keeps as the blob's
memory and hands back to the pool when the blob is deleted (after the last reply sending
it, see :meth:`MemoryStore.checkout`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from tiercheck.backends._peer_protocol import HANDSHAKE_MAX_FRAME
from tiercheck.peer.validation import Refused

__all__ = ["OBJECT_OVERHEAD", "RECORD_OVERHEAD", "RESERVE_MIN", "BufferPool", "MemoryStore"]

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


def _size_class(n: int) -> int:
    """Capacity of a pooled buffer for ``n`` bytes: ``n`` rounded up to 1/64 of its power
    of two, so at most 1.6% is wasted and equal chunk sizes share a class."""
    step = max(1, (1 << (n.bit_length() - 1)) // 64)
    return -(-n // step) * step


class BufferPool:
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


class MemoryStore:
    """Blobs and log records per namespace, under one memory limit: payload, per-object
    overhead and the frames being received all count (``used + inflight``)."""

    def __init__(
        self, memory_limit: int, pool: BufferPool, namespace_quota: int | None = None
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
            raise Refused(
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
            raise Refused(
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
                raise Refused(
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
                raise Refused("OutOfRange", f"count {count} is outside the log of {n} records")
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
