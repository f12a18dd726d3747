"""SIGKILL a trainer on the default store at engine kill points and at random moments, many
times; every time, a fresh process must restore the newest acknowledged step (or a newer
one), bit for bit, from a store that verifies.

``tests/crash_harness.py`` does the work (see its docstring): ``Checkpointer(root)`` with
the default tiers (shm, LMDB, ``file://``), default policy and memory budgets, nothing
wrapped around a tier. CI runs three seeded zygotes side by side: ``dense`` (AdamW, every
tensor changes every step, a save every step), ``guarded`` (``ckpt.guard(optimizer)``: log
versions) and ``dist`` (two gloo ranks, one killed), at least 60 kills together.
``TIERCHECK_SOAK=1`` runs ``TIERCHECK_SOAK_ROUNDS`` rounds (default 5) of
``TIERCHECK_SOAK_ITERATIONS`` lives per zygote (default 300; over 3,000 kills in all, about
an hour on two cores), each round on new stores: the default store's remote tier keeps every
base (issue 25), so one zygote's store grows by about 1 GB of /dev/shm per 100 lives.
``TIERCHECK_CRASH_SEED`` replays a seed; ``TIERCHECK_CRASH_MODES`` (comma-separated) runs
some modes only.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tiercheck.store.lifecycle import destroy_store

HARNESS = Path(__file__).with_name("crash_harness.py")
SOAK = os.environ.get("TIERCHECK_SOAK") == "1"
SEED = int(os.environ.get("TIERCHECK_CRASH_SEED", "20240607"))
# lives per zygote in CI: about 85% end in a SIGKILL, so >= 60 kills together
CI_ITERATIONS = {"dense": 32, "guarded": 30, "dist": 24, "staged": 24}
MODES = [
    m for m in os.environ.get("TIERCHECK_CRASH_MODES", "dense,guarded,dist,staged").split(",") if m
]
SOAK_ITERATIONS = int(os.environ.get("TIERCHECK_SOAK_ITERATIONS", "300"))
ROUNDS = int(os.environ.get("TIERCHECK_SOAK_ROUNDS", "5")) if SOAK else 1
ITERATIONS = {m: SOAK_ITERATIONS if SOAK else CI_ITERATIONS[m] for m in MODES}
MIN_KILLS = 3000 if SOAK and SOAK_ITERATIONS * ROUNDS >= 1300 else 60


def _store_root(tmp_path: Path, name: str) -> Path:
    # tmpfs when there is one: the harness fsyncs a lot, and a crash test is about order,
    # not disks (the tiers' own crash tests cover their files)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / f"tiercheck-crash-{os.getpid()}-{tmp_path.name}-{name}"
    return tmp_path / name


def _remove_store(root: Path) -> None:
    """The store and the harness's warm-up store, shm segments included (the harness
    destroys both itself; this is for a harness that was killed)."""
    for path in (root, root.with_name(root.name + "-warm")):
        with contextlib.suppress(FileNotFoundError):
            destroy_store(path)
        subprocess.run(["rm", "-rf", str(path)], check=False)


@pytest.mark.slow
@pytest.mark.timeout(4 * 3600 if SOAK else 600)
def test_sigkill_at_random_points_loses_nothing(tmp_path: Path) -> None:
    summaries: list[dict[str, Any]] = []
    for round_ in range(ROUNDS):
        summaries += _round(tmp_path, round_)
    for s in summaries:
        print(json.dumps({k: v for k, v in s.items() if k != "failures"}))
    for s in summaries:
        mode = s["mode"]
        assert not s["failures"], f"{mode}: " + json.dumps(s["failures"], indent=1)[:20000]
        assert s["iterations"] == ITERATIONS[mode]
        assert s["acks"] > ITERATIONS[mode]  # the trainer made progress across the kills
        assert s["checked"] > ITERATIONS[mode] // 2  # lives not killed during their restore
        assert s["exact_restores"] > 0
        assert s["rollbacks"] > 0  # restores in the saving process, each exact
    assert sum(s["kills"] for s in summaries) >= MIN_KILLS
    points = set().union(*(s["kills_by_point"] for s in summaries))
    zygote = {"random", "random_save", "ack"}
    assert zygote <= points
    assert len(points - zygote) >= 5  # kills inside the engine, at several points


def _round(tmp_path: Path, round_: int) -> list[dict[str, Any]]:
    """One zygote per mode side by side, on new stores; their summaries."""
    roots = {mode: _store_root(tmp_path, f"{mode}-{round_}") for mode in MODES}
    procs = {
        mode: subprocess.Popen(
            [
                sys.executable,
                str(HARNESS),
                "run",
                "--root",
                str(root),
                "--mode",
                mode,
                "--seed",
                str(SEED + 10 * round_ + i),
                "--iterations",
                str(ITERATIONS[mode]),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i, (mode, root) in enumerate(roots.items())
    }
    summaries = []
    try:
        for mode, proc in procs.items():
            out, _ = proc.communicate()
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            assert lines, f"{mode}: no summary (status {proc.returncode}): {out[-2000:]}"
            summaries.append(json.loads(lines[-1]))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for root in roots.values():
            _remove_store(root)
    return summaries


@pytest.mark.slow
def test_sigkill_from_the_test_process(tmp_path: Path) -> None:
    """The same check without fork: pytest runs the trainer, kills it after a random number
    of acknowledged saves, and runs the check in another process."""
    root = tmp_path / "store"
    digests: dict[int, str] = {}
    last_ack = -1
    proc = subprocess.Popen(
        [sys.executable, str(HARNESS), "trainer", "--root", str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        want = random.Random(SEED).randint(3, 6)
        for line in proc.stdout:
            if line.startswith("SAVE "):
                _, step, digest = line.split()
                digests[int(step)] = digest
            elif line.startswith("ACK "):
                last_ack = int(line.split()[1])
                if last_ack + 1 == want:
                    proc.send_signal(signal.SIGKILL)
                    break
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        (tmp_path / "digests.json").write_text(json.dumps(digests))
        res = subprocess.run(
            [
                sys.executable,
                str(HARNESS),
                "verify",
                "--root",
                str(root),
                "--last-ack",
                str(last_ack),
                "--digests",
                str(tmp_path / "digests.json"),
            ],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        result = json.loads(res.stdout.strip().splitlines()[-1])
        assert res.returncode == 0 and not result["errors"], result
        assert result["step"] >= last_ack
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with contextlib.suppress(FileNotFoundError):
            destroy_store(root)
