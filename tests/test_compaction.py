"""Log compaction: a checkpoint record stands for the records before it, so reading a log
costs O(versions kept); compaction is atomic on every tier and survives SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import torch

from tiercheck import Checkpointer, Policy, TierPolicy
from tiercheck.backends import open_tier
from tiercheck.backends.base import Tier
from tiercheck.formats.manifest import (
    AbortRecord,
    CheckpointRecord,
    CommitRecord,
    DropRecord,
    PrepareRecord,
    VersionInfo,
    pack_record,
    unpack_record,
)
from tiercheck.store.catalog import (
    append_record,
    compact_log,
    read_catalog,
    read_tier_log,
    should_compact,
)

KEEP = 12  # versions a tier keeps in these logs


def _info(v: int) -> VersionInfo:
    role = "base" if v % 10 == 0 else "diff"
    return VersionInfo(
        v, v * 10, role, None if role == "base" else v - v % 10, 1, (f"{v:064x}",), 1.0, 100
    )


def _prepare(v: int, deltas: dict[str, str] | None = None) -> PrepareRecord:
    info = _info(v)
    return PrepareRecord(
        v, 0, info.step, info.role, info.base, f"{v:064x}", 1, 100, 1.0, deltas or {}
    )


def _write_history(tier: Tier, versions: int, first: int = 0) -> None:
    """``versions`` saves: prepare + commit each, the tier keeping the newest ``KEEP``."""
    for v in range(first, first + versions):
        append_record(tier, _prepare(v))
        append_record(tier, CommitRecord(_info(v)))
        if v - KEEP >= 0:
            append_record(tier, DropRecord(v - KEEP, 2.0))


def test_10000_versions_read_in_o_kept_records() -> None:
    tier = open_tier("memory://")
    _write_history(tier, 10_000)
    before = read_tier_log("mem", tier)
    assert before.records == 3 * 10_000 - KEEP  # every record ever appended is read
    assert should_compact(before)
    report = compact_log("mem", tier)
    assert (report.before, report.after, report.skipped) == (before.records, 1, None)
    after = read_tier_log("mem", tier)
    assert after.records == 1  # one checkpoint record, whatever the history
    assert after.held() == before.held() == list(range(10_000 - KEEP, 10_000))
    assert {v: after.committed[v] for v in after.held()} == {
        v: before.committed[v] for v in before.held()
    }
    assert after.prepared == {v: before.prepared[v] for v in before.held()}
    assert after.max_version_id() == 9_999
    # a checkpoint holds the kept versions only: its size does not grow with history
    ckpt = pack_record(after.checkpoint())
    assert len(ckpt) < 500 * KEEP
    # more saves, then the next compaction folds the checkpoint in as well
    _write_history(tier, 100, first=10_000)
    assert read_tier_log("mem", tier).records == 1 + 300
    compact_log("mem", tier)
    again = read_tier_log("mem", tier)
    assert again.records == 1 and again.held() == list(range(10_100 - KEEP, 10_100))


def test_fsspec_reads_one_object_per_kept_record(tmp_path: Path) -> None:
    tier = open_tier(f"file://{tmp_path}/remote")
    _write_history(tier, 40)
    log_dir = tmp_path / "remote" / "log"
    assert len(os.listdir(log_dir)) == 3 * 40 - KEEP  # one GET each, before
    compact_log("remote", tier)
    assert os.listdir(log_dir) == [f"{3 * 40 - KEEP - 1:016d}.ckpt"]
    _write_history(tier, 5, first=40)
    names = sorted(os.listdir(log_dir))
    assert len(names) == 1 + 15  # the checkpoint and what came after it: 16 GETs to read
    fresh = open_tier(f"file://{tmp_path}/remote")
    tl = read_tier_log("remote", fresh)
    assert tl.records == 16 and tl.held() == list(range(45 - KEEP, 45))


def test_fsspec_readers_tolerate_a_compaction_cut_short(tmp_path: Path) -> None:
    """Crashed between writing the checkpoint and deleting what it replaced: readers use
    the checkpoint and skip the older objects; appends continue after both."""
    tier = open_tier(f"file://{tmp_path}/remote")
    _write_history(tier, 30)
    whole = read_tier_log("remote", tier)
    log_dir = tmp_path / "remote" / "log"
    old = {name: (log_dir / name).read_bytes() for name in os.listdir(log_dir)}
    compact_log("remote", tier)
    for name, data in old.items():  # as if the deletes never happened
        (log_dir / name).write_bytes(data)
    reader = open_tier(f"file://{tmp_path}/remote", read_only=True)
    tl = read_tier_log("remote", reader)
    assert tl.records == 1 and tl.held() == whole.held()
    writer = open_tier(f"file://{tmp_path}/remote")
    append_record(writer, AbortRecord(999, "test"))
    assert read_tier_log("remote", writer).records == 2


def test_undecided_and_delta_information_survives() -> None:
    tier = open_tier("memory://")
    _write_history(tier, 40)
    base = f"{7:064x}"
    append_record(tier, _prepare(40))
    append_record(tier, AbortRecord(40, "a rank failed"))
    append_record(tier, _prepare(41, {f"{1:064x}": base}))  # in flight: no decision yet
    append_record(tier, _prepare(15))  # older than a decision: presumed aborted
    compact_log("mem", tier)
    tl = read_tier_log("mem", tier)
    assert tl.records == 1
    assert sorted(tl.prepared) == [*range(40 - KEEP, 40), 41]
    assert tl.deltas == {f"{1:064x}": base} and tl.may_hold_deltas
    assert tl.max_version_id() == 41
    # the in-flight version commits after the compaction
    append_record(tier, CommitRecord(_info(41)))
    assert 41 in read_tier_log("mem", tier).held()


def test_checkpoint_record_round_trip() -> None:
    rec = CheckpointRecord(
        committed=(_info(3), _info(4)),
        prepared=(_prepare(3), _prepare(4, {f"{1:064x}": f"{2:064x}"})),
        max_version=9,
        delta_blobs=True,
        records=123,
        time=5.0,
    )
    assert unpack_record(pack_record(rec)) == rec


def test_a_record_of_a_newer_minor_schema_is_never_compacted_away() -> None:
    tier = open_tier("memory://")
    _write_history(tier, 100)
    newer = msgpack.packb({"type": "future", "x": 1, "v": [1, 99]}, use_bin_type=True)
    tier.append(newer)
    report = compact_log("mem", tier)
    assert report.skipped is not None and "v1.99" in report.skipped
    assert len(tier.read_log()) == 3 * 100 - KEEP + 1


def test_a_tier_without_compaction_keeps_its_log(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent / "backends"))
    try:
        from example_tier import SqliteTier
    finally:
        sys.path.pop(0)
    tier = SqliteTier(f"sqlite://{tmp_path}/t.db")
    _write_history(tier, 20)
    report = compact_log("dir", tier)
    assert report.skipped == "not supported"
    assert read_tier_log("dir", tier).records == 3 * 20 - KEEP


def test_store_restores_after_compaction(tmp_path: Path) -> None:
    """Compacting every tier of a real store (the engine does it after retention) keeps
    restore, history and version ids as they were."""
    keep = TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=2)
    policy = Policy(base_every=3, chunk_size=1 << 16, tiers={"mem": keep, "lmdb": keep})
    tiers = [("mem", f"memory://compaction-{tmp_path.name}"), ("lmdb", f"lmdb://{tmp_path}/lmdb")]
    state = {"w": torch.zeros(10_000)}
    with Checkpointer(tmp_path / "store", tiers=tiers, policy=policy) as ckpt:
        for step in range(1, 16):
            state["w"] += 1
            ckpt.save(step, state).wait()
        ckpt.flush()  # the engine's own retention and compaction are done (not mid-way)

        # versions every tier dropped leave the history with the records that named them;
        # a tier that dropped a version another still holds shows it "missing" once its
        # log is compacted (the checkpoint record names only what the tier holds): whether
        # the engine compacted that tier before this line is a matter of timing
        def seen() -> list[tuple[int, int, dict[str, str]]]:
            return [
                (v.id, v.step, {t: "missing" if s == "dropped" else s for t, s in v.tiers.items()})
                for v in ckpt.history()
                if v.holders
            ]

        history = seen()
        for slot in ckpt.tierset.open():
            assert slot.tier is not None
            report = compact_log(slot.name, slot.tier)
            assert report.skipped is None and report.after == 1, report
        catalog = ckpt.refresh()
        assert all(tl.records == 1 for tl in catalog.logs.values())
        assert seen() == history
        target = {"w": torch.empty(10_000)}
        info = ckpt.restore(target)
        assert info.step == 15 and torch.equal(target["w"], state["w"])
        h = ckpt.save(16, state)
        assert h.wait().version == 15  # ids continue after the compacted ones
    from tiercheck.backends._memory import MemoryTier

    MemoryTier.discard(f"compaction-{tmp_path.name}")


# --- SIGKILL during compaction -------------------------------------------------------

CHILD = r"""
import json, sys
from tiercheck.backends.registry import open_tier
from tiercheck.formats.manifest import AbortRecord
from tiercheck.store.catalog import append_record, compact_log

url, options = json.loads(sys.argv[1])
tier = open_tier(url, **options)
print("ready", flush=True)
for i in range(100_000):  # the parent kills the child long before this ends
    append_record(tier, AbortRecord(10_000 + i, "filler"))  # changes nothing held
    print("c", i, flush=True)
    compact_log("t", tier)
    print("d", i, flush=True)
"""

CRASH_TIERS = {
    "shm": lambda work: ("shm://compact", {"root": str(work / "shm")}),
    "lmdb": lambda work: (f"lmdb://{work}/lmdb", {}),
    "file": lambda work: (f"file://{work}/fsspec", {}),
}


@pytest.mark.parametrize("name", sorted(CRASH_TIERS))
def test_sigkill_during_compaction_keeps_the_committed_state(name: str, tmp_path: Path) -> None:
    url, options = CRASH_TIERS[name](tmp_path)
    tier = open_tier(url, **options)
    _write_history(tier, 40)
    expected = read_tier_log("t", tier)
    tier.close()
    for kill_after in (0, 2, 5):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps([url, options])],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None
            lines = iter(child.stdout.readline, "")
            assert next(lines).strip() == "ready"
            for line in lines:  # kill right after "c N": in the middle of compaction N
                if line.split() == ["c", str(kill_after)]:
                    child.send_signal(signal.SIGKILL)
                    break
        finally:
            child.kill()
            child.wait()
            if child.stdout is not None:
                child.stdout.close()
        again = open_tier(url, **options)  # a writable open recovers what the kill left
        catalog = read_catalog({"t": again})
        tl = catalog.logs["t"]
        assert tl.held() == expected.held(), f"{name}: kill after c {kill_after}"
        assert {v: tl.committed[v] for v in tl.held()} == {
            v: expected.committed[v] for v in expected.held()
        }
        assert tl.max_version_id() >= expected.max_version_id()
        assert tl.corrupt == 0
        append_record(again, AbortRecord(99_999, "after the crash"))  # appends still work
        assert read_tier_log("t", again).held() == expected.held()
        again.close()
