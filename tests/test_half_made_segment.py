"""An open killed after it made a segment's ``blobs/`` directory and before its log leaves
a half-made segment in the shm root: it holds no memory, but nothing listed it, so nothing
could remove it. It is listed now (unowned) and ``tiercheck rm shm://NAME`` deletes it."""

from __future__ import annotations

import json
import os
import shutil
import uuid

import pytest
from _clirun import run_cli

from tiercheck.backends import DEFAULT_SHM_ROOT, list_segments


def test_a_half_made_segment_is_listed_and_rm_deletes_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    name = f"half-made-{uuid.uuid4().hex[:8]}"
    path = os.path.join(DEFAULT_SHM_ROOT, name)
    os.makedirs(DEFAULT_SHM_ROOT, mode=0o700, exist_ok=True)
    os.mkdir(path, 0o700)
    try:
        for d in ("blobs", "pool", "tmp"):  # what the open makes before owner.json and log
            os.mkdir(os.path.join(path, d), 0o700)
        found = [s for s in list_segments(DEFAULT_SHM_ROOT) if s.name == name]
        assert len(found) == 1 and not found[0].owned and found[0].store is None
        out, _ = run_cli(capsys, "rm", f"shm://{name}", "--json")
        assert json.loads(out)["segments"] == [path]
        assert not os.path.exists(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)
