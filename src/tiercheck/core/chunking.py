"""Laying entries out in a shard's byte stream and cutting the stream into chunks.

Layout rule (SPEC.md, "Packing entries into chunks"): tensor and array entries come first,
in flatten order, then msgpack/pickle entries; each entry starts at a 64-byte-aligned
offset. Padding is zero. An entry of at least ``chunk_size`` bytes is a segment of its
own; the stretches between such entries are segments too; each segment is cut into
windows of ``chunk_size`` bytes from its start, the last one shorter.

So a large entry always starts a chunk and ends one (no chunk straddles it, and no padding
is needed to get there), and small entries share chunks. Putting variable-size scalars
last keeps every tensor's offset, and so every chunk boundary, where it was from one
version to the next while only scalars change size: unchanged tensors then hash to the
same chunk ids and are stored once.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tiercheck.core.entries import Leaf
from tiercheck.formats.manifest import ChunkRef, Entry, ShardPlacement

__all__ = [
    "ALIGN",
    "CHUNKS_PER_STATE",
    "DEFAULT_CHUNK_SIZE",
    "MIN_CHUNK_SIZE",
    "Layout",
    "choose_chunk_size",
    "chunks_of",
    "cut_windows",
    "plan_layout",
]

ALIGN = 64
DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024
MIN_CHUNK_SIZE = 64 * 1024
CHUNKS_PER_STATE = 64


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class Layout:
    """Where each leaf lies: ``entries[i]`` describes ``leaves[i]`` (same order)."""

    entries: tuple[Entry, ...]
    stream_bytes: int
    chunk_size: int
    windows: tuple[tuple[int, int], ...]
    """``(offset, length)`` of every chunk window, in stream order."""
    sharded: Mapping[int, ShardPlacement] = field(default_factory=dict)
    """Entry index -> placement, for the entries that are pieces of a DTensor."""

    def signature(self) -> tuple[int, tuple[tuple[str, int, int], ...]]:
        """What must match for chunk ``i`` of two versions to cover the same tensor bytes.

        Only tensor and array entries count: scalars are laid out after them, so a scalar
        changing size (a loader position crossing a msgpack int width, a longer string)
        moves no tensor and must not force a new base. The tail chunks holding scalars may
        then differ in length from the base's; delta encoding handles that.
        """
        return (
            self.chunk_size,
            tuple(
                (e.key, e.offset, e.nbytes) for e in self.entries if e.kind in ("tensor", "ndarray")
            ),
        )


def choose_chunk_size(leaves: Sequence[Leaf], max_chunk_size: int) -> int:
    """The chunk size for a state of ``leaves``: ``max_chunk_size`` (the policy's
    ``chunk_size``) unless the state is smaller than :data:`CHUNKS_PER_STATE` chunks of it.

    Dedup works per chunk: a state of one 4 MiB chunk is rewritten whole when a single bias
    changes. A smaller state is cut into about :data:`CHUNKS_PER_STATE` chunks instead, of a
    power of two bytes, at least :data:`MIN_CHUNK_SIZE` (below that, per-chunk costs
    dominate: every chunk is an object in every tier, an fsync on a file tier, a request on
    an object store). The size only changes when the state doubles or halves, so the layout,
    and with it the chunk boundaries diff versions rely on, stays put from one save to the
    next.
    """
    total = sum(_round_up(leaf.nbytes, ALIGN) for leaf in leaves)
    target = total // CHUNKS_PER_STATE
    if target >= max_chunk_size:
        return max_chunk_size
    size = MIN_CHUNK_SIZE
    while size < target:
        size *= 2
    return min(size, max_chunk_size)


def plan_layout(leaves: Sequence[Leaf], chunk_size: int) -> Layout:
    """Assign a stream offset to every leaf."""
    if chunk_size < ALIGN or chunk_size % ALIGN:
        raise ValueError(f"chunk_size must be a positive multiple of {ALIGN}, got {chunk_size}")
    offsets: dict[int, int] = {}
    cuts = {0}  # segment boundaries
    pos = 0
    order = [i for i, leaf in enumerate(leaves) if leaf.kind in ("tensor", "ndarray")]
    order += [i for i, leaf in enumerate(leaves) if leaf.kind not in ("tensor", "ndarray")]
    for i in order:
        n = leaves[i].nbytes
        pos = _round_up(pos, ALIGN)
        offsets[i] = pos
        if n >= chunk_size:
            cuts.update((pos, pos + n))
        pos += n
    entries = tuple(
        Entry(leaf.key, leaf.kind, leaf.dtype, leaf.shape, offsets[i], leaf.nbytes)
        for i, leaf in enumerate(leaves)
    )
    sharded = {i: leaf.placement for i, leaf in enumerate(leaves) if leaf.placement is not None}
    return Layout(entries, pos, chunk_size, cut_windows(cuts, pos, chunk_size), sharded)


def cut_windows(cuts: set[int], stream_bytes: int, chunk_size: int) -> tuple[tuple[int, int], ...]:
    """Cut ``[0, stream_bytes)`` at ``cuts``, then every segment every ``chunk_size`` bytes."""
    bounds = sorted(c for c in cuts | {stream_bytes} if 0 <= c <= stream_bytes)
    windows: list[tuple[int, int]] = []
    for start, end in itertools.pairwise(bounds):
        windows.extend((o, min(chunk_size, end - o)) for o in range(start, end, chunk_size))
    return tuple(windows)


def chunks_of(entry: Entry, chunks: Sequence[ChunkRef]) -> range:
    """Indices of the chunks (in stream order, as in a manifest) that ``entry`` overlaps."""
    if entry.nbytes == 0 or not chunks:
        return range(0)
    starts = [c.offset for c in chunks]
    first = bisect.bisect_right(starts, entry.offset) - 1
    last = bisect.bisect_left(starts, entry.offset + entry.nbytes) - 1
    return range(max(first, 0), last + 1)
