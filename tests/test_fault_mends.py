"""Faults that once stopped a store, and what it does now: a best-effort remote that is down
at the first launch (the store is empty, not of unknown content), an LMDB environment that
cannot be opened for writing (the store opens without it), and ``wait_migrated()`` after a
save whose ``wait()`` raised (it still waits for the migrations)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.backends.registry import open_tier
from tiercheck.errors import (
    DurabilityError,
    EmptyStore,
    InvalidURL,
    NoRestorableVersion,
    TierError,
    WaitTimeout,
)
from tiercheck.store.lifecycle import destroy_store
from tiercheck.testing.faults import FaultEvent, FaultPlan, inject

NO_RETRY = {"retry": False}


def _state(step: int, n: int = 4096) -> dict[str, Any]:
    return {"w": torch.full((n,), float(step)), "step": step}


# --- A: a best-effort remote down when the store is first opened ------------------------------


def _tiers(tmp_path: Path, s3: tuple[str, dict[str, Any]], name: str) -> list[TierSpec]:
    url, options = s3
    return [
        TierSpec("shm", f"shm://{name}", {"root": str(tmp_path / "shm")}),
        TierSpec("lmdb", f"lmdb://{tmp_path / 'lmdb'}"),
        TierSpec("remote", url, {"storage_options": options, **NO_RETRY}),
    ]


def test_first_launch_with_the_remote_down_is_an_empty_store(
    tmp_path: Path, s3_server: Any, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    """The store's id is drawn by this open, so the remote it cannot reach holds none of its
    versions: ``restore(missing_ok=True)`` returns None, ``restore()`` raises EmptyStore,
    and saves commit in the tiers that opened."""
    root = tmp_path / "run"
    tiers = _tiers(tmp_path, s3_bucket, f"mend{uuid.uuid4().hex[:8]}")
    try:
        with s3_server.down(), Checkpointer(root, tiers=tiers) as ckpt:
            assert ckpt.tierset.get("remote").tier is None  # down: not opened
            state = _state(0)
            assert ckpt.restore(state, missing_ok=True) is None
            with pytest.raises(EmptyStore):
                ckpt.restore(state)
            r = ckpt.save(1, _state(1)).wait()
            assert r.committed_tiers == ("shm", "lmdb") and r.tiers["remote"] == "unreachable"
            info = ckpt.restore(state)
            assert info.step == 1 and bool((state["w"] == 1.0).all())
    finally:
        destroy_store(root)


def test_an_existing_store_with_the_remote_down_says_it_is_unreachable(
    tmp_path: Path, s3_server: Any, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    """A store opened before may hold versions in the remote it cannot reach now: the
    restore refuses to call it empty, and says to try again once the tier is back (it is
    not damaged, so nothing is to be moved aside)."""
    root = tmp_path / "run"
    tiers = _tiers(tmp_path, s3_bucket, f"mend{uuid.uuid4().hex[:8]}")
    try:
        Checkpointer(root, tiers=tiers).close()  # the store exists, and owns its tiers
        with s3_server.down(), Checkpointer(root, tiers=tiers) as ckpt:
            for missing_ok in (True, False):
                with pytest.raises(NoRestorableVersion) as err:
                    ckpt.restore(_state(0), missing_ok=missing_ok)
                assert not isinstance(err.value, EmptyStore)
                message = str(err.value)
                assert "tier remote is unreachable" in message, message
                assert "once" in message and "move aside" not in message, message
            # the tiers that can be read, alone, hold nothing: that is an empty store
            assert ckpt.restore(_state(0), tiers=["shm", "lmdb"], missing_ok=True) is None
    finally:
        destroy_store(root)


# --- B: an LMDB environment that cannot be opened for writing ---------------------------------


@contextmanager
def _unwritable(path: Path) -> Iterator[None]:
    """Make the directory ``path`` and the files in it unwritable for this process: by its
    mode, or, for root (whom modes do not stop), by the immutable attribute (``chattr
    +i``: the kernel refuses every write to it, root's too, with EPERM)."""
    entries = [path, *path.iterdir()]
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in entries}
        for p in entries:
            p.chmod(modes[p] & ~0o222)
        try:
            yield
        finally:
            for p, mode in modes.items():
                p.chmod(mode)
        return
    chattr = shutil.which("chattr")
    if chattr is None:
        pytest.skip("running as root without chattr: cannot make a directory unwritable")
    done = subprocess.run([chattr, "+i", *map(str, entries)], capture_output=True, check=False)
    if done.returncode != 0:
        subprocess.run([chattr, "-i", *map(str, entries)], capture_output=True, check=False)
        pytest.skip(f"this file system keeps no immutable attribute: {done.stderr!r}")
    try:
        yield
    finally:
        subprocess.run([chattr, "-i", *map(str, entries)], capture_output=True, check=True)


def test_lmdb_that_cannot_be_written_leaves_the_store_open(tmp_path: Path) -> None:
    """After a save, the LMDB environment becomes unwritable (as under a file system
    remounted read-only): a writable open goes on without the tier, restores from shm,
    and saves to the others, as for a lost tier."""
    root = tmp_path / "run"
    lmdb_dir = tmp_path / "lmdb"
    tiers = [
        TierSpec("shm", f"shm://mend{uuid.uuid4().hex[:8]}", {"root": str(tmp_path / "shm")}),
        TierSpec("lmdb", f"lmdb://{lmdb_dir}"),
        TierSpec("remote", f"file://{tmp_path / 'remote'}"),
    ]
    try:
        with Checkpointer(root, tiers=tiers) as ckpt:
            ckpt.save(1, _state(1)).wait_migrated()
        with _unwritable(lmdb_dir):
            with pytest.raises(TierError) as err:
                open_tier(f"lmdb://{lmdb_dir}")
            assert not isinstance(err.value, InvalidURL), err.value
            with Checkpointer(root, tiers=tiers) as ckpt:
                slot = ckpt.tierset.get("lmdb")
                assert slot.tier is None and slot.error
                state = _state(0)
                assert ckpt.restore(state).step == 1 and bool((state["w"] == 1.0).all())
                r = ckpt.save(2, _state(2)).wait()
                assert "shm" in r.committed_tiers and r.tiers["lmdb"] == "unreachable"
            # read-only, it still reads the environment it cannot write
            with Checkpointer(root, read_only=True) as reader:
                assert reader.restore(None, tiers=["lmdb"]).step == 1
    finally:
        destroy_store(root)


def test_a_malformed_lmdb_url_is_still_a_configuration_error(tmp_path: Path) -> None:
    for url in ("lmdb://relative/path", "lmdb:///", f"lmdb://{tmp_path}/x?a=b"):
        with pytest.raises(InvalidURL):
            open_tier(url)
        with pytest.raises(InvalidURL):
            Checkpointer(tmp_path / "run", tiers=[TierSpec("lmdb", url)])


# --- C: wait_migrated() after wait() raised ---------------------------------------------------


def test_wait_migrated_waits_for_migrations_when_the_save_failed(tmp_path: Path) -> None:
    """LMDB (synchronous, required) is full, so ``wait()`` raises DurabilityError while the
    version's migration to the remote is still running: ``wait_migrated()`` waits for it to
    settle (within its timeout), then raises the save's error."""
    release = threading.Event()
    entered = threading.Event()

    def hold(event: FaultEvent) -> None:
        entered.set()
        release.wait(60)

    policy = Policy(
        tiers={
            "mem": TierPolicy(versions="all", mode="sync", codec="raw"),
            "lmdb": TierPolicy(versions="all", mode="sync", codec="raw"),
            "remote": TierPolicy(versions="base", mode="async", codec="raw"),
        }
    )
    ckpt = Checkpointer(
        tmp_path / "run",
        tiers=[
            TierSpec("mem", f"memory://{uuid.uuid4().hex}"),
            TierSpec("lmdb", f"lmdb://{tmp_path / 'lmdb'}", {"max_size": 2 << 20}),
            TierSpec("remote", f"file://{tmp_path / 'remote'}"),
        ],
        policy=policy,
    )
    try:
        plan = inject(ckpt, "remote", FaultPlan())
        plan.hook(hold, "append")  # the migration's commit waits until released
        big = {"w": torch.randn(1 << 20, generator=torch.Generator().manual_seed(1))}
        h = ckpt.save(1, big)  # 4 MiB of distinct chunks: more than LMDB may hold
        with pytest.raises(DurabilityError):
            h.wait()
        assert h.result_now().tiers["lmdb"] == "failed"
        with pytest.raises(WaitTimeout, match="still being retried"):
            h.wait_migrated(timeout=0.2)  # the migration has not settled
        assert not h.migrated()
        release.set()
        with pytest.raises(DurabilityError):
            h.wait_migrated(timeout=20)
        assert entered.is_set() and h.migrated()
        assert h.result_now().tiers["remote"] == "committed"
    finally:
        release.set()
        ckpt.close(wait_migrations=False)


def test_a_required_remote_down_at_the_open_fails_every_wait_migrated(
    tmp_path: Path, s3_server: Any, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    """An asynchronous remote written out as required that could not be opened: no
    migration ever settles the handle, and ``wait_migrated()`` returned as if the remote
    had received the version (a new user's S3 outage at the job's start, unnoticed)."""
    root = tmp_path / "run"
    tiers = _tiers(tmp_path, s3_bucket, f"mend{uuid.uuid4().hex[:8]}")
    policy = Policy(tiers={"remote": TierPolicy(mode="async", guarantee="required")})
    try:
        Checkpointer(root, tiers=tiers, policy=policy).close()
        with s3_server.down(), Checkpointer(root, tiers=tiers, policy=policy) as ckpt:
            h = ckpt.save(1, _state(1))
            r = h.wait()  # the synchronous tiers took it: wait() is content
            assert r.tiers["remote"] == "unreachable"
            with pytest.raises(DurabilityError, match="required tier remote failed"):
                h.wait_migrated()
    finally:
        destroy_store(root)


@pytest.mark.parametrize(
    "bad",
    [
        TierSpec("lmdb", "lmdb://relative/lmdb"),  # InvalidURL while the tiers are opened
        TierSpec("lmdb", "lmdb://{root}/lmdb", {"survives": "galaxy"}),  # a bad option
    ],
    ids=["url", "option"],
)
def test_a_failed_first_open_leaves_no_shm_segment(tmp_path: Path, bad: TierSpec) -> None:
    """The open of a new store that fails on a later tier removes the shm segment it made:
    it had no owner, so neither ``tiercheck rm`` (no store file) nor ``gc --orphans`` would
    ever free it, and each retry of a misconfigured job leaked one."""
    shm_root = tmp_path / "shm"
    name = f"mend{uuid.uuid4().hex[:8]}"
    tiers = [TierSpec("shm", f"shm://{name}", {"root": str(shm_root)}), bad]
    with pytest.raises((InvalidURL, TierError, ValueError, TypeError)):
        Checkpointer(tmp_path / "run", tiers=tiers)
    assert not (shm_root / name).exists()
    assert not (tmp_path / "run" / "tiercheck.toml").exists()
    # an existing segment (another store's, or this store's from before) is left alone
    (shm_root / name).mkdir(parents=True)
    (shm_root / name / "keep").write_text("x")
    with pytest.raises((InvalidURL, TierError, ValueError, TypeError)):
        Checkpointer(tmp_path / "run", tiers=tiers)
    assert (shm_root / name / "keep").exists()


def test_a_remote_down_at_the_open_is_opened_once_it_can_be_reached(
    tmp_path: Path, s3_server: Any, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    """A remote that could not be reached when the store was opened took no version for the
    rest of the run, however soon it came back (a short S3 outage at a job's start meant no
    remote copy for days). Now it is tried again, by itself with backoff, and at once by
    ``retry_migrations()``; its log is read first, and it takes the next versions."""
    root = tmp_path / "run"
    tiers = _tiers(tmp_path, s3_bucket, f"mend{uuid.uuid4().hex[:8]}")
    policy = Policy(tiers={"remote": TierPolicy(mode="async", versions="all")})
    try:
        with Checkpointer(root, tiers=tiers, policy=policy) as ckpt:
            ckpt.save(1, _state(1)).wait_migrated()  # the remote holds version 0
        with s3_server.down():
            ckpt = Checkpointer(root, tiers=tiers, policy=policy)
        try:
            assert ckpt.tierset.get("remote").tier is None
            r = ckpt.save(2, _state(2)).wait_migrated()
            assert r.tiers["remote"] == "unreachable"
            ckpt.retry_migrations()  # the server is up again: opened now, on this thread
            assert ckpt.tierset.get("remote").tier is not None
            # a diff of a base the remote missed would not restore from it: passed over
            r = ckpt.save(3, _state(3)).wait_migrated()
            assert r.role == "diff" and r.tiers["remote"] == "missing", r
            assert "its base" in r.errors["remote"]
            r = ckpt.save(4, _state(4), role="base").wait_migrated()
            assert r.tiers["remote"] == "committed"
            r = ckpt.save(5, _state(5)).wait_migrated()
            assert r.role == "diff" and r.tiers["remote"] == "committed"
        finally:
            ckpt.close()
        # the remote alone restores the newest version it took
        with Checkpointer(root, tiers=tiers, policy=policy) as ckpt:
            state = _state(0)
            info = ckpt.restore(state, tiers=["remote"])
            assert info.step == 5 and bool((state["w"] == 5.0).all())
    finally:
        destroy_store(root)
