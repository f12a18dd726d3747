"""The engine's thread pools (``tiercheck.runtime.executors``): every parallel step runs on a
pool the store made when it opened, none on a pool made for the call, and closing the store
ends every thread it started."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.errors import ConfigError
from tiercheck.runtime.executors import Executors, lower_priority, own_nice
from tiercheck.testing.faults import FaultEvent, FaultPlan, inject
from tiercheck.upkeep.copying import WRITE_WINDOW

CHUNK = 4096


def state_of(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64 * 1024, generator=g), "step": step}


def open_store(root: Path) -> Checkpointer:
    """LMDB takes every version in the commit; a file:// remote gets each by migration."""
    return Checkpointer(
        root / "s",
        tiers=[
            TierSpec("lmdb", f"lmdb://{root / 'lmdb'}"),
            TierSpec("remote", f"file://{root / 'remote'}"),
        ],
        policy=Policy(
            base_every=1,
            chunk_size=CHUNK,
            tiers={
                "lmdb": TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=None),
                "remote": TierPolicy(versions="all", mode="async", codec="zstd", keep_bases=None),
            },
        ),
    )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[Checkpointer, FaultPlan]]:
    """The store, its remote behind a fault plan that only observes."""
    ckpt = open_store(tmp_path)
    yield ckpt, inject(ckpt, "remote")
    ckpt.close(abandon=True)


def test_migration_writes_and_log_reads_run_on_the_stores_pools(
    store: tuple[Checkpointer, FaultPlan],
) -> None:
    ckpt, plan = store
    threads: dict[str, set[threading.Thread]] = {"put": set(), "read_log": set()}

    def seen(event: FaultEvent) -> None:
        threads[event.op].add(threading.current_thread())

    plan.hook(seen, ["put", "read_log"])
    for step in range(3):
        ckpt.save(step, state_of(step)).wait()
    assert ckpt.wait_migrations(60)
    ckpt.refresh()
    executors = ckpt.executors
    # ThreadPoolExecutor keeps its workers in _threads: the one way to name a pool's threads
    assert threads["put"] and threads["put"] <= set(executors.writes._threads)
    assert threads["read_log"] and threads["read_log"] <= set(executors.logs._threads)
    assert [v.step for v in ckpt.history() if v.tiers["remote"] == "committed"] == [0, 1, 2]


def test_close_ends_every_thread_the_store_started(tmp_path: Path) -> None:
    before = set(threading.enumerate())
    ckpt = open_store(tmp_path)
    for step in range(2):
        ckpt.save(step, state_of(step)).wait()
    assert ckpt.wait_migrations(60)
    info = ckpt.restore({"w": torch.zeros(64 * 1024), "step": -1})
    assert info.step == 1
    assert torch.equal(ckpt.version(0)["w"], state_of(0)["w"])
    started = {t.name for t in set(threading.enumerate()) - before}
    assert any(name.startswith("tiercheck-io") for name in started)
    ckpt.close()
    left = sorted(t.name for t in set(threading.enumerate()) - before if t.is_alive())
    assert left == []


def test_a_saves_small_chunks_are_hashed_on_the_stores_hashing_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tiercheck.formats.ids as ids

    hashed_on: set[threading.Thread] = set()
    real = ids._hash_serial

    def recording(*args: Any) -> list[str]:
        hashed_on.add(threading.current_thread())
        return real(*args)

    monkeypatch.setattr(ids, "_hash_serial", recording)
    monkeypatch.setattr(ids.os, "cpu_count", lambda: 2)  # the pool path, on any machine
    with Checkpointer(
        tmp_path / "s",
        tiers=[TierSpec("lmdb", f"lmdb://{tmp_path / 'lmdb'}")],
        policy=Policy(base_every=1, chunk_size=64 * 1024),
    ) as ckpt:
        state = {"w": torch.randn(4 * 1024 * 1024)}  # 16 MiB in 256 chunks of 64 KiB
        ckpt.save(0, state).wait()
        assert hashed_on and hashed_on <= set(ckpt.executors.hashing._threads)
        assert torch.equal(ckpt.version(0)["w"], state["w"])


def test_work_cancelled_at_shutdown_is_done_for_its_waiters() -> None:
    """``concurrent.futures.wait`` returns for work the close cancelled (CPython's own
    ``shutdown(cancel_futures=True)`` leaves it unnotified: a migration waiting for its
    queued writes hung forever at close)."""
    from concurrent.futures import wait

    pools = Executors.start(threads=4)
    release = threading.Event()
    try:
        busy = [pools.writes.submit(release.wait) for _ in range(WRITE_WINDOW)]
        queued = pools.writes.submit(lambda: None)  # no thread is free: it waits in the queue
        pools.shutdown(wait=False, cancel_futures=True)
        done, _ = wait([queued], timeout=60)
        assert queued in done and queued.cancelled()
    finally:
        release.set()
        pools.shutdown(wait=True)
    assert all(f.done() for f in busy)


def test_a_slow_remote_never_holds_a_save_behind_its_migration(tmp_path: Path) -> None:
    """A migration's threads wait for the remote to take its writes (a raw blob is copied
    out on the reading thread, the window waits for the rest). They were the threads that
    also placed a save's shard in shm (``tiercheck-io``): with the remote slow, a save's
    ``wait()`` waited for the migration before it. Here the default store's remote takes
    no blob until the saves are done; on the old code no save after the first finished
    until the remote's writes gave up waiting. Now migrations read and encode on
    ``tiercheck-migrate-io``."""
    release = threading.Event()
    held: list[str | None] = []

    def slow(event: FaultEvent) -> None:
        if event.key is not None and event.key.startswith("0" * 16):
            return  # the remote's own marker, written by its maintenance
        if not release.wait(30.0):
            held.append(event.key)

    ckpt = Checkpointer(tmp_path / "store")
    try:
        inject(ckpt, "remote").hook(slow, "put")
        for step in range(3):  # the first base's migration waits at the remote
            ckpt.save(step, state_of(step)).wait()
        assert not held, f"{len(held)} remote writes waited for the saves to finish"
        release.set()
        assert ckpt.wait_migrations(60)
        assert ckpt.history()[0].tiers["remote"] == "committed"
    finally:
        release.set()
        ckpt.destroy()


def _policy_and_nice(tid: int) -> tuple[int, int]:
    """The scheduling policy (``os.SCHED_*``) and nice value of thread ``tid``."""
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # from field 3 (state) on
    return int(fields[38]), int(fields[16])  # fields 41 (policy) and 19 (nice)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
@pytest.mark.parametrize("background", ["idle", "low"])
def test_the_threads_that_save_yield_the_cpu_and_the_staging_copy_does_not(
    tmp_path: Path, background: str
) -> None:
    """``background="low"`` (the default) runs every thread that hashes, places, commits
    or migrates at ``nice`` +10 or more, ``"idle"`` under ``SCHED_IDLE`` too (the kernel
    preempts it the moment another thread wants its core); the staging copy, which the
    trainer waits for, keeps the caller's priority either way. The levels are the
    opener's +10 and, for a migration's reads, +19: not +10 again for a pool thread that
    the (already lowered) save thread started (those ran at +19)."""
    before = set(threading.enumerate())
    open_store(tmp_path).close()  # its tiers: LMDB in the commit, a remote by migration
    kwargs = {} if background == "low" else {"background": background}  # low: the default
    with Checkpointer(tmp_path / "s", **kwargs) as ckpt:  # type: ignore[arg-type]
        for step in range(2):
            ckpt.save(step, state_of(step)).wait_migrated()
        started = {t for t in set(threading.enumerate()) - before if t.native_id}
        seen = {t.name.split("_")[0]: _policy_and_nice(t.native_id) for t in started}  # type: ignore[arg-type]
    main = _policy_and_nice(threading.get_native_id())
    assert main[0] == os.SCHED_OTHER
    assert seen["tiercheck-stage"] == main  # the trainer waits for it
    lowered = ["tiercheck-save", "tiercheck-tier", "tiercheck-write", "tiercheck-migrate-io"]
    for name in [*lowered, "tiercheck-log"]:
        policy, nice = seen[name]
        assert nice >= main[1] + 10, name
        assert policy == (os.SCHED_IDLE if background == "idle" else os.SCHED_OTHER), name
    for name in ["tiercheck-save", "tiercheck-tier", "tiercheck-log"]:
        assert seen[name][1] == min(19, main[1] + 10), name
    assert seen["tiercheck-migrate-io"][1] == 19


def test_an_unknown_background_priority_is_refused_before_the_store_opens(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match="background must be one of 'idle', 'low'"):
        Checkpointer(tmp_path / "s", background="lowest")  # type: ignore[arg-type]
    assert not (tmp_path / "s").exists()


def test_priority_levels_are_absolute_and_never_raise_a_thread() -> None:
    """``lower_priority(n)`` puts the calling thread at ``nice`` n (absolute: twice is
    still n, where +10 twice was +20), capped at 19, and leaves a thread already lower
    where it is."""
    base = own_nice()
    seen: list[int] = []

    def run(first: int | None, level: int) -> None:
        if first is not None:
            os.nice(first - own_nice())
        lower_priority(level)
        lower_priority(level)
        seen.append(own_nice())

    for first, level in [(None, base + 10), (None, base + 40), (base + 15, base + 10)]:
        t = threading.Thread(target=run, args=(first, level))
        t.start()
        t.join()
    assert seen == [min(19, base + 10), 19, min(19, base + 15)]
    assert own_nice() == base  # the caller's own thread is untouched
