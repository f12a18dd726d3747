"""Run under torchrun by tests/test_restore_world.py, one phase per launch, on a store of
per-rank LMDB tiers and a shared ``file://`` remote: ``save STEP`` saves ``{"w": ...}``
(rank-dependent values) at STEP; ``restore`` restores into a state of the right shape;
``mismatch`` restores with rank 1's state of another shape. Each rank writes what it saw
to ``result-PHASE-RANK.json`` beside the store root."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _leave import leave

import tiercheck
from tiercheck import TierSpec


def values(step: int, rank: int) -> torch.Tensor:
    return torch.arange(256, dtype=torch.float32) + 1000 * step + rank


def main() -> None:
    root, phase = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tiers = [
        TierSpec("lmdb", f"lmdb://{root}/lmdb-{{rank}}"),
        TierSpec("remote", f"file://{root}/remote"),
    ]
    out: dict[str, object] = {"rank": rank}
    with tiercheck.Checkpointer(root, tiers=tiers) as ckpt:
        if phase == "save":
            step = int(sys.argv[3])
            ckpt.save(step, {"w": values(step, rank)}).wait_migrated()
        else:
            size = 128 if phase == "mismatch" and rank == 1 else 256
            state = {"w": torch.zeros(size)}
            try:
                info = ckpt.restore(state)
                out["step"] = info.step if info is not None else None
                out["fallback"] = info.fallback if info is not None else None
                out["exact"] = bool(torch.equal(state["w"], values(1, rank)))
            except tiercheck.errors.TiercheckError as exc:
                out["error"] = f"{type(exc).__name__}: {exc}"
            out["zeros"] = bool(not state["w"].any())
    Path(root).with_name(f"result-{phase}-{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    leave(main())
