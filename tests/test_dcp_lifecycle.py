"""DCP's own lifecycle on tiercheck, in one process: shards without a tensor, a new writer per
save, and what a save leaves behind when it returns (issue 34).

DCP's storage protocol has no close, and its idiom is a new writer per save; whatever state a
rank holds (no tensor at all included) must load back.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.engine.coordinator import LocalCoordinator
from tiercheck.errors import StoreLocked, UnsupportedValue
from tiercheck.integrations.dcp import TierReader, TierWriter, rank_root

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def tiers(root: Path) -> list[Any]:
    """LMDB in the commit, and a "remote" directory inside the checkpoint that takes every
    version in the background (the default store's layout, without shm)."""
    return [
        ("lmdb", f"lmdb://{root}/lmdb"),
        TierSpec("remote", f"file://{root}/remote", {"shared": True, "survives": "process"}),
    ]


def policy() -> Policy:
    sync = TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=None)
    later = TierPolicy(versions="all", mode="async", codec="raw", keep_bases=None)
    return Policy(base_every=10, chunk_size=16 * 1024, tiers={"lmdb": sync, "remote": later})


def writer(root: Path, **kwargs: Any) -> TierWriter:
    return TierWriter(root, tiers=tiers, policy=policy(), **kwargs)


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "dcp"
    yield path
    TierWriter(path).close()  # this process's stores under the root, if any are open


def history(root: Path) -> list[tuple[int, dict[str, str]]]:
    with Checkpointer(rank_root(root, 0), read_only=True, coordinator=LocalCoordinator()) as c:
        return [(v.step, dict(v.tiers)) for v in c.history()]


# --- a shard without a tensor ---------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "target"),
    [
        ({"epoch": 5}, {"epoch": -1}),
        ({}, {}),
        (
            {"loader": {"epoch": 2, "names": ["a", "b"]}, "seed": 7},
            {"loader": {"epoch": 0, "names": ["", ""]}, "seed": 0},
        ),
    ],
    ids=["one-int", "empty", "nested"],
)
def test_a_state_without_a_tensor_round_trips(
    root: Path, state: dict[str, Any], target: dict[str, Any]
) -> None:
    save(state, storage_writer=writer(root))
    load(target, storage_reader=TierReader(root))
    assert target == state


def test_byte_items_beside_tensors_round_trip(root: Path) -> None:
    state: dict[str, Any] = {"w": torch.arange(6.0), "epoch": 3, "note": "x" * 100_000}
    save(state, storage_writer=writer(root))
    target: dict[str, Any] = {"w": torch.zeros(6), "epoch": 0, "note": ""}
    load(target, storage_reader=TierReader(root))
    assert torch.equal(target["w"], state["w"])
    assert target["epoch"] == 3 and target["note"] == state["note"]


# --- a writer per save ------------------------------------------------------------------


def test_a_new_writer_per_save_on_one_root(root: Path) -> None:
    kept = []  # every writer stays referenced: the garbage collector releases nothing
    for step in range(3):
        w = writer(root)
        kept.append(w)
        save({"w": torch.full((64,), float(step)), "step": step}, storage_writer=w)
    target: dict[str, Any] = {"w": torch.zeros(64), "step": -1}
    load(target, storage_reader=TierReader(root))
    assert target["step"] == 2 and torch.equal(target["w"], torch.full((64,), 2.0))
    # one store, shared: the later versions are diffs against the first
    ckpt = kept[-1].checkpointer
    assert ckpt is not None and ckpt is kept[0].checkpointer
    assert [v.role for v in ckpt.history()] == ["base", "diff", "diff"]


def test_async_save_with_a_writer_per_save(root: Path) -> None:
    from torch.distributed.checkpoint.state_dict_saver import async_save

    futures = [  # two saves in flight at once, each with a writer of its own
        async_save({"w": torch.full((32,), float(s))}, storage_writer=writer(root), checkpoint_id=s)
        for s in range(2)
    ]
    for f in futures:
        f.result()
    assert sorted(step for step, _ in history(root)) == [0, 1]  # committed in either order


def test_when_save_returns_nothing_writes_in_the_checkpoint_directory(
    root: Path, tmp_path: Path
) -> None:
    w = writer(root)
    save({"w": torch.randn(256, 256), "epoch": 1}, storage_writer=w)
    # committed in every tier, the background one included: nothing is left to write here
    assert history(root) == [(0, {"lmdb": "committed", "remote": "committed"})]
    moved = tmp_path / "moved"
    root.rename(moved)  # what a caller may do right after the save
    target: dict[str, Any] = {"w": torch.zeros(256, 256), "epoch": 0}
    load(target, storage_reader=TierReader(moved))
    assert target["epoch"] == 1
    w.close()
    assert not root.exists()  # nothing wrote into the old path, the close included
    TierWriter(moved).close()


def test_background_migrations_are_asked_for_and_waited_by_close(root: Path) -> None:
    w = writer(root, background=True)
    save({"w": torch.randn(128, 128)}, storage_writer=w)
    assert w.wait_migrations()
    assert history(root) == [(0, {"lmdb": "committed", "remote": "committed"})]
    w.close()


def test_a_save_after_the_directory_was_deleted_starts_a_new_store(root: Path) -> None:
    import shutil

    save({"w": torch.ones(8)}, storage_writer=writer(root))
    shutil.rmtree(root)
    save({"w": torch.full((8,), 2.0)}, storage_writer=writer(root))
    assert [step for step, _ in history(root)] == [0]
    target = {"w": torch.zeros(8)}
    load(target, storage_reader=TierReader(root))
    assert torch.equal(target["w"], torch.full((8,), 2.0))


def test_store_locked_names_the_holder_and_this_process(root: Path) -> None:
    save({"w": torch.ones(4)}, storage_writer=writer(root))
    with pytest.raises(StoreLocked) as info:
        Checkpointer(rank_root(root, 0), coordinator=LocalCoordinator())
    assert f"pid {os.getpid()}" in str(info.value) and "this process" in str(info.value)
    TierWriter(root).close()  # hands the store over
    Checkpointer(rank_root(root, 0), coordinator=LocalCoordinator()).close()


# --- pickled byte items ---------------------------------------------------------------


def test_a_pickled_bytesio_item_is_refused_by_name_with_the_opt_in(root: Path) -> None:
    state: dict[str, Any] = {"w": torch.ones(4), "blob": io.BytesIO(b"raw bytes")}
    save(state, storage_writer=writer(root))
    target: dict[str, Any] = {"w": torch.zeros(4), "blob": io.BytesIO()}
    with pytest.raises(CheckpointException) as info:
        load(target, storage_reader=TierReader(root))
    (failure,) = info.value.failures.values()
    err = failure[0]
    assert isinstance(err, UnsupportedValue)
    assert "'blob'" in str(err) and "BytesIO" in str(err) and "allow_pickle=True" in str(err)
    load(target, storage_reader=TierReader(root, allow_pickle=True))
    assert target["blob"].getvalue() == b"raw bytes"
