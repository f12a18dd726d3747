"""Chunk ids: BLAKE3-256 of a chunk's raw bytes, as 64 lowercase hex characters; and
chunk checks: XXH3-128 of the same bytes.

An id names content, whatever the encoding of a stored copy (SPEC.md section 2). A check
(schema 1.2, SPEC.md section 7.2) is recorded in the shard manifest next to the id, taken
from the same bytes before their id: a copy of a chunk that never left this host's memory
(a blob of the shm tier read where it lies) is verified against it at restore, at memory
speed (XXH3-128 runs at about 30 GB/s on one core here, BLAKE3 at about 5), as a file
system checks its blocks with a fast checksum and keeps a cryptographic hash for dedup.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor

import blake3
import xxhash

__all__ = [
    "CHECK_SIZE",
    "ID_HEX_LENGTH",
    "Buffer",
    "as_byte_view",
    "chunk_check",
    "chunk_id",
    "chunk_ids",
    "chunk_ids_and_checks",
]

Buffer = bytes | bytearray | memoryview

ID_HEX_LENGTH = 64

#: bytes of a chunk check (XXH3-128, canonical big-endian, seed 0)
CHECK_SIZE = 16

# Above this size one chunk is hashed by blake3's own worker pool (max_threads=AUTO, one
# pool for the process), which splits the BLAKE3 tree across cores. Measured on 2 cores
# with 4 MiB chunks: serial 5.3 GB/s, a 2-thread pool over chunks 9.1 GB/s, AUTO per chunk
# 9.5 GB/s. Below it the per-call fan-out costs more than it saves (64 KiB chunks: serial
# 4.8 GB/s, max_threads 1.8 GB/s), so small chunks are instead split into one slice per
# thread. A count of threads (``threads=N``) is never passed to blake3 for a list of
# chunks: ``max_threads=N`` builds a thread pool of N threads for each hasher, torn down
# after it (256 pools per GiB of 4 MiB chunks: 144 ms and 262 ms of CPU per GiB on 2
# cores, against 122 ms and 235 ms for the chunks handed out one at a time to 2 threads).
_TREE_PARALLEL_MIN = 1 << 20
# Small chunks are only worth a thread pool when there is this much of them in total.
_POOL_MIN_BYTES = 8 << 20


def as_byte_view(data: Buffer) -> memoryview:
    """Return a flat, unsigned-byte memoryview of ``data`` (no copy).

    Accepts any C-contiguous buffer, including memoryviews of other formats or more
    dimensions (e.g. a view of a float32 array); raises ``ValueError`` for a
    non-contiguous one.
    """
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.c_contiguous:
        raise ValueError("chunk buffers must be C-contiguous")
    return view.cast("B")


def chunk_id(data: Buffer) -> str:
    """Return the chunk id of ``data``: BLAKE3-256 as 64 lowercase hex characters."""
    view = as_byte_view(data)
    if len(view) >= _TREE_PARALLEL_MIN:
        return blake3.blake3(view, max_threads=blake3.blake3.AUTO).hexdigest()
    return blake3.blake3(view).hexdigest()


def chunk_check(data: Buffer) -> bytes:
    """The check of ``data``: XXH3-128 (seed 0), ``CHECK_SIZE`` bytes, big-endian. The
    GIL is released while it runs."""
    return xxhash.xxh3_128_digest(as_byte_view(data))


def _hash_serial(
    views: Sequence[memoryview],
    checks: list[bytes] | None = None,
    indices: Sequence[int] | None = None,
) -> list[str]:
    """The ids of ``views`` (of those at ``indices``), one after the other on this thread."""
    return [
        _hash_one(views, i, checks) for i in (range(len(views)) if indices is None else indices)
    ]


def _hash_one(
    views: Sequence[memoryview], i: int, checks: list[bytes] | None, max_threads: int = 1
) -> str:
    """The id of ``views[i]``, and, where ``checks`` is given, its check into ``checks[i]``
    first: the bytes the check reads are in this core's cache when BLAKE3 reads them (a
    4 MiB chunk: one pass over memory for both, not two)."""
    if checks is not None:
        checks[i] = chunk_check(views[i])
    return blake3.blake3(views[i], max_threads=max_threads).hexdigest()


def chunk_ids(
    chunks: Sequence[Buffer], threads: int | None = None, *, pool: Executor | None = None
) -> list[str]:
    """Return the chunk id of every buffer in ``chunks``, in order, using ``threads`` cores.

    ``threads=None`` uses every core; ``threads=1`` hashes on the calling thread only.
    Large chunks (>= 1 MiB) are each hashed with BLAKE3's tree parallelism where
    ``threads`` is None; with a count, two or more are handed out one at a time to
    ``threads`` threads (the caller's and tasks on ``pool``, or on a pool made for the
    call). Many small ones are hashed in ``threads`` slices on ``pool`` (blake3 releases
    the GIL while hashing), or on the calling thread when no pool is given.
    """
    return _ids([as_byte_view(c) for c in chunks], threads, pool, None)


def chunk_ids_and_checks(
    chunks: Sequence[Buffer], threads: int | None = None, *, pool: Executor | None = None
) -> tuple[list[str], list[bytes]]:
    """The ids of ``chunks`` as :func:`chunk_ids` hashes them, and their checks
    (:func:`chunk_check`), each chunk's check taken just before its id, on the same thread
    (what a save records: SPEC.md section 7.2)."""
    views = [as_byte_view(c) for c in chunks]
    checks = [b""] * len(views)
    return _ids(views, threads, pool, checks), checks


def _ids(
    views: Sequence[memoryview],
    threads: int | None,
    pool: Executor | None,
    checks: list[bytes] | None,
) -> list[str]:
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    workers = threads if threads is not None else (os.cpu_count() or 1)
    if workers == 1:
        return _hash_serial(views, checks)

    max_threads = blake3.blake3.AUTO if threads is None else workers
    ids = [""] * len(views)
    large = [i for i, view in enumerate(views) if len(view) >= _TREE_PARALLEL_MIN]
    small = [i for i, view in enumerate(views) if len(view) < _TREE_PARALLEL_MIN]
    if threads is None or len(large) < 2:
        for i in large:
            ids[i] = _hash_one(views, i, checks, max_threads)
    else:
        _hash_in_lanes(views, large, ids, min(workers, len(large)), pool, checks)

    small_bytes = sum(len(views[i]) for i in small)
    if pool is None or small_bytes < _POOL_MIN_BYTES or len(small) < 2:
        for i in small:
            ids[i] = _hash_one(views, i, checks)
    else:
        n_slices = min(workers, len(small))
        slices = [small[k::n_slices] for k in range(n_slices)]
        hashed = pool.map(lambda idx: _hash_serial(views, checks, idx), slices)
        for idx, hexes in zip(slices, hashed):
            for i, h in zip(idx, hexes):
                ids[i] = h
    return ids


def _hash_in_lanes(
    views: Sequence[memoryview],
    indices: Sequence[int],
    ids: list[str],
    lanes: int,
    pool: Executor | None,
    checks: list[bytes] | None = None,
) -> None:
    """``ids[i]`` for each ``i`` in ``indices``, one chunk per thread at a time on ``lanes``
    threads: the caller's and ``lanes - 1`` tasks on ``pool`` (or on a pool made for this
    call), each taking the next chunk when it is done with one, so that a thread the
    scheduler holds back delays no other's chunks."""
    order = iter(indices)
    lock = threading.Lock()

    def lane() -> None:
        while True:
            with lock:
                i = next(order, None)
            if i is None:
                return
            ids[i] = _hash_one(views, i, checks)

    own = None
    if pool is None:
        pool = own = ThreadPoolExecutor(lanes - 1, thread_name_prefix="tiercheck-hash")
    try:
        helpers = [pool.submit(lane) for _ in range(lanes - 1)]
        lane()
        for helper in helpers:
            if not helper.cancel():  # one that never started has nothing left to take
                helper.result()
    finally:
        if own is not None:
            own.shutdown()
