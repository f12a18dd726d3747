"""The demo end to end: train, SIGKILL, restore, and the bit-identity proof."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tiercheck.backends import list_segments
from tiercheck.cli.demo import BASE_EVERY, cadence


@pytest.mark.slow
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
    # the header states the policy, not a cadence the planner does not keep; the cadence
    # printed is counted from the history (5 steps: every version but the first few a log)
    assert f"a base at least every {BASE_EVERY} versions" in out
    m = re.search(r"Cadence: (\d+) of (\d+) versions are bases", out)
    assert m is not None and 1 <= int(m.group(1)) <= int(m.group(2))
    # the demo deletes its store with its shm segment (tiercheck rm), leaving /dev/shm as it was
    assert not root.exists()
    assert [s for s in list_segments() if s.store == str(root.resolve())] == []


def test_the_cadence_is_counted_from_the_roles() -> None:
    roles = (["base"] + ["log"] * 3) * 25  # 25 bases in 100 versions
    assert cadence(roles).startswith("Cadence: 25 of 100 versions are bases, one every 4.0 ")
    assert cadence(["base", "diff"]).startswith("Cadence: 1 of 2 versions are bases")
    assert cadence([]) == "Cadence: no base among 0 versions."
