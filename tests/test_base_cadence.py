"""A scalar changing size (a loader position crossing a msgpack int width) must not force
a new base: only tensor layout changes do."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

import tiercheck
import tiercheck.testing.faults
from tiercheck.store.config import TierSpec


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


def test_roles_are_decided_when_save_is_called(tmp_path: Path) -> None:
    """A base still being written counts: the save right after it is a diff, not a base."""
    slow = [{"action": "latency", "op": "append", "seconds": 0.15, "count": "all"}]
    ckpt = tiercheck.Checkpointer(
        tmp_path,
        tiers=[TierSpec("slow", f"faulty+memory://{uuid.uuid4().hex}", {"faults": slow})],
        policy=tiercheck.Policy(base_every=3),
    )
    try:
        handles = [ckpt.save(0, {"w": torch.zeros(64)})]
        handles[0].wait_staged()
        handles.append(ckpt.save(1, {"w": torch.ones(64)}))
        assert not handles[0].done()  # the base was still being written when 1 was decided
        for step in range(2, 6):
            handles.append(ckpt.save(step, {"w": torch.full((64,), float(step))}))
        results = [h.wait() for h in handles]
    finally:
        ckpt.close()
    assert [r.role for r in results] == ["base", "diff", "diff"] * 2
    assert [r.base for r in results] == [None, 0, 0, None, 3, 3]


def test_diffs_of_a_failed_base_rebase_on_the_next_version(tmp_path: Path) -> None:
    fail_first_put = [  # slowly, so that the next save is decided before it fails
        {"action": "latency", "op": "put", "nth": 1, "count": 1, "seconds": 0.5},
        {"action": "fail", "op": "put", "nth": 1, "count": 1},
    ]
    ckpt = tiercheck.Checkpointer(
        tmp_path,
        tiers=[TierSpec("t", f"faulty+memory://{uuid.uuid4().hex}", {"faults": fail_first_put})],
        policy=tiercheck.Policy(base_every=4),
    )
    try:
        first = ckpt.save(0, {"w": torch.zeros(64)})  # a base; its only tier fails it
        second = ckpt.save(1, {"w": torch.ones(64)})  # decided as a diff of version 0
        with pytest.raises(tiercheck.errors.CheckpointError):
            first.wait()
        r1 = second.wait()
        r2, r3 = (ckpt.save(s, {"w": torch.full((64,), float(s))}).wait() for s in (2, 3))
        assert ckpt.restore({"w": torch.empty(64)}).step == 3
    finally:
        ckpt.close()
    assert (r1.role, r1.base) == ("base", None)  # it was to be a diff of the failed base
    assert (r2.role, r2.base, r3.role, r3.base) == ("diff", r1.version, "diff", r1.version)
