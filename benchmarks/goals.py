"""The durable-path goals of issue 16, measured alone on a small state (a micro-benchmark).

    python benchmarks/goals.py                  # 256 MiB state, 3 repeats
    python benchmarks/goals.py --state-mib 64 --repeats 2 --only restore,staged

``benchmarks/run.py`` reports the same four ratios in its full run; this script exists to
guide work on one path without running everything (the machine has 2 shared cores: a full
run takes minutes and its numbers move with the load, printed with every result).

The four goals, each tiercheck's median over the peer's median in this one run:

- **migrated**: the migration of a committed version (default store: shm + LMDB hold it) to
  the ``file://`` remote tier, from its start to the commit record there, against
  ``dcp.save`` of the same state to the same disk (FileSystemWriter, 2 threads,
  ``sync_files=True``). Both end with every byte fsynced: DCP fsyncs each data file and its
  ``.metadata`` (no directory fsync); tiercheck fsyncs each blob before naming it and each
  directory it named blobs in before the log record, and the record.
- **committed**: the default store (shm + LMDB, both synchronous), ``save()`` call to
  committed, against the same ``dcp.save``.
- **restore**: ``restore(tiers=["remote"])`` of the default store's file tier into the
  state's tensors, verified, against ``dcp.load`` from the same disk into the same tensors.
  Both read files written moments before (in the page cache).
- **staged**: ``save()`` call to staged against a copy of every tensor into warm buffers.

The disk-bound paths are also printed against the disk's floor (``disk_write_fsync_s``: the
state's raw bytes written by two threads to one file each and fsynced), so a ratio near 1
between two of them can be told apart from both being slow.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_lib import (
    MIB,
    BenchState,
    copy_warm,
    dcp_save_load,
    default_store_warmup,
    disk_dir,
    disk_floor,
    make_state,
    median,
    one_tier,
    private_disk_dir,
    store,
    tc_saves,
)

import tiercheck
from tiercheck.store.lifecycle import shm_root_left_as_found

GOALS = {
    # name: (tiercheck metric, peer metric, target)
    "migrated": ("tc_migrate_file_s", "dcp_save_disk_s", 1.0),
    "committed": ("tc_committed_default_s", "dcp_save_disk_s", 1.0),
    "restore": ("tc_restore_file_s", "dcp_load_disk_s", 1.0),
    "staged": ("tc_staged_s", "copy_warm_s", 1.3),
}


def measure(bs: BenchState, repeats: int, only: set[str]) -> dict[str, list[float]]:
    m: dict[str, list[float]] = {}
    if "staged" in only:
        m["copy_warm_s"] = copy_warm(bs, repeats)
        tp = tiercheck.TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=1)
        tiers, policy = one_tier("shm", "shm://tc-goals-{uid}", tp)
        with store(tiers, policy) as ckpt:
            m["tc_staged_s"] = tc_saves(ckpt, bs, repeats, warm=1)["staged"]
    if only & {"migrated", "committed", "restore"}:
        m["disk_write_fsync_s"] = disk_floor(bs, disk_dir(), repeats)
        r = dcp_save_load(bs, disk_dir(), repeats, load=True)
        m["dcp_save_disk_s"], m["dcp_load_disk_s"] = r["save"], r["load"]
        with store(None, tiercheck.Policy(base_every=1, gc_grace_seconds=0)) as ckpt:
            r = tc_saves(ckpt, bs, repeats, migrated=True, warm=default_store_warmup())
            m["tc_committed_default_s"] = r["committed"]
            m["tc_migrated_remote_s"] = r["migrated"]
            m["tc_migrate_file_s"] = r["migration"]
            runs = []
            for _ in range(repeats):
                gc.collect()
                t0 = time.perf_counter()
                ckpt.restore(bs.state, tiers=["remote"])
                runs.append(time.perf_counter() - t0)
            m["tc_restore_file_s"] = runs
    return m


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-mib", type=float, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", default=",".join(GOALS), help="comma-separated goal names")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch intra-op threads (on a loaded machine 1 keeps OpenMP's spinning "
        "threads from slowing every torch copy, the peers' included)",
    )
    args = p.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    only = {g.strip() for g in args.only.split(",") if g.strip()}
    if not only <= set(GOALS):
        p.error(f"--only takes {', '.join(GOALS)}")
    torch.manual_seed(0)
    bs = make_state(int(args.state_mib * MIB))
    load0 = os.getloadavg()[0]
    with private_disk_dir(), shm_root_left_as_found():
        m = measure(bs, args.repeats, only)
    load1 = os.getloadavg()[0]
    print(
        f"state {bs.nbytes / MIB:.0f} MiB, {args.repeats} repeats, "
        f"load average {load0:.1f} -> {load1:.1f}, torch threads {torch.get_num_threads()}"
    )
    for name, runs in m.items():
        print(f"  {name:24s} {median(runs) * 1e3:9.1f} ms   {[round(x * 1e3) for x in runs]}")
    out: dict[str, Any] = {"state_bytes": bs.nbytes, "load": [load0, load1], "metrics": m}
    ratios = {}
    for name in GOALS:
        if name not in only:
            continue
        tc, peer, target = GOALS[name]
        ratio = median(m[tc]) / median(m[peer])
        ratios[name] = ratio
        verdict = "met" if ratio <= target else "NOT met"
        print(f"{name:10s} {tc} / {peer} = {ratio:.2f}x (target <= {target}x: {verdict})")
    if "disk_write_fsync_s" in m:  # the disk-bound paths against what the disk allows
        floor = median(m["disk_write_fsync_s"])
        for k in ("dcp_save_disk_s", "tc_migrate_file_s", "tc_committed_default_s"):
            print(
                f"{k} / the disk's floor (write + fsync of the raw bytes) = "
                f"{median(m[k]) / floor:.2f}x"
            )
    out["ratios"] = ratios
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
