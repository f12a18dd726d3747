"""/dev/shm held by a default store under dense training (issue 13): every chunk of the
state changes at every save, the worst case for the shm tier.

    python benchmarks/shm_budget.py [--state-mib 144] [--saves 12 50]

Saves ``--saves`` versions (the largest count; the others are read on the way) into a new
default store, waiting for each save and for the store's maintenance, and measures the
memory the store's own shm segment takes (its files' allocated blocks: the segment of this
store only, not all of /dev/shm, which other processes use). Prints the peak and the value
after each listed count, as bytes and as a multiple of the state. The store is deleted at
the end (``Checkpointer.destroy``), so /dev/shm is left as found.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from tiercheck import Checkpointer
from tiercheck.core.sizes import tree_bytes
from tiercheck.store.lifecycle import shm_root_left_as_found


def run(state_mib: int, saves: list[int], work: Path) -> None:
    state = {"w": torch.randn(state_mib << 18)}  # float32: 4 bytes each
    nbytes = state["w"].numel() * 4
    ckpt = Checkpointer(work / "store")
    try:
        seg = ckpt.tierset.get("shm").tier.path  # type: ignore[union-attr]
        peak, t0 = 0, time.perf_counter()
        for step in range(1, max(saves) + 1):
            state["w"] += 1.0  # every chunk changes
            ckpt.save(step, state).wait()
            ckpt.flush()
            peak = max(peak, tree_bytes(seg))
            if step in saves:
                now = tree_bytes(seg)
                sizes = tree_bytes(seg, apparent=True)
                budget = getattr(ckpt.tierset.get("shm").tier, "budget", None)
                print(
                    f"after {step:3d} saves: shm segment {now / 2**20:8.1f} MiB "
                    f"({now / nbytes:5.2f}x the state), peak {peak / 2**20:8.1f} MiB "
                    f"({peak / nbytes:5.2f}x), file sizes {sizes / nbytes:5.2f}x, budget "
                    f"{'none' if budget is None else f'{budget / 2**20:.1f} MiB'}, "
                    f"{time.perf_counter() - t0:.0f} s",
                    flush=True,
                )
    finally:
        ckpt.destroy()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state-mib", type=int, default=144)
    p.add_argument("--saves", type=int, nargs="+", default=[12, 50])
    args = p.parse_args()
    print(f"state {args.state_mib} MiB; load average {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp, shm_root_left_as_found():
        run(args.state_mib, sorted(args.saves), Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
