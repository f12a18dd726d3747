"""A rank of a job that saves log versions on two ranks, each rank's shm its own (the
default store's shape), run by torchrun in tests/test_restore_world.py; the restore then
runs in one process (fewer ranks), which cannot read rank 1's log.

    fewer_worker.py ROOT save       (under torchrun, 2 ranks)
    fewer_worker.py ROOT restore    (one process: writes ROOT.result.json)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from _leave import leave

from tiercheck import Checkpointer


def main() -> None:
    root, mode = Path(sys.argv[1]), sys.argv[2]
    rank = 0
    if mode == "save":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters())
    ckpt = Checkpointer(root)
    ckpt.guard(opt)
    if mode == "save":
        roles = []
        for step in range(1, 4):
            model(torch.randn(4, 16) + rank).square().mean().backward()  # each rank its data
            opt.step()
            opt.zero_grad()
            roles.append(ckpt.save(step, {"model": model, "optim": opt}).wait().role)
            if step == 1 and rank == 0:
                torch.save(model.state_dict(), f"{root}.base.pt")
        ckpt.close()
        assert roles == ["base", "log", "log"], roles
        leave()
        return
    try:
        info = ckpt.restore({"model": model, "optim": opt})
        want = torch.load(f"{root}.base.pt")
        row = {
            "step": info.step,
            "role": info.role,
            "fallback": info.fallback,
            "exact": all(torch.equal(model.state_dict()[k], want[k]) for k in want),
        }
    except Exception as exc:
        row = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        ckpt.close()
    Path(f"{root}.result.json").write_text(json.dumps(row))


if __name__ == "__main__":
    main()
