"""An orderly interpreter exit with saves in flight (issue 33, item 7): a script that
returns right after its last ``save()``, without closing the store. Before, the saves in
flight failed halfway with ``RuntimeError: cannot schedule new futures after shutdown``
("the save of step 20 failed unexpectedly"); now each is finished (or abandoned with one
line), nothing internal is printed, and a fresh process restores the last step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from tiercheck import Checkpointer

_SCRIPT = r"""
import sys
import torch
import tiercheck

ckpt = tiercheck.Checkpointer(sys.argv[1])
for step in range(1, 21):
    ckpt.save(step, {"w": torch.full((1 << 20,), float(step))})  # never waited for
print("returning with saves in flight", flush=True)
"""


def test_exit_with_saves_in_flight_finishes_them(tmp_path: Path) -> None:
    root = tmp_path / "store"
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(root)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "returning with saves in flight" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "cannot schedule new futures" not in proc.stderr, proc.stderr
    assert "failed" not in proc.stderr, proc.stderr
    assert "at interpreter exit" not in proc.stderr, proc.stderr  # the hook's own error
    ckpt = Checkpointer(root)
    try:
        out = {"w": torch.empty(1 << 20)}
        info = ckpt.restore(out)
        assert info.step == 20 and torch.equal(out["w"], torch.full((1 << 20,), 20.0))
    finally:
        ckpt.destroy()


_READER = r"""
import sys
import torch
import tiercheck

with tiercheck.Checkpointer(sys.argv[1]) as ckpt:
    ckpt.save(1, {"w": torch.ones(8)}).wait()
reader = tiercheck.Checkpointer(sys.argv[1], read_only=True)  # never closed
print("read step", reader.history()[0].step, flush=True)
"""


def test_exit_with_a_reader_left_open_ends(tmp_path: Path) -> None:
    """A read-only store left open at exit is collected while the interpreter finalizes,
    after its threads have ended: dropping it there must not wait for them. (With the
    close of dropped stores, before it skipped finalization, such a script never exited.)"""
    root = tmp_path / "store"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _READER, str(root)], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        assert "read step 1" in proc.stdout and "Traceback" not in proc.stderr, proc.stderr
    finally:
        Checkpointer(root).destroy()
