"""FSDP2 training guarded by the store: each rank logs its local shards' gradients, saves
are log versions, and a run whose ranks are SIGKILLed resumes bit-identically.

Real torchrun processes (2 ranks, CPU, gloo), a real shm tier per rank, and the worker
tests/dist_scripts/fsdp_log_worker.py. For fp32 AdamW and for FSDP2 mixed precision
(bf16 parameters in compute, bf16 gradient reduction, fp32 optimizer state):

- an uninterrupted run of 6 steps, a save after each: some saves are log versions, each
  storing at most 0.40x (fp32) or 0.20x (mixed precision) of what a base stores;
- a run of the same store killed (both ranks, SIGKILL) right after the save of step 5,
  then resumed: the restore replays the log on each rank's shards, what it restored is bit
  for bit what was saved, and the resumed run ends bit for bit where the uninterrupted
  one did.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import torchrun
from _snippets import destroy_stores

WORKER = Path(__file__).parent / "dist_scripts" / "fsdp_log_worker.py"


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
