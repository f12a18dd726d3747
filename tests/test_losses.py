"""Losses reported (issue 33 items 4 and 6): a restore that cannot reach the newest
acknowledged version says which steps were lost and with which tier; ``history()`` and
``tiercheck ls`` list them as lost; a store whose only tier left is damaged is not "empty".

Real tiers: the default store (an shm segment in /dev/shm, LMDB, a ``file://`` remote),
with the reboot done as a reboot does it: the shm segment is gone.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import _fresh
import pytest
import torch

from tiercheck import Checkpointer, TierSpec
from tiercheck.errors import EmptyStore, NoRestorableVersion
from tiercheck.store.lifecycle import destroy_store


def _save_steps(root: Path, steps: range) -> str:
    """Save ``steps`` into the default store at ``root`` (each acknowledged), close it;
    return its shm segment's directory."""
    model = torch.nn.Linear(64, 64)
    with Checkpointer(root) as ckpt:
        for step in steps:
            with torch.no_grad():
                model.weight.add_(1.0)
            ckpt.save(step, {"model": model}).wait()
        shm = ckpt.tierset.get("shm").tier
        assert shm is not None
        return str(shm.path)  # type: ignore[attr-defined]


def _reboot(segment: str) -> None:
    shutil.rmtree(segment)


def rebooted_ranks(root: Path, shm: Path, then: str) -> dict[int, dict[str, Any]]:
    """Two gloo ranks (tests/dist_scripts/loss_worker.py) save steps 1 and 2; rank 1's shm
    segment is lost (a reboot of its node); both ranks then run the phase ``then``. Returns
    what each rank wrote of it, by rank."""
    import json

    from _dist import torchrun

    name = f"loss{uuid.uuid4().hex[:8]}"
    script = Path(__file__).parent / "dist_scripts" / "loss_worker.py"
    for phase in ("save", then):
        if phase == then:
            (segment,) = [p for p in shm.iterdir() if p.name.endswith(f"{name}-1")]
            _reboot(str(segment))
        proc = torchrun(script, str(root), str(shm), name, phase, nproc=2, timeout=180)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r: json.loads(root.with_name(f"result-{then}-{r}.json").read_text()) for r in (0, 1)}


def test_a_restore_after_a_reboot_says_which_steps_were_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ckpt"
    try:
        segment = _save_steps(root, range(10, 101, 10))
        _reboot(segment)
        with Checkpointer(root) as ckpt:
            with caplog.at_level(logging.WARNING, logger="tiercheck"):
                info = ckpt.restore({"model": torch.nn.Linear(64, 64)})
            assert info is not None and info.step < 100
            lost = info.lost
            assert lost is not None
            assert lost.steps[-1] == 100 and info.step not in lost.steps
            assert lost.steps == tuple(range(info.step + 10, 101, 10))
            assert lost.tiers == ("shm",)
            text = str(lost)
            assert "lost with tier shm" in text and "100" in text
            warnings = [r for r in caplog.records if "lost with tier shm" in r.getMessage()]
            assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
            assert warnings[0].name.startswith("tiercheck")
            # history lists them, as lost, after the versions it holds
            rows = ckpt.history()
            gone = [v for v in rows if v.gone is not None]
            assert [v.step for v in gone] == list(lost.steps)
            assert all(v.gone == "lost with tier shm" and not v.restorable for v in gone)
            with pytest.raises(NoRestorableVersion, match="lost with tier shm"):
                ckpt.version(gone[-1].id)
            with pytest.raises(NoRestorableVersion, match="lost with tier shm"):
                ckpt.restore({"model": torch.nn.Linear(64, 64)}, step=100)
        out = _fresh.run(
            ["-m", "tiercheck", "ls", str(root)],
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "200"},
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert "lost with tier shm" in out.stdout
    finally:
        destroy_store(root)


def test_a_restore_that_reaches_the_newest_version_reports_no_loss(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    try:
        _save_steps(root, range(1, 4))
        with Checkpointer(root) as ckpt:
            info = ckpt.restore({"model": torch.nn.Linear(64, 64)})
            assert info is not None and info.step == 3 and info.lost is None
            assert all(v.gone is None for v in ckpt.history())
    finally:
        destroy_store(root)


def test_a_store_that_lost_every_version_is_not_empty(tmp_path: Path) -> None:
    root = tmp_path / "mem"
    name = f"tc-loss-{os.getpid()}"
    spec = [TierSpec("shm", f"shm://{name}")]
    try:
        with Checkpointer(root, tiers=spec) as ckpt:
            ckpt.save(5, {"w": torch.ones(8)}).wait()
            shm = ckpt.tierset.get("shm").tier
            assert shm is not None
            segment = str(shm.path)  # type: ignore[attr-defined]
        _reboot(segment)
        with Checkpointer(root, tiers=spec) as ckpt:
            for missing_ok in (False, True):
                with pytest.raises(NoRestorableVersion, match="lost with tier shm") as err:
                    ckpt.restore({"w": torch.zeros(8)}, missing_ok=missing_ok)
                assert not isinstance(err.value, EmptyStore)
    finally:
        destroy_store(root)


def test_a_damaged_lmdb_left_alone_is_not_an_empty_store(tmp_path: Path) -> None:
    """The shm segment gone and ``data.mdb`` cut short: the restore says the LMDB tier is
    damaged or unreachable, never that the store is empty."""
    root = tmp_path / "ckpt"
    script = (
        "import sys, torch\n"
        "from tiercheck import Checkpointer\n"
        "with Checkpointer(sys.argv[1]) as ckpt:\n"
        "    try:\n"
        "        ckpt.restore({'model': torch.nn.Linear(64, 64)}, tiers=['lmdb'])\n"
        "    except Exception as exc:\n"
        "        print(type(exc).__name__, exc)\n"
    )
    try:
        segment = _save_steps(root, range(1, 3))
        _reboot(segment)
        data = root / "lmdb" / "data.mdb"
        with open(data, "r+b") as f:
            f.truncate(4096)
        # in a subprocess: a truncated LMDB can SIGBUS the reader
        out = _fresh.run(["-c", script, str(root)], capture_output=True, text=True, timeout=120)
        assert "the store is empty" not in out.stdout, out.stdout + out.stderr
        assert "lmdb" in out.stdout and "NoRestorableVersion" in out.stdout, out.stdout + out.stderr
        assert "damaged" in out.stdout or "unreachable" in out.stdout, out.stdout
    finally:
        destroy_store(root)


@pytest.mark.slow
def test_every_rank_reports_the_versions_another_rank_lost(tmp_path: Path) -> None:
    """Two gloo ranks save steps 1 (a base, in shm and LMDB) and 2 (a diff, in shm only);
    rank 1's shm segment is then lost (a reboot of its node). Both ranks restore step 1,
    the newest they can all read; rank 1 lost step 2, and rank 0, which holds it still,
    reports rank 1's loss as its own ``info.lost`` (naming the rank). Before, rank 0, the
    rank that usually logs, rolled back an acknowledged step without a word."""
    root, shm = tmp_path / "store", tmp_path / "shm"
    try:
        rows = rebooted_ranks(root, shm, "restore")
        assert all(row["step"] == 1 and row["lost_steps"] == [2] for row in rows.values()), rows
        assert rows[1]["lost_rank"] is None and rows[0]["lost_rank"] == 1, rows
        assert "of rank 1" in rows[0]["text"], rows
    finally:
        destroy_store(root)


def test_a_run_after_a_reboot_never_reuses_the_id_of_a_lost_version(tmp_path: Path) -> None:
    """The versions lost with shm keep their ids: the next run's saves take new ones, so
    the ledger, the warning and ``history()`` keep naming the versions that were lost,
    not the new run's (it took ids 1 and 2 again, and the loss vanished from view)."""
    root = tmp_path / "ckpt"
    try:
        segment = _save_steps(root, range(1, 4))  # version 0 a base (LMDB), 1 and 2 in shm
        _reboot(segment)
        model = torch.nn.Linear(64, 64)
        with Checkpointer(root) as ckpt:
            info = ckpt.restore({"model": model})
            assert info is not None and info.step == 1
            assert info.lost is not None and info.lost.versions == (1, 2)
            r = ckpt.save(10, {"model": model}).wait()
            assert r.version > 2
            rows = {v.id: v for v in ckpt.history()}
            assert rows[r.version].step == 10
            assert 1 not in rows or rows[1].gone is not None
        with Checkpointer(root) as ckpt:
            info = ckpt.restore({"model": torch.nn.Linear(64, 64)})
            assert info is not None and info.step == 10 and info.version == r.version
    finally:
        destroy_store(root)


def test_a_loss_names_the_tier_it_could_not_reach_as_one_that_may_hold_a_copy(
    tmp_path: Path, s3_server: Any, s3_bucket: tuple[str, dict[str, Any]]
) -> None:
    """Versions acknowledged in shm, migrated later to a remote that is down at the next
    open after a reboot: the restore says the remote may hold them (it did not say so, and
    called them lost), and a later restore with the remote back resumes from the newest."""
    from tiercheck import Policy, TierPolicy

    url, options = s3_bucket
    root = tmp_path / "ckpt"
    name = f"loss{uuid.uuid4().hex[:8]}"
    tiers = [
        TierSpec("shm", f"shm://{name}", {"root": str(tmp_path / "shm")}),
        TierSpec("lmdb", f"lmdb://{tmp_path / 'lmdb'}"),
        TierSpec("remote", url, {"storage_options": options, "retry": False}),
    ]
    policy = Policy(tiers={"remote": TierPolicy(mode="async", versions="all")})
    model = torch.nn.Linear(64, 64)
    try:
        with Checkpointer(root, tiers=tiers, policy=policy) as ckpt:
            for step in (1, 2, 3):
                with torch.no_grad():
                    model.weight.fill_(float(step))
                r = ckpt.save(step, {"model": model}).wait_migrated()
                assert r.tiers["remote"] == "committed"
        shutil.rmtree(tmp_path / "shm")  # the reboot
        with s3_server.down(), Checkpointer(root, tiers=tiers, policy=policy) as ckpt:
            info = ckpt.restore({"model": torch.nn.Linear(64, 64)})
            assert info.step == 1 and info.lost is not None
            assert info.lost.unreached == ("remote",)
            assert "tier remote could not be reached and may hold" in str(info.lost)
        with Checkpointer(root, tiers=tiers, policy=policy) as ckpt:
            fresh = torch.nn.Linear(64, 64)
            info = ckpt.restore({"model": fresh})
            assert info.step == 3 and info.lost is None
            assert bool((fresh.weight == 3.0).all())
    finally:
        destroy_store(root)
