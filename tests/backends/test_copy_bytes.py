"""``copy_bytes``, ``scatter``, ``gather`` and ``joined``: the copies tiers make of blob
bytes (a join for LMDB or a pack, a blob read into the caller's parts), handed to numpy
above 64 KiB so that they run without the GIL (a memoryview's slice assignment holds it
for the whole copy: with a background thread scattering 16 MiB blobs, a Python loop in
the foreground ran 3.1 M iterations a second against 4.8 M with numpy's copy; 8 M
alone)."""

from __future__ import annotations

import array

import pytest

from tiercheck.backends import base
from tiercheck.backends.base import copy_bytes, fresh_buffer, gather, joined, scatter


@pytest.mark.parametrize("n", [0, 1, 4096, 64 * 1024 - 1, 64 * 1024, 3 << 20])
def test_copy_bytes_copies_every_byte_small_or_large(n: int) -> None:
    src = bytes((i * 7 + 3) % 256 for i in range(n))
    dst = bytearray(n)
    copy_bytes(memoryview(dst), src)
    assert dst == src


def test_copy_bytes_reads_any_contiguous_buffer() -> None:
    """A tensor's bytes arrive as a memoryview of its format (float32 here): copied as
    bytes, whatever the format."""
    floats = array.array("f", (float(i) for i in range(1 << 16)))  # 256 KiB
    dst = bytearray(len(floats) * 4)
    copy_bytes(memoryview(dst), memoryview(floats).cast("B"))
    assert dst == floats.tobytes()
    copy_bytes(memoryview(dst), floats)
    assert dst == floats.tobytes()


def test_copy_bytes_refuses_a_length_mismatch_as_slice_assignment_does() -> None:
    for n in (100, base._GIL_FREE_COPY + 100):
        with pytest.raises(ValueError):
            copy_bytes(memoryview(bytearray(n)), bytes(n - 1))


def test_scatter_fills_parts_in_order_and_stops_at_the_end_of_the_data() -> None:
    data = bytes(range(256)) * 1024  # 256 KiB
    parts = [
        memoryview(bytearray(100)),
        memoryview(bytearray(200_000)),
        memoryview(bytearray(70_000)),
    ]
    assert scatter(data, parts) == len(data)
    joined = b"".join(bytes(p) for p in parts)
    assert joined[: len(data)] == data
    assert bytes(parts[2][len(data) - 200_100 :]) == bytes(70_000 - (len(data) - 200_100))


def test_gather_copies_parts_in_order_to_the_start_of_a_larger_buffer() -> None:
    """The inverse of ``scatter``: what LMDB's join buffer and ``joined`` are filled by."""
    parts = [b"h" * 64, bytes(range(256)) * 512, b"t" * 3]
    out = memoryview(bytearray(b"\xee" * (sum(map(len, parts)) + 10)))
    assert gather([memoryview(p) for p in parts], out) == sum(map(len, parts))
    assert bytes(out) == b"".join(parts) + b"\xee" * 10


@pytest.mark.parametrize("sizes", [(), (0,), (64, 100), (64, 4 << 20), (1, 70_000, 3, 200_000)])
def test_joined_is_the_parts_in_order_and_a_copy_of_them(sizes: tuple[int, ...]) -> None:
    """A blob's header and payload joined as ``b"".join`` would, small or large, and the
    result owns its bytes: the caller may reuse its buffers at once (a pack keeps it)."""
    parts = [bytearray((i * 13 + k) % 256 for i in range(n)) for k, n in enumerate(sizes)]
    floats = array.array("f", (float(i) for i in range(1000)))
    views: list[base.Buffer] = [memoryview(p) for p in parts] + [memoryview(floats)]
    expect = b"".join(bytes(p) for p in parts) + floats.tobytes()
    out = joined(views)
    assert bytes(out) == expect and len(out) == len(expect)
    for p in parts:
        p[:] = bytes(len(p))
    floats[0] = -1.0
    assert bytes(out) == expect


def test_joined_copies_a_large_blob_outside_the_gil_and_a_small_one_as_bytes() -> None:
    """Above 64 KiB the copy is numpy's (which releases the GIL; ``b"".join`` holds it,
    and a base migrated into packs held a trainer's thread for a quarter of a second)."""
    assert isinstance(joined([b"h" * 64, bytes(1000)]), bytes)
    big = joined([b"h" * 64, bytes(base._GIL_FREE_COPY)])
    assert isinstance(big, memoryview) and big.format == "B" and big.ndim == 1


@pytest.mark.parametrize("n", [0, 10, base._GIL_FREE_COPY - 1, base._GIL_FREE_COPY, 5 << 20])
def test_fresh_buffer_is_a_writable_flat_buffer_of_its_size(n: int) -> None:
    """The scratch and read buffers of background threads: ``n`` writable bytes, which a
    read fills (large ones are numpy's, not zeroed under the GIL as ``bytearray`` is)."""
    buf = fresh_buffer(n)
    assert len(buf) == n and buf.format == "B" and buf.ndim == 1 and not buf.readonly
    data = bytes((i * 31) % 256 for i in range(n))
    copy_bytes(buf, data)
    assert bytes(buf) == data
    assert isinstance(buf.obj, bytearray) == (n < base._GIL_FREE_COPY)
