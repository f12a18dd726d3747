"""Running the CLI in the test's process (tests/test_cli_mends.py, test_cli_mends2.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiercheck.cli.main import main


def run_cli(capsys: pytest.CaptureFixture[str], *args: str | Path, ok: int = 0) -> tuple[str, str]:
    """Run ``main`` in this process; check its exit status; return stdout and stderr."""
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    assert rc == ok, (args, rc, out.out, out.err)
    return out.out, out.err
