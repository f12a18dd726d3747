"""Engine defects reproduced and fixed (issue 21, item 5): the write lease's put and delete
in order across threads, close() bounded by its timeout, a failed open releasing what it
took, a changed tier list refused, and every background thread's failure reported.

Races are forced with :class:`~tiercheck.testing.faults.FaultyTier` hooks that block a real tier's
call on an Event, never with sleeps.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.backends.registry import open_tier
from tiercheck.errors import ConfigError, FormatVersionError, StoreLocked, UnfinishedWork
from tiercheck.formats.codecs import Codec, encode_blob
from tiercheck.formats.ids import chunk_id
from tiercheck.store.catalog import TierLog
from tiercheck.store.config import CONFIG_NAME, coerce_tiers, load_config
from tiercheck.store.leases import TierLeases
from tiercheck.store.tierset import TierSlot
from tiercheck.testing.faults import FaultEvent, FaultPlan, FaultyTier, inject
from tiercheck.upkeep.copying import WRITE_WINDOW
from tiercheck.upkeep.retention import GCState, collect_garbage

CHUNK = 4096


def state_of(seed: int, n: int = 4 * CHUNK) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "step": seed}


def mem() -> str:
    return f"memory://{uuid.uuid4().hex}"


# --- 1. the write lease follows its holds in order ------------------------------------------


def test_a_writer_starting_while_the_last_one_deletes_the_lease_keeps_it(tmp_path: Path) -> None:
    """The save thread ends its hold (its delete of the lease is slow) while the migration
    thread starts one: the lease must be in the tier while the migration writes, or another
    process's sweep deletes the blobs it writes before they are committed."""
    plan = FaultPlan()
    tier = FaultyTier(open_tier(f"file://{tmp_path / 'shared'}", shared=True), plan)
    leases, other_process = TierLeases(), TierLeases()
    deleting, put_again = threading.Event(), threading.Event()

    def slow_delete(_: FaultEvent) -> None:
        deleting.set()
        # the old code's second writer puts its lease here, inside the window; the fixed
        # code makes it wait for this delete, so the wait ends by its bound instead
        put_again.wait(timeout=2)

    plan.hook(slow_delete, "delete", count=1)
    plan.hook(lambda _: put_again.set(), "put", nth=2, after=True)
    leases.acquire_write(tier)
    saving = threading.Thread(target=leases.release_write, args=(tier,))
    saving.start()
    assert deleting.wait(timeout=60)
    migrating = threading.Thread(target=leases.acquire_write, args=(tier,), kwargs={"wait": False})
    migrating.start()
    saving.join()
    migrating.join()
    try:
        assert leases.write_id in tier.has([leases.write_id])  # held, so it is in the tier
        raw = b"a blob the migration wrote and has not committed yet"
        tier.put(chunk_id(raw), encode_blob(raw, Codec.RAW))
        slot = TierSlot(TierSpec("shared", tier.url), tier, TierPolicy())
        report = collect_garbage(
            slot,
            TierLog("shared"),
            lambda mid: None,  # type: ignore[arg-type,return-value]
            state=GCState(),
            grace=0,
            leases=other_process,
        )
        assert report.fenced is not None and leases.holder in report.fenced
        assert tier.has([chunk_id(raw)])
    finally:
        leases.release_write(tier)
        tier.close()


# --- 2. close(timeout) returns by its timeout -----------------------------------------------


def test_close_returns_by_its_timeout_while_a_migration_is_inside_a_put(tmp_path: Path) -> None:
    """A migration to a remote tier whose puts do not return: close(timeout=0.5) returns
    (raising UnfinishedWork naming it) while the put is still blocked; the tiers and the
    store lock are kept until the migration's thread ends, and that thread starts no tier
    call after close: nothing more is written or appended to the remote tier."""
    root = tmp_path / "s"
    slow_policy = TierPolicy(versions="base", mode="async", codec="zstd", keep_bases=None)
    ckpt = Checkpointer(
        root,
        tiers=[("fast", mem()), ("slow", f"file://{tmp_path / 'remote'}")],
        policy=Policy(
            chunk_size=CHUNK,
            gc_grace_seconds=0,
            tiers={"fast": TierPolicy(keep_bases=None), "slow": slow_policy},
        ),
    )
    plan = FaultPlan()
    slot = ckpt.tierset.get("slow")
    assert slot.tier is not None
    slot.tier = remote = FaultyTier(slot.tier, plan)
    window_full, release = threading.Event(), threading.Event()
    lock = threading.Lock()
    entered: list[str] = []
    returned: list[str] = []

    def stuck(event: FaultEvent) -> None:
        with lock:
            entered.append(event.key)
            if len(entered) == WRITE_WINDOW:
                window_full.set()
        if not release.wait(timeout=30):  # bounds the old code's close, which waits for it
            release.set()
        returned.append(event.key)

    plan.hook(stuck, "put")
    try:
        handle = ckpt.save(0, state_of(0, n=1 << 20))  # 4 MiB: more chunks than the window
        handle.wait()
        assert window_full.wait(timeout=60)  # every write the migration may have in flight
        with pytest.raises(UnfinishedWork) as err:
            ckpt.close(timeout=0.5)
        assert returned == []  # close returned while the puts were still blocked
        assert err.value.running == ("the migration of version 0 to slow",)
        assert (0, "slow", "still running at close") in err.value.migrations
        with pytest.raises(StoreLocked):  # the lock is kept while the thread may write
            Checkpointer(root)
    finally:
        release.set()
    assert ckpt.wait_closed(timeout=60)
    assert len(returned) == WRITE_WINDOW  # the puts in flight ended; no other one began
    assert remote.calls["put"] == WRITE_WINDOW and remote.calls["append"] == 0
    assert handle.wait_migrated(timeout=60).tiers["slow"] == "failed"  # settled: abandoned
    with Checkpointer(root) as again:  # released: opens in this process
        (v,) = again.history()
        assert v.id == 0 and v.holders == ("fast",)
    remote.inner.close()


# --- 3. a failed open releases what it took --------------------------------------------------


def test_a_failed_open_releases_the_lock_and_tiers_it_took(tmp_path: Path) -> None:
    """A tier's log written by a newer tiercheck makes the open fail after the writer
    lock and the tiers were taken; the caller keeps the error (and with it the half-made
    Checkpointer). The store must be free to open again in this process."""
    root, remote = tmp_path / "s", tmp_path / "remote"
    tiers = [("fast", f"lmdb://{tmp_path / 'lmdb'}"), ("remote", f"file://{remote}")]
    with Checkpointer(root, tiers=tiers, policy=Policy(chunk_size=CHUNK)) as ckpt:
        ckpt.save(0, state_of(0)).wait_migrated(timeout=60)
    newer = open_tier(f"file://{remote}")
    newer.append(msgpack.packb({"v": [99, 0], "type": "commit"}, use_bin_type=True))
    newer.close()
    threads = set(threading.enumerate())
    with pytest.raises(FormatVersionError) as first:
        Checkpointer(root)
    with pytest.raises(FormatVersionError) as second:  # not StoreLocked
        Checkpointer(root)
    assert first.value is not second.value
    assert [t.name for t in set(threading.enumerate()) - threads] == []
    remote.rename(tmp_path / "remote-newer")  # put away for a newer tiercheck
    with Checkpointer(root) as ckpt:  # the LMDB environment was closed: it opens again
        assert [v.id for v in ckpt.history()] == [0]


# --- 4. other tiers are refused ---------------------------------------------------------------


def test_reopening_with_other_tiers_raises_unless_asked_to_rewrite(tmp_path: Path) -> None:
    root = tmp_path / "s"
    first = [("fast", f"file://{tmp_path / 'a'}")]
    other = [("fast", f"file://{tmp_path / 'b'}")]
    with Checkpointer(root, tiers=first, policy=Policy(chunk_size=CHUNK)) as ckpt:
        ckpt.save(0, state_of(0)).wait()
    with pytest.raises(ConfigError, match="rewrite_config=True"):
        Checkpointer(root, tiers=other)
    with Checkpointer(root) as ckpt:  # the file was left as it was
        assert [v.id for v in ckpt.history()] == [0]
    with Checkpointer(root, tiers=first) as ckpt:  # the same tiers: fine
        assert [v.id for v in ckpt.history()] == [0]
    with Checkpointer(root, tiers=other, read_only=True) as ckpt:  # reads them, writes nothing
        assert ckpt.history() == []
    with Checkpointer(root, tiers=other, rewrite_config=True) as ckpt:
        assert ckpt.history() == []
    assert load_config(root / CONFIG_NAME).tiers == coerce_tiers(other)


# --- 5. a background thread's failure reaches close() ----------------------------------------


class InjectedBug(BaseException):
    """Not an Exception: what the maintenance thread's per-tier handler does not catch."""


def test_an_unexpected_failure_in_maintenance_reaches_close(tmp_path: Path) -> None:
    ckpt = Checkpointer(
        tmp_path / "s",
        tiers=[("fast", mem())],
        policy=Policy(
            chunk_size=CHUNK, base_every=1, gc_grace_seconds=0, tiers={"fast": TierPolicy()}
        ),
    )
    plan = inject(ckpt, "fast")

    def bug_in_maintenance(_: FaultEvent) -> None:
        if threading.current_thread().name.startswith("tiercheck-maint"):
            raise InjectedBug("retention's drop record")

    plan.hook(bug_in_maintenance, "append")
    try:
        for step in range(3):  # keep_bases=1: the second commit makes retention drop one
            ckpt.save(step, state_of(step)).wait()
        ckpt.flush()
    finally:
        with pytest.raises(UnfinishedWork, match="InjectedBug") as err:
            ckpt.close()
    assert err.value.saves == ()
    assert err.value.background and "maintenance" in err.value.background[0]
