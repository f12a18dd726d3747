"""Run under torchrun by tests/test_losses.py, one phase per launch, on a store of per-rank
shm segments (every version) and per-rank LMDB tiers (bases only): ``save`` saves steps 1
(a base) and 2 (a diff), each acknowledged; ``restore`` restores and writes what it
reported to ``result-restore-RANK.json`` beside the store root."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _leave import leave

import tiercheck
from tiercheck import Policy, TierPolicy, TierSpec


def main() -> None:
    root, shm_root, name, phase = sys.argv[1:5]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tiers = [
        TierSpec("shm", f"shm://{name}-{{rank}}", {"root": shm_root}),
        TierSpec("lmdb", f"lmdb://{root}/lmdb-{{rank}}"),
    ]
    policy = Policy(base_every=10, tiers={"lmdb": TierPolicy(versions="base")})
    state = {"w": torch.zeros(1024)}
    with tiercheck.Checkpointer(root, tiers=tiers, policy=policy) as ckpt:
        if phase == "save":
            for step in (1, 2):
                state["w"] += 1.0
                ckpt.save(step, state).wait()
            out: dict[str, object] = {}
        else:
            info = ckpt.restore(state)
            assert info is not None
            lost = info.lost
            out = {
                "rank": rank,
                "step": info.step,
                "lost_steps": None if lost is None else list(lost.steps),
                "lost_rank": None if lost is None else lost.rank,
                "text": str(lost),
            }
    if phase == "restore":
        Path(root).with_name(f"result-restore-{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    leave(main())
