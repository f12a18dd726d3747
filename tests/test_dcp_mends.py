"""DCP on tiercheck after its coordinator was killed in ``finish``, and with DCP's plan
caching (2 ranks under torchrun).

Every rank had committed its shard of the new checkpoint; rank 1's store held its shard of
the newest finished one (tests/test_dcp_hold.py), until a ``gc`` of that store outside DCP,
which holds nothing, let go of its shards of the previous checkpoints; the coordinator's
store still records those checkpoints. Loading without a checkpoint_id falls back to the
newest one every rank can restore; naming one that cannot be read says which rank lost
what.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import _dist
import pytest
import torch
from _dist import free_port
from _snippets import destroy_stores
from torch.distributed.checkpoint.api import CheckpointException

from tiercheck import Checkpointer
from tiercheck.engine.coordinator import LocalCoordinator
from tiercheck.integrations.dcp import load_full_state_dict, rank_root

SCRIPTS = Path(__file__).with_name("dist_scripts")
sys.path.insert(0, str(SCRIPTS))
from dcp_mends_worker import rank_state  # noqa: E402

pytestmark = pytest.mark.slow


def torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    return _dist.torchrun(
        SCRIPTS / "dcp_mends_worker.py",
        *args,
        rendezvous=["--master-addr", "127.0.0.1", "--master-port", str(free_port())],
        env={"GLOO_SOCKET_IFNAME": "lo"},
        timeout=120,
    )


def history(root: Path, rank: int) -> dict[int, tuple[int, bool]]:
    """Rank ``rank``'s versions: id -> (step, restorable)."""
    with Checkpointer(
        rank_root(root, rank), read_only=True, coordinator=LocalCoordinator()
    ) as ckpt:
        return {v.id: (v.step, v.restorable) for v in ckpt.history()}


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("dcp-mends") / "ckpt"
    proc = torchrun("save", str(root))
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "Signal 9" in proc.stderr or "SIGKILL" in proc.stderr, proc.stderr[-5000:]
    # a store opened outside DCP holds nothing: its retention drops the held shard
    with Checkpointer(rank_root(root, 1), coordinator=LocalCoordinator()) as ckpt:
        ckpt.gc()
    try:
        yield root
    finally:
        destroy_stores(root)


def test_killed_coordinator_leaves_rank_versions_the_reader_must_skip(killed: Path) -> None:
    # the coordinator recorded steps 1..3; rank 1 committed step 4 as a base, and its
    # versions of steps 2 and 3 (diffs of the base of step 1) are in no tier any more
    assert [s for s, _ in history(killed, 0).values()] == [1, 2, 3]
    assert history(killed, 1) == {0: (1, True), 1: (2, False), 2: (3, False), 3: (4, True)}


def test_latest_falls_back_to_the_newest_checkpoint_every_rank_restores(
    killed: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tiercheck.integrations.dcp.reader"):
        sd = load_full_state_dict(killed)
    assert torch.equal(sd["w0"], rank_state(0, 1)["w0"])
    assert torch.equal(sd["w1"], rank_state(1, 1)["w1"])
    skipped = [r.getMessage() for r in caplog.records]
    assert len(skipped) == 2, skipped
    assert "(step 3)" in skipped[0] and "(step 2)" in skipped[1]
    assert all("rank 1's shard" in m and "no tier holds" in m for m in skipped)


def test_named_checkpoint_that_a_rank_lost_says_which_and_why(killed: Path) -> None:
    with pytest.raises(CheckpointException) as err:
        load_full_state_dict(killed, checkpoint_id=3)
    text = str(err.value)
    assert "(step 3)" in text and "cannot be loaded" in text, text
    assert "rank 1's shard, version 2" in text and "fast: dropped" in text, text
    assert torch.equal(load_full_state_dict(killed, checkpoint_id=1)["w1"], rank_state(1, 1)["w1"])


def test_restarted_job_loads_the_newest_checkpoint_every_rank_restores(killed: Path) -> None:
    proc = torchrun("load", str(killed))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "rank 0: loaded step 1" in proc.stdout and "rank 1: loaded step 1" in proc.stdout


def test_plan_caching_without_checkpoint_id_labels_every_rank_with_the_step(
    tmp_path: Path,
) -> None:
    try:
        proc = torchrun("cache", str(tmp_path / "ckpt"))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        for rank in (0, 1):
            steps = [s for s, _ in history(tmp_path / "ckpt", rank).values()]
            assert steps == [0, 1, 2], f"rank {rank}: {steps}"
    finally:
        destroy_stores(tmp_path)
