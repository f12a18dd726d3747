"""A finished DCP checkpoint stays restorable on every rank until a newer one is finished.

Under DCP each rank saves its shard as a version of its own store, and the coordinator
finishes the checkpoint after every rank has committed. A rank's base of the next
checkpoint lets its store's retention go of the diffs before it (the default shm tier keeps
the newest base and its diffs), so without a hold the rank's shard of the newest finished
checkpoint was gone before the coordinator recorded the new one: a job killed in between
resumed from an older checkpoint. The coordinator now has each rank hold its shard of the
newest finished checkpoint (``Checkpointer.hold``), recorded with the rank's next shard so
that a restarted job holds it too, until a newer checkpoint is finished.

The runs are real: ``torchrun`` with 2 ranks on gloo and loopback, the default stores (shm
and LMDB), the coordinator SIGKILLed as ``finish`` begins.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import _dist
import pytest
import torch
from _dist import free_port
from _snippets import destroy_stores

from tiercheck import Checkpointer, Policy, TierPolicy
from tiercheck.engine.coordinator import LocalCoordinator
from tiercheck.integrations.dcp import load_full_state_dict, rank_root

SCRIPTS = Path(__file__).with_name("dist_scripts")
sys.path.insert(0, str(SCRIPTS))
from dcp_hold_worker import rank_state  # noqa: E402


def torchrun(root: Path, last: int, kill: int | None = None) -> subprocess.CompletedProcess[str]:
    """One job on ``root``: resume, save up to step ``last``, the coordinator killed in
    the ``finish`` of step ``kill``."""
    args = [str(root), str(last), *([] if kill is None else [str(kill)])]
    # torchrun's agent makes a log directory per launch, in /tmp unless told
    logs = ["--log-dir", str(root.parent / "torchrun-logs")]
    proc = _dist.torchrun(
        SCRIPTS / "dcp_hold_worker.py",
        *args,
        rendezvous=["--master-addr", "127.0.0.1", "--master-port", str(free_port()), *logs],
        env={"GLOO_SOCKET_IFNAME": "lo"},
        timeout=120,
    )
    out = proc.stdout[-3000:] + proc.stderr[-5000:]
    if kill is None:
        assert proc.returncode == 0, out
    else:
        assert proc.returncode != 0, out
        assert "Signal 9" in proc.stderr or "SIGKILL" in proc.stderr, out
    return proc


def shards(root: Path, rank: int) -> dict[int, tuple[int, bool]]:
    """Rank ``rank``'s versions: id -> (step, restorable)."""
    with Checkpointer(
        rank_root(root, rank), read_only=True, coordinator=LocalCoordinator()
    ) as ckpt:
        return {v.id: (v.step, v.restorable) for v in ckpt.history()}


def restorable_steps(root: Path, rank: int) -> list[int]:
    return sorted(step for step, ok in shards(root, rank).values() if ok)


def loads_step(root: Path, step: int, caplog: pytest.LogCaptureFixture) -> None:
    """The newest checkpoint every rank restores is ``step``, found without skipping one."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tiercheck.integrations.dcp.reader"):
        sd = load_full_state_dict(root)
    assert [r.getMessage() for r in caplog.records] == []
    for rank in (0, 1):
        assert torch.equal(sd[f"w{rank}"], rank_state(rank, step)[f"w{rank}"]), (rank, step)


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    try:
        yield tmp_path / "ckpt"
    finally:
        destroy_stores(tmp_path)


@pytest.mark.slow
def test_a_coordinator_killed_in_finish_leaves_the_newest_finished_checkpoint(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # steps 1..3 finished; every rank committed step 4 (a base), then the coordinator died
    torchrun(root, 4, kill=4)
    assert restorable_steps(root, 0) == [1, 2, 3]
    # rank 1's base of step 4 would have let go of its diffs of steps 2 and 3 in shm
    # (LMDB keeps bases only): its shard of step 3 is held, step 2's is not
    assert restorable_steps(root, 1) == [1, 3, 4]
    loads_step(root, 3, caplog)


@pytest.mark.slow
def test_the_hold_outlives_a_restart_and_goes_once_a_newer_checkpoint_is_finished(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torchrun(root, 4, kill=4)
    # the restarted job resumes from step 3; opening rank 1's store for its save must not
    # let step 3's shard go, and the coordinator dies in finish again
    again = torchrun(root, 4, kill=4)
    assert "rank 0: loaded step 3" in again.stdout and "rank 1: loaded step 3" in again.stdout
    loads_step(root, 3, caplog)
    # the next job finishes steps 4 and 5: rank 1 then holds its shard of step 4 (the
    # newest finished when step 5 was planned), and lets go of step 3's
    done = torchrun(root, 5)
    assert "rank 0: loaded step 3" in done.stdout and "rank 1: loaded step 3" in done.stdout
    loads_step(root, 5, caplog)
    assert 3 not in restorable_steps(root, 1)
    assert restorable_steps(root, 1)[-2:] == [4, 5]


def test_hold_keeps_versions_from_retention_until_replaced(tmp_path: Path) -> None:
    lmdb = TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=1)
    with Checkpointer(
        tmp_path / "store",
        tiers=[("lmdb", f"lmdb://{tmp_path}/lmdb")],
        policy=Policy(base_every=2, tiers={"lmdb": lmdb}),
    ) as ckpt:

        def save(step: int) -> int:
            handle = ckpt.save(step, {"w": torch.full((8,), float(step))})
            handle.wait()
            ckpt.flush()
            return handle.version

        first, held = save(0), save(1)  # a base and its diff
        ckpt.hold([held])
        save(2)  # a base: retention would let the first two go
        kept = {v.id for v in ckpt.history() if v.restorable}
        assert {first, held} <= kept
        ckpt.restore(state := {"w": torch.zeros(8)}, version=held)
        assert torch.equal(state["w"], torch.full((8,), 1.0))
        ckpt.hold([])
        newest = save(3)
        assert {v.id for v in ckpt.history() if v.restorable} == {newest - 1, newest}


def test_a_held_diff_keeps_its_base_in_the_tier_that_holds_only_the_base(
    tmp_path: Path,
) -> None:
    """A held diff that a memory tier holds keeps its base in the disk tier too (found by
    new-user testing with the default stores: shm let the base go under its budget, LMDB,
    which holds no diffs, dropped it for a newer base, and the held diff, the rank's shard
    of the newest finished checkpoint, could not be restored). The engine's pinned
    versions name their bases, whatever tier holds what."""
    fast = TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=1)
    disk = TierPolicy(versions="base", mode="sync", codec="raw", keep_bases=1)
    with Checkpointer(
        tmp_path / "store",
        tiers=[("fast", f"memory://{tmp_path.name}-hold"), ("disk", f"lmdb://{tmp_path}/lmdb")],
        policy=Policy(base_every=2, tiers={"fast": fast, "disk": disk}),
    ) as ckpt:
        base = ckpt.save(0, {"w": torch.full((8,), 0.0)}).wait().version
        held = ckpt.save(1, {"w": torch.full((8,), 1.0)}).wait().version
        ckpt.hold([held])
        assert base in ckpt._engine.pinned()
        ckpt.save(2, {"w": torch.full((8,), 2.0)}).wait()  # a base: disk keeps one base
        ckpt.flush()
        tiers = {v.id: dict(v.tiers) for v in ckpt.history()}
        assert tiers[base]["disk"] == "committed", tiers


@pytest.mark.slow
def test_a_failed_saves_checkpoint_id_does_not_name_the_next_save(root: Path) -> None:
    """DCP resets a writer only for a save given a ``checkpoint_id``: the id of a save
    that failed before ``finish`` (step 4 named 100) stayed, and the next two saves,
    given none, were recorded as steps 100 and 101 (found by new-user testing)."""
    logs = ["--log-dir", str(root.parent / "torchrun-logs")]
    proc = _dist.torchrun(
        SCRIPTS / "dcp_failed_id_worker.py",
        str(root),
        rendezvous=["--master-addr", "127.0.0.1", "--master-port", str(free_port()), *logs],
        env={"GLOO_SOCKET_IFNAME": "lo"},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "steps [1, 2, 3, 4, 5]" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.slow
def test_a_rank_whose_shm_a_reboot_emptied_loads_the_newest_checkpoint_it_still_holds(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only rank 1's shm segment is gone (its node rebooted): its diffs of steps 2, 3 and
    5 are lost, its bases of steps 1 and 4 are in LMDB. A load skips the checkpoint of
    step 5 and goes to step 4, every rank's; it raised NoRestorableVersion, since a rank
    store with a tier that did not open was not judged (found by new-user testing)."""
    torchrun(root, 5)
    with Checkpointer(rank_root(root, 1), read_only=True, coordinator=LocalCoordinator()) as ckpt:
        shm = ckpt.tierset.get("shm").tier
        assert shm is not None
        segment = Path(shm.path)  # type: ignore[attr-defined]
    shutil.rmtree(segment)
    with caplog.at_level(logging.WARNING, logger="tiercheck.integrations.dcp.reader"):
        sd = load_full_state_dict(root)
    for rank in (0, 1):
        assert torch.equal(sd[f"w{rank}"], rank_state(rank, 4)[f"w{rank}"]), rank
    assert "rank 1's shard" in caplog.text
