"""DCP on tiercheck vs DCP's FileSystemWriter, on the same ~1 GiB state, in one run.

For each writer (``TierWriter`` on a default store: shm + LMDB + a ``file://`` remote tier;
``FileSystemWriter`` to a fresh directory on disk) and each API (``dcp.save``,
``dcp.async_save`` with ``DefaultStager``), one repetition is a base save followed by a
second save after a small change (1% of one tensor). Reported per save, median over the
repetitions:

- ``blocked_s``: time until the call returned (``save``: everything; ``async_save``: the
  staging copy);
- ``durable_s``: time until the checkpoint was committed (``save`` returned / the future
  resolved). For tiercheck that is the synchronous tiers (shm for every version, LMDB for
  bases); ``migrated_s`` adds the background copy of bases to the remote tier;
- ``bytes_written``: bytes the save stored (tiercheck: the version's stored bytes over all
  tiers, from ``history()``; FileSystemWriter: the size of the checkpoint directory).

    python benchmarks/dcp_bench.py [--gib 1.0] [--reps 3] [--out benchmarks/results/dcp.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import async_save, save

from tiercheck.integrations.dcp import TierWriter
from tiercheck.store.lifecycle import destroy_store

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

TENSOR = 4096 * 4096  # 64 MiB of fp32


def make_state(gib: float) -> dict[str, Any]:
    n = max(1, round(gib * 1024 / 64))
    g = torch.Generator().manual_seed(0)
    return {
        "model": {f"layers.{i}.weight": torch.randn(4096, 4096, generator=g) for i in range(n)},
        "step": 0,
    }


def nudge(state: dict[str, Any]) -> None:
    """A small change: 1% of one tensor."""
    w = state["model"]["layers.0.weight"]
    with torch.no_grad():
        w.view(-1)[: w.numel() // 100] += 1.0
    state["step"] += 1


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def one_save(state: dict[str, Any], writer: Any, mode: str) -> dict[str, float]:
    t0 = time.perf_counter()
    if mode == "save":
        save(state, storage_writer=writer)
        t = time.perf_counter() - t0
        return {"blocked_s": t, "durable_s": t}
    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        fut = async_save(state, storage_writer=writer, async_stager=stager)
        blocked = time.perf_counter() - t0
        assert isinstance(fut, Future)
        fut.result()
        return {"blocked_s": blocked, "durable_s": time.perf_counter() - t0}
    finally:
        stager.close()


def rep_fs(state: dict[str, Any], work: Path, mode: str) -> list[dict[str, float]]:
    out = []
    for k in range(2):
        d = work / f"fs-{mode}-{k}"
        row = one_save(state, FileSystemWriter(d), mode)
        row["bytes_written"] = du(d)
        out.append(row)
        if k == 0:
            nudge(state)
    return out


def rep_tier(state: dict[str, Any], work: Path, mode: str) -> list[dict[str, float]]:
    root = work / f"tier-{mode}"
    out = []
    writer = TierWriter(root)
    try:
        for k in range(2):
            row = one_save(state, writer, mode)
            ckpt = writer.checkpointer
            assert ckpt is not None
            t0 = time.perf_counter()
            ckpt.wait_migrations()
            row["migrated_s"] = row["durable_s"] + (time.perf_counter() - t0)
            last = ckpt.history()[-1]
            row["bytes_written"] = last.stored_bytes
            row["role"] = last.role  # type: ignore[assignment]
            out.append(row)
            if k == 0:
                nudge(state)
    finally:
        writer.close()
        for rank_root in root.glob("rank*"):  # each rank's store with its shm segment
            if (rank_root / "tiercheck.toml").exists():
                destroy_store(rank_root)
    return out


def median_rows(rows: list[list[dict[str, float]]]) -> list[dict[str, Any]]:
    out = []
    for k, label in enumerate(("base", "after small change")):
        cols = [r[k] for r in rows]
        med: dict[str, Any] = {"save": label}
        for key in cols[0]:
            vals = [c[key] for c in cols]
            med[key] = statistics.median(vals) if isinstance(vals[0], (int, float)) else vals[0]
        med["samples"] = {key: [c[key] for c in cols] for key in cols[0] if key != "role"}
        out.append(med)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/dcp.json")
    ap.add_argument("--dir", default=None, help="scratch directory on disk (default: temp)")
    args = ap.parse_args()
    results: dict[str, Any] = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for writer, rep in (("FileSystemWriter", rep_fs), ("TierWriter", rep_tier)):
            for mode in ("save", "async_save"):
                rows = []
                for i in range(args.reps):
                    state = make_state(args.gib)
                    work = Path(tmp) / f"{writer}-{mode}-{i}"
                    work.mkdir()
                    rows.append(rep(state, work, mode))
                    shutil.rmtree(work, ignore_errors=True)
                results[f"{writer} {mode}"] = median_rows(rows)
                print(writer, mode, json.dumps(results[f"{writer} {mode}"][0:2], default=str)[:400])
    state_bytes = sum(t.numel() * 4 for t in make_state(args.gib)["model"].values())
    doc = {
        "benchmark": "dcp.save / dcp.async_save: TierWriter vs FileSystemWriter",
        "state_bytes": state_bytes,
        "reps": args.reps,
        "statistic": "median",
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "load_avg_1m": os.getloadavg()[0],
        },
        "wall_s": time.perf_counter() - t_start,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out} in {doc['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
