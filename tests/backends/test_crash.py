"""Crash safety: SIGKILL a real writer process and check what a new process finds.

A child process opens a tier, then loops: store a few blobs (content whose BLAKE3 is
their id), print ``b <i>``, append record ``i`` that names them, print ``a <i>``. The
test reads the child's stdout to know how far it got (no sleeps), kills it with SIGKILL at
a chosen line, reads whatever it had printed before dying, and reopens the tier here:

- every acknowledged record (``a <i>`` printed) is present, whole and in order;
- at most one more record, the one in flight, and only whole;
- every blob named by a record that is present reads back with content matching its id;
- a writer reopening the tier can append after the survivors.

Tiers under test are the rows of ``CRASH_TARGETS``; add a row to cover another tier.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import pytest

from tiercheck.backends.base import Tier
from tiercheck.backends.registry import open_tier


@dataclass(frozen=True)
class CrashTarget:
    """A tier to crash-test: ``make(workdir)`` returns its URL and JSON-able options."""

    name: str
    make: Callable[[Path], tuple[str, dict[str, Any]]]
    read_only: bool = True  # whether to also check a read-only open of the crashed tier


CRASH_TARGETS: list[CrashTarget] = [
    CrashTarget("shm", lambda work: ("shm://crash", {"root": str(work / "shm")})),
    CrashTarget("lmdb", lambda work: (f"lmdb://{work}/lmdb", {})),
    CrashTarget("lmdb-nosync", lambda work: (f"lmdb://{work}/lmdb", {"sync": False})),
    CrashTarget("file", lambda work: (f"file://{work}/fsspec", {})),
]

# (marker, n): kill right after the child prints "<marker> <n>". "a" lands between
# appends, "b" just before an append starts, so the kill often hits an append midway.
KILL_POINTS = [("b", 0), ("a", 1), ("b", 3), ("a", 6), ("b", 9)]

CHILD = r"""
import json, os, random, sys
import blake3
from tiercheck.backends.registry import open_tier

url, options, seed = json.loads(sys.argv[1])
rng = random.Random(seed)
tier = open_tier(url, **options)
sizes = [0, 1, 4095, 65537, 1 << 20, (2 << 20) + 5]
print("ready", flush=True)
for i in range(10_000):  # the parent kills the child long before this ends
    blobs = []
    for _ in range(rng.randint(1, 3)):
        data = os.urandom(rng.choice(sizes))
        blobs.append((blake3.blake3(data).hexdigest(), data))
    pad = os.urandom(rng.choice([0, 10, 5000, 300_000, 1 << 20]))
    head = {"i": i, "ids": [b for b, _ in blobs], "pad": blake3.blake3(pad).hexdigest()}
    record = json.dumps(head).encode() + b"\n" + pad
    if i % 2:
        for bid, data in blobs:
            tier.put(bid, data)
        print("b", i, flush=True)
        tier.append(record)
    else:
        print("b", i, flush=True)
        tier.append(record, blobs=blobs)
    print("a", i, flush=True)
"""


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """Per-test directory, in /dev/shm when it exists (shm tiers live there for real)."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        path = Path("/dev/shm") / f"tiercheck-crash-{uuid.uuid4().hex}"
        path.mkdir()
        yield path
        shutil.rmtree(path, ignore_errors=True)
    else:
        yield tmp_path


def _run_and_kill(
    url: str, options: dict[str, Any], seed: int, marker: str, n: int, errfile: Path
) -> int:
    """Run the child, SIGKILL it after it prints ``marker n``; return acknowledged appends."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(errfile, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, json.dumps([url, options, seed])],
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
        )
    assert proc.stdout is not None
    try:
        target = f"{marker} {n}"
        lines: list[str] = []
        while True:
            line = proc.stdout.readline().decode()
            if not line:
                raise AssertionError(f"child exited early: {errfile.read_text()}")
            lines.append(line.strip())
            if lines[-1] == target:
                break
        os.kill(proc.pid, signal.SIGKILL)
        # Lines the child printed before the signal landed are acknowledgements too.
        # Read them through the same buffered reader: readline may have buffered some.
        # The last piece is a line the kill cut short (print writes "a", " ", "12" and the
        # newline one by one when unbuffered), or empty: an acknowledgement only once whole.
        lines += proc.stdout.read().decode().split("\n")[:-1]
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    acks = [int(line.split()[1]) for line in lines if line.startswith("a ")]
    assert acks == list(range(len(acks)))
    return len(acks)


def _check_tier(tier: Tier, acked: int) -> list[bytes]:
    records = tier.read_log()
    assert acked <= len(records) <= acked + 1, (acked, len(records))
    for i, record in enumerate(records):
        head_line, _, pad = record.partition(b"\n")
        head = json.loads(head_line)
        assert head["i"] == i
        assert blake3.blake3(pad).hexdigest() == head["pad"], f"record {i} is torn"
        for bid in head["ids"]:
            data = bytes(tier.get(bid))
            assert blake3.blake3(data).hexdigest() == bid, f"blob {bid} of record {i}"
    return records


@pytest.mark.parametrize(("marker", "n"), KILL_POINTS, ids=[f"{m}{n}" for m, n in KILL_POINTS])
@pytest.mark.parametrize("target", CRASH_TARGETS, ids=[t.name for t in CRASH_TARGETS])
def test_sigkill_keeps_acknowledged_records(
    target: CrashTarget, marker: str, n: int, workdir: Path, tmp_path: Path
) -> None:
    url, options = target.make(workdir)
    seed = n * 100 + len(target.name)
    acked = _run_and_kill(url, options, seed, marker, n, tmp_path / "child.err")
    assert acked >= (n + 1 if marker == "a" else n)

    if target.read_only:
        with open_tier(url, read_only=True, **options) as ro:
            records = _check_tier(ro, acked)
    with open_tier(url, **options) as tier:
        again = _check_tier(tier, acked)
        if target.read_only:
            assert again == records
        tier.append(b"after the crash")
        assert tier.read_log() == [*again, b"after the crash"]
