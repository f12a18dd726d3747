"""Packs on the fsspec tier (SPEC section 16): the conformance suite on packed file://,
fsspec+memory:// and s3:// (moto on loopback) tiers, and what packs add: few objects, a
pack visible only whole, validated indexes, deletion and repacking."""

from __future__ import annotations

import json
import logging
import struct
import uuid
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tiercheck.backends._fsspec import DEFAULT_PACK_SIZE, FsspecTier
from tiercheck.backends.base import Tier
from tiercheck.backends.registry import open_tier
from tiercheck.errors import InvalidURL, NotFound
from tiercheck.formats.packs import PACK_HEADER, PACK_MAGIC, PackEntry, encode_pack_tail
from tiercheck.testing.conformance import TierConformance, blob

# --- conformance: small packs, so that a test's blobs span several -------------------

_SMALL = 64 * 1024


class _Packed(TierConformance):
    pack_size: ClassVar[int | str] = _SMALL
    options: ClassVar[dict[str, Any]] = {}

    def url(self, tmp_path: Path) -> str:
        raise NotImplementedError

    def make_tier(self, tmp_path: Path) -> Tier:
        return open_tier(self.url(tmp_path), pack_size=self.pack_size, **self.options)

    def reopen(self, tier: Tier) -> Tier:
        tier.close()
        return open_tier(tier.url, pack_size=self.pack_size, **self.options)

    def open_read_only(self, tier: Tier) -> Tier:
        return open_tier(tier.url, read_only=True, pack_size=self.pack_size, **self.options)


class TestPackedFileTier(_Packed):
    def url(self, tmp_path: Path) -> str:
        return f"file://{tmp_path}/tier"


class TestPackedFileTierLargePacks(_Packed):
    pack_size = "128MiB"  # everything a test writes waits in one pack until a flush

    def url(self, tmp_path: Path) -> str:
        return f"file://{tmp_path}/tier"


class TestPackedMemoryTier(_Packed):
    def url(self, tmp_path: Path) -> str:
        return f"fsspec+memory://tiercheck-{uuid.uuid4().hex}"


class TestPackedS3Tier(_Packed):
    concurrency_rounds = 10

    @pytest.fixture(autouse=True)
    def _bucket(self, s3_bucket: tuple[str, dict[str, Any]]) -> None:
        self._url, storage = s3_bucket
        self.options = {"storage_options": storage}

    def url(self, tmp_path: Path) -> str:
        return self._url


# --- what packs add ------------------------------------------------------------------


def _file_tier(tmp_path: Path, pack_size: int | str = _SMALL, **options: Any) -> FsspecTier:
    tier = open_tier(f"file://{tmp_path}/tier", pack_size=pack_size, **options)
    assert isinstance(tier, FsspecTier)
    return tier


def _objects(tmp_path: Path, under: str) -> list[Path]:
    return sorted(p for p in (tmp_path / "tier" / under).rglob("*") if p.is_file())


def _packs(tmp_path: Path) -> list[Path]:
    return [p for p in _objects(tmp_path, "packs") if p.suffix == ".pack"]


def test_blobs_of_a_version_are_a_few_packs(tmp_path: Path) -> None:
    tier = _file_tier(tmp_path, pack_size="1MiB")
    items = [blob(4096, seed=i) for i in range(300)]  # 1.2 MiB in all
    tier.append(b"version", blobs=items)
    assert _objects(tmp_path, "blobs") == []
    assert len(_packs(tmp_path)) == 2  # one full pack of 1 MiB, one of the rest
    again = _file_tier(tmp_path, pack_size="1MiB")
    assert sorted(again.list()) == sorted(bid for bid, _ in items)
    for bid, data in items:
        assert bytes(again.get(bid)) == data


def test_puts_wait_in_memory_until_a_flush(tmp_path: Path) -> None:
    tier = _file_tier(tmp_path, pack_size="1MiB")
    bid, data = blob(1000, seed=1)
    assert tier.put(bid, data) is True
    assert bytes(tier.get(bid)) == data  # readable through the writer at once
    assert _packs(tmp_path) == []
    other = _file_tier(tmp_path, pack_size="1MiB", read_only=True)
    assert other.has([bid]) == set()  # not stored yet: no other instance may rely on it
    tier.flush()
    assert other.has([bid]) == {bid} and bytes(other.get(bid)) == data
    assert len(_packs(tmp_path)) == 1


def test_a_blob_stored_in_a_pack_is_not_written_again(tmp_path: Path) -> None:
    tier = _file_tier(tmp_path)
    items = [blob(2000, seed=i) for i in range(5)]
    tier.append(b"one", blobs=items)
    packs = _packs(tmp_path)
    again = _file_tier(tmp_path)
    assert again.put_many(items) == 0
    again.append(b"two", blobs=items)
    assert _packs(tmp_path) == packs


def test_reads_are_ranged_into_the_callers_buffer(tmp_path: Path) -> None:
    tier = _file_tier(tmp_path)
    items = [blob(10_000 + i, seed=i) for i in range(4)]
    tier.append(b"v", blobs=items)
    tier = _file_tier(tmp_path)
    for bid, data in items:
        head, body = bytearray(64), bytearray(len(data) - 64)
        assert tier.get_parts(bid, [memoryview(head), memoryview(body)]) == len(data)
        assert bytes(head + body) == data
        assert tier.head(bid, 100) == data[:100] and tier.size(bid) == len(data)


def test_layout_marker(tmp_path: Path) -> None:
    loose = open_tier(f"file://{tmp_path}/tier")  # an existing unpacked tier: layout 1
    old, old_data = blob(3000, seed=7)
    loose.append(b"old", blobs=[(old, old_data)])
    loose.close()
    marker = tmp_path / "tier" / "tier.json"
    assert json.loads(marker.read_text())["layout"] == 1
    packed = _file_tier(tmp_path)
    assert json.loads(marker.read_text())["layout"] == 2  # an older reader now refuses it
    assert bytes(packed.get(old)) == old_data  # loose blobs stay readable
    new, new_data = blob(3000, seed=8)
    packed.append(b"new", blobs=[(new, new_data)])
    assert set(packed.list()) == {old, new}
    open_tier(f"file://{tmp_path}/fresh", pack_size="1MiB").close()
    assert json.loads((tmp_path / "fresh" / "tier.json").read_text())["layout"] == 2


def test_object_stores_pack_by_default(
    s3_bucket: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    url, storage = s3_bucket
    tier = open_tier(url, storage_options=storage)
    assert isinstance(tier, FsspecTier) and tier._packs is not None
    assert tier._packs._pack_size == DEFAULT_PACK_SIZE
    local = open_tier(f"file://{tmp_path}/t")
    assert isinstance(local, FsspecTier) and local._packs is None  # a local tier: opt in
    with pytest.raises(InvalidURL):
        open_tier(f"file://{tmp_path}/t", pack_size="lots")
    with pytest.raises(InvalidURL):
        open_tier(f"file://{tmp_path}/t", pack_size=-1)


# --- deleting: drop, repack, delete whole packs ---------------------------------------


def _one_pack(tmp_path: Path, sizes: list[int]) -> tuple[FsspecTier, list[tuple[str, bytes]]]:
    tier = _file_tier(tmp_path, pack_size="1MiB")
    items = [blob(n, seed=i) for i, n in enumerate(sizes)]
    tier.append(b"v", blobs=items)
    assert len(_packs(tmp_path)) == 1
    return tier, items


def test_a_pack_with_no_live_blob_is_deleted(tmp_path: Path) -> None:
    tier, items = _one_pack(tmp_path, [5000] * 4)
    assert tier.delete(bid for bid, _ in items) == 4
    assert _objects(tmp_path, "packs") == []
    assert list(tier.list()) == [] and list(_file_tier(tmp_path).list()) == []


def test_a_pack_mostly_garbage_is_repacked(tmp_path: Path) -> None:
    tier, items = _one_pack(tmp_path, [5000] * 4)
    old = _packs(tmp_path)
    old_size = old[0].stat().st_size
    assert tier.delete([items[0][0], items[1][0], items[2][0]]) == 3  # 25% live < 50%
    new = _packs(tmp_path)
    assert len(new) == 1 and new != old
    assert new[0].stat().st_size < old_size
    assert [p.suffix for p in _objects(tmp_path, "packs")] == [".pack"]  # no drop list
    again = _file_tier(tmp_path)
    assert list(again.list()) == [items[3][0]] and bytes(again.get(items[3][0])) == items[3][1]


def test_a_pack_mostly_live_keeps_its_bytes_and_drops_the_ids(tmp_path: Path) -> None:
    tier, items = _one_pack(tmp_path, [5000] * 4)
    old = _packs(tmp_path)
    gone = items[0][0]
    assert tier.delete([gone]) == 1  # 75% live: no rewrite
    assert _packs(tmp_path) == old
    assert [p.suffix for p in _objects(tmp_path, "packs")] == [".drop", ".pack"]
    for t in (tier, _file_tier(tmp_path)):  # the drop list is durable: a reopen agrees
        assert gone not in t.has([gone]) and gone not in set(t.list())
        with pytest.raises(NotFound):
            t.get(gone)
    data = dict(items)[gone]
    assert tier.put(gone, data) is True  # put again: a new pack holds it
    tier.flush()
    assert bytes(_file_tier(tmp_path).get(gone)) == data
    # the rest of the old pack going below the threshold repacks it, drop list and all
    assert tier.delete([items[1][0], items[2][0]]) == 2
    names = {p.name for p in _objects(tmp_path, "packs")}
    assert not any(n.startswith(old[0].stem) for n in names)
    assert set(_file_tier(tmp_path).list()) == {gone, items[3][0]}


def test_a_reader_finds_a_blob_again_after_another_process_repacked(tmp_path: Path) -> None:
    writer, items = _one_pack(tmp_path, [5000] * 4)
    reader = _file_tier(tmp_path)
    assert bytes(reader.get(items[3][0])) == items[3][1]  # the reader knows the old pack
    assert writer.delete([bid for bid, _ in items[:3]]) == 3  # repacked: old pack gone
    assert bytes(reader.get(items[3][0])) == items[3][1]


def test_repair_writes_a_loose_copy_read_before_the_packed_one(tmp_path: Path) -> None:
    tier, items = _one_pack(tmp_path, [5000] * 2)
    bid, data = items[0]
    assert tier.put(bid, data, overwrite=True) is True
    assert [p.name for p in _objects(tmp_path, "blobs")] == [bid]
    assert bytes(_file_tier(tmp_path).get(bid)) == data
    assert tier.delete([bid]) == 1  # every copy goes
    assert _objects(tmp_path, "blobs") == [] and bid not in _file_tier(tmp_path).has([bid])


# --- a pack's index is untrusted input -------------------------------------------------


def _pack_bytes(entries: list[PackEntry], body: bytes) -> bytes:
    return PACK_MAGIC + body + encode_pack_tail(entries)


def _hostile(tmp_path: Path, raw: bytes, caplog: pytest.LogCaptureFixture) -> FsspecTier:
    tier = _file_tier(tmp_path)
    (tmp_path / "tier" / "packs").mkdir(parents=True, exist_ok=True)
    (tmp_path / "tier" / "packs" / f"{'ab' * 16}.pack").write_bytes(raw)
    caplog.set_level(logging.WARNING)
    return tier


_ID = "cd" * 32
_GOOD = [PackEntry(_ID, PACK_HEADER, 10)]


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(_pack_bytes([PackEntry(_ID, PACK_HEADER, 11)], b"x" * 10), id="past-end"),
        pytest.param(_pack_bytes([PackEntry(_ID, 2, 10)], b"x" * 10), id="into-header"),
        pytest.param(_pack_bytes([PackEntry(_ID, PACK_HEADER, 1 << 62)], b"x"), id="huge"),
        pytest.param(
            _pack_bytes(
                [PackEntry(_ID, PACK_HEADER, 6), PackEntry("ef" * 32, PACK_HEADER + 4, 6)],
                b"x" * 10,
            ),
            id="overlap",
        ),
        pytest.param(_pack_bytes(_GOOD * 2, b"x" * 10), id="twice"),
        pytest.param(_pack_bytes(_GOOD, b"x" * 10)[:-40], id="truncated"),
        pytest.param(_pack_bytes(_GOOD, b"x" * 10)[:-33] + b"\0" + b"x" * 32, id="bad-check"),
        pytest.param(
            PACK_MAGIC + b"x" * 10 + struct.pack("<Q16s8s", 1 << 40, b"\0" * 16, b"TCPKEND1"),
            id="count-beyond-size",
        ),
        pytest.param(b"", id="empty"),
    ],
)
def test_a_damaged_or_crafted_index_makes_its_pack_unused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, raw: bytes
) -> None:
    tier = _hostile(tmp_path, raw, caplog)
    assert tier.has([_ID]) == set() and list(tier.list()) == []
    with pytest.raises(NotFound):
        tier.get(_ID)
    assert "is not used" in caplog.text
    # the tier still works beside the bad pack
    bid, data = blob(100, seed=3)
    tier.append(b"v", blobs=[(bid, data)])
    assert bytes(_file_tier(tmp_path).get(bid)) == data


def test_a_well_formed_hand_made_pack_is_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # the negative cases above differ from this one only in what they break
    tier = _hostile(tmp_path, _pack_bytes(_GOOD, b"0123456789"), caplog)
    assert tier.has([_ID]) == {_ID} and bytes(tier.get(_ID)) == b"0123456789"


def test_a_pack_streams_to_s3_in_parts_while_it_fills(
    s3_bucket: tuple[str, dict[str, Any]],
) -> None:
    import s3fs

    url, storage = s3_bucket
    tier = open_tier(url, storage_options=storage, pack_size="24MiB")
    items = [blob(3 << 20, seed=i) for i in range(7)]  # 21 MiB: parts leave as it fills
    for bid, data in items:
        tier.put(bid, data)
    gone = items[2][0]
    assert tier.delete([gone]) == 1  # before the pack is finished: its bytes stay, unnamed
    tier.flush()
    fs = s3fs.S3FileSystem(**storage)
    packs = [p for p in fs.find(url.removeprefix("s3://")) if p.endswith(".pack")]
    assert len(packs) == 1
    assert fs.info(packs[0])["ETag"].strip('"').endswith("-3")  # a multipart upload
    again = open_tier(url, storage_options=storage, pack_size="24MiB")
    assert set(again.list()) == {bid for bid, _ in items} - {gone}
    for bid, data in items:
        if bid != gone:
            assert bytes(again.get(bid)) == data
