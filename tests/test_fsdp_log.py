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


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("mixed", "bound"), [(False, 0.40), (True, 0.20)], ids=["fp32", "bf16"])
def test_fsdp2_log_versions_resume_bit_identically_after_sigkill(
    tmp_path: Path, mixed: bool, bound: float
) -> None:
    name = f"fsdplog-{uuid.uuid4().hex[:8]}"
    flags = ["--mixed"] if mixed else []

    def run(store: str, tag: str, *args: str) -> Any:
        return torchrun(WORKER, str(tmp_path), store, "--steps", "6", "--out", tag, *args, *flags)

    try:
        ref = run(f"{name}-ref", "ref")
        assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-6000:]
        killed = run(name, "run", "--kill-after", "5")
        assert killed.returncode != 0, "the ranks were to kill themselves"
        assert "SIGKILL" in killed.stderr, killed.stderr[-3000:]
        resumed = run(name, "run")
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
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
    finally:
        destroy_stores(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_log_version_restored_on_another_world_size_replays_where_it_was_logged(
    tmp_path: Path, one_rank: None
) -> None:
    w = load_worker()
    try:
        # 2 -> 1: two ranks save base, log, log; this process restores on one
        two = torchrun(WORKER, str(tmp_path), "two", "--steps", "3", "--files", "--out", "two")
        assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-6000:]
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
            want = torch.load(tmp_path / "two-0.pt")
            assert not _differing(want, run.tensors()), _differing(want, run.tensors())
        # 1 -> 2: this process saves base, log, log; two ranks restore
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
        # (--steps 3: nothing is trained after the restore of step 3)
        one = torchrun(WORKER, str(tmp_path), "one", "--steps", "3", "--files", "--out", "one")
        assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-6000:]
        for rank in (0, 1):
            restore = _report(tmp_path, "one", rank)["restore"]
            assert (restore["role"], restore["step"], restore["replayed"]) == ("log", 3, 2)
            assert restore["fallback"] is None, restore
            got = torch.load(tmp_path / f"one-{rank}.pt")
            assert not _differing(want, got), (rank, _differing(want, got))
    finally:
        destroy_stores(tmp_path)
