"""Run under torchrun by tests/test_losses.py and tests/test_lost_rows.py, one phase per
launch, on a store of per-rank shm segments (every version) and per-rank LMDB tiers (the
newest two bases) under one shared root: ``save`` saves steps 1 (a base) and 2 (a diff),
each acknowledged; ``restore`` restores and writes what it reported; ``resume`` restores,
saves step 3 and writes each rank's history, before and after that save. Each writes to
``result-PHASE-RANK.json`` beside the store root."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _leave import leave

import tiercheck
from tiercheck import Policy, TierPolicy, TierSpec


def _rows(ckpt: tiercheck.Checkpointer) -> list[dict[str, Any]]:
    return [
        {"id": v.id, "step": v.step, "restorable": v.restorable, "gone": v.gone}
        for v in ckpt.history()
    ]


def main() -> None:
    root, shm_root, name, phase = sys.argv[1:5]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tiers = [
        TierSpec("shm", f"shm://{name}-{{rank}}", {"root": shm_root}),
        TierSpec("lmdb", f"lmdb://{root}/lmdb-{{rank}}"),
    ]
    policy = Policy(base_every=10, tiers={"lmdb": TierPolicy(versions="base", keep_bases=2)})
    state = {"w": torch.zeros(1024)}
    out: dict[str, Any] = {"rank": rank}
    with tiercheck.Checkpointer(root, tiers=tiers, policy=policy) as ckpt:
        if phase == "save":
            for step in (1, 2):
                state["w"] += 1.0
                ckpt.save(step, state).wait()
        elif phase == "restore":
            info = ckpt.restore(state)
            assert info is not None
            lost = info.lost
            out["step"] = info.step
            out["lost_steps"] = None if lost is None else list(lost.steps)
            out["lost_rank"] = None if lost is None else lost.rank
            out["text"] = str(lost)
        else:
            info = ckpt.restore(state)
            assert info is not None
            out["restored"] = info.step
            out["before"] = _rows(ckpt)
            out["saved"] = ckpt.save(3, state).wait().version
            out["after"] = _rows(ckpt)
    if phase != "save":
        Path(root).with_name(f"result-{phase}-{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    leave(main())
