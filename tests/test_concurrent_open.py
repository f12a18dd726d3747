"""Two stores opened at the same moment on one tier (issue 33 item 3): the owner claim is
atomic, so exactly one store owns the tier and the other gets ``ForeignTier``; neither
ever sees the other's versions.

Two real processes (spawned, each a long-lived worker) open a store each, at different
roots, on one shared tier: an shm segment in /dev/shm, an LMDB environment, a file://
remote. A ``multiprocessing.Barrier`` releases both opens of a round together."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tiercheck import TierSpec

ROUNDS = int(os.environ.get("TIERCHECK_RACE_ROUNDS", "100"))  # per tier kind: 300 races


def _worker(me: int, inbox: Any, barrier: Any, out: Any) -> None:
    """For each batch of rounds from ``inbox`` (None: stop), open the store ``root`` of
    round i on its shared tier as soon as the other worker is ready too; a store that wins
    lists its history, saves one version and restores it."""
    from tiercheck.errors import ForeignTier

    while (rounds := inbox.get()) is not None:
        for i, (root, tiers) in enumerate(rounds):
            barrier.wait(timeout=120)
            try:
                out.put((i, me, *_open_and_use(me, i, root, tiers)))
            except ForeignTier as exc:
                out.put((i, me, "foreign", str(exc)))
            except Exception as exc:  # reported, so the test shows what else went wrong
                out.put((i, me, "error", f"{type(exc).__name__}: {exc}"))


def _open_and_use(me: int, i: int, root: str, tiers: list[TierSpec]) -> tuple[str, str]:
    import torch

    from tiercheck import Checkpointer

    with Checkpointer(root, tiers=tiers) as ckpt:
        seen = [v.step for v in ckpt.history()]
        ckpt.save(1000 * me + i, {"who": torch.tensor([me, i])}).wait()
        state = {"who": torch.tensor([-1, -1])}
        ckpt.restore(state)
        return "won", f"history before save {seen}, restored {state['who'].tolist()}"


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[list[Any], Any, list[Any]]]:
    """Two worker processes (started once for the module), their inboxes and the queue
    of their results."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    out = ctx.Queue()
    inboxes = [ctx.Queue(), ctx.Queue()]
    procs = [
        ctx.Process(target=_worker, args=(me, inboxes[me], barrier, out), daemon=True)
        for me in (0, 1)
    ]
    for p in procs:
        p.start()
    try:
        yield inboxes, out, procs
    finally:
        for inbox in inboxes:
            inbox.put(None)
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()


@pytest.fixture
def places(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A directory for roots and tiers, and an shm root in /dev/shm; both removed after."""
    shm = Path(tempfile.mkdtemp(prefix="tiercheck-race-", dir="/dev/shm"))
    try:
        yield tmp_path, shm
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def _shared_tier(kind: str, where: Path, shm: Path, i: int) -> TierSpec:
    if kind == "shm":
        return TierSpec("shm", f"shm://race{i}", {"root": str(shm)})
    if kind == "lmdb":
        return TierSpec("lmdb", f"lmdb://{where / 'tiers' / f'lmdb{i}'}")
    return TierSpec("remote", f"file://{where / 'tiers' / f'remote{i}'}")


def _next_result(out: Any, procs: list[Any]) -> tuple[int, int, str, str]:
    """The next result of a worker; fails when a worker died or hangs (a guard, not a
    measurement: a round takes well under a second)."""
    for _ in range(48):
        try:
            return out.get(timeout=5)  # type: ignore[no-any-return]
        except queue.Empty:
            dead = [p.exitcode for p in procs if not p.is_alive()]
            assert not dead, f"a worker process died, exit codes {dead}"
    raise AssertionError("no worker reported for 4 minutes: one hangs in an open or a save")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["shm", "lmdb", "file"])
def test_two_stores_opened_at_once_on_one_tier_one_wins(
    kind: str, places: tuple[Path, Path], workers: tuple[list[Any], Any, list[Any]]
) -> None:
    where, shm = places
    inboxes, out, procs = workers
    for me in (0, 1):
        rounds = [
            (str(where / f"store{me}-{i}"), [_shared_tier(kind, where, shm, i)])
            for i in range(ROUNDS)
        ]
        inboxes[me].put(rounds)
    results: dict[int, dict[int, tuple[str, str]]] = {}
    for _ in range(2 * ROUNDS):
        i, me, outcome, detail = _next_result(out, procs)
        results.setdefault(i, {})[me] = (outcome, detail)
    both = [i for i, r in results.items() if [o for o, _ in r.values()].count("won") == 2]
    bad = {
        i: r for i, r in results.items() if sorted(o for o, _ in r.values()) != ["foreign", "won"]
    }
    first = list(bad.items())[:3]
    assert not bad, f"{len(both)} of {ROUNDS} rounds served both stores; first: {first}"
    for i, r in results.items():
        (winner,) = [me for me, (o, _) in r.items() if o == "won"]
        # the winner's store is new: it sees no version, and restores its own
        assert r[winner][1] == f"history before save [], restored {[winner, i]}", r
        assert "owned by another store" in r[1 - winner][1]
