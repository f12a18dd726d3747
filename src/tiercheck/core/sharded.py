"""Distributed tensors (DTensor, FSDP2): saved as local pieces, restored onto any mesh.

Save: a DTensor leaf is stored as this rank's local shard, an ordinary ``tensor`` entry,
plus a :class:`~tiercheck.formats.manifest.ShardPlacement` saying which box of the global
tensor it holds (SPEC.md section 14). Replicated pieces on several ranks are the same
chunks, stored once in a shared tier.

Restore: a target whose box is the saved one (same mesh, same placements) is loaded in
place like any tensor. Any other target, a DTensor on another mesh or placement, or a
plain tensor (which gets the whole global tensor), is a :class:`Piece`: its box is
assembled from the boxes the version's ranks saved, read through their shard manifests
(every rank's manifest id is in the version's ``VersionInfo``), as DCP resharding does.
:func:`gather` fetches and verifies every chunk a restore needs before anything is
written, so the restore stays all or nothing; :meth:`Gathered.apply` then copies.
"""

from __future__ import annotations

import bisect
import math
import sys
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiercheck.core.entries import torch_dtype
from tiercheck.engine.fetch import ChunkFetcher
from tiercheck.engine.tierset import TierSlot
from tiercheck.errors import CheckpointError, StateError, UnsupportedValue
from tiercheck.formats.manifest import Entry, ShardManifest, ShardPlacement, VersionInfo

if TYPE_CHECKING:
    import torch

__all__ = [
    "Gathered",
    "Piece",
    "box_of",
    "gather",
    "is_dtensor",
    "local_piece",
    "piece_for",
]


def is_dtensor(obj: object) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (without importing it needlessly:
    no DTensor exists before its module has been imported)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(obj, module.DTensor)


def _placement_names(t: Any, key: str, error: type[StateError]) -> tuple[str, ...]:
    from torch.distributed.tensor import Replicate, Shard

    names = []
    for p in t.placements:
        if type(p) is Shard:  # not _StridedShard (FSDP2 + TP): its piece is not one box
            names.append(f"S({p.dim})")
        elif isinstance(p, Replicate):
            names.append("R")
        else:
            raise error(
                f"DTensor placement {p} ({type(p).__name__}) is not supported (only Shard and "
                "Replicate); "
                "redistribute the tensor first",
                key=key,
            )
    return tuple(names)


# (global shape, mesh, placements) -> (mesh, placement names, local shape, offsets). Computing a
# layout costs ~0.3 ms of Python in torch; a model has thousands of DTensors of a few
# layouts, and save() computes them on the caller's thread. The mesh is kept in the value,
# so its id is not reused while the entry lives.
_LAYOUTS: dict[tuple[Any, ...], tuple[Any, tuple[str, ...], tuple[int, ...], tuple[int, ...]]] = {}
_LAYOUTS_MAX = 4096


def _layout(
    t: Any, key: str, error: type[StateError]
) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    """Placement names, local shape and global offsets of this rank's piece of ``t``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, tuple(t.placements)
    cache_key = (tuple(t.shape), id(mesh), placements)
    hit = _LAYOUTS.get(cache_key)
    if hit is not None and hit[0] is mesh:
        return hit[1], hit[2], hit[3]
    names = _placement_names(t, key, error)
    if mesh.get_coordinate() is None:
        raise error("this rank is not in the DTensor's mesh", key=key)
    shape, offsets = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    result = (names, tuple(int(d) for d in shape), tuple(int(o) for o in offsets))
    if len(_LAYOUTS) >= _LAYOUTS_MAX:
        _LAYOUTS.clear()
    _LAYOUTS[cache_key] = (mesh, *result)
    return result


_MESH_SHAPES: dict[int, tuple[Any, tuple[int, ...]]] = {}


def _mesh_shape(mesh: Any) -> tuple[int, ...]:
    hit = _MESH_SHAPES.get(id(mesh))
    if hit is None or hit[0] is not mesh:
        if len(_MESH_SHAPES) >= _LAYOUTS_MAX:
            _MESH_SHAPES.clear()
        hit = _MESH_SHAPES[id(mesh)] = (mesh, tuple(int(d) for d in mesh.shape))
    return hit[1]


def box_of(t: Any, key: str) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The local tensor of DTensor ``t`` and the offsets of its box in the global tensor."""
    _, shape, offsets = _layout(t, key, StateError)
    local = t._local_tensor
    if tuple(local.shape) != shape:
        raise StateError(
            f"the DTensor's local tensor has shape {tuple(local.shape)}, its placements "
            f"give {shape}",
            key=key,
        )
    return local, offsets


def local_piece(t: Any, key: str) -> tuple[torch.Tensor, ShardPlacement]:
    """What a save stores for DTensor ``t``: its local tensor and its placement."""
    names, shape, offsets = _layout(t, key, UnsupportedValue)
    local = t._local_tensor
    if tuple(local.shape) != shape:
        raise UnsupportedValue(
            f"the DTensor's local tensor has shape {tuple(local.shape)}, its placements "
            f"give {shape}",
            key=key,
        )
    placement = ShardPlacement(
        global_shape=tuple(int(d) for d in t.shape),
        global_stride=tuple(int(s) for s in t.stride()),
        mesh_shape=_mesh_shape(t.device_mesh),
        placements=names,
        offsets=offsets,
    )
    return local, placement


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

    list(pool.map(one, sorted(need)))
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
