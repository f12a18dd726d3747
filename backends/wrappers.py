"""Tier wrappers: a tier that forwards every call of the tier interface to another tier.

:class:`WrapperTier` is the base of tiers that add something around an existing tier
(fault injection, tracing, retries, rate limits), as restic's backend wrappers are: a
subclass overrides only the calls it changes, and everything else reaches the inner tier
unchanged. It forwards *every* method and property of
:class:`~tiercheck.backends.base.Tier`, including those the base class gives a default
(``put_parts``, ``begin_put``, ``put_many``, ``put_many_parts``, ``get_parts``, ``pin``,
``staging_area``, ``size``,
``head``, ``replace_log_prefix``, ``usage``, ``set_budget``, ``read_owner``,
``write_owner``, ``claim_owner``, ``bind_store``): a wrapper that inherited those defaults
would silently turn a vectored write into a join, hide a memory tier's budget from the
engine, make an atomic owner claim a racy one, or refuse log compaction the inner tier can
do.
``tests/backends/test_wrappers.py`` fails when a method is added to ``Tier`` and not here.

Attributes the interface does not name (an LMDB tier's ``path``, a peer tier's ``stats``)
are looked up on the inner tier too. ``isinstance`` checks against a concrete tier class do
not see through a wrapper.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from tiercheck.backends.base import (
    Buffer,
    Capabilities,
    LogScan,
    PendingPut,
    Pins,
    StagingArea,
    StoreOwner,
    Tier,
)

__all__ = ["WrapperTier"]


class WrapperTier(Tier):
    """``inner``, every call forwarded unchanged (module docstring). ``url``,
    ``capabilities``, ``read_only`` and ``budget`` are the inner tier's, read at each use."""

    scheme = "wrapper"

    def __init__(self, inner: Tier) -> None:
        # Tier.__init__ is not called: the attributes it would set are the inner tier's
        # (properties below), so that a change there is seen here
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet: avoid recursing during __init__
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    # --- what a tier declares ------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.inner.url

    @url.setter
    def url(self, value: str) -> None:
        self.inner.url = value

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    @capabilities.setter
    def capabilities(self, value: Capabilities) -> None:
        self.inner.capabilities = value

    @property
    def read_only(self) -> bool:
        return self.inner.read_only

    @read_only.setter
    def read_only(self, value: bool) -> None:
        self.inner.read_only = value

    @property
    def budget(self) -> int | None:
        """The inner tier's budget (None where it has none or is no memory tier)."""
        value = getattr(self.inner, "budget", None)
        return value if isinstance(value, int) else None

    # --- blobs -----------------------------------------------------------------------------

    def put(self, blob_id: str, data: Buffer, *, overwrite: bool = False) -> bool:
        return self.inner.put(blob_id, data, overwrite=overwrite)

    def put_parts(self, blob_id: str, parts: Sequence[Buffer], *, overwrite: bool = False) -> bool:
        return self.inner.put_parts(blob_id, parts, overwrite=overwrite)

    def begin_put(self, blob_id: str, parts: Sequence[Buffer]) -> PendingPut:
        return self.inner.begin_put(blob_id, parts)

    def put_many(self, items: Iterable[tuple[str, Buffer]]) -> int:
        return self.inner.put_many(items)

    def put_many_parts(self, items: Iterable[tuple[str, Sequence[Buffer]]]) -> int:
        return self.inner.put_many_parts(items)

    def get(self, blob_id: str, out: memoryview | None = None) -> memoryview:
        return self.inner.get(blob_id, out)

    def get_parts(self, blob_id: str, parts: Sequence[memoryview]) -> int:
        return self.inner.get_parts(blob_id, parts)

    def pin(self) -> Pins | None:
        return self.inner.pin()

    def staging_area(
        self, windows: Sequence[tuple[int, int]], stream_bytes: int
    ) -> StagingArea | None:
        return self.inner.staging_area(windows, stream_bytes)

    def has(self, blob_ids: Iterable[str]) -> set[str]:
        return self.inner.has(blob_ids)

    def delete(self, blob_ids: Iterable[str]) -> int:
        return self.inner.delete(blob_ids)

    def list(self) -> Iterator[str]:
        return self.inner.list()

    def size(self, blob_id: str) -> int:
        return self.inner.size(blob_id)

    def head(self, blob_id: str, nbytes: int = 64) -> bytes:
        return self.inner.head(blob_id, nbytes)

    # --- log ---------------------------------------------------------------------------------

    def append(self, record: bytes, *, blobs: Iterable[tuple[str, Buffer]] = ()) -> None:
        self.inner.append(record, blobs=blobs)

    def read_log(self) -> builtins.list[bytes]:
        return self.inner.read_log()

    def written_at(self, blob_ids: Sequence[str]) -> dict[str, float]:
        return self.inner.written_at(blob_ids)

    def scan_log(self) -> LogScan:
        return self.inner.scan_log()

    def replace_log_prefix(self, count: int, record: bytes) -> None:
        self.inner.replace_log_prefix(count, record)

    # --- resources and lifecycle -----------------------------------------------------------

    def usage(self) -> int | None:
        return self.inner.usage()

    def set_budget(self, nbytes: int | str | None) -> None:
        self.inner.set_budget(nbytes)

    def free_memory(self) -> int | None:
        return self.inner.free_memory()

    def preallocate(self, sizes: Sequence[int]) -> int:
        return self.inner.preallocate(sizes)

    def read_owner(self) -> StoreOwner | None:
        return self.inner.read_owner()

    def write_owner(self, owner: StoreOwner) -> None:
        self.inner.write_owner(owner)

    def claim_owner(self, owner: StoreOwner, *, replacing: StoreOwner | None = None) -> StoreOwner:
        return self.inner.claim_owner(owner, replacing=replacing)

    def bind_store(self, root: str) -> None:
        self.inner.bind_store(root)

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()

    def unmake(self, store_id: str | None = None) -> None:
        self.inner.unmake(store_id)

    def __enter__(self) -> WrapperTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
