"""FSDP2 training guarded by the store: each rank logs its local shards' gradients, saves
are log versions, and a run whose ranks are SIGKILLed resumes bit-identically.

Real torchrun processes (2 ranks, CPU, gloo), a real shm tier per rank, and the worker
tests/dist_scripts/fsdp_log_worker.py. For fp32 AdamW and for mixed precision (bf16
parameters sharded by FSDP2, fp32 master weights and AdamW state):

- an uninterrupted run of 6 steps, a save after each: some saves are log versions, each
  storing at most 0.40x (fp32) or 0.20x (mixed precision) of what a base stores;
- a run of the same store killed (both ranks, SIGKILL) right after the save of step 5,
  then resumed: the restore replays the log on each rank's shards, what it restored is bit
  for bit what was saved, and the resumed run ends bit for bit where the uninterrupted
  one did.

A log version restored onto another number of ranks (2 -> 1, 1 -> 2) is replayed on the
layout that logged it (each saving rank's steps over its base's pieces, verified against
its fingerprints) and then resharded: bit for bit the state saved (the one-process side
runs here, in a one-rank gloo group).

Launches are shared where no rank dies: both precisions' uninterrupted runs and
resumptions run one after another in one launch, and so do the 2 -> 1 save and the
1 -> 2 restore; the ranks' imports are paid once for each.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import free_port, torchrun
from _once import once
from _snippets import destroy_stores

from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec

WORKER = Path(__file__).parent / "dist_scripts" / "fsdp_log_worker.py"


def load_worker() -> ModuleType:
    # the worker imports its neighbour _leave, as torchrun runs it (its folder on the path)
    if str(WORKER.parent) not in sys.path:
        sys.path.insert(0, str(WORKER.parent))
    spec = importlib.util.spec_from_file_location("fsdp_log_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A one-rank gloo group in this process."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _report(root: Path, tag: str, rank: int) -> dict[str, Any]:
    out: dict[str, Any] = json.loads((root / f"{tag}-{rank}.json").read_text())
    return out


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [
        k
        for k in a
        if a[k].dtype != b[k].dtype
        or a[k].shape != b[k].shape
        or not torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8))
    ]


PRECISIONS = {"fp32": [], "bf16": ["--mixed"]}


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return once(tmp_path_factory, "fsdp-log", kill_and_resume)


def kill_and_resume(folder: Path) -> dict[str, Any]:
    """For each precision, in ``folder/PRECISION``: a run of the store ``NAME-PRECISION``
    killed after the save of step 5 (a launch of its own: its ranks die); then one launch
    runs every precision's uninterrupted reference run (store ``NAME-PRECISION-ref``) and
    every killed run's resumption. Returns each launch's exit status, the killed runs'
    stderr, and ``folder``."""
    name = f"fsdplog-{uuid.uuid4().hex[:8]}"
    out: dict[str, Any] = {}
    try:
        for precision, flags in PRECISIONS.items():
            (folder / precision).mkdir()
            store = f"{name}-{precision}"  # its shm segments: one name per store
            run = [str(folder / precision), store, "--steps", "6", "--out", "run", *flags]
            killed = torchrun(WORKER, *run, "--kill-after", "5")
            out[precision] = {"killed": killed.returncode, "killed stderr": killed.stderr}
        args = []
        for tag, suffix in (("ref", "-ref"), ("run", "")):
            for precision, flags in PRECISIONS.items():
                store = f"{name}-{precision}{suffix}"
                run = [str(folder / precision), store, "--steps", "6", "--out", tag, *flags]
                args += ["then", *run]
        rest = torchrun(WORKER, *args[1:])
        out["rest"] = {"code": rest.returncode, "output": rest.stdout[-3000:] + rest.stderr[-6000:]}
        out["folder"] = str(folder)
        return out
    finally:
        destroy_stores(folder)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("precision", "bound"), [("fp32", 0.40), ("bf16", 0.20)], ids=["fp32", "bf16"]
)
def test_fsdp2_log_versions_resume_bit_identically_after_sigkill(
    killed_and_resumed: dict[str, Any], precision: str, bound: float
) -> None:
    tmp_path = Path(killed_and_resumed["folder"]) / precision
    killed = killed_and_resumed[precision]
    rest = killed_and_resumed["rest"]
    assert rest["code"] == 0, rest["output"]  # the reference runs and the resumptions
    assert killed["killed"] != 0, "the ranks were to kill themselves"
    assert "SIGKILL" in killed["killed stderr"], killed["killed stderr"][-3000:]
    for rank in (0, 1):
        saves = _report(tmp_path, "ref", rank)["saves"]
        roles = [s["role"] for s in saves]
        assert roles[0] == "base" and roles.count("log") >= 3, roles
        full = max(s["shm"] for s in saves if s["role"] == "base")
        for s in saves:
            if s["role"] == "log":
                assert s["shm"] <= bound * full, (rank, s, full)
        restore = _report(tmp_path, "run", rank)["restore"]
        assert restore["step"] == 5 and restore["role"] == "log", restore
        assert restore["replayed"] >= 1 and restore["fallback"] is None, restore
        saved = torch.load(tmp_path / f"run-saved-{rank}.pt")
        restored = torch.load(tmp_path / f"run-restored-{rank}.pt")
        assert not _differing(saved, restored), (rank, _differing(saved, restored))
        want = torch.load(tmp_path / f"ref-{rank}.pt")
        got = torch.load(tmp_path / f"run-{rank}.pt")
        assert not _differing(want, got), (rank, _differing(want, got))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_log_version_restored_on_another_world_size_replays_where_it_was_logged(
    tmp_path: Path, one_rank: None
) -> None:
    w = load_worker()
    try:
        # 1 -> 2: this process saves base, log, log (the two ranks restore it below)
        tier = TierSpec("files", f"file://{tmp_path}/one-files", {"shared": True})
        policy = Policy(tiers={"files": TierPolicy(versions="all", keep_bases=2)})
        with Checkpointer(tmp_path / "one", tiers=[tier], policy=policy) as ckpt:
            run = w.Run(False)
            ckpt.guard(run.opt)
            roles = []
            for step in (1, 2, 3):
                run.step()
                handle = ckpt.save(step, run.state())
                handle.wait()
                roles.append(handle.role)
            assert roles == ["base", "log", "log"]
            want = run.tensors()
        # one launch: two ranks save base, log, log (2 -> 1, restored by this process
        # below); then they restore the store this process saved (--steps 3: nothing is
        # trained after the restore of step 3)
        both = torchrun(
            WORKER,
            *(str(tmp_path), "two", "--steps", "3", "--files", "--out", "two"),
            *("then", str(tmp_path), "one", "--steps", "3", "--files", "--out", "one"),
        )
        assert both.returncode == 0, both.stdout[-3000:] + both.stderr[-6000:]
        saves = _report(tmp_path, "two", 0)["saves"]
        assert [s["role"] for s in saves] == ["base", "log", "log"]
        with Checkpointer(tmp_path / "two") as ckpt:
            run = w.Run(False)
            ckpt.guard(run.opt)
            state = run.state()
            info = ckpt.restore(state)
            run.loader = state["loader"]
            assert (info.role, info.step, info.replayed_steps) == ("log", 3, 2), info.fallback
            assert info.fallback is None
            two = torch.load(tmp_path / "two-0.pt")
            assert not _differing(two, run.tensors()), _differing(two, run.tensors())
        for rank in (0, 1):
            restore = _report(tmp_path, "one", rank)["restore"]
            assert (restore["role"], restore["step"], restore["replayed"]) == ("log", 3, 2)
            assert restore["fallback"] is None, restore
            got = torch.load(tmp_path / f"one-{rank}.pt")
            assert not _differing(want, got), (rank, _differing(want, got))
    finally:
        destroy_stores(tmp_path)
