"""Log-record framing: how one opaque record is laid out on a byte medium.

Frame = ``MAGIC (2 bytes b"TR") | length (u32 LE) | checksum (first 8 bytes of BLAKE3 of the
payload) | payload``. A reader walks frames from the start and stops at the first frame
that is short, has a bad magic or fails its checksum: that frame and everything after it
is a torn tail and is not returned. Tiers that keep one record per object frame it too,
so a damaged object is detected rather than parsed.

:func:`scan_frames` is the reader a tier that keeps its log in one byte stream uses (format
revision 1.1, SPEC section 6.1): it steps over a damaged frame in the middle to the next
intact one, so damage to one record never hides the records after it; only bytes after
the last intact frame are a torn tail.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

import blake3

__all__ = [
    "FRAME_HEADER",
    "FrameScan",
    "frame_record",
    "iter_frames",
    "scan_frames",
    "torn_tail",
    "unframe_record",
]

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


def _intact_at(view: memoryview, pos: int) -> int:
    """End offset of an intact frame starting at ``pos``, or -1 if there is none."""
    if pos + FRAME_HEADER > len(view):
        return -1
    magic, length, digest = _HEADER.unpack_from(view, pos)
    end: int = pos + FRAME_HEADER + length
    if magic != _MAGIC or end > len(view):
        return -1
    if _digest(view[pos + FRAME_HEADER : end]) != digest:
        return -1
    return end


@dataclass(frozen=True)
class FrameScan:
    """What :func:`scan_frames` found: the intact frames' payloads and ``(start, end)``
    offsets, how many damaged stretches were stepped over, and ``intact_end``, the end
    of the last intact frame (bytes after it are a torn tail)."""

    payloads: tuple[bytes, ...]
    spans: tuple[tuple[int, int], ...]
    damaged: int
    intact_end: int


def _next_intact(view: memoryview, pos: int) -> int:
    """Start of the first intact frame after a damaged one at ``pos``, or -1."""
    # The damaged frame's own length field is usually still right: try where it ends.
    if pos + FRAME_HEADER <= len(view) and bytes(view[pos : pos + 2]) == _MAGIC:
        length: int = _HEADER.unpack_from(view, pos)[1]
        end = pos + FRAME_HEADER + length
        if end < len(view) and _intact_at(view, end) >= 0:
            return end
    data = view.obj if isinstance(view.obj, bytes) else bytes(view)
    at = pos + 1
    while True:
        at = data.find(_MAGIC, at)
        if at < 0:
            return -1
        if _intact_at(view, at) >= 0:
            return at
        at += 1


def torn_tail(data: bytes | memoryview, start: int) -> bool:
    """Whether the bytes of ``data`` from ``start`` (after the last intact frame) can be what
    an append cut short leaves: empty, or the beginning of a frame (a prefix of the magic,
    or the magic and a length that runs past the end). Anything else (a complete frame
    that fails its check, bytes without the magic) is damage, never cut off."""
    tail = bytes(memoryview(data)[start:])
    if len(tail) < len(_MAGIC):
        return _MAGIC.startswith(tail)
    if tail[: len(_MAGIC)] != _MAGIC:
        return False
    if len(tail) < FRAME_HEADER:
        return True
    length: int = _HEADER.unpack_from(tail, 0)[1]
    return FRAME_HEADER + length > len(tail)


def scan_frames(data: bytes | memoryview) -> FrameScan:
    """Every intact frame of a byte-stream log, stepping over damaged ones.

    A frame that is damaged (bad magic or check, impossible length) but followed by an
    intact frame is skipped and counted in ``damaged``; the records after it are kept.
    Bytes after the last intact frame are a torn tail.
    """
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    payloads: list[bytes] = []
    spans: list[tuple[int, int]] = []
    damaged = 0
    pos = 0
    while pos < len(view):
        end = _intact_at(view, pos)
        if end < 0:
            nxt = _next_intact(view, pos)
            if nxt < 0:
                break  # a torn tail
            damaged += 1
            pos = nxt
            continue
        payloads.append(bytes(view[pos + FRAME_HEADER : end]))
        spans.append((pos, end))
        pos = end
    return FrameScan(tuple(payloads), tuple(spans), damaged, spans[-1][1] if spans else 0)
