"""CUDA: staging from the GPU, restore into device tensors (ordered after the caller's
queued work, exact for a model and its optimizer, all or nothing), the CUDA generators, the
GPU benchmark, and a 2-process NCCL job. Marked ``gpu`` and skipped without CUDA (``-m gpu``
selects them on a GPU host).

The staging tests race a save against GPU work still queued: a long kernel
(``torch.cuda._sleep``) followed by a write of the tensor being saved. A staging copy that
did not wait for the trainer's stream would read the tensor before the write lands.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import torchrun

import tiercheck
from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.errors import StateError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)

SPIN = 200_000_000  # GPU cycles of torch.cuda._sleep: ~0.1 s, far longer than the save call


@pytest.fixture
def shm_root() -> Iterator[str]:
    root = f"/dev/shm/tiercheck-gputest-{uuid.uuid4().hex[:10]}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


def store(tmp_path: Path, shm_root: str) -> Checkpointer:
    tiers = [TierSpec("shm", "shm://gpu", {"root": shm_root}), f"lmdb://{tmp_path / 'lmdb'}"]
    policy = Policy(base_every=1, gc_grace_seconds=0, tiers={"lmdb": TierPolicy(versions="all")})
    return Checkpointer(tmp_path / "store", tiers=tiers, policy=policy)


def test_staging_waits_for_work_queued_on_the_default_stream(tmp_path: Path, shm_root: str) -> None:
    x = torch.zeros(1 << 20, device="cuda")
    with store(tmp_path, shm_root) as ckpt:
        ckpt.prepare({"x": x})
        torch.cuda._sleep(SPIN)
        x.fill_(7.0)  # lands only after the spin
        ckpt.save(0, {"x": x}).wait()
        back = {"x": torch.zeros(1 << 20)}
        ckpt.restore(back, tiers=["lmdb"])
    assert torch.equal(back["x"], torch.full((1 << 20,), 7.0))


def test_staging_waits_for_work_queued_on_the_callers_own_stream(
    tmp_path: Path, shm_root: str
) -> None:
    x = torch.zeros(1 << 20, device="cuda")
    side = torch.cuda.Stream()
    with store(tmp_path, shm_root) as ckpt:
        with torch.cuda.stream(side):
            torch.cuda._sleep(SPIN)
            x.fill_(3.0)
            handle = ckpt.save(0, {"x": x})  # the copies must wait for `side`, not stream 0
        handle.wait()
        back = {"x": torch.zeros(1 << 20)}
        ckpt.restore(back)
    assert torch.equal(back["x"], torch.full((1 << 20,), 3.0))


def test_mixed_cpu_and_gpu_state_restores_to_its_devices(tmp_path: Path, shm_root: str) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    state: dict[str, Any] = {
        "w": torch.randn(300_000, device="cuda", generator=g),
        "h": torch.randn(64, 64, device="cuda", generator=g).half(),
        "cpu": torch.arange(1000, dtype=torch.int64),
        "step": 5,
    }
    with store(tmp_path, shm_root) as ckpt:
        ckpt.save(5, state).wait()
        back: dict[str, Any] = {
            "w": torch.zeros_like(state["w"]),
            "h": torch.zeros_like(state["h"]),
            "cpu": torch.zeros(1000, dtype=torch.int64),
            "step": 0,
        }
        ckpt.restore(back)
    assert back["w"].is_cuda and back["h"].is_cuda and not back["cpu"].is_cuda
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["h"], state["h"])
    assert torch.equal(back["cpu"], state["cpu"]) and back["step"] == 5


def test_restore_into_device_tensors_writes_after_the_work_queued_on_them(
    tmp_path: Path, shm_root: str
) -> None:
    """The restore's host-to-device copies (a side stream) wait for the work already queued
    on the caller's stream: a write queued behind a long kernel lands before the restored
    bytes, not over them. The tensors keep their storage (restored in place)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    saved = {
        "w": torch.randn(1 << 22, device="cuda", generator=g),
        "h": torch.randn(300, 7, device="cuda", generator=g).half(),
    }
    with store(tmp_path, shm_root) as ckpt:
        ckpt.save(1, saved).wait()
        live = {k: torch.zeros_like(v) for k, v in saved.items()}
        where = {k: v.data_ptr() for k, v in live.items()}
        torch.cuda._sleep(SPIN)
        live["w"].fill_(9.0)  # queued behind the spin: lands after restore() was called
        ckpt.restore(live, tiers=["shm"])
    assert {k: v.data_ptr() for k, v in live.items()} == where
    assert torch.equal(live["w"], saved["w"]) and torch.equal(live["h"], saved["h"])


def test_a_model_and_optimizer_on_the_gpu_restore_exactly(tmp_path: Path, shm_root: str) -> None:
    torch.manual_seed(0)

    def run(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            model(torch.randn(4, 64, device="cuda")).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    model, opt = run(0)
    with store(tmp_path, shm_root) as ckpt:
        ckpt.save(2, {"model": model, "opt": opt}).wait()
        model2, opt2 = run(1)
        ckpt.restore({"model": model2, "opt": opt2}, tiers=["shm"])
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert b.is_cuda and torch.equal(a, b)
    for a, b in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_failed_restore_into_device_tensors_leaves_them_as_they_were(
    tmp_path: Path, shm_root: str
) -> None:
    """A module whose last layer does not fit raises in ``load_state_dict`` after loading
    the layers that fit: its device tensors (it loads by reference: written last) and the
    plain device tensor beside it (written last too) were never written."""
    torch.manual_seed(0)
    saved = {
        "model": torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 8)).cuda(),
        "w": torch.randn(1 << 20, device="cuda"),
    }
    with store(tmp_path, shm_root) as ckpt:
        ckpt.save(1, saved).wait()
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)).cuda()
        target = {"model": model, "w": torch.zeros(1 << 20, device="cuda")}
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(StateError, match="size mismatch"):
            ckpt.restore(target, tiers=["shm"])
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not target["w"].any()


def test_cuda_generators_round_trip_through_a_checkpoint(tmp_path: Path, shm_root: str) -> None:
    torch.manual_seed(11)
    torch.cuda.manual_seed_all(11)
    torch.randn(10, device="cuda")  # advance the generator past its seed
    with store(tmp_path, shm_root) as ckpt:
        ckpt.save(0, {"rng": tiercheck.rng_state()}).wait()
        expected = torch.randn(1000, device="cuda")
        torch.cuda.manual_seed_all(999)  # something else ran in between
        back: dict[str, Any] = {"rng": tiercheck.rng_state()}
        ckpt.restore(back)
    tiercheck.set_rng_state(back["rng"])
    assert torch.equal(torch.randn(1000, device="cuda"), expected)


_ONE_GPU_OF_TWO = textwrap.dedent(
    """
    import json, sys, torch, tiercheck
    from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
    root, shm_root, set_device = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    if set_device:
        torch.cuda.set_device(1)
    x = torch.zeros(1 << 20, device="cuda:1")
    tiers = [TierSpec("shm", "shm://gpu1", {"root": shm_root}), f"lmdb://{root}/lmdb"]
    policy = Policy(base_every=1, gc_grace_seconds=0, tiers={"lmdb": TierPolicy(versions="all")})
    with Checkpointer(root + "/store", tiers=tiers, policy=policy) as ckpt:
        ckpt.prepare({"x": x})
        with torch.cuda.device(1):  # the spin kernel runs on the current device
            torch.cuda._sleep(200_000_000)
            x.fill_(5.0)
            handle = ckpt.save(0, {"x": x})
        handle.wait()
        back = {"x": torch.zeros(1 << 20, device="cuda:1")}
        ckpt.restore(back)
    print(json.dumps({
        "exact": bool(torch.equal(back["x"], torch.full((1 << 20,), 5.0, device="cuda:1"))),
        "context_on_0": bool(torch._C._cuda_hasPrimaryContext(0)),
    }))
    """
)


@two_gpus
@pytest.mark.parametrize("set_device", [True, False])
def test_a_process_on_the_second_gpu_creates_no_context_on_the_first(
    tmp_path: Path, shm_root: str, set_device: bool
) -> None:
    if not hasattr(torch._C, "_cuda_hasPrimaryContext"):
        pytest.skip("this torch build cannot tell whether a primary context exists")
    proc = subprocess.run(
        [sys.executable, "-c", _ONE_GPU_OF_TWO, str(tmp_path), shm_root, str(int(set_device))],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"exact": True, "context_on_0": False}


@two_gpus
def test_two_nccl_ranks_save_and_restore_on_their_own_gpus(tmp_path: Path, shm_root: str) -> None:
    worker = Path(__file__).parent / "dist_scripts" / "gpu_worker.py"
    out = tmp_path / "out"
    out.mkdir()
    proc = torchrun(
        worker, "--root", str(tmp_path), "--shm-root", shm_root, "--out", str(out), timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["step"] == 3 and r["exact"] and r["on_device"], r
        assert r["allreduce_after"] == 2.0, r
        if r["context_on_other_gpu_before"] is False:
            assert r["context_on_other_gpu"] is False, r


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_the_gpu_benchmark_runs_on_cuda(tmp_path: Path, device: str) -> None:
    """``benchmarks/gpu.py`` on the GPU (its numbers go to docs/benchmarks.md), named with
    and without an index (``cuda`` is the current device), to its comparison with DCP's
    ``async_save`` (a stager per save on torch before 2.13)."""
    from test_bench_gpu_script import run_gpu_bench

    result = run_gpu_bench(tmp_path, device)
    expected = f"cuda:{torch.cuda.current_device()}" if device == "cuda" else device
    assert result["device"] == expected
    metrics = result["metrics"]
    assert isinstance(metrics, dict)
    assert metrics["tc_staged_s"]["median"] > 0 and metrics["dcp_async_staged_s"]["median"] > 0
    assert metrics["tc_restore_shm_s"]["median"] > 0 and metrics["dcp_load_disk_s"]["median"] > 0
