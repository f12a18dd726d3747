"""DCP on tiercheck with real ranks: ``torchrun --nproc-per-node 2`` (gloo, CPU, loopback).

The worker (``dist_scripts/dcp_worker.py``) saves a ``Shard(0)`` DTensor state and loads it
back on the same 2 ranks with other placements; this process then loads it on 1 rank.
A second launch kills rank 1 in the middle of ``write_data``: the previous checkpoint must
stay the newest one and load intact.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import _dist
import pytest
import torch
from _dist import free_port
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load

from tiercheck import Checkpointer
from tiercheck.engine.coordinator import LocalCoordinator
from tiercheck.integrations.dcp import TierReader, rank_root

SCRIPTS = Path(__file__).resolve().parent / "dist_scripts"
sys.path.insert(0, str(SCRIPTS))
from dcp_worker import full_state  # noqa: E402

pytestmark = pytest.mark.slow


def torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    return _dist.torchrun(
        SCRIPTS / "dcp_worker.py",
        *args,
        rendezvous=[
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}",
            "--local-addr",
            "127.0.0.1",
        ],
        env={"GLOO_SOCKET_IFNAME": "lo"},
        timeout=120,
    )


def load_on_one_rank(root: Path, checkpoint_id: str | None = None) -> dict[str, Any]:
    template = full_state(0)
    target: dict[str, Any] = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in template.items()
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load(target, checkpoint_id=checkpoint_id, storage_reader=TierReader(root))
    return target


def history(root: Path, rank: int) -> list[tuple[int, int]]:
    with Checkpointer(
        rank_root(root, rank), read_only=True, coordinator=LocalCoordinator()
    ) as ckpt:
        return [(v.id, v.step) for v in ckpt.history()]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcp") / "ckpt"
    proc = torchrun("save", str(root), "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "rank 0: OK" in proc.stdout and "rank 1: OK" in proc.stdout
    return root


def test_dtensor_save_on_two_ranks_reshards_on_two_and_loads_on_one(saved: Path) -> None:
    # each rank saved its Shard(0) half into its own store; rank 0's version has the metadata
    assert history(saved, 0) == [(0, 1)]
    assert history(saved, 1) == [(0, 1)]
    got = load_on_one_rank(saved)
    for k, v in full_state(1).items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def test_rank_killed_mid_write_leaves_previous_checkpoint(saved: Path) -> None:
    proc = torchrun("crash", str(saved), "2")
    assert proc.returncode != 0
    assert "exitcode: 17" in proc.stderr, proc.stderr[-5000:]
    # no coordinator version for step 2: the checkpoint of step 1 is still the newest
    assert history(saved, 0) == [(0, 1)]
    got = load_on_one_rank(saved)
    assert torch.equal(got["w"], full_state(1)["w"])
    assert got["step"] == 1
    with pytest.raises(CheckpointException, match="no restorable DCP checkpoint for step 2"):
        load_on_one_rank(saved, "step:2")
