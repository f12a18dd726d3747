"""A torchrun worker for tests/test_fsdp_log.py: FSDP2 training guarded by the store, so
that saves are log versions of each rank's local shards (CPU, gloo).

Usage: ``torchrun --nproc-per-node 2 ... fsdp_log_worker.py ROOT NAME --steps N
[--kill-after K] [--mixed] [--out TAG] [then ROOT NAME ...]``: one run, or several one after
another (``_then.py``).

Every rank builds the same model (same seed), shards it with ``fully_shard`` over the
ranks, trains data-parallel (each rank its own batches) with AdamW, a LambdaLR schedule
and gradient clipping, and saves model, optimizer, schedule and data position after every
step into the store at ``ROOT/NAME``
(shm, one segment store per rank). If the store holds a version, it is restored first
(into the fresh model and optimizer: base, replay, verify) and training resumes after it.

Per rank it writes ``ROOT/TAG-RANK.json`` (the role and shm bytes of every save, the
restore's outcome) and ``ROOT/TAG-RANK.pt`` (every tensor, global, at the end); with
``--kill-after K`` it writes the local tensors as saved at step K to
``ROOT/TAG-saved-RANK.pt`` and every rank SIGKILLs itself once that save is committed; a
restore writes what it restored to ``ROOT/TAG-restored-RANK.pt``.

``--mixed``: mixed precision, bf16 parameters and fp32 optimizer state. The model is bf16
(its sharded parameters, gradients and their reduction), the optimizer updates fp32 master
copies of the shards (DTensors too) and keeps fp32 moments; after each step the bf16
parameters are set from the masters (they are the guard's ``mirrors``). Gradients are
clipped in bf16 and cast up to the masters' ``.grad``, exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _leave import leave
from _then import command_lines
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec


class Run:
    def __init__(self, mixed: bool) -> None:
        torch.manual_seed(1234)  # the same full model on every rank, then sharded
        # odd sizes: uneven pieces over 2 ranks (257 = 129 + 128, 9 = 5 + 4); 86 k
        # parameters, ~0.5 MiB of fp32 parameters and AdamW state per rank
        self.model = nn.Sequential(
            nn.Linear(24, 257), nn.Tanh(), nn.Linear(257, 300), nn.Tanh(), nn.Linear(300, 9)
        )
        if mixed:
            self.model.to(torch.bfloat16)
        for layer in (self.model[0], self.model[2], self.model[4]):
            fully_shard(layer)
        fully_shard(self.model)
        self.masters: list[torch.Tensor] = []
        params = list(self.model.parameters())
        if mixed:
            self.masters = [p.detach().float().requires_grad_(True) for p in params]
            params = self.masters
        self.mirrors = list(zip(self.masters, self.model.parameters()))
        self.opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 / (1 + 0.1 * s))
        self.loader = {"position": 0}

    def state(self) -> dict[str, Any]:
        state = {"model": self.model, "optim": self.opt, "sched": self.sched}
        return {**state, "master": self.masters, "loader": self.loader}

    def step(self) -> None:
        rank = dist.get_rank()
        g = torch.Generator().manual_seed(1000 * self.loader["position"] + rank)
        self.loader["position"] += 1
        x, y = torch.randn(16, 24, generator=g), torch.randn(16, 9, generator=g)
        dtype = next(self.model.parameters()).dtype
        loss = nn.functional.mse_loss(self.model(x.to(dtype)).float(), y)
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), 0.5)
        for master, p in self.mirrors:
            master.grad = p.grad.float()  # exact: every bf16 value is an fp32 value
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad()
        self.model.zero_grad()
        with torch.no_grad():
            for master, p in self.mirrors:
                p.copy_(master)

    def tensors(self) -> dict[str, Any]:
        """Every tensor (a DTensor's global value) and the small state, by name."""

        def local(v: Any) -> Any:  # the global tensor (a collective for a DTensor)
            return (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()

        out: dict[str, Any] = {f"p/{k}": local(v) for k, v in self.model.state_dict().items()}
        out.update({f"m/{i}": local(m) for i, m in enumerate(self.masters)})
        params = [p for g in self.opt.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            for name, v in self.opt.state.get(p, {}).items():
                out[f"s/{i}/{name}"] = local(v)
        out["lr"] = torch.tensor([g["lr"] for g in self.opt.param_groups], dtype=torch.float64)
        out["sched"] = torch.tensor(self.sched.last_epoch)
        out["position"] = torch.tensor(self.loader["position"])
        return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("name")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--kill-after", type=int)
    ap.add_argument("--mixed", action="store_true")
    ap.add_argument("--out", default="run")
    ap.add_argument("--files", action="store_true", help="one file:// tier all ranks share")
    return ap


def train(args: argparse.Namespace) -> None:
    """One training run, as its command line says."""
    rank = dist.get_rank()
    root = Path(args.root)
    tiers = [TierSpec("shm", f"shm://{args.name}-{{rank}}")]
    if args.files:  # every rank reads every rank's pieces: restores onto another world size
        tiers = [TierSpec("files", f"file://{root}/{args.name}-files", {"shared": True})]
    policy = Policy(tiers={tiers[0].name: TierPolicy(versions="all", keep_bases=2)})
    run = Run(args.mixed)
    report: dict[str, Any] = {"saves": [], "restore": None}
    start = 0
    with Checkpointer(root / args.name, tiers=tiers, policy=policy) as ckpt:
        ckpt.guard(run.opt, mirrors=run.mirrors)
        if ckpt.history():
            state = run.state()
            info = ckpt.restore(state)
            run.loader = state["loader"]  # a plain dict is restored as a new one
            if args.mixed:
                run.masters = state["master"]
                run.mirrors = list(zip(run.masters, run.model.parameters()))
            start = info.step
            report["restore"] = {
                "step": info.step,
                "role": info.role,
                "replayed": info.replayed_steps,
                "fallback": info.fallback,
            }
            torch.save(run.tensors(), root / f"{args.out}-restored-{rank}.pt")
        for step in range(start + 1, args.steps + 1):  # none after a restore of --steps
            run.step()
            handle = ckpt.save(step, run.state())
            result = handle.result()
            report["saves"].append(
                {
                    "step": step,
                    "role": handle.role,
                    "logical": result.logical_bytes,
                    "shm": result.bytes_written.get("shm", 0),
                }
            )
            if step == args.kill_after:
                torch.save(run.tensors(), root / f"{args.out}-saved-{rank}.pt")
                (root / f"{args.out}-{rank}.json").write_text(json.dumps(report))
                dist.barrier()  # both ranks' files are written: die together
                os.kill(os.getpid(), signal.SIGKILL)
    torch.save(run.tensors(), root / f"{args.out}-{rank}.pt")
    (root / f"{args.out}-{rank}.json").write_text(json.dumps(report))


def main() -> None:
    runs = [parser().parse_args(line) for line in command_lines(sys.argv[1:])]
    dist.init_process_group("gloo")
    for args in runs:
        train(args)
    dist.destroy_process_group()


if __name__ == "__main__":
    leave(main())
