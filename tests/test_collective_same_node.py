"""A ``collective://`` tier whose partner is on the rank's own node (one node: the partner
map ``(r + ranks_per_node) % world`` gives each rank itself) keeps its copies in memory a
lost node takes along. It said it survived losing the node all the same, so versions
acknowledged in shm and that tier alone never reached the ack ledger, and a reboot lost
them without a word (found by new-user testing). Now the tier survives a crashed process
only, the ledger records those versions, and a restore after a reboot names them.

One process (no process group: world 1, the partner is the rank itself), real /dev/shm
segments under the test's directory and a real LMDB environment.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import torch

from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.backends.base import FailureDomain
from tiercheck.restore.losses import ledger_path, read_ledger


def test_a_partner_on_the_same_node_survives_a_process_and_its_losses_are_reported(
    tmp_path: Path,
) -> None:
    shm = tmp_path / "shm"
    name = f"coll{uuid.uuid4().hex[:8]}"
    tiers = [
        TierSpec("shm", f"shm://{name}", {"root": str(shm)}),
        TierSpec("peer", f"collective://{name}", {"shm_root": str(shm)}),
        TierSpec("lmdb", f"lmdb://{tmp_path / 'lmdb'}"),
    ]
    policy = Policy(base_every=10, tiers={"lmdb": TierPolicy(versions="base", keep_bases=2)})
    root = tmp_path / "store"
    with Checkpointer(root, tiers=tiers, policy=policy) as ckpt:
        peer = ckpt.tierset.get("peer").tier
        assert peer is not None and peer.capabilities.survives == FailureDomain.PROCESS
        for step in range(1, 5):
            ckpt.save(step, {"w": torch.full((64,), float(step))}).wait()
        store_id = ckpt.tierset.store_id
    assert [a.step for a in read_ledger(ledger_path(root), store_id)] == [2, 3, 4]
    for segment in shm.iterdir():  # a reboot empties the node's memory
        shutil.rmtree(segment)
    with Checkpointer(root, tiers=tiers, policy=policy) as ckpt:
        state = {"w": torch.zeros(64)}
        info = ckpt.restore(state)
        assert info.step == 1 and torch.equal(state["w"], torch.full((64,), 1.0))
        assert info.lost is not None and list(info.lost.steps) == [2, 3, 4]
