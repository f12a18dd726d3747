"""``memory://[NAME]``: blobs and log held in this process (tests and examples).

Layout: a ``dict`` id -> ``bytes`` for blobs and a ``list`` of ``bytes`` for the log, behind
one lock. Nothing touches disk; everything is lost with the process.

Option ``budget`` (bytes or a size such as ``"1GiB"``) bounds the blob bytes held: a put
past it raises ``OverBudget``.

Naming: ``memory://NAME`` opens the process-wide store called NAME, created on first use
and kept until :meth:`MemoryTier.discard` or the end of the process, so two
``open_tier("memory://x")`` calls (or a close and a reopen) see the same content.
``memory://`` without a name is a private store that lives only as long as its tier.
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tiercheck.backends.base import (
    Buffer,
    Capabilities,
    FailureDomain,
    Pins,
    Tier,
    check_blob_id,
    check_budget,
    parse_budget,
    scatter,
)
from tiercheck.backends.base import invalid_url as _invalid_url
from tiercheck.errors import NotFound

__all__ = ["MemoryTier"]

_PREFIX = "memory://"


@dataclass
class _Store:
    blobs: dict[str, bytes] = field(default_factory=dict)
    log: list[bytes] = field(default_factory=list)
    nbytes: int = 0  # sum of the blobs' lengths
    lock: threading.Lock = field(default_factory=threading.Lock)


# Named stores outlive their tiers on purpose (see module docstring).
_named: dict[str, _Store] = {}
_named_lock = threading.Lock()


class MemoryTier(Tier):
    """In-process tier. Thread-safe; survives nothing."""

    scheme: ClassVar[str] = "memory"
    CAPABILITIES: ClassVar[Capabilities] = Capabilities(
        survives=FailureDomain.NONE, shared=False, persistent=False, speed_rank=0, host_memory=True
    )

    def __init__(
        self,
        url: str,
        *,
        read_only: bool = False,
        budget: int | str | None = None,
        **options: Any,
    ) -> None:
        if options:
            raise _invalid_url(url, f"unknown options for memory://: {sorted(options)}")
        if not url.startswith(_PREFIX):
            raise _invalid_url(url, "expected memory://[NAME]")
        name = url[len(_PREFIX) :]
        if any(c in name for c in "?#") or any(not c.isprintable() for c in name):
            raise _invalid_url(url, "a memory tier name has no query, fragment or control chars")
        super().__init__(url, capabilities=self.CAPABILITIES, read_only=read_only)
        self.budget = parse_budget(budget, url)
        self.name = name
        if not name:
            self._store = _Store()
        else:
            with _named_lock:
                self._store = _named.setdefault(name, _Store())

    @classmethod
    def discard(cls, name: str) -> bool:
        """Forget the named store ``name``; returns whether it existed.

        Tiers still open on it keep their content; a later ``memory://NAME`` starts empty.
        """
        with _named_lock:
            return _named.pop(name, None) is not None

    # --- blobs ---------------------------------------------------------------------

    def put(self, blob_id: str, data: Buffer, *, overwrite: bool = False) -> bool:
        check_blob_id(blob_id, self.url)
        self._check_writable("put")
        value = bytes(data)  # the caller may reuse its buffer
        with self._store.lock:
            old = self._store.blobs.get(blob_id)
            if not overwrite and old is not None:
                return False
            held = self._store.nbytes - (len(old) if old is not None else 0)
            check_budget(self.url, blob_id, held=held, needed=len(value), budget=self.budget)
            self._store.blobs[blob_id] = value
            self._store.nbytes = held + len(value)
            return True

    def get(self, blob_id: str, out: memoryview | None = None) -> memoryview:
        data = self._stored(blob_id)
        return self._copy_out(data, out, self.url, blob_id)

    def get_parts(self, blob_id: str, parts: Sequence[memoryview]) -> int:
        data = self._stored(blob_id)
        return scatter(data, parts)

    def _stored(self, blob_id: str) -> bytes:
        """The stored value of ``blob_id`` (NotFound if there is none)."""
        check_blob_id(blob_id, self.url)
        with self._store.lock:
            data = self._store.blobs.get(blob_id)
        if data is None:
            raise NotFound("blob not found", url=self.url, key=blob_id)
        return data

    def pin(self) -> Pins:
        """Blobs in place: a memory tier holds each as an immutable ``bytes`` object, which
        a later put or delete replaces or drops but never changes."""
        return _MemoryPins(self)

    def head(self, blob_id: str, nbytes: int = 64) -> bytes:
        check_blob_id(blob_id, self.url)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        return self._stored(blob_id)[:nbytes]

    def has(self, blob_ids: Iterable[str]) -> set[str]:
        ids = list(blob_ids)
        for blob_id in ids:
            check_blob_id(blob_id, self.url)
        with self._store.lock:
            return {b for b in ids if b in self._store.blobs}

    def delete(self, blob_ids: Iterable[str]) -> int:
        ids = list(blob_ids)
        for blob_id in ids:
            check_blob_id(blob_id, self.url)
        self._check_writable("delete")
        removed = 0
        with self._store.lock:
            for b in ids:
                data = self._store.blobs.pop(b, None)
                if data is not None:
                    removed += 1
                    self._store.nbytes -= len(data)
        return removed

    def list(self) -> Iterator[str]:
        with self._store.lock:
            ids = list(self._store.blobs)
        return iter(ids)

    def size(self, blob_id: str) -> int:
        data = self._stored(blob_id)
        return len(data)

    # --- log -----------------------------------------------------------------------

    def append(self, record: bytes, *, blobs: Iterable[tuple[str, Buffer]] = ()) -> None:
        self._check_writable("append")
        items = [(b, bytes(d)) for b, d in blobs]
        for blob_id, _ in items:
            check_blob_id(blob_id, self.url)
        value = bytes(record)
        with self._store.lock:
            fresh = {b: d for b, d in items if b not in self._store.blobs}
            needed = sum(len(d) for d in fresh.values())
            check_budget(self.url, "", held=self._store.nbytes, needed=needed, budget=self.budget)
            self._store.blobs.update(fresh)
            self._store.nbytes += needed
            self._store.log.append(value)

    def read_log(self) -> builtins.list[bytes]:
        with self._store.lock:
            return list(self._store.log)

    def replace_log_prefix(self, count: int, record: bytes) -> None:
        self._check_writable("compact the log")
        value = bytes(record)
        with self._store.lock:
            if not 1 <= count <= len(self._store.log):
                raise ValueError(f"count {count} is outside the log of {len(self._store.log)}")
            self._store.log[:count] = [value]

    def usage(self) -> int:
        with self._store.lock:
            return self._store.nbytes

    def set_budget(self, nbytes: int | str | None) -> None:
        self.budget = parse_budget(nbytes, self.url)

    def free_memory(self) -> int:
        """The host's available memory (this tier's blobs are in the process)."""
        import psutil

        return int(psutil.virtual_memory().available)


class _MemoryPins(Pins):
    """:meth:`MemoryTier.pin`: views of the stored ``bytes`` objects (read-only)."""

    def __init__(self, tier: MemoryTier) -> None:
        self._tier = tier

    def get(self, blob_id: str) -> memoryview:
        return memoryview(self._tier._stored(blob_id))
