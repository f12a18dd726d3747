"""The trainer waits only for its own copy (issue 31): the staging buffer is free for the next
save as soon as the fastest tier holds the shard, and a slower synchronous tier reads the rest
from that tier's copy, so the next save stages (and overwrites the buffer) while it writes.

The slow tier here is held inside the first ``has`` its placement asks (before it reads any
byte of the shard); the next save must be staged meanwhile, the slow tier must still store the
first version's bytes, not the buffer's new contents, and the save that reaches it while it is
busy skips it ("latest wins": ``missing``, with the reason), never waits for it.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tiercheck import Checkpointer, Policy, SaveHandle, TierPolicy, TierSpec
from tiercheck.testing.faults import FaultEvent, inject

NUMEL = 1 << 18  # 1 MiB


def state_of(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(NUMEL, generator=g), "b": torch.randn(1000, generator=g)}


def open_store(root: Path) -> Checkpointer:
    tag = uuid.uuid4().hex[:8]
    tiers = [
        # the fastest tier (speed rank 0), streamed while the shard is hashed
        TierSpec("fast", f"memory://handover-{tag}"),
        # slower (shm), with a budget: placed after hashing, not streamed
        TierSpec("slow", f"shm://tc-test-handover-{tag}", {"budget": "64MiB"}),
    ]
    policy = Policy(
        base_every=1,
        chunk_size=1 << 16,
        tiers={
            "fast": TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=3),
            "slow": TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=3),
        },
    )
    return Checkpointer(root / "s", tiers=tiers, policy=policy)


def open_shm_lmdb(root: Path, *, base_every: int) -> Checkpointer:
    """The default store's shape, small: shm with a budget of about two versions (raw, all
    versions) and LMDB taking bases."""
    tag = uuid.uuid4().hex[:8]
    tiers = [
        TierSpec("shm", f"shm://tc-test-handover-{tag}", {"budget": "2560KiB"}),
        TierSpec("lmdb", f"lmdb://{root}/lmdb"),
    ]
    policy = Policy(
        base_every=base_every,
        chunk_size=1 << 16,
        tiers={
            "shm": TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=1),
            "lmdb": TierPolicy(versions="base", mode="sync", codec="raw", keep_bases=2),
        },
    )
    return Checkpointer(root / "s", tiers=tiers, policy=policy)


def hold_slow_placement(ckpt: Checkpointer, name: str = "slow") -> tuple[threading.Event, ...]:
    """Once ``armed`` is set, tier ``name``'s placement is held inside the first ``has`` it
    asks (before it reads any byte of the shard) until ``release`` is set; ``entered``
    says it is there. Returns (armed, entered, release)."""
    armed, entered, release = threading.Event(), threading.Event(), threading.Event()

    def hold_first_has(event: FaultEvent) -> None:
        # the placement's own question (on a tier thread), not the budget check before it
        placing = threading.current_thread().name.startswith("tiercheck-tier")
        if placing and armed.is_set() and not entered.is_set():
            entered.set()
            release.wait()

    inject(ckpt, name).hook(hold_first_has, "has")
    return armed, entered, release


def first_save_held(
    ckpt: Checkpointer, state: dict[str, Any], armed: threading.Event, entered: threading.Event
) -> SaveHandle:
    """Prepare for ``state`` and save it as step 0 with the hold of
    :func:`hold_slow_placement` armed; returns once the held tier's placement is inside."""
    ckpt.prepare(state)
    armed.set()
    handle = ckpt.save(0, state)
    assert entered.wait(60), "the held tier never asked what it holds"
    return handle


def until(condition: Callable[[], bool], ended: Callable[[], bool] = lambda: False) -> bool:
    """Poll ``condition`` every 10 ms for up to a minute (a handle has no event for one
    tier's state); False if ``ended`` held first or the minute ran out."""
    for _ in range(6000):
        if condition():
            return True
        if ended():
            return False
        threading.Event().wait(0.01)
    return False


def tier_is(handle: SaveHandle, tier: str, state: str) -> Callable[[], bool]:
    """Whether ``handle``'s save is ``state`` at ``tier`` now (for :func:`until`)."""
    return lambda: handle.result_now().tiers.get(tier) == state


def test_next_save_stages_while_a_slower_tier_still_writes(tmp_path: Path) -> None:
    ckpt = open_store(tmp_path)
    armed, entered, release = hold_slow_placement(ckpt)
    try:
        s0, s1 = state_of(0), state_of(1)
        h0 = first_save_held(ckpt, s0, armed, entered)
        h1 = ckpt.save(1, s1)
        # before: the buffer stayed with version 0 until slow had written it, so this
        # timed out (WaitTimeout) while slow was held
        h1.wait_staged(timeout=60)
        # slow is let go only once version 1 has skipped it: released earlier, slow could
        # be free before version 1 asks, and take it (a race the suite hit under load)
        assert until(tier_is(h1, "slow", "missing"), h1.done), h1.result_now()
        release.set()
        r0, r1 = h0.wait(timeout=60), h1.wait(timeout=60)
        assert r0.tiers == {"fast": "committed", "slow": "committed"}, r0
        # slow was still writing version 0 when version 1 reached it: skipped, not failed
        assert r1.tiers == {"fast": "committed", "slow": "missing"}, r1
        assert "latest wins" in r1.errors["slow"], r1.errors
        ckpt.flush()
        s2 = state_of(2)  # slow is free again: it takes the newest version
        r2 = ckpt.save(2, s2).wait(timeout=60)
        assert r2.tiers == {"fast": "committed", "slow": "committed"}, r2
        # slow wrote version 0 from fast's copy: version 0's bytes, not version 1's
        for step, want in ((0, s0), (2, s2)):
            got = {k: torch.zeros_like(v) for k, v in want.items()}
            ckpt.restore(got, step=step, tiers=["slow"])
            for k in want:
                assert torch.equal(got[k], want[k]), (step, k)
    finally:
        release.set()
        ckpt.destroy()


def test_a_slower_tier_that_finishes_before_the_next_save_reads_only_the_buffer(
    tmp_path: Path,
) -> None:
    """The buffer is given back only when the next save wants it: a slower tier that is
    still writing after the fastest tier committed goes on reading the staging buffer, so
    no byte of the version is read back from the fastest tier (and verified) a second
    time when no save is waiting. Before, the buffer was handed back the moment the
    fastest tier held the shard, and slow read the rest from fast (every chunk a ``get``).
    """
    ckpt = open_store(tmp_path)
    armed, entered, release = hold_slow_placement(ckpt)
    reads: list[FaultEvent] = []
    inject(ckpt, "fast").hook(reads.append, "get")
    try:
        s0 = state_of(0)
        ckpt.prepare(s0)
        armed.set()
        h0 = ckpt.save(0, s0)
        assert entered.wait(60), "tier slow never asked what it holds"
        until(tier_is(h0, "fast", "committed"))  # fast commits while slow is held
        assert h0.result_now().tiers["fast"] == "committed"
        saves = ckpt._engine.saves
        assert saves is not None
        until(lambda: saves._tail is not None)  # the rest of version 0 goes to the tail
        # slow has not read a byte yet: the buffer is still version 0's (a pipeline that
        # released it on handing over let the next save overwrite what slow reads next)
        assert saves.staging._busy.locked()
        release.set()
        r0 = h0.wait(timeout=60)
        assert r0.tiers == {"fast": "committed", "slow": "committed"}, r0
        assert reads == []  # slow wrote every chunk from the buffer
        got = {k: torch.zeros_like(v) for k, v in s0.items()}
        ckpt.restore(got, step=0, tiers=["slow"])
        assert all(torch.equal(got[k], s0[k]) for k in s0)
    finally:
        release.set()
        ckpt.destroy()


def test_the_fastest_tier_makes_room_while_a_slower_tier_takes_its_newest_version(
    tmp_path: Path,
) -> None:
    """The shape of the default store saving often (issue 31): shm with a budget of about
    two versions, LMDB taking bases and still writing the newest one. The next version
    needs shm to let go of the version before that newest one, which nothing needs any
    more (shm's newest is a newer base); it must not wait for LMDB. Before, the version a
    save handed to the tail was confirmed only when the tail ended, so the one before it
    stayed pinned as "the newest version every rank committed", shm found no room, and the
    save waited for LMDB's write (issue 31's every-5-steps stalls)."""
    ckpt = open_shm_lmdb(tmp_path, base_every=2)
    armed, entered, release = hold_slow_placement(ckpt, "lmdb")
    try:
        states = [state_of(s) for s in range(4)]
        ckpt.prepare(states[0])
        assert ckpt.save(0, states[0]).wait(timeout=60).tiers == {
            "shm": "committed",
            "lmdb": "committed",
        }
        r1 = ckpt.save(1, states[1]).wait(timeout=60)  # a diff: shm alone
        assert r1.tiers == {"shm": "committed", "lmdb": "missing"}, r1
        armed.set()
        h2 = ckpt.save(2, states[2])  # a base: shm commits it, LMDB is held writing it
        assert entered.wait(60), "LMDB never asked what it holds"
        h3 = ckpt.save(3, states[3])  # shm holds versions 1 and 2: 1 must go, at once
        committed_while_held = until(tier_is(h3, "shm", "committed"))
        release.set()
        r2, r3 = h2.wait(timeout=60), h3.wait(timeout=60)
        assert committed_while_held, r3
        assert r2.tiers == {"shm": "committed", "lmdb": "committed"}, r2
        assert r3.tiers["shm"] == "committed", r3
        for step in (2, 3):
            want = states[step]
            got = {k: torch.zeros_like(v) for k, v in want.items()}
            ckpt.restore(got, step=step)
            assert all(torch.equal(got[k], want[k]) for k in want), step
    finally:
        release.set()
        ckpt.destroy()


def test_a_diff_stays_a_diff_while_a_slower_tier_still_writes_its_base(tmp_path: Path) -> None:
    """shm (a budget of about two versions) and LMDB (bases). While LMDB still writes base
    0 behind the hand-over, the next version stays a diff: LMDB counts as holding its base,
    as it will once its write ends. Before, it became a base (shm "keeps its base alone"),
    which LMDB then wanted too, so with saves closer than LMDB's write every version was a
    base and LMDB never caught up (issue 31's saves every 5 steps)."""
    ckpt = open_shm_lmdb(tmp_path, base_every=10)
    armed, entered, release = hold_slow_placement(ckpt, "lmdb")
    try:
        s0, s1 = state_of(0), state_of(1)
        h0 = first_save_held(ckpt, s0, armed, entered)
        r1 = ckpt.save(1, s1).wait(timeout=60)  # LMDB is still held writing base 0
        held = not release.is_set()
        release.set()
        assert held
        assert r1.role == "diff" and r1.base == 0, r1
        assert r1.tiers == {"shm": "committed", "lmdb": "missing"}, r1
        assert h0.wait(timeout=60).tiers == {"shm": "committed", "lmdb": "committed"}
        got = {k: torch.zeros_like(v) for k, v in s1.items()}
        ckpt.restore(got, step=1)
        assert all(torch.equal(got[k], s1[k]) for k in s1)
    finally:
        release.set()
        ckpt.destroy()


def test_a_slower_tier_takes_the_next_save_once_the_version_it_wrote_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once ``wait()`` of a version handed to the tail has returned, its slower tiers have
    written it, and the next save places there: they are no longer busy. The tail marked
    them free only at its very end, after the outcome and the up to 5 s a base's commit
    waits for LMDB's retention (``maintenance.flush``), so a save asked for meanwhile
    skipped LMDB ("missing", latest wins) though nothing was writing there: the full-disk
    test's save after the space was freed failed that way in a suite run."""
    from tiercheck.upkeep.maintenance import Maintenance

    real_flush = Maintenance.flush
    in_flush, go_on = threading.Event(), threading.Event()

    def held_flush(self: Maintenance, *args: Any, **kwargs: Any) -> Any:
        in_flush.set()
        go_on.wait(60)  # retention of a tier that takes its time
        return real_flush(self, *args, **kwargs)

    monkeypatch.setattr(Maintenance, "flush", held_flush)
    ckpt = open_shm_lmdb(tmp_path, base_every=1)
    try:
        ckpt.prepare(state_of(0))
        r0 = ckpt.save(0, state_of(0)).wait(timeout=60)
        assert r0.tiers == {"shm": "committed", "lmdb": "committed"}, r0
        assert in_flush.wait(60), "the base's commit never waited for retention"
        h1 = ckpt.save(1, state_of(1))  # while version 0's tail waits in the flush
        until(tier_is(h1, "shm", "committed"))  # committed in shm: where else it goes is decided
        go_on.set()
        r1 = h1.wait(timeout=60)
        assert r1.tiers == {"shm": "committed", "lmdb": "committed"}, r1
    finally:
        go_on.set()
        ckpt.destroy()
