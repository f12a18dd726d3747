"""tiercheck.rng_state(): plain values only, bit-exact round trips, older states still load."""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

import tiercheck
from tiercheck.errors import StateError


def _draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_state_is_weights_only_loadable_and_round_trips(tmp_path: Path) -> None:
    np.random.seed(3)
    np.random.standard_normal()  # leaves a cached gaussian in the legacy state
    state = tiercheck.rng_state()
    expected = _draws()
    torch.save({"rng": state}, tmp_path / "rng.pt")
    loaded = torch.load(tmp_path / "rng.pt", weights_only=True)["rng"]
    _draws()
    tiercheck.set_rng_state(loaded)
    assert _draws() == expected


def test_round_trip_through_a_store(tmp_path: Path) -> None:
    with tiercheck.Checkpointer(tmp_path / "s", tiers=["memory://" + uuid.uuid4().hex]) as ckpt:
        ckpt.save(0, {"rng": tiercheck.rng_state()}).wait()
        expected = _draws()
        info = ckpt.restore({"rng": None})  # None: a placeholder for what was saved
    tiercheck.set_rng_state(info.state["rng"])
    assert _draws() == expected


def test_older_numpy_tuple_state_still_restores() -> None:
    old = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),  # the tuple with an ndarray key tiercheck stored before
        "torch": torch.get_rng_state(),
    }
    expected = _draws()
    tiercheck.set_rng_state(old)
    assert _draws() == expected
    as_lists = dict(old, numpy=[old["numpy"][0], old["numpy"][1].tolist(), *old["numpy"][2:]])
    tiercheck.set_rng_state(as_lists)
    assert _draws() == expected


def test_none_placeholder_only_where_given(tmp_path: Path) -> None:
    with tiercheck.Checkpointer(tmp_path / "s", tiers=["memory://" + uuid.uuid4().hex]) as ckpt:
        ckpt.save(0, {"a": {"x": torch.ones(2)}, "b": torch.zeros(2)}).wait()
        info = ckpt.restore({"a": None, "b": torch.empty(2)})
        assert torch.equal(info.state["a"]["x"], torch.ones(2))
        with pytest.raises(StateError, match="saved a dict"):
            ckpt.restore({"a": 5, "b": torch.empty(2)})
