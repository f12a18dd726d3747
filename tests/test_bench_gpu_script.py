"""``benchmarks/gpu.py`` (saving a GPU-resident state against ``dcp.async_save``) runs its
whole path on the CPU here, so it works the day it is run on a GPU machine; the same run on
CUDA is in ``tests/test_gpu.py``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_gpu_bench(tmp_path: Path, device: str) -> dict[str, object]:
    from tiercheck.backends import DEFAULT_SHM_ROOT

    # the script removes the host's shm root if it made it; other tests use it meanwhile
    os.makedirs(DEFAULT_SHM_ROOT, exist_ok=True)
    out = tmp_path / "gpu.json"
    env = {**os.environ, "TIERCHECK_BENCH_DISK": str(tmp_path / "disk")}
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--device", device]
    cmd += ["--state-mib", "2", "--repeats", "1", "--out", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(out.read_text())
    return result


@pytest.mark.slow
def test_the_gpu_benchmark_runs_its_whole_path_on_the_cpu(tmp_path: Path) -> None:
    result = run_gpu_bench(tmp_path, "cpu")
    metrics = result["metrics"]
    assert isinstance(metrics, dict)
    for name in (
        "copy_to_host_s",
        "tc_blocked_s",
        "tc_staged_s",
        "tc_committed_shm_s",
        "tc_committed_default_s",
        "tc_restore_shm_s",
        "dcp_async_blocked_s",
        "dcp_async_staged_s",
        "dcp_async_committed_disk_s",
        "dcp_load_disk_s",
    ):
        assert metrics[name]["median"] > 0, name
    ratios = result["ratios"]
    assert isinstance(ratios, dict) and len(ratios) == 6
    assert all(math.isfinite(r) and r > 0 for r in ratios.values())
    assert result["device"] == "cpu" and result["state_bytes"] > 0
    assert not (tmp_path / "disk").exists() or not any((tmp_path / "disk").iterdir())


def test_the_gpu_benchmark_says_when_there_is_no_cuda(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--state-mib", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no CUDA device here" in done.stderr


@pytest.mark.slow
def test_the_device_check_script_runs_its_steps_and_prints_one_table(tmp_path: Path) -> None:
    """``scripts/device_check.sh`` as a dry run on the CPU (``DEVICE=cpu QUICK=1``): the
    gpu-marked tests (skipped here), the restore benchmark, one table; nothing installed.
    The other two benchmarks' CPU paths have tests of their own (above, and CI's
    ``benchmarks/run.py --quick``), so this run skips them (``SKIP``), as the table says."""
    from tiercheck.backends import DEFAULT_SHM_ROOT

    os.makedirs(DEFAULT_SHM_ROOT, exist_ok=True)
    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "DEVICE": "cpu",
        "QUICK": "1",
        "SKIP": "gpu_bench trainer_overhead",
    }
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "device_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    lines = done.stdout.splitlines()
    header = max(i for i, line in enumerate(lines) if line.split()[:2] == ["check", "result"])
    rows = {line.split()[0]: line.split()[1] for line in lines[header + 1 :] if line.strip()}
    for check in ("gpu_tests", "restore_bench"):
        assert rows.get(check) == "ok", done.stdout[-3000:] + done.stderr[-2000:]
    assert rows.get("gpu_bench") == rows.get("trainer_overhead") == "skipped", done.stdout
    assert json.loads((tmp_path / "out" / "restore.json").read_text())["ratios"]
