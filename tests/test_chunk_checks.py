"""Chunk checks (schema 1.2, SPEC.md section 7.2): every save records XXH3-128 of each
chunk next to its id, and a restore verifies a chunk read in place from shm against it.
A copy that fails its check is verified by BLAKE3 instead; a store written before checks
(no ``checks`` in its manifests) is verified by BLAKE3 throughout.

Real /dev/shm segments (under the test's directory) and a real LMDB environment.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import tiercheck
from tiercheck import Policy, TierSpec
from tiercheck.engine import placing
from tiercheck.formats.ids import chunk_ids
from tiercheck.formats.manifest import ShardManifest
from tiercheck.store import fetch as fetch_module
from tiercheck.store.fetch import ChunkFetcher

CHUNK = 64 * 1024


@contextlib.contextmanager
def saved_store(
    tmp_path: Path, seed: int
) -> Iterator[tuple[tiercheck.Checkpointer, dict[str, Any], ShardManifest]]:
    """A store of shm and LMDB that saved :func:`state` ``(seed)`` as its one version:
    the store, the state saved and its manifest."""
    tiers = [
        TierSpec("shm", f"shm://ck{uuid.uuid4().hex[:10]}", {"root": str(tmp_path / "shm")}),
        TierSpec("lmdb", f"lmdb://{tmp_path / 'lmdb'}"),
    ]
    with tiercheck.Checkpointer(
        tmp_path / "store", tiers=tiers, policy=Policy(chunk_size=CHUNK, gc_grace_seconds=0)
    ) as ckpt:
        saved = state(seed)
        ckpt.save(seed, saved).wait()
        ckpt.flush()
        yield ckpt, saved, manifest_of(ckpt)


def state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"w": {f"w{i}": torch.randn(50_000) for i in range(3)}, "step": seed}


def manifest_of(ckpt: tiercheck.Checkpointer) -> ShardManifest:
    fetcher = ChunkFetcher(ckpt.tierset.by_speed())
    versions = ckpt.refresh().versions
    return fetcher.manifest(versions[max(versions)].shards[0])


def damage_in_shm(ckpt: tiercheck.Checkpointer, chunk_id: str) -> None:
    shm = ckpt.tierset.get("shm").tier
    assert shm is not None
    blob = bytearray(shm.get(chunk_id))
    blob[-1] ^= 0x40
    shm.put(chunk_id, bytes(blob), overwrite=True)


def blake3_verified(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ids of the chunks a read verifies by BLAKE3 from now on (``fetch._verify``
    still runs: this only records its calls)."""
    hashed: list[str] = []
    verify = fetch_module._verify

    def counting(raw: memoryview, chunk_id: str) -> None:
        hashed.append(chunk_id)
        verify(raw, chunk_id)

    monkeypatch.setattr(fetch_module, "_verify", counting)
    return hashed


def test_every_saved_chunk_records_xxh3_128_of_its_bytes(tmp_path: Path) -> None:
    with saved_store(tmp_path, 1) as (ckpt, _, manifest):
        assert len(manifest.chunks) > 2
        lmdb = ChunkFetcher([ckpt.tierset.get("lmdb")])
        for ref in manifest.chunks:
            raw = lmdb.fetch(ref.id)[0]  # verified by BLAKE3
            assert ref.check == xxhash.xxh3_128_digest(raw), ref.id


def test_a_chunk_that_fails_its_check_in_shm_is_read_from_lmdb_and_repaired(
    tmp_path: Path,
) -> None:
    """The check, not BLAKE3, decides in place: a flipped bit in shm's copy fails it, and
    the restore takes LMDB's copy (verified by BLAKE3), exact, and rewrites shm's."""
    with saved_store(tmp_path, 2) as (ckpt, saved, manifest):
        bad = manifest.chunks[1]
        assert bad.check is not None
        damage_in_shm(ckpt, bad.id)
        target = state(3)
        info = ckpt.restore(target)
        for k, v in saved["w"].items():
            assert torch.equal(target["w"][k], v), k
        assert ("shm", bad.id) in info.corrupt and ("shm", bad.id) in info.repaired
        assert info.chunks_from == {"shm": len(manifest.chunks), "lmdb": 1}  # manifest too


def test_in_place_a_wrong_check_defers_to_blake3_and_no_check_means_blake3(
    tmp_path: Path,
) -> None:
    """``fetch_in_place``: the bytes where their check matches; None (read them the long
    way, verified by BLAKE3) where it does not; by BLAKE3 where the manifest has none."""
    with saved_store(tmp_path, 1) as (ckpt, _, manifest):
        ref = manifest.chunks[0]
        slot = ckpt.tierset.get("shm")
        assert slot.tier is not None and ref.check is not None
        fetcher = ChunkFetcher(ckpt.tierset.by_speed())
        pins = slot.tier.pin()
        assert pins is not None
        try:
            got = fetcher.fetch_in_place(ref.id, slot, pins, ref.length, ref.check)
            assert got is not None and xxhash.xxh3_128_digest(got) == ref.check
            wrong = bytes(b ^ 0xFF for b in ref.check)
            assert fetcher.fetch_in_place(ref.id, slot, pins, ref.length, wrong) is None
            by_blake3 = fetcher.fetch_in_place(ref.id, slot, pins, ref.length, None)
            assert by_blake3 is not None and bytes(by_blake3) == bytes(got)
        finally:
            pins.close()


def test_a_store_written_without_checks_restores_in_place_by_blake3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1.1 writer took no checks: its manifests have none, a restore verifies shm's copies
    by BLAKE3 where they lie, and a damaged one is still caught."""

    def ids_only(views: Any, threads: Any = None, pool: Any = None) -> Any:
        return chunk_ids(views, threads, pool=pool), [None] * len(views)

    monkeypatch.setattr(placing, "chunk_ids_and_checks", ids_only)
    with saved_store(tmp_path, 4) as (ckpt, saved, manifest):
        assert all(ref.check is None for ref in manifest.chunks)
        target = state(5)
        info = ckpt.restore(target)
        assert info.chunks_from == {"shm": len(manifest.chunks) + 1}
        bad = manifest.chunks[-1].id
        damage_in_shm(ckpt, bad)
        target = state(5)
        info = ckpt.restore(target)
        for k, v in saved["w"].items():
            assert torch.equal(target["w"][k], v), k
        assert ("shm", bad) in info.corrupt and ("shm", bad) in info.repaired


def test_a_restore_staged_from_shm_verifies_by_the_checks_and_from_lmdb_by_blake3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While shm cannot be pinned (another reader pins it), a restore reads shm's copies
    into its staging buffer: those are verified against their checks (no BLAKE3 of a
    chunk), and a chunk shm lost comes from LMDB, verified by BLAKE3."""
    hashed = blake3_verified(monkeypatch)
    with saved_store(tmp_path, 6) as (ckpt, saved, manifest):
        shm = ckpt.tierset.get("shm").tier
        assert shm is not None
        held = shm.pin()
        assert held is not None
        try:
            hashed.clear()
            target = state(7)
            info = ckpt.restore(target)
            for k, v in saved["w"].items():
                assert torch.equal(target["w"][k], v), k
            assert info.chunks_from == {"shm": len(manifest.chunks) + 1}
            assert not set(hashed) & {ref.id for ref in manifest.chunks}
            lost = manifest.chunks[0].id
            shm.delete([lost])
            hashed.clear()
            target = state(7)
            info = ckpt.restore(target)
            assert torch.equal(target["w"]["w0"], saved["w"]["w0"])
            assert info.chunks_from.get("lmdb") == 1 and lost in hashed
        finally:
            held.close()


@pytest.mark.parametrize("threads", [None, 1, 2])
@pytest.mark.parametrize("sizes", [[3 << 20] * 3, [64 << 10] * 200, [5, 3 << 20, 70_000, 0]])
def test_ids_and_checks_agree_with_each_hash_on_every_path(
    threads: int | None, sizes: list[int]
) -> None:
    """Large chunks in lanes or by BLAKE3's tree, small ones in slices, serial: every path
    gives each chunk its BLAKE3 id and its XXH3-128 check."""
    from concurrent.futures import ThreadPoolExecutor

    import blake3

    from tiercheck.formats.ids import chunk_ids_and_checks

    gen = torch.Generator().manual_seed(len(sizes))
    chunks = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in sizes]
    views = [memoryview(c.numpy()) for c in chunks]
    with ThreadPoolExecutor(2) as pool:
        ids, checks = chunk_ids_and_checks(views, threads, pool=pool)
    assert ids == [blake3.blake3(v).hexdigest() for v in views]
    assert checks == [xxhash.xxh3_128_digest(v) for v in views]


def test_a_disk_tier_that_is_not_persistent_is_verified_by_blake3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a tier that says its copies lie in this host's memory (shm, ``memory://``) is
    verified against the checks: a ``file://`` tier declared ``persistent = false`` (a
    directory on a tmpfs, say) is a disk tier all the same, verified by BLAKE3."""
    hashed = blake3_verified(monkeypatch)
    tiers = [TierSpec("files", f"file://{tmp_path / 'files'}", {"persistent": False})]
    with tiercheck.Checkpointer(tmp_path / "store", tiers=tiers) as ckpt:
        saved = state(8)
        ckpt.save(8, saved).wait()
        slot = ckpt.tierset.get("files")
        assert slot.tier is not None and not slot.tier.capabilities.persistent
        assert not slot.tier.capabilities.host_memory
        manifest = manifest_of(ckpt)
        target = state(9)
        ckpt.restore(target)
        assert torch.equal(target["w"]["w1"], saved["w"]["w1"])
        assert {ref.id for ref in manifest.chunks} <= set(hashed)
