"""A torchrun worker for tests/test_fsdp.py: FSDP2 (``fully_shard``) state through
``Checkpointer.save/restore`` (CPU, gloo).

Usage: ``torchrun --nproc-per-node 2 ... fsdp_worker.py ROOT``

1. Restore ``ROOT/one`` (saved by one process, the test itself, with global values in
   ``ROOT/one.pt``) into a fresh FSDP2 model and optimizer sharded over the 2 ranks: 1 -> 2.
2. Train a fresh model sharded over the 2 ranks for 3 steps, save model and optimizer to
   ``ROOT/two`` as step 3, write the global values (``full_tensor()``) to ``ROOT/two.pt``
   (rank 0), restore into another fresh model and optimizer on the same mesh and check
   every value bit for bit; then one more step on both must agree bit for bit too.

The test restores ``ROOT/two`` on one process afterwards (2 -> 1). Each rank prints
``OK <rank>`` at the end; any mismatch raises. The helpers are the test's too.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _leave import leave
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tiercheck import Checkpointer, TierSpec


def build(shard: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    # every build on a rank starts from the same init: a restore that did nothing would
    # leave it, and it differs from the trained state that was saved
    torch.manual_seed(1234 + dist.get_rank())
    # odd row counts: uneven pieces over 2 ranks (11 + 10, 351 + 350, 3 + 2); ~110 KiB of
    # state per rank, so each rank's stream is 2 chunks and some pieces straddle chunks
    model = nn.Sequential(
        nn.Linear(12, 21), nn.ReLU(), nn.Linear(21, 701), nn.ReLU(), nn.Linear(701, 5)
    )
    if shard:
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(8, 12, generator=g), torch.randn(8, 5, generator=g)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


def full(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Global values: every parameter and every optimizer state tensor (by position)."""
    out: dict[str, Any] = {f"p/{k}": full(v).clone() for k, v in model.state_dict().items()}
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for name, v in opt.state.get(p, {}).items():
            out[f"s/{i}/{name}"] = full(v).clone()
    return out


def check(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    if got.keys() != want.keys():
        raise AssertionError(f"{what}: keys {sorted(got)} != {sorted(want)}")
    for k in want:
        a, b = got[k], want[k]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            raise AssertionError(f"{what}: {k} differs")


def store(root: Path) -> Checkpointer:
    """One shared file tier: every rank reads every rank's pieces from it."""
    tier = TierSpec("files", f"file://{root}/files", {"shared": True})
    return Checkpointer(root, tiers=[tier])


def main() -> None:
    root = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with store(root / "one") as ckpt:
        model, opt = build(shard=True)
        ckpt.restore({"model": model, "optim": opt})
        check(snapshot(model, opt), torch.load(root / "one.pt"), "restore 1 -> 2")
    with store(root / "two") as ckpt:
        model, opt = build(shard=True)
        for i in range(3):
            step(model, opt, i)
        ckpt.save(3, {"model": model, "optim": opt}).wait()
        want = snapshot(model, opt)
        if rank == 0:
            torch.save(want, root / "two.pt")
        model2, opt2 = build(shard=True)
        ckpt.restore({"model": model2, "optim": opt2})
        check(snapshot(model2, opt2), want, "same-mesh restore")
        step(model, opt, 3)
        step(model2, opt2, 3)
        check(snapshot(model2, opt2), snapshot(model, opt), "a step after restore")
    dist.destroy_process_group()
    print(f"OK {rank}", flush=True)


if __name__ == "__main__":
    leave(main())
