"""A torchrun worker for tests/test_dcp_hold.py: a job that resumes from the newest DCP
checkpoint, saves on, and may have its coordinator SIGKILLed as ``finish`` begins.

Usage: ``torchrun --nproc-per-node 2 ... dcp_hold_worker.py ROOT LAST [KILL]``

Every rank store is the default one (shm, LMDB, a ``file://`` remote) with a base every
third version: shm keeps the newest base and its diffs, LMDB the two newest bases. The job
loads the newest checkpoint every rank can restore, if there is one, and prints
``rank R: loaded step N``; then it saves every step after it up to ``LAST``, each rank its
own tensor (:func:`rank_state`), one writer per save. At step ``KILL`` rank 0, DCP's
coordinator, SIGKILLs itself as its ``finish`` begins: every rank has committed its shard
of that step, and no checkpoint records it.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _leave import leave
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save
from torch.distributed.checkpoint.storage import WriteResult

from tiercheck import Policy
from tiercheck.integrations.dcp import TierReader, TierWriter, rank_root


def policy() -> Policy:
    return Policy(base_every=3, chunk_size=16 * 1024)


def rank_state(rank: int, step: int) -> dict[str, torch.Tensor]:
    """What ``rank`` saves at ``step``."""
    return {f"w{rank}": torch.full((256,), float(100 * rank + step))}


class Killed(TierWriter):  # type: ignore[misc]
    """A writer whose coordinator dies as its ``finish`` of step ``kill`` begins."""

    kill: int | None = None

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self._step == self.kill:
            os.kill(os.getpid(), signal.SIGKILL)
        super().finish(metadata, results)


def main() -> None:
    root, last = Path(sys.argv[1]), int(sys.argv[2])
    Killed.kill = int(sys.argv[3]) if len(sys.argv) > 3 else None
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loaded = 0
    if (rank_root(root, 0) / "tiercheck.toml").exists():
        target = {f"w{rank}": torch.zeros(256)}
        load(target, storage_reader=TierReader(root))
        loaded = int(target[f"w{rank}"][0].item()) - 100 * rank
        print(f"rank {rank}: loaded step {loaded}", flush=True)
    for step in range(loaded + 1, last + 1):
        writer = Killed(root, policy=policy())
        save(rank_state(rank, step), checkpoint_id=step, storage_writer=writer)
    TierWriter(root).close()
    dist.barrier()
    print(f"rank {rank}: saved up to step {last}", flush=True)


if __name__ == "__main__":
    leave(main())
