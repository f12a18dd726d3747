"""Resharding: a restore onto another layout assembles each distributed tensor's box.

A target whose box is the saved one (same mesh, same placements) is loaded in place like
any tensor. Any other target, a DTensor on another mesh or placement, or a plain tensor
(which gets the whole global tensor), is a :class:`Piece`: its box is assembled from the
boxes the version's ranks saved (SPEC.md section 14.2), read through their shard
manifests (every rank's manifest id is in the version's ``VersionInfo``), as DCP
resharding does. :func:`gather` fetches and verifies every chunk a restore needs before
anything is written, so the restore stays all or nothing; :meth:`Gathered.apply` then
copies. What a save stores of a DTensor is :mod:`tiercheck.core.sharded`'s business.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from tiercheck.core.entries import torch_dtype
from tiercheck.core.sharded import box_of, is_dtensor
from tiercheck.errors import CheckpointError, StateError
from tiercheck.formats.manifest import Entry, ShardManifest, ShardPlacement, VersionInfo
from tiercheck.runtime.parallel import map_all
from tiercheck.store.fetch import ChunkFetcher
from tiercheck.store.tierset import TierSlot

__all__ = [
    "Gathered",
    "Piece",
    "gather",
    "piece_for",
]


@dataclass(frozen=True)
class Piece:
    """A box of a saved distributed tensor to fill: ``dest`` holds the global elements
    from ``offsets`` on (``dest.shape`` of them per dimension)."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    dest: Any  # torch.Tensor: a DTensor's local tensor, or a whole plain tensor
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class _Copy:
    """Copy the overlap (``lo``..``hi``, global coordinates) of one saved box."""

    piece: Piece
    entry: Entry
    box: tuple[int, ...]  # the saved box's offsets
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    rank: int  # whose manifest holds it

    def span(self) -> tuple[int, int]:
        """The stream bytes from the overlap's first element to its last, in the piece."""
        size = torch_dtype(self.entry.dtype).itemsize
        strides = _contiguous_strides(self.entry.shape)
        first = sum((lo - b) * s for lo, b, s in zip(self.lo, self.box, strides))
        last = sum((hi - 1 - b) * s for hi, b, s in zip(self.hi, self.box, strides))
        return self.entry.offset + first * size, self.entry.offset + (last + 1) * size


@dataclass
class Gathered:
    """Every saved box a restore needs, fetched and verified; :meth:`apply` copies them."""

    copies: list[_Copy] = field(default_factory=list)
    manifests: dict[int, ShardManifest] = field(default_factory=dict)
    chunks: dict[tuple[int, int], bytearray] = field(default_factory=dict)  # (rank, i) -> raw
    own: tuple[int, memoryview] | None = None  # (rank, its staged stream)
    starts: dict[int, list[int]] = field(default_factory=dict)  # rank -> its chunks' offsets
    bytes_read: int = 0

    def _bytes(self, rank: int, lo: int, hi: int) -> memoryview:
        if self.own is not None and self.own[0] == rank:
            return self.own[1][lo:hi]
        m = self.manifests[rank]
        first, last = _chunks_between(self.starts[rank], lo, hi)
        if first == last:  # within one chunk: no copy
            ref = m.chunks[first]
            return memoryview(self.chunks[(rank, first)])[lo - ref.offset : hi - ref.offset]
        out = bytearray(hi - lo)
        for ci in range(first, last + 1):
            ref = m.chunks[ci]
            a, z = max(lo, ref.offset), min(hi, ref.offset + ref.length)
            out[a - lo : z - lo] = self.chunks[(rank, ci)][a - ref.offset : z - ref.offset]
        return memoryview(out)

    def apply(self) -> None:
        """Copy every overlap into its piece (after :func:`gather` succeeded)."""
        import torch

        with torch.no_grad():
            for c in self.copies:
                dtype = torch_dtype(c.entry.dtype)
                start, end = c.span()
                raw = self._bytes(c.rank, start, end)
                flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
                shape = [hi - lo for lo, hi in zip(c.lo, c.hi)]
                strides = _contiguous_strides(c.entry.shape)
                src = flat.as_strided(shape, strides) if shape else flat.reshape(())
                dst = c.piece.dest
                for d, (lo, hi) in enumerate(zip(c.lo, c.hi)):
                    dst = dst.narrow(d, lo - c.piece.offsets[d], hi - lo)
                dst.copy_(src)


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(shape[d + 1], 1)
    return strides


def _chunks_between(starts: Sequence[int], lo: int, hi: int) -> tuple[int, int]:
    """The first and last index of the chunks starting at ``starts`` (in stream order,
    tiling the stream) that hold stream bytes ``[lo, hi)``, ``lo < hi``."""
    return bisect.bisect_right(starts, lo) - 1, bisect.bisect_left(starts, hi) - 1


def gather(
    pieces: Sequence[Piece],
    info: VersionInfo,
    fetcher: ChunkFetcher,
    order: Sequence[TierSlot],
    pool: Executor,
    *,
    expect: Sequence[str] = (),
    own: tuple[int, ShardManifest, memoryview] | None = None,
) -> Gathered:
    """Find, fetch and verify the saved boxes that cover ``pieces``; write nothing.

    Reads the shard manifest of every rank of ``info`` (``own``: this rank's, already
    staged, whose bytes are not fetched again). A replicated box saved by several ranks is
    read once. Raises :class:`StateError` when a piece does not fit what was saved, and
    :class:`CheckpointError` when the saved boxes do not cover it.
    """
    g = Gathered()
    if not pieces:
        return g
    if own is not None:
        g.manifests[own[0]] = own[1]
        g.own = (own[0], own[2])
    for r, mid in enumerate(info.shards):
        if r not in g.manifests:
            g.manifests[r] = fetcher.manifest(mid, order=order)
        g.starts[r] = [c.offset for c in g.manifests[r].chunks]
    # key -> [(rank, entry, placement)], each distinct box once
    saved: dict[str, list[tuple[int, Entry, ShardPlacement]]] = {}
    wanted = {p.key for p in pieces}
    ranks = sorted(g.manifests, key=lambda r: (g.own is None or r != g.own[0], r))
    for r in ranks:  # this rank's own boxes first: they need no fetch
        m = g.manifests[r]
        for i, placement in m.sharded.items():
            e = m.entries[i]
            if e.key not in wanted:
                continue
            boxes = saved.setdefault(e.key, [])
            if all(p.offsets != placement.offsets or x.shape != e.shape for _, x, p in boxes):
                boxes.append((r, e, placement))
    need: set[tuple[int, int]] = set()
    for piece in pieces:
        found = saved.get(piece.key)
        if not found:
            raise CheckpointError(
                f"{piece.key}: version {info.id} holds no sharded tensor under this key"
            )
        covered = 0
        for r, e, placement in found:
            if placement.global_shape != piece.global_shape or e.dtype != piece.dtype:
                raise StateError(
                    f"saved {e.dtype} {placement.global_shape} (global) does not match the "
                    f"state's {piece.dtype} {piece.global_shape}",
                    key=piece.key,
                )
            lo = tuple(max(a, b) for a, b in zip(piece.offsets, placement.offsets))
            hi = tuple(
                min(a + n, b + k)
                for a, n, b, k in zip(piece.offsets, piece.dest.shape, placement.offsets, e.shape)
            )
            if any(a >= z for a, z in zip(lo, hi)):
                continue
            copy = _Copy(piece, e, placement.offsets, lo, hi, r)
            g.copies.append(copy)
            covered += math.prod(z - a for a, z in zip(lo, hi))
            if g.own is None or r != g.own[0]:  # only the chunks under the overlap
                first, last = _chunks_between(g.starts[r], *copy.span())
                need.update((r, ci) for ci in range(first, last + 1))
        if covered != math.prod(piece.dest.shape):
            raise CheckpointError(
                f"{piece.key}: the pieces version {info.id} saved cover {covered} of the "
                f"{math.prod(piece.dest.shape)} elements this rank needs"
            )

    def one(item: tuple[int, int]) -> None:
        r, ci = item
        ref = g.manifests[r].chunks[ci]
        buf = bytearray(ref.length)
        fetcher.fetch(ref.id, memoryview(buf), order=order, expect=expect)
        g.chunks[item] = buf

    map_all(pool, one, sorted(need))
    g.bytes_read = sum(len(b) for b in g.chunks.values())
    return g


def piece_for(key: str, entry: Entry, placement: ShardPlacement, target: Any) -> Piece | None:
    """The piece to assemble for ``target``, or None where the saved box is the target's
    own (loaded in place like any tensor entry). Raises :class:`StateError` if ``target``
    cannot hold the saved tensor."""
    import torch

    dtype = str(target.dtype).removeprefix("torch.")
    if dtype != entry.dtype or tuple(target.shape) != placement.global_shape:
        raise StateError(
            f"saved tensor {entry.dtype} {placement.global_shape} (global) does not match "
            f"the state's {dtype} {tuple(target.shape)}",
            key=key,
        )
    if is_dtensor(target):
        local, offsets = box_of(target, key)
        if (
            offsets == placement.offsets
            and tuple(local.shape) == entry.shape
            and local.device.type == "cpu"
            and local.is_contiguous()
        ):
            return None
        return Piece(key, entry.dtype, placement.global_shape, local, offsets)
    assert isinstance(target, torch.Tensor)
    return Piece(key, entry.dtype, placement.global_shape, target, (0,) * len(entry.shape))
