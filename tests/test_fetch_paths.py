"""The fast paths of reading and writing blobs: a raw blob read straight into the caller's
buffer (and verified there), falling back to a whole-blob decode for other codecs and to
the next tier for damage; the default codec of file-system tiers; and a migration to a
real S3 endpoint (moto on loopback) with its compressed blobs uploaded in a window."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tiercheck import Checkpointer, Policy
from tiercheck.backends.base import Capabilities, FailureDomain
from tiercheck.backends.registry import open_tier
from tiercheck.errors import BlobCorrupt, NotFound
from tiercheck.formats.codecs import (
    BLOB_HEADER_SIZE,
    Codec,
    encode_blob,
    encode_blob_parts,
    raw_payload,
)
from tiercheck.formats.ids import chunk_id
from tiercheck.store.config import TierSpec
from tiercheck.store.fetch import ChunkFetcher
from tiercheck.store.policy import TierPolicy, default_tier_policy
from tiercheck.store.tierset import TierSlot

DATA = os.urandom(100_000) + bytes(50_000)  # compressible tail: zstd blobs are smaller
CID = chunk_id(DATA)


def split(blob: bytes, payload_room: int) -> tuple[bytearray, bytearray]:
    head = bytearray(blob[:BLOB_HEADER_SIZE])
    body = bytearray(payload_room)
    rest = blob[BLOB_HEADER_SIZE:]
    body[: min(len(rest), payload_room)] = rest[:payload_room]
    return head, body


def test_raw_payload_returns_the_verified_view_in_place() -> None:
    blob = encode_blob(DATA, Codec.RAW)
    head, body = split(blob, len(DATA) + 10)
    view = raw_payload(head, memoryview(body), len(blob), CID)
    assert view is not None and view.obj is body and bytes(view) == DATA


def test_raw_payload_leaves_other_codecs_and_partial_reads_to_the_caller() -> None:
    zblob = encode_blob(DATA, Codec.ZSTD)
    head, body = split(zblob, len(DATA))
    assert raw_payload(head, memoryview(body), len(zblob), CID) is None
    blob = encode_blob(DATA, Codec.RAW)
    head, body = split(blob, 1000)  # payload longer than the room given: not all read
    assert raw_payload(head, memoryview(body), len(blob), CID) is None


@pytest.mark.parametrize("damage", ["payload", "header", "short", "long"])
def test_raw_payload_reports_damage(damage: str) -> None:
    blob = bytearray(encode_blob(DATA, Codec.RAW))
    size = len(blob)
    if damage == "payload":
        blob[BLOB_HEADER_SIZE + 5] ^= 1
    elif damage == "header":
        blob[20] ^= 1
    elif damage == "short":
        size -= 1
    else:
        blob += b"x"
        size += 1
    head, body = split(bytes(blob[:size]), len(DATA) + 10)
    with pytest.raises(BlobCorrupt):
        raw_payload(head, memoryview(body), size, CID)


def slot(name: str, url: str, codec: str = "raw") -> TierSlot:
    tier = open_tier(url)
    return TierSlot(TierSpec(name, url), tier, TierPolicy(codec=codec))  # type: ignore[arg-type]


def test_fetch_reads_a_raw_blob_straight_into_out() -> None:
    a = slot("a", "memory://")
    assert a.tier is not None
    a.tier.put_parts(CID, encode_blob_parts(DATA, Codec.RAW))
    out = bytearray(len(DATA))
    raw, name = ChunkFetcher([a]).fetch(CID, memoryview(out))
    assert name == "a" and raw.obj is out and bytes(out) == DATA


def test_fetch_decodes_a_blob_whose_codec_the_policy_did_not_predict() -> None:
    a = slot("a", "memory://")  # policy says raw, the copy is zstd (a repair, an old policy)
    assert a.tier is not None
    a.tier.put(CID, encode_blob(DATA, Codec.ZSTD))
    for room in (len(DATA), len(DATA) + 4096):
        out = bytearray(room)
        raw, _ = ChunkFetcher([a]).fetch(CID, memoryview(out))
        assert bytes(raw) == DATA and bytes(out[: len(DATA)]) == DATA


def test_fetch_falls_back_past_a_damaged_raw_copy_and_repairs_it() -> None:
    bad, good = slot("bad", "memory://"), slot("good", "memory://")
    assert bad.tier is not None and good.tier is not None
    damaged = bytearray(encode_blob(DATA, Codec.RAW))
    damaged[-1] ^= 0xFF
    bad.tier.put(CID, damaged)
    good.tier.put(CID, encode_blob(DATA, Codec.ZSTD))
    fetcher = ChunkFetcher([bad, good], repair=True)
    out = bytearray(len(DATA))
    raw, name = fetcher.fetch(CID, memoryview(out))
    assert name == "good" and bytes(raw) == DATA
    assert fetcher.stats.corrupt == [("bad", CID)] and fetcher.stats.repaired == [("bad", CID)]
    assert bytes(ChunkFetcher([bad]).fetch(CID)[0]) == DATA
    with pytest.raises(NotFound):
        ChunkFetcher([good]).fetch(chunk_id(b"absent"), memoryview(out))


def test_file_tiers_store_raw_by_default_object_stores_zstd(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'remote'}"
    remote = open_tier(url, survives="cluster", shared=True)
    assert remote.capabilities.compress is False
    assert default_tier_policy(remote.capabilities).codec == "raw"
    forced = open_tier(url, survives="cluster", shared=True, compress=True)
    assert default_tier_policy(forced.capabilities).codec == "zstd"
    object_store = Capabilities(
        survives=FailureDomain.CLUSTER, shared=True, persistent=True, speed_rank=50
    )
    assert default_tier_policy(object_store).codec == "zstd"


def test_migration_to_s3_uploads_compressed_blobs_and_restores_from_s3_alone(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    url, options = s3_bucket
    tiers = [
        TierSpec("mem", "memory://"),
        TierSpec("s3", url, {"storage_options": options, "survives": "cluster"}),
    ]
    policy = Policy(
        base_every=1,
        chunk_size=64 * 1024,
        gc_grace_seconds=0,
        tiers={"s3": TierPolicy(versions="base", mode="async", codec="zstd", keep_bases=None)},
    )
    w = torch.randn(40 * 16384, generator=torch.Generator().manual_seed(3))  # 40 chunks
    with Checkpointer(tmp_path / "store", tiers=tiers, policy=policy) as ckpt:
        r = ckpt.save(0, {"w": w}).wait_migrated()
        assert r.tiers["s3"] == "committed"
        ckpt.flush()  # a sweep the migration asked for has ended (its lease is gone)
        s3 = ckpt.tierset.get("s3").tier
        assert s3 is not None and len(list(s3.list())) == 41  # every chunk + the manifest
        back = {"w": torch.zeros_like(w)}
        info = ckpt.restore(back, tiers=["s3"])
    assert info.source == "s3" and torch.equal(back["w"], w)


def test_file_tier_fsyncs_blob_directories_once_before_the_next_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiercheck.backends._fsspec import local

    synced: list[str] = []
    real = local.fsync_dir
    monkeypatch.setattr(local, "fsync_dir", lambda d: (synced.append(d), real(d)))
    tier = open_tier(f"file://{tmp_path / 't'}")
    blobs = [(chunk_id(bytes([i]) * 100), bytes([i]) * 100) for i in range(20)]
    for bid, data in blobs:
        tier.put_parts(bid, [encode_blob(data, Codec.RAW)])
    blob_dirs = {os.path.dirname(str(tmp_path / "t" / "blobs" / bid[:2] / bid)) for bid, _ in blobs}
    assert not blob_dirs & set(synced)  # content fsynced, names not yet
    synced.clear()
    tier.append(b"record")
    assert all(synced.count(d) == 1 for d in blob_dirs)  # once each, however many blobs
    assert synced.index(str(tmp_path / "t" / "log")) > max(synced.index(d) for d in blob_dirs)
    tier.close()
