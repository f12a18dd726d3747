"""FSDP2 (``fully_shard``) and DTensor state through ``Checkpointer.save/restore``.

The multi-rank test runs real torchrun processes (CPU, gloo): bit-identical restore on the
same mesh, and resharding when the world size changes (1 -> 2 and 2 -> 1, the latter also
into a plain unsharded model). The one-process side runs here, in a one-rank gloo group.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import free_port, torchrun
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from tiercheck import Checkpointer
from tiercheck.errors import NoRestorableVersion, StateError, UnsupportedValue

WORKER = Path(__file__).parent / "dist_scripts" / "fsdp_worker.py"
pytestmark = pytest.mark.timeout(240)


def load_worker() -> ModuleType:
    """The worker script as a module, with its directory on the path as torchrun gives it
    (it imports ``_leave`` from there; the test passed alone only where an earlier test of
    the same process had left that directory on the path)."""
    spec = importlib.util.spec_from_file_location("fsdp_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(WORKER.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(WORKER.parent))
    return module


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    """A one-rank gloo group in this process and its CPU mesh."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_state_restores_bit_identically_on_any_world_size(
    tmp_path: Path, mesh: DeviceMesh
) -> None:
    w = load_worker()
    with w.store(tmp_path / "one") as ckpt:  # saved by one process, restored by two
        model, opt = w.build(shard=True)
        for i in range(2):
            w.step(model, opt, i)
        ckpt.save(2, {"model": model, "optim": opt}).wait()
        torch.save(w.snapshot(model, opt), tmp_path / "one.pt")
    proc = torchrun(WORKER, str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "OK 0" in proc.stdout and "OK 1" in proc.stdout
    want = torch.load(tmp_path / "two.pt")  # saved by two processes, restored by one
    with w.store(tmp_path / "two") as ckpt:
        model, opt = w.build(shard=True)
        ckpt.restore({"model": model, "optim": opt})
        w.check(w.snapshot(model, opt), want, "restore 2 -> 1")
        plain, popt = w.build(shard=False)
        ckpt.restore({"model": plain, "optim": popt})
        w.check(w.snapshot(plain, popt), want, "restore 2 -> 1 into a plain model")
        assert torch.equal(ckpt.version(0)["model/0.weight"], want["p/0.weight"])
        # all or nothing: without rank 1's shard nothing is restored, nothing is written
        rank1 = ckpt.version(0).info.shards[1]
        (tmp_path / "two" / "files" / "blobs" / rank1[:2] / rank1).unlink()
        fresh, fopt = w.build(shard=False)
        before = w.snapshot(fresh, fopt)
        with pytest.raises(NoRestorableVersion):
            ckpt.restore({"model": fresh, "optim": fopt}, repair=False)
        w.check(w.snapshot(fresh, fopt), before, "a failed restore")


def test_a_dtensor_is_saved_as_its_local_piece_with_its_placement(
    tmp_path: Path, mesh: DeviceMesh
) -> None:
    w = torch.randn(6, 5)
    state: dict[str, Any] = {"w": distribute_tensor(w, mesh, [Shard(1)]), "b": torch.ones(3)}
    state["r"] = distribute_tensor(torch.arange(4.0), mesh, [Replicate()])
    with Checkpointer(tmp_path / "s", tiers=[f"file://{tmp_path}/f"]) as ckpt:
        ckpt.save(1, state).wait()
        m = ckpt.version(0).manifest
        index = {e.key: i for i, e in enumerate(m.entries)}
        assert set(m.sharded) == {index["w"], index["r"]}
        p = m.sharded[index["w"]]
        assert (p.global_shape, p.global_stride, p.mesh_shape) == ((6, 5), (5, 1), (1,))
        assert (p.placements, p.offsets) == (("S(1)",), (0, 0))
        assert m.sharded[index["r"]].placements == ("R",)
        assert {"s": index["w"]} in [node for _, node in m.tree["d"]]
        # into DTensors (in place), plain tensors (the whole tensor) and placeholders
        target = distribute_tensor(torch.zeros(6, 5), mesh, [Shard(1)])
        local = target.to_local()
        ckpt.restore({"w": target, "b": torch.zeros(3), "r": torch.zeros(4)})
        assert torch.equal(target.full_tensor(), w) and target.to_local() is not None
        assert local.data_ptr() == target.to_local().data_ptr()
        info = ckpt.restore({"w": None, "b": None, "r": None})
        assert torch.equal(info.state["w"], w) and torch.equal(info.state["r"], torch.arange(4.0))
    from tiercheck.cli.main import main

    assert main(["export", str(tmp_path / "s"), "latest", str(tmp_path / "out.pt")]) == 0
    exported = torch.load(tmp_path / "out.pt")
    assert torch.equal(exported["w"], w) and torch.equal(exported["r"], torch.arange(4.0))


def test_dtensor_mismatches_are_refused_before_anything_is_written(
    tmp_path: Path, mesh: DeviceMesh
) -> None:
    partial = DTensor.from_local(torch.ones(4), mesh, [Partial()])
    with Checkpointer(tmp_path / "s", tiers=[f"file://{tmp_path}/f"]) as ckpt:
        with pytest.raises(UnsupportedValue, match="Partial"):
            ckpt.save(1, {"p": partial})
        ckpt.save(2, {"w": distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])}).wait()
        wrong = torch.zeros(4, 5)
        with pytest.raises(StateError, match="global"):
            ckpt.restore({"w": wrong})
        assert not wrong.any()
        with pytest.raises(StateError, match="saved a tensor"):
            ckpt.restore({"w": "text"})
