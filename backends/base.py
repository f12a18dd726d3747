"""The tier interface: what every storage tier must do, and what it declares about itself.

A tier stores two things: **blobs** (immutable, content-addressed byte strings named by a
64-character lowercase hex id) and a **log** (an append-only sequence of opaque records).
It is small, synchronous and batch friendly on purpose; the engine supplies concurrency
(it calls one tier from several threads, so implementations must be thread-safe).

The engine's call sequence into a tier, which an implementation may rely on:

1. ``open_tier(url, **options)`` constructs the tier (the registry calls the class).
2. Saving a version: ``has(ids)`` to skip what is there, then ``put``/``put_many`` for the
   missing blobs, then ``append(record, blobs=...)``. A record is appended only after every
   blob it references is durable in this tier (a tier with transactions may put the blobs
   passed as ``blobs`` in the same transaction as the record). A tier may batch the blobs
   put since its last ``append`` (a packed object store writes them into one pack object):
   they are readable through the same instance at once, and durable and visible to other
   instances once ``append``, ``flush()`` or ``close()`` returns; ``append`` makes them
   durable before its record, so a record never names a blob that is not stored.
3. Restoring: ``read_log()`` once, then ``get`` or ``get_parts`` per blob (possibly into a
   caller buffer); or, from a tier that can hold its blobs in place (``pin()`` does not
   return None), each blob's stored bytes read where they lie until the restore ends.
4. Repair: ``put(id, data, overwrite=True)`` replaces a copy found corrupt.
5. Retention / GC: ``list()``, ``head(id)`` (a blob's header, to find a delta's base) and
   ``delete(ids)``, only for blobs no kept record references.
6. Log compaction, after retention: ``read_log()``, then ``replace_log_prefix(n, record)``
   with a checkpoint record that sums up the first ``n`` records read. Records appended
   in between stay after the checkpoint. A tier that cannot do it atomically raises
   ``NotSupported`` (the default) and keeps its whole log.
7. ``close()``; after it no call is made.

Before any of these, a store opened for writing calls ``bind_store(root)`` once, naming the
store that owns the tier; a tier holding node memory records it so that a segment whose
store is deleted can be found and reclaimed (``tiercheck gc --orphans``).

**Budgets (memory tiers).** A tier holding node memory (shm, the peer daemon, the
collective tier, ``memory://``) takes a ``budget`` option: the most bytes of blob data it
may hold (an int or a size such as ``"8GiB"``; default none). ``usage()`` returns the bytes
of blob data held now (None where counting is not cheap). A ``put`` that would take
``usage()`` past the budget, or that needs more memory than the node has free, writes
nothing and raises ``OverBudget`` (a ``TierFull``): the tier never takes the memory a
trainer needs, and a tmpfs page fault can never become a SIGBUS. The engine's side of the
contract: before placing a version on a tier with a budget, compare ``usage()`` plus the
bytes it will write with ``budget`` and drop old versions (retention, then GC) to make room;
a version that still does not fit is skipped on that tier with a warning, never a failed
training step. ``OverBudget`` raised by a put in flight means the same: skip the tier for
that version.

Guarantees every tier gives (checked by :mod:`tiercheck.testing.conformance`):

- ``put`` is atomic: after a crash a blob is either absent or complete. A reader never sees
  a prefix. Putting an id that is present is a no-op unless ``overwrite`` is true.
- ``append`` is atomic and ordered: after a crash ``read_log`` returns exactly the records
  whose ``append`` returned, possibly plus the one in flight (whole or not at all), in
  append order.
- ``replace_log_prefix`` is atomic: after a crash ``read_log`` returns either the old
  records or the checkpoint followed by the records after the replaced prefix.
- Errors are typed (:mod:`tiercheck.errors`): ``NotFound`` for a missing blob,
  ``TierUnavailable`` when the tier cannot be reached (retryable), ``TierFull`` when out of
  space (``OverBudget`` past a budget), ``ReadOnlyTier`` for a write to a read-only tier,
  ``InvalidURL`` for a bad URL.
  A tier does not check that a blob's content matches its id: the codec layer does that.
"""

from __future__ import annotations

import abc
import builtins
import json
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

from tiercheck.core.sizes import format_size, parse_size
from tiercheck.errors import InvalidURL, NotSupported, OverBudget, ReadOnlyTier, TierError

__all__ = [
    "BLOB_ID_RE",
    "STAGED_HEADER",
    "Buffer",
    "Capabilities",
    "FailureDomain",
    "Later",
    "LogScan",
    "PendingPut",
    "Pins",
    "StagingArea",
    "StoreOwner",
    "Tier",
    "check_blob_id",
    "check_budget",
    "invalid_url",
    "parse_budget",
    "scatter",
]

Buffer = bytes | bytearray | memoryview
Later = Callable[[Callable[[], object]], object]
"""Where work may run after its caller returns (an ``Executor``'s ``submit``)."""

BLOB_ID_RE = re.compile(r"^[0-9a-f]{64}$")


class PendingPut:
    """A put whose bytes have left the caller's buffers (see :meth:`Tier.begin_put`).

    :meth:`finish` completes it (durable and named, as :meth:`Tier.put_parts` on return)
    and returns what ``put_parts`` would; :meth:`abort` drops it, leaving the tier as if it
    had never begun. Exactly one of them is called. This one is already complete.
    """

    def __init__(self, written: bool) -> None:
        self._written = written

    def finish(self) -> bool:
        return self._written

    def abort(self) -> None:
        """Nothing to undo: the blob was stored whole (content-addressed: harmless)."""


class Pins:
    """Blobs of one tier read where they are stored, unchanged until :meth:`close`
    (:meth:`Tier.pin`): a restore verifies each chunk in place, then copies it once into
    the caller's tensor, with no copy in between that could differ from what it verified.

    :meth:`get` returns a read-only view of a blob's stored bytes (``NotFound`` if it has
    none); the tier guarantees that no write of its own, of this or another process,
    changes those bytes while the pins are open (a deleted blob's memory is not reused
    meanwhile). :meth:`close` releases every view; using one after it is an error. A
    subclass implements :meth:`get` and :meth:`close`; the default holds nothing.
    """

    def get(self, blob_id: str) -> memoryview:
        raise NotSupported(f"{type(self).__name__} holds no blobs in place")

    def parts(self, blob_id: str, head: int) -> tuple[memoryview, memoryview, int]:
        """A blob's stored bytes as ``(front, rest, size)``: the blob is ``front`` then
        ``rest``, ``size`` bytes in all, ``front`` at least its first ``head`` bytes (or
        the whole blob, if shorter). The same guarantee as :meth:`get`; by default its
        view, cut. A tier whose blob is not one contiguous run of memory gives its parts
        (shm: a staged blob's header page, read, and its payload where the staging range
        maps it)."""
        blob = self.get(blob_id)
        return blob[:head], blob[head:], len(blob)

    def close(self, later: Later | None = None) -> None:
        """Release every view :meth:`get` and :meth:`parts` returned. Idempotent.
        ``later`` (a thread pool's ``submit``, say) runs what need not hold up the caller
        once the views are released (shm's unmapping, tens of milliseconds per GiB);
        without it, or where it refuses the work, that runs here."""

    def __enter__(self) -> Pins:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: the header of a blob a tier makes of a staged window (:meth:`Tier.staging_area`): a
#: page (SPEC section 2 allows up to 4096 bytes), so the payload is at a page offset
STAGED_HEADER = 4096


class StagingArea:
    """Two ranges of memory a save stages into that are a tier's own storage, so that a
    window of the staged stream becomes that tier's blob without a copy
    (:meth:`Tier.staging_area`; shm's is :class:`tiercheck.backends._shm_segments.StageArea`).

    One save stages at a time: :meth:`take` a range, :meth:`arm` it, copy the stream into
    :meth:`tensor`, :meth:`done_staging`, and once window ``k`` is hashed to ``blob_id``,
    :meth:`adopt` it (False: the tier had that blob already; a blob takes
    ``STAGED_HEADER`` bytes more than its window). The ranges take turns, so a range is
    staged into again only two saves later. :meth:`close` when no save reads either."""

    tier: Tier  # the tier whose storage the ranges are, which adopts their windows
    windows: tuple[tuple[int, int], ...]
    nbytes: int  # the memory both ranges take

    def take(self) -> int:
        raise NotImplementedError

    def busy(self, r: int) -> int:
        """Windows of range ``r`` still held as blobs (arming it replaces them)."""
        raise NotImplementedError

    def arm(self, r: int) -> None:
        raise NotImplementedError

    def done_staging(self) -> None:
        raise NotImplementedError

    def tensor(self, r: int) -> Any:
        raise NotImplementedError

    def adopt(self, r: int, k: int, blob_id: str) -> bool:
        raise NotImplementedError

    def close(self, *, pool: bool = False) -> None:
        """Release the ranges; ``pool``: keep the memory of the free ones for the tier's
        own puts (the saves stage privately from now on)."""
        raise NotImplementedError


@dataclass(frozen=True)
class LogScan:
    """A log as :meth:`Tier.scan_log` read it: the intact records in append order (what
    :meth:`Tier.read_log` returns) and where each damaged record was (one line each, e.g.
    ``"record key 12"`` or ``"bytes 140-310"``), stepped over. A torn tail (a write in flight
    at a crash) is not damage."""

    records: tuple[bytes, ...]
    damaged: tuple[str, ...] = ()


class FailureDomain(str, Enum):
    """The widest failure a tier's content survives."""

    NONE = "none"  # lost with the process (memory://)
    PROCESS = "process"  # survives a crashed process (shm, lmdb)
    NODE = "node"  # survives losing the node (peer memory)
    CLUSTER = "cluster"  # survives losing the cluster (remote object storage)

    @property
    def order(self) -> int:
        return ["none", "process", "node", "cluster"].index(self.value)


@dataclass(frozen=True)
class Capabilities:
    """What a tier declares about itself, so the engine never guesses.

    ``speed_rank`` orders tiers for restore: lower is read first. Built-in values:
    memory 0, shm 10, peer 20, lmdb 30, fsspec local 40, fsspec remote 50.
    ``atomic_batch`` says that ``append(record, blobs=...)`` writes blobs and record in
    one transaction. ``persistent`` says the content survives a reboot of its host.
    ``compress`` says that bytes are scarcer than CPU on the way to this tier (a network
    object store), so the default placement compresses what a shared or cluster-surviving
    tier stores; a file system mounted on this node says False: writing fp32 there is
    faster than compressing it (zstd level 1 runs at about 1 GB/s per core and saves
    under 10% on training state).
    ``empty_objects`` says that the tier stores blobs and log records of 0 bytes; one that
    does not (the peer daemon: an empty object would cost it only overhead, so it refuses
    them) raises ``NotSupported`` for them. The engine never writes one: a blob carries a
    header, a record is a msgpack map.
    ``blob_times`` says that :meth:`Tier.written_at` reports when each blob was written
    (GC's grace period then runs from the blob's own age, across processes).
    ``host_memory`` says that the tier's copies lie in this host's memory and never leave
    it (shm, ``memory://``): a restore verifies a copy read from it against its chunk's
    check (XXH3-128) where the manifest records one, not by BLAKE3 (SPEC.md section 7.2).
    Only a tier whose bytes cross no disk, no network and no other process's hands may
    say so: a non-persistent disk tier does not.
    """

    survives: FailureDomain
    shared: bool
    persistent: bool
    speed_rank: int
    atomic_batch: bool = False
    compress: bool = True
    empty_objects: bool = True
    blob_times: bool = False
    host_memory: bool = False


@dataclass(frozen=True)
class StoreOwner:
    """The owner record of a tier: the id of the store that owns it, the store's root (as
    that store last opened it) and the node it was opened on. ``store_id`` is None in a
    record written before stores had ids (an shm segment's ``owner.json`` naming a root)."""

    store_id: str | None
    root: str | None
    host: str | None

    def to_json(self) -> dict[str, str | None]:
        return {"store_id": self.store_id, "root": self.root, "host": self.host}

    @classmethod
    def from_json(cls, obj: object) -> StoreOwner | None:
        """The record in ``obj`` (a decoded JSON object), or None if it is not one."""
        if not isinstance(obj, dict):
            return None
        values = [obj.get(k) for k in ("store_id", "root", "host")]
        if not all(v is None or isinstance(v, str) for v in values):
            return None
        store_id, root, host = values
        if store_id is None and root is None:
            return None
        return cls(store_id, root, host)

    def to_bytes(self) -> bytes:
        """The record as a tier that keeps it in bytes stores it: UTF-8 JSON."""
        return json.dumps(self.to_json()).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> StoreOwner | None:
        """The record in ``raw`` (:meth:`to_bytes`), or None if it is not one: a record
        this version did not write is treated as none."""
        try:
            return cls.from_json(json.loads(raw))
        except ValueError:
            return None


def check_blob_id(blob_id: str, url: str = "") -> None:
    """Raise ``TierError`` if ``blob_id`` is not 64 lowercase hex digits."""
    if not isinstance(blob_id, str) or not BLOB_ID_RE.match(blob_id):
        raise TierError(f"invalid blob id {blob_id!r}: expected 64 lowercase hex digits", url=url)


class Tier(abc.ABC):
    """Abstract storage tier. Subclasses implement the abstract methods.

    Class attribute ``scheme`` names the URL scheme the class serves (informational; the
    registry maps schemes to classes). Instances carry ``url``, ``capabilities`` and
    ``read_only``.
    """

    scheme: ClassVar[str] = ""

    def __init__(self, url: str, *, capabilities: Capabilities, read_only: bool = False) -> None:
        self.url = url
        self.capabilities = capabilities
        self.read_only = read_only

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # --- blobs ---------------------------------------------------------------------

    @abc.abstractmethod
    def put(self, blob_id: str, data: Buffer, *, overwrite: bool = False) -> bool:
        """Store ``data`` under ``blob_id`` atomically.

        Returns True if bytes were written, False if the id was present (and ``overwrite``
        false). Raises ``ReadOnlyTier``, ``TierFull``, ``TierUnavailable``.
        """

    def put_parts(self, blob_id: str, parts: Sequence[Buffer], *, overwrite: bool = False) -> bool:
        """Store the concatenation of ``parts`` under ``blob_id``, as :meth:`put` does.

        The engine writes a raw blob as its header and a view of the staged chunk, so that a
        tier able to write several buffers at once (a vectored write) spares the copy and
        the fresh pages of joining them; such a tier overrides this. The default joins.
        """
        return self.put(blob_id, joined(parts), overwrite=overwrite)

    def begin_put(self, blob_id: str, parts: Sequence[Buffer]) -> PendingPut:
        """Begin :meth:`put_parts` (without ``overwrite``): once this returns, ``parts`` may
        be reused; the put is complete when the returned :class:`PendingPut` is finished.

        A migration reads each chunk into a buffer it reuses for the next one: a tier whose
        durable write waits on the device (a local file's fsync) copies the parts out here
        and makes them durable in :meth:`PendingPut.finish`, on another thread, while the
        next chunk is read and verified. The default puts at once.
        """
        return PendingPut(self.put_parts(blob_id, parts))

    def put_many(self, items: Iterable[tuple[str, Buffer]]) -> int:
        """Store several blobs; returns how many were written. Not atomic as a group."""
        return sum(1 for blob_id, data in items if self.put(blob_id, data))

    def put_many_parts(self, items: Iterable[tuple[str, Sequence[Buffer]]]) -> int:
        """:meth:`put_many` for blobs given as parts (see :meth:`put_parts`).

        A transactional tier takes the engine's batch of raw blobs this way (a header and
        a view of the staged chunk each) and joins each into a buffer it reuses, instead
        of the engine joining every blob into fresh memory. The default joins each blob
        as it is consumed and calls :meth:`put_many`.
        """
        return self.put_many((blob_id, joined(parts)) for blob_id, parts in items)

    @abc.abstractmethod
    def get(self, blob_id: str, out: memoryview | None = None) -> memoryview:
        """Return the stored bytes of ``blob_id``.

        With ``out`` (a writable byte buffer at least as large as the blob), the bytes are
        written into its start and ``out[:size]`` is returned; otherwise a new buffer.
        Raises ``NotFound`` (also when ``out`` is too small: ``ValueError``).
        """

    def get_parts(self, blob_id: str, parts: Sequence[memoryview]) -> int:
        """Read ``blob_id`` scattered over ``parts`` and return the blob's size in bytes.

        The blob's first ``len(parts[0])`` bytes land in ``parts[0]``, the next ones in
        ``parts[1]``, and so on (a vectored read). A blob shorter than the parts together
        leaves the rest untouched; of a longer one only the prefix that fits is read: the
        caller compares the size returned with what it gave. The engine reads a raw blob as
        its header into a small buffer and its payload straight into the destination (a
        tensor, the staging buffer), so a tier able to read into caller memory (``preadv``
        on a file, a copy out of a mapped value) spares the intermediate copy by
        overriding this. The default reads the blob with :meth:`get` and copies. Raises
        ``NotFound``.
        """
        return scatter(self.get(blob_id), parts)

    def staging_area(
        self, windows: Sequence[tuple[int, int]], stream_bytes: int
    ) -> StagingArea | None:
        """Ranges a save of this layout (chunk ``windows`` of a stream of
        ``stream_bytes``) can stage into that are this tier's own storage, its windows
        then adopted as raw blobs without a copy (:class:`StagingArea`); None where this
        tier cannot (the default), or not for this layout or now (no room)."""
        return None

    def pin(self) -> Pins | None:
        """Read blobs in place until the returned :class:`Pins` is closed, or None where
        this tier cannot (the default; then read with :meth:`get_parts`). A tier that
        returns pins keeps every pinned blob's bytes as they are while they are open (shm
        does not recycle a deleted blob's pages meanwhile); it may return None while it
        cannot promise that (another reader pins, a put is recycling a segment), and the
        caller reads with :meth:`get_parts` instead. Reads only: a read-only tier pins too.
        """
        return None

    @abc.abstractmethod
    def has(self, blob_ids: Iterable[str]) -> set[str]:
        """Return the subset of ``blob_ids`` present in this tier."""

    @abc.abstractmethod
    def delete(self, blob_ids: Iterable[str]) -> int:
        """Delete the given blobs; absent ids are ignored. Returns how many were removed."""

    @abc.abstractmethod
    def list(self) -> Iterator[str]:
        """Iterate over every blob id in this tier (any order)."""

    def size(self, blob_id: str) -> int:
        """Stored size in bytes of ``blob_id``. Default reads the blob."""
        return len(self.get(blob_id))

    def head(self, blob_id: str, nbytes: int = 64) -> bytes:
        """The first ``nbytes`` bytes of ``blob_id`` (all of it if it is shorter).

        Garbage collection reads blob headers with it (a delta blob names its base chunk
        in its first 64 bytes). Raises ``NotFound`` if the blob is absent. The default
        reads the whole blob; a tier that can read a prefix cheaply (a ranged read, a
        slice of a mapped value) should override it.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        return bytes(self.get(blob_id)[:nbytes])

    def written_at(self, blob_ids: Sequence[str]) -> dict[str, float]:
        """When each of ``blob_ids`` was last written, in seconds since the epoch (the
        clock of the tier's host: a file's mtime, an object's last-modified time), for the
        blobs the tier holds and knows it of; absent ids are left out.

        GC's grace period runs from this time, so that what a process that died left
        behind is collected by the next process, not after a grace of its own. A tier
        that reports it declares ``Capabilities.blob_times``; the default knows none
        (the grace then runs from when this process first saw the blob unreferenced).
        """
        return {}

    # --- log -----------------------------------------------------------------------

    @abc.abstractmethod
    def append(self, record: bytes, *, blobs: Iterable[tuple[str, Buffer]] = ()) -> None:
        """Append one opaque record to the log, atomically, after storing ``blobs``.

        A tier with ``capabilities.atomic_batch`` writes blobs and record in one
        transaction; others put the blobs first, then append.
        """

    @abc.abstractmethod
    def read_log(self) -> builtins.list[bytes]:
        """Every complete record, in append order. Torn or partial records are not returned."""

    def scan_log(self) -> LogScan:
        """The log's intact records (as :meth:`read_log`) and where its damaged ones were.

        ``tiercheck verify`` reports every damaged record: the commit or drop it held is
        lost from this tier. The default reports none (a tier whose records cannot be
        damaged, or that cannot tell); a tier that steps over damaged records overrides it.
        """
        return LogScan(tuple(self.read_log()))

    def replace_log_prefix(self, count: int, record: bytes) -> None:
        """Replace the first ``count`` records of the log with the single ``record``.

        ``count`` (``1 <= count <= len(read_log())``, else ``ValueError``) counts records
        as :meth:`read_log` returns them (damaged ones skipped);
        records appended after those ``count`` stay, in order, after ``record``. Atomic:
        a reader (and a crash) sees the old log or the new one, never a mix that loses a
        record. Log compaction uses it with a checkpoint record of the catalog. The
        default raises ``NotSupported``: the engine then keeps the whole log.
        """
        raise self._unsupported("log compaction (replace_log_prefix)")

    def flush(self) -> None:  # noqa: B027 - optional hook, most tiers store at once
        """Make every blob put so far durable and visible to other instances.

        A tier that batches puts (see the call sequence above) writes what is waiting;
        ``append`` and ``close`` do it too. Default: nothing (puts are stored on return).
        """

    # --- resources -----------------------------------------------------------------

    def usage(self) -> int | None:
        """Bytes of blob data this tier holds, or None where counting is not cheap.

        Memory tiers count (their ``budget`` bounds it); the default is None.
        """
        return None

    def set_budget(self, nbytes: int | str | None) -> None:
        """Change the tier's ``budget`` (bytes, a size such as ``"8GiB"``, or None: none).

        The engine sets a default budget once it knows the state's size. Blobs already
        held above a lowered budget stay (retention removes them); only new writes are
        refused. Memory tiers implement it; the default raises ``NotSupported``.
        """
        raise self._unsupported("a memory budget")

    def preallocate(self, sizes: Sequence[int]) -> int:
        """Make blobs of these sizes cheap to put later, where the tier can: shm writes
        the pages of pooled segments the puts will take, LMDB reserves the blocks they
        will write and reads them into the page cache. Returns the bytes made ready;
        never more than the tier's ``budget`` (and its other limits) allow, and a full
        medium is 0 bytes ready, not an error.

        The engine calls it at ``Checkpointer.prepare``, outside the training step, on
        every writable tier that is not shared, with the blobs of the first two versions
        (:meth:`tiercheck.store.tierset.TierSet.preallocate`). The default makes nothing
        ready (0).
        """
        return 0

    def free_memory(self) -> int | None:
        """Bytes free now in the memory this tier's blobs live in, or None where that is
        not known from this process (the default: a disk or remote tier, another node).

        The engine's default memory budgets take at most half of it
        (:mod:`tiercheck.store.budgets`). May raise ``OSError`` or a ``TierError``.
        """
        return None

    def read_owner(self) -> StoreOwner | None:
        """The owner record this tier holds (formats/SPEC.md, "Store identity"), or None:
        none recorded yet, or a tier that keeps none (the default)."""
        return None

    def write_owner(self, owner: StoreOwner) -> None:  # noqa: B027 - optional hook
        """Record ``owner`` as the store owning this tier, replacing any record (atomically:
        a reader sees the old record or the new one). Tiers that keep an owner record (shm,
        LMDB, fsspec) implement it; the default records nothing."""

    def claim_owner(self, owner: StoreOwner, *, replacing: StoreOwner | None = None) -> StoreOwner:
        """Record ``owner`` if the tier's record is still ``replacing`` (None: no record
        yet), as one atomic compare-and-swap; returns the record that holds afterwards:
        ``owner`` when this claim won, the other record when it lost (then nothing is
        written). Two stores claiming one tier at the same moment, from any processes,
        get one winner. A store opened for writing claims each tier with it
        (:mod:`tiercheck.store.identity`).

        Tiers that keep an owner record implement it atomically (shm: a lock on the
        segment; LMDB: one write transaction; fsspec: create-if-absent). The default
        reads, compares and writes with :meth:`read_owner` and :meth:`write_owner`, which
        is atomic only for a tier that keeps no record (it grants every claim); a tier
        that keeps one and can be opened by two processes must override it."""
        self._check_writable("record the owner")
        current = self.read_owner()
        if current != replacing:
            return current if current is not None else owner
        self.write_owner(owner)
        return owner

    def bind_store(self, root: str) -> None:  # noqa: B027 - optional hook
        """Record that the store at ``root`` owns this tier (called once, before saving).

        A tier holding node memory records the owner so that its memory can be reclaimed
        once that store is deleted (see :mod:`tiercheck.store.lifecycle`). Default: nothing.
        """

    # --- lifecycle -----------------------------------------------------------------

    def close(self) -> None:  # noqa: B027 - optional hook, most tiers hold nothing
        """Release resources. Further calls are undefined."""

    def unmake(self, store_id: str | None = None) -> None:  # noqa: B027 - most make nothing
        """After :meth:`close`, remove the storage this instance's open created, if it did
        and no store but ``store_id`` claimed it since (the open of a new store failed
        after it: nothing else would ever free it)."""

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- helpers for subclasses ----------------------------------------------------

    def _check_writable(self, what: str = "write") -> None:
        if self.read_only:
            raise ReadOnlyTier(f"cannot {what}: tier was opened read-only", url=self.url)

    def _unsupported(self, what: str) -> NotSupported:
        return NotSupported(f"{what} is not supported by {type(self).__name__}", url=self.url)

    @staticmethod
    def _copy_out(data: Buffer, out: memoryview | None, url: str, blob_id: str) -> memoryview:
        """Helper for ``get``: copy ``data`` into ``out`` if given, else wrap it."""
        if out is None:
            return memoryview(data)
        n = len(data)
        if len(out) < n:
            raise ValueError(
                f"buffer of {len(out)} bytes too small for blob of {n} bytes ({url} {blob_id})"
            )
        copy_bytes(out[:n], data)
        return out[:n]


_GIL_FREE_COPY = 64 * 1024  # copy_bytes hands a copy this large to numpy


def copy_bytes(dst: memoryview, src: Buffer) -> None:
    """``dst[:] = src`` (same length), without holding the GIL for a large copy: a
    memoryview's slice assignment copies under the GIL (a trainer's Python thread stalls
    behind a background thread copying chunks), numpy's copy releases it."""
    if len(dst) >= _GIL_FREE_COPY:
        import numpy as np  # here: the peer daemon and the CLI's browsing never load it

        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
    else:
        dst[:] = src


def fresh_buffer(n: int) -> memoryview:
    """A new writable buffer of ``n`` bytes whose pages are not touched here (the copy or
    read into it touches them, without the GIL where :func:`copy_bytes` or a file read
    does it). ``bytearray(n)`` zeroes it holding the GIL: a background thread making a
    chunk-sized buffer stalls the trainer's Python thread for the time. Contents are
    undefined until written."""
    if n < _GIL_FREE_COPY:
        return memoryview(bytearray(n))
    import numpy as np

    return np.empty(n, dtype=np.uint8).data


def joined(parts: Sequence[Buffer]) -> bytes | memoryview:
    """``parts`` in order in one new buffer (a copy: the caller may reuse its buffers at
    once), made without holding the GIL when large. ``b"".join`` copies under it, and a
    chunk's fresh pages fault under it too: a background thread joining 4 MiB chunks held
    a trainer's Python thread for a quarter of a second per base migrated (a step of
    140 ms took 359). Small results are bytes; large ones a memoryview of a fresh buffer
    whose pages the copies touch."""
    views = [p if isinstance(p, bytes) else memoryview(p).cast("B") for p in parts]
    total = sum(len(v) for v in views)
    if total < _GIL_FREE_COPY:
        return b"".join(views)
    out = fresh_buffer(total)
    gather(views, out)
    return out


def gather(views: Sequence[memoryview | bytes], out: memoryview) -> int:
    """Copy ``views`` one after another to the start of ``out`` (long enough), each by
    :func:`copy_bytes`; return how many bytes (the inverse of :func:`scatter`)."""
    pos = 0
    for v in views:
        copy_bytes(out[pos : pos + len(v)], v)
        pos += len(v)
    return pos


def scatter(data: Buffer, parts: Sequence[memoryview]) -> int:
    """Copy the start of ``data`` over ``parts`` in order; return ``len(data)`` (for
    :meth:`Tier.get_parts` of tiers that hold the blob in memory)."""
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    pos = 0
    for part in parts:
        if pos >= len(view):
            break
        n = min(len(part), len(view) - pos)
        copy_bytes(part[:n], view[pos : pos + n])
        pos += n
    return len(view)


def parse_budget(value: int | str | None, url: str = "", option: str = "budget") -> int | None:
    """A ``budget`` tier option (or another size ``option``) as bytes (None: no budget);
    ``InvalidURL`` naming the option if malformed (a size string such as "64MiB" is not)."""
    if value is None:
        return None
    try:
        return parse_size(value)
    except (ValueError, TypeError) as exc:
        raise invalid_url(url, f"{option}: {exc}") from None


def check_budget(
    url: str, blob_id: str, *, held: int, needed: int, budget: int | None, free: int | None = None
) -> None:
    """Raise ``OverBudget`` if ``needed`` more bytes do not fit.

    ``held`` bytes are held now; ``budget`` bounds ``held + needed`` (None: no budget);
    ``free`` is the memory the node has free for new pages (None: not checked).
    """
    if budget is not None and held + needed > budget:
        raise OverBudget(
            f"writing {format_size(needed)} would take the tier past its budget: "
            f"{format_size(held)} of {format_size(budget)} held; drop old versions "
            "(retention keep_bases/keep_diffs), or raise the tier's budget option",
            url=url,
            key=blob_id,
            needed=needed,
            held=held,
            budget=budget,
        )
    if free is not None and needed > free:
        raise OverBudget(
            f"writing {format_size(needed)} needs more memory than the node has free "
            f"({format_size(free)}); free memory (tiercheck gc --orphans, old stores), "
            "or give the tier a smaller budget so that fewer versions are kept",
            url=url,
            key=blob_id,
            needed=needed,
            held=held,
            budget=budget,
        )


def invalid_url(url: str, why: str) -> InvalidURL:
    """Build an ``InvalidURL`` error with a uniform message."""
    return InvalidURL(f"invalid tier URL {url!r}: {why}", url=url)
