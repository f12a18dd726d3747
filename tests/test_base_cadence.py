"""A scalar changing size (a loader position crossing a msgpack int width) must not force
a new base: only tensor layout changes do."""

from __future__ import annotations

from pathlib import Path

import torch

import tiercheck


def test_scalar_growth_keeps_base_cadence(tmp_path: Path) -> None:
    w = torch.zeros(1000)
    ckpt = tiercheck.Checkpointer(
        tmp_path, tiers=[("mem", "memory://cadence")], policy=tiercheck.Policy(base_every=5)
    )
    try:
        roles = []
        for step in range(10):
            w += 1
            # 100 -> 130 -> ... crosses the 1-byte (<128) and 2-byte (<256) msgpack widths
            state = {"w": w, "loader": {"index": 100 + 30 * step, "name": "x" * step}}
            roles.append(ckpt.save(step, state).wait().role)
    finally:
        ckpt.close()
    assert roles == ["base", "diff", "diff", "diff", "diff"] * 2


def test_tensor_layout_change_forces_base(tmp_path: Path) -> None:
    ckpt = tiercheck.Checkpointer(
        tmp_path, tiers=[("mem", "memory://cadence2")], policy=tiercheck.Policy(base_every=5)
    )
    try:
        r0 = ckpt.save(0, {"w": torch.zeros(10)}).wait().role
        r1 = ckpt.save(1, {"w": torch.zeros(10)}).wait().role
        r2 = ckpt.save(2, {"w": torch.zeros(20)}).wait().role
    finally:
        ckpt.close()
    assert (r0, r1, r2) == ("base", "diff", "base")
