"""Per-tier maintenance after commits and migrations: retention, then GC, then log
compaction; and making room in a tier over its memory budget before a save places a
version there. It owns the GC state.

Each tier has a *lane* of its own: one thread that does all the work on that tier, in the
order asked (retention, GC, compaction, making room, discarding), so that retention, GC
and eviction never race on a tier and never run from two threads on it. Lanes do not
wait for one another: making room in shm never waits behind LMDB's or the remote's GC
(issue 31). A commit or a migration *requests* maintenance of the tiers it wrote;
requests coalesce per tier, and never block a save. :meth:`Maintenance.maintain_tier` is
the one place a per-tier step is added. Failures are logged per tier and the lane goes on;
an unexpected one is also recorded for ``close()`` to report.

Log compaction (:func:`~tiercheck.store.catalog.compact_log`) runs once a tier's log holds
:data:`~tiercheck.store.catalog.COMPACT_SLACK` more records than a checkpoint of it would,
and its result replaces that tier's log in the live catalog. A tier that cannot compact
(``NotSupported``, or a record this version cannot summarise) is not asked again by this
process: each attempt reads the whole log.

Once ``close()`` halts it (:class:`~tiercheck.runtime.background.Halt`), no request is
taken, the work queued on every lane is cancelled and no further tier is maintained; a
request's unexpected failure is recorded by
:func:`~tiercheck.runtime.background.reporting` for ``close()`` to raise.

:meth:`Maintenance.make_room` runs on its tier's lane (see :mod:`tiercheck.store.budgets`).

:meth:`Maintenance.discard` sweeps, at once, what a save or a migration that was given up
wrote to a tier: the ids it had protected, once released, that no version the tier holds
references and no other save or migration in flight protects (the fence), under the write
leases of a shared tier. A full disk is then not kept full by work that will never commit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

from tiercheck.errors import Halted, TiercheckError
from tiercheck.formats.manifest import ChunkRef
from tiercheck.runtime.background import Halt, reporting
from tiercheck.runtime.handles import Failures
from tiercheck.store.budgets import Shortfall, budget_of
from tiercheck.store.catalog import (
    Catalog,
    LiveCatalog,
    TierLog,
    compact_log,
    read_tier_log,
    should_compact,
)
from tiercheck.store.fetch import ChunkFetcher
from tiercheck.store.leases import GCFence, TierLeases
from tiercheck.store.policy import Policy, TierPolicy
from tiercheck.store.tierset import TierSet, TierSlot
from tiercheck.upkeep.retention import (
    ChunkList,
    GCReport,
    GCState,
    Protection,
    collect_garbage,
    drop_versions,
    plan_drops,
    protection,
)

__all__ = ["Maintenance"]

log = logging.getLogger(__name__)

R = TypeVar("R")


class Maintenance:
    """Retention and GC for the tiers of one store (see the module docstring).

    ``pinned()`` returns the versions that must not be dropped now (a migration reads
    them, an in-flight diff needs them as its base). ``rank``: tiers shared by every rank
    are maintained by rank 0 only.
    """

    def __init__(
        self,
        *,
        tierset: TierSet,
        policy: Policy,
        catalog: LiveCatalog,
        fence: GCFence,
        leases: TierLeases,
        pinned: Callable[[], set[int]],
        failures: Failures,
        rank: int = 0,
        halt: Halt | None = None,
    ) -> None:
        self.tierset = tierset
        self.policy = policy
        self.catalog = catalog
        self.fence = fence
        self.leases = leases
        self.pinned = pinned
        self.failures = failures
        self.rank = rank
        self.halt = halt or Halt()
        self._lanes: dict[str, ThreadPoolExecutor] = {}  # tier -> its one thread (docstring)
        self._lock = threading.Lock()
        self._scheduled: set[str] = set()  # tiers whose maintenance is queued, not started
        self._stopped = False  # halted: no work is taken
        self._active: dict[str, str] = {}  # tier -> what its lane is doing, for close()
        # sweep every tier once after opening (what a crashed writer left behind); after
        # that only after a drop, and while swept candidates wait out their grace
        self._gc_due: set[str] = {s.name for s in tierset.slots}
        self._gc_state = GCState()  # each tier's part used on that tier's lane only
        self._no_compaction: dict[str, str] = {}  # tier -> why compaction was skipped
        self._chunk_lists: dict[str, ChunkList] = {}  # manifest id -> its chunks (_chunks_of)

    # --- requests -------------------------------------------------------------------------

    def request(self, tiers: Iterable[str]) -> None:
        """Maintain ``tiers`` soon, each on its lane (returns at once)."""
        with self._lock:
            if self._stopped:
                return
            for name in sorted(set(tiers) - self._scheduled):
                if name not in self._names():
                    continue
                self._scheduled.add(name)
                run = reporting(self.failures, "maintenance", self._run)
                self._lane(name).submit(self._as, name, f"maintenance of tier {name}", run, name)

    def flush(self, timeout: float | None = None, tiers: Iterable[str] | None = None) -> bool:
        """Block until the maintenance requested so far has run on every lane (or those of
        ``tiers``; at once once halted), or ``timeout`` passed; True unless it did."""
        deadline = None if timeout is None else time.monotonic() + timeout
        wanted = None if tiers is None else set(tiers)
        names = [n for n in self._names() if wanted is None or n in wanted]
        try:
            futs = [self._submit(name, "flush", lambda: None) for name in names]
        except Halted:
            return True
        for fut in futs:
            try:
                fut.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except CancelledError:
                continue
            except TimeoutError:
                return False
        return True

    def collect(self, *, dry_run: bool = False, grace: float | None = None) -> list[GCReport]:
        """Sweep every tier now, each on its lane; ``grace`` overrides the policy's (with a
        fresh clock: a blob counts as first seen now). Returns one report per tier swept."""
        state = None if grace is None else GCState()
        futs = [
            self._submit(slot.name, "gc", self._collect_one, slot, dry_run, grace, state)
            for slot in self.tierset.open()
        ]
        return [r for r in (self._wait(f, "gc") for f in futs) if r is not None]

    def make_room(self, slot: TierSlot, needed: int) -> Shortfall | None:
        """Make ``needed`` bytes fit ``slot``'s budget, on the tier's lane (never behind
        another tier's work); return None once they fit (or the tier has no budget), else
        what is missing.

        Versions are dropped by retention tightened step by step (first the policy itself,
        then fewer diffs, down to none, then fewer bases, down to one, and last the versions
        a newer one needs that a more durable tier keeps: a diff's base that LMDB holds) and
        the tier is swept after each step: at once (grace 0) where no other process writes
        to it, with the policy's grace in a shared tier. Never dropped: what the tier must
        keep (:func:`tiercheck.upkeep.retention.protection`: its newest restorable version and
        what that needs, until a newer one is committed here or somewhere at least as
        durable), a pinned version (a migration still reads it, an in-flight diff follows
        it) unless a more durable tier keeps it. What still does not fit is the *new*
        version's shortfall: it skips the tier.
        """
        what = f"making room in tier {slot.name}"
        return self._wait(self._submit(slot.name, what, self._make_room, slot, needed), what)

    def discard(self, tiers: Iterable[str], ids: Iterable[str]) -> None:
        """Delete, on each tier's lane, those of ``ids`` in ``tiers`` that nothing
        references or protects (what a save or migration given up wrote; see the module
        docstring). Returns at once; nothing is done once the store is closing."""
        wanted = frozenset(ids)
        if not wanted:
            return
        with self._lock:
            if self._stopped:
                return
            for name in sorted(set(tiers) & set(self._names())):
                run = reporting(self.failures, "discard", self._discard)
                what = "discarding what was given up"
                self._lane(name).submit(self._as, name, what, run, name, wanted)

    def _discard(self, name: str, ids: frozenset[str]) -> None:
        if self.halt.is_set():
            return
        slot = self.tierset.get(name)
        if slot.tier is None or not self._manages(slot):
            return
        try:
            report = self._sweep(slot, self._gc_state, 0.0, False, only=ids)
        except (TiercheckError, OSError) as exc:  # the next sweep tries again, by age
            log.warning("tier %s: could not delete what was given up: %s", name, exc)
            return
        if report.deleted:
            log.info(
                "tier %s: deleted %d blobs a save or migration given up had written",
                name,
                report.deleted,
            )

    def close(self) -> None:
        self.stop()
        self.join()

    def stop(self) -> None:
        """Take no more work and cancel what is queued (returns at once; see :meth:`join`)."""
        with self._lock:
            self._stopped = True
            lanes = list(self._lanes.values())
        for lane in lanes:
            lane.shutdown(wait=False, cancel_futures=True)

    def join(self) -> None:
        """Block until every lane's thread has ended (after :meth:`stop`)."""
        with self._lock:
            lanes = list(self._lanes.values())
        for lane in lanes:
            lane.shutdown(wait=True)

    def active(self) -> str | None:
        """What the lanes are doing now (None when all are idle)."""
        doing = dict(self._active)  # a copy: the lanes change it
        return "; ".join(doing[n] for n in sorted(doing)) or None

    def _names(self) -> list[str]:
        return [s.name for s in self.tierset.slots]

    def _lane(self, name: str) -> ThreadPoolExecutor:
        """``name``'s lane (under ``_lock``; made at its first use)."""
        lane = self._lanes.get(name)
        if lane is None:
            lane = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tiercheck-maint-{name}")
            self._lanes[name] = lane
        return lane

    def _submit(self, name: str, what: str, fn: Callable[..., R], *args: Any) -> Future[R]:
        with self._lock:
            if self._stopped:
                raise Halted(f"{what} was not started: the store is closing")
            return self._lane(name).submit(self._as, name, what, fn, *args)

    @staticmethod
    def _wait(fut: Future[R], what: str) -> R:
        try:
            return fut.result()
        except CancelledError:
            raise Halted(f"{what} was not started: the store is closing") from None

    def _as(self, name: str, what: str, fn: Callable[..., R], *args: Any) -> R:
        self._active[name] = what if what.endswith(name) else f"{what} (tier {name})"
        try:
            return fn(*args)
        finally:
            self._active.pop(name, None)

    # --- the lanes -------------------------------------------------------------------------

    def _run(self, name: str) -> None:
        with self._lock:
            self._scheduled.discard(name)  # a request from now on queues another round
        if self.halt.is_set():  # close(): no tier is started after it
            return
        slot = self.tierset.get(name)
        if slot.tier is None:
            return
        try:
            self.maintain_tier(slot)
        except (TiercheckError, OSError) as exc:  # retried at the next request
            log.warning("maintenance of tier %s failed: %s", slot.name, exc)
        except Exception as exc:  # a bug: reported by close(); the other tiers go on
            log.exception("maintenance of tier %s failed unexpectedly", slot.name)
            self.failures.background(f"maintenance of tier {slot.name}: {exc!r}")

    def maintain_tier(self, slot: TierSlot) -> None:
        """Everything done to one tier after a commit or a migration, in order: retention,
        then GC, then log compaction (when due)."""
        if slot.tier is None or slot.policy is None or not self._manages(slot):
            return
        tl = self._log_of(slot)  # unreachable when last read: read now (retention needs all)
        drops = plan_drops(tl, slot.policy, self.pinned(), self._protection(slot))
        if drops:
            self.catalog.dropped(slot.name, drop_versions(slot, drops))
            log.debug("retention dropped %s from %s", drops, slot.name)
        # listing a tier is not free (a remote one especially): sweep only after a drop,
        # while swept candidates wait out their grace, and once after opening
        if drops or slot.name in self._gc_due:
            grace = self._grace(slot) if drops else self.policy.gc_grace_seconds
            report = self._sweep(slot, self._gc_state, grace, False)
            if report.waiting or report.fenced:
                self._gc_due.add(slot.name)
            else:
                self._gc_due.discard(slot.name)
        self._compact(slot)

    def _log_of(self, slot: TierSlot) -> TierLog:
        """``slot``'s log in the catalog, read now if it is not there (whole: retention must
        not act on a partial log)."""
        assert slot.tier is not None
        tl = self.catalog.snapshot().logs.get(slot.name)
        if tl is not None:
            return tl
        mark = self.catalog.begin_read()
        try:
            fresh = read_tier_log(slot.name, slot.tier)
        except BaseException:
            self.catalog.end_read(mark)
            raise
        return self.catalog.install(Catalog({slot.name: fresh}, {}), mark, partial=True).logs[
            slot.name
        ]

    def _compact(self, slot: TierSlot) -> None:
        """Compact ``slot``'s log once it pays (module docstring)."""
        assert slot.tier is not None
        tl = self.catalog.snapshot().logs.get(slot.name)
        if tl is None or slot.name in self._no_compaction:
            return
        # The catalog counts the records it read, not those this process appended since:
        # each version it committed there wrote at least two (prepare, commit), each drop one.
        written = 2 * len(tl.committed) + len(tl.dropped)
        if not should_compact(replace(tl, records=max(tl.records, written))):
            return
        mark = self.catalog.begin_read()
        try:
            report = compact_log(slot.name, slot.tier)
        except BaseException:
            self.catalog.end_read(mark)
            raise
        if report.log is None:
            self.catalog.end_read(mark)
            self._no_compaction[slot.name] = report.skipped or "skipped"
            log.info("the log of tier %s is not compacted: %s", slot.name, report.skipped)
            return
        # what this process recorded while compacting is merged into the log read after it
        self.catalog.install(Catalog({slot.name: report.log}, {}), mark, partial=True)
        log.debug(
            "compacted the log of %s: %d -> %d records", slot.name, report.before, report.after
        )

    def _make_room(self, slot: TierSlot, needed: int) -> Shortfall | None:
        tier = slot.tier
        assert tier is not None
        budget = budget_of(tier)
        held = tier.usage()
        if budget is None or held is None or held + needed <= budget:
            return None
        if slot.policy is None or not self._manages(slot):
            return Shortfall(slot.name, needed, held, budget)
        grace = self._grace(slot)
        # first what retention dropped already (waiting out its grace), then tighter steps,
        # and last what a more durable tier keeps; never what this tier must keep (which
        # these drops do not change: its newest version and what that needs stay)
        protect = self._protection(slot)
        steps: list[tuple[TierPolicy, bool] | None] = [
            None,
            *((tight, False) for tight in _tightened(slot.policy, self._log_of(slot))),
            (replace(slot.policy, keep_diffs=0, keep_bases=1), True),
        ]
        for step in steps:
            if step is not None:
                tight, last_resort = step
                drops = plan_drops(
                    self._log_of(slot), tight, self.pinned(), protect, last_resort=last_resort
                )
                if not drops:
                    continue
                self.catalog.dropped(slot.name, drop_versions(slot, drops))
                log.info(
                    "tier %s is over its budget: dropped versions %s to make room for %d bytes",
                    slot.name,
                    drops,
                    needed,
                )
            report = self._sweep(slot, self._gc_state, grace, False)
            if report.waiting or report.fenced:
                self._gc_due.add(slot.name)
            held = tier.usage() or 0
            if held + needed <= budget:
                return None
        return Shortfall(slot.name, needed, held, budget)

    def _grace(self, slot: TierSlot) -> float:
        """The grace of a sweep of ``slot`` after retention dropped versions or to make
        room: none where only this process writes (not a shared tier: this process's saves
        and migrations are fenced, and no other writer can leave a blob behind that it
        would still commit), the policy's in a shared tier. Without it, what retention
        dropped would stay on disk for the grace period: an LMDB file, which never shrinks,
        would grow by a state per base saved during it. (The sweep after opening, with
        nothing dropped, keeps the policy's grace.)"""
        assert slot.tier is not None
        return self.policy.gc_grace_seconds if slot.tier.capabilities.shared else 0.0

    def _protection(self, slot: TierSlot) -> Protection:
        """What ``slot``'s tier must keep now (:func:`tiercheck.upkeep.retention.protection`)."""
        self._log_of(slot)  # the rule reads this tier's whole log
        caps = {s.name: s.tier.capabilities for s in self.tierset.slots if s.tier is not None}
        return protection(self.catalog.snapshot(), slot.name, caps)

    def _manages(self, slot: TierSlot) -> bool:
        # one rank manages a tier every rank shares
        return slot.tier is not None and (not slot.tier.capabilities.shared or self.rank == 0)

    def _sweep(
        self,
        slot: TierSlot,
        state: GCState,
        grace: float,
        dry_run: bool,
        *,
        only: frozenset[str] | None = None,
    ) -> GCReport:
        assert slot.tier is not None
        fetcher = ChunkFetcher(self.tierset.by_speed(), repair=False)
        shared = slot.tier.capabilities.shared
        name = slot.name
        tier = slot.tier

        def current_log() -> TierLog:
            # other processes commit here too, or what was given up is judged: read what
            # the tier says now (a record whose append failed may be there all the same)
            if shared or only is not None:
                fresh = read_tier_log(name, tier)
                mine = self.catalog.snapshot().logs.get(name)
                if mine is not None:
                    fresh.committed.update(
                        {v: i for v, i in mine.committed.items() if v not in fresh.committed}
                    )
                return fresh
            return self.catalog.snapshot().logs.get(name) or TierLog(name)

        return collect_garbage(
            slot,
            current_log,
            self._chunks_of(fetcher),
            state=state,
            grace=grace,
            dry_run=dry_run,
            # a per-rank tier holds this rank's shards only: other manifests are elsewhere
            rank=None if shared else self.rank,
            fence=self.fence,
            leases=self.leases if shared else None,
            only=only,
        )

    def note_chunks(self, manifest_id: str, chunks: Sequence[ChunkRef]) -> None:
        """The chunks of a shard manifest a save of this process just committed, kept for
        the sweeps' mark (:meth:`_chunks_of`): it is then never read back and decoded."""
        with self._lock:
            self._chunk_lists[manifest_id] = ChunkList(tuple(chunks))

    def _chunks_of(self, fetcher: ChunkFetcher) -> Callable[[str], ChunkList]:
        """The chunks of a shard manifest by id for a sweep's mark: kept from an earlier
        sweep (:class:`~tiercheck.upkeep.retention.ChunkList`; a manifest never changes),
        else read and decoded with ``fetcher``. Those no held version of a tier names any
        more are let go first. 40 saves of a state of 2,288 tensors (1 GiB) by the default
        store, in a process of 4 million objects: the collector's passes on the
        maintenance threads 1.55-1.63 s under the GIL (4,620 young, 423 middle, 2 full of
        ~0.5 s each) before, 56-58 ms with the chunks kept (700 young, 65 middle, no full
        one), 5 ms once the saves hand theirs over (:meth:`note_chunks`: 51 young, 5
        middle)."""
        logs = self.catalog.snapshot().logs.values()
        held = {mid for tl in logs for v in tl.held() for mid in tl.committed[v].shards}
        with self._lock:
            self._chunk_lists = {m: c for m, c in self._chunk_lists.items() if m in held}

        def chunks(manifest_id: str) -> ChunkList:
            with self._lock:
                got = self._chunk_lists.get(manifest_id)
            if got is None:
                got = ChunkList(tuple(fetcher.manifest(manifest_id).chunks))
                with self._lock:
                    self._chunk_lists[manifest_id] = got
            return got

        return chunks

    def _collect_one(
        self, slot: TierSlot, dry_run: bool, grace: float | None, state: GCState | None
    ) -> GCReport | None:
        if slot.name not in self.catalog.snapshot().logs:
            return None
        grace_s = self.policy.gc_grace_seconds if grace is None else grace
        return self._sweep(slot, state or self._gc_state, grace_s, dry_run)


def _tightened(policy: TierPolicy, tl: TierLog) -> list[TierPolicy]:
    """Retention of ``policy``, then tighter step by step: one diff fewer at a time down to
    none, then one base fewer at a time down to one (what :meth:`Maintenance.make_room`
    tries, in order)."""
    held = tl.held()
    n_bases = sum(1 for v in held if tl.committed[v].role == "base")
    n_diffs = len(held) - n_bases
    out = [policy]
    diffs = n_diffs if policy.keep_diffs is None else min(policy.keep_diffs, n_diffs)
    out += [replace(policy, keep_diffs=k) for k in range(diffs - 1, -1, -1)]
    bases = n_bases if policy.keep_bases is None else min(policy.keep_bases, n_bases)
    out += [replace(policy, keep_diffs=0, keep_bases=k) for k in range(bases - 1, 0, -1)]
    return out
