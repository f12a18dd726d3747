"""Packs seen from the engine: a base migrated to the default store's remote directory
and to S3 (moto on loopback) is a few objects, restores from that tier alone, and GC
deletes whole packs once their versions are gone (issue 25, item 3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tiercheck import Checkpointer, Policy
from tiercheck.store.config import TierSpec
from tiercheck.store.policy import TierPolicy


def _state(seed: int, numel: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(numel, generator=g), "b": torch.randn(1000, generator=g)}


def _remote_objects(root: Path) -> list[Path]:
    return [p for p in (root / "remote").rglob("*") if p.is_file() and p.name != "tier.json"]


def test_default_remote_holds_a_base_in_at_most_four_objects(tmp_path: Path) -> None:
    root = tmp_path / "store"
    numel = 3 * 1024 * 1024 // 4  # 3 MiB
    ckpt = Checkpointer(root)  # the defaults: bases migrate to root/remote
    try:
        for step in range(9):
            ckpt.save(step, _state(step, numel)).wait()
        assert ckpt.wait_migrations(timeout=300)
        bases = {v.id for v in ckpt.history() if v.tiers.get("remote") == "committed"}
        assert bases and len(_remote_objects(root)) <= 4 * len(bases)
        assert not list((root / "remote").glob("blobs/*/*"))
        back = _state(99, numel)
        info = ckpt.restore(back, tiers=["remote"])
        assert info.source == "remote"
        assert all(torch.equal(back[k], v) for k, v in _state(info.step, numel).items())
    finally:
        ckpt.destroy()


def test_the_default_remote_writes_packs_of_16_mib(tmp_path: Path) -> None:
    """A pack waits in memory until it is written (up to three at once), so the default
    store's remote directory writes 16 MiB packs: a 40 MiB base is three, none over
    16 MiB and a chunk (the old default wrote it as one pack of 40 MiB, held in memory)."""
    root = tmp_path / "store"
    numel = 40 * 1024 * 1024 // 4
    with Checkpointer(root) as ckpt:
        assert ckpt.save(0, _state(0, numel)).wait_migrated().tiers["remote"] == "committed"
        packs = sorted((root / "remote" / "packs").glob("*.pack"))
        sizes = [p.stat().st_size for p in packs]
        assert len(packs) == 3, sizes
        assert max(sizes) <= (16 + 4 + 1) * 1024 * 1024, sizes
        ckpt.destroy()


def _s3_store(tmp_path: Path, s3: tuple[str, dict[str, Any]], pack_size: str) -> Checkpointer:
    url, options = s3
    tiers = [
        TierSpec("mem", "memory://"),
        TierSpec(
            "s3", url, {"storage_options": options, "survives": "cluster", "pack_size": pack_size}
        ),
    ]
    policy = Policy(
        base_every=1,
        chunk_size=64 * 1024,
        gc_grace_seconds=0,
        tiers={"s3": TierPolicy(versions="base", mode="async", codec="zstd", keep_bases=1)},
    )
    return Checkpointer(tmp_path / "store", tiers=tiers, policy=policy)


def _s3_objects(s3: tuple[str, dict[str, Any]], kind: str) -> list[str]:
    url, options = s3
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    return [p for p in fs.find(url.removeprefix("s3://")) if f"/{kind}/" in p]


def test_a_large_base_on_s3_is_one_pack_per_pack_size_and_gc_deletes_whole_packs(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    numel = 2 * 1024 * 1024 // 4  # 2 MiB of random floats: zstd leaves them about as large
    with _s3_store(tmp_path, s3_bucket, "512KiB") as ckpt:
        first = ckpt.save(0, _state(0, numel)).wait_migrated()
        assert first.tiers["s3"] == "committed"
        ckpt.flush()  # a sweep the migration asked for has ended (its lease is gone)
        packs = _s3_objects(s3_bucket, "packs")
        assert 4 <= len(packs) <= 5  # 2 MiB in 512 KiB packs (the last one partly full)
        assert _s3_objects(s3_bucket, "blobs") == []
        assert ckpt.save(1, _state(1, numel)).wait_migrated().tiers["s3"] == "committed"
        ckpt.gc(grace=0)  # keep_bases=1: version 0 is gone, and its packs with it
        left = _s3_objects(s3_bucket, "packs")
        assert not set(packs) & set(left) and 4 <= len(left) <= 5
        back = _state(9, numel)
        info = ckpt.restore(back, tiers=["s3"])
    assert info.source == "s3" and info.step == 1
    assert all(torch.equal(back[k], v) for k, v in _state(1, numel).items())
