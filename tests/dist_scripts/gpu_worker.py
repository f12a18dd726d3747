"""A rank of a 2-GPU NCCL job, run by torchrun in tests/test_gpu.py.

Each rank trains a toy state on its own GPU (``cuda:LOCAL_RANK``) with an NCCL all-reduce
per step, saves every step through tiercheck (its 2PC runs on a gloo group of its own),
then restores the newest version into fresh CUDA tensors and checks: bit-exact, still on
its device, the trainer's NCCL group still usable, and no CUDA context created on the
other rank's GPU. One JSON line per rank goes to ``--out/rank-R.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _leave import leave

import tiercheck
from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec


def has_context(index: int) -> bool | None:
    probe = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    return None if probe is None else bool(probe(index))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--shm-root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank = dist.get_rank()
    device = torch.device("cuda", local)
    g = torch.Generator(device=device).manual_seed(1234)  # same replica on every rank
    w = torch.randn(1 << 20, device=device, generator=g)  # 4 MiB: several chunks
    own = torch.full((4096,), float(rank), device=device)
    tiers = [
        TierSpec("shm", "shm://gpu-{rank}", {"root": args.shm_root}),
        TierSpec("lmdb", f"lmdb://{args.root}/lmdb-{{rank}}"),
    ]
    policy = Policy(
        base_every=2,
        chunk_size=1 << 20,
        gc_grace_seconds=0,
        tiers={"lmdb": TierPolicy(versions="all", keep_bases=1)},
    )
    result: dict[str, Any] = {"rank": rank}
    warm = torch.ones(8, device=device)
    dist.all_reduce(warm)  # NCCL is up (and made whatever contexts it makes) before tiercheck
    torch.cuda.synchronize(device)
    other = 1 - local
    result["context_on_other_gpu_before"] = has_context(other)
    ckpt = Checkpointer(f"{args.root}/store", tiers=tiers, policy=policy)
    try:
        for step in range(1, args.steps + 1):
            grad = torch.ones_like(w) * (step + rank)
            dist.all_reduce(grad)  # the trainer's NCCL traffic between saves
            w.add_(grad, alpha=1e-3)
            own.add_(1.0)
            ckpt.save(step, {"w": w, "own": own, "step": step}).wait()
        expected_w, expected_own = w.clone(), own.clone()
        back: dict[str, Any] = {
            "w": torch.zeros_like(w),
            "own": torch.zeros_like(own),
            "step": 0,
        }
        info = ckpt.restore(back)
        result["step"] = info.step
        result["exact"] = bool(
            torch.equal(back["w"], expected_w) and torch.equal(back["own"], expected_own)
        )
        result["on_device"] = back["w"].device == device and back["own"].device == device
        check = torch.ones(8, device=device)
        dist.all_reduce(check)
        torch.cuda.synchronize(device)
        result["allreduce_after"] = float(check[0].item())
        result["context_on_other_gpu"] = has_context(other)
    finally:
        ckpt.close(timeout=60)
    Path(args.out, f"rank-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    assert tiercheck.__version__
    leave(main())
