"""A result made once per test run, for several tests that check parts of it.

A module-scoped fixture runs once per pytest-xdist worker that gets one of its tests, and
``--dist worksteal`` gives a module's tests to either worker: a torchrun launch shared by
several tests would then run twice. :func:`once` makes the result once: the first worker
to ask makes it under a lock in the run's temporary directory (the one its workers share)
and writes it there as JSON; a worker that asks later, or while it is being made, waits
for the lock and reads it. A failure to make it is recorded too, and fails every test
that asks for it, with what went wrong, instead of making it again.
"""

from __future__ import annotations

import fcntl
import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def once(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], Any]) -> Any:
    """``make(folder)``'s result (plain JSON data), made once in this test run; ``folder``
    is a new folder of the run's temporary directory, named after ``name``, kept until
    the run's temporary directories go."""
    base = factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        base = base.parent  # the run's directory: every worker's basetemp is in it
    folder = base / f"once-{name}"
    result, failure = folder / "result.json", folder / "failure.txt"
    with open(base / f"once-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if result.is_file():
            return json.loads(result.read_text())
        if failure.is_file():
            pytest.fail(f"{name} failed (in an earlier test):\n{failure.read_text()}")
        folder.mkdir(exist_ok=True)
        try:
            value = make(folder)
        except BaseException:
            failure.write_text(traceback.format_exc())
            raise
        result.write_text(json.dumps(value))
        return value
