"""Input a new user passed to the Python API and got a Python error from inside tiercheck
for (or nothing at all): each is refused with a typed error saying what to pass instead,
before anything is written. Every case here raised ``TypeError``, ``AttributeError``,
``RuntimeError`` or ``RecursionError`` from tiercheck's internals, or was accepted and
lost what it held, before its mend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tiercheck
from tiercheck.errors import CheckpointError, ConfigError, StateError, UnsupportedValue


@pytest.fixture
def saved(memory_ckpt: tiercheck.Checkpointer) -> tiercheck.Checkpointer:
    memory_ckpt.save(1, {"x": torch.tensor([1.0, 2.0]), "c": torch.tensor([1 + 2j])}).wait()
    return memory_ckpt


def _state(x: torch.Tensor | None = None, c: torch.Tensor | None = None) -> dict[str, Any]:
    return {
        "x": torch.zeros(2) if x is None else x,
        "c": torch.zeros(1, dtype=torch.complex64) if c is None else c,
    }


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_a_conjugate_or_negative_view_is_refused_as_a_target(
    saved: tiercheck.Checkpointer, view: str
) -> None:
    """Its memory holds other values than it shows (torch's lazy conj and neg bits), so
    the saved bytes cannot be written into it. Was a RuntimeError from ``Tensor.view``."""
    if view == "conj":
        state = _state(c=torch.zeros(1, dtype=torch.complex64).conj())
    else:
        state = _state(x=torch._neg_view(torch.zeros(2)))
    with pytest.raises(StateError, match=f"{'conjugate' if view == 'conj' else 'negative'} view"):
        saved.restore(state)
    assert not state["x"].any() and not state["c"].any()


@pytest.mark.parametrize("version", ["latest", -1, 1.0, True])
def test_restore_refuses_a_version_that_is_not_an_id(
    saved: tiercheck.Checkpointer, version: Any
) -> None:
    """``"latest"`` raised a TypeError comparing str with int; ``-1`` said that version
    was committed and then dropped by retention."""
    with pytest.raises(ValueError, match="version must be an int from 0 or None"):
        saved.restore(_state(), version=version)
    with pytest.raises(ValueError, match="step must be an int from 0 or None"):
        saved.restore(_state(), step=-3)


@pytest.mark.parametrize("tiers", [[], "mem"])
def test_restore_refuses_tiers_that_name_no_tier(saved: tiercheck.Checkpointer, tiers: Any) -> None:
    """``tiers=[]`` with ``missing_ok`` returned None on a store that holds a version (a
    resume script would start over); a string was read letter by letter."""
    with pytest.raises(ConfigError, match="non-empty list of tier names"):
        saved.restore(_state(), tiers=tiers, missing_ok=True)


@pytest.mark.parametrize("spec", [1.5, None, b"1", -1])
def test_version_refuses_what_names_no_version(saved: tiercheck.Checkpointer, spec: Any) -> None:
    if spec is None:  # None is the newest version
        assert saved.version(spec).step == 1
        return
    with pytest.raises(ValueError, match="not a version"):
        saved.version(spec)


@pytest.mark.parametrize("state", [None, [("w", torch.ones(1))], "w"])
def test_a_state_that_is_not_a_mapping_is_refused(
    memory_ckpt: tiercheck.Checkpointer, state: Any
) -> None:
    """``dict(state)`` ran before the check: None raised a TypeError, a list of pairs was
    saved as if it were a dict."""
    for call in (lambda: memory_ckpt.save(1, state), lambda: memory_ckpt.prepare(state)):
        with pytest.raises(StateError, match="a state must be a dict"):
            call()
    assert list(memory_ckpt.history()) == []


def test_a_container_that_holds_itself_is_refused(memory_ckpt: tiercheck.Checkpointer) -> None:
    cfg: dict[str, Any] = {"lr": 0.1}
    cfg["me"] = cfg
    with pytest.raises(StateError, match="holds itself"):
        memory_ckpt.save(1, {"cfg": cfg, "w": torch.ones(2)})


@pytest.mark.parametrize(
    "array",
    [np.ma.masked_array([1.0, 2.0, 3.0], mask=[0, 1, 0]), np.matrix([[1.0, 2.0]])],
    ids=["masked", "matrix"],
)
def test_numpy_subclasses_are_refused_not_flattened(
    memory_ckpt: tiercheck.Checkpointer, array: np.ndarray
) -> None:
    """A masked array came back without its mask, a matrix as a plain array."""
    with pytest.raises(UnsupportedValue, match=f"subclass {type(array).__qualname__}"):
        memory_ckpt.save(1, {"a": array})


def test_a_memmap_is_saved_as_the_array_it_is(
    memory_ckpt: tiercheck.Checkpointer, tmp_path: Path
) -> None:
    mm = np.memmap(tmp_path / "mm", dtype=np.float32, mode="w+", shape=(4,))
    mm[:] = [1, 2, 3, 4]
    memory_ckpt.save(1, {"a": mm}).wait()
    out = {"a": np.zeros(4, dtype=np.float32)}
    memory_ckpt.restore(out)
    assert out["a"].tolist() == [1, 2, 3, 4]


def test_prepare_and_guard_after_close_are_refused(tmp_path: Path) -> None:
    """As save and restore are: ``prepare`` after close wrote its pages into the closed
    store's shm segment (160 MB for an 80 MB state)."""
    ckpt = tiercheck.Checkpointer(tmp_path / "store")
    ckpt.close()
    try:
        with pytest.raises(CheckpointError, match="closed"):
            ckpt.prepare({"w": torch.zeros(1 << 20)})
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        with pytest.raises(CheckpointError, match="closed"):
            ckpt.guard(opt)
    finally:
        ckpt.destroy()
