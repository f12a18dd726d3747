"""One rank of ``benchmarks/cluster_bench.py``, run by torchrun (gloo, CPU).

    peer:  save --saves+1 versions (the first is a warm-up) of --mib MiB of float32 to a
           peer tier (``--transport tcp``: a ``peer://`` daemon per rank; ``collective``:
           the next rank's node memory over torch.distributed); every byte changes between
           saves and every version is a base, so each save moves the whole shard;
    dedup: save --saves versions of a data-parallel replica (identical on every rank,
           --mib MiB) plus --own-kib KiB of the rank's own to a remote ``file://`` tier,
           synchronously, once shared (cross-rank dedup) and once with a prefix per rank.

Each rank writes ``result-PHASE-RANK.json`` under --root with its per-save timings and
bytes written; the driver combines them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec

# ends as the tests' torchrun workers do: gloo's teardown at exit can abort a finished rank
sys.path.insert(0, str(Path(__file__).parents[2] / "tests" / "dist_scripts"))
from _leave import leave

MIB = 1 << 20
CHUNK = 4 * MIB


def record(result: Any) -> dict[str, Any]:
    return {
        "version": result.version,
        "tiers": dict(result.tiers),
        "bytes": dict(result.bytes_written),
        "chunks": dict(result.chunks_written),
        "timings": dict(result.timings),
        "logical": result.logical_bytes,
    }


def run_peer(args: argparse.Namespace, rank: int, world: int) -> list[dict[str, Any]]:
    if args.transport == "tcp":
        ports = [int(p) for p in args.ports.split(",")]
        # the daemon of the next "node", as a rank would replicate off its own node
        spec = TierSpec(
            "peer", f"peer://127.0.0.1:{ports[(rank + 1) % world]}/r{{rank}}", {"timeout": 60.0}
        )
    else:
        # one rank stands for one node: the default partner map with ranks_per_node=1
        spec = TierSpec(
            "peer",
            "collective://bench",
            {"ranks_per_node": 1, "shm_root": f"{args.shm_root}/node{{rank}}"},
        )
    policy = Policy(
        base_every=1,
        chunk_size=CHUNK,
        gc_grace_seconds=0,
        tiers={"peer": TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=1)},
    )
    g = torch.Generator().manual_seed(rank)
    state = {"w": torch.randn(args.mib * MIB // 4, generator=g)}
    out = []
    with Checkpointer(f"{args.root}/store-peer", tiers=[spec], policy=policy) as ckpt:
        for step in range(args.saves + 1):
            state["w"].add_(1.0)  # every chunk new: the whole shard crosses the wire
            dist.barrier()  # all ranks start the save together, as after a training step
            out.append(record(ckpt.save(step, state).wait()))
    return out


def run_dedup(args: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    replica = torch.randn(args.mib * MIB // 4, generator=torch.Generator().manual_seed(7))
    own = torch.randn(args.own_kib * 256, generator=torch.Generator().manual_seed(100 + rank))
    out: dict[str, Any] = {}
    for mode in ("shared", "per_rank"):
        if mode == "shared":
            spec = TierSpec(
                "remote", f"file://{args.root}/remote", {"survives": "cluster", "shared": True}
            )
        else:
            spec = TierSpec(
                "remote",
                f"file://{args.root}/remote-{{rank}}",
                {"survives": "cluster", "shared": False},
            )
        # the default GC grace: rank 0 sweeps the shared tier after each commit while the
        # other ranks may already write the next version's blobs there
        policy = Policy(
            base_every=1,
            chunk_size=CHUNK,
            tiers={"remote": TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=None)},
        )
        saves = []
        with Checkpointer(f"{args.root}/store-{mode}", tiers=[spec], policy=policy) as ckpt:
            for step in range(args.saves):
                replica.add_(1.0)
                own.add_(1.0)
                state = {"model": {"w": replica}, "own": own}
                saves.append(record(ckpt.save(step, state).wait()))
        out[mode] = saves
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["peer", "dedup"])
    p.add_argument("--root", required=True)
    p.add_argument("--shm-root", default="/dev/shm/tiercheck-bench")
    p.add_argument("--transport", choices=["tcp", "collective"], default="tcp")
    p.add_argument("--ports", default="")
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--own-kib", type=int, default=1024)
    p.add_argument("--saves", type=int, default=3)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.phase == "peer":
        result: Any = run_peer(args, rank, world)
    else:
        result = run_dedup(args, rank, world)
    Path(args.root, f"result-{args.phase}-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    leave(main())
