"""A rank of a job spread over two torchrun "nodes" on one machine (tests/test_cluster_nodes.py).

Each torchrun launch (``--nnodes 2 --node-rank N``) is one node: its ranks see
``GROUP_RANK=N``, and their node-local tiers live under that node's directories through the
``{node}`` placeholder, so wiping one node's directories is a real node loss. The peer tier
is ``collective://`` with the default partner map, ``(rank + ranks_per_node) % world``: a
rank on the other node. The remote tier is shared by every rank.

Every rank holds a data-parallel replica (identical on all ranks) and a small tensor of its
own, both a pure function of (step, rank), so the test can check any restored step.

    save:    save every step 1..--steps; one event per acknowledged step
    restore: restore the newest version every rank can restore; one event with what came back

Several scenarios, each a command line of its own (its own ``--root`` and ``--shm-root``),
can run one after another in one launch, separated by ``then`` (``_then.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from _leave import leave
from _then import command_lines

from tiercheck import Checkpointer, Policy, TierSpec

REPLICA = 128 * 1024  # floats: 512 KiB, 8 chunks of 64 KiB


def state_for(step: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(2000 + step // 3)  # changes every 3 steps
    replica = torch.randn(REPLICA, generator=g)
    replica[: 1024 * (step % 3)] += 1.0  # small changes inside a base period
    own = torch.randn(512, generator=torch.Generator().manual_seed(step * 100 + rank))
    return {"model": {"w": replica}, "own": own, "meta": {"step": step, "rank": rank}}


def specs(args: argparse.Namespace) -> list[TierSpec]:
    node_shm = f"{args.shm_root}/node{{node}}"
    return [
        TierSpec("shm", "shm://rank-{local_rank}", {"root": node_shm}),
        TierSpec("peer", "collective://npeer", {"shm_root": node_shm}),
        TierSpec("lmdb", f"lmdb://{args.root}/node{{node}}/lmdb-{{local_rank}}"),
        TierSpec("remote", f"file://{args.root}/remote", {"survives": "cluster", "shared": True}),
    ]


EVENTS: list[str] = []


def emit(**fields: Any) -> None:
    """One JSON line per event, in this rank's own file."""
    with open(EVENTS[0], "a") as f:
        f.write(json.dumps(fields) + "\n")


def placement(ckpt: Checkpointer) -> dict[str, Any]:
    peer = ckpt.tierset.get("peer").tier
    return {
        "rank": ckpt.rank,
        "node": ckpt.coordinator.node,
        "group_rank": int(os.environ["GROUP_RANK"]),
        "local_rank": ckpt.coordinator.local_rank,
        "partner": getattr(peer, "partner", None),
    }


def save(args: argparse.Namespace, ckpt: Checkpointer) -> None:
    where = placement(ckpt)
    for step in range(1, args.steps + 1):
        r = ckpt.save(step, state_for(step, ckpt.rank)).wait()
        emit(event="ack", step=step, version=r.version, role=r.role, tiers=dict(r.tiers), **where)
    ckpt.wait_migrations(timeout=60)
    dist.barrier()
    # a GC pass reads only this rank's manifests on its per-rank tiers
    reports = ckpt.gc(dry_run=True)
    emit(event="gc", kept={r.tier: r.kept for r in reports}, **where)


def restore(args: argparse.Namespace, ckpt: Checkpointer) -> None:
    target = state_for(0, ckpt.rank)
    info = ckpt.restore(target)
    expected = state_for(info.step, ckpt.rank)
    exact = all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in (
            (target["model"]["w"], expected["model"]["w"]),
            (target["own"], expected["own"]),
        )
    ) and (target["meta"] == expected["meta"])
    emit(
        event="restored",
        step=info.step,
        version=info.version,
        source=info.source,
        chunks_from=dict(info.chunks_from),
        exact=exact,
        **placement(ckpt),
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["save", "restore"])
    p.add_argument("--root", required=True)
    p.add_argument("--shm-root", required=True)
    p.add_argument("--steps", type=int, default=5)
    return p


def scenario(args: argparse.Namespace) -> None:
    EVENTS[:] = [f"{args.root}/events-{args.phase}-{dist.get_rank()}.jsonl"]
    node = os.environ["GROUP_RANK"]
    # the default GC grace: rank 0 sweeps the shared tier while other ranks may still be
    # migrating into it, and only the grace period keeps their new blobs
    policy = Policy(base_every=3, chunk_size=64 * 1024)
    ckpt = Checkpointer(f"{args.root}/node{node}/store", tiers=specs(args), policy=policy)
    try:
        save(args, ckpt) if args.phase == "save" else restore(args, ckpt)
    finally:
        ckpt.close(timeout=60)


def main() -> int:
    runs = [parser().parse_args(line) for line in command_lines(sys.argv[1:])]
    dist.init_process_group("gloo")
    for args in runs:
        scenario(args)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    leave(main())
