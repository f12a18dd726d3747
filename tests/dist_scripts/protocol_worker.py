"""A rank that counts what the commit protocol costs it per save, run by torchrun in
tests/test_protocol_scale.py.

Each rank holds a fully sharded state (a tensor of its own, ``--chunks`` chunks of 16 KiB,
new content every save) and saves it ``--saves`` times after one warm-up save to its own
shm tier and a shared ``file://`` tier written synchronously (so the chunk exchange names
the writers). Every ``torch.distributed`` collective the process makes is counted by a
forwarding wrapper around the module's functions: the bytes its output tensors received
and the number of calls, per save (from ``save()`` to ``wait()``). Prints nothing; writes
one JSON line to ``--out``-RANK.json.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _leave import leave

from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.engine.coordinator import DistCoordinator

CHUNK = 16 * 1024


class Counter:
    """Bytes and calls of every collective this process makes, by output tensor."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0

    def install(self) -> None:
        outputs: dict[str, Callable[..., list[torch.Tensor]]] = {
            "all_reduce": lambda t, *a, **k: [t],
            "broadcast": lambda t, *a, **k: (
                [t] if k.get("src", a[0] if a else 0) != RANK[0] else []
            ),
            "all_gather": lambda out, *a, **k: list(out),
            "all_gather_into_tensor": lambda out, *a, **k: [out],
            "all_to_all_single": lambda out, *a, **k: [out],
            "all_to_all": lambda out, *a, **k: list(out),
            "reduce_scatter": lambda out, *a, **k: [out],
            "reduce_scatter_tensor": lambda out, *a, **k: [out],
            "scatter": lambda out, *a, **k: [out],
            "gather": lambda t, gather_list=None, *a, **k: list(gather_list or []),
            "recv": lambda t, *a, **k: [t],
            "irecv": lambda t, *a, **k: [t],
        }
        for name, received in outputs.items():
            setattr(dist, name, self._counting(getattr(dist, name), received))

    def _counting(
        self, real: Callable[..., Any], received: Callable[..., list[torch.Tensor]]
    ) -> Callable[..., Any]:
        @functools.wraps(real)
        def call(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            self.calls += 1
            self.bytes += sum(t.numel() * t.element_size() for t in received(*args, **kwargs))
            return out

        return call


RANK = [0]


def _protocol(coordinator: DistCoordinator) -> tuple[int, int]:
    """What the coordinator counts itself: bytes received, calls (0, 0 if it counts none)."""
    return getattr(coordinator, "received", 0), getattr(coordinator, "calls", 0)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--shm-root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--chunks", type=int, default=48)
    p.add_argument("--saves", type=int, default=3)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = RANK[0] = dist.get_rank()
    counter = Counter()
    counter.install()
    tiers = [
        TierSpec("shm", "shm://proto-{rank}", {"root": f"{args.shm_root}/node{{rank}}"}),
        TierSpec("remote", f"file://{args.root}/remote", {"survives": "cluster", "shared": True}),
    ]
    policy = Policy(
        chunk_size=CHUNK,
        gc_grace_seconds=0,
        tiers={"remote": TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=None)},
    )
    coordinator = DistCoordinator(timeout=120.0)
    ckpt = Checkpointer(f"{args.root}/store", tiers=tiers, policy=policy, coordinator=coordinator)
    per_save: list[dict[str, Any]] = []
    try:
        for step in range(args.saves + 1):
            g = torch.Generator().manual_seed(step * 1000 + rank)
            state = {"own": torch.randn(args.chunks * CHUNK // 4, generator=g)}
            b0, c0 = counter.bytes, counter.calls
            p0, q0 = _protocol(coordinator)
            r = ckpt.save(step, state).wait()
            if step == 0:
                continue  # the warm-up
            per_save.append(
                {
                    "bytes": counter.bytes - b0,
                    "calls": counter.calls - c0,
                    "protocol_bytes": _protocol(coordinator)[0] - p0,
                    "protocol_calls": _protocol(coordinator)[1] - q0,
                    "tiers": dict(r.tiers),
                    "remote_chunks": r.chunks_written.get("remote", 0),
                }
            )
        dist.barrier()
    finally:
        ckpt.close(timeout=60)
    with open(f"{args.out}-{rank}.json", "w") as f:
        json.dump({"rank": rank, "world": dist.get_world_size(), "saves": per_save}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    leave(main())
