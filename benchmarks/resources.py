"""Bounded resources, measured: /dev/shm before and after ``tiercheck rm`` and
``tiercheck gc --orphans``; records read at open for 10,000 versions before and after log
compaction.

    python benchmarks/resources.py [--state-mib 64] [--versions 10000]

Prints a table; leaves /dev/shm as it found it (the stores are deleted at the end).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tiercheck import Checkpointer
from tiercheck.backends import list_segments, open_tier
from tiercheck.formats.manifest import CommitRecord, DropRecord, PrepareRecord, VersionInfo
from tiercheck.store.catalog import append_record, compact_log, read_tier_log

KEEP = 12


def segment_bytes() -> int:
    return sum(s.nbytes or 0 for s in list_segments())


def cli(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "tiercheck", *args], capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def shm_lifecycle(state_mib: int, work: Path) -> None:
    state = {"w": torch.randn(state_mib << 18)}  # float32: 4 bytes each
    before = segment_bytes()
    roots = []
    for i in range(3):
        root = work / f"store{i}"
        with Checkpointer(root) as ckpt:
            for step in range(3):
                state["w"] += 1
                ckpt.save(step, state).wait()
        roots.append(root)
    stores = segment_bytes()
    cli("rm", str(roots[0]))
    after_rm = segment_bytes()
    for root in roots[1:]:
        shutil.rmtree(root)  # deleted by hand: the segments stay behind
    orphaned = segment_bytes()
    listed = cli("gc", "--orphans")
    cli("gc", "--orphans", "--yes")
    after_gc = segment_bytes()
    print(f"tiercheck shm segments, bytes (3 default stores, 3 saves of {state_mib} MiB each):")
    for label, value in [
        ("before", before),
        ("with 3 stores", stores),
        ("after tiercheck rm of one", after_rm),
        ("after rm -r of the other two roots", orphaned),
        ("after tiercheck gc --orphans --yes", after_gc),
    ]:
        print(f"  {label:40s} {value:>14,d}")
    print("  gc --orphans (dry run) said:\n    " + listed.replace("\n", "\n    "))


def info(v: int) -> VersionInfo:
    role = "base" if v % 10 == 0 else "diff"
    return VersionInfo(
        v, v, role, None if role == "base" else v - v % 10, 1, (f"{v:064x}",), 1.0, 100
    )


def log_compaction(versions: int, work: Path) -> None:
    print(f"records read at open, {versions:,d} versions, the tier keeping {KEEP}:")
    urls = {
        "memory": ("memory://", {}),
        "shm": ("shm://resources-bench", {"root": str(work / "shm")}),
        "lmdb": (f"lmdb://{work}/lmdb", {}),
    }
    for name, (url, options) in urls.items():
        tier = open_tier(url, **options)
        for v in range(versions):
            i = info(v)
            append_record(
                tier, PrepareRecord(v, 0, v, i.role, i.base, f"{v:064x}", 1, 100, 1.0, {})
            )
            append_record(tier, CommitRecord(i))
            if v >= KEEP:
                append_record(tier, DropRecord(v - KEEP, 1.0))
        t0 = time.perf_counter()
        before = read_tier_log(name, tier)
        t1 = time.perf_counter()
        compact_log(name, tier)
        t2 = time.perf_counter()
        after = read_tier_log(name, tier)
        t3 = time.perf_counter()
        assert after.held() == before.held()
        print(
            f"  {name:8s} before {before.records:>7,d} records ({t1 - t0:.3f} s)   "
            f"after {after.records} ({(t3 - t2) * 1e3:.2f} ms)   compaction {t2 - t1:.3f} s"
        )
        tier.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state-mib", type=int, default=64)
    p.add_argument("--versions", type=int, default=10_000)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tc-resources-"))
    try:
        shm_lifecycle(args.state_mib, work)
        log_compaction(args.versions, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
