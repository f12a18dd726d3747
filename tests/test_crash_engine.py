"""SIGKILL a trainer at random points, many times; every time, a fresh process must restore
the newest acknowledged step (or a newer one), bit for bit, from a store that verifies.

``tests/crash_harness.py`` does the work (see its docstring). CI runs two seeded zygotes side
by side (one per core), the first with the LMDB tier on the zstd codec, the second on the
delta codec (crashed saves then leave delta blobs no log record describes, whose bases GC
must keep); ``TIERCHECK_SOAK=1`` runs thousands of kill points
(``TIERCHECK_SOAK_ITERATIONS``, default 3000 per zygote). ``TIERCHECK_CRASH_SEED`` replays
a seed; ``TIERCHECK_CRASH_LMDB_CODEC`` (raw, zstd, delta) puts both zygotes on one codec.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).with_name("crash_harness.py")
SOAK = os.environ.get("TIERCHECK_SOAK") == "1"
ITERATIONS = int(os.environ.get("TIERCHECK_SOAK_ITERATIONS", "3000")) if SOAK else 120
SEED = int(os.environ.get("TIERCHECK_CRASH_SEED", "20240607"))
CODECS = [os.environ.get("TIERCHECK_CRASH_LMDB_CODEC", c) for c in ("zstd", "delta")]


def _store_root(tmp_path: Path, name: str) -> Path:
    # tmpfs when there is one: the harness fsyncs a lot, and a crash test is about order,
    # not disks (the tiers' own crash tests cover their files)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        root = shm / f"tiercheck-crash-{os.getpid()}-{tmp_path.name}-{name}"
        return root
    return tmp_path / name


@pytest.mark.timeout(7200 if SOAK else 480)
def test_sigkill_at_random_points_loses_nothing(tmp_path: Path) -> None:
    roots = [_store_root(tmp_path, f"z{i}") for i in range(2)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HARNESS),
                "run",
                "--root",
                str(root),
                "--seed",
                str(SEED + i),
                "--iterations",
                str(ITERATIONS),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "TIERCHECK_CRASH_LMDB_CODEC": CODECS[i]},
        )
        for i, root in enumerate(roots)
    ]
    summaries = []
    try:
        for proc in procs:
            out, _ = proc.communicate()
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            assert lines, f"harness printed no summary (status {proc.returncode}): {out[-2000:]}"
            summaries.append(json.loads(lines[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for root in roots:
            if root.is_relative_to("/dev/shm"):
                subprocess.run(["rm", "-rf", str(root), f"{root}-warm"], check=False)
    for s, codec in zip(summaries, CODECS):
        print(json.dumps({k: v for k, v in s.items() if k != "failures"}))
        assert not s["failures"], json.dumps(s["failures"], indent=1)
        assert s["lmdb_codec"] == codec
        assert s["iterations"] == ITERATIONS
        assert s["acks"] > ITERATIONS  # the trainer made progress across the kills
        assert s["checked"] > ITERATIONS * 3 // 4  # lives not killed during their own restore
    kills = sum(s["kills"] for s in summaries)
    points = set().union(*(s["kills_by_point"] for s in summaries))
    assert kills >= ITERATIONS  # most iterations end in a SIGKILL
    assert {"ack", "put", "append", "delete", "gc", "migrate"} <= points


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HARNESS), *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def test_sigkill_from_the_test_process(tmp_path: Path) -> None:
    """The same check without fork: pytest runs the trainer, kills it, runs the verifier."""
    rng = random.Random(SEED)
    root = tmp_path / "store"
    last_ack = -1
    for _ in range(2):
        proc = subprocess.Popen(
            [sys.executable, str(HARNESS), "trainer", "--root", str(root)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert proc.stdout is not None
        want = rng.randint(1, 6)
        got = 0
        for line in proc.stdout:
            if line.startswith("ACK "):
                last_ack = max(last_ack, int(line.split()[1]))
                got += 1
                if got == want:
                    proc.send_signal(signal.SIGKILL)
                    break
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        res = _run(["verify", "--root", str(root), "--last-ack", str(last_ack)])
        result = json.loads(res.stdout.strip().splitlines()[-1])
        assert res.returncode == 0 and not result["errors"], result
        assert result["step"] >= last_ack
