"""Nothing acknowledged is lost (docs/concepts.md, "Guarantees"; issue 21).

A version acknowledged by ``wait()`` stays restorable from the tiers that acknowledged it
until a newer version is committed at the same or stronger durability: budgets, retention,
GC and compaction never drop a tier's newest restorable version, or what it needs, first.

Everything here runs the default store (shm in /dev/shm, LMDB, a ``file://`` remote, the
default memory budgets): the path users run. The crash test kills a real trainer process
with SIGKILL at the moment the old code lost an acknowledged version (right after making
room in shm for the next version, before that version commits).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import torch
from _dense import STATE_NUMEL, state_at

from tiercheck import Checkpointer
from tiercheck.backends.base import Capabilities, FailureDomain
from tiercheck.formats.manifest import Role, VersionInfo
from tiercheck.store.catalog import Catalog, TierLog
from tiercheck.upkeep.retention import plan_drops, protection

_TRAINER = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    import tiercheck.upkeep.maintenance as maintenance
    from tiercheck import Checkpointer
    sys.path.insert(0, {tests!r})
    from _dense import state_at

    root, kill_at = sys.argv[1], int(sys.argv[2])
    original = maintenance.Maintenance._make_room

    def make_room_then_die(self, slot, needed):
        out = original(self, slot, needed)
        if step == kill_at:  # room made for this step's version, not committed yet
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    maintenance.Maintenance._make_room = make_room_then_die
    ckpt = Checkpointer(root)
    for step in range(1, kill_at + 1):
        ckpt.save(step, state_at(step)).wait()
        print("ACK", step, flush=True)
    """
)


def test_a_kill_after_making_room_loses_no_acknowledged_version(tmp_path: Path) -> None:
    """Dense training on the default store, SIGKILLed right after shm made room for step 4
    (base 1, diffs 2 and 3 acknowledged). The old code made that room by dropping diff 3,
    the newest acknowledged version: the restart restored step 1."""
    root = tmp_path / "store"
    proc = subprocess.run(
        [sys.executable, "-c", _TRAINER.format(tests=str(Path(__file__).parent)), str(root), "4"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == -9, proc.stderr
    acks = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("ACK")]
    assert acks == [1, 2, 3]
    ckpt = Checkpointer(root)
    try:
        out = {"w": torch.empty(STATE_NUMEL), "step": torch.tensor(0)}
        info = ckpt.restore(out)
        assert info.step == 3
        expected = state_at(3)
        assert torch.equal(out["w"], expected["w"]) and int(out["step"]) == 3
    finally:
        ckpt.destroy()


def test_dense_training_keeps_every_diff_in_shm_within_the_default_budget(
    tmp_path: Path,
) -> None:
    """The rule costs no memory: to fit the next diff, shm lets go of the base (LMDB keeps
    it), never of the newest diff; every version still commits in shm."""
    ckpt = Checkpointer(tmp_path / "store")
    try:
        for step in range(1, 13):
            res = ckpt.save(step, state_at(step)).wait()
            assert res.tiers["shm"] == "committed", res.errors
            ckpt.flush()
            shm = ckpt.refresh().logs["shm"]
            assert max(shm.held()) == res.version  # the newest is always there
    finally:
        ckpt.destroy()


# --- the rule itself, on catalogs written by hand -----------------------------------------

SHM = Capabilities(FailureDomain.PROCESS, shared=False, persistent=False, speed_rank=10)
LMDB = Capabilities(FailureDomain.PROCESS, shared=False, persistent=True, speed_rank=30)
REMOTE = Capabilities(FailureDomain.CLUSTER, shared=True, persistent=True, speed_rank=50)
CAPS = {"shm": SHM, "lmdb": LMDB, "remote": REMOTE}


def _info(v: int, role: Role = "base", base: int | None = None) -> VersionInfo:
    return VersionInfo(
        id=v, step=v, role=role, base=base, world_size=1, shards=("m",), time=0.0, logical_bytes=1
    )


def _catalog(held: dict[str, list[VersionInfo]]) -> Catalog:
    logs = {}
    for name, infos in held.items():
        tl = TierLog(name)
        tl.committed = {i.id: i for i in infos}
        logs[name] = tl
    return Catalog(logs, {})


def test_the_newest_diff_is_kept_and_its_base_may_go_where_lmdb_keeps_it() -> None:
    b, d1 = _info(1), _info(2, "diff", 1)
    cat = _catalog({"shm": [b, d1], "lmdb": [b]})
    p = protection(cat, "shm", CAPS)
    assert p.keep == {2} and p.elsewhere == {1}
    assert protection(cat, "lmdb", CAPS).keep == {1}  # LMDB keeps what shm's newest needs
    from tiercheck.store.policy import TierPolicy

    tight = TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=1, keep_diffs=0)
    assert plan_drops(cat.logs["shm"], tight, (), p) == []
    assert plan_drops(cat.logs["shm"], tight, {1}, p, last_resort=True) == [1]
    assert plan_drops(cat.logs["shm"], replace(tight, keep_diffs=0), (), p) == []


def test_making_room_as_a_last_resort_lets_go_of_an_old_base_nothing_needs() -> None:
    """shm holds base 1 and diff 3 of base 2 (base 2 went to LMDB only): the tightest
    policy keeps base 1 as shm's newest base, the last resort drops it (seen in a SIGKILL
    run: every other dense diff then skipped shm)."""
    from tiercheck.store.policy import TierPolicy

    b1, b2, d3 = _info(1), _info(2), _info(3, "diff", 2)
    cat = _catalog({"shm": [b1, d3], "lmdb": [b1, b2]})
    p = protection(cat, "shm", CAPS)
    assert p.keep == {3}
    tight = TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=1, keep_diffs=0)
    assert plan_drops(cat.logs["shm"], tight, (), p) == []
    assert plan_drops(cat.logs["shm"], tight, (), p, last_resort=True) == [1]


def test_a_tier_lets_go_once_a_newer_version_is_as_safe_elsewhere() -> None:
    b, d1, d2 = _info(1), _info(2, "diff", 1), _info(3, "diff", 1)
    # diff 3 went to LMDB (shm had no room): shm's diff 2 is superseded
    cat = _catalog({"shm": [b, d1], "lmdb": [b, d2]})
    assert protection(cat, "shm", CAPS).keep == frozenset()
    # a newer version in shm does not supersede LMDB's newest: shm is not as durable
    cat = _catalog({"shm": [b, d1, _info(4, "diff", 1)], "lmdb": [b, d2]})
    assert 3 in protection(cat, "lmdb", CAPS).keep


def test_a_version_whose_base_is_gone_is_not_what_a_tier_keeps() -> None:
    cat = _catalog({"shm": [_info(2, "diff", 1)], "lmdb": [_info(3)]})
    assert protection(cat, "shm", CAPS).keep == frozenset()  # not restorable: nothing to keep
