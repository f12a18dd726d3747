"""Restoring with another world size than a version was saved with (real gloo ranks
under torchrun, per-rank LMDB tiers and a shared ``file://`` remote): every rank agrees
on one outcome, and a failure on one rank fails the restore on every rank instead of
leaving the others waiting in the next round."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _dist import torchrun

from tiercheck.store.lifecycle import destroy_store

WORKER = Path(__file__).parent / "dist_scripts" / "world_worker.py"


def run(root: Path, nproc: int, *args: str) -> list[dict[str, Any]]:
    proc = torchrun(WORKER, str(root), *args, nproc=nproc, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    paths = [root.with_name(f"result-{args[0]}-{r}.json") for r in range(nproc)]
    rows = [json.loads(path.read_text()) for path in paths]
    for path in paths:
        path.unlink()
    return rows


@pytest.mark.slow
def test_ranks_agree_when_the_newest_version_has_fewer_shards(tmp_path: Path) -> None:
    """Step 1 saved by two ranks, step 2 by one: two ranks restoring again cannot restore
    step 2 (rank 1 has no shard of it), so both drop it and restore step 1, each its own
    shard, bit for bit. Before, rank 1 raised while rank 0 went on to agree on an older
    version alone and failed when rank 1 left (or waited for the group's timeout).
    Then a state that does not fit on rank 1 only: every rank raises, none hangs, and
    nothing is written on either."""
    root = tmp_path / "store"
    run(root, 2, "save", "1")
    run(root, 1, "save", "2")
    rows = run(root, 2, "restore")
    for row in rows:
        assert "error" not in row, row
        assert row["step"] == 1 and row["exact"], row
        assert "could not be restored" in row["fallback"], row
    rows = run(root, 2, "mismatch")
    for row in rows:
        assert "error" in row and row["zeros"], row
    by_rank = {row["rank"]: row["error"] for row in rows}
    assert by_rank[1].startswith("StateError"), by_rank
    assert by_rank[0].startswith("CheckpointError") and "rank" in by_rank[0], by_rank


FEWER = Path(__file__).parent / "dist_scripts" / "fewer_worker.py"


@pytest.mark.slow
def test_one_rank_restoring_two_ranks_log_versions_falls_back_to_their_base(
    tmp_path: Path,
) -> None:
    """Log versions saved by two ranks on the default store, each rank's log in its own
    shm: one process cannot read rank 1's log to replay it resharded. It restores the base
    (saying why), as a version another rank cannot read is dropped; before, the restore
    raised ``StateError`` (the replay 'broke' on a chunk in no reachable tier)."""
    root = tmp_path / "store"
    try:
        proc = torchrun(FEWER, str(root), "save", nproc=2, timeout=180)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        proc = torchrun(FEWER, str(root), "restore", nproc=1, timeout=180)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        row = json.loads(Path(f"{root}.result.json").read_text())
        assert "error" not in row, row
        assert row["step"] == 1 and row["role"] == "base" and row["exact"], row
        assert "could not be replayed" in row["fallback"], row
    finally:
        destroy_store(root)
