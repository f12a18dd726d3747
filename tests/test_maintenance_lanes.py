"""Making room in a tier never waits behind another tier's work (issue 31): each tier has
its own maintenance lane. A sweep of one tier held inside its ``list`` call (a slow remote
listing a bucket) must not hold up a save that needs room in a memory tier. (A tier with a
budget makes room on its own lane, so the slow tier here has none.)"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import torch

from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.testing.faults import FaultEvent, inject

NUMEL = 1 << 16  # 256 KiB


def test_make_room_does_not_wait_behind_another_tiers_gc(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    tiers = [
        TierSpec("fast", f"memory://lanes-fast-{tag}", {"budget": "1MiB"}),
        TierSpec("slow", f"lmdb://{tmp_path}/lmdb"),  # no budget: it never makes room
    ]
    policy = Policy(
        base_every=1,  # every version a base: retention drops the one before it
        gc_grace_seconds=0,
        tiers={"fast": TierPolicy(), "slow": TierPolicy()},
    )
    ckpt = Checkpointer(tmp_path / "s", tiers=tiers, policy=policy)
    entered, release = threading.Event(), threading.Event()
    armed = threading.Event()

    def slow_listing(event: FaultEvent) -> None:
        if armed.is_set() and not release.is_set():
            entered.set()
            release.wait()

    inject(ckpt, "slow").hook(slow_listing, "list")
    try:
        ckpt.save(0, {"w": torch.randn(NUMEL)}).wait()
        ckpt.flush()
        armed.set()
        ckpt.save(1, {"w": torch.randn(NUMEL)}).wait()  # slow drops version 0, then sweeps
        assert entered.wait(60), "the sweep of tier slow did not start"
        # slow's lane is held in its listing; fast must still make room for this save
        res = ckpt.save(2, {"w": torch.randn(NUMEL)}).wait(timeout=60)
        assert res.tiers["fast"] == "committed", res
        # slow takes its next base once its retention ran (or 5 s passed): while its lane is
        # held, this save skips it as a busy tier ("latest wins"), never as a failed one
        assert res.tiers["slow"] in ("committed", "missing"), res
        if res.tiers["slow"] == "missing":
            assert "latest wins" in res.errors["slow"], res
    finally:
        release.set()
        ckpt.destroy()
