"""Log versions through the engine: guard() logs the optimizer, save() picks the role,
restore() replays and verifies, falls back when it cannot (issue 11, phase 2)."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import _fresh
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _dist import torchrun
from _models import Trainer, assert_bit_identical, snapshot
from update_log_run import AFTER, Run

import tiercheck
from tiercheck.errors import NoRestorableVersion
from tiercheck.logversions.planner import choose
from tiercheck.store.config import TierSpec

HERE = Path(__file__).resolve().parent


def _train_and_save(ckpt: tiercheck.Checkpointer, run: Run, steps: int) -> list[Any]:
    handles = []
    for _ in range(steps):
        run.step()
        handles.append(ckpt.save(run.steps, run.state()))
    for h in handles:
        h.wait()
    return handles


def test_dense_training_resumes_bit_identically_in_a_new_process(tmp_path: Path) -> None:
    """Default store, no configuration: AdamW + OneCycleLR + clipping + a CPU GradScaler
    that skips a step. Saves become log versions, and a new process restoring the newest
    one (base + replay) continues exactly as the trainer did."""
    store = tmp_path / "store"
    run = Run(seed=0)
    ckpt = tiercheck.Checkpointer(store)
    try:
        ckpt.guard(run.opt, run.scaler)
        handles = _train_and_save(ckpt, run, 5)
        roles = [h.role for h in handles]
        assert roles[0] == "base" and roles[1] == "log", roles
        assert "diff" not in roles  # dense: a full version is a base
        history = {v.id: v for v in ckpt.history()}
        newest = max(history)
        assert history[newest].role == "log"
        full = history[handles[0].version].info.logical_bytes
        shm = [h.result().bytes_written["shm"] for h in handles if h.role == "log"]
        # this tiny state has 64 KiB chunks and 20 KB of RNG states: a log version of one
        # step is ~0.4x here, 0.33x on a real model (docs/benchmarks.md)
        assert max(shm) < 0.45 * full, (shm, full)
        ckpt.close()
        out = tmp_path / "resumed.json"
        _fresh.run(
            [str(HERE / "log_versions_run.py"), str(store), str(out)],
            check=True,
            timeout=300,
        )
        for _ in range(AFTER):
            run.step()
        child = json.loads(out.read_text())
        assert child["role"] == "log" and child["version"] == newest
        assert child["replayed"] >= 1 and child["fallback"] is None
        assert child["digests"] == run.digests()
    finally:
        ckpt.destroy()


def _shm(tmp_path: Path) -> TierSpec:
    return TierSpec("shm", "shm://lv", {"root": str(tmp_path / "shm")})


def _store(tmp_path: Path) -> tiercheck.Checkpointer:
    return tiercheck.Checkpointer(tmp_path / "s", tiers=[_shm(tmp_path)])


def test_a_parameter_edited_outside_the_optimizer_is_saved_full(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An in-place edit outside ``optimizer.step()`` bumps the tensor's version counter:
    the save sees it and is a full version, with one warning naming the state key."""
    t = Trainer()
    ckpt = _store(tmp_path)
    try:
        ckpt.guard(t.opt)
        t.step()
        ckpt.save(1, t.state()).wait()
        t.step()
        with torch.no_grad():
            t.model.head.bias.add_(1.0)  # outside optimizer.step()
        with caplog.at_level(logging.WARNING, logger="tiercheck"):
            h = ckpt.save(2, t.state())
            h.wait()
        assert h.role in ("base", "diff")
        (warning,) = [r.getMessage() for r in caplog.records if "outside" in r.getMessage()]
        assert "model/head.bias" in warning and "param/" not in warning
        saved = snapshot(t)
        fresh = Trainer(seed=5)
        ckpt.guard(fresh.opt)
        info = ckpt.restore(fresh.state())
        assert info.version == h.version and info.fallback is None
        assert_bit_identical(snapshot(fresh), saved)
    finally:
        ckpt.destroy()


def test_an_edit_through_data_falls_back_to_the_base_naming_the_state_key(
    tmp_path: Path,
) -> None:
    """``.data`` has a version counter of its own, so the save cannot see this edit: the
    fingerprints catch it at restore, which names the state key and loads the base."""
    t = Trainer()
    ckpt = _store(tmp_path)
    try:
        ckpt.guard(t.opt)
        t.step()
        base = ckpt.save(1, t.state())
        base.wait()
        base_state = snapshot(t)
        t.step()
        t.model.head.bias.data.add_(1.0)  # outside optimizer.step(), unseen by autograd
        h = ckpt.save(2, t.state())
        h.wait()
        assert h.role == "log"
        fresh = Trainer(seed=5)
        ckpt.guard(fresh.opt)
        info = ckpt.restore(fresh.state())
        assert info.version == base.version and info.role == "base"
        assert info.fallback is not None and "could not be replayed" in info.fallback
        assert "model/head.bias" in info.fallback and "param/" not in info.fallback
        assert_bit_identical(snapshot(fresh), base_state)
        t.step()  # the first guard's log was moved to fresh.opt: t's steps are not logged
        assert ckpt.save(3, fresh.state()).result().role in ("base", "diff")
    finally:
        ckpt.destroy()


def test_log_versions_are_skipped_without_a_guarded_optimizer_and_a_reader_can_guard(
    tmp_path: Path,
) -> None:
    t = Trainer()
    ckpt = _store(tmp_path)
    try:
        ckpt.guard(t.opt)
        t.step()
        first = ckpt.save(1, t.state())
        t.step()
        log_version = ckpt.save(2, t.state())
        log_version.wait()
        assert first.role == "base" and log_version.role == "log"
        reader = tiercheck.Checkpointer(tmp_path / "s", read_only=True)
        try:
            fresh = Trainer(seed=5)
            info = reader.restore(fresh.state())
            assert info.version == first.version
            assert info.fallback is not None and "guard(optimizer)" in info.fallback
            with pytest.raises(NoRestorableVersion, match="guard"):
                reader.restore(fresh.state(), version=log_version.version)
        finally:
            reader.close()
        # a read-only store replays into the optimizer it guards (an evaluation job
        # reading the trainer's newest version): the log version, bit for bit
        reader = tiercheck.Checkpointer(tmp_path / "s", read_only=True)
        try:
            fresh = Trainer(seed=5)
            reader.guard(fresh.opt)
            info = reader.restore(fresh.state())
            assert info.version == log_version.version and info.fallback is None
            assert_bit_identical(snapshot(fresh), snapshot(t))
        finally:
            reader.close()
    finally:
        ckpt.destroy()


def test_restore_in_process_then_saving_again_starts_from_a_full_version(tmp_path: Path) -> None:
    t = Trainer()
    ckpt = _store(tmp_path)
    try:
        ckpt.guard(t.opt)
        for step in range(1, 4):
            t.step()
            ckpt.save(step, t.state()).wait()
        expected = snapshot(t)
        info = ckpt.restore(t.state())
        assert info.role == "log" and info.replayed_steps == 2 and info.fallback is None
        assert_bit_identical(snapshot(t), expected)
        t.step()
        assert ckpt.save(4, t.state()).result().role == "base"  # the log restarts here
        t.step()
        assert ckpt.save(5, t.state()).result().role == "log"
    finally:
        ckpt.destroy()


def test_retention_keeps_a_log_versions_base(tmp_path: Path) -> None:
    t = Trainer()
    policy = tiercheck.Policy(tiers={"shm": tiercheck.TierPolicy(keep_bases=1, keep_diffs=1)})
    ckpt = tiercheck.Checkpointer(tmp_path / "s", tiers=[_shm(tmp_path)], policy=policy)
    try:
        ckpt.guard(t.opt)
        roles = []
        for step in range(1, 9):
            t.step()
            roles.append(ckpt.save(step, t.state()).result().role)
        ckpt.flush()
        held = {v.id: v.role for v in ckpt.history() if v.tiers.get("shm") == "committed"}
        last_log = max(v for v, r in held.items() if r == "log")
        base = ckpt.version(last_log).info.base
        assert base in held and held[base] == "base"
        assert sorted(held) == [base, last_log], (roles, held)
        assert ckpt.restore(t.state()).version == last_log
    finally:
        ckpt.destroy()


def test_choice_of_role() -> None:
    common = {"replayed_bytes": 1200, "max_replay_seconds": 30.0, "replay_seconds": 0.1}
    assert choose(new_bytes=400, log_bytes=800, changed_bytes=1200, **common) is None
    assert "outgrew" in str(choose(new_bytes=400, log_bytes=1600, changed_bytes=1200, **common))
    assert "diff is cheaper" in str(
        choose(new_bytes=400, log_bytes=400, changed_bytes=100, **common)
    )
    slow = {**common, "replay_seconds": 31.0}
    assert "max_replay_seconds" in str(choose(new_bytes=1, log_bytes=1, changed_bytes=1200, **slow))


def test_cli_shows_the_replay_chain_and_export_replays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tiercheck.cli.main import main

    t = Trainer()
    root = tmp_path / "s"
    ckpt = tiercheck.Checkpointer(
        root,
        tiers=[("file", f"file://{tmp_path / 'f'}")],
        policy=tiercheck.Policy(tiers={"file": tiercheck.TierPolicy(versions="all")}),
    )
    try:
        ckpt.guard(t.opt)
        for step in (1, 2, 3):
            t.step()
            ckpt.save(step, t.state()).wait()
    finally:
        ckpt.close()
    capsys.readouterr()
    assert main(["ls", str(root), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["versions"]
    assert [(r["role"], r["base"]) for r in rows] == [("base", None), ("log", 0), ("log", 0)]
    assert all(r["restorable"] for r in rows)
    assert main(["show", str(root), "2"]) == 0
    out = capsys.readouterr().out
    assert "log of version 0" in out and "replay    version 0, then 2 optimizer step" in out
    assert main(["show", str(root), "2", "--json"]) == 0
    replay = json.loads(capsys.readouterr().out)["replay"]
    head = len(list(t.model.parameters())) - 2  # head.weight: the last parameter but one
    assert replay["steps"] == 2
    assert replay["replayed_leaves"]["model/head.weight"] == f"param/{head}"
    assert replay["replayed_leaves"][f"optim/state/{head}/exp_avg"] == f"state/{head}/exp_avg"
    # export replays from the log alone (torch.optim.AdamW over the base's tensors)
    out_file = tmp_path / "w.safetensors"
    assert main(["export", str(root), "2", str(out_file)]) == 0
    from safetensors.torch import load_file

    exported = load_file(str(out_file))
    assert_bit_identical(
        {k: v for k, v in exported.items() if k.startswith("model/")},
        {f"model/{k}": v for k, v in t.model.state_dict().items()},
    )
    assert torch.equal(
        exported[f"optim/state/{head}/exp_avg"], t.opt.state[t.model.head.weight]["exp_avg"]
    )
    # an optimizer outside torch.optim cannot be rebuilt here: a typed refusal
    from tiercheck.errors import ReplayRequired
    from tiercheck.logversions.replay import replay_offline

    with tiercheck.Checkpointer(root, read_only=True) as ro:
        v = ro.version(2)
        object.__setattr__(v.manifest, "log", replace(v.manifest.log, optimizer="my.Opt"))
        with pytest.raises(ReplayRequired, match=r"not one of torch\.optim"):
            replay_offline(v)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_ranks_each_log_their_shard_and_restore_bit_identically(tmp_path: Path) -> None:
    proc = torchrun(HERE / "dist_scripts" / "log_worker.py", "--root", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["roles"] == ["base", "log", "log"], out
        assert out["role"] == "log" and out["step"] == 3 and out["replayed"] == 2, out
        assert out["fallback"] is None and out["identical"], out


def test_a_lost_gradient_chunk_falls_back_before_touching_the_state(tmp_path: Path) -> None:
    t = Trainer()
    ckpt = _store(tmp_path)
    try:
        ckpt.guard(t.opt)
        t.step()
        first = ckpt.save(1, t.state()).result()
        t.step()
        second = ckpt.save(2, t.state())
        second.wait()
        assert second.role == "log"
        base_ids = {c.id for c in ckpt.version(first.version).manifest.chunks}
        grad = ckpt.version(second.version).manifest.chunks[0].id  # step 0's gradients
        assert grad not in base_ids
        tier = ckpt.tierset.get("shm").tier
        assert tier is not None and tier.delete([grad]) == 1
        fresh = Trainer(seed=5)
        ckpt.guard(fresh.opt)
        info = ckpt.restore(fresh.state())
        assert info.version == first.version and info.replayed_steps == 0
        assert info.fallback is not None and f"version {second.version}" in info.fallback
    finally:
        ckpt.destroy()


def test_a_state_without_the_optimizer_is_never_a_log_version(tmp_path: Path) -> None:
    """The replay needs the optimizer's state in the base: without it, saves stay full."""
    t = Trainer()
    ckpt = _store(tmp_path)
    try:
        ckpt.guard(t.opt)
        roles = []
        for step in (1, 2):
            t.step()
            h = ckpt.save(step, {"model": t.model})
            assert h.role is None or h.role in ("base", "diff")  # known once planned
            roles.append(h.result().role)
        assert roles == ["base", "diff"]
    finally:
        ckpt.destroy()
