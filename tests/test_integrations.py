"""Lightning and transformers.Trainer resume bit-identically from tiercheck after a SIGKILL.

Each test runs the script in tests/integration_scripts/ twice, in fresh processes: an
uninterrupted run followed by a run that SIGKILLs itself mid-training, then a resume of the
killed run from its last checkpoint; the resumed run's final weights and optimizer state
must equal the uninterrupted run's bit for bit. Tiny models built from code or a
config, CPU, no downloads (HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _snippets import destroy_stores

from tiercheck.integrations import read_pointer

SCRIPTS = Path(__file__).with_name("integration_scripts")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONHASHSEED": "0"}


@pytest.fixture
def work(tmp_path: Path) -> Iterator[Path]:
    try:
        yield tmp_path
    finally:
        destroy_stores(tmp_path)


def _start(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(SCRIPTS / script), *args],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen[str], expect: int = 0) -> str:
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == expect, f"exit {proc.returncode}, expected {expect}:\n{out[-6000:]}"
    return out


def _assert_identical(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"weights differ at {k}"
    assert a["optim"].keys() == b["optim"].keys()
    for pid, st in a["optim"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, b["optim"][pid][k]), f"optimizer state differs at {pid}/{k}"


def _crash_and_resume(
    script: str, work: Path, *flags: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    ref = ["--ref-dir", str(work / "ref"), "--ref-out", str(work / "ref.pt")]
    crash = _start(script, "crash", "--dir", str(work / "job"), *ref, *flags)
    _finish(crash, expect=-signal.SIGKILL)
    resume = _start(
        script, "resume", "--dir", str(work / "job"), "--out", str(work / "resumed.pt"), *flags
    )
    _finish(resume)
    a = torch.load(work / "ref.pt", weights_only=True)
    b = torch.load(work / "resumed.pt", weights_only=True)
    return a, b


@pytest.mark.slow
def test_lightning_async_resume_after_sigkill_is_bit_identical(work: Path) -> None:
    a, b = _crash_and_resume("ptl_run.py", work, "--async-save")
    assert a["first_epoch"] == 0
    # killed in epoch 3: the checkpoint of epoch 2 (async) may not have been committed yet,
    # and then last.ckpt still names an earlier one; never none, never a torn one
    assert 1 <= b["first_epoch"] <= 3, "the resumed run must start after a checkpoint"
    _assert_identical(a, b)
    last = work / "job" / "ckpts" / "last.ckpt"
    assert read_pointer(last) is not None  # a pointer (guarded against torch.load)
    assert last.stat().st_size < 1024  # a pointer, not the state


@pytest.mark.slow
def test_hf_trainer_resume_after_sigkill_is_bit_identical(work: Path) -> None:
    a, b = _crash_and_resume("hf_run.py", work)
    assert a["resumed"] is None
    assert b["resumed"] == 6, "the resumed run must start from checkpoint-6 (mid-epoch)"
    _assert_identical(a, b)
    ckpt = work / "job" / "out" / "checkpoint-6"
    assert (ckpt / "tiercheck.json").is_file()
    assert not (ckpt / "optimizer.pt").exists()  # the optimizer state lives in tiercheck only


def test_pointer_files_round_trip_and_leave_torch_files_alone(tmp_path: Path) -> None:
    from tiercheck.errors import StateError
    from tiercheck.integrations import Pointer, read_pointer, write_pointer

    p = Pointer(str(tmp_path / "store"), version=12, step=480)
    write_pointer(tmp_path / "ckpts" / "last.ckpt", p)
    assert read_pointer(tmp_path / "ckpts" / "last.ckpt") == p
    assert [f.name for f in (tmp_path / "ckpts").iterdir()] == ["last.ckpt"]  # no temp left
    torch.save({"state_dict": {}}, tmp_path / "plain.ckpt")
    assert read_pointer(tmp_path / "plain.ckpt") is None  # Lightning's own file: not ours
    (tmp_path / "bad.ckpt").write_text('{"format": "tiercheck-pointer", "v": 1, "root": 3}')
    with pytest.raises(StateError, match="malformed"):
        read_pointer(tmp_path / "bad.ckpt")
    with pytest.raises(FileNotFoundError):
        read_pointer(tmp_path / "missing.ckpt")


@pytest.mark.slow
def test_lightning_sharded_strategy_resume_after_sigkill_is_bit_identical(work: Path) -> None:
    """ModelParallelStrategy (FSDP2) on 2 CPU ranks saves through DCP, not through a
    checkpoint IO: the TiercheckIO callback alone routes its saves and loads to tiercheck."""
    a, b = _crash_and_resume("ptl_sharded_run.py", work)
    assert a["first_epoch"] == 0
    assert b["first_epoch"] == 2, "the resumed run must start from the checkpoint of epoch 1"
    _assert_identical(a, b)
    last = work / "job" / "ckpts" / "last.ckpt"
    assert last.is_file() and read_pointer(last) is not None
    # the shards live in tiercheck (one store per rank), none in Lightning's DCP files
    assert not list((work / "job").rglob("*.distcp"))
    assert {p.name for p in (work / "job" / "store-sharded").iterdir()} >= {"rank0", "rank1"}
