"""tiercheck under ``torch.distributed.checkpoint`` as DCP's own tests use it (issue 34).

Every case runs twice: on tiercheck (``TierWriter`` / ``TierReader``) and on DCP's own
storage (``FileSystemWriter`` / ``FileSystemReader``), through the same storage protocol,
so that a difference between the two shows as one parameter failing. The cases are written
here (not copied from PyTorch), after what DCP's tests exercise: shards without a tensor, a
new writer per save, resharding across world sizes and meshes (DTensor, 4 ranks on gloo in
one torchrun launch), ``async_save`` with the thread and the process executors, the
DCP <-> ``torch.save`` conversions, and planner options.
"""

from __future__ import annotations

import re
import sys
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import torchrun
from _once import once
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict, load
from torch.distributed.checkpoint.state_dict_saver import async_save, save

from tiercheck.integrations.dcp import TierReader, TierWriter

SCRIPTS = Path(__file__).resolve().parent / "dist_scripts"
sys.path.insert(0, str(SCRIPTS))
from dcp_conformance_worker import BACKENDS, full_state  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def tiers(root: Path) -> list[tuple[str, str]]:
    return [("lmdb", f"lmdb://{root}/lmdb")]


def writer(backend: str, path: Path) -> Any:
    return TierWriter(path, tiers=tiers(path)) if backend == "tier" else FileSystemWriter(path)


def reader(backend: str, path: Path, **kwargs: Any) -> Any:
    return TierReader(path, **kwargs) if backend == "tier" else FileSystemReader(path)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    yield str(request.param)
    TierWriter(tmp_path).close()  # this process's tiercheck stores under the test's directory


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def model_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(16, 8, generator=g), "b": torch.randn(16, generator=g)},
        "epoch": seed,
    }


def blank() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(16, 8), "b": torch.zeros(16)}, "epoch": -1}


# --- one process ----------------------------------------------------------------------


@pytest.mark.parametrize("state", [{"epoch": 5}, {}], ids=["int", "empty"])
def test_state_without_tensors(backend: str, tmp_path: Path, state: dict[str, Any]) -> None:
    save(state, storage_writer=writer(backend, tmp_path / "ckpt"))
    target = {k: -1 for k in state}
    load(target, storage_reader=reader(backend, tmp_path / "ckpt"))
    assert target == state


def test_a_writer_per_save_loads_the_newest(backend: str, tmp_path: Path) -> None:
    for seed in (1, 2, 3):
        save(model_state(seed), storage_writer=writer(backend, tmp_path / "ckpt"))
    target = blank()
    load(target, storage_reader=reader(backend, tmp_path / "ckpt"))
    assert same(target, model_state(3))


def test_async_save_thread_executor(backend: str, tmp_path: Path) -> None:
    future = async_save(model_state(4), storage_writer=writer(backend, tmp_path / "ckpt"))
    assert isinstance(future, Future)
    future.result()
    target = blank()
    load(target, storage_reader=reader(backend, tmp_path / "ckpt"))
    assert same(target, model_state(4))


@pytest.mark.slow
def test_async_save_process_executor(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed as dist
    from _dist import free_port
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # the checkpoint daemon's rendezvous
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for seed in (5, 6):  # a writer per save, the second one after the daemon started
                future = async_save(
                    model_state(seed),
                    storage_writer=writer(backend, tmp_path / "ckpt"),
                    async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                )
                future.result(timeout=120)
        target = blank()
        load(target, storage_reader=reader(backend, tmp_path / "ckpt"))
        assert same(target, model_state(6))
    finally:
        dist.destroy_process_group()


def test_torch_save_to_dcp_and_back(backend: str, tmp_path: Path) -> None:
    """``format_utils.torch_save_to_dcp`` and ``dcp_to_torch_save``, whose steps are these
    (the functions themselves name DCP's file system storage)."""
    from torch.distributed.checkpoint import format_utils

    original = tmp_path / "model.pt"
    torch.save(model_state(7), original)
    dcp_dir, back = tmp_path / "dcp", tmp_path / "back.pt"
    if backend == "fs":
        format_utils.torch_save_to_dcp(original, dcp_dir)
        format_utils.dcp_to_torch_save(dcp_dir, back)
    else:
        state = torch.load(original, weights_only=False)
        save(state, storage_writer=writer(backend, dcp_dir), no_dist=True)
        full: dict[str, Any] = {}
        _load_state_dict(
            full,
            storage_reader=reader(backend, dcp_dir),
            planner=_EmptyStateDictLoadPlanner(),  # type: ignore[no-untyped-call]
            no_dist=True,
        )
        torch.save(full, back)
    assert same(torch.load(back, weights_only=True), model_state(7))


def test_planner_with_plan_caching_across_saves(backend: str, tmp_path: Path) -> None:
    from torch.distributed.checkpoint.planner import SavePlanner

    # DCP caches plans per planner class, process-wide: a class of this test's own
    planner = type(f"CachingPlanner_{backend}", (DefaultSavePlanner,), {})(enable_plan_caching=True)
    try:
        for seed in (8, 9):  # the second save reuses the cached plans
            w = writer(backend, tmp_path / "ckpt")
            save(model_state(seed), storage_writer=w, planner=planner)
    finally:
        for name in dir(SavePlanner):
            if name.startswith("_cached_"):
                getattr(SavePlanner, name).pop(type(planner).__name__, None)
    target = blank()
    load(target, storage_reader=reader(backend, tmp_path / "ckpt"))
    assert same(target, model_state(9))


def test_load_planner_allows_a_partial_load(backend: str, tmp_path: Path) -> None:
    save(model_state(10), storage_writer=writer(backend, tmp_path / "ckpt"))
    target = blank() | {"extra": torch.zeros(3)}
    load(
        target,
        storage_reader=reader(backend, tmp_path / "ckpt"),
        planner=DefaultLoadPlanner(allow_partial_load=True),
    )
    assert same({k: v for k, v in target.items() if k != "extra"}, model_state(10))
    assert torch.equal(target["extra"], torch.zeros(3))


# --- four ranks -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """One torchrun launch of 4 ranks running every multi-rank case on both backends (one
    in the whole run, whichever worker's test asks first)."""
    work, out = once(tmp_path_factory, "dcp-conformance", launch_four_ranks)
    yield Path(work), out
    TierWriter(Path(work)).close()  # this process's tiercheck stores there


def launch_four_ranks(work: Path) -> tuple[str, str]:
    for b in BACKENDS:  # saved by one process, loaded by four
        save(full_state(0), storage_writer=writer(b, work / f"{b}-one"), no_dist=True)
    TierWriter(work / "tier-one").close()
    proc = torchrun(
        SCRIPTS / "dcp_conformance_worker.py", str(work), nproc=4, env={"GLOO_SOCKET_IFNAME": "lo"}
    )
    return str(work), proc.stdout + "\n--- stderr ---\n" + proc.stderr[-6000:]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["one-to-mesh", "writer-per-save", "mesh-change", "tensor-free"])
@pytest.mark.parametrize("which", BACKENDS)
def test_four_ranks(four_ranks: tuple[Path, str], which: str, case: str) -> None:
    _, out = four_ranks
    # four processes share one stdout: a line may run into another's, so read by pattern
    head = out.split("\n--- stderr ---\n")[0]
    lines = re.findall(rf"rank \d {which} {case}: (?:ok|.*?(?=rank \d |$))", head, re.M)
    assert len(lines) == 4, out[-6000:]
    bad = [ln for ln in lines if not ln.endswith(": ok")]
    assert not bad, "\n".join(bad) + "\n" + out[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("which", BACKENDS)
def test_four_ranks_save_loads_on_one(four_ranks: tuple[Path, str], which: str) -> None:
    work, _ = four_ranks
    want = full_state(2)
    target: dict[str, Any] = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in want.items()
    }
    load(target, storage_reader=reader(which, work / f"{which}-four"))
    assert same(target, want)
