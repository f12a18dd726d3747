"""Fault scenarios, each a test: the fault-injection tier itself, corrupted blobs in each
tier, a remote tier that goes down, full disks and full /dev/shm, two writers on one root,
a diff whose base was collected, clock skew, and a store from a newer format version."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from crash_harness import bit_mismatch, check_store

from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.backends.base import Tier
from tiercheck.backends.registry import open_tier
from tiercheck.errors import (
    DurabilityError,
    FormatVersionError,
    NoRestorableVersion,
    StoreLocked,
    TierFull,
    TierUnavailable,
)
from tiercheck.formats.codecs import Codec, encode_blob
from tiercheck.formats.manifest import CommitRecord, VersionInfo, pack_record
from tiercheck.store.fetch import ChunkFetcher
from tiercheck.testing.conformance import TierConformance, blob, blob_id
from tiercheck.testing.faults import FaultPlan, FaultyTier, damage_bytes, inject
from tiercheck.upkeep.retention import drop_versions

CHUNK = 4096
EVERY = TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=None)


def state_of(step: int, n: int = 4096) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "step": step, "tag": f"s{step}"}


def policy(**tiers: TierPolicy) -> Policy:
    return Policy(base_every=3, chunk_size=CHUNK, gc_grace_seconds=0, tiers=tiers)


def assert_same(got: Any, want: Any) -> None:
    bad = bit_mismatch(got, want)
    assert bad is None, bad


# --- the wrapper ------------------------------------------------------------------------------


class TestFaultyTierConformance(TierConformance):  # type: ignore[misc,unused-ignore]
    """With an empty plan the wrapper is transparent: it passes the whole tier contract."""

    def make_tier(self, tmp_path: Path) -> Tier:
        return open_tier(f"faulty+lmdb://{tmp_path / 'lmdb'}")


def test_fault_plan_actions() -> None:
    plan = FaultPlan(seed=7)
    tier = FaultyTier(open_tier(f"memory://{uuid.uuid4().hex}"), plan)
    ids = [blob(100, i) for i in range(6)]
    fail = plan.fail("put", nth=2, error=TierFull)
    tier.put(*ids[0])
    with pytest.raises(TierFull):
        tier.put(*ids[1])
    tier.put(*ids[1])  # only the 2nd call failed
    plan.remove(fail)
    plan.lose("put", nth=tier.calls["put"] + 1)  # call numbers count from the tier's open
    assert tier.put(*ids[2]) and not tier.inner.has([ids[2][0]])  # reported, not done
    tier.put(*ids[2])
    assert tier.inner.has([ids[2][0]])
    plan.clear()
    plan.corrupt("get", nth=tier.calls["get"] + 1)
    assert bytes(tier.get(ids[0][0])) != ids[0][1]  # a damaged copy, once
    assert bytes(tier.get(ids[0][0])) == ids[0][1]  # the stored one is intact
    plan.truncate("put", nth=tier.calls["put"] + 1)
    tier.put(*ids[4])
    assert len(tier.inner.get(ids[4][0])) < 100
    plan.down()
    for op in (lambda: tier.get(ids[0][0]), tier.read_log, lambda: tier.append(b"r")):
        with pytest.raises(TierUnavailable):
            op()
    plan.up()
    tier.append(b"r")
    seen: list[str] = []
    plan.hook(lambda ev: seen.append(f"{ev.op}#{ev.call}"), "append", after=True)
    plan.latency(0.0, "append")
    tier.append(b"s")
    assert seen == [f"append#{tier.calls['append']}"]
    assert tier.read_log() == [b"r", b"s"]
    kinds = [e.action for e in plan.events]
    assert {"fail", "lose", "corrupt", "truncate", "hook", "latency"} <= set(kinds)


def test_fault_plan_by_url_is_seeded(tmp_path: Path) -> None:
    def run(seed: int) -> list[bool]:
        spec = [{"action": "corrupt", "op": "put", "count": "all", "probability": 0.5}]
        tier = open_tier(f"faulty+memory://{uuid.uuid4().hex}", faults=spec, seed=seed)
        out = []
        for i in range(32):
            bid, data = blob(64, i)
            tier.put(bid, data)
            out.append(bytes(tier.get(bid)) == data)
        return out

    assert run(1) == run(1) and run(1) != run(2)
    assert 0 < sum(run(1)) < 32


# --- corruption: detected, fallback, repaired -------------------------------------------------


def three_tiers(tmp_path: Path) -> Checkpointer:
    return Checkpointer(
        tmp_path / "s",
        tiers=[
            TierSpec("shm", f"shm://t{uuid.uuid4().hex[:10]}", {"root": str(tmp_path / "shm")}),
            TierSpec("lmdb", f"lmdb://{tmp_path / 'lmdb'}"),
            TierSpec("file", f"file://{tmp_path / 'file'}"),
        ],
        policy=policy(shm=EVERY, lmdb=EVERY, file=TierPolicy(versions="all", codec="zstd")),
    )


@pytest.mark.parametrize("how", ["corrupt", "truncate"])
@pytest.mark.parametrize("victim", ["shm", "lmdb", "file"])
def test_corrupt_blob_in_each_tier_detected_fallback_repaired(
    tmp_path: Path, victim: str, how: str
) -> None:
    import random

    ckpt = three_tiers(tmp_path)
    for step in range(2):
        ckpt.save(step, state_of(step)).wait()
        ckpt.flush()  # every tier takes each version (one still busy skips it: latest wins)
    info = ckpt.refresh().versions[1]
    slot = ckpt.tierset.get(victim)
    assert slot.tier is not None
    manifest = ChunkFetcher([slot]).manifest(info.shards[0])
    rng = random.Random(f"{victim}{how}")
    victims = [manifest.chunks[0].id, info.shards[0]]  # a chunk and the manifest itself
    for bid in victims:
        slot.tier.put(bid, damage_bytes(slot.tier.get(bid), how, rng), overwrite=True)  # type: ignore[arg-type,unused-ignore]
    assert any(victim in p for p in check_store(ckpt))  # detected
    others = [s for s in ckpt.tierset.by_speed() if s is not slot]
    fetcher = ChunkFetcher([slot, *others], repair=True)
    for bid in victims:
        _, source = fetcher.fetch(bid)  # falls back to an intact copy...
        assert source != victim
    assert sorted(fetcher.stats.corrupt) == sorted((victim, b) for b in victims)
    assert sorted(fetcher.stats.repaired) == sorted((victim, b) for b in victims)  # ...repairs
    assert check_store(ckpt) == []
    out = ckpt.restore(None, tiers=[victim])  # the repaired tier alone restores it exactly
    assert_same(out.state, state_of(1))
    ckpt.close()


def test_restore_repairs_the_fastest_tier(tmp_path: Path) -> None:
    ckpt = three_tiers(tmp_path)
    ckpt.save(0, state_of(0)).wait()
    shm = ckpt.tierset.get("shm").tier
    assert shm is not None
    manifest = ChunkFetcher(ckpt.tierset.by_speed()).manifest(ckpt.refresh().versions[0].shards[0])
    bad = manifest.chunks[1].id
    bad2 = manifest.chunks[2].id
    shm.put(bad, b"garbage", overwrite=True)
    header = bytearray(shm.get(bad2))
    header[4] ^= 0x40  # a flipped bit in the version byte reads as "format v65"
    shm.put(bad2, bytes(header), overwrite=True)
    info = ckpt.restore(None)  # falls back to LMDB for both, no FormatVersionError
    assert_same(info.state, state_of(0))
    assert ("shm", bad) in info.corrupt and ("shm", bad) in info.repaired
    assert info.chunks_from["lmdb"] == 2
    ckpt.gc()  # the copy with the odd version byte is left alone: verify reports it
    assert any(bad2 in p for p in check_store(ckpt))
    good = ChunkFetcher([ckpt.tierset.get("lmdb")]).fetch(bad2)[0]
    shm.put(bad2, encode_blob(good, Codec.RAW), overwrite=True)
    assert check_store(ckpt) == []
    assert check_store(ckpt) == []
    ckpt.close()


# --- a remote tier that goes down -------------------------------------------------------------


@pytest.mark.slow
def test_remote_down_during_saves_and_migration(
    tmp_path: Path, s3_server: Any, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    url, options = s3_bucket
    ckpt = Checkpointer(
        tmp_path / "s",
        tiers=[
            TierSpec("shm", f"shm://r{uuid.uuid4().hex[:10]}", {"root": str(tmp_path / "shm")}),
            TierSpec("s3sync", url + "-sync", {"storage_options": options}),
            TierSpec("s3", url, {"storage_options": options}),
        ],
        policy=policy(
            shm=EVERY,
            s3sync=TierPolicy(
                versions="all", mode="sync", codec="zstd", keep_bases=None, guarantee="best_effort"
            ),
            s3=TierPolicy(versions="base", mode="async", codec="zstd", keep_bases=None),
        ),
    )
    ckpt.save(0, state_of(0)).wait_migrated()
    with s3_server.down():
        results = [ckpt.save(step, state_of(step)).wait() for step in range(1, 5)]
        assert ckpt.wait_migrations(timeout=0) is False  # the base's migration is postponed
        assert [(v, t) for v, t, _ in ckpt.pending_migrations()] == [(3, "s3")]
    for r in results:  # every save committed, at a lower level
        assert r.committed_tiers == ("shm",)
        assert r.tiers["s3sync"] == "failed" and "TierUnavailable" in r.errors["s3sync"]
    assert [r.tiers["s3"] for r in results if r.role == "base"] == ["migrating"]
    assert ckpt.wait_migrations(timeout=120) is True  # retried by itself once the tier is back
    tiers = {v.id: v.tiers for v in ckpt.history()}
    assert tiers[3]["s3"] == "committed" and tiers[0]["s3"] == "committed"
    r5 = ckpt.save(5, state_of(5), role="base").wait()  # and saves reach the remote again
    assert r5.tiers["s3sync"] == "committed" and ckpt.refresh().logs["s3sync"].holds(5)
    for vid, step in ((3, 3), (0, 0)):
        assert_same(ckpt.restore(None, version=vid, tiers=["s3"]).state, state_of(step))
    assert_same(ckpt.restore(None).state, state_of(5))
    assert check_store(ckpt) == []
    ckpt.close()


def test_sync_tier_down_lowers_commit_level_then_recovers(tmp_path: Path) -> None:
    plan = FaultPlan()
    # a plan object cannot go into tiercheck.toml: wrap the opened tier instead
    ckpt = Checkpointer(
        tmp_path / "s",
        tiers=[
            TierSpec("a", f"memory://{uuid.uuid4().hex}"),
            TierSpec("b", f"lmdb://{tmp_path / 'lmdb'}"),
        ],
        policy=policy(a=EVERY, b=EVERY),
    )
    inject(ckpt, "b", plan)
    ckpt.save(0, state_of(0)).wait()
    plan.down()
    h = ckpt.save(1, state_of(1))
    with pytest.raises(DurabilityError, match="required tier b failed"):
        h.wait()  # b is synchronous, so required: the caller hears of it
    r = h.result_now()
    assert r.committed_tiers == ("a",) and r.tiers["b"] == "failed"
    assert_same(ckpt.restore(None).state, state_of(1))  # committed, from a
    plan.up()
    r = ckpt.save(2, state_of(2)).wait()
    assert r.committed_tiers == ("a", "b")
    assert_same(ckpt.restore(None, tiers=["b"]).state, state_of(2))
    ckpt.close()


# --- full disks -------------------------------------------------------------------------------


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "2m") -> Iterator[bool]:
    """Mount a ``size`` tmpfs at ``path`` if this process may; yields whether it did."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        yield False
        return
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    if res.returncode != 0:
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill_until_full(ckpt: Checkpointer, victim: str, first_step: int) -> tuple[int, str]:
    """Save ever bigger states until ``victim`` reports full; return (last good step, error).

    A memory tier (shm) is bounded by its default budget before the file system fills: it
    is then skipped for the version, which wait() does not raise (a budget skip is no
    failure; docs/concepts.md, "Guarantees")."""
    for step in range(first_step, first_step + 40):
        h = ckpt.save(step, state_of(step, n=64 * 1024 * (step - first_step + 1)))
        try:
            r = h.wait()
        except DurabilityError as exc:  # the full tier is required: wait() says so
            r = h.result_now()
            assert r.tiers.get(victim) == "failed" and exc.failed.keys() == {victim}
            return step, r.errors[victim]
        if r.tiers.get(victim) == "missing" and "latest wins" not in r.errors[victim]:
            # (a tier still writing an earlier version skips this one: not a full tier)
            return step, r.errors[victim]
    raise AssertionError(f"tier {victim} never filled up")


@pytest.mark.parametrize("kind", ["file-tmpfs", "lmdb-max-size", "shm-tmpfs"])
def test_disk_full_is_typed_and_the_store_stays_readable(tmp_path: Path, kind: str) -> None:
    mnt = tmp_path / "small"
    with small_tmpfs(mnt) as mounted:
        if kind == "file-tmpfs":
            if not mounted:
                pytest.skip("cannot mount a tmpfs here (the LMDB max_size case covers it)")
            spec = TierSpec("full", f"file://{mnt / 'remote'}")
        elif kind == "shm-tmpfs":
            if not mounted:
                pytest.skip("cannot mount a small tmpfs for the shm root")
            spec = TierSpec("full", f"shm://full{uuid.uuid4().hex[:8]}", {"root": str(mnt)})
        else:
            spec = TierSpec("full", f"lmdb://{tmp_path / 'lmdb'}", {"max_size": 2 << 20})
        ckpt = Checkpointer(
            tmp_path / "s",
            tiers=[TierSpec("mem", f"memory://{uuid.uuid4().hex}"), spec],
            policy=policy(mem=EVERY, full=EVERY),
        )
        ckpt.save(0, state_of(0)).wait()
        step, error = fill_until_full(ckpt, "full", 1)
        # OverBudget is a TierFull; a memory tier is skipped for its budget before that
        assert error.startswith(("TierFull", "OverBudget")) or "budget" in error, error
        full = ckpt.tierset.get("full").tier
        assert full is not None
        big = os.urandom(4 << 20)
        with pytest.raises(TierFull):  # the tier's own error is typed too
            full.put(blob_id(big), encode_blob(big, Codec.RAW))
        # the store stays readable: every version the full tier committed is intact
        held = ckpt.refresh().logs["full"].held()
        assert step not in held and held
        assert 0 in held or "budget" in error  # making room for a budget drops old versions
        for vid in held:
            info = ckpt.restore(None, version=vid, tiers=["full"])
            n = 64 * 1024 * info.step if info.step else 4096
            assert_same(info.state, state_of(info.step, n=n))
        assert_same(ckpt.restore(None).state, state_of(step, n=64 * 1024 * step))
        assert [p for p in check_store(ckpt) if "full" in p] == []
        ckpt.close(wait_migrations=False)


# --- two writers ------------------------------------------------------------------------------


def _python(code: str, **kw: Any) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **kw,
    )


def test_second_writer_process_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "s"
    tiers = [TierSpec("lmdb", f"lmdb://{tmp_path / 'lmdb'}")]
    Checkpointer(root, tiers=tiers, policy=policy(lmdb=EVERY)).close()
    holder = _python(
        f"""
        import sys, torch
        from tiercheck import Checkpointer
        ckpt = Checkpointer({str(root)!r})
        ckpt.save(0, {{"w": torch.ones(3)}}).wait()
        print("READY", flush=True)
        sys.stdin.readline()
        ckpt.save(1, {{"w": torch.ones(3) * 2}}).wait()
        ckpt.close()
        print("DONE", flush=True)
        """
    )
    assert holder.stdout is not None and holder.stdin is not None
    try:
        assert holder.stdout.readline().strip() == "READY", holder.stderr
        with pytest.raises(StoreLocked):
            Checkpointer(root)
        with Checkpointer(root, read_only=True) as reader:  # inspection still works
            assert reader.restore(None).step == 0
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "DONE"
    finally:
        holder.kill() if holder.poll() is None else None
        holder.wait()
    with Checkpointer(root) as ckpt:  # the lock went with the process
        tl = ckpt.refresh().logs["lmdb"]
        assert tl.held() == [0, 1] and tl.corrupt == 0
        assert torch.equal(ckpt.restore(None).state["w"], torch.ones(3) * 2)


# --- a diff whose base was collected ----------------------------------------------------------


def test_diff_whose_base_was_collected_is_never_offered(tmp_path: Path) -> None:
    ckpt = Checkpointer(
        tmp_path / "s", tiers=[("m", f"memory://{uuid.uuid4().hex}")], policy=policy(m=EVERY)
    )
    for step in range(3):  # v0 base, v1 and v2 diffs of it
        ckpt.save(step, state_of(step)).wait()
    drop_versions(ckpt.tierset.get("m"), [0])
    ckpt.gc()
    catalog = ckpt.refresh()
    assert catalog.logs["m"].held() == [1, 2] and catalog.restorable_versions() == []
    assert {v.id: v.restorable for v in ckpt.history()}.get(2) in (False, None)
    with pytest.raises(NoRestorableVersion):
        ckpt.restore(None)
    with pytest.raises(NoRestorableVersion):
        ckpt.restore(None, version=2)
    ckpt.save(3, state_of(3)).wait()  # a new base is restorable again
    assert ckpt.restore(None).version == 3
    ckpt.close()


# --- clock skew -------------------------------------------------------------------------------


@pytest.mark.parametrize("skew", [-3600, 3600])
def test_newest_version_is_by_id_not_clock(tmp_path: Path, skew: int) -> None:
    root = tmp_path / "s"
    tiers = [TierSpec("lmdb", f"lmdb://{tmp_path / 'lmdb'}")]
    with Checkpointer(root, tiers=tiers, policy=policy(lmdb=EVERY)) as ckpt:
        ckpt.save(0, state_of(0)).wait()
    writer = _python(
        f"""
        import time
        real = time.time
        time.time = lambda: real() + {skew}  # this writer's clock is off by an hour
        from tiercheck import Checkpointer
        from test_faults import state_of
        with Checkpointer({str(root)!r}) as ckpt:
            ckpt.save(1, state_of(1)).wait()
        """
    )
    _, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err
    with Checkpointer(root) as ckpt:
        ckpt.save(2, state_of(2)).wait()  # and a writer with the right clock after it
        times = {v.id: v.time for v in ckpt.history()}
        assert (times[1] < times[0]) == (skew < 0)
        assert ckpt.restore(None).version == 2
        ckpt.close()
    with Checkpointer(root, read_only=True) as reader:
        assert reader.restore(None, version=1).step == 1


# --- a newer format ---------------------------------------------------------------------------


def test_store_from_a_newer_format_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "s"
    tiers = [TierSpec("lmdb", f"lmdb://{tmp_path / 'lmdb'}")]
    with Checkpointer(root, tiers=tiers, policy=policy(lmdb=EVERY)) as ckpt:
        ckpt.save(0, state_of(0)).wait()
        info = ckpt.refresh().versions[0]
    lmdb = open_tier(f"lmdb://{tmp_path / 'lmdb'}")
    # a log record of format v2
    rec = msgpack.unpackb(pack_record(CommitRecord(_bump(info))), raw=False)
    rec["v"] = [2, 0]
    lmdb.append(msgpack.packb(rec, use_bin_type=True))
    lmdb.close()
    with pytest.raises(FormatVersionError, match="upgrade"):
        Checkpointer(root, read_only=True)
    # a blob of format v2 (header byte 4 is the major version)
    tmp2 = tmp_path / "b"
    with Checkpointer(tmp2, tiers=[("m", f"lmdb://{tmp2 / 'lmdb'}")], policy=policy(m=EVERY)) as c:
        c.save(0, state_of(0)).wait()
        tier = c.tierset.get("m").tier
        assert tier is not None
        mid = c.refresh().versions[0].shards[0]
        cid = ChunkFetcher([c.tierset.get("m")]).manifest(mid).chunks[0].id
        data = bytearray(tier.get(cid))
        data[4] = 2
        tier.put(cid, bytes(data), overwrite=True)
        with pytest.raises(FormatVersionError, match="upgrade"):
            c.restore(None)


def _bump(info: VersionInfo) -> VersionInfo:
    return VersionInfo(
        id=info.id + 1,
        step=info.step + 1,
        role=info.role,
        base=info.base,
        world_size=info.world_size,
        shards=info.shards,
        time=info.time,
        logical_bytes=info.logical_bytes,
        metadata=info.metadata,
    )
