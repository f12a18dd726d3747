"""One rank of benchmarks/protocol.py, run by torchrun: the commit protocol alone.

Drives :class:`tiercheck.engine.coordinator.DistCoordinator` through the four steps of a
save (exchange, decide, confirm, settle) for ``--saves`` versions after ``--warmup``, with
``--chunks`` chunk ids per rank: ``sharded`` (every rank's its own) or ``replicated`` (the
same ids on every rank, data parallel). No tiers, no data: what a save costs a rank in the
protocol itself. Per save: seconds (after a barrier, so every rank starts together), bytes
the protocol's collectives delivered to this rank, collective calls. Then the same
messages as the protocol before issue 24 sent them (every rank's id list all-gathered,
then the vote and the confirmation all-gathered) for the baseline. Writes ``--out``-RANK.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from tiercheck.engine.coordinator import DistCoordinator, Vote
from tiercheck.formats.ids import chunk_id

# ends as the tests' torchrun workers do: gloo's teardown at exit can abort a finished rank
sys.path.insert(0, str(Path(__file__).parents[2] / "tests" / "dist_scripts"))
from _leave import leave


def ids_for(rank: int, version: int, chunks: int, mode: str) -> list[tuple[str, int]]:
    owner = 0 if mode == "replicated" else rank
    return [(chunk_id(f"{owner}/{version}/{i}".encode()), 4 << 20) for i in range(chunks)]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--chunks", type=int, default=300)
    p.add_argument("--mode", choices=["sharded", "replicated"], default="sharded")
    p.add_argument("--saves", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    coord = DistCoordinator(timeout=300.0)
    group = coord._group
    saves: list[dict[str, Any]] = []
    for v in range(args.warmup + args.saves):
        chunks = ids_for(rank, v, args.chunks, args.mode)
        manifest = chunk_id(f"manifest/{rank}/{v}".encode())
        dist.barrier(group=group)
        b0, c0 = coord.received, coord.calls
        t0 = time.perf_counter()
        ex = coord.exchange(v, chunks)
        t1 = time.perf_counter()
        d = coord.decide(v, Vote(rank, True, manifest, ("shm",)))
        t2 = time.perf_counter()
        c = coord.confirm(v, {"remote": True})
        s = coord.settle(v, "")
        t3 = time.perf_counter()
        assert ex.ok and d.commit and c.ok and not s, (ex.reason, d.reason, c.reason, s)
        if v < args.warmup:
            continue
        saves.append(
            {
                "seconds": t3 - t0,
                "exchange_s": t1 - t0,
                "decide_s": t2 - t1,
                "confirm_settle_s": t3 - t2,
                "bytes": coord.received - b0,
                "calls": coord.calls - c0,
                "owned": len(ex.owned or ()),
            }
        )
    # the same messages as the protocol before issue 24: all-gathers of every rank's list
    baseline: list[dict[str, Any]] = []
    for v in range(args.warmup + args.saves):
        chunks = ids_for(rank, v, args.chunks, args.mode)
        dist.barrier(group=group)
        b0 = coord.received
        t0 = time.perf_counter()
        head = {"step": "exchange", "version": v, "ok": True, "reason": ""}
        everyone = coord.net.all_gather_bytes(
            msgpack.packb({**head, "chunks": [[c, n] for c, n in chunks]})
        )
        lists = [msgpack.unpackb(b)["chunks"] for b in everyone]
        vote = {"step": "vote", "version": v, "ok": True, "manifest": "f" * 64, "reason": ""}
        coord.net.all_gather_bytes(msgpack.packb(vote))
        conf = {"step": "confirm", "version": v, "committed": ["shm"], "shared": ["remote"]}
        coord.net.all_gather_bytes(msgpack.packb({**conf, "skipped": []}))
        t1 = time.perf_counter()
        assert len(lists) == dist.get_world_size()
        if v >= args.warmup:
            baseline.append({"seconds": t1 - t0, "bytes": coord.received - b0})
    # the transport alone: one 8-byte all-reduce, one all-to-all of 4 bytes per rank, and
    # one all-gather of 1 MiB per rank (bandwidth)
    world = dist.get_world_size()
    small = torch.zeros(1, dtype=torch.int64)
    counts = torch.zeros(world, dtype=torch.int32)
    big = torch.zeros(1 << 20, dtype=torch.uint8)
    transport: dict[str, list[float]] = {
        "all_reduce_s": [],
        "all_to_all_s": [],
        "gather_1mib_s": [],
    }
    for i in range(args.warmup + args.saves):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        dist.all_reduce(small, op=dist.ReduceOp.MAX, group=group)
        t1 = time.perf_counter()
        dist.all_to_all_single(torch.empty_like(counts), counts, group=group)
        t2 = time.perf_counter()
        outs = [torch.empty_like(big) for _ in range(world)]
        dist.barrier(group=group)
        t3 = time.perf_counter()
        dist.all_gather(outs, big, group=group)
        t4 = time.perf_counter()
        if i >= args.warmup:
            transport["all_reduce_s"].append(t1 - t0)
            transport["all_to_all_s"].append(t2 - t1)
            transport["gather_1mib_s"].append(t4 - t3)
    result = {
        "transport": {k: statistics.median(v) for k, v in transport.items()},
        "rank": rank,
        "world": dist.get_world_size(),
        "saves": saves,
        "baseline": baseline,
        "median_s": statistics.median(s["seconds"] for s in saves),
    }
    with open(f"{args.out}-{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier(group=group)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    leave(main())
