"""The migration service: copies committed versions to their asynchronous tiers, retrying.

A committed version that an asynchronous tier wants is queued here for that tier. One
thread works through the queue in order of when each migration is due; copying is
:func:`tiercheck.upkeep.copying.migrate_shard`. A migration that fails is retried with
exponential backoff (1 s doubling to 60 s, with jitter): without end while the tier is
unreachable (:class:`~tiercheck.errors.TierUnavailable`), at most
:data:`MAX_ATTEMPTS` times for any other tier error. A retry's backoff is no sleep: the
thread waits on its queue until the next migration is due or a new one arrives. (Writing to
a shared tier that another process is sweeping, it does poll until the sweep ends, see
:meth:`~tiercheck.store.leases.TierLeases.acquire_write`.)

The outcome of each migration is delivered on the handle of the save it belongs to (its
tier's state, and what ``wait_migrated()`` raises), never elsewhere. A version is pinned
(retention keeps it, and its base, in the tiers it is read from) until its migrations
settle. An exception that is not a tiercheck error fails that migration, is logged, and is
reported by ``close()``; the thread goes on. A target that refuses the version for its
memory budget (:class:`~tiercheck.errors.OverBudget`) is *skipped* for it, not retried.
``stop`` drains or abandons the queue and returns what was left unfinished; once
``close()`` halts the store (:class:`~tiercheck.runtime.background.Halt`), the migration running
starts no further tier call and settles as abandoned, and :meth:`MigrationService.join`
waits for the thread to end.

In a multi-rank job each rank migrates its own shard; to a tier the ranks share, each
writes only the chunks it owns, and rank 0 records the commit once every rank's
``prepare`` record is there (it polls the tier's log with backoff, up to
``commit_timeout``). Rank 0 keeps its own ids of the version protected, sweeps nothing in
the shared tier itself (it never sees the other ranks' ids), and holds a write lease
there, from the save until then.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from tiercheck.errors import (
    DurabilityError,
    Halted,
    NotFound,
    OverBudget,
    TiercheckError,
    TierUnavailable,
)
from tiercheck.formats.manifest import CommitRecord, VersionInfo
from tiercheck.runtime.background import Halt, reporting
from tiercheck.runtime.handles import Failures, SaveHandle, TierState
from tiercheck.store import guarantees
from tiercheck.store.budgets import Shortfall, budget_of
from tiercheck.store.catalog import Catalog, LiveCatalog, append_record, read_tier_log
from tiercheck.store.fetch import ChunkFetcher
from tiercheck.store.leases import GCFence, Reservation, TierLeases
from tiercheck.store.policy import Policy
from tiercheck.store.tierset import TierSet, TierSlot
from tiercheck.upkeep.copying import migrate_shard
from tiercheck.upkeep.maintenance import Maintenance

__all__ = ["MAX_ATTEMPTS", "MigrationService", "Reservation"]

log = logging.getLogger(__name__)

RETRY_FIRST = 1.0
RETRY_MAX = 60.0
MAX_ATTEMPTS = 3  # for tier errors other than TierUnavailable
_POLL_FIRST = 0.02  # rank 0 waiting for the other ranks' prepare records
_POLL_MAX = 2.0


class _NotYet(Exception):
    """Rank 0 prepared its shard in a shared tier; other ranks have not yet."""


@dataclass(eq=False)
class _Job:
    info: VersionInfo
    slot: TierSlot
    handle: SaveHandle | None
    owned: frozenset[str] | None
    reservation: Reservation
    attempts: int = 0
    error: str = ""
    prepared: bool = False
    waiting_since: float | None = None
    poll: float = _POLL_FIRST
    #: the ids an attempt protected and may have written to ``slot`` (discarded if it fails)
    written: tuple[str, ...] = ()
    #: how it ended is decided: no longer pending, no longer pins its version
    settled: bool = False


class MigrationService:
    """Migrations of one store (see the module docstring)."""

    def __init__(
        self,
        *,
        tierset: TierSet,
        policy: Policy,
        catalog: LiveCatalog,
        fence: GCFence,
        leases: TierLeases,
        pool: Executor,
        writes: Executor,
        maintenance: Maintenance,
        failures: Failures,
        rank: int = 0,
        world_size: int = 1,
        commit_timeout: float = 300.0,
        broken: Callable[[], str | None] = lambda: None,
        halt: Halt | None = None,
    ) -> None:
        self.tierset = tierset
        self.policy = policy
        self.catalog = catalog
        self.fence = fence
        self.leases = leases
        self.pool = pool
        self.writes = writes
        self.maintenance = maintenance
        self.failures = failures
        self.rank = rank
        self.world_size = world_size
        self.commit_timeout = commit_timeout
        self.broken = broken  # why the ranks can no longer agree, once they cannot
        self.halt = halt or Halt()
        self._cond = threading.Condition()
        self._queue: list[tuple[float, int, _Job]] = []  # (due, order, job), a heap
        self._order = itertools.count()
        self._running: _Job | None = None
        self._closing = False  # stop() is finishing the queue: no waiting on unreachable tiers
        self._halted = False  # stop() gave up: settle what is left as abandoned
        self._abandoned: list[tuple[int, str, str]] = []
        # tier -> (step, time) of the newest version it holds or was sent (cadence)
        self._sent: dict[str, tuple[int, float]] = {}
        self._rng = random.Random()
        # tiers that could not be opened with the store: when to try them again, how often
        # it failed, and whether a try is running (_reopen_in_background)
        self._reopen_at = time.monotonic() + RETRY_FIRST
        self._reopen_tries = 0
        self._reopening = False
        self._reopen_lock = threading.Lock()  # one reopen_unopened at a time
        self._thread = threading.Thread(
            target=reporting(failures, "the migration thread stopped", self._loop),
            name="tiercheck-migrate",
            daemon=True,
        )
        self._thread.start()

    # --- called by the save pipeline ---------------------------------------------------

    def targets(self, info: VersionInfo) -> tuple[list[TierSlot], dict[str, str]]:
        """The asynchronous tiers that want ``info`` and are due for it, and the tiers
        that want it but whose cadence (``TierPolicy.every``) is not due yet, with why.

        A tier is due when it has no version yet, or ``info`` is ``every`` after the newest
        version it holds or was sent (by step or by the versions' time, so that every rank
        decides alike); called once per version, in commit order."""
        self._reopen_in_background()
        due: list[TierSlot] = []
        later: dict[str, str] = {}
        for s in self.tierset.open():
            if s.policy is None or s.policy.mode != "async" or not s.policy.wants(info.role):
                continue
            if info.base is not None and not self._takes_base(s.name, info.base):
                later[s.name] = (
                    f"its base, version {info.base}, is not in this tier (it could not be "
                    "reached then): the tier takes the next base"
                )
                continue
            cadence = s.policy.cadence
            if cadence is not None:
                with self._cond:
                    last = self._sent.get(s.name) or self._newest_held(s.name)
                    if last is not None and not cadence.due(info.step, info.time, *last):
                        later[s.name] = (
                            f"not due: the tier receives a version every {cadence.describe()} "
                            f"(every={s.policy.every!r}), the last from step {last[0]}"
                        )
                        continue
                    self._sent[s.name] = (info.step, info.time)
            due.append(s)
        return due, later

    def unopened_shortfall(
        self, info: VersionInfo, handle: SaveHandle, targets: Sequence[TierSlot]
    ) -> DurabilityError | None:
        """What ``wait_migrated()`` raises for ``info``, sent to no tier (``targets`` empty)
        while a tier is not open: a required asynchronous one that could not be opened
        fails it (no migration settles the handle, to say so)."""
        if targets or all(s.tier is not None for s in self.tierset.slots):
            return None
        return self._migrated_shortfall(info, handle)

    def _migrated_shortfall(self, info: VersionInfo, handle: SaveHandle) -> DurabilityError | None:
        """What ``wait_migrated()`` raises for ``info``, by its handle's tier states."""
        rank = self.rank if self.world_size > 1 else None
        slots = self.tierset.slots
        return guarantees.judge("migrated", info, handle.result_now(), slots, self.policy, rank)

    def _takes_base(self, tier: str, base: int) -> bool:
        """Whether ``tier`` holds version ``base`` or is being sent it: a version that
        follows a base is restored from a tier only with its base there."""
        tl = self.catalog.snapshot().logs.get(tier)
        if tl is not None and tl.holds(base):
            return True
        with self._cond:
            return any(j.info.id == base and j.slot.name == tier for j in self._jobs())

    def _unopened(self) -> list[TierSlot]:
        """The tiers that could not be reached when the store was opened (one process:
        the ranks of a job would not agree on a tier one of them opened alone)."""
        if self.world_size > 1:
            return []
        return [s for s in self.tierset.slots if s.tier is None and s.unreachable]

    def reopen_unopened(self) -> list[str]:
        """Open the tiers that could not be reached when the store was opened
        (:meth:`TierSet.reopen`), each with its log read into the catalog first; they take
        the versions committed from now on (an asynchronous one, the next version due).
        Returns the names of those opened now."""
        with self._reopen_lock:
            opened = [name for slot in self._unopened() if (name := self._reopen(slot))]
        if opened:
            self.maintenance.request(opened)
        return opened

    def _reopen(self, slot: TierSlot) -> str | None:
        """:meth:`reopen_unopened` of one tier: its name if it is open now."""
        if self.halt.is_set():
            return None
        mark = self.catalog.begin_read()
        if not self.tierset.reopen(slot):
            self.catalog.end_read(mark)
            return None
        assert slot.tier is not None
        try:
            found = Catalog({slot.name: read_tier_log(slot.name, slot.tier)}, {})
        except TiercheckError as exc:  # open, but what it holds is not known: as at an open
            log.warning("tier %s was opened again; its log could not be read: %s", slot.name, exc)
            found = Catalog({}, {slot.name: str(exc)})
        self.catalog.install(found, mark, partial=True)
        log.warning(
            "tier %s, which could not be reached when the store was opened, is open now: "
            "it takes the versions committed from now on",
            slot.name,
        )
        return slot.name

    def _reopen_in_background(self) -> None:
        """Try the tiers that could not be opened again, on a thread of its own, once
        their backoff is due (it grows as migrations' does, 1 s doubling to 60 s)."""
        with self._cond:
            if self._reopening or self._halted or time.monotonic() < self._reopen_at:
                return
            if not self._unopened():
                return
            self._reopening = True

        def attempt() -> None:
            try:
                self.reopen_unopened()
            finally:
                with self._cond:
                    self._reopening = False
                    self._reopen_tries += 1
                    self._reopen_at = time.monotonic() + self._backoff(self._reopen_tries)

        threading.Thread(
            target=reporting(self.failures, "opening a tier again", attempt),
            name="tiercheck-reopen",
            daemon=True,
        ).start()

    def _newest_held(self, tier: str) -> tuple[int, float] | None:
        """``(step, time)`` of the newest version ``tier`` holds, as the catalog knows it."""
        tl = self.catalog.snapshot().logs.get(tier)
        newest = tl.newest_held() if tl is not None else None
        return (newest.step, newest.time) if newest is not None else None

    def reserve(
        self, info: VersionInfo, targets: Sequence[TierSlot], ids: Sequence[str]
    ) -> Reservation:
        """On rank 0 of a multi-rank job, before the other ranks can start migrating
        ``info``: protect ``ids`` (this rank's), hold every blob of each shared target from
        this process's sweeps, and a write lease in each, until the migration settles.
        Elsewhere an empty reservation."""
        shared = [s for s in targets if s.tier is not None and s.tier.capabilities.shared]
        if self.rank != 0 or self.world_size == 1 or not shared:
            return Reservation()
        out = Reservation(
            protected=self.fence.protect(ids), held=self.fence.hold(s.name for s in shared)
        )
        for slot in shared:
            assert slot.tier is not None
            try:
                self.leases.acquire_write(slot.tier, wait=False)
                out.leased.append(slot)
            except TiercheckError as exc:  # the migration takes one when it runs
                log.debug("no early write lease in %s: %s", slot.name, exc)
        return out

    def release(self, reservation: Reservation) -> None:
        self.fence.release(reservation.protected)
        self.fence.release_in(reservation.held)
        reservation.protected, reservation.held = [], []
        for slot in reservation.leased:
            assert slot.tier is not None
            self.leases.release_write(slot.tier)
        reservation.leased = []

    def submit(
        self,
        info: VersionInfo,
        handle: SaveHandle | None,
        targets: Sequence[TierSlot],
        *,
        owned: frozenset[str] | None = None,
        reservation: Reservation | None = None,
    ) -> None:
        """Queue the migration of ``info`` to each of ``targets``. The handle must already
        show them as ``migrating``; the reservation is released when the last settles."""
        reservation = reservation or Reservation()
        if not targets:
            self.release(reservation)
            return
        jobs = [_Job(info, s, handle, owned, reservation) for s in targets]
        with self._cond:
            halted = self._halted
            if not halted:
                for job in jobs:
                    heapq.heappush(self._queue, (time.monotonic(), next(self._order), job))
                self._cond.notify_all()
        if halted:  # a save committed after close() gave up on it: its handle must settle
            for job in jobs:
                self._abandon(job, "not started before close")

    # --- queries ------------------------------------------------------------------------

    def _jobs(self) -> list[_Job]:
        jobs = [j for _, _, j in self._queue]
        if self._running is not None:
            jobs.append(self._running)
        return jobs

    def pinned(self) -> set[int]:
        """Versions retention must keep (and their bases): they are being migrated."""
        with self._cond:
            jobs = [j for j in self._jobs() if not j.settled]
        out = {j.info.id for j in jobs}
        out |= {j.info.base for j in jobs if j.info.base is not None}
        return out

    def pending(self) -> list[tuple[int, str, str]]:
        """``(version, tier, last error)`` of every migration not settled yet."""
        with self._cond:
            return [(j.info.id, j.slot.name, j.error) for j in self._jobs() if not j.settled]

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no migration is pending (or ``timeout``); True if none is."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._running is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def retry_now(self) -> int:
        """Make every migration waiting out a backoff due now, and (unless the store is
        closing) try now, on this thread, the tiers that could not be opened with the
        store; returns how many migrations were waiting."""
        with self._cond:
            closing = self._closing or self._halted
        if not closing:
            self.reopen_unopened()
        now = time.monotonic()
        with self._cond:
            waiting = sum(1 for _, _, j in self._queue if j.attempts)
            self._queue = [(now, order, j) for _, order, j in self._queue]
            heapq.heapify(self._queue)
            self._cond.notify_all()
        return waiting

    # --- shutting down -------------------------------------------------------------------

    def stop(
        self, *, timeout: float | None = None, abandon: bool = False
    ) -> list[tuple[int, str, str]]:
        """Finish the queue unless ``abandon``, for at most ``timeout`` seconds, then take
        no more work. Finishing tries each pending migration once more at once; one whose
        tier is still unreachable is not waited for, and other failures get their usual
        retries. Returns ``(version, tier, why)`` of each migration left unfinished, but
        for the one still running (:meth:`running`); their handles settle as failed. The
        thread may still be in that migration: :meth:`join` waits for it."""
        if not abandon:
            with self._cond:
                self._closing = True
            self.retry_now()
            self.wait(timeout)
        for job in self._halt():
            self._abandon(job, job.error or "not started before close")
        with self._cond:
            return list(self._abandoned)

    def running(self) -> tuple[int, str] | None:
        """``(version, tier)`` of the migration the thread is in, if it is in one."""
        with self._cond:
            job = self._running
        return None if job is None else (job.info.id, job.slot.name)

    def join(self) -> None:
        """Block until the migration thread has ended (after :meth:`stop`)."""
        self._halt()
        self._thread.join()

    def _abandon(self, job: _Job, why: str) -> None:
        with self._cond:
            self._abandoned.append((job.info.id, job.slot.name, why))
        self._settle(job, "failed", f"abandoned at close: {why}")

    def _halt(self) -> list[_Job]:
        """Stop taking work: the thread ends; returns the jobs still queued (now removed)."""
        with self._cond:
            self._halted = True
            left = [j for _, _, j in self._queue]
            self._queue = []
            self._cond.notify_all()
        return left

    # --- the migration thread ----------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while True:
                        if self._halted:
                            return
                        now = time.monotonic()
                        if self._queue and self._queue[0][0] <= now:
                            break
                        self._cond.wait(self._queue[0][0] - now if self._queue else None)
                    _, _, job = heapq.heappop(self._queue)
                    self._running = job
                try:
                    self._attempt(job)
                finally:
                    with self._cond:
                        self._running = None
                        self._cond.notify_all()
        except BaseException as exc:  # never silent: fail what is queued (reporting logs it)
            for job in self._halt():
                self._settle(job, "failed", f"the migration thread stopped: {exc!r}")
            raise

    def _attempt(self, job: _Job) -> None:
        name, vid = job.slot.name, job.info.id
        try:
            self._migrate(job)
        except Halted as exc:  # close() halted the store: no tier call after it
            self._abandon(job, str(exc))
        except _NotYet as exc:
            assert job.waiting_since is not None
            if self.broken() is not None:  # a rank died: its prepare will never come
                self._fail(job, f"{exc}, and the ranks can no longer agree ({self.broken()})")
            elif time.monotonic() - job.waiting_since > self.commit_timeout:
                self._fail(job, f"{exc} after {self.commit_timeout:.0f} s")
            else:
                job.error = str(exc)
                self._later(job, job.poll)
                job.poll = min(job.poll * 2, _POLL_MAX)
        except OverBudget as exc:  # a memory tier without room: skipped, not failed
            went = self.catalog.snapshot().holders(vid)
            msg = Shortfall.refused(name, exc).warn(vid, job.info.step, went)
            self._settle(job, "missing", f"{type(exc).__name__}: {msg}")
        except TierUnavailable as exc:
            job.attempts += 1
            job.error = f"{type(exc).__name__}: {exc}"
            if self._closing:  # closing: report it rather than wait for the tier
                self._abandon(job, job.error)
                return
            delay = self._backoff(job.attempts)
            log.warning("migration of version %d to %s postponed %.0f s: %s", vid, name, delay, exc)
            if job.handle is not None:
                job.handle._set_tier(name, "migrating", job.error)
            self._later(job, delay)
        except TiercheckError as exc:
            job.attempts += 1
            job.error = f"{type(exc).__name__}: {exc}"
            if job.attempts >= MAX_ATTEMPTS:
                self._fail(job, job.error)
            else:
                delay = self._backoff(job.attempts)
                log.warning(
                    "migration of version %d to %s failed, retried in %.0f s: %s",
                    vid,
                    name,
                    delay,
                    exc,
                )
                self._later(job, delay)
        except Exception as exc:
            if self.halt.is_set():  # close() cancelled the reads it queued
                self._abandon(job, f"stopped by close: {type(exc).__name__}: {exc}")
                return
            # a bug, not a tier: fail this migration, keep the thread
            log.exception("migration of version %d to %s failed unexpectedly", vid, name)
            self.failures.background(f"migration of version {vid} to {name}: {exc!r}", exc)
            self._fail(job, f"{type(exc).__name__}: {exc}")
        else:
            self._settle(job, "committed", None)

    def _backoff(self, attempts: int) -> float:
        delay = min(RETRY_FIRST * 2.0 ** (attempts - 1), RETRY_MAX)
        jitter: float = self._rng.uniform(0.9, 1.1)  # ranks retrying together spread out
        return delay * jitter

    def _later(self, job: _Job, delay: float) -> None:
        with self._cond:
            if self._halted:
                halted = True
            else:
                halted = False
                heapq.heappush(self._queue, (time.monotonic() + delay, next(self._order), job))
                self._cond.notify_all()
        if halted:
            self._abandon(job, job.error)

    def _fail(self, job: _Job, error: str) -> None:
        """Give up on ``job``: what it wrote to its tier is deleted unless something else
        references or protects it (a full disk is not kept full by a copy never committed)."""
        log.error("migration of version %d to %s failed: %s", job.info.id, job.slot.name, error)
        self._settle(job, "failed", error, discard=True)

    def _settle(
        self, job: _Job, state: TierState, error: str | None, *, discard: bool = False
    ) -> None:
        """The migration of ``job`` ended: release what it held, ask for maintenance of the
        tiers (the version is no longer pinned) and, if ``discard``, for the deletion of
        what it wrote, then tell its handle. In that order: a caller that saw the handle
        settle and then flushes the store finds that work done, and the job is neither
        pending nor pinning its version once the handle says it ended."""
        with self._cond:
            job.settled = True
            last_of_version = not any(
                j.reservation is job.reservation for j in self._jobs() if j is not job
            )
        if last_of_version:
            self.release(job.reservation)
        with self._cond:  # one that never arrived: the cadence counts from what the tier holds
            if state != "committed" and self._sent.get(job.slot.name) == (
                job.info.step,
                job.info.time,
            ):
                del self._sent[job.slot.name]
        if not self._halted:
            self.maintenance.request(s.name for s in self.tierset.slots)
        if discard:
            self.maintenance.discard([job.slot.name], job.written)
        handle = job.handle
        if handle is not None and handle._migration_settled(job.slot.name, state, error):
            handle._settle_migrated(self._migrated_shortfall(job.info, handle))

    def _exempt(self, catalog: Catalog, versions: list[int]) -> set[str]:
        """The tiers with a memory budget whose copies of ``versions`` a migration need not
        protect: a tier without a budget holds each of them too."""
        budgeted = {s.name for s in self.tierset.slots if budget_of(s.tier) is not None}
        if not budgeted:
            return set()
        for v in versions:
            if not any(n not in budgeted for n in catalog.holders(v)):
                return set()
        return budgeted

    def _migrate(self, job: _Job) -> None:
        """One attempt at ``job``; raises to be retried, returns when it is done."""
        info, slot, rank = job.info, job.slot, self.rank
        what = f"the migration of version {info.id} to {slot.name}"
        self.halt.check(what)
        tier = slot.tier
        if tier is None:
            raise TierUnavailable(f"tier {slot.name} could not be opened: {slot.error}")
        shared = tier.capabilities.shared
        cross_rank = shared and self.world_size > 1
        if not job.prepared:
            catalog = self.catalog.snapshot()
            base = catalog.versions.get(info.base) if info.base is not None else None
            # a tier with a memory budget may free the version while it is migrated when a
            # tier without one holds it too: its ids are not protected there, and it is
            # read last (a copy it freed would read as missing or, reused, as corrupt)
            exempt = self._exempt(catalog, [info.id, *([base.id] if base is not None else [])])
            holders = [self.tierset.get(n) for n in catalog.holders(info.id) if n != slot.name]
            sources = sorted(
                [s for s in holders if s.tier is not None],
                key=lambda s: (s.name in exempt, s.speed_rank),
            )
            sources += [s for s in self.tierset.by_speed() if s not in sources and s is not slot]
            fetcher = ChunkFetcher(sources, repair=True, zstd_level=self.policy.zstd_level)
            base_mid = base.shards[rank] if base is not None else None
            mid = info.shards[rank]
            ids = [mid, *(c.id for c in fetcher.manifest(mid, order=sources).chunks)]
            if base_mid is not None:
                ids += [base_mid, *(c.id for c in fetcher.manifest(base_mid, order=sources).chunks)]
            job.written = tuple(ids)
            # before the target is asked what it has
            protected = self.fence.protect_in(
                [s.name for s in self.tierset.slots if s.name not in exempt], ids
            )
            try:
                self.halt.check(what)
                if shared:
                    self.leases.acquire_write(tier)
                try:
                    migrate_shard(
                        info,
                        rank,
                        slot,
                        sources,
                        fetcher,
                        self.pool,
                        writes=self.writes,
                        zstd_level=self.policy.zstd_level,
                        base_manifest_id=base_mid,
                        commit=False,
                        only=set(job.owned) if cross_rank and job.owned is not None else None,
                        halt=self.halt,
                    )
                    if not cross_rank:
                        if shared and not self.leases.write_valid(tier):
                            raise TierUnavailable(
                                "the write lease lapsed while migrating; trying again",
                                url=tier.url,
                            )
                        self.halt.check(f"the commit of version {info.id} in {slot.name}")
                        append_record(tier, CommitRecord(info))
                        self.catalog.committed(slot.name, info)
                finally:
                    if shared:
                        self.leases.release_write(tier)
            finally:
                self.fence.release_in(protected)
            job.prepared = True
        if cross_rank and rank == 0:
            self.halt.check(what)
            tl = read_tier_log(slot.name, tier)
            missing = set(range(self.world_size)) - set(tl.prepared.get(info.id, {}))
            if missing:
                if job.waiting_since is None:
                    job.waiting_since = time.monotonic()
                raise _NotYet(f"ranks {sorted(missing)} have not migrated their shard yet")
            self._commit_shared(job)
        elif cross_rank:
            self.catalog.committed(slot.name, info)  # rank 0 records it

    def _commit_shared(self, job: _Job) -> None:
        """Rank 0: record the commit in a shared tier where every rank prepared. The write
        lease held since the save covers every rank's blobs; without it (the tier was down
        then), check under a fresh lease that every blob is still there first."""
        slot, info = job.slot, job.info
        tier = slot.tier
        assert tier is not None
        if slot in job.reservation.leased and self.leases.write_valid(tier):
            append_record(tier, CommitRecord(info))
        else:
            with self.leases.writing(tier):
                fetcher = ChunkFetcher([slot], repair=False)
                ids: set[str] = set(info.shards)
                for mid in info.shards:
                    ids.update(c.id for c in fetcher.manifest(mid).chunks)
                gone = ids - tier.has(list(ids))
                if gone:
                    raise NotFound(
                        f"{len(gone)} blobs of version {info.id} vanished from the shared tier "
                        "before its commit; the version stays where it was committed",
                        url=tier.url,
                    )
                append_record(tier, CommitRecord(info))
        self.catalog.committed(slot.name, info)
