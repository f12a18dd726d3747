"""Blob surgery shared by tests: what a writer of another format version would store."""

from __future__ import annotations

import blake3

from tiercheck.formats.codecs import FORMAT_MAJOR


def newer_major(blob: bytes) -> bytes:
    """``blob`` as a writer of the next major format would label it (SPEC.md sections 3, 5):
    the major byte bumped and the header check recomputed, payload unchanged."""
    buf = bytearray(blob)
    buf[4] = FORMAT_MAJOR + 1
    header_size = int.from_bytes(buf[8:10], "little")
    buf[12:16] = bytes(4)
    buf[12:16] = blake3.blake3(bytes(buf[:header_size])).digest(length=4)
    return bytes(buf)
