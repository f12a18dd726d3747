"""A torchrun worker for tests/test_dcp_dist.py: DCP save/load of DTensor state on tiercheck.

Usage: ``torchrun --nproc-per-node 2 ... dcp_worker.py MODE ROOT STEP``

- ``save``: save a ``Shard(0)``-sharded state as ``step:STEP``, then load it back on the
  same 2 ranks into ``Shard(1)`` and ``Replicate`` targets and check every value.
- ``crash``: save ``step:STEP`` but rank 1 dies (``os._exit``) in ``write_data`` after its
  shard has started to be written; never returns normally on rank 1.

Values depend only on STEP (see :func:`full_state`), so the test process can check them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _leave import leave
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.futures import Future

from tiercheck import Policy, TierPolicy
from tiercheck.integrations.dcp import TierReader, TierWriter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def tiers(root: Path) -> list[tuple[str, str]]:
    return [("lmdb", f"lmdb://{root}/lmdb"), ("files", f"file://{root}/files")]


def policy() -> Policy:
    keep = TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=None)
    return Policy(base_every=10, chunk_size=16 * 1024, tiers={"lmdb": keep, "files": keep})


def full_state(step: int) -> dict[str, Any]:
    """The global (unsharded) values saved at ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "w": torch.randn(64, 48, generator=g),
        "b": torch.arange(64, dtype=torch.float64) + step,
        "emb": torch.randn(32, 16, generator=g).to(torch.bfloat16),
        "step": step,
    }


class CrashingWriter(TierWriter):  # type: ignore[misc]
    """Rank 1 dies in the middle of writing its shard."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self._rank == 1:
            ckpt = self.checkpointer
            assert ckpt is not None
            items = {}
            for it in plan.items:
                key, value, _ = self._resolve(it, planner)
                items[key] = value
            handle = ckpt.save(999, {"dcp_items": items})
            handle.wait_staged()
            os._exit(17)
        result: Future[list[WriteResult]] = super().write_data(plan, planner)
        return result


def main() -> None:
    mode, root, step = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = full_state(step)
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items() if k != "step"}
    state["step"] = full["step"]
    writer_cls = CrashingWriter if mode == "crash" else TierWriter
    with writer_cls(root, tiers=tiers, policy=policy()) as writer:
        save(state, checkpoint_id=f"step:{step}", storage_writer=writer)
    if mode == "crash":
        raise SystemExit(f"rank {rank}: the crashing save returned")

    for other in (Shard(1), Replicate()):
        places = {k: other if v.dim() > 1 else Replicate() for k, v in full.items() if k != "step"}
        target: dict[str, Any] = {
            k: distribute_tensor(torch.zeros_like(full[k]), mesh, [p]) for k, p in places.items()
        }
        target["step"] = -1
        load(target, checkpoint_id=f"step:{step}", storage_reader=TierReader(root))
        for k, v in full.items():
            got = target[k]
            if isinstance(got, DTensor):
                assert got.placements == (places[k],), (k, got.placements)
                got = got.full_tensor()
                assert got.dtype == v.dtype and torch.equal(got, v), f"{k} differs ({places[k]})"
            else:
                assert got == v, (k, got, v)
    dist.barrier()
    print(f"rank {rank}: OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    leave(main())
