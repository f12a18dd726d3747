"""History reads the logical state of a log version (issue 26, item 3).

A guarded store (``ckpt.guard(optimizer)``) saves log versions between full versions: the
optimizer inputs since the base, not the state. Browsing history must still show the state
each version stands for: its base's tensors with the logged steps replayed, bit for bit,
never the internal ``/log/S/I`` gradient entries; and where the replay cannot be done here,
a typed :class:`~tiercheck.errors.ReplayRequired` that says how to get the state.

Every store here is a real default store (``tiercheck.Checkpointer(root)``: shm, LMDB and
the file-backed remote tier) trained by the small transformer of ``tests/_models.py``.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from _models import Trainer
from update_log_run import SKIP_AT, Run

import tiercheck
from tiercheck.cli.main import main
from tiercheck.errors import ReplayRequired
from tiercheck.formats.manifest import Fingerprint
from tiercheck.history.versions import Version


def live_state(t: Trainer | Run) -> dict[str, Any]:
    """The trainer's model parameters, buffers and optimizer state now, by state key, cloned."""
    out: dict[str, Any] = {
        f"model/{k}": v.detach().clone() for k, v in t.model.state_dict().items()
    }
    for pid, st in t.opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"optim/state/{pid}/{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    out["loader"] = copy.deepcopy(t.loader)
    return out


def assert_reads_as(v: Version, expected: dict[str, Any]) -> None:
    for key, want in expected.items():
        got = v[key]
        if isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor), key
            assert got.dtype == want.dtype and got.shape == want.shape, key
            assert torch.equal(got, want), key
        else:
            assert got == want, key


@dataclass
class Guarded:
    """A closed guarded store whose versions are ``roles`` (base, then log versions), with
    the trainer's live state at each version's save in ``states``."""

    root: Path
    roles: list[str]
    states: list[dict[str, Any]]
    trainer: Trainer


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[Guarded]:
    t = Trainer()
    root = tmp_path / "store"
    ckpt = tiercheck.Checkpointer(root)
    try:
        ckpt.guard(t.opt)
        roles, states = [], []
        for step in (1, 2, 3):
            t.step()
            roles.append(ckpt.save(step, t.state()).result().role)
            states.append(live_state(t))
        ckpt.close()
        yield Guarded(root, roles, states, t)
    finally:
        ckpt.destroy()


def test_the_latest_version_of_a_guarded_store_reads_as_the_trainers_state(
    guarded: Guarded,
) -> None:
    assert guarded.roles == ["base", "log", "log"]
    with tiercheck.Checkpointer(guarded.root, read_only=True) as ckpt:
        for vid in (2, 1):  # the newest, then an older log version of the same base
            v = ckpt.version("latest") if vid == 2 else ckpt.version(vid)
            assert (v.id, v.role, v.base) == (vid, "log", 0)
            want = guarded.states[vid]
            assert_reads_as(v, want)
            keys = v.keys()
            assert not [k for k in keys if k.startswith("/log/")]
            assert set(want) <= set(v.entries) and "model/head.weight" in v
            model = v.to_state_dict("model/")
            assert model.keys() == {k for k in want if k.startswith("model/")}
            for k, value in model.items():
                assert torch.equal(value, want[k]), k
            everything = v.to_state_dict()
            assert everything.keys() == v.entries.keys()
            assert everything["loader"] == want["loader"]
            both = v.read(["model/pos", "loader"])
            assert torch.equal(both["model/pos"], want["model/pos"])
        base = ckpt.version(0)
        assert base.role == "base" and base.entries == base.stored_entries
        assert_reads_as(base, guarded.states[0])
        # the stored shard is still there to see: the logged gradients and the own leaves
        stored = ckpt.version(2).stored_entries
        assert any(k.startswith("/log/1/") for k in stored) and "model/pos" not in stored


def test_reading_history_next_to_the_trainer_matches_every_step_and_leaves_it_alone(
    tmp_path: Path,
) -> None:
    """In the training process, with the writer open: AdamW with clipping, OneCycleLR and a
    GradScaler that skips a step. After every save the newest version reads as the live
    state, and reading it neither changes the trainer nor stops the next saves being logs."""
    run = Run(seed=3)
    ckpt = tiercheck.Checkpointer(tmp_path / "store")
    try:
        ckpt.guard(run.opt, run.scaler)
        roles = []
        for _ in range(SKIP_AT + 1):
            run.step()
            roles.append(ckpt.save(run.steps, run.state()).result().role)
            want = live_state(run)
            v = ckpt.version("latest")
            assert (v.role, v.step) == (roles[-1], run.steps)
            assert_reads_as(v, want)
            assert_reads_as(v, live_state(run))  # the read did not touch the trainer
        assert roles[0] == "base" and roles[1:] == ["log"] * SKIP_AT, roles
        rlog = ckpt.version("latest").manifest.log
        assert rlog is not None and rlog.steps[SKIP_AT - 2].skipped  # replayed as skipped
    finally:
        ckpt.destroy()


def test_a_log_version_is_replayed_once_and_reads_return_fresh_values(guarded: Guarded) -> None:
    with tiercheck.Checkpointer(guarded.root, read_only=True) as ckpt:
        v = ckpt.version(2)
        first = v["model/head.weight"]
        first.zero_()  # the caller's copy: the version's own cache is not touched
        assert torch.equal(v["model/head.weight"], guarded.states[2]["model/head.weight"])
        # the replay verified once; the log could change now and reads would not notice
        _damage_fingerprint(v, "param/0")
        assert torch.equal(v["model/pos"], guarded.states[2]["model/pos"])
        fresh = ckpt.version(2)  # another Version object replays again, and refuses
        _damage_fingerprint(fresh, "param/0")
        with pytest.raises(ReplayRequired):
            fresh["model/pos"]


def _damage_fingerprint(v: Version, name: str) -> None:
    """Flip a byte of the fingerprint ``name`` in ``v``'s (cached) shard manifest."""
    rlog = v.manifest.log
    assert rlog is not None
    fp = rlog.fingerprints[name]
    bad = Fingerprint(fp.algo, bytes([fp.digest[0] ^ 0xFF]) + fp.digest[1:])
    damaged = replace(rlog, fingerprints={**rlog.fingerprints, name: bad})
    object.__setattr__(v.manifest, "log", damaged)


def test_replay_required_when_the_replay_does_not_verify(guarded: Guarded) -> None:
    with tiercheck.Checkpointer(guarded.root, read_only=True) as ckpt:
        v = ckpt.version("latest")
        _damage_fingerprint(v, "state/3/exp_avg")
        with pytest.raises(ReplayRequired) as err:
            v["model/head.weight"]
        assert (err.value.version, err.value.base) == (2, 0)
        message = str(err.value)
        assert "state/3/exp_avg" in message  # why
        assert "ckpt.guard(optimizer)" in message and "ckpt.restore(state)" in message  # how
        with pytest.raises(ReplayRequired):
            v.to_state_dict("model/")
        # what needs no replay is still there: the entries, and the log version's own leaves
        assert "model/head.weight" in v.entries
        assert v["loader"] == guarded.states[2]["loader"]


def test_replay_required_for_a_torch_the_log_was_not_written_by(guarded: Guarded) -> None:
    with tiercheck.Checkpointer(guarded.root, read_only=True) as ckpt:
        v = ckpt.version("latest")
        rlog = v.manifest.log
        assert rlog is not None
        object.__setattr__(v.manifest, "log", replace(rlog, torch="1.0.0"))
        with pytest.raises(ReplayRequired, match=r"torch version: saved '1\.0\.0'"):
            v.read(["model/pos"])


def _cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> str:
    capsys.readouterr()
    assert main([str(a) for a in args]) == 0
    return capsys.readouterr().out


def test_show_lists_the_logical_entries_of_a_log_version(
    guarded: Guarded, capsys: pytest.CaptureFixture[str]
) -> None:
    data = json.loads(_cli(capsys, "show", guarded.root, "latest", "--json"))
    assert (data["id"], data["role"], data["base"]) == (2, "log", 0)
    entries = {e["key"]: e for e in data["entries"]}
    assert not [k for k in entries if k.startswith("/log/")]
    assert set(guarded.states[2]) <= set(entries)
    head = entries["model/head.weight"]
    assert head["replayed"] == "param/26" and head["shape"] == [32, 32]
    assert head["dtype"] == "float32" and head["size"] == 32 * 32 * 4
    assert entries["loader"]["replayed"] is None
    assert data["replay"]["steps"] == 2 and data["replay"]["gradients"] > 0
    text = _cli(capsys, "show", guarded.root, "latest")
    assert "log of version 0" in text and "/log/" not in text
    assert re.search(r"model/head\.weight .*replayed", text)
    base = json.loads(_cli(capsys, "show", guarded.root, "0", "--json"))
    assert all(e["replayed"] is None for e in base["entries"])


def test_diff_of_a_base_and_a_log_version_compares_their_states(
    guarded: Guarded, capsys: pytest.CaptureFixture[str]
) -> None:
    data = json.loads(_cli(capsys, "diff", guarded.root, "0", "latest", "--json"))
    assert data["added"] == [] and data["removed"] == []
    assert (data["a_role"], data["b_role"]) == ("base", "log")
    changed = {c["key"] for c in data["changed"]}
    before, after = guarded.states[0], guarded.states[2]
    moved = {
        k
        for k, value in after.items()
        if isinstance(value, torch.Tensor) and not torch.equal(value, before[k])
    }
    assert "model/head.weight" in moved and moved <= changed
    assert "loader" in changed  # an own leaf of the log version
    assert not [k for k in data["unchanged"] if k in moved]
    text = _cli(capsys, "diff", guarded.root, "0", "2")
    assert "version 0 (base) -> 2 (log of 0)" in text and "0 added, 0 removed," in text
    between = json.loads(_cli(capsys, "diff", guarded.root, "1", "2", "--json"))
    assert "model/head.weight" in {c["key"] for c in between["changed"]}
    assert between["removed"] == [] and between["added"] == []


def test_ls_marks_the_role_of_every_version(
    guarded: Guarded, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = json.loads(_cli(capsys, "ls", guarded.root, "--json"))["versions"]
    assert [(r["role"], r["base"]) for r in rows] == [("base", None), ("log", 0), ("log", 0)]
    assert rows[1]["logical_bytes"] == rows[0]["logical_bytes"]  # the state, not the log
    text = _cli(capsys, "ls", guarded.root)
    assert text.count("log of 0") == 2
    assert "replayed" in text  # what a log version is, said once under the table
