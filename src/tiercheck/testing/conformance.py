"""The tier conformance suite: one subclass per backend proves the contract of
:class:`tiercheck.backends.base.Tier`.

Usage (in a test module of any package, third-party tiers included)::

    from tiercheck.testing.conformance import TierConformance

    class TestMyTier(TierConformance):
        def make_tier(self, tmp_path):
            return open_tier(f"mytier://{tmp_path}/store")

pytest collects every ``test_*`` method of the subclass. Hooks a subclass may override:

- ``make_tier(tmp_path)`` (required): a fresh, empty, writable tier.
- ``reopen(tier)``: close ``tier`` and open the same store again (default: ``open_tier``
  on ``tier.url``). Set ``reopenable = False`` for tiers whose content does not outlive
  the instance.
- ``open_read_only(tier)``: a second, read-only instance over the same store while
  ``tier`` stays open (default: ``open_tier(tier.url, read_only=True)``). Set
  ``supports_read_only = False`` to skip.
- ``large_blob_size``: size of the "big blob" round trip (default 4 MiB + 3 bytes).

Every tier the suite opens through these hooks is closed at the end of the test.
This module imports pytest; nothing else in tiercheck imports it, so pytest is not a
runtime dependency of tiercheck.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar

import blake3
import pytest

from tiercheck.backends.base import Buffer, Capabilities, FailureDomain, StoreOwner, Tier
from tiercheck.backends.registry import open_tier
from tiercheck.errors import NotFound, NotSupported, ReadOnlyTier, TierError

__all__ = ["TierConformance", "blob", "blob_id"]


def blob_id(data: bytes) -> str:
    """The content id of ``data`` (BLAKE3-256, lowercase hex), as the engine names chunks."""
    return blake3.blake3(data).hexdigest()


def blob(size: int, seed: int = 0) -> tuple[str, bytes]:
    """A deterministic pseudo-random blob of ``size`` bytes and its id."""
    data = _pattern(size, seed)
    return blob_id(data), data


def _pattern(size: int, seed: int) -> bytes:
    # BLAKE3 in XOF mode: fast, deterministic, and different for every seed.
    return blake3.blake3(seed.to_bytes(8, "little")).digest(length=size) if size else b""


def _sizes(tier: Tier, sizes: list[int]) -> list[int]:
    """``sizes`` without 0 for a tier that stores no empty objects."""
    return [n for n in sizes if n or tier.capabilities.empty_objects]


def _fake_id(n: int) -> str:
    return f"{n:064x}"


class TierConformance:
    """Base class of the conformance tests. Subclass it and implement :meth:`make_tier`."""

    reopenable: ClassVar[bool] = True
    supports_read_only: ClassVar[bool] = True
    large_blob_size: ClassVar[int] = 4 * 1024 * 1024 + 3
    concurrency_threads: ClassVar[int] = 4
    concurrency_rounds: ClassVar[int] = 25

    # --- hooks ---------------------------------------------------------------------

    def make_tier(self, tmp_path: Path) -> Tier:
        """Return a fresh, empty, writable tier whose storage lives under ``tmp_path``."""
        raise NotImplementedError(f"{type(self).__name__} must implement make_tier(tmp_path)")

    def reopen(self, tier: Tier) -> Tier:
        """Close ``tier`` and return a new instance over the same store."""
        tier.close()
        return open_tier(tier.url)

    def open_read_only(self, tier: Tier) -> Tier:
        """Return a read-only instance over ``tier``'s store; ``tier`` stays open."""
        return open_tier(tier.url, read_only=True)

    # --- fixture -------------------------------------------------------------------

    @pytest.fixture
    def tier(self, tmp_path: Path) -> Iterator[Tier]:
        self._open_tiers: list[Tier] = []
        t = self._track(self.make_tier(tmp_path))
        yield t
        # Close the newest first: a read-only view may share resources with its writer.
        for opened in reversed(self._open_tiers):
            opened.close()

    def _track(self, tier: Tier) -> Tier:
        self._open_tiers.append(tier)
        return tier

    def _reopen(self, tier: Tier) -> Tier:
        new = self.reopen(tier)
        self._open_tiers.remove(tier)  # reopen closed it
        return self._track(new)

    # --- capabilities --------------------------------------------------------------

    def test_capabilities(self, tier: Tier) -> None:
        caps = tier.capabilities
        assert isinstance(caps, Capabilities)
        assert isinstance(caps.survives, FailureDomain)
        assert isinstance(caps.speed_rank, int)
        assert isinstance(tier.url, str) and "://" in tier.url
        assert tier.read_only is False

    # --- blobs ---------------------------------------------------------------------

    @pytest.mark.parametrize("size", [0, 1, 7, 4095, 4097, 65537, 1 << 20])
    def test_put_get_round_trip(self, tier: Tier, size: int) -> None:
        bid, data = blob(size, seed=size)
        if not size and not tier.capabilities.empty_objects:
            with pytest.raises(NotSupported):
                tier.put(bid, data)
            return
        assert tier.put(bid, data) is True
        got = tier.get(bid)
        assert isinstance(got, memoryview)
        assert bytes(got) == data
        assert tier.size(bid) == size

    def test_put_get_large(self, tier: Tier) -> None:
        bid, data = blob(self.large_blob_size, seed=99)
        assert tier.put(bid, data) is True
        assert bytes(tier.get(bid)) == data
        assert tier.size(bid) == len(data)

    def test_put_accepts_any_buffer(self, tier: Tier) -> None:
        bid, data = blob(1000, seed=1)
        backing = bytearray(b"\xee" * 10) + bytearray(data)
        assert tier.put(bid, memoryview(backing)[10:]) is True
        bid2, data2 = blob(333, seed=2)
        assert tier.put(bid2, bytearray(data2)) is True
        assert bytes(tier.get(bid)) == data
        assert bytes(tier.get(bid2)) == data2

    def test_get_into_exact_buffer(self, tier: Tier) -> None:
        bid, data = blob(10_000, seed=3)
        tier.put(bid, data)
        buf = bytearray(len(data))
        view = tier.get(bid, out=memoryview(buf))
        assert len(view) == len(data)
        assert bytes(view) == data
        assert bytes(buf) == data

    def test_get_into_bigger_buffer(self, tier: Tier) -> None:
        bid, data = blob(10_000, seed=4)
        tier.put(bid, data)
        buf = bytearray(b"\xab" * (len(data) + 100))
        view = tier.get(bid, out=memoryview(buf))
        assert len(view) == len(data)
        assert bytes(view) == data
        assert bytes(buf[: len(data)]) == data
        assert bytes(buf[len(data) :]) == b"\xab" * 100  # nothing written past the blob

    def test_get_into_empty_blob(self, tier: Tier) -> None:
        if not tier.capabilities.empty_objects:
            pytest.skip(f"{type(tier).__name__} stores no empty blobs (empty_objects)")
        bid, data = blob(0)
        tier.put(bid, data)
        buf = bytearray(16)
        assert bytes(tier.get(bid, out=memoryview(buf))) == b""

    def test_get_into_too_small_buffer(self, tier: Tier) -> None:
        bid, data = blob(10_000, seed=5)
        tier.put(bid, data)
        with pytest.raises(ValueError):
            tier.get(bid, out=memoryview(bytearray(len(data) - 1)))

    def test_put_existing_is_noop(self, tier: Tier) -> None:
        bid = _fake_id(1)
        assert tier.put(bid, b"first") is True
        assert tier.put(bid, b"second, longer") is False
        assert bytes(tier.get(bid)) == b"first"

    def test_put_overwrite_replaces(self, tier: Tier) -> None:
        bid = _fake_id(2)
        tier.put(bid, b"corrupt copy")
        assert tier.put(bid, b"good", overwrite=True) is True
        assert bytes(tier.get(bid)) == b"good"
        assert tier.size(bid) == 4
        assert list(tier.list()) == [bid]

    def test_put_overwrite_absent(self, tier: Tier) -> None:
        bid = _fake_id(3)
        assert tier.put(bid, b"x", overwrite=True) is True
        assert bytes(tier.get(bid)) == b"x"

    def test_put_many(self, tier: Tier) -> None:
        items = [blob(100 + i, seed=i) for i in range(10)]
        assert tier.put_many(items) == 10
        assert tier.put_many([*items[:5], blob(7, seed=1000)]) == 1
        assert tier.has(bid for bid, _ in items) == {bid for bid, _ in items}

    def test_put_many_parts(self, tier: Tier) -> None:
        items = [blob(3000 + i, seed=20 + i) for i in range(6)]
        backing = [bytearray(data) for _, data in items]
        parts = [
            (bid, [memoryview(b)[:64], memoryview(b)[64:1000], memoryview(b)[1000:]])
            for (bid, _), b in zip(items, backing)
        ]
        assert tier.put_many_parts(parts) == 6
        for b in backing:
            b[0] ^= 0xFF  # the tier kept no view of a caller's buffer
        for bid, data in items:
            assert bytes(tier.get(bid)) == data
        assert tier.put_many_parts([(items[0][0], [b"other"]), *parts[1:2]]) == 0

    def test_put_parts(self, tier: Tier) -> None:
        bid, data = blob(70_000, seed=5)
        backing = bytearray(data)
        parts: list[Buffer] = [data[:64], memoryview(backing)[64:5000], bytearray(data[5000:])]
        assert tier.put_parts(bid, parts) is True
        assert bytes(tier.get(bid)) == data and tier.size(bid) == len(data)
        backing[100] ^= 0xFF  # the tier kept no view of a caller's buffer
        assert bytes(tier.get(bid)) == data
        assert tier.put_parts(bid, [b"other"]) is False
        assert tier.put_parts(bid, [b"ot", b"her"], overwrite=True) is True
        assert bytes(tier.get(bid)) == b"other"
        empty = _fake_id(9)
        if tier.capabilities.empty_objects:
            assert tier.put_parts(empty, []) is True and bytes(tier.get(empty)) == b""
        else:
            with pytest.raises(NotSupported):
                tier.put_parts(empty, [])

    def test_begin_put(self, tier: Tier) -> None:
        (bid, data), (other, other_data) = blob(70_000, seed=7), blob(3000, seed=8)
        backing = bytearray(data)
        pending = tier.begin_put(bid, [backing[:64], memoryview(backing)[64:]])
        backing[:] = bytes(len(backing))  # reusable once begun: the tier copied it out
        assert pending.finish() is True
        assert bytes(tier.get(bid)) == data and bid in tier.has([bid])
        assert tier.begin_put(bid, [b"other"]).finish() is False  # present: no write
        assert bytes(tier.get(bid)) == data
        dropped = tier.begin_put(other, [other_data])
        dropped.abort()  # never finished: absent, or (a tier that puts at once) whole
        assert other not in tier.has([other]) or bytes(tier.get(other)) == other_data
        assert set(tier.list()) <= {bid, other}  # no temporary object is ever listed

    def test_get_parts(self, tier: Tier) -> None:
        bid, data = blob(70_000, seed=6)
        tier.put(bid, data)
        head, body = bytearray(64), bytearray(len(data) - 64)
        assert tier.get_parts(bid, [memoryview(head), memoryview(body)]) == len(data)
        assert bytes(head) + bytes(body) == data
        # parts larger than the blob: filled as far as it goes, the rest untouched
        head, body = bytearray(64), bytearray(b"\xaa" * len(data))
        assert tier.get_parts(bid, [memoryview(head), memoryview(body)]) == len(data)
        assert bytes(head) + bytes(body[: len(data) - 64]) == data
        assert body[len(data) - 64 :] == b"\xaa" * 64
        # parts smaller than the blob: the prefix that fits; the size says the rest
        small = bytearray(1000)
        assert tier.get_parts(bid, [memoryview(small)]) == len(data)
        assert bytes(small) == data[:1000]
        with pytest.raises(NotFound):
            tier.get_parts(_fake_id(77), [memoryview(bytearray(10))])

    def test_has_many(self, tier: Tier) -> None:
        present = [_fake_id(i) for i in range(0, 200, 2)]
        absent = [_fake_id(i) for i in range(1, 200, 2)]
        for bid in present:
            tier.put(bid, bid.encode())
        assert tier.has(present + absent) == set(present)
        assert tier.has(iter(absent)) == set()
        assert tier.has([]) == set()

    def test_delete_many(self, tier: Tier) -> None:
        ids = [_fake_id(i) for i in range(20)]
        for bid in ids:
            tier.put(bid, b"data " + bid.encode())
        absent = [_fake_id(i) for i in range(100, 105)]
        assert tier.delete(ids[:10] + absent) == 10
        assert tier.has(ids) == set(ids[10:])
        assert sorted(tier.list()) == sorted(ids[10:])
        for bid in ids[:10]:
            with pytest.raises(NotFound):
                tier.get(bid)
        assert tier.delete(ids[:10]) == 0
        assert tier.delete([]) == 0

    def test_delete_then_put_again(self, tier: Tier) -> None:
        bid, data = blob(5000, seed=6)
        tier.put(bid, data)
        assert tier.delete([bid]) == 1
        assert tier.put(bid, data) is True
        assert bytes(tier.get(bid)) == data

    def test_written_at(self, tier: Tier) -> None:
        # GC's grace runs from these times: a tier that declares blob_times reports one for
        # each blob it holds, taken from a clock that agrees with this host's (a slack for
        # file-system timestamp granularity), and none for a blob it does not hold.
        before = time.time()
        ids = [_fake_id(i) for i in range(3)]
        for bid in ids:
            tier.put(bid, b"aged " + bid.encode())
        after = time.time()
        absent = _fake_id(99)
        got = tier.written_at([*ids, absent])
        assert absent not in got
        if not tier.capabilities.blob_times:
            assert set(got) <= set(ids)
            return
        assert set(got) == set(ids)
        for t in got.values():
            assert before - 2.0 <= t <= after + 2.0, (before, t, after)
        tier.delete(ids[:1])
        assert set(tier.written_at(ids)) == set(ids[1:])
        assert tier.written_at([]) == {}

    def test_list(self, tier: Tier) -> None:
        assert list(tier.list()) == []
        ids = {_fake_id(i) for i in range(50)}
        for bid in ids:
            tier.put(bid, b"x")
        listed = list(tier.list())
        assert len(listed) == len(ids)
        assert set(listed) == ids

    def test_size(self, tier: Tier) -> None:
        for i, n in enumerate(_sizes(tier, [0, 1, 12345])):
            bid = _fake_id(i)
            tier.put(bid, b"z" * n)
            assert tier.size(bid) == n
        with pytest.raises(NotFound):
            tier.size(_fake_id(999))

    def test_head(self, tier: Tier) -> None:
        # head(id, n): the first n bytes (all of a shorter blob), as bytes; GC reads blob
        # headers with it. Overridden or not, it must agree with get.
        sizes = _sizes(tier, [0, 1, 63, 64, 65, 10_000])
        for size in sizes:
            bid, data = blob(size, seed=200 + size)
            tier.put(bid, data)
        for size in sizes:
            bid, data = blob(size, seed=200 + size)
            got = tier.head(bid)
            assert isinstance(got, bytes)
            assert got == data[:64]
            for n in (0, 1, 64, 100, 4096, size, size + 1):
                assert tier.head(bid, n) == data[:n]
        bid, data = blob(5000, seed=201)
        tier.put(bid, data, overwrite=True)
        assert tier.head(bid, 16) == data[:16]
        tier.delete([bid])
        with pytest.raises(NotFound):
            tier.head(bid)
        with pytest.raises(NotFound):
            tier.head(_fake_id(43), 64)
        with pytest.raises(TierError):
            tier.head("../" + "0" * 61)

    def test_missing_is_not_found(self, tier: Tier) -> None:
        bid = _fake_id(42)
        with pytest.raises(NotFound) as info:
            tier.get(bid)
        assert isinstance(info.value, KeyError)
        assert bid in str(info.value)
        with pytest.raises(KeyError):
            tier.get(bid, out=memoryview(bytearray(10)))

    @pytest.mark.parametrize(
        "bad",
        ["", "abc", "A" * 64, "g" * 64, "0" * 63, "0" * 65, "../" + "0" * 61, "0" * 63 + "\n"],
    )
    def test_invalid_blob_id_rejected(self, tier: Tier, bad: str) -> None:
        with pytest.raises(TierError):
            tier.put(bad, b"data")
        with pytest.raises(TierError):
            tier.get(bad)
        with pytest.raises(TierError):
            tier.has([bad])
        with pytest.raises(TierError):
            tier.delete([bad])
        assert list(tier.list()) == []

    def test_empty_objects_as_declared(self, tier: Tier) -> None:
        """``capabilities.empty_objects``: empty blobs and records are stored, or refused
        with ``NotSupported`` and nothing is stored."""
        bid = _fake_id(31)
        if tier.capabilities.empty_objects:
            assert tier.put(bid, b"") is True and tier.size(bid) == 0
            tier.append(b"")
            assert tier.read_log() == [b""]
            return
        with pytest.raises(NotSupported):
            tier.put(bid, b"")
        with pytest.raises(NotSupported):
            tier.put_many([(bid, b"")])
        with pytest.raises(NotSupported):
            tier.append(b"")
        assert tier.has([bid]) == set() and tier.read_log() == []

    # --- log -----------------------------------------------------------------------

    def test_read_log_fresh_is_empty(self, tier: Tier) -> None:
        assert tier.read_log() == []

    def test_log_append_order(self, tier: Tier) -> None:
        records = [f"record {i}".encode() for i in range(100)]
        for rec in records:
            tier.append(rec)
        assert tier.read_log() == records

    def test_scan_log_is_read_log(self, tier: Tier) -> None:
        records = [f"scanned {i}".encode() for i in range(20)]
        for rec in records:
            tier.append(rec)
        scan = tier.scan_log()
        assert list(scan.records) == records == tier.read_log()
        assert scan.damaged == ()  # an intact log has no damaged records

    def test_log_varied_sizes(self, tier: Tier) -> None:
        records = [b"", b"x", _pattern(1 << 20, 7), b"", _pattern(4097, 8), b"\x00" * 14]
        records = [r for r in records if r or tier.capabilities.empty_objects]
        for rec in records:
            tier.append(rec)
        assert tier.read_log() == records

    def test_log_records_look_like_frames(self, tier: Tier) -> None:
        # Payloads that mimic frame headers or a torn tail must come back verbatim.
        from tiercheck.formats.framing import frame_record

        tricky = [frame_record(b"inner"), frame_record(b"inner")[:-1], b"TR", b"TR" + b"\xff" * 12]
        for rec in tricky:
            tier.append(rec)
        assert tier.read_log() == tricky

    def test_append_with_blobs(self, tier: Tier) -> None:
        items = [blob(1000 + i, seed=50 + i) for i in range(5)]
        tier.append(b"version 1", blobs=items)
        assert tier.read_log() == [b"version 1"]
        assert tier.has(bid for bid, _ in items) == {bid for bid, _ in items}
        for bid, data in items:
            assert bytes(tier.get(bid)) == data
        # Blobs already present are fine in a later append.
        tier.append(b"version 2", blobs=items[:2])
        assert tier.read_log() == [b"version 1", b"version 2"]

    # --- log compaction ------------------------------------------------------------

    def _compacts(self, tier: Tier) -> bool:
        """Whether the tier compacts logs (``replace_log_prefix`` is not ``NotSupported``)."""
        try:
            tier.replace_log_prefix(1, b"probe")
        except NotSupported:
            return False
        except ValueError:
            return True  # the empty log has no record 1: it checked, so it compacts
        raise AssertionError("replace_log_prefix(1, ...) of an empty log must raise ValueError")

    def test_replace_log_prefix(self, tier: Tier) -> None:
        if not self._compacts(tier):
            pytest.skip(f"{type(tier).__name__} does not compact logs (NotSupported)")
        records = [f"record {i}".encode() for i in range(10)]
        for rec in records:
            tier.append(rec)
        tier.replace_log_prefix(6, b"checkpoint of 0-5")
        assert tier.read_log() == [b"checkpoint of 0-5", *records[6:]]
        tier.append(b"after")
        assert tier.read_log() == [b"checkpoint of 0-5", *records[6:], b"after"]
        # A checkpoint can replace an earlier checkpoint and what follows it.
        tier.replace_log_prefix(3, b"second checkpoint")
        assert tier.read_log() == [b"second checkpoint", *records[8:], b"after"]
        tier.replace_log_prefix(4, b"all of it")
        assert tier.read_log() == [b"all of it"]
        for bad in (0, 2):
            with pytest.raises(ValueError):
                tier.replace_log_prefix(bad, b"x")
        assert tier.read_log() == [b"all of it"]
        if self.reopenable:
            again = self._reopen(tier)
            assert again.read_log() == [b"all of it"]
            again.append(b"appended after reopen")
            assert again.read_log() == [b"all of it", b"appended after reopen"]

    def test_replace_log_prefix_read_only(self, tier: Tier) -> None:
        if not self.supports_read_only or not self._compacts(tier):
            pytest.skip(f"{type(tier).__name__}: no read-only mode or no compaction")
        tier.append(b"rec")
        ro = self._track(self.open_read_only(tier))
        with pytest.raises(ReadOnlyTier):
            ro.replace_log_prefix(1, b"nope")
        assert tier.read_log() == [b"rec"]

    def test_usage(self, tier: Tier) -> None:
        before = tier.usage()
        if before is None:
            pytest.skip(f"{type(tier).__name__} does not count usage")
        items = [blob(100_000 + i, seed=300 + i) for i in range(3)]
        for bid, data in items:
            tier.put(bid, data)
        grown = tier.usage()
        assert grown is not None and grown >= before + sum(len(d) for _, d in items) // 2
        tier.delete([bid for bid, _ in items])
        after = tier.usage()
        assert after is not None and after < grown

    def test_preallocate_changes_nothing_a_reader_sees(self, tier: Tier) -> None:
        """``preallocate`` (``Checkpointer.prepare``) only readies room: it returns the
        bytes made ready (0 is fine), adds no blob, no log record and no usage, and the
        puts after it store what they are given."""
        before = tier.usage()
        ready = tier.preallocate([100_000, 100_000, 4096])
        assert isinstance(ready, int) and ready >= 0
        assert list(tier.list()) == [] and tier.read_log() == []
        assert tier.usage() == before
        items = [blob(100_000, seed=320), blob(4096, seed=321)]
        for bid, data in items:
            tier.put(bid, data)
        assert [bytes(tier.get(bid)) for bid, _ in items] == [data for _, data in items]

    def test_pinned_blobs_do_not_change_until_released(self, tier: Tier) -> None:
        """``pin()`` (a restore's reads in place): None, or pins whose views are the stored
        bytes, read-only (``get``, and ``parts`` in two), ``NotFound`` for a missing blob,
        and unchanged until ``close()`` while their blobs are deleted and blobs of the same
        sizes are put (the writes that reuse a deleted blob's memory, where a tier reuses
        it); the puts still store what they are given, and the tier pins again once
        released."""
        items = [blob(n, seed=330 + n) for n in (70_000, 4096)]
        for bid, data in items:
            tier.put(bid, data)
        pins = tier.pin()
        if pins is None:
            return  # this tier reads with get_parts only
        try:
            views = [pins.get(bid) for bid, _ in items]
            assert [bytes(v) for v in views] == [data for _, data in items]
            assert all(v.readonly for v in views)
            for bid, data in items:  # the same bytes in two parts, the first at least 64
                front, rest, size = pins.parts(bid, 64)
                assert len(front) >= 64 and bytes(front) + bytes(rest) == data
                assert size == len(data) and rest.readonly
                del front, rest
            with pytest.raises(NotFound):
                pins.get(_fake_id(331))
            with pytest.raises(NotFound):
                pins.parts(_fake_id(332), 64)
            tier.delete([bid for bid, _ in items])
            others = [blob(len(data), seed=340 + i) for i, (_, data) in enumerate(items)]
            for bid, data in others:
                tier.put(bid, data)
            assert [bytes(v) for v in views] == [data for _, data in items]
            assert [bytes(tier.get(bid)) for bid, _ in others] == [d for _, d in others]
            del views
        finally:
            pins.close()
        pins.close()  # idempotent
        again = tier.pin()
        assert again is not None
        again.close()

    def test_pins_closed_with_later_leave_only_cleanup_to_it(self, tier: Tier) -> None:
        """``close(later)``: the tier pins again at once (nothing of the pins still holds
        it), and the work handed to ``later``, run afterwards, raises nothing."""
        bid, data = blob(70_000, seed=350)
        tier.put(bid, data)
        pins = tier.pin()
        if pins is None:
            return  # this tier reads with get_parts only
        assert bytes(pins.get(bid)) == data
        jobs: list[Callable[[], object]] = []
        pins.close(jobs.append)
        again = tier.pin()
        assert again is not None
        again.close()
        for job in jobs:
            job()
        pins.close(jobs.append)  # idempotent
        assert bytes(tier.get(bid)) == data

    # --- lifecycle -----------------------------------------------------------------

    def test_reopen(self, tier: Tier) -> None:
        if not self.reopenable:
            pytest.skip(f"{type(tier).__name__} content does not outlive the instance")
        items = [blob(n, seed=n) for n in _sizes(tier, [0, 1, 70_000])]
        for bid, data in items:
            tier.put(bid, data)
        records = [b"a", b"", _pattern(300_000, 1)]
        records = [r for r in records if r or tier.capabilities.empty_objects]
        for rec in records:
            tier.append(rec)
        deleted = _fake_id(77)
        tier.put(deleted, b"gone")
        tier.delete([deleted])

        again = self._reopen(tier)
        assert again.read_log() == records
        assert set(again.list()) == {bid for bid, _ in items}
        for bid, data in items:
            assert bytes(again.get(bid)) == data
        # The reopened tier keeps appending after the old records.
        again.append(b"after reopen")
        assert again.read_log() == [*records, b"after reopen"]

    def test_read_only_refuses_writes(self, tier: Tier) -> None:
        if not self.supports_read_only:
            pytest.skip(f"{type(tier).__name__} has no read-only mode")
        bid, data = blob(2000, seed=11)
        tier.put(bid, data)
        tier.append(b"rec")
        ro = self._track(self.open_read_only(tier))
        assert ro.read_only is True
        assert bytes(ro.get(bid)) == data
        assert ro.has([bid]) == {bid}
        assert list(ro.list()) == [bid]
        assert ro.read_log() == [b"rec"]
        other, other_data = blob(10, seed=12)
        with pytest.raises(ReadOnlyTier):
            ro.put(other, other_data)
        with pytest.raises(ReadOnlyTier):
            ro.put(bid, data, overwrite=True)
        with pytest.raises(ReadOnlyTier):
            ro.append(b"nope")
        with pytest.raises(ReadOnlyTier):
            ro.append(b"nope", blobs=[(other, other_data)])
        with pytest.raises(ReadOnlyTier):
            ro.delete([bid])
        assert tier.read_log() == [b"rec"]
        assert tier.has([bid, other]) == {bid}

    # --- owner record ---------------------------------------------------------------

    def test_claim_owner(self, tier: Tier) -> None:
        """A claim is a compare-and-swap: the first store to claim a tier owns it, a later
        claim finds that record and writes nothing, a claim replacing the record it read
        wins only if nothing changed it since. A tier that keeps no record grants every
        claim and records none."""
        a = StoreOwner("a" * 32, "/stores/a", "node-a")
        b = StoreOwner("b" * 32, "/stores/b", "node-b")
        assert tier.claim_owner(a) == a
        if tier.read_owner() is None:
            assert tier.claim_owner(b) == b
            assert tier.read_owner() is None
            return
        assert tier.read_owner() == a
        assert tier.claim_owner(b) == a  # lost: a holds
        assert tier.read_owner() == a
        assert tier.claim_owner(a) == a  # claiming again what one holds
        assert tier.claim_owner(b, replacing=b) == a  # a stale expectation loses
        moved = StoreOwner(a.store_id, "/stores/a-moved", "node-a")
        assert tier.claim_owner(moved, replacing=a) == moved
        assert tier.read_owner() == moved
        if self.reopenable:
            again = self._reopen(tier)
            assert again.read_owner() == moved
            assert again.claim_owner(b) == moved
        if self.supports_read_only:
            ro = self._track(self.open_read_only(tier if not self.reopenable else again))
            with pytest.raises(ReadOnlyTier):
                ro.claim_owner(b)

    def test_concurrent_claims_have_one_winner(self, tier: Tier) -> None:
        """Threads claiming one new tier at the same moment, each for a store of its own:
        every one is told the same winner, and the record is the winner's."""
        threads = self.concurrency_threads
        start = threading.Barrier(threads)
        owners = [StoreOwner(f"{t:032x}", f"/stores/{t}", "node") for t in range(threads)]
        won: list[StoreOwner | None] = [None] * threads
        errors: list[BaseException] = []

        def work(t: int) -> None:
            try:
                start.wait()
                won[t] = tier.claim_owner(owners[t])
            except BaseException as exc:  # re-raised in the main thread below
                errors.append(exc)

        workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if errors:
            raise errors[0]
        if tier.read_owner() is None:  # a tier that keeps no record grants every claim
            assert won == owners
            return
        assert len(set(won)) == 1 and won[0] in owners
        assert tier.read_owner() == won[0]

    # --- concurrency ---------------------------------------------------------------

    def test_concurrent_put_get_append(self, tier: Tier) -> None:
        threads = self.concurrency_threads
        rounds = self.concurrency_rounds
        errors: list[BaseException] = []
        start = threading.Barrier(threads)
        shared = [blob(3000, seed=10_000 + i) for i in range(8)]

        def work(t: int) -> None:
            try:
                start.wait()
                for r in range(rounds):
                    bid, data = blob(1 + (t * 7919 + r * 104729) % 300_000, seed=t * 1000 + r)
                    tier.put(bid, data)
                    # Every thread also races on the same ids: content must stay whole.
                    sid, sdata = shared[(t + r) % len(shared)]
                    tier.put(sid, sdata)
                    assert bytes(tier.get(bid)) == data
                    assert bytes(tier.get(sid)) == sdata
                    record = f"{t}:{r}:{bid}:".encode() + _pattern(r * 997, t)
                    tier.append(record, blobs=[(bid, data)])
            except BaseException as exc:  # re-raised in the main thread below
                errors.append(exc)

        workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if errors:
            raise errors[0]

        log = tier.read_log()
        assert len(log) == threads * rounds
        seen: dict[int, int] = {}
        for rec in log:
            t_s, r_s, bid, pad = rec.split(b":", 3)
            t, r = int(t_s), int(r_s)
            assert pad == _pattern(r * 997, t), "torn or mixed record"
            # Each thread's records appear in the order that thread appended them.
            assert seen.get(t, -1) == r - 1
            seen[t] = r
            assert tier.has([bid.decode()]) == {bid.decode()}
        assert seen == dict.fromkeys(range(threads), rounds - 1)
