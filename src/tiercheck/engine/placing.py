"""The save pipeline after staging: hash -> encode -> place (prepare) -> decide -> record.

Everything here runs on tiercheck's background threads. Per version and tier the order is
always: blobs the tier lacks, then the manifest blob, then the ``prepare`` record; the
``commit`` record comes only after the coordinator's decision. A tier that fails drops
out of this version (a lower commit level) without failing the others.

Blobs are placed while the stream is still being hashed (:class:`ShardStream`): each
window of chunks goes to the tiers that need nothing but its bytes (a tier of this rank,
codec raw or zstd) as soon as its ids are known, so copying, hashing and flushing
overlap. This changes nothing of the order above: the manifest and the prepare record
still come after every blob, so no version is committed before all its blobs are durable
in the tier, and blobs of a version that is never committed are unreferenced (GC's).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

from tiercheck.backends.base import STAGED_HEADER, StagingArea
from tiercheck.core.chunking import Layout
from tiercheck.engine.staging import ShardBytes
from tiercheck.errors import NotFound, OverBudget, TierError
from tiercheck.formats.codecs import Codec, delta_if_smaller, encode_blob, encode_blob_parts
from tiercheck.formats.ids import Buffer, chunk_id, chunk_ids_and_checks
from tiercheck.formats.manifest import (
    ChunkRef,
    CommitRecord,
    PrepareRecord,
    ReplayLog,
    Role,
    ShardManifest,
    VersionInfo,
    pack_manifest,
)
from tiercheck.runtime.handles import SaveHandle, TierState
from tiercheck.runtime.parallel import map_all
from tiercheck.store.budgets import budget_of
from tiercheck.store.catalog import append_record
from tiercheck.store.deltas import elem_size, held_bases
from tiercheck.store.tierset import TierSlot

__all__ = [
    "PlaceResult",
    "Shard",
    "ShardStream",
    "Streamed",
    "build_manifest",
    "commit_on",
    "encodes_deltas",
    "hash_stream",
    "keeps_bases_on_disk",
    "place_shard",
    "streamable",
    "sync_slots",
]

log = logging.getLogger(__name__)

BaseLookup = Callable[[str], bytes]

BATCH_BYTES = 64 * 1024 * 1024  # bytes per transaction on tiers with atomic_batch
# A stream writer joins the windows hashed while it wrote the last one into one write (one
# transaction and one sync on a tier with atomic_batch) of up to this many bytes.
GROUP_BYTES = 256 * 1024 * 1024

# a chunk's blob as parts (header, payload) and the base it is a delta against
_Encoded = tuple[str, list[Buffer], str | None]


def hash_stream(view: memoryview, layout: Layout, threads: int | None) -> tuple[ChunkRef, ...]:
    """Chunk ids of every window of the staged stream, hashed on ``threads`` cores, and
    their checks (:func:`~tiercheck.formats.ids.chunk_ids_and_checks`)."""
    windows = layout.windows
    ids, checks = chunk_ids_and_checks([view[o : o + n] for o, n in windows], threads=threads)
    return tuple(ChunkRef(cid, o, n, c) for cid, c, (o, n) in zip(ids, checks, windows))


def streamable(
    slots: Sequence[TierSlot], role: Role, unsized: Collection[str] = (), busy: Collection[str] = ()
) -> list[TierSlot]:
    """The synchronous tiers that take a version of ``role`` and can take its blobs while
    the stream is being hashed: a tier of this rank alone (a shared tier learns which
    chunks are this rank's from the exchange of chunk ids) whose blobs need nothing but
    the chunk's bytes (not a delta against a base) and with no memory budget (room is made
    in such a tier before it is written, for the whole shard, from every chunk's id), nor
    one to come (``unsized``: a default budget set once the version's size is known, after
    the hash; a write streamed then would be refused past it before room was made). Nor a
    tier ``busy`` still writing an earlier version: it skips this one (latest wins), and
    blobs streamed to it would be written for nothing (and read from the staging buffer,
    which they would hold until written)."""
    out = []
    for slot in slots:
        tp, tier = slot.policy, slot.tier
        if tier is None or tp is None or tp.mode != "sync" or not tp.wants(role):
            continue
        if slot.name in unsized or slot.name in busy:
            continue
        if tier.capabilities.shared or (tp.codec == "delta" and role == "diff"):
            continue
        if isinstance(getattr(tier, "budget", None), int):
            continue
        out.append(slot)
    return out


@dataclass
class Streamed:
    """What :class:`ShardStream` wrote to one tier before the shard's manifest existed."""

    started: float
    chunks_written: int = 0
    bytes_written: int = 0
    written: set[str] = field(default_factory=set)
    error: BaseException | None = None


class ShardStream:
    """Place a shard's chunks in tiers window by window, as soon as each is hashed.

    :meth:`hash` hashes the staged stream ``BATCH_BYTES`` at a time on the caller's thread
    and hands each window to one writer thread per tier, which writes the chunks the tier
    lacks while the next window is hashed: for a raw tier, the windows queued behind it go
    in one write of up to ``GROUP_BYTES`` (group commit: one transaction and one sync on a
    tier with ``atomic_batch``). Before a window is handed over, ``protect`` is called with its ids
    (GC must not delete a blob a writer has just found present). What the writers hold in
    flight is bounded: a window's blobs are a header and a view of the staged chunk (raw)
    or one window's encoded blobs (zstd), nothing queues up.

    A writer that fails stops writing; :func:`place_shard` (given :meth:`result` for its
    tier) then reports the tier failed for this version. :meth:`close` stops the writers
    and waits for them: the staging buffer must not be reused before (they read it).
    """

    def __init__(
        self,
        slots: Sequence[TierSlot],
        *,
        pool: Executor,
        view: memoryview | ShardBytes,
        zstd_level: int,
        protect: Callable[[list[str]], None],
        lower: Callable[[], None],
    ) -> None:
        self._pool = pool
        self._lower = lower
        self._view = view if isinstance(view, ShardBytes) else ShardBytes(view)
        self._zstd_level = zstd_level
        self._protect = protect
        self._stop = threading.Event()
        self._queues: dict[str, queue.SimpleQueue[list[ChunkRef] | None]] = {}
        self._results: dict[str, Future[Streamed]] = {}
        self._threads: list[threading.Thread] = []
        self._ended = False
        for slot in slots:
            q: queue.SimpleQueue[list[ChunkRef] | None] = queue.SimpleQueue()
            fut: Future[Streamed] = Future()
            t = threading.Thread(
                target=self._writer,
                args=(slot, q, fut),
                name=f"tiercheck-stream-{slot.name}",
                daemon=True,
            )
            self._queues[slot.name], self._results[slot.name] = q, fut
            self._threads.append(t)
            t.start()

    def hash(
        self, layout: Layout, threads: int | None, hashing: Executor | None = None
    ) -> tuple[ChunkRef, ...]:
        """Chunk ids and checks of every window of the staged stream (as
        :func:`hash_stream`; small chunks in parallel on ``hashing``), handing each
        ``BATCH_BYTES`` of windows to the writers as soon as it is hashed."""
        windows = layout.windows
        step = max(1, BATCH_BYTES // max(1, layout.chunk_size))
        refs: list[ChunkRef] = []
        try:
            for lo in range(0, len(windows), step):
                part = windows[lo : lo + step]
                with self._view.reading():
                    views = [self._view[o : o + n] for o, n in part]
                    # each chunk's check just before its id: a byte changed between the
                    # two is caught by the check at restore, never blessed by it
                    ids, checks = chunk_ids_and_checks(views, threads=threads, pool=hashing)
                    del views
                batch = [ChunkRef(cid, o, n, c) for cid, c, (o, n) in zip(ids, checks, part)]
                if self._queues:
                    self._protect(ids)
                    for q in self._queues.values():
                        q.put(batch)
                refs += batch
        finally:
            self._end()
        return tuple(refs)

    def result(self, tier: str) -> Future[Streamed] | None:
        """What the writer of ``tier`` wrote (done once it has ended); None if no writer."""
        return self._results.get(tier)

    def close(self) -> None:
        """Stop the writers (windows not yet written are dropped) and wait for them."""
        self._stop.set()
        self._end()
        for t in self._threads:
            t.join()

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            for q in self._queues.values():
                q.put(None)

    def _writer(
        self, slot: TierSlot, q: queue.SimpleQueue[list[ChunkRef] | None], fut: Future[Streamed]
    ) -> None:
        self._lower()  # this thread's own: the trainer keeps its CPU
        out = Streamed(started=time.perf_counter())
        try:
            # group commit where the blobs are views of the staged buffer (raw): an
            # encoded window owns its memory, so those are written one window at a time
            assert slot.policy is not None
            group = GROUP_BYTES if slot.policy.codec == "raw" else 0
            ended = False
            while not ended and (batch := q.get()) is not None:
                while sum(ref.length for ref in batch) < group:
                    try:
                        more = q.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        ended = True
                        break
                    batch = batch + more
                if out.error is None and not self._stop.is_set():
                    try:
                        with self._view.reading():  # raw blobs are views of what it reads
                            self._write(slot, batch, out)
                    except Exception as exc:  # the tier drops out of this version
                        out.error = exc
        finally:
            fut.set_result(out)

    def _write(self, slot: TierSlot, batch: list[ChunkRef], out: Streamed) -> None:
        tier = slot.tier
        assert tier is not None and slot.policy is not None
        codec = Codec.RAW if slot.policy.codec == "raw" else Codec.ZSTD
        first: dict[str, ChunkRef] = {}
        for ref in batch:
            if ref.id not in out.written:
                first.setdefault(ref.id, ref)
        if not first:
            return
        present = tier.has(first)
        missing = [ref for cid, ref in first.items() if cid not in present]
        out.written.update(first)

        def encode(ref: ChunkRef) -> tuple[str, list[Buffer]]:
            raw = self._view[ref.offset : ref.offset + ref.length]
            return ref.id, encode_blob_parts(raw, codec, level=self._zstd_level)

        if codec == Codec.RAW:  # a header: queued on the pool it would wait behind writes
            items = [encode(ref) for ref in missing]
        else:
            items = map_all(self._pool, encode, missing)
        if tier.capabilities.atomic_batch:
            tier.put_many_parts(items)
        else:
            map_all(self._pool, lambda item: tier.put_parts(*item), items)
        out.chunks_written += len(items)
        out.bytes_written += sum(len(p) for _, parts in items for p in parts)


def build_manifest(
    *,
    version: int,
    rank: int,
    world_size: int,
    layout: Layout,
    chunks: tuple[ChunkRef, ...],
    tree: Any,
    log: ReplayLog | None = None,
) -> tuple[ShardManifest, bytes, str]:
    """The shard manifest, its encoded bytes and its id (BLAKE3 of those bytes); ``log``
    for a log version's shard."""
    manifest = ShardManifest(
        version=version,
        rank=rank,
        world_size=world_size,
        chunk_size=layout.chunk_size,
        stream_bytes=layout.stream_bytes,
        entries=layout.entries,
        chunks=chunks,
        tree=tree,
        log=log,
        sharded=layout.sharded,
    )
    data = pack_manifest(manifest)
    return manifest, data, chunk_id(data)


@dataclass
class PlaceResult:
    """How one tier took one shard."""

    tier: str
    ok: bool
    chunks_written: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    error: str | None = None
    exception: BaseException | None = None
    deltas: dict[str, str] = field(default_factory=dict)


def place_shard(
    slot: TierSlot,
    *,
    pool: Executor,
    view: memoryview | ShardBytes,
    layout: Layout,
    manifest: ShardManifest,
    manifest_bytes: bytes,
    manifest_id: str,
    step: int,
    role: Role,
    base: int | None,
    base_chunks: Sequence[ChunkRef] | None,
    base_lookup: BaseLookup | None,
    zstd_level: int,
    only: set[str] | None = None,
    clock: Callable[[], float] = time.time,
    streamed: Future[Streamed] | None = None,
    adopt: Callable[[int, str], bool] | None = None,
) -> PlaceResult:
    """Write the chunks ``slot`` lacks, then the manifest, then the prepare record.

    ``base_chunks`` (the base version's chunks, same layout) enables delta encoding for a
    diff version on a tier whose codec is ``delta``. ``only`` limits the chunks this call
    writes (cross-rank dedup on a shared tier: the other chunks are other ranks' to write).
    ``streamed``: what a :class:`ShardStream` wrote to this tier already (awaited here; its
    failure is this tier's failure). ``view``: the staged stream, or a :class:`ShardBytes`
    that may move the reads to another tier's copy meanwhile (every read is under its lease).
    ``adopt(i, id)``: the tier holds the staged stream in its own files (shm's
    ``StageArea``, :meth:`Tier.staging_area`) and makes chunk ``i``'s window the blob
    ``id`` instead of writing a copy.
    """
    t0 = time.perf_counter()
    src = view if isinstance(view, ShardBytes) else ShardBytes(view)
    tier = slot.tier
    assert tier is not None and slot.policy is not None
    codec = slot.policy.codec
    result = PlaceResult(slot.name, ok=False)
    try:
        if streamed is not None:
            done = streamed.result()
            t0 = min(t0, done.started)
            if done.error is not None:
                raise done.error
            result.chunks_written, result.bytes_written = done.chunks_written, done.bytes_written
        first: dict[str, int] = {}
        for i, ref in enumerate(manifest.chunks):
            first.setdefault(ref.id, i)
        present = tier.has([*first, manifest_id])
        missing = [cid for cid in first if cid not in present and (only is None or cid in only)]
        local_bases: set[str] = set()
        if codec == "delta" and role == "diff" and base_chunks is not None and missing:
            local_bases = held_bases(tier, base_chunks)

        def encode(index: int) -> _Encoded:
            """The blob of chunk ``index`` as parts (header, payload), and its delta base.
            A raw blob's payload is a view of the staged chunk: nothing is copied."""
            ref = manifest.chunks[index]
            raw = src[ref.offset : ref.offset + ref.length]
            if codec == "raw":  # the caller's lease covers the write of the view
                return ref.id, encode_blob_parts(raw, Codec.RAW), None
            if (
                codec == "delta"
                and role == "diff"
                and base_chunks is not None
                and base_lookup is not None
                and index < len(base_chunks)
                and base_chunks[index].id in local_bases
            ):
                base_id = base_chunks[index].id
                try:
                    base_raw = base_lookup(base_id)
                except (NotFound, TierError) as exc:
                    log.debug("no base for delta of %s: %s", ref.id, exc)
                else:
                    elem = elem_size(layout.entries, ref.offset)
                    delta = delta_if_smaller(raw, base_raw, base_id, elem, zstd_level)
                    if delta is not None:
                        return ref.id, delta, base_id
            return ref.id, encode_blob_parts(raw, Codec.ZSTD, level=zstd_level), None

        def write(index: int) -> _Encoded:
            if adopt is not None:
                ref = manifest.chunks[index]
                adopt(index, ref.id)  # False: there already (a put racing it)
                return ref.id, [], None
            with src.reading():
                cid, parts, base_id = encode(index)
                tier.put_parts(cid, parts)  # one vectored write where the tier has it
            return cid, parts, base_id

        def encode_owned(index: int) -> _Encoded:  # encoded blobs own their bytes
            with src.reading():
                return encode(index)

        def note(cid: str, parts: Sequence[Buffer], base_id: str | None) -> None:
            result.chunks_written += 1
            # an adopted window (no parts): its file's bytes
            result.bytes_written += (
                sum(len(p) for p in parts)
                if parts
                else manifest.chunks[first[cid]].length + STAGED_HEADER
            )
            if base_id is not None:
                result.deltas[cid] = base_id

        indices = [first[c] for c in missing]
        if tier.capabilities.atomic_batch and adopt is None:
            # A transactional tier pays one durable commit per transaction, not per chunk:
            # each window of chunks is one transaction. The next window is encoded on the
            # pool while this one is written and synced (raw needs no encoding: its parts
            # are a header and a view of the staged chunk, so its windows are as large as
            # a stream writer's groups: fewer syncs).
            per = GROUP_BYTES if codec == "raw" else BATCH_BYTES
            window = max(1, per // max(1, manifest.chunk_size))
            batches = [indices[lo : lo + window] for lo in range(0, len(indices), window)]

            def submit(batch: list[int]) -> list[Future[_Encoded]] | None:
                # raw is encoded here (a header): queued on the pool, it would wait behind
                # the other tiers' writes
                return None if codec == "raw" else [pool.submit(encode_owned, i) for i in batch]

            ahead = submit(batches[0]) if batches else None
            try:
                for k, batch in enumerate(batches):
                    with src.reading():
                        encoded = (
                            [encode(i) for i in batch]
                            if ahead is None
                            else [f.result() for f in ahead]
                        )
                        ahead = submit(batches[k + 1]) if k + 1 < len(batches) else None
                        tier.put_many_parts([(cid, parts) for cid, parts, _ in encoded])
                    for cid, parts, base_id in encoded:
                        note(cid, parts, base_id)
            finally:
                for f in ahead or ():  # they read the staged view: done before we return
                    if not f.cancel():
                        f.exception()
        else:
            for cid, parts, base_id in map_all(pool, write, indices):
                note(cid, parts, base_id)
        manifest_blob = b""
        if manifest_id not in present:
            manifest_blob = encode_blob(manifest_bytes, Codec.ZSTD, level=zstd_level)
            result.bytes_written += len(manifest_blob)
        record = PrepareRecord(
            version=manifest.version,
            rank=manifest.rank,
            step=step,
            role=role,
            base=base,
            manifest=manifest_id,
            chunks_written=result.chunks_written,
            bytes_written=result.bytes_written,
            time=clock(),
            deltas=result.deltas,
        )
        blobs = [(manifest_id, manifest_blob)] if manifest_blob else []
        append_record(tier, record, blobs=blobs)
        result.ok = True
    except Exception as exc:  # a failing tier lowers the commit level; reported, not raised
        result.error = f"{type(exc).__name__}: {exc}"
        result.exception = exc
        if isinstance(exc, OverBudget):  # a skip, not a failure (store/budgets.py): the
            # save warns of it once it knows where the version went (engine/saving.py)
            log.debug("tier %s refused version %s: %s", slot.name, manifest.version, exc)
        else:
            log.warning("tier %s failed to take version %s: %s", slot.name, manifest.version, exc)
    result.seconds = time.perf_counter() - t0
    return result


def note_placed(handle: SaveHandle, r: PlaceResult) -> None:
    """Report on ``handle`` what ``r`` wrote, how long it took and, if it failed, why."""
    handle._written(r.tier, r.bytes_written, r.chunks_written)
    handle._time(f"prepared:{r.tier}", r.seconds)
    if not r.ok:
        # past the tier's memory budget: the tier is skipped for this version, not failed
        state: TierState = "missing" if isinstance(r.exception, OverBudget) else "failed"
        handle._set_tier(r.tier, state, r.error)


def commit_on(slot: TierSlot, info: VersionInfo) -> str | None:
    """Append the commit record to ``slot``; return an error string instead of raising."""
    assert slot.tier is not None
    try:
        append_record(slot.tier, CommitRecord(info))
    except Exception as exc:  # the other tiers' commit still stands
        log.warning("tier %s failed to record commit of %s: %s", slot.name, info.id, exc)
        return f"{type(exc).__name__}: {exc}"
    return None


def keeps_bases_on_disk(slot: TierSlot) -> bool:
    """A tier of this node's disk that keeps a bounded number of bases (LMDB): its retention
    runs before its next write, so that its pages hold ``keep_bases`` and the one being
    written, however far the maintenance threads lag behind the saves."""
    tier, tp = slot.tier, slot.policy
    return (
        tier is not None
        and tp is not None
        and tp.keep_bases is not None
        and tier.capabilities.persistent
        and not tier.capabilities.shared
    )


def fallback_slot(
    by_speed: Sequence[TierSlot], skipped: Collection[str], world_size: int
) -> TierSlot | None:
    """The tier that takes a version every tier that wants it skipped for lack of room.

    The fastest reachable tier without a budget, not skipped: a synchronous tier of this
    process first, whatever versions it usually takes (a diff goes to LMDB, which keeps
    bases); where there is none (LMDB lost), a single-process store writes the version
    to an asynchronous or shared one (the remote) now, before it is acknowledged. The
    version is committed somewhere rather than not at all; the memory tier's budget,
    the trainer's memory, is never exceeded. With several ranks a shared tier takes a
    version only when every rank agrees to write it there, so that fallback is left out.
    """
    usable = [
        s for s in by_speed
        if s.tier is not None and s.policy is not None and s.name not in skipped
        and budget_of(s.tier) is None
    ]  # fmt: skip
    for slot in usable:
        assert slot.tier is not None and slot.policy is not None
        if slot.policy.mode == "sync" and not slot.tier.capabilities.shared:
            return slot
    return usable[0] if usable and world_size == 1 else None


def sync_slots(slots: Sequence[TierSlot], role: Role, handle: SaveHandle) -> list[TierSlot]:
    """The synchronous tiers of ``slots`` that take a version of ``role``; every tier's
    state on ``handle`` starts here (``pending``, or ``unreachable`` with the reason)."""
    sync = []
    for slot in slots:
        if slot.tier is None:
            handle._set_tier(slot.name, "unreachable", f"tier could not be opened: {slot.error}")
            continue
        handle._set_tier(slot.name, "pending")
        tp = slot.policy
        if tp is not None and tp.mode == "sync" and tp.wants(role):
            sync.append(slot)
    return sync


def encodes_deltas(slots: Sequence[TierSlot], role: Role) -> bool:
    """Whether a synchronous tier that takes versions of ``role`` stores deltas (then
    an in-flight diff reads its base's chunks, and a sweep must leave them; otherwise a
    tier over its budget may free them: :func:`tiercheck.upkeep.retention.protection`)."""
    return any(
        s.policy is not None
        and s.policy.mode == "sync"
        and s.policy.codec == "delta"
        and s.policy.wants(role)
        for s in slots
    )


@dataclass
class Shard:
    """This rank's shard of a version, staged and hashed."""

    view: ShardBytes
    chunks: tuple[ChunkRef, ...]
    manifest: Any
    manifest_bytes: bytes
    manifest_id: str
    base_chunks: tuple[ChunkRef, ...] | None
    stream: ShardStream  # the blobs placed while hashing (step 2 overlaps step 4)
    # staged in shm's own segment files: the area and its range (shm adopts the windows)
    staged: tuple[StagingArea, int] | None = None

    def adopter(self, slot: TierSlot) -> Callable[[int, str], bool] | None:
        """How ``slot`` takes chunk ``i`` staged in its own files, if it does."""
        if self.staged is None or slot.tier is not self.staged[0].tier:
            return None
        area, r = self.staged
        return lambda i, cid: area.adopt(r, i, cid)
