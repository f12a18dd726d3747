"""Per-tier maintenance after commits and migrations: retention, then GC (then, per issue 13,
log compaction). It owns the GC state and runs on one thread of its own.

A commit or a migration *requests* maintenance of the tiers it wrote; requests coalesce,
and the thread works through the tiers that are due, one at a time, so retention never
runs from two threads and never blocks a save. :meth:`Maintenance.maintain_tier` is the
one place a per-tier step is added. Failures are logged per tier and the thread goes on;
an unexpected one is also recorded for ``close()`` to report.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from tiercheck.errors import TiercheckError
from tiercheck.fetch import ChunkFetcher
from tiercheck.handles import Failures
from tiercheck.leases import GCFence, TierLeases
from tiercheck.manifest_log import Catalog, LiveCatalog, TierLog, read_tier_log
from tiercheck.placement import Policy
from tiercheck.retention import GCReport, GCState, collect_garbage, drop_versions, plan_drops
from tiercheck.tierset import TierSet, TierSlot

__all__ = ["Maintenance"]

log = logging.getLogger("tiercheck")


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
    ) -> None:
        self.tierset = tierset
        self.policy = policy
        self.catalog = catalog
        self.fence = fence
        self.leases = leases
        self.pinned = pinned
        self.failures = failures
        self.rank = rank
        self.last_errors: dict[str, str] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiercheck-maint")
        self._lock = threading.Lock()
        self._due: set[str] = set()
        self._scheduled = False
        # sweep every tier once after opening (what a crashed writer left behind); after
        # that only after a drop, and while swept candidates wait out their grace
        self._gc_due: set[str] = {s.name for s in tierset.slots}
        self._gc_state = GCState()  # used on the maintenance thread only

    # --- requests -------------------------------------------------------------------------

    def request(self, tiers: Iterable[str]) -> None:
        """Maintain ``tiers`` soon (returns at once)."""
        with self._lock:
            self._due.update(tiers)
            if self._scheduled or not self._due:
                return
            self._scheduled = True
        self._executor.submit(self._run)

    def flush(self) -> None:
        """Block until the maintenance requested so far has run."""
        self._executor.submit(lambda: None).result()

    def collect(self, *, dry_run: bool = False, grace: float | None = None) -> list[GCReport]:
        """Sweep every tier now, on the maintenance thread; ``grace`` overrides the policy's
        (with a fresh clock: a blob counts as first seen now). Returns one report per tier."""
        fut: Future[list[GCReport]] = self._executor.submit(self._collect_all, dry_run, grace)
        return fut.result()

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    # --- the maintenance thread ----------------------------------------------------------

    def _run(self) -> None:
        with self._lock:
            due, self._due = self._due, set()
            self._scheduled = False
        for slot in self.tierset.open():
            if slot.name not in due:
                continue
            try:
                self.maintain_tier(slot)
                self.last_errors.pop(slot.name, None)
            except (TiercheckError, OSError) as exc:  # retried at the next request
                self.last_errors[slot.name] = f"{type(exc).__name__}: {exc}"
                log.warning("maintenance of tier %s failed: %s", slot.name, exc)
            except Exception as exc:  # a bug: reported by close(); the other tiers go on
                self.last_errors[slot.name] = f"{type(exc).__name__}: {exc}"
                log.exception("maintenance of tier %s failed unexpectedly", slot.name)
                self.failures.background(f"maintenance of tier {slot.name}: {exc!r}")

    def maintain_tier(self, slot: TierSlot) -> None:
        """Everything done to one tier after a commit or a migration, in order: retention,
        then GC. (Log compaction, issue 13, goes after GC here.)"""
        if slot.tier is None or slot.policy is None or not self._manages(slot):
            return
        tl = self.catalog.snapshot().logs.get(slot.name)
        if tl is None:  # unreachable when last read: read it now (retention needs all of it)
            mark = self.catalog.begin_read()
            try:
                fresh = read_tier_log(slot.name, slot.tier)
            except BaseException:
                self.catalog.end_read(mark)
                raise
            tl = self.catalog.install(Catalog({slot.name: fresh}, {}), mark, partial=True).logs[
                slot.name
            ]
        drops = plan_drops(tl, slot.policy, self.pinned())
        if drops:
            self.catalog.dropped(slot.name, drop_versions(slot, drops))
            log.debug("retention dropped %s from %s", drops, slot.name)
        # listing a tier is not free (a remote one especially): sweep only after a drop,
        # while swept candidates wait out their grace, and once after opening
        if drops or slot.name in self._gc_due:
            report = self._sweep(slot, self._gc_state, self.policy.gc_grace_seconds, False)
            if report.waiting or report.fenced:
                self._gc_due.add(slot.name)
            else:
                self._gc_due.discard(slot.name)

    def _manages(self, slot: TierSlot) -> bool:
        # one rank manages a tier every rank shares
        return slot.tier is not None and (not slot.tier.capabilities.shared or self.rank == 0)

    def _sweep(self, slot: TierSlot, state: GCState, grace: float, dry_run: bool) -> GCReport:
        assert slot.tier is not None
        fetcher = ChunkFetcher(self.tierset.by_speed(), repair=False)
        shared = slot.tier.capabilities.shared
        name = slot.name
        tier = slot.tier

        def current_log() -> TierLog:
            if shared:  # other processes commit here too: read what the tier says now
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
            fetcher.manifest,
            state=state,
            grace=grace,
            dry_run=dry_run,
            # a per-rank tier holds this rank's shards only: other manifests are elsewhere
            rank=None if shared else self.rank,
            fence=self.fence,
            leases=self.leases if shared else None,
        )

    def _collect_all(self, dry_run: bool, grace: float | None) -> list[GCReport]:
        state = self._gc_state if grace is None else GCState()
        grace_s = self.policy.gc_grace_seconds if grace is None else grace
        reports = []
        for slot in self.tierset.open():
            if slot.name not in self.catalog.snapshot().logs:
                continue
            reports.append(self._sweep(slot, state, grace_s, dry_run))
        return reports
