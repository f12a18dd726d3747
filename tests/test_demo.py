"""The demo end to end: train, SIGKILL, restore, and the bit-identity proof."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tiercheck.backends import list_segments


def test_demo_crash_restore_is_bit_identical(tmp_path: Path) -> None:
    root = tmp_path / "store"
    args = ["--steps", "5", "--crash-at", "3", "--root", str(root)]
    proc = subprocess.run(
        [sys.executable, "-m", "tiercheck.cli.demo", *args],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = " ".join(proc.stdout.split())
    assert "SIGKILL" in out
    assert "PROOF: bit-identical" in out
    assert "from tier shm" in out
    # the demo deletes its store with its shm segment (tiercheck rm), leaving /dev/shm as it was
    assert not root.exists()
    assert [s for s in list_segments() if s.store == str(root.resolve())] == []
