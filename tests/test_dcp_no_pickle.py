"""Loading a DCP checkpoint through TierReader runs no pickle from the store by default."""

from __future__ import annotations

import pathlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

from tiercheck import Policy, TierPolicy
from tiercheck.errors import UnsupportedValue
from tiercheck.integrations.dcp import TierReader, TierWriter

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Planted:
    """Unpickling this touches ``marker``: what an attacker's payload would do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def _save(root: Path, state: dict[str, Any]) -> None:
    keep = TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=None)
    with TierWriter(
        root,
        tiers=lambda r: [("lmdb", f"lmdb://{r}/lmdb")],
        policy=Policy(tiers={"lmdb": keep}),
    ) as writer:
        save(state, storage_writer=writer, checkpoint_id="step:1")


def test_planted_pickle_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    _save(tmp_path / "dcp", {"w": torch.arange(4.0), "extra": Planted(marker)})
    assert not marker.exists()  # saving pickles, it does not run the payload
    target: dict[str, Any] = {"w": torch.zeros(4), "extra": None}
    with pytest.raises(CheckpointException) as info:
        load(target, storage_reader=TierReader(tmp_path / "dcp"))
    (failure,) = info.value.failures.values()  # (exception, traceback) of rank 0
    assert isinstance(failure[0], UnsupportedValue)
    failure = failure[0]
    assert "Unsupported global" in str(failure) and "allow_pickle" in str(failure)
    assert not marker.exists()
    # the explicit opt-in loads it the way DCP's planner always would: the payload runs
    load(target, storage_reader=TierReader(tmp_path / "dcp", allow_pickle=True))
    assert marker.exists()


def test_plain_byte_items_load_without_pickle(tmp_path: Path) -> None:
    state = {"w": torch.arange(6.0), "step": 7, "cfg": {"lr": 0.5, "names": ["a", "b"]}}
    _save(tmp_path / "dcp", state)
    target: dict[str, Any] = {"w": torch.zeros(6), "step": 0, "cfg": {"lr": 0.0, "names": []}}
    load(target, storage_reader=TierReader(tmp_path / "dcp"))
    assert torch.equal(target["w"], state["w"])
    assert target["step"] == 7 and target["cfg"] == state["cfg"]
