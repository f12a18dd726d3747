"""A full disk (issue 22 item 5, issue 25 item 5): work that is given up deletes what it
wrote, GC's grace runs from a blob's own age, and a save after the space is freed succeeds.

On a real 40 MiB tmpfs (skipped with the reason where this process may not mount one) with
real ``file://`` and LMDB tiers; ``tiercheck gc`` runs as a real process after the one that
left the garbage has exited.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import textwrap
import time
import uuid
from pathlib import Path

import _fresh
import lmdb
import pytest
import torch
from _tmpfs import tmpfs

from tiercheck import Checkpointer
from tiercheck.errors import DurabilityError
from tiercheck.store.config import TierSpec
from tiercheck.store.policy import Policy, TierPolicy

MiB = 1 << 20


def used(path: Path) -> float:
    return shutil.disk_usage(path).used / MiB


def fill(path: Path, leave: float) -> Path:
    """A ballast file that leaves ``leave`` MiB free on ``path``'s file system."""
    ballast = path / "ballast"
    free = shutil.disk_usage(path).free
    ballast.write_bytes(b"\xa5" * max(0, free - int(leave * MiB)))
    return ballast


def random_state(seed: int, mib: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=g), "step": seed}


def two_tier_store(root: Path, disk_url: str, disk: TierPolicy) -> Checkpointer:
    """A memory tier that takes every version, and ``disk`` on the small file system."""
    policy = Policy(
        base_every=1,
        chunk_size=1 * MiB,
        gc_grace_seconds=300,
        tiers={"mem": TierPolicy(versions="all", mode="sync", keep_bases=1), "disk": disk},
    )
    return Checkpointer(
        root,
        tiers=[
            TierSpec("mem", f"memory://{uuid.uuid4().hex}", {"budget": "256MiB"}),
            TierSpec("disk", disk_url),
        ],
        policy=policy,
    )


def test_given_up_migration_deletes_what_it_wrote(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk") as disk:
        ballast = fill(disk, leave=8)
        before = used(disk)
        ckpt = two_tier_store(
            tmp_path / "root",
            f"file://{disk / 'remote'}",
            TierPolicy(versions="base", mode="async", guarantee="best_effort"),
        )
        try:
            handle = ckpt.save(0, random_state(0, 12))  # 12 MiB: does not fit in 8
            handle.wait()
            assert ckpt.wait_migrations(120)
            assert handle.result_now().tiers["disk"] == "failed"
            assert "TierFull" in handle.result_now().errors["disk"]
            ckpt.flush()
            # what the migration wrote before the disk filled is gone (main: ~8 MiB stays)
            assert used(disk) - before < 0.5
            # so the next (smaller) base fits without anyone freeing space
            nxt = ckpt.save(1, random_state(1, 5))
            nxt.wait()
            assert ckpt.wait_migrations(120)
            assert nxt.result_now().tiers["disk"] == "committed"
            # and once the space is freed, a big one does too
            ballast.unlink()
            big = ckpt.save(2, random_state(2, 12))
            big.wait()
            assert ckpt.wait_migrations(120)
            assert big.result_now().tiers["disk"] == "committed"
            got = {"w": torch.zeros(12 * MiB // 4), "step": -1}
            assert ckpt.restore(got, tiers=["disk"]).version == 2
            assert torch.equal(got["w"], random_state(2, 12)["w"])  # type: ignore[arg-type]
        finally:
            ckpt.close()


@pytest.mark.parametrize("kind", ["file", "lmdb"])
def test_failed_save_deletes_what_it_wrote_and_the_next_save_succeeds(
    tmp_path: Path, kind: str
) -> None:
    with tmpfs(tmp_path / "disk") as disk:
        url = f"file://{disk / 'files'}" if kind == "file" else f"lmdb://{disk / 'lmdb'}"
        ckpt = two_tier_store(
            tmp_path / "root", url, TierPolicy(versions="all", mode="sync", keep_bases=1)
        )
        try:
            ckpt.save(0, random_state(0, 6)).wait()
            ballast = fill(disk, leave=4)
            before = used(disk)
            # 16 MiB: more than the free space and the slack LMDB reserved beyond its data
            failed = ckpt.save(1, random_state(1, 16))
            with pytest.raises(DurabilityError):  # the disk tier is required: it is full
                failed.wait()
            assert failed.result_now().tiers == {"mem": "committed", "disk": "failed"}
            ckpt.flush()
            assert used(disk) - before < 0.5  # main: the blobs written before ENOSPC stay
            # a state that fits the space left now commits
            ckpt.save(2, random_state(2, 2)).wait()
            # the save after the space is freed succeeds
            ballast.unlink()
            result = ckpt.save(3, random_state(3, 8)).wait()
            assert result.tiers == {"mem": "committed", "disk": "committed"}
            got = {"w": torch.zeros(8 * MiB // 4), "step": -1}
            assert ckpt.restore(got, tiers=["disk"]).version == 3
            assert torch.equal(got["w"], random_state(3, 8)["w"])  # type: ignore[arg-type]
        finally:
            ckpt.close()


_WRITER = textwrap.dedent(
    """
    import sys, torch
    from tiercheck import Checkpointer
    from tiercheck.store.config import TierSpec
    from tiercheck.store.policy import Policy, TierPolicy

    root, lmdb_url, file_url = sys.argv[1:4]
    keep1 = TierPolicy(versions="all", mode="sync", keep_bases=1)
    ckpt = Checkpointer(
        root,
        tiers=[TierSpec("lmdb", lmdb_url), TierSpec("files", file_url)],
        policy=Policy(base_every=1, chunk_size=1 << 16, gc_grace_seconds=300,
                      tiers={"lmdb": keep1, "files": keep1}),
    )
    for step in range(4):  # every base replaces the last (retention sweeps its blobs)
        g = torch.Generator().manual_seed(step)
        ckpt.save(step, {"w": torch.randn(1 << 18, generator=g), "step": step}).wait()
    ckpt.close()  # its background sweeps are over: they would take what follows
    # what a writer that died mid-save leaves: blobs no record references
    from tiercheck.backends import open_tier
    from tiercheck.formats.ids import chunk_id
    for url in (lmdb_url, file_url):
        tier = open_tier(url)
        for i in range(5):
            blob = bytes([i]) * 70000
            tier.put(chunk_id(blob), blob)
        tier.close()
    """
)


def _age_lmdb_times(path: Path, seconds: float) -> int:
    """Move every blob's written time in the LMDB at ``path`` ``seconds`` into the past
    (what ``touch -d`` does to a file's mtime); returns how many."""
    env = lmdb.open(str(path), max_dbs=3)
    try:
        times = env.open_db(b"times")
        with env.begin(write=True) as txn:
            items = [(bytes(k), struct.unpack("<d", bytes(v))[0]) for k, v in txn.cursor(times)]
            for key, t in items:
                txn.put(key, struct.pack("<d", t - seconds), db=times)
        return len(items)
    finally:
        env.close()


def test_gc_without_flags_frees_what_a_process_that_exited_left(tmp_path: Path) -> None:
    root = tmp_path / "root"
    lmdb_path, files = tmp_path / "lmdb", tmp_path / "files"
    _fresh.run(
        ["-c", _WRITER, str(root), f"lmdb://{lmdb_path}", f"file://{files}"],
        check=True,
        timeout=300,
    )
    # the writer exited an hour ago: its blobs are an hour old
    _age_lmdb_times(lmdb_path, 3600)
    hour_ago = time.time() - 3600
    blobs = [p for p in (files / "blobs").rglob("*") if p.is_file()]
    for p in blobs:
        os.utime(p, (hour_ago, hour_ago))

    def gc(*flags: str) -> dict[str, dict[str, int]]:
        proc = _fresh.run(
            ["-m", "tiercheck", "gc", str(root), "--json", *flags],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        return {r["tier"]: r for r in json.loads(proc.stdout)["tiers"]}

    def blob_files() -> int:
        return sum(1 for p in (files / "blobs").rglob("*") if p.is_file())

    dry = gc("--dry-run")
    for tier in ("lmdb", "files"):
        # the blobs the dead writer left are past the grace (main: all "waiting")
        assert dry[tier]["unreferenced"] > 0, dry
        assert dry[tier]["would_delete"] == dry[tier]["unreferenced"], dry
    before = blob_files()
    gc()  # no flags
    after = gc("--dry-run")
    assert all(r["unreferenced"] == 0 for r in after.values()), after
    assert blob_files() == after["files"]["kept"] < before  # what is left is referenced
    with Checkpointer(root, read_only=True) as ro:
        got = {"w": torch.zeros(1 << 18), "step": -1}
        assert ro.restore(got).step == 3
