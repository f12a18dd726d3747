"""Migration: copying a committed version to a slower tier after the commit.

A migration reads the version's chunks from the fastest tier holding it (verified, with
fallback), re-encodes them for the target tier's codec, writes what the target lacks,
then the manifest, then ``prepare`` and ``commit`` records, in that order, so the target's
log never names a version whose blobs are not all there. A target that is unreachable
(:class:`~tiercheck.errors.TierUnavailable`) keeps the job pending; it is retried later,
and nothing already committed elsewhere is affected.

Cost: each chunk is read once, straight into a per-thread buffer where the source holds it
raw, and verified there (the one hash of the migration: a copy must not carry damage to a
slower tier). A raw target gets header + that buffer in one vectored write (a local file:
into the page cache, then fsynced and named on a write thread while the next chunk is
read, see ``Tier.begin_put``); a compressed target gets the encoded blob, uploaded while
the next chunk is encoded. Up to ``WRITE_WINDOW`` blobs are in flight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass

from tiercheck.backends.base import PendingPut, fresh_buffer
from tiercheck.errors import CheckpointError, NotFound, TierError
from tiercheck.formats.codecs import Codec, delta_if_smaller, encode_blob, encode_blob_parts
from tiercheck.formats.ids import Buffer
from tiercheck.formats.manifest import CommitRecord, PrepareRecord, VersionInfo, unpack_manifest
from tiercheck.runtime.background import Halt
from tiercheck.runtime.executors import WRITE_WINDOW
from tiercheck.store.catalog import append_record
from tiercheck.store.deltas import elem_size, held_bases
from tiercheck.store.fetch import ChunkFetcher
from tiercheck.store.tierset import TierSlot

__all__ = ["MigrationResult", "migrate_shard"]


@dataclass
class MigrationResult:
    version: int
    tier: str
    chunks_written: int
    bytes_written: int
    seconds: float


def migrate_shard(
    info: VersionInfo,
    rank: int,
    target: TierSlot,
    sources: Sequence[TierSlot],
    fetcher: ChunkFetcher,
    pool: Executor,
    *,
    writes: Executor,
    zstd_level: int,
    base_manifest_id: str | None = None,
    commit: bool = True,
    only: set[str] | None = None,
    halt: Halt | None = None,
) -> MigrationResult:
    """Copy rank ``rank``'s shard of ``info`` into ``target``; record prepare (and commit).

    Chunks are read, verified and encoded on ``pool``; their writes run on ``writes`` (the
    store's write threads), at most ``WRITE_WINDOW`` of this migration's at a time.

    ``only`` limits the chunks copied (on a shared tier the others are other ranks' to
    write, see :mod:`tiercheck.engine.partition`); ``commit=False`` leaves the
    commit record to the coordinator rank. Once ``halt`` is set no further chunk is read or
    written and no record appended (:class:`~tiercheck.errors.Halted` is raised).
    """
    what = f"the migration of version {info.id} to {target.name}"

    def check() -> None:
        if halt is not None:
            halt.check(what)

    t0 = time.perf_counter()
    tier = target.tier
    assert tier is not None and target.policy is not None
    manifest_id = info.shards[rank]
    manifest_raw = bytes(fetcher.fetch(manifest_id, order=sources)[0])
    manifest = unpack_manifest(manifest_raw)
    first: dict[str, int] = {}
    for i, ref in enumerate(manifest.chunks):
        first.setdefault(ref.id, i)
    present = tier.has([*first, manifest_id])
    missing = [c for c in first if c not in present and (only is None or c in only)]
    codec = target.policy.codec
    base_chunks = None
    if codec == "delta" and info.role == "diff" and base_manifest_id is not None:
        try:
            base_chunks = fetcher.manifest(base_manifest_id, order=sources).chunks
        except (NotFound, TierError):
            base_chunks = None
    deltas: dict[str, str] = {}
    local_bases: set[str] = set()
    if base_chunks is not None and missing:
        local_bases = held_bases(tier, base_chunks)

    local = threading.local()

    def copy(cid: str) -> int:
        check()
        index = first[cid]
        length = manifest.chunks[index].length
        # decode into this thread's buffer: no fresh pages, and no copy out of the
        # fetcher's scratch buffer (the encoded blob is the only new allocation)
        buf: memoryview | None = getattr(local, "buf", None)
        if buf is None or len(buf) < length:
            buf = local.buf = fresh_buffer(max(length, manifest.chunk_size))
        # verified as read (a copy must not carry damage to a slower tier); not hashed again
        raw, _ = fetcher.fetch(cid, buf[:length], order=sources)
        parts: list[Buffer]
        if codec == "raw":  # header + this thread's buffer, written without joining
            parts = encode_blob_parts(raw, Codec.RAW)
        elif (
            base_chunks is not None
            and index < len(base_chunks)
            and base_chunks[index].id in local_bases
        ):
            base_id = base_chunks[index].id
            base_raw, _ = fetcher.fetch(base_id, order=sources)
            elem = elem_size(manifest.entries, manifest.chunks[index].offset)
            delta = delta_if_smaller(raw, base_raw, base_id, elem, zstd_level)
            if delta is not None:
                deltas[cid] = base_id
                parts = delta
            else:
                parts = encode_blob_parts(raw, Codec.ZSTD, level=zstd_level)
        else:
            parts = encode_blob_parts(raw, Codec.ZSTD, level=zstd_level)
        window.acquire()
        pending: PendingPut | None = None
        try:
            check()  # close() began: this blob is not written
            if codec == "raw":  # the parts hold this thread's buffer, reused next: the
                # tier copies them out now and makes them durable on a write thread
                pending = tier.begin_put(cid, parts)
            with lock:
                if ended:  # the migration failed while this chunk was read
                    raise CheckpointError(f"{what} has ended")
                if pending is not None:
                    write = writes.submit(pending.finish)
                else:  # a compressed blob owns its bytes: uploaded while the next is encoded
                    write = writes.submit(tier.put_parts, cid, parts)
                in_flight.append((write, pending))
        except BaseException:
            if pending is not None:
                pending.abort()
            window.release()
            raise
        write.add_done_callback(lambda _: window.release())
        return sum(len(p) for p in parts)

    # Writes run on the write threads, up to WRITE_WINDOW of this migration's at a time,
    # beside the CPU pool that reads, verifies and encodes: a local file's fsync (raw) and
    # a store reached over the network (compressed) wait on the device, not the CPU. Memory
    # stays bounded by the window (a raw blob is copied out into the page cache before it
    # is queued).
    window = threading.BoundedSemaphore(WRITE_WINDOW)
    lock = threading.Lock()
    in_flight: list[tuple[Future[bool], PendingPut | None]] = []
    ended = False  # under lock: once set, no write of this migration is queued
    try:
        written = list(pool.map(copy, missing))
        for write, _ in in_flight:
            write.result()  # the first failed write fails the migration
    finally:
        with lock:
            ended = True
            queued = list(in_flight)
        for write, _ in queued:
            write.cancel()  # not started yet: never started
        wait([write for write, _ in queued if not write.cancelled()])  # those never run
        for write, pending in queued:
            if pending is not None and write.cancelled():
                pending.abort()  # begun, never finished: its temporary file goes
    nbytes = sum(written)
    blobs = []
    if manifest_id not in present:
        mblob = encode_blob(manifest_raw, Codec.ZSTD, level=zstd_level)
        blobs.append((manifest_id, mblob))
        nbytes += len(mblob)
    check()
    append_record(
        tier,
        PrepareRecord(
            version=info.id,
            rank=rank,
            step=info.step,
            role=info.role,
            base=info.base,
            manifest=manifest_id,
            chunks_written=len(written),
            bytes_written=nbytes,
            time=time.time(),
            deltas=deltas,
        ),
        blobs=blobs,
    )
    if commit:
        check()
        append_record(tier, CommitRecord(info))
    return MigrationResult(info.id, target.name, len(written), nbytes, time.perf_counter() - t0)
