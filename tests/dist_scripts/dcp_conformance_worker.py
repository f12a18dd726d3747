"""A torchrun worker for tests/test_dcp_conformance.py: DCP's multi-rank cases, each run on
tiercheck's storage and on DCP's own file system storage in the same launch.

Usage: ``torchrun --nproc-per-node 4 ... dcp_conformance_worker.py WORK``

For each backend ``B`` (``tier``: TierWriter/TierReader, ``fs``: FileSystemWriter/
FileSystemReader), with ``WORK/B-one`` saved beforehand by one process (:func:`full_state`
at step 0):

- ``one-to-mesh``: load ``WORK/B-one`` into DTensors on a 2x2 mesh (world size 1 -> 4);
- ``writer-per-save``: save :func:`sharded` twice to ``WORK/B-four`` on the 2x2 mesh, a new
  writer each time; ``epoch`` is a plain int, so DCP gives it to one rank and the others'
  shards hold tensors only, and the ``tensor-free`` dict below has no tensor on any rank;
- ``mesh-change``: load the second save into a 1-D mesh of 4 with ``Shard(1)``;
- ``tensor-free``: save ``{"epoch": 3, "cfg": {...}}`` (no tensor anywhere) and load it.

Each rank prints ``B CASE: ok`` or ``B CASE: FAIL <why>`` per case; the test process then
loads ``WORK/B-four`` on one rank (4 -> 1).
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _leave import leave
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tiercheck.integrations.dcp import TierReader, TierWriter

BACKENDS = ("tier", "fs")


def tiers(root: Path) -> list[tuple[str, str]]:
    return [("lmdb", f"lmdb://{root}/lmdb")]


def writer(backend: str, path: Path) -> Any:
    return TierWriter(path, tiers=tiers) if backend == "tier" else FileSystemWriter(path)


def reader(backend: str, path: Path) -> Any:
    return TierReader(path) if backend == "tier" else FileSystemReader(path)


def full_state(step: int) -> dict[str, Any]:
    """The global values saved at ``step``."""
    g = torch.Generator().manual_seed(7 + step)
    return {
        "w": torch.randn(8, 12, generator=g),
        "emb": torch.randn(16, 4, generator=g).to(torch.bfloat16),
        "b": torch.arange(8, dtype=torch.float64) + step,
        "epoch": step,
    }


def sharded(
    full: dict[str, Any], mesh: Any, places: Callable[[torch.Tensor], list[Any]]
) -> dict[str, Any]:
    """``full`` as DTensors on ``mesh``, placed by ``places(tensor)``; other values as they are."""
    return {
        k: distribute_tensor(v, mesh, places(v)) if isinstance(v, torch.Tensor) else v
        for k, v in full.items()
    }


def grid_places(t: torch.Tensor) -> list[Any]:
    return [Shard(0), Shard(1)] if t.dim() > 1 else [Shard(0), Replicate()]


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: distribute_tensor(torch.zeros_like(v.full_tensor()), v.device_mesh, v.placements)
        if isinstance(v, DTensor)
        else -1
        for k, v in state.items()
    }


def check(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k, v in want.items():
        g = got[k]
        if isinstance(g, DTensor):
            g = g.full_tensor()
        if isinstance(v, torch.Tensor):
            assert g.dtype == v.dtype and torch.equal(g, v), f"{k} differs"
        else:
            assert g == v, f"{k}: {g!r} != {v!r}"


def run(backend: str, work: Path) -> dict[str, str]:
    rank = dist.get_rank()
    grid = init_device_mesh("cpu", (2, 2))
    line = init_device_mesh("cpu", (4,))
    results: dict[str, str] = {}

    def case(name: str, body: Callable[[], None]) -> None:
        try:
            body()
            results[name] = "ok"
        except Exception as exc:
            results[name] = f"FAIL {type(exc).__name__}: {exc}"
            traceback.print_exc()
        dist.barrier()

    def one_to_mesh() -> None:
        target = zeros_like(sharded(full_state(0), grid, grid_places))
        load(target, storage_reader=reader(backend, work / f"{backend}-one"))
        check(target, full_state(0))

    def writer_per_save() -> None:
        for step in (1, 2):
            state = sharded(full_state(step), grid, lambda t: [Shard(0), Replicate()])
            save(state, storage_writer=writer(backend, work / f"{backend}-four"))

    def mesh_change() -> None:
        target = zeros_like(sharded(full_state(0), line, lambda t: [Shard(t.dim() - 1)]))
        load(target, storage_reader=reader(backend, work / f"{backend}-four"))
        check(target, full_state(2))

    def tensor_free() -> None:
        path = work / f"{backend}-free"
        save({"epoch": 3, "cfg": {"lr": 0.5}}, storage_writer=writer(backend, path))
        target: dict[str, Any] = {"epoch": -1, "cfg": {"lr": 0.0}}
        load(target, storage_reader=reader(backend, path))
        assert target == {"epoch": 3, "cfg": {"lr": 0.5}}, target

    for name, body in (
        ("one-to-mesh", one_to_mesh),
        ("writer-per-save", writer_per_save),
        ("mesh-change", mesh_change),
        ("tensor-free", tensor_free),
    ):
        case(name, body)
    if backend == "tier":
        for name in ("one", "four", "free"):
            TierWriter(work / f"{backend}-{name}").close()
    del rank
    return results


def main() -> None:
    work = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for backend in BACKENDS:
        for name, result in run(backend, work).items():
            print(f"rank {rank} {backend} {name}: {result}", flush=True)
    dist.barrier()
    leave(0)


if __name__ == "__main__":
    main()
