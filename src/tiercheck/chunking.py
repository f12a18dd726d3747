"""Laying entries out in a shard's byte stream and cutting the stream into chunks.

Layout rule (SPEC.md, "Packing entries into chunks"): tensor and array entries come first,
in flatten order, then msgpack/pickle entries; each entry starts at a 64-byte-aligned
offset, and an entry of at least ``chunk_size`` bytes starts at a chunk boundary. Padding
is zero. The stream is cut into windows of ``chunk_size`` bytes (the last may be shorter).

Putting variable-size scalars last keeps every tensor's offset, and so every chunk
boundary, where it was from one version to the next while only scalars change size:
unchanged tensors then hash to the same chunk ids and are stored once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tiercheck.entries import Leaf
from tiercheck.formats.manifest import Entry

__all__ = ["ALIGN", "DEFAULT_CHUNK_SIZE", "Layout", "chunks_of", "plan_layout"]

ALIGN = 64
DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class Layout:
    """Where each leaf lies: ``entries[i]`` describes ``leaves[i]`` (same order)."""

    entries: tuple[Entry, ...]
    stream_bytes: int
    chunk_size: int

    @property
    def windows(self) -> list[tuple[int, int]]:
        """``(offset, length)`` of every chunk window."""
        cs = self.chunk_size
        return [(o, min(cs, self.stream_bytes - o)) for o in range(0, self.stream_bytes, cs)]

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


def plan_layout(leaves: Sequence[Leaf], chunk_size: int) -> Layout:
    """Assign a stream offset to every leaf."""
    if chunk_size < ALIGN or chunk_size % ALIGN:
        raise ValueError(f"chunk_size must be a positive multiple of {ALIGN}, got {chunk_size}")
    offsets: dict[int, int] = {}
    pos = 0
    order = [i for i, leaf in enumerate(leaves) if leaf.kind in ("tensor", "ndarray")]
    order += [i for i, leaf in enumerate(leaves) if leaf.kind not in ("tensor", "ndarray")]
    for i in order:
        n = leaves[i].nbytes
        pos = _round_up(pos, chunk_size if n >= chunk_size else ALIGN)
        offsets[i] = pos
        pos += n
    entries = tuple(
        Entry(leaf.key, leaf.kind, leaf.dtype, leaf.shape, offsets[i], leaf.nbytes)
        for i, leaf in enumerate(leaves)
    )
    return Layout(entries, pos, chunk_size)


def chunks_of(entry: Entry, chunk_size: int) -> range:
    """Indices of the chunk windows that ``entry`` touches."""
    if entry.nbytes == 0:
        return range(0)
    first = entry.offset // chunk_size
    last = (entry.offset + entry.nbytes - 1) // chunk_size
    return range(first, last + 1)
