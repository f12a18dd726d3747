"""A rank of a multi-rank checkpointing job, run by torchrun in tests/test_cluster.py.

Every rank holds a data-parallel replica (identical on all ranks) and a small tensor of
its own, both a pure function of (step, rank), so a test can check any restored step.

    save:    save every step 1..--steps; print one JSON line per acknowledged step
    restore: restore the newest version every rank can restore; print what came back

Several scenarios, each a command line of its own (its own ``--root`` and ``--shm-root``),
can run one after another in one launch, separated by ``then`` (``_then.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _leave import leave
from _then import command_lines

import tiercheck
from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.engine.coordinator import DistCoordinator
from tiercheck.formats import Codec, chunk_id, encode_blob
from tiercheck.store.leases import TierLeases

REPLICA = 256 * 1024  # floats: 1 MiB, 16 chunks of 64 KiB


def state_for(step: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 + step // 3)  # changes every 3 steps
    replica = torch.randn(REPLICA, generator=g)
    replica[: 1024 * (step % 3)] += 1.0  # small changes inside a base period
    own = torch.randn(512, generator=torch.Generator().manual_seed(step * 100 + rank))
    return {"model": {"w": replica}, "own": own, "meta": {"step": step, "rank": rank}}


def specs(args: argparse.Namespace) -> list[TierSpec]:
    out = [
        TierSpec("shm", "shm://cluster-{rank}", {"root": f"{args.shm_root}/node{{rank}}"}),
        TierSpec("lmdb", f"lmdb://{args.root}/node{{rank}}/lmdb-{{local_rank}}"),
        TierSpec("remote", f"file://{args.root}/remote", {"survives": "cluster", "shared": True}),
    ]
    if args.peer_ports:
        ports = [int(p) for p in args.peer_ports.split(",")]
        rank = dist.get_rank()
        port = ports[(rank + 1) % len(ports)]  # the daemon on the next "node"
        # a loaded machine can stall a peer call for seconds: a dead daemon refuses at once
        out.insert(1, TierSpec("peer", f"peer://127.0.0.1:{port}/r{{rank}}", {"timeout": 20.0}))
    if args.collective:
        # each rank stands for a node: the partner of rank r is rank r+1 (mod world)
        out.insert(
            1,
            TierSpec(
                "peer",
                "collective://cpeer",
                {"ranks_per_node": 1, "shm_root": f"{args.shm_root}/node{{rank}}"},
            ),
        )
    return out


def policy(args: argparse.Namespace) -> Policy:
    remote = (
        TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=None)
        if args.remote_sync
        else TierPolicy(versions="base", mode="async", codec="zstd", keep_bases=None)
    )
    return Policy(base_every=3, chunk_size=64 * 1024, gc_grace_seconds=0, tiers={"remote": remote})


EVENTS: list[str] = []


def emit(**fields: Any) -> None:
    """One JSON line per event, in this rank's own file (ranks share stdout)."""
    with open(EVENTS[0], "a") as f:
        f.write(json.dumps(fields) + "\n")


def inject(args: argparse.Namespace, ckpt: Checkpointer) -> Callable[[], None]:
    """This rank dies (``--kill-rank``) or fails (``--fail-rank``) in the save of
    ``--kill-step`` / ``--fail-step``; a survivor reports what it saw. Returns what puts
    the staging back as it was, for the scenarios after this one in the same process."""
    rank = dist.get_rank()
    if args.kill_rank >= 0 and rank != args.kill_rank:
        # torchrun stops the survivors when a rank dies: let them finish and report first
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.kill_rank == rank and args.kill_at == "place":
        import tiercheck.engine.saving as engine

        real = engine.place_shard

        def place_then_die(slot: Any, **kw: Any) -> Any:
            if kw["step"] == args.kill_step:
                os.kill(os.getpid(), signal.SIGKILL)  # a crash in the middle of the save
            return real(slot, **kw)

        engine.place_shard = place_then_die  # type: ignore[assignment]
    elif args.kill_rank == rank:  # die just before a step of the commit protocol
        coordinator: Any = ckpt.coordinator
        real_step = getattr(coordinator, args.kill_at)

        def step_then_die(version: int, *a: Any, **kw: Any) -> Any:
            if version == args.kill_step - 1:  # a fresh store: step s is version s - 1
                os.kill(os.getpid(), signal.SIGKILL)
            return real_step(version, *a, **kw)

        setattr(coordinator, args.kill_at, step_then_die)
    if args.fail_rank == rank:  # a local failure before the exchange (staging)
        import tiercheck.engine.staging

        real_stage = tiercheck.engine.staging.StagingBuffer.stage
        calls = [0]

        def stage_or_fail(self: Any, *a: Any, **kw: Any) -> Any:
            calls[0] += 1
            if calls[0] == args.fail_step:
                raise RuntimeError(f"injected staging failure on rank {rank}")
            return real_stage(self, *a, **kw)

        tiercheck.engine.staging.StagingBuffer.stage = stage_or_fail  # type: ignore[method-assign]

        def undo() -> None:
            tiercheck.engine.staging.StagingBuffer.stage = real_stage  # type: ignore[method-assign]

        return undo
    return lambda: None


def save(args: argparse.Namespace, ckpt: Checkpointer) -> None:
    undo = inject(args, ckpt)
    try:
        save_steps(args, ckpt)
    finally:
        undo()


def save_steps(args: argparse.Namespace, ckpt: Checkpointer) -> None:
    rank = dist.get_rank()
    # a blob another writer is putting into the shared tier, not yet named by any record (a
    # save or migration in flight, under its write lease): rank 0's sweeps must leave it,
    # whatever the grace setting, until that writer is gone
    remote = ckpt.tierset.get("remote").tier
    assert remote is not None
    raw = b"written by rank 1, not yet prepared"
    writer = TierLeases()
    if rank == 1:
        writer.acquire_write(remote)
        remote.put(chunk_id(raw), encode_blob(raw, Codec.RAW))
    dist.barrier()
    for step in range(1, args.steps + 1):
        h = ckpt.save(step, state_for(step, rank))
        kind, error = "ack", ""
        try:
            r = h.wait()
        except tiercheck.errors.DurabilityError as exc:  # committed, short of a guarantee
            r, kind, error = h.result_now(), "short", str(exc)
        except tiercheck.errors.CheckpointError as exc:
            emit(event="failed", rank=rank, step=step, error=str(exc))
            continue
        emit(
            event=kind,
            error=error,
            rank=rank,
            step=step,
            version=r.version,
            role=r.role,
            tiers=dict(r.tiers),
            bytes=dict(r.bytes_written),
            logical=r.logical_bytes,
        )
    if args.kill_rank >= 0:  # a rank is dead: the job cannot go on together
        ckpt.close(abandon=True)
        return
    ckpt.wait_migrations(timeout=120)
    dist.barrier()
    if rank == 0:
        (report,) = [r for r in ckpt.gc() if r.tier == "remote"]
        emit(event="gc", rank=rank, fenced=report.fenced)
    dist.barrier()
    emit(
        event="history",
        rank=rank,
        versions=[[v.id, v.step, v.role, dict(v.tiers)] for v in ckpt.history()],
    )
    emit(event="in-flight blob", rank=rank, kept=chunk_id(raw) in remote.has([chunk_id(raw)]))
    dist.barrier()
    if rank == 1:
        writer.release_write(remote)  # the writer is gone without a record: a leftover
    dist.barrier()
    if rank == 0:
        ckpt.gc()
    dist.barrier()
    emit(event="leftover blob", rank=rank, kept=chunk_id(raw) in remote.has([chunk_id(raw)]))


def restore(args: argparse.Namespace, ckpt: Checkpointer) -> None:
    rank = dist.get_rank()
    target = state_for(0, rank)
    info = ckpt.restore(target)
    expected = state_for(info.step, rank)
    exact = (
        all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for a, b in (
                (target["model"]["w"], expected["model"]["w"]),
                (target["own"], expected["own"]),
            )
        )
        and target["meta"] == expected["meta"]
    )
    emit(
        event="restored",
        rank=rank,
        step=info.step,
        version=info.version,
        source=info.source,
        chunks_from=dict(info.chunks_from),
        exact=exact,
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["save", "restore"])
    p.add_argument("--root", required=True)
    p.add_argument("--shm-root", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--kill-at", choices=["place", "exchange", "decide", "confirm"], default="place")
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-step", type=int, default=-1)
    p.add_argument("--peer-ports", default="")
    p.add_argument("--remote-sync", action="store_true")
    p.add_argument("--collective", action="store_true")
    p.add_argument("--default-store", action="store_true", help="Checkpointer(root): no config")
    return p


def scenario(args: argparse.Namespace) -> None:
    EVENTS[:] = [f"{args.root}/events-{args.phase}-{dist.get_rank()}.jsonl"]
    if args.default_store:  # every rank opens one new root at once: they race to create it
        ckpt = Checkpointer(f"{args.root}/default")
    else:
        # a long group timeout: a rank's failure must abort a version long before it
        coordinator = DistCoordinator(timeout=600.0)
        ckpt = Checkpointer(
            f"{args.root}/store", tiers=specs(args), policy=policy(args), coordinator=coordinator
        )
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
