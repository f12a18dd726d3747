"""A rank of a multi-rank job saving log versions, run by torchrun in
tests/test_log_versions.py.

Each rank trains its own small model (its shard: different parameters and data on every
rank) with AdamW, guarded by the store, and saves after every step: a base, then log
versions, each rank logging its own optimizer. Then it opens the store again, restores
the newest version into a fresh model and optimizer (base + replay on every rank) and
writes what came back and whether it is bit-identical to what was saved.

    log_worker.py --root DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _leave import leave
from torch import nn

from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec


class Shard:
    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.data = torch.Generator().manual_seed(seed + 7)

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optim": self.opt}

    def step(self) -> None:
        x = torch.randn(8, 16, generator=self.data)
        loss = self.model(x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"model/{k}": v.detach().clone() for k, v in self.model.state_dict().items()}
        for pid, st in self.opt.state_dict()["state"].items():
            for k, v in st.items():
                out[f"optim/{pid}/{k}"] = v.clone()
        return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = Path(args.root)
    tiers = [TierSpec("shm", "shm://lv-{rank}", {"root": f"{root}/shm{{rank}}"})]
    policy = Policy(tiers={"shm": TierPolicy(versions="all", keep_bases=1)})
    shard = Shard(seed=100 + rank)
    roles = []
    with Checkpointer(root / "store", tiers=tiers, policy=policy) as ckpt:
        ckpt.guard(shard.opt)
        for step in (1, 2, 3):
            shard.step()
            roles.append(ckpt.save(step, shard.state()).result().role)
    saved = shard.tensors()
    fresh = Shard(seed=999)
    with Checkpointer(root / "store", tiers=tiers, policy=policy) as ckpt:
        ckpt.guard(fresh.opt)
        info = ckpt.restore(fresh.state())
    back = fresh.tensors()
    same = saved.keys() == back.keys() and all(
        torch.equal(saved[k].view(-1).view(torch.uint8), back[k].view(-1).view(torch.uint8))
        for k in saved
    )
    (root / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "roles": roles,
                "role": info.role,
                "step": info.step,
                "replayed": info.replayed_steps,
                "fallback": info.fallback,
                "identical": same,
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    leave(main())
