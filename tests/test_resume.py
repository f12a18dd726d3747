"""Exact resume: restoring version N from each tier and training on is bit-identical to a
run that never stopped."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from _models import Trainer, assert_bit_identical, snapshot

import tiercheck
from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec

N = 4
R = 3  # the step restored: a diff (base_every=3), or a log version of 2 steps


def _tiers(tmp_path: Path, s3: tuple[str, dict[str, Any]] | None) -> list[TierSpec]:
    name = f"test-{uuid.uuid4().hex[:12]}"
    specs = [
        # a budget above the default (two versions): shm must keep step R to restore it
        TierSpec("shm", f"shm://{name}", {"root": str(tmp_path / "shmroot"), "budget": "64MiB"}),
        TierSpec("lmdb", f"lmdb://{tmp_path / 'lmdb'}"),
        TierSpec("file", f"file://{tmp_path / 'remote'}", {"survives": "cluster", "shared": True}),
    ]
    if s3 is not None:
        specs.append(TierSpec("s3", s3[0], {"storage_options": s3[1]}))
    return specs


def _policy(names: list[str]) -> Policy:
    every = TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=None)
    tiers = {n: every for n in names}
    tiers["s3"] = TierPolicy(versions="all", mode="sync", codec="zstd", keep_bases=None)
    return Policy(base_every=3, chunk_size=16 * 1024, gc_grace_seconds=0, tiers=tiers)


@pytest.fixture
def reference() -> dict[str, Any]:
    t = Trainer()
    for _ in range(2 * N):
        t.step()
    return snapshot(t)


@pytest.mark.slow
@pytest.mark.parametrize("logged", [False, True], ids=["diffs", "log-versions"])
def test_resume_from_each_tier_is_bit_identical(
    tmp_path: Path,
    s3_bucket: tuple[str, dict[str, Any]],
    reference: dict[str, Any],
    logged: bool,
) -> None:
    specs = _tiers(tmp_path, s3_bucket)
    policy = _policy([s.name for s in specs])
    ckpt = Checkpointer(tmp_path / "store", tiers=specs, policy=policy)
    t = Trainer()
    ckpt.guard(t.opt, log=logged)
    for step in range(1, 2 * N + 1):
        t.step()
        ckpt.save(step, t.state(), metadata={"step": step}).wait()
    assert_bit_identical(snapshot(t), reference)
    roles = {v.step: v.role for v in ckpt.history()}
    assert "base" in roles.values()
    assert roles[R] == ("log" if logged else "diff"), roles
    ckpt.close()

    for spec in specs:
        ckpt = Checkpointer(tmp_path / "store", tiers=specs, policy=policy)
        fresh = Trainer(seed=123)  # different init: everything must come from the checkpoint
        ckpt.guard(fresh.opt)  # a log version replays into the guarded optimizer
        state = fresh.state()
        info = ckpt.restore(state, step=R, tiers=[spec.name])
        assert info.step == R and info.source == spec.name
        assert info.replayed_steps == (R - 1 if logged else 0), info
        assert set(info.chunks_from) == {spec.name}
        fresh.after_restore(state)
        for _ in range(2 * N - R):
            fresh.step()
        assert_bit_identical(snapshot(fresh), reference)
        ckpt.close()


def test_restore_newest_by_default_and_rng(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "store", tiers=["memory://" + uuid.uuid4().hex])
    t = Trainer()
    for step in range(3):
        t.step()
        ckpt.save(step, t.state()).wait()
    import torch

    expected_next = torch.rand(3)
    fresh = Trainer(seed=9)
    state = fresh.state()
    info = ckpt.restore(state)
    assert info.step == 2
    fresh.after_restore(state)
    # the global torch RNG continues exactly where it was at the save
    assert_bit_identical({"r": torch.rand(3)}, {"r": expected_next})
    assert tiercheck.rng_state()["torch"].dtype == torch.uint8
    ckpt.close()


def test_the_documented_plain_loop_saves_each_steps_own_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/integrations.md's plain training loop, run as written: every version it saved
    restores an optimizer that took exactly that many steps (AdamW's step count; a log
    version replays its steps into a guarded optimizer). Before, the loop saved without
    ``guard`` (nor ``wait_staged``), so the next step's update reached the staging copy:
    the versions of steps 2-4 held the optimizer and model of steps 3-5."""
    import torch
    from _snippets import REPO, blocks_of

    page = REPO / "docs" / "integrations.md"
    code = next(b.code for b in blocks_of(page) if "# line 1" in b.code)
    monkeypatch.chdir(tmp_path)
    exec(compile(code.split("# after a restart")[0], str(page), "exec"), {})
    steps = []
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        for v in ckpt.history():
            if not v.restorable:  # a log version retention dropped
                continue
            model = torch.nn.Linear(32, 32)
            opt = torch.optim.AdamW(model.parameters())
            ckpt.guard(opt)
            ckpt.restore({"model": model, "opt": opt, "rng": None}, version=v.id)
            steps.append((v.step, int(opt.state[model.weight]["step"])))
    assert len(steps) >= 2 and max(steps)[0] == 5, steps
    assert all(saved == took for saved, took in steps), steps
    tiercheck.store.lifecycle.destroy_store(tmp_path / "ckpt")
