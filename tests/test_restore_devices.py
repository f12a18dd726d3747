"""The window accounting of a restore into GPU tensors (``tiercheck.restore.devices``): the
verified chunks of a stream arrive in any order, from several threads, and each window of
the part bound for the device is reported complete exactly once, when its last byte is
verified (then it is copied to the device while the next chunks are read). The copies
themselves need CUDA: ``tests/test_gpu.py``."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tiercheck.restore.devices import Windows


def tiling(total: int, rng: random.Random) -> list[tuple[int, int]]:
    """Chunks ``(offset, length)`` covering ``[0, total)`` one after another."""
    out, at = [], 0
    while at < total:
        n = min(total - at, rng.randint(1, 40))
        out.append((at, n))
        at += n
    return out


@pytest.mark.parametrize("seed", range(20))
def test_each_window_is_complete_once_when_its_last_byte_is_verified(seed: int) -> None:
    rng = random.Random(seed)
    total = rng.randint(1, 500)
    lo = rng.randint(0, total - 1)
    hi = rng.randint(lo + 1, total)
    size = rng.randint(1, 64)
    chunks = tiling(total, rng)
    rng.shuffle(chunks)
    windows = Windows(lo, hi, size)
    seen = bytearray(total)
    done: list[tuple[int, int]] = []
    for offset, length in chunks:
        seen[offset : offset + length] = b"\1" * length
        for start, end in windows.add(offset, length):
            assert all(seen[start:end]), "a window reported before all its bytes"
            done.append((start, end))
    assert sorted(done) == [(s, min(s + size, hi)) for s in range(lo, hi, size)]
    assert windows.pending == 0


def test_windows_counted_from_several_threads_are_each_reported_once() -> None:
    total, size = 1 << 16, 1000
    windows = Windows(100, total - 7, size)
    chunks = tiling(total, random.Random(1))
    with ThreadPoolExecutor(8) as pool:
        reported = [w for ws in pool.map(lambda c: windows.add(*c), chunks) for w in ws]
    assert len(reported) == len(set(reported)) == (total - 107 + size - 1) // size
    assert windows.pending == 0


def test_bytes_outside_the_device_part_complete_nothing() -> None:
    windows = Windows(100, 200, 64)
    assert windows.add(0, 100) == [] and windows.add(200, 50) == []
    assert windows.pending == 2
    assert windows.add(90, 80) == [(100, 164)]
    assert windows.add(170, 40) == [(164, 200)]
