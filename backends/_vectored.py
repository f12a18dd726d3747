"""Vectored file I/O shared by the file-backed tiers (shm, local ``file://``)."""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["read_parts"]

# iovecs per call (Linux's IOV_MAX is 1024) and bytes per call (Linux moves at most
# ~2 GiB per read): stay below both.
_IOV_MAX = 1024
_IO_STEP = 1 << 30


def read_parts(fd: int, parts: Sequence[memoryview], size: int, start: int = 0) -> int:
    """Fill ``parts`` in order from byte ``start`` of the file ``fd``, up to ``size``
    bytes; return the bytes read (less than asked only if the file ended or shrank)."""
    views: list[memoryview] = []
    left = size
    for part in parts:
        if left <= 0:
            break
        n = min(len(part), left)
        # a view above _IO_STEP is split: one preadv must not move more than that
        views += [part[i : min(i + _IO_STEP, n)] for i in range(0, n, _IO_STEP)]
        left -= n
    pos = 0
    i = 0
    while i < len(views):
        got = os.preadv(fd, views[i : i + _IOV_MAX], start + pos)
        if got == 0:
            break
        pos += got
        while i < len(views) and got >= len(views[i]):
            got -= len(views[i])
            i += 1
        if got:
            views[i] = views[i][got:]
    return pos
