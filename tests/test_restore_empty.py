"""A first launch: ``restore(state, missing_ok=True)`` on an empty store returns None and
leaves the state alone; without it the error says the store is empty. A store that has
versions none of which can be read is not empty: that still raises, missing_ok or not."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch
from _dist import free_port, torchrun

import tiercheck
from tiercheck import TierSpec
from tiercheck.errors import EmptyStore, NoRestorableVersion


def tiers(tmp_path: Path) -> list[TierSpec]:
    return [
        TierSpec("mem", f"memory://{uuid.uuid4().hex}"),
        TierSpec("lmdb", f"lmdb://{tmp_path / 'lmdb'}"),
    ]


def test_an_empty_store_restores_nothing_with_missing_ok(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with tiercheck.Checkpointer(tmp_path / "s", tiers=tiers(tmp_path)) as ckpt:
        assert ckpt.restore({"model": model}, missing_ok=True) is None
        with pytest.raises(EmptyStore, match="the store is empty") as err:
            ckpt.restore({"model": model})
        assert "missing_ok=True" in str(err.value)
        assert isinstance(err.value, NoRestorableVersion)  # what callers caught before
        with pytest.raises(EmptyStore, match="in tiers lmdb"):
            ckpt.restore({"model": model}, tiers=["lmdb"])
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        # the idiom of the docs: resume if there is anything, else start at step 1
        info = ckpt.restore({"model": model}, missing_ok=True)
        start = info.step + 1 if info is not None else 1
        assert start == 1
        ckpt.save(start, {"model": model}).wait()
        with torch.no_grad():
            model.weight.add_(1.0)
        info = ckpt.restore({"model": model}, missing_ok=True)
    assert info is not None and info.step == 1
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_store_whose_versions_cannot_be_read_is_not_empty(tmp_path: Path) -> None:
    spec = [TierSpec("lmdb", f"lmdb://{tmp_path / 'lmdb'}")]
    with tiercheck.Checkpointer(tmp_path / "s", tiers=spec) as ckpt:
        ckpt.save(1, {"w": torch.ones(1024)}).wait()
        tier = ckpt.tierset.get("lmdb").tier
        assert tier is not None
        tier.delete(list(tier.list()))  # every blob gone, the log still names the version
        for missing_ok in (False, True):
            with pytest.raises(NoRestorableVersion) as err:
                ckpt.restore({"w": torch.zeros(1024)}, missing_ok=missing_ok)
            assert not isinstance(err.value, EmptyStore)


@pytest.mark.slow
@pytest.mark.parametrize("remote", ["none", "down"])
def test_every_rank_agrees_the_store_is_empty(tmp_path: Path, remote: str) -> None:
    """Two gloo ranks under torchrun: missing_ok gives None on every rank, EmptyStore
    without it on every rank; after a save both restore it. ``down``: the store's remote
    tier cannot be reached at this first launch, which changes nothing (the store's id was
    drawn by this open, so no tier holds a version of it). Before, every rank raised
    ``NoRestorableVersion`` telling the user to move the unreachable tier aside."""
    script = Path(__file__).parent / "dist_scripts" / "empty_worker.py"
    args = [str(tmp_path / "store")] + ([str(free_port())] if remote == "down" else [])
    proc = torchrun(script, *args, nproc=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    for r in rows:
        assert r["missing_ok"] is True and "the store is empty" in r["error"]
        assert r["restored"] is True and r["same"] is True
