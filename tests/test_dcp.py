"""tiercheck under torch.distributed.checkpoint, single process (see test_dcp_dist.py for ranks)."""

from __future__ import annotations

import pickle
import uuid
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import async_save, save

from tiercheck import Checkpointer, Policy, TierPolicy
from tiercheck.errors import ConfigError, StateError, UnsupportedValue
from tiercheck.integrations.dcp import (
    CheckpointRef,
    TierReader,
    TierWriter,
    decode_metadata,
    encode_metadata,
    parse_checkpoint_id,
    rank_root,
)
from tiercheck.integrations.dcp.ids import METADATA

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

CHUNK = 16 * 1024


def tiers_for(tag: str) -> Callable[[Path], list[tuple[str, str]]]:
    """A fast in-process tier plus LMDB, both keeping every version, per rank store."""
    return lambda root: [("mem", f"memory://{tag}-{root.name}"), ("lmdb", f"lmdb://{root}/lmdb")]


def policy() -> Policy:
    keep = TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=None)
    return Policy(base_every=10, chunk_size=CHUNK, tiers={"mem": keep, "lmdb": keep})


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[TierWriter]:
    w = TierWriter(tmp_path / "dcp", tiers=tiers_for(uuid.uuid4().hex), policy=policy())
    yield w
    w.close()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128))
        self.head = nn.Linear(128, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.frozen(x))
        return out


def trained(seed: int = 0) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        net(torch.randn(8, 128)).pow(2).mean().backward()
        opt.step()
    return net, opt


def app_state(net: Net, opt: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(net, opt)
    return {"model": msd, "optim": osd, "loader": {"epoch": 2, "position": 1234}}


def assert_same(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, path


def test_model_and_optimizer_round_trip(writer: TierWriter, tmp_path: Path) -> None:
    net, opt = trained()
    saved = app_state(net, opt)
    save(saved, storage_writer=writer)

    net2, opt2 = trained(seed=1)
    target = app_state(net2, opt2)
    target["loader"] = {"epoch": 0, "position": 0}
    load(target, storage_reader=TierReader(tmp_path / "dcp"))
    set_state_dict(net2, opt2, model_state_dict=target["model"], optim_state_dict=target["optim"])
    assert_same(app_state(net, opt), app_state(net2, opt2))
    assert target["loader"] == {"epoch": 2, "position": 1234}


def test_async_save_round_trip_with_default_stager(writer: TierWriter, tmp_path: Path) -> None:
    net, opt = trained()
    saved = app_state(net, opt)
    expected = app_state(*trained())  # the same values, in other tensors
    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        future = async_save(saved, storage_writer=writer, async_stager=stager)
        assert isinstance(future, Future)
        # staging is done when async_save returns: the trainer may change its state now
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)
        result = future.result()
    finally:
        stager.close()
    assert result.state_dict_metadata
    target = app_state(*trained(seed=3))
    load(target, storage_reader=TierReader(tmp_path / "dcp"))
    assert_same(expected, target)


def test_versions_in_history_and_diff_stores_less(writer: TierWriter, tmp_path: Path) -> None:
    net, _ = trained()
    for p in net.frozen.parameters():
        p.requires_grad_(False)
    save({"model": net.state_dict()}, storage_writer=writer)
    heads = [net.head.weight.detach().clone()]
    with torch.no_grad():
        net.head.weight.add_(0.5)
    heads.append(net.head.weight.detach().clone())
    save({"model": net.state_dict()}, storage_writer=writer)

    ckpt = writer.checkpointer
    assert ckpt is not None and ckpt.root == rank_root(tmp_path / "dcp", 0)
    hist = ckpt.history()
    assert [(v.step, v.role) for v in hist] == [(0, "base"), (1, "diff")]
    base, diff = hist
    assert diff.base == base.id
    assert diff.stored_bytes < base.stored_bytes / 4
    assert all(v.metadata["dcp"]["coordinator"] is True for v in hist)

    # both versions stay loadable, each with its own content
    for cid, head in (("step:0", heads[0]), ("step:1", heads[1])):
        target = {"model": {k: torch.zeros_like(v) for k, v in net.state_dict().items()}}
        load(target, checkpoint_id=cid, storage_reader=TierReader(tmp_path / "dcp"))
        assert torch.equal(target["model"]["head.weight"], head)
        assert torch.equal(target["model"]["frozen.0.weight"], net.state_dict()["frozen.0.weight"])


def test_filesystem_writer_and_tier_writer_load_identically(
    writer: TierWriter, tmp_path: Path
) -> None:
    net, opt = trained()
    state = app_state(net, opt)
    save(state, storage_writer=FileSystemWriter(tmp_path / "fs"))
    save(state, storage_writer=writer)

    def load_with(reader: Any) -> dict[str, Any]:
        target = app_state(*trained(seed=7))
        load(target, storage_reader=reader)
        return target

    from_fs = load_with(FileSystemReader(tmp_path / "fs"))
    from_tier = load_with(TierReader(tmp_path / "dcp"))
    assert_same(from_fs, from_tier)
    assert_same(state["model"], from_tier["model"])


def test_checkpoint_ids_name_steps_and_versions(writer: TierWriter, tmp_path: Path) -> None:
    save({"t": torch.full((4,), 1.0)}, checkpoint_id="step:10", storage_writer=writer)
    save({"t": torch.full((4,), 2.0)}, storage_writer=writer)  # next step: 11
    save({"t": torch.full((4,), 3.0)}, checkpoint_id=5, storage_writer=writer)
    ckpt = writer.checkpointer
    assert ckpt is not None
    assert [(v.id, v.step) for v in ckpt.history()] == [(0, 10), (1, 11), (2, 5)]

    def value(cid: str | None) -> float:
        target = {"t": torch.zeros(4)}
        load(target, checkpoint_id=cid, storage_reader=TierReader(ckpt))
        return float(target["t"][0])

    assert value(None) == 3.0  # newest version, whatever its step
    assert value("step:11") == 2.0
    assert value("10") == 1.0
    assert value("version:1") == 2.0
    with pytest.raises(CheckpointException, match="no restorable DCP checkpoint for step 99"):
        value("step:99")  # DCP wraps the reader's NoRestorableVersion
    with pytest.raises(ConfigError):
        save({"t": torch.zeros(4)}, checkpoint_id="version:3", storage_writer=writer)
    with pytest.raises(ConfigError):
        save({"t": torch.zeros(4)}, checkpoint_id=tmp_path / "x", storage_writer=writer)
    assert parse_checkpoint_id(None) == CheckpointRef()
    assert TierWriter.validate_checkpoint_id("step:3")
    assert not TierWriter.validate_checkpoint_id("/some/dir")


def test_metadata_is_msgpack_and_pickle_is_refused(writer: TierWriter, tmp_path: Path) -> None:
    net, opt = trained()
    md = save(app_state(net, opt), storage_writer=writer)
    ckpt = writer.checkpointer
    assert ckpt is not None
    v = ckpt.version("latest")
    # stored as bytes (a uint8 tensor) of plain msgpack, without extension types
    assert v.entries[METADATA].kind == "tensor"
    raw = v[METADATA].numpy().tobytes()
    obj = msgpack.unpackb(raw, raw=False)
    assert obj["format"] == "tiercheck-dcp"
    decoded = decode_metadata(raw).metadata
    assert decoded.state_dict_metadata == md.state_dict_metadata
    assert decoded.planner_data == md.planner_data
    assert set(decoded.storage_data) == set(md.storage_data)

    class Boom:
        def __reduce__(self) -> tuple[Any, ...]:
            return (pytest.fail, ("decode_metadata unpickled a payload",))

    with pytest.raises(StateError):
        decode_metadata(pickle.dumps(md))
    with pytest.raises(StateError):
        decode_metadata(pickle.dumps(Boom()))
    obj["surprise"] = 1
    with pytest.raises(StateError, match="unknown fields"):
        decode_metadata(msgpack.packb(obj))
    md.planner_data = {"x": object()}
    with pytest.raises(UnsupportedValue):
        encode_metadata(md)


def test_reader_refuses_a_pickled_metadata_entry(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    root = rank_root(tmp_path / "dcp", 0)
    with Checkpointer(root, tiers=tiers_for(tag)(root), allow_pickle=True) as ckpt:
        h = ckpt.save(
            0,
            {"pad": torch.zeros(1), METADATA: {1, 2}},  # a set is not msgpack: pickled
            metadata={"dcp": {"format": 1, "rank": 0, "coordinator": True}},
        )
        h.wait()
        assert ckpt.version(0).entries[METADATA].kind == "pickle"
    with pytest.raises(StateError, match="stored as 'pickle', not as bytes"):
        TierReader(tmp_path / "dcp").read_metadata()


def test_process_executor_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """async_save's process executor pickles the writer; it must work from a root path."""
    import socket

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # the checkpoint daemon's rendezvous
    try:
        root = tmp_path / "dcp"
        lmdb = f"lmdb://{rank_root(root, 0)}/lmdb"
        state: dict[str, Any] = {"w": torch.randn(64, 64), "meta": {"epoch": 5}}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            future = async_save(
                state,
                storage_writer=TierWriter(root, tiers=[("lmdb", lmdb)]),
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            )
            assert isinstance(future, Future)
            future.result(timeout=120)
        target: dict[str, Any] = {"w": torch.zeros(64, 64), "meta": {"epoch": 0}}
        load(target, storage_reader=TierReader(root))
        assert torch.equal(target["w"], state["w"])
        assert target["meta"] == {"epoch": 5}
    finally:
        dist.destroy_process_group()
