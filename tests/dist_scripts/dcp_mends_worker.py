"""A torchrun worker for tests/test_dcp_mends.py: DCP's coordinator killed in ``finish``.

Usage: ``torchrun --nproc-per-node 2 ... dcp_mends_worker.py MODE ROOT``

- ``save``: save steps 1..4, each rank its own tensor (:func:`rank_state`); every third
  version of a store is a base, and at step 4 (a base on every rank) rank 0, DCP's
  coordinator, SIGKILLs itself at the start of ``finish``, after every rank committed its
  shard. Each rank store has a fast tier that keeps every version of the newest base and a
  durable one that keeps the two newest bases: rank 1's base of step 4 would leave its
  versions of steps 2 and 3 in no tier, as the default store's shm and LMDB tiers do; it
  holds step 3's (the newest finished checkpoint's) until a ``gc`` outside DCP, which the
  test runs after the kill.
- ``load``: a restarted job's ``dcp.load`` of the newest checkpoint on both ranks; prints
  the step it loaded.
- ``cache``: three saves with ``checkpoint_id=None`` and DCP's plan caching (the second and
  third reuse every rank's plan of the first).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _leave import leave
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save
from torch.distributed.checkpoint.storage import WriteResult

from tiercheck import Policy, TierPolicy
from tiercheck.integrations.dcp import TierReader, TierWriter

KILLED_AT = 4


def tiers(root: Path) -> list[tuple[str, str]]:
    return [("fast", f"lmdb://{root}/fast"), ("durable", f"file://{root}/durable")]


def policy() -> Policy:
    fast = TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=1)
    durable = TierPolicy(versions="base", mode="sync", codec="raw", keep_bases=2)
    return Policy(base_every=3, chunk_size=16 * 1024, tiers={"fast": fast, "durable": durable})


def rank_state(rank: int, step: int) -> dict[str, torch.Tensor]:
    """What ``rank`` saves at ``step``."""
    return {f"w{rank}": torch.full((256,), float(100 * rank + step))}


class KilledCoordinator(TierWriter):  # type: ignore[misc]
    """The coordinator dies as its ``finish`` of step :data:`KILLED_AT` begins."""

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self._step == KILLED_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        super().finish(metadata, results)


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if mode == "save":
        for step in range(1, KILLED_AT + 1):
            writer = KilledCoordinator(root, tiers=tiers, policy=policy())
            save(rank_state(rank, step), checkpoint_id=step, storage_writer=writer)
        raise SystemExit(f"rank {rank}: the save of step {KILLED_AT} returned")
    if mode == "cache":
        for step in range(3):
            planner = DefaultSavePlanner(enable_plan_caching=True)
            writer = TierWriter(root, tiers=tiers, policy=policy())
            save(rank_state(rank, step), storage_writer=writer, planner=planner)
        writer.close()
        dist.barrier()
        dist.destroy_process_group()
        return
    target = {f"w{rank}": torch.zeros(256)}
    load(target, storage_reader=TierReader(root))
    print(f"rank {rank}: loaded step {int(target[f'w{rank}'][0].item()) - 100 * rank}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    leave(main())
