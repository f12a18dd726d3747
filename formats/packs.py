"""Packs: many blobs in one object, with the index at its end (SPEC section 16).

Layout of a pack object of ``size`` bytes::

    header   b"TCPACK1\\n"                                   8 bytes
    blobs    the stored bytes of each blob, back to back
    index    count x (id: 32 bytes | offset: u64 LE | length: u64 LE)   48 bytes each
    trailer  count: u64 LE | check: 16 bytes | b"TCPKEND1"            32 bytes

``check`` is the first 16 bytes of BLAKE3 of the index bytes. A blob's bytes are
``pack[offset : offset + length]``. The index is untrusted input: :func:`parse_index`
checks every entry (inside the blob area, no overlap, no id twice) before the reader
uses any of it, so a damaged or crafted pack can never make a reader allocate or read
outside the object.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import blake3

__all__ = [
    "MAX_PACK_BLOBS",
    "PACK_HEADER",
    "PACK_MAGIC",
    "PACK_TRAILER",
    "TAIL_GUESS",
    "PackEntry",
    "PackError",
    "encode_pack_tail",
    "index_span",
    "parse_index",
]

PACK_MAGIC = b"TCPACK1\n"
PACK_HEADER = len(PACK_MAGIC)
_END_MAGIC = b"TCPKEND1"
_TRAILER = struct.Struct("<Q16s8s")
PACK_TRAILER = _TRAILER.size  # 32 bytes
_ENTRY = struct.Struct("<32sQQ")
ENTRY_SIZE = _ENTRY.size  # 48 bytes
#: bytes a reader fetches from a pack's end first: the trailer and the index of up to
#: about 1,300 blobs, so that one ranged read finds most indexes whole
TAIL_GUESS = 64 * 1024
#: the most blobs one pack may hold: an index is read whole, so its size is bounded
MAX_PACK_BLOBS = 1 << 20


class PackError(ValueError):
    """A pack's trailer or index is damaged or impossible (the pack is not used)."""


@dataclass(frozen=True)
class PackEntry:
    """Where one blob lies in a pack: ``pack[offset : offset + length]``."""

    blob_id: str
    offset: int
    length: int


def _check(index: bytes | memoryview) -> bytes:
    return blake3.blake3(index).digest(length=16)


def encode_pack_tail(entries: Sequence[PackEntry]) -> bytes:
    """The index and trailer that end a pack holding ``entries`` (offsets from its start)."""
    index = b"".join(_ENTRY.pack(bytes.fromhex(e.blob_id), e.offset, e.length) for e in entries)
    return index + _TRAILER.pack(len(entries), _check(index), _END_MAGIC)


def index_span(trailer: bytes | memoryview, size: int) -> tuple[int, int]:
    """``(start, count)`` of the index, from a pack's last :data:`PACK_TRAILER` bytes.

    Raises :class:`PackError` if the trailer is not one, or names an index that cannot
    fit in a pack of ``size`` bytes.
    """
    if size < PACK_HEADER + PACK_TRAILER or len(trailer) != PACK_TRAILER:
        raise PackError(f"a pack of {size} bytes is too short for a header and a trailer")
    count, _, magic = _TRAILER.unpack(trailer)
    if magic != _END_MAGIC:
        raise PackError("the pack's trailer magic is wrong (torn or not a pack)")
    if count > min(MAX_PACK_BLOBS, (size - PACK_HEADER - PACK_TRAILER) // ENTRY_SIZE):
        raise PackError(f"the trailer names {count} blobs, more than a {size}-byte pack holds")
    return size - PACK_TRAILER - count * ENTRY_SIZE, int(count)


def parse_index(tail: bytes | memoryview, size: int) -> list[PackEntry]:
    """The entries of a pack of ``size`` bytes whose last ``len(tail)`` bytes are ``tail``.

    ``tail`` must hold the whole index and trailer (see :func:`index_span`). Every entry
    is checked: it lies between the header and the index, entries do not overlap, and no
    id appears twice; the index must match the trailer's check. Raises :class:`PackError`.
    """
    view = memoryview(tail)
    start, count = index_span(view[len(view) - PACK_TRAILER :], size)
    if size - start > len(view):
        raise PackError("the tail given does not hold the whole index")
    index = view[len(view) - (size - start) : len(view) - PACK_TRAILER]
    _, check, _ = _TRAILER.unpack(view[len(view) - PACK_TRAILER :])
    if _check(index) != check:
        raise PackError("the pack's index fails its check (damaged)")
    entries = []
    seen: set[str] = set()
    for i in range(count):
        raw_id, offset, length = _ENTRY.unpack_from(index, i * ENTRY_SIZE)
        blob_id = raw_id.hex()
        if offset < PACK_HEADER or offset + length > start:
            raise PackError(
                f"index entry {i} ({blob_id}) spans bytes {offset}..{offset + length}, "
                f"outside the blob area {PACK_HEADER}..{start}"
            )
        if blob_id in seen:
            raise PackError(f"index entry {i} names blob {blob_id} a second time")
        seen.add(blob_id)
        entries.append(PackEntry(blob_id, offset, length))
    end = PACK_HEADER
    for e in sorted(entries, key=lambda e: e.offset):
        if e.offset < end:
            raise PackError(f"index entry for {e.blob_id} overlaps the blob before it")
        end = e.offset + e.length
    return entries
