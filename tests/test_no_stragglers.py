"""A failed parallel step leaves no call of it running (``tiercheck.runtime.parallel``).

When one chunk of a save's placement or of a restore's fetch fails, the other chunks of
that step must not go on after the step has failed: a save's chunks would land after the
failure deleted what the save wrote (seen as 1 MiB left on a full disk), and would read a
staged buffer the next save reuses; a restore's would write an older attempt's chunks into
the buffer the next attempt fills. Each test fails one call at once, slows the ones after
it, and checks that no call starts or runs once the step has reported its failure.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.errors import NoRestorableVersion, NotFound, TierFull
from tiercheck.runtime.parallel import map_all
from tiercheck.testing.faults import FaultEvent, FaultPlan, Op, inject

CHUNK = 4096
CHUNKS = 48


class Calls:
    """Counts the calls of one operation: started, and running now."""

    def __init__(self, fail: type[Exception], fail_at: int = 1, slow: float = 0.05) -> None:
        self.fail, self.fail_at, self.slow = fail, fail_at, slow
        self.lock = threading.Lock()
        self.started = 0
        self.running = 0

    def before(self, event: FaultEvent) -> None:
        with self.lock:
            self.started += 1
            failing = self.started == self.fail_at
            if not failing:
                self.running += 1
        if failing:
            raise self.fail("this call fails at once")
        if self.started > self.fail_at:
            time.sleep(self.slow)

    def after(self, event: FaultEvent) -> None:
        with self.lock:
            self.running -= 1

    def watch(self, plan: FaultPlan, op: Op) -> None:
        plan.hook(self.before, [op])
        plan.hook(self.after, [op], after=True)

    def settled(self, ckpt: Checkpointer) -> tuple[int, int, int]:
        """(started, running) now, and started once every call queued on the store's I/O
        pool has run (the pool is shut down, waiting for them)."""
        with self.lock:
            started, running = self.started, self.running
        ckpt.executors.io.shutdown(wait=True)
        with self.lock:
            return started, running, self.started


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(CHUNKS * CHUNK // 4, generator=g)}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[Checkpointer, FaultPlan]]:
    """A memory tier and a file:// tier behind a fault plan, both taking every version in
    the commit (the file tier's writes stream as the state is hashed)."""
    ckpt = Checkpointer(
        tmp_path / "root",
        tiers=[
            TierSpec("mem", f"memory://{uuid.uuid4().hex}"),
            TierSpec("disk", f"file://{tmp_path / 'disk'}"),
        ],
        policy=Policy(
            base_every=1,
            chunk_size=CHUNK,
            tiers={
                "mem": TierPolicy(versions="all", mode="sync", codec="raw"),
                "disk": TierPolicy(
                    versions="all", mode="sync", codec="raw", guarantee="best_effort"
                ),
            },
        ),
    )
    yield ckpt, inject(ckpt, "disk")
    ckpt.close(abandon=True)


def test_a_failed_chunk_write_leaves_no_write_of_the_save_running(
    store: tuple[Checkpointer, FaultPlan],
) -> None:
    ckpt, plan = store
    puts = Calls(TierFull)
    puts.watch(plan, "put")
    result = ckpt.save(0, state()).wait()
    assert result.tiers == {"mem": "committed", "disk": "failed"}, result.tiers
    started, running, later = puts.settled(ckpt)
    assert running == 0, f"{running} writes still running after the save failed on disk"
    assert later == started, f"{later - started} writes started after the save failed on disk"
    assert started < CHUNKS  # the writes not started when the first failed never ran


def test_a_failed_chunk_read_leaves_no_read_of_the_restore_running(
    store: tuple[Checkpointer, FaultPlan],
) -> None:
    ckpt, plan = store
    ckpt.save(0, state()).wait()
    # the first read is the manifest's; the second, a chunk's, finds its blob lost (the
    # tier stays in use for the other chunks)
    gets = Calls(NotFound, fail_at=2)
    gets.watch(plan, "get")
    target = {"w": torch.zeros(CHUNKS * CHUNK // 4)}
    with pytest.raises(NoRestorableVersion):
        ckpt.restore(target, tiers=["disk"])
    started, running, later = gets.settled(ckpt)
    assert running == 0, f"{running} reads still running after the restore failed"
    assert later == started, f"{later - started} reads started after the restore failed"
    assert torch.equal(target["w"], torch.zeros(CHUNKS * CHUNK // 4))  # all or nothing


def test_map_all_cancels_what_has_not_started_and_waits_for_what_runs() -> None:
    ran: list[int] = []
    lock = threading.Lock()

    def one(i: int) -> int:
        if i == 0:
            raise ValueError("first")
        time.sleep(0.05)
        with lock:
            ran.append(i)
        return i

    with ThreadPoolExecutor(4) as pool:
        assert map_all(pool, lambda i: i * 2, range(5)) == [0, 2, 4, 6, 8]
        with pytest.raises(ValueError):
            map_all(pool, one, range(40))
        with lock:
            done = len(ran)
    # the pool has run everything it was given: nothing ran on after the failure was raised
    assert len(ran) == done and done < 39
