"""Log-record framing: how one opaque record is laid out on a byte medium.

Frame = ``MAGIC (2 bytes b"TR") | length (u32 LE) | checksum (first 8 bytes of BLAKE3 of the
payload) | payload``. A reader walks frames from the start and stops at the first frame
that is short, has a bad magic or fails its checksum: that frame and everything after it
is a torn tail and is not returned. Tiers that keep one record per object frame it too,
so a damaged object is detected rather than parsed.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import blake3

__all__ = ["FRAME_HEADER", "frame_record", "iter_frames", "unframe_record"]

_MAGIC = b"TR"
_HEADER = struct.Struct("<2sI8s")
FRAME_HEADER = _HEADER.size  # 14 bytes
MAX_RECORD = 1 << 30


def _digest(payload: bytes | memoryview) -> bytes:
    return blake3.blake3(payload).digest(length=8)


def frame_record(payload: bytes) -> bytes:
    """Return ``payload`` wrapped in a frame."""
    if len(payload) > MAX_RECORD:
        raise ValueError(f"log record of {len(payload)} bytes exceeds {MAX_RECORD}")
    return _HEADER.pack(_MAGIC, len(payload), _digest(payload)) + payload


def iter_frames(data: bytes | memoryview) -> Iterator[bytes]:
    """Yield the payload of each intact frame in ``data``, stopping at a torn tail."""
    view = memoryview(data)
    pos = 0
    while pos + FRAME_HEADER <= len(view):
        magic, length, digest = _HEADER.unpack_from(view, pos)
        end = pos + FRAME_HEADER + length
        if magic != _MAGIC or end > len(view):
            return
        payload = bytes(view[pos + FRAME_HEADER : end])
        if _digest(payload) != digest:
            return
        yield payload
        pos = end


def unframe_record(data: bytes | memoryview) -> bytes | None:
    """Return the payload of a single-frame object, or None if it is torn or damaged."""
    for payload in iter_frames(data):
        if FRAME_HEADER + len(payload) == len(data):
            return payload
        return None
    return None
