"""What the engine promises, each promise a test (issue 12): restores that change nothing
unless they succeed, migrations retried until they land or are reported, ``close()`` that
reports what it could not finish, background errors on their own handle, GC fenced off
from writers by construction (in this process and through leases in shared tiers), the
configuration of guarantees, and honest failure domains in ``tiercheck ls``."""

from __future__ import annotations

import json
import threading
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import tiercheck
from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.backends._memory import MemoryTier
from tiercheck.backends.registry import open_tier
from tiercheck.errors import (
    DurabilityError,
    NoRestorableVersion,
    UnfinishedWork,
    WaitTimeout,
)
from tiercheck.formats.codecs import Codec, encode_blob
from tiercheck.formats.ids import chunk_id
from tiercheck.store.catalog import TierLog
from tiercheck.store.config import default_config, load_config, save_config
from tiercheck.store.leases import GCFence, TierLeases
from tiercheck.testing.faults import inject
from tiercheck.upkeep.retention import GCState, collect_garbage

CHUNK = 4096
EVERY = TierPolicy(keep_bases=None)
BASES_ASYNC = TierPolicy(versions="base", mode="async", codec="zstd", keep_bases=None)


def mem() -> str:
    return f"memory://{uuid.uuid4().hex}"


def state_of(seed: int, n: int = 4 * 4096) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(7, generator=g), "step": seed}


def store(tmp_path: Path, **tiers: TierPolicy) -> Checkpointer:
    return Checkpointer(
        tmp_path / "s",
        tiers=[(name, mem()) for name in tiers],
        policy=Policy(base_every=3, chunk_size=CHUNK, gc_grace_seconds=0, tiers=tiers),
    )


# --- restore is all or nothing ----------------------------------------------------------


def test_a_failed_restore_leaves_the_callers_state_untouched(tmp_path: Path) -> None:
    ckpt = store(tmp_path, fast=EVERY)
    model = torch.nn.Linear(64, 64)
    try:
        ckpt.save(0, {"model": model, "w": torch.randn(8 * 4096), "step": 0}).wait()
        tier = ckpt.tierset.get("fast").tier
        assert tier is not None
        manifest = ckpt.version(0).manifest
        missing = manifest.chunks[-1].id
        tier.delete([missing])  # the last chunk is gone from the only tier
        target = {"model": torch.nn.Linear(64, 64), "w": torch.zeros(8 * 4096), "step": -1}
        before = {k: v.clone() for k, v in target["model"].state_dict().items()}
        with pytest.raises(NoRestorableVersion) as failed:
            ckpt.restore(target)
        for key, value in target["model"].state_dict().items():
            assert torch.equal(value, before[key]), key
        assert not target["w"].any() and target["step"] == -1  # nothing written
        assert missing in str(failed.value)  # the error names the chunk that could not be read
    finally:
        ckpt.close()


# --- migrations: retried, waited for, reported --------------------------------------------


def test_a_migration_is_retried_by_itself_and_wait_migrated_returns(tmp_path: Path) -> None:
    ckpt = store(tmp_path, fast=EVERY, slow=BASES_ASYNC)
    plan = inject(ckpt, "slow")
    try:
        plan.down()
        h = ckpt.save(0, state_of(0))
        h.wait()
        with pytest.raises(WaitTimeout, match="still being retried"):
            h.wait_migrated(timeout=0.2)
        ckpt.flush()  # the save has queued its migration (after its handle finished)
        assert [(v, t) for v, t, _ in ckpt.pending_migrations()] == [(0, "slow")]
        plan.up()
        r = h.wait_migrated(timeout=120)  # no retry_migrations(): the backoff retries it
        assert r.tiers["slow"] == "committed"
        assert ckpt.refresh().logs["slow"].holds(0)
    finally:
        ckpt.close()


class BuggyTier(MemoryTier):
    """A memory tier whose ``append`` raises a plain ``ValueError`` (a bug, not a tier
    error) while ``broken`` is set."""

    broken: ClassVar[bool] = False

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__("memory://buggy-" + url.split("://", 1)[1], **options)

    def append(self, record: bytes, *, blobs: Any = ()) -> None:
        if BuggyTier.broken:
            raise ValueError("a bug in a tier")
        super().append(record, blobs=blobs)


def test_a_migration_that_hits_a_bug_fails_on_its_handle_and_the_thread_goes_on(
    tmp_path: Path,
) -> None:
    tiercheck.register_tier("buggy", BuggyTier, replace=True)
    required = TierPolicy(versions="base", mode="async", keep_bases=None, guarantee="required")
    ckpt = Checkpointer(
        tmp_path / "s",
        tiers=[("fast", mem()), ("slow", f"buggy://{uuid.uuid4().hex}")],
        policy=Policy(chunk_size=CHUNK, base_every=1, tiers={"fast": EVERY, "slow": required}),
    )
    try:
        BuggyTier.broken = True
        first = ckpt.save(0, state_of(0))
        # wait() does not wait for the migration, which may have failed already
        assert first.wait().tiers["slow"] in ("migrating", "failed")
        with pytest.raises(DurabilityError, match=r"required tier slow failed.*a bug in a tier"):
            first.wait_migrated(timeout=120)
        BuggyTier.broken = False
        second = ckpt.save(1, state_of(1))
        assert second.wait_migrated(timeout=120).tiers["slow"] == "committed"  # thread alive
        assert ckpt.save(2, state_of(2)).wait().committed_tiers == ("fast",)  # not blamed
    finally:
        BuggyTier.broken = False
        with pytest.raises(UnfinishedWork, match="ValueError") as err:
            ckpt.close()
    assert err.value.saves == () and len(err.value.background) == 1  # the bug, once


def test_close_reports_unfinished_migrations_and_can_abandon_them(tmp_path: Path) -> None:
    for abandon in (False, True):
        ckpt = store(tmp_path / str(abandon), fast=EVERY, slow=BASES_ASYNC)
        plan = inject(ckpt, "slow")
        plan.down()
        h = ckpt.save(0, state_of(0))
        h.wait()
        if abandon:
            ckpt.close(abandon=True)  # logged, not raised
        else:
            with pytest.raises(UnfinishedWork) as err:
                ckpt.close()  # tries once more, does not wait for the tier to come back
            ((version, tier, _),) = err.value.migrations
            assert (version, tier) == (0, "slow")
        assert h.wait_migrated(timeout=5).tiers["slow"] == "failed"  # settled, not hanging
        with Checkpointer(tmp_path / str(abandon) / "s", read_only=True) as again:
            assert [v.id for v in again.history()] == [0]  # the store was closed all the same


# --- GC fenced off from writers -------------------------------------------------------------


def test_a_writer_waits_only_for_the_deletion_of_what_it_protects() -> None:
    fence = GCFence()
    doomed, other = "a" * 64, "b" * 64
    fence.begin()
    assert fence.claim("t", [doomed, other]) == [doomed, other]
    fence.protect([chr(99) * 64])  # not being deleted: returns at once
    got: list[list[str]] = []
    writer = threading.Thread(target=lambda: got.append(fence.protect([doomed])))
    writer.start()
    writer.join(0.2)
    assert writer.is_alive()  # waits while its blob is being deleted...
    fence.done("t")
    writer.join(10)
    assert got == [[doomed]]  # ...and then asks the tier afresh


def test_ids_released_during_a_sweep_stay_protected_until_it_ends() -> None:
    fence = GCFence()
    ids = fence.protect(["c" * 64])
    fence.begin()  # the sweep may have read its catalog before the commit naming them
    fence.release(ids)
    assert fence.claim("t", ["c" * 64]) == []
    fence.done("t")
    fence.begin()
    assert fence.claim("t", ["c" * 64]) == ["c" * 64]
    fence.done("t")


def test_a_held_tier_is_swept_of_nothing_until_released() -> None:
    """Rank 0 holds the shared tiers while other ranks' blobs (ids it never sees) are named
    by no record yet: a sweep of a held tier claims nothing; other tiers are swept."""
    fence = GCFence()
    blob = "d" * 64
    held = fence.hold(["shared"])
    fence.begin()
    assert fence.claim("shared", [blob]) == []
    fence.done("shared")
    fence.begin()
    assert fence.claim("local", [blob]) == [blob]
    fence.done("local")
    fence.release_in(held)
    fence.begin()
    assert fence.claim("shared", [blob]) == [blob]
    fence.done("shared")
    assert fence.protected("shared") == set()


def shared_tier(tmp_path: Path) -> Any:
    return open_tier(f"file://{tmp_path / 'shared'}", shared=True)


def sweep(tier: Any, leases: TierLeases) -> Any:
    from tiercheck.store.tierset import TierSlot

    slot = TierSlot(TierSpec("shared", tier.url), tier, TierPolicy())
    return collect_garbage(
        slot,
        TierLog("shared"),
        lambda mid: None,
        state=GCState(),
        grace=0,
        leases=leases,  # type: ignore[arg-type,return-value]
    )


def test_a_sweep_skips_a_shared_tier_another_process_writes_to(tmp_path: Path) -> None:
    tier = shared_tier(tmp_path)
    writer, sweeper = TierLeases(), TierLeases()  # two processes, as far as leases go
    raw = b"a blob a save in another process is writing"
    writer.acquire_write(tier)
    tier.put(chunk_id(raw), encode_blob(raw, Codec.RAW))
    report = sweep(tier, sweeper)
    assert report.fenced is not None and writer.holder in report.fenced
    assert tier.has([chunk_id(raw)])
    writer.release_write(tier)  # gone without a record: a leftover
    report = sweep(tier, sweeper)
    assert report.fenced is None and report.deleted == 1
    assert list(tier.list()) == []  # the sweep lease is gone too
    tier.close()


def test_a_writer_waits_for_another_process_sweep_and_stale_leases_go(tmp_path: Path) -> None:
    tier = shared_tier(tmp_path)
    writer, sweeper = TierLeases(), TierLeases()
    assert sweeper.put_sweep(tier) is None
    done = threading.Event()

    def write() -> None:
        writer.acquire_write(tier)
        done.set()

    t = threading.Thread(target=write)
    t.start()
    assert not done.wait(0.3)  # the sweep is live: the writer waits before asking what is there
    sweeper.end_sweep(tier)
    assert done.wait(30)
    t.join()
    writer.release_write(tier)
    # a lease of a process that died on this host is stale at once
    dead = TierLeases()
    dead.acquire_write(tier)
    stale = dead._lease("write", 3600.0)
    object.__setattr__(stale, "pid", 2**22 + 12345)  # no such process
    tier.put(dead.write_id, stale.encode(), overwrite=True)
    assert sweep(tier, sweeper).fenced is None
    assert list(tier.list()) == []
    tier.close()


# --- configuration and labels ---------------------------------------------------------------


def test_guarantees_round_trip_through_the_config_file(tmp_path: Path) -> None:
    policy = Policy(
        durability="process",
        migrated_durability="cluster",
        tiers={
            "a": TierPolicy(guarantee="best_effort"),
            "b": TierPolicy(mode="async"),
        },
    )
    path = tmp_path / "tiercheck.toml"
    cfg = tiercheck.store.config.StoreConfig((TierSpec("a", mem()), TierSpec("b", mem())), policy)
    save_config(path, cfg)
    text = path.read_text()
    assert 'durability = "process"' in text and 'guarantee = "best_effort"' in text
    back = load_config(path)
    assert back.policy == policy
    assert not back.policy.tiers["a"].required and not back.policy.tiers["b"].required
    assert TierPolicy().required and TierPolicy(mode="async", guarantee="required").required
    with pytest.raises(tiercheck.errors.ConfigError):
        TierPolicy(guarantee="always")  # type: ignore[arg-type]
    with pytest.raises(tiercheck.errors.ConfigError):
        Policy(durability="rack")  # type: ignore[arg-type]


def test_the_default_remote_tier_says_it_is_node_local(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tiercheck.cli.main import main

    root = tmp_path / "store"
    cfg = default_config(root)  # with its shm segment under tmp_path
    tiers = [
        replace(t, options={"root": str(tmp_path / "shm")}) if t.name == "shm" else t
        for t in cfg.tiers
    ]
    with Checkpointer(root, tiers=tiers, policy=cfg.policy) as ckpt:
        ckpt.save(0, state_of(0)).wait_migrated()
        slot = ckpt.tierset.get("remote")
        assert slot.policy is not None and slot.policy.mode == "async"  # still takes bases
    assert main(["ls", str(root), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    remote = {t["name"]: t for t in out["tiers"]}["remote"]
    assert remote["survives"] == "process"  # not "cluster": it is a directory on this node
    assert "reboot" in remote["survives_text"] and remote["persistent"]
    (v,) = out["versions"]
    assert v["survives"] == "process" and v["tiers"]["remote"] == "committed"
    assert main(["ls", str(root)]) == 0
    assert "node-local" in capsys.readouterr().out
