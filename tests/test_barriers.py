"""What each wait promises about the background work behind it, on the default store.

A migration's end asks for maintenance (retention of every tier, now that the version is
no longer pinned) and, if it failed, for the deletion of what it wrote. Those requests are
made before its handle settles, so:

- ``handle.wait_migrated()`` then ``ckpt.flush()`` finds them done;
- ``ckpt.wait_migrations()`` returns once they are done;
- ``ckpt.pending_migrations()`` no longer lists a migration whose handle settled.

The migration thread is made to pause 0.5 s before each such request (the window a loaded
machine opens when it deschedules the thread there), and the deletion runs 0.5 s late (a
busy maintenance thread). Before the order was fixed, each test below failed in those
windows (CI failed once on it: a test counted the blobs of a failed migration while they
were being deleted).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tiercheck import Checkpointer, Policy
from tiercheck.store.config import TierSpec
from tiercheck.store.policy import TierPolicy
from tiercheck.upkeep.maintenance import Maintenance

STATE_FLOATS = 64 * 1024  # 256 KiB: several chunks of 64 KiB


@pytest.fixture
def late_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """The migration thread pauses before each maintenance request and discard."""

    def late(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: Maintenance, *args: Any) -> Any:
            if threading.current_thread().name == "tiercheck-migrate":
                time.sleep(0.5)
            return real(self, *args)

        return call

    monkeypatch.setattr(Maintenance, "request", late(Maintenance.request))
    monkeypatch.setattr(Maintenance, "discard", late(Maintenance.discard))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Checkpointer]:
    ckpt = Checkpointer(
        tmp_path / "store", policy=Policy(base_every=1, remote_every=1, chunk_size=64 * 1024)
    )
    try:
        yield ckpt
    finally:
        ckpt.destroy()


def state_of(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((STATE_FLOATS,), float(step))}


def remote_held(ckpt: Checkpointer) -> list[int]:
    return [v.step for v in ckpt.history() if v.tiers.get("remote") == "committed"]


def remote_files(ckpt: Checkpointer) -> set[str]:
    remote = Path(ckpt.root) / "remote"
    return {str(p.relative_to(remote)) for p in remote.rglob("*") if p.is_file()}


@pytest.mark.usefixtures("late_requests")
def test_flush_after_wait_migrated_finds_the_migrations_retention_done(
    store: Checkpointer,
) -> None:
    """The remote keeps its newest two bases: once the third one's handle says it is
    migrated, a flush has also run the retention that drops the first."""
    for step in (1, 2, 3):
        assert store.save(step, state_of(step)).wait_migrated().tiers["remote"] == "committed"
    store.flush()
    assert remote_held(store) == [2, 3]


@pytest.mark.usefixtures("late_requests")
def test_pending_migrations_is_empty_once_the_handle_settled(store: Checkpointer) -> None:
    assert store.save(1, state_of(1)).wait_migrated().tiers["remote"] == "committed"
    assert store.pending_migrations() == []


@pytest.mark.usefixtures("late_requests")
@pytest.mark.parametrize("barrier", ["wait_migrated, flush", "wait_migrations"])
def test_a_failed_migrations_blobs_are_gone_after_the_barrier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, barrier: str
) -> None:
    """Raw blobs reach a file tier in two steps (written, then fsynced and named on the
    write threads). A migration whose fsync fails from the tenth call fails; every blob
    begun and not finished is removed at once, the blobs it did name stay until the
    deletion of what it wrote (nothing references them), and either barrier returns after
    that deletion, even with the maintenance thread running late. The next migration
    completes and restores."""
    from tiercheck.backends._fsspec import local

    real_discard = Maintenance._discard

    def busy(self: Maintenance, *args: Any) -> None:
        time.sleep(0.5)
        real_discard(self, *args)

    monkeypatch.setattr(Maintenance, "_discard", busy)
    remote = tmp_path / "remote"
    tiers = [TierSpec("mem", "memory://"), TierSpec("remote", f"file://{remote}")]
    policy = Policy(
        base_every=1,
        chunk_size=64 * 1024,
        tiers={"remote": TierPolicy(versions="base", mode="async", codec="raw", keep_bases=None)},
    )
    real_fsync, calls = os.fsync, 0

    def fails_from_the_tenth(fd: int) -> None:
        nonlocal calls
        calls += 1
        if calls >= 10:
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    w = torch.randn(40 * 16384, generator=torch.Generator().manual_seed(4))  # 40 chunks
    with Checkpointer(tmp_path / "store", tiers=tiers, policy=policy) as ckpt:
        monkeypatch.setattr(local.os, "fsync", fails_from_the_tenth)
        handle = ckpt.save(0, {"w": w})
        if barrier == "wait_migrations":
            assert ckpt.wait_migrations(120)
        else:
            handle.wait_migrated(120)
            ckpt.flush()
        assert handle.result_now().tiers["remote"] == "failed"
        assert calls >= 10
        assert not [p for p in remote.rglob("*.tmp")]
        assert not [p for p in remote.rglob("*") if p.is_file() and "blobs" in p.parts]
        monkeypatch.setattr(local.os, "fsync", real_fsync)
        assert ckpt.save(1, {"w": w + 1}).wait_migrated(timeout=120).tiers["remote"] == "committed"
        back = {"w": torch.zeros_like(w)}
        info = ckpt.restore(back, tiers=["remote"])
    assert info.version == 1 and torch.equal(back["w"], w + 1)
