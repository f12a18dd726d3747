"""A torchrun worker for tests/test_dcp_hold.py: one TierWriter for every save of a job;
the save of step 4 is named ``checkpoint_id=100`` and fails on rank 0 (an object in its
state dict that cannot be pickled), the job catches the error and saves steps 5 and 6
without a ``checkpoint_id``. Rank 0 then prints the steps its store records.

Usage: ``torchrun --nproc-per-node 2 ... dcp_failed_id_worker.py ROOT``
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch.distributed as dist
from _leave import leave
from dcp_hold_worker import policy, rank_state
from torch.distributed.checkpoint.state_dict_saver import save

from tiercheck import Checkpointer
from tiercheck.engine.coordinator import LocalCoordinator
from tiercheck.integrations.dcp import TierWriter, rank_root


def main() -> None:
    root = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    writer = TierWriter(root, policy=policy())
    for step in range(1, 7):
        sd: dict[str, object] = dict(rank_state(rank, step))
        checkpoint_id = step if step < 4 else 100 if step == 4 else None
        if step == 4 and rank == 0:
            sd["bad"] = threading.Lock()  # cannot be pickled: rank 0's write_data fails
        try:
            save(sd, storage_writer=writer, checkpoint_id=checkpoint_id)
        except BaseException:  # DCP's CheckpointException is a BaseException
            assert step == 4, step
    writer.close()
    dist.barrier()
    if rank == 0:
        with Checkpointer(
            rank_root(root, 0), read_only=True, coordinator=LocalCoordinator()
        ) as ckpt:
            print("steps", [v.step for v in ckpt.history()], flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    leave(main())
