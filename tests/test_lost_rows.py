"""Lost versions stay reported: a version acknowledged in shm only and lost with it (a
reboot) is still listed as lost, by ``history()``, ``tiercheck ls`` and ``show``, after a
newer version is committed (it vanished from both, and ``show`` said "dropped by
retention"), until the store keeps no version older than it; and a loss on another rank of
a multi-rank store shows in rank 0's view (it was not listed there at all).

Real tiers (shm segments in /dev/shm or under the test's directory, LMDB), the reboot done
as a reboot does it: the shm segment is gone (``test_losses._reboot``).
"""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from pathlib import Path

import pytest
import torch
from _clirun import run_cli
from test_losses import _reboot, _save_steps, rebooted_ranks

from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.errors import NoRestorableVersion
from tiercheck.restore.losses import ledger_path, read_ledger
from tiercheck.store.lifecycle import destroy_store

LOST = "lost with tier shm"


def _gone(rows: list) -> dict[int, str | None]:  # type: ignore[type-arg]
    return {v.id: v.gone for v in rows if v.gone is not None}


def test_a_lost_version_stays_lost_after_a_newer_version_is_committed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Steps 1-5 in the default store (version 0 a base in LMDB, 1-4 diffs in shm only),
    a reboot, then a run that restores step 1 and saves step 10: versions 1-4 are still
    lost, in ``history()``, ``version()``, ``restore(version=)``, ``ls`` and ``show``."""
    root = tmp_path / "ckpt"
    try:
        _reboot(_save_steps(root, range(1, 6)))
        model = torch.nn.Linear(64, 64)
        with Checkpointer(root) as ckpt:
            info = ckpt.restore({"model": model})
            assert info is not None and info.step == 1 and info.lost is not None
            assert info.lost.versions == (1, 2, 3, 4)
            new = ckpt.save(10, {"model": model}).wait().version
            rows = ckpt.history()
            assert [v.id for v in rows] == sorted(v.id for v in rows)  # oldest first
            assert _gone(rows) == {i: LOST for i in (1, 2, 3, 4)}
            assert [v.step for v in rows if v.gone] == [2, 3, 4, 5]
            assert all(not v.restorable for v in rows if v.gone)
            assert {v.id for v in rows if v.restorable} == {0, new}
            with pytest.raises(NoRestorableVersion, match=LOST):
                ckpt.version(3)
            with pytest.raises(NoRestorableVersion, match=LOST):
                ckpt.restore({"model": torch.nn.Linear(64, 64)}, version=3)
            info = ckpt.restore({"model": torch.nn.Linear(64, 64)})
            assert info is not None and info.version == new and info.lost is None
        out, _ = run_cli(capsys, "ls", root, "--json")
        doc = json.loads(out)
        assert {v["id"]: v["gone"] for v in doc["versions"] if v["gone"]} == {
            i: LOST for i in (1, 2, 3, 4)
        }
        assert doc["not_listed"] is None, doc["not_listed"]  # not "retention dropped them"
        out, _ = run_cli(capsys, "ls", root)
        assert LOST in out and "retention dropped" not in out
        _, err = run_cli(capsys, "show", root, "3", ok=2)
        assert LOST in err and "dropped by retention" not in err, err
        _, err = run_cli(capsys, "show", root, "step:4", ok=2)
        assert LOST in err and "dropped by retention" not in err, err
    finally:
        destroy_store(root)


def test_a_run_that_saves_without_restoring_keeps_the_loss_on_record(tmp_path: Path) -> None:
    """The first writable open after the reboot records the loss in the ack ledger before
    its first save, whether or not the run restores or lists anything: a run that starts
    afresh and saves step 10 at once leaves versions 1-2 listed as lost."""
    root = tmp_path / "ckpt"
    try:
        _reboot(_save_steps(root, range(1, 4)))
        with Checkpointer(root) as ckpt:
            ckpt.save(10, {"model": torch.nn.Linear(64, 64)}).wait()
        with Checkpointer(root, read_only=True) as ro:
            assert _gone(ro.history()) == {1: LOST, 2: LOST}
        assert [a.id for a in read_ledger(ledger_path(root), None) if a.lost] == [1, 2]
    finally:
        destroy_store(root)


def test_versions_retention_dropped_from_shm_are_never_called_lost(tmp_path: Path) -> None:
    """No reboot: runs after runs, shm drops the diffs it no longer keeps; none of them is
    recorded or listed as lost."""
    root = tmp_path / "ckpt"
    policy = Policy(base_every=3)
    model = torch.nn.Linear(64, 64)
    try:
        for first in (1, 20, 40):
            with Checkpointer(root, policy=policy) as ckpt:
                ckpt.restore({"model": model}, missing_ok=True)
                for step in range(first, first + 8):
                    with torch.no_grad():
                        model.weight.add_(1.0)
                    ckpt.save(step, {"model": model}).wait()
        with Checkpointer(root, policy=policy) as ckpt:
            assert _gone(ckpt.history()) == {}
    finally:
        destroy_store(root)


def test_a_lost_version_is_listed_until_the_store_keeps_no_older_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """shm and LMDB (bases, the newest two kept), a base every third version: versions 1-2
    are lost; they stay listed while LMDB keeps base 0, and are listed no more once
    retention dropped it (every version older than them is gone: retention would have
    dropped them by now); asked for by id or step, they are still named as lost."""
    root = tmp_path / "ckpt"
    segment_root = tmp_path / "shm"
    tiers = [
        TierSpec("shm", f"shm://rows{uuid.uuid4().hex[:8]}", {"root": str(segment_root)}),
        TierSpec("lmdb", f"lmdb://{tmp_path / 'lmdb'}"),
    ]
    policy = Policy(base_every=3, tiers={"lmdb": TierPolicy(versions="base", keep_bases=2)})
    model = torch.nn.Linear(64, 64)
    try:
        with Checkpointer(root, tiers=tiers, policy=policy) as ckpt:
            for step in (1, 2, 3):  # version 0 a base (shm, LMDB), 1 and 2 diffs (shm)
                ckpt.save(step, {"model": model}).wait()
        (segment,) = list(segment_root.iterdir())
        _reboot(str(segment))
        with Checkpointer(root, tiers=tiers, policy=policy) as ckpt:
            ckpt.restore({"model": model})
            ckpt.save(10, {"model": model}).wait()  # a base: LMDB keeps 0 and this one
        with Checkpointer(root, tiers=tiers, policy=policy, read_only=True) as ro:
            assert _gone(ro.history()) == {1: LOST, 2: LOST}
        with Checkpointer(root, tiers=tiers, policy=policy) as ckpt:
            for step in range(11, 17):  # two more bases: LMDB drops base 0
                ckpt.save(step, {"model": model}).wait()
        with Checkpointer(root, tiers=tiers, policy=policy, read_only=True) as ro:
            rows = ro.history()
            assert min(v.id for v in rows if v.holders) > 2, [(v.id, v.tiers) for v in rows]
            assert _gone(rows) == {}
            # asked for, it is still named as lost, not as dropped by retention
            for spec in (1, "step:3"):
                with pytest.raises(NoRestorableVersion, match=LOST) as err:
                    ro.version(spec)
                assert "keeps no version as old" in str(err.value)
        out, _ = run_cli(capsys, "ls", root, "--json")
        assert f"(ids 1-2) {LOST}" in json.loads(out)["not_listed"]
        _, err = run_cli(capsys, "show", root, "2", ok=2)
        assert LOST in err and "dropped by retention" not in err, err
    finally:
        destroy_store(root)


@pytest.mark.slow
def test_a_loss_on_another_rank_shows_in_rank_0s_view(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two gloo ranks save steps 1 (a base, shm and LMDB) and 2 (a diff, shm only); rank
    1's shm segment is lost. On restart both restore step 1 and save step 3. Rank 0 still
    holds its shard of version 1, but no restore can use it: its history (before and after
    the new save) and ``tiercheck ls`` (rank 0's view) list version 1 as lost with rank 1's
    shm; rank 1 lists it as lost with its own."""
    root, shm = tmp_path / "store", tmp_path / "shm"
    try:
        rows = rebooted_ranks(root, shm, "resume")
        assert all(row["restored"] == 1 for row in rows.values()), rows
        for when in ("before", "after"):
            by_id = {v["id"]: v for v in rows[0][when]}
            assert by_id[1]["gone"] == f"{LOST} of rank 1", rows[0][when]
            assert not by_id[1]["restorable"] and by_id[0]["restorable"], rows[0][when]
            mine = {v["id"]: v for v in rows[1][when]}
            assert mine[1]["gone"] == LOST and not mine[1]["restorable"], rows[1][when]
        out, _ = run_cli(capsys, "ls", root, "--json")
        listed = {v["id"]: v for v in json.loads(out)["versions"]}
        assert listed[1]["gone"] == f"{LOST} of rank 1" and not listed[1]["restorable"], listed
        assert listed[rows[0]["saved"]]["restorable"], listed
        out, _ = run_cli(capsys, "ls", root)
        assert f"{LOST} of rank 1" in out
        _, err = run_cli(capsys, "show", root, "1", ok=2)
        assert f"{LOST} of rank 1" in err, err
    finally:
        destroy_store(root)


def test_the_ledgers_rewrite_keeps_the_losses_it_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ledger is rewritten once it holds ``2 * KEEP`` lines and kept its newest
    ``KEEP`` rows: after a loss, ``KEEP`` newer memory-only saves pushed the lost rows out,
    and ``show`` called the lost versions "dropped by retention" while the store still kept
    an older one. Lost rows are kept apart from the others now."""
    from tiercheck.restore import losses

    monkeypatch.setattr(losses, "KEEP", 4)
    root = tmp_path / "ckpt"
    try:
        _reboot(_save_steps(root, range(1, 4)))  # version 0 in LMDB, 1 and 2 in shm only
        model = torch.nn.Linear(64, 64)
        with Checkpointer(root, policy=Policy(base_every=1000)) as ckpt:
            for step in range(10, 22):  # memory-only diffs: 12 rows past the lost ones
                ckpt.save(step, {"model": model}).wait()
            store_id = ckpt.tierset.store_id
            assert _gone(ckpt.history()) == {1: LOST, 2: LOST}
        rows = read_ledger(ledger_path(root), store_id)
        assert [a.id for a in rows if a.lost] == [1, 2]
    finally:
        destroy_store(root)


def test_no_loss_is_recorded_while_a_tier_that_may_have_superseded_it_is_down(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Versions a memory tier let go for a newer base that only an unreachable tier holds
    look lost at an open after a reboot: none is recorded lost then (they were listed as
    lost for good once the tier came back), and the open says why."""
    root = tmp_path / "ckpt"
    try:
        _reboot(_save_steps(root, range(1, 4)))
        shutil.move(root / "remote", tmp_path / "away")
        (root / "remote").write_text("not a directory: the remote cannot be opened")
        with (
            caplog.at_level(logging.WARNING, logger="tiercheck.restore.losses"),
            Checkpointer(root) as ckpt,
        ):
            down = [s.name for s in ckpt.tierset.slots if s.tier is None]
            store_id = ckpt.tierset.store_id
        assert down, "the remote was expected to be unreachable"
        assert "not recording which acknowledged versions were lost" in caplog.text
        assert not [a for a in read_ledger(ledger_path(root), store_id) if a.lost]
    finally:
        if (tmp_path / "away").exists():
            (root / "remote").unlink()
            shutil.move(tmp_path / "away", root / "remote")
        destroy_store(root)


def test_verify_after_a_reboot_says_the_store_starts_shm_afresh(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``verify`` of a store whose shm segment a reboot emptied told the user to move the
    damaged tier aside and let the store rebuild it; nothing is damaged, and the store's
    next writable open starts the segment afresh."""
    root = tmp_path / "ckpt"
    try:
        _reboot(_save_steps(root, range(1, 4)))
        out, _ = run_cli(capsys, "verify", root, ok=1)
        assert "tier shm cannot be read now" in out and "started afresh" in out, out
        assert "move the damaged tier aside" not in out, out
    finally:
        destroy_store(root)
