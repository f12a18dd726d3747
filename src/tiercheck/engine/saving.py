"""The save service: from ``save()`` to the commit, one version at a time.

:meth:`SaveService.submit` runs on the caller's thread: it validates and flattens the
state (bad input fails there, before anything is written), decides the version's id and
role (a base still being written already counts), and queues the save. One pipeline
thread then runs each save in order:

1. **stage** the state into the staging buffer (the caller may change it afterwards);
2. **hash** the staged stream and build the shard manifest; each window hashed goes at once
   to this rank's own synchronous tiers (:class:`ShardStream`: step 4 begins here);
3. **exchange** chunk ids with the other ranks (:mod:`tiercheck.engine.coordinator`; a local failure
   is sent instead, so every rank aborts the version at once);
4. **place** the shard in every synchronous tier in parallel (:func:`place_shard`), after
   making room in each tier with a memory budget, or skipping the tier for this version
   when it cannot fit (:mod:`tiercheck.store.budgets`);
5. **vote** once one tier holds it, then record the decision in each tier as it finishes;
6. **confirm** across ranks (commits in shared tiers, guarantees for every rank);
7. judge the store's guarantees (:mod:`tiercheck.store.guarantees`), deliver the outcome on the
   save's handle, queue the migrations and request maintenance of the tiers written.

The service owns the version planner (ids, roles, the base each diff follows), the
in-flight saves and the base chunks diffs are encoded against; it borrows the staging
buffer and the I/O pool. The staging buffer is held (``StagingBuffer`` acquire/release) from
staging until every tier write that reads it has ended, tier calls included, or, once the
fastest tier holds the shard, until the next save, a restore or ``prepare`` asks for it
(:mod:`tiercheck.engine.handover`): the slower tiers then read that tier's copy. The
service's own lock guards the planner and the in-flight list and is never held while a tier
is called. Each save's outcome travels in
return values to its handle, nowhere else.

Once ``close()`` halts the store (:class:`~tiercheck.runtime.background.Halt`), the saves queued
are cancelled (their handles fail with :class:`~tiercheck.errors.Halted`), and the save
running starts no new placement or commit.

Log versions (issue 11): while an optimizer is guarded with its update log
(:mod:`tiercheck.logversions.planner`), every save is planned on the pipeline thread instead, in
order, while the guard holds the trainer: :meth:`SaveService._decide` makes it a log
version of the steps since the last full version or a full one (base or diff), and the
steps after it do not depend on the role.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import (
    FIRST_COMPLETED,
    Executor,
    Future,
    ThreadPoolExecutor,
    as_completed,
    wait,
)
from typing import Any

from tiercheck.backends.base import STAGED_HEADER as HEADER
from tiercheck.engine.coordinator import Coordinator, Vote
from tiercheck.engine.handover import hand_over, skip_busy
from tiercheck.engine.placing import (
    PlaceResult,
    Shard,
    ShardStream,
    build_manifest,
    commit_on,
    encodes_deltas,
    fallback_slot,
    keeps_bases_on_disk,
    note_placed,
    place_shard,
    streamable,
    sync_slots,
)
from tiercheck.engine.ports import Migrations, Upkeep
from tiercheck.engine.staging import Hold, ShardBytes, StagingBuffer
from tiercheck.engine.submitting import Job as _Job
from tiercheck.engine.submitting import SaveQueue, Superseded
from tiercheck.errors import (
    CheckpointError,
    CommitAborted,
    DurabilityError,
    Halted,
    OverBudget,
    TiercheckError,
)
from tiercheck.formats.codecs import BLOB_HEADER_SIZE
from tiercheck.formats.manifest import AbortRecord, ChunkRef, VersionInfo
from tiercheck.logversions.planner import LogSource, with_fingerprints
from tiercheck.runtime.background import Halt, reporting
from tiercheck.runtime.executors import Priority
from tiercheck.runtime.handles import Failures, SaveHandle
from tiercheck.store import guarantees
from tiercheck.store.budgets import (
    Budgets,
    Chains,
    Shortfall,
    budget_of,
    bytes_needed,
    diff_leaves_no_room,
    version_bytes,
)
from tiercheck.store.catalog import LiveCatalog, append_record
from tiercheck.store.fetch import ChunkFetcher
from tiercheck.store.leases import GCFence, TierLeases
from tiercheck.store.policy import Policy
from tiercheck.store.tierset import TierSet, TierSlot

__all__ = ["SaveService"]

log = logging.getLogger(__name__)


class SaveService(SaveQueue):
    """The save pipeline of one store (see the module docstring)."""

    def __init__(
        self,
        *,
        tierset: TierSet,
        policy: Policy,
        coordinator: Coordinator,
        catalog: LiveCatalog,
        fence: GCFence,
        leases: TierLeases,
        staging: StagingBuffer,
        pool: Executor,
        hashing: Executor,
        migrations: Migrations,
        maintenance: Upkeep,
        failures: Failures,
        allow_pickle: bool,
        next_id: int,
        takes_diffs: bool,
        halt: Halt | None = None,
        confirmed: int | None = None,
        priority: Priority | None = None,
    ) -> None:
        self.tierset = tierset
        self.priority = priority or Priority()
        self.policy = policy
        self.coordinator = coordinator
        self.rank = coordinator.rank
        self.world_size = coordinator.world_size
        self.catalog = catalog
        self.fence = fence
        self.leases = leases
        self.staging = staging
        self.pool = pool
        self.hashing = hashing
        self.migrations = migrations
        self.maintenance = maintenance
        self.failures = failures
        self.allow_pickle = allow_pickle
        self.halt = halt or Halt()
        self._pipeline = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tiercheck-save", initializer=self.priority.lower
        )
        # the staging copies, in order, at the trainer's own priority (it waits for them):
        # a save stages as soon as the buffer is free, while the save before it still
        # writes its slower tiers from the fastest tier's copy (_hand_over)
        self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiercheck-stage")
        # the slower tiers of a save committed in its fastest tier, and its outcome
        self._tails = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tiercheck-tail", initializer=self.priority.lower
        )
        self._tail: Future[None] | None = None
        self._busy: set[str] = set()  # the tiers the tail is still writing
        self._busy_version: int | None = None  # the version it writes there
        self._tier_pool = ThreadPoolExecutor(
            max_workers=max(2, len(tierset.slots)),
            thread_name_prefix="tiercheck-tier",
            initializer=self.priority.lower,
        )
        self._outstanding = threading.Semaphore(2)  # the save running and the one queued
        self._hash_threads = policy.hash_threads or None
        self.budgets = Budgets(tierset)
        # the planner and the in-flight list: changed under _lock, which guards no I/O
        self._lock = threading.Lock()
        self._queued = threading.Condition(self._lock)
        self._inflight: list[_Job] = []
        self._next_id = next_id
        self._takes_diffs = takes_diffs
        # roles are decided when save() is called, not when a save commits: a base still
        # being written already counts, so two saves in a row never both become bases
        self._plan_base: tuple[int, tuple[Any, ...]] | None = None  # version, layout signature
        self._plan_since = 0  # diffs decided since that base
        # used on the pipeline thread only
        self._base_chunks: dict[int, tuple[ChunkRef, ...]] = {}  # the last committed base's
        self._rebased: dict[int, int] = {}  # failed base -> the diff that became the base
        self._chain = Chains()  # what a log version's chain keeps in a tier
        self.logs: LogSource | None = None  # the guarded optimizer's update log
        self._committed_full: set[int] = set()  # full versions committed by this process
        # the newest version every rank has committed (agreed at open, then each confirmed
        # here): kept in every tier that holds it (:meth:`pinned`), since this rank's own
        # logs may name a newer version another rank never committed (a job killed in its
        # commit), which the rule of retention.protection alone would keep instead
        self._confirmed = confirmed
        #: called with each committed version and its tiers before the save is acknowledged
        self.acknowledged: Callable[[VersionInfo, list[str]], None] | None = None

    def flush(self) -> None:
        """Block until every save submitted so far has finished."""
        self._pipeline.submit(lambda: None).result()
        self._tails.submit(lambda: None).result()

    def drain(self, timeout: float | None) -> bool:
        """Block until every save submitted so far has finished, or ``timeout`` passed;
        True if they finished."""
        end = None if timeout is None else time.monotonic() + timeout
        try:
            self._pipeline.submit(lambda: None).result(timeout)
            left = None if end is None else max(0.0, end - time.monotonic())
            self._tails.submit(lambda: None).result(left)
        except TimeoutError:
            return False
        return True

    def running(self) -> list[str]:
        """The saves not finished yet, by step and version."""
        with self._lock:
            return [f"the save of step {j.step} (version {j.version})" for j in self._inflight]

    def stop(self) -> None:
        """Take no more saves: those queued are cancelled and their handles fail (returns
        at once; see :meth:`join`)."""
        self._pipeline.shutdown(wait=False, cancel_futures=True)
        self._stager.shutdown(wait=False, cancel_futures=True)
        self._tails.shutdown(wait=False)  # a tail runs to its end (no commit after the halt)
        self._tier_pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            cancelled = [j for j in self._inflight if j.future is not None and j.future.cancelled()]
        for job in cancelled:
            why = f"the save of step {job.step} was not started: {self.halt.why}"
            job.handle._fail(Halted(why))
            self._finished(job)

    def join(self) -> None:
        """Block until the pipeline's threads have ended (after :meth:`stop`)."""
        self._pipeline.shutdown(wait=True)
        self._stager.shutdown(wait=True)
        self._tails.shutdown(wait=True)
        self._tier_pool.shutdown(wait=True)

    def close(self) -> None:
        self.stop()
        self.join()

    # --- the pipeline thread -------------------------------------------------------------

    def _run(self, job: _Job) -> None:
        self._conclude(job, self._attempt(job, lambda: self._save(job)))

    def _attempt(self, job: _Job, part: Callable[[], Callable[[], None] | None]) -> bool | None:
        """Run ``part`` of ``job``: True if it failed (its handle says why), None if the rest
        went to the tail thread (which concludes the job), else False."""
        try:
            tail = part()
        except Superseded as exc:  # latest wins: skipped, not failed
            log.info("%s", exc)
            job.handle._supersede(str(exc))
            return False
        except BaseException as exc:
            level = logging.WARNING if isinstance(exc, CommitAborted) else logging.ERROR
            log.log(level, "save of step %d (version %d) failed: %s", job.step, job.version, exc)
            job.handle._fail(exc)
            return True
        if tail is None:
            return False
        job.outstanding = False  # a tail does not hold back the next save() call
        self._outstanding.release()
        previous = self._tail
        if previous is not None:  # one tail at a time: a slower tier that lags holds the
            previous.exception()  # pipeline here, never the staging of the next save
        what = f"the save of step {job.step} (version {job.version})"

        def rest() -> Callable[[], None] | None:
            tail()
            return None

        def run_tail() -> None:
            self._conclude(job, self._attempt(job, rest))

        try:
            self._tail = self._tails.submit(reporting(self.failures, what, run_tail))
        except RuntimeError:  # stopped: end it here
            run_tail()
        return None

    def _conclude(self, job: _Job, failed: bool | None) -> None:
        """``job`` has ended (``failed`` None: its tail has not yet): release what it held,
        and have every tier that did not commit it give up what it wrote there."""
        if failed is None:
            return
        written = list(job.protected)
        self._finished(job)
        given_up = [
            name
            for name, state in job.handle.result_now().tiers.items()
            if state in ("failed", "missing") or (failed and state != "committed")
        ]
        self.maintenance.discard(given_up, written)

    def _finished(self, job: _Job) -> None:
        """``job`` ran, or was cancelled: release what it held."""
        self.fence.release(job.protected)
        self.fence.release_in(job.held)
        job.protected, job.held = [], []
        with self._lock:
            job.finished = True
            if job in self._inflight:
                self._inflight.remove(job)
            hold = job.hold
        if hold is not None:  # cancelled after it was staged ahead
            hold.release()
        if job.outstanding:
            job.outstanding = False
            self._outstanding.release()

    def _save(self, job: _Job) -> Callable[[], None] | None:
        """Run ``job``; returns the rest of it (its slower tiers, its outcome) when that is
        left to the tail thread."""
        handle = job.handle
        self.halt.check(f"the save of step {job.step}")
        with self._lock:
            if job.superseded is not None and job.hold is None:  # gave way before the buffer
                raise Superseded(job.superseded)
        ahead = job.staging
        staging_failed: BaseException | None = None
        if ahead is not None and not ahead.cancelled():
            try:
                ahead.result()  # staged ahead: its failure is this save's (and the exchange's)
            except Exception as exc:
                staging_failed = exc
            if job.superseded is not None:  # gave way mid-copy: the buffer goes, stopped
                raise Superseded(job.superseded)
            if job.hold is None:
                raise Halted(f"the save of step {job.step} was not staged: {self.halt.why}")
        else:
            job.staging = None
            if not self.staging.acquire():
                raise CheckpointError("the staging buffer is unavailable")
            job.hold = Hold(self.staging)
        hold = job.hold  # until the fastest tier holds the shard, or every tier write ended
        leased: list[TierSlot] = []
        shard: Shard | None = None
        handed = False  # to the tail thread, with the buffer if it is still offered
        try:
            failure = job.failure or staging_failed
            if job.deferred:
                try:
                    self._decide(job)
                except Exception as exc:
                    failure = failure or exc
            if failure is None:
                try:
                    shard = self._encode(job)
                except Exception as exc:  # the other ranks must hear of it (exchange)
                    failure = exc
            sizes: dict[str, int] = {}
            for ref in shard.chunks if shard is not None else ():
                sizes.setdefault(ref.id, ref.length)
            exchange = self.coordinator.exchange(
                job.version,
                list(sizes.items()) if shard is not None else None,
                f"{type(failure).__name__}: {failure}" if failure is not None else "",
            )
            if failure is not None:
                raise failure
            assert shard is not None and job.layout is not None
            if not exchange.ok:
                raise CommitAborted(f"version {job.version} aborted: {exchange.reason}")
            ids = [shard.manifest_id, *sizes]
            if encodes_deltas(self.tierset.slots, job.role):  # deltas are read against these
                ids += [c.id for c in shard.base_chunks or ()]
            job.protected += self.fence.protect(ids)  # before any tier is asked what it has
            if self.world_size > 1 and self.rank == 0:
                # rank 0 sweeps the shared tiers, and records the commit there after the
                # others let go of their write leases: until then their blobs (ids it never
                # sees) are named by no record, so it sweeps none of these tiers meanwhile
                job.held += self.fence.hold(s.name for s in self.tierset.slots if _shared(s))
            sync = self._lease(sync_slots(self.tierset.slots, job.role, handle), leased, handle)
            sync = self._lease(self._fit_budgets(job, shard, sync), leased, handle)  # fallback
            if self.world_size == 1:  # latest wins: a slower tier still busy skips this one
                sync, skips = skip_busy(sync, self._busy, job.version, job.step)
                for name, why in skips.items():
                    handle._set_tier(name, "missing", why)
                    job.skipped[name] = why
            fetcher = ChunkFetcher(self.tierset.by_speed(), repair=False)

            def base_lookup(cid: str) -> bytes:
                return bytes(fetcher.fetch(cid)[0])

            self.halt.check(f"placing the save of step {job.step}")
            futures = {
                self._tier_pool.submit(
                    place_shard,
                    slot,
                    pool=self.pool,
                    view=shard.view,
                    layout=job.layout,
                    manifest=shard.manifest,
                    manifest_bytes=shard.manifest_bytes,
                    manifest_id=shard.manifest_id,
                    step=job.step,
                    role=job.role,
                    base=job.base,
                    base_chunks=shard.base_chunks,
                    base_lookup=base_lookup,
                    zstd_level=self.policy.zstd_level,
                    only=set(exchange.owned)
                    if _shared(slot) and exchange.owned is not None
                    else None,
                    streamed=shard.stream.result(slot.name),
                    adopt=shard.adopter(slot),
                ): slot
                for slot in sync
            }
            over = hand_over(futures, shard.view, shard.chunks, hold)
            try:
                info, committed, shared_ready, rest = self._vote_and_commit(job, futures, shard)
                if (
                    rest is not None
                    and self.world_size == 1
                    and over is not None
                    and over.wait()  # the fastest tier holds the shard, or failed
                    and not hold.needed
                ):
                    # committed in the fastest tier, which holds the shard: the slower
                    # tiers finish on the tail thread, and the next save goes on meanwhile
                    if info.role == "base":  # the next diff follows it
                        self._base_chunks = {info.id: shard.chunks}
                    if info.role in ("base", "diff"):
                        self._committed_full.add(info.id)
                    self._chain.committed(info, shard.chunks)
                    with self._lock:  # one rank confirms its own commit (LocalCoordinator):
                        # the version before it is no longer pinned while the tail runs
                        self._confirmed = max(info.id, self._confirmed or -1)
                    owned, exchanged = exchange.owned, exchange.ids
                    mine, leased = leased, []  # the tail lets go of them
                    handed = True
                    self.maintenance.request(s.name for s in committed)  # room for the next
                    self._busy = {s.name for f, s in futures.items() if not f.done()}
                    self._busy_version = info.id

                    def tail() -> None:
                        try:
                            try:
                                rest()
                            finally:
                                for f in futures:
                                    f.exception()
                                shard.stream.close()
                                hold.release()
                                # written there: the next save places there, also one
                                # asked for as soon as wait() of this one returns (not a
                                # newer save's set)
                                if self._busy_version == info.id:
                                    self._busy = set()
                            self._after_commit(
                                job, info, shard, committed, shared_ready, owned, exchanged
                            )
                        finally:
                            self._release_writes(mine)

                    return tail
                if rest is not None:
                    rest()
            finally:
                if not handed:
                    for f in futures:  # tier writes read the staged stream: let them end
                        f.exception()
                    shard.stream.close()
                    hold.release()
            self._after_commit(
                job, info, shard, committed, shared_ready, exchange.owned, exchange.ids
            )
            self._chain.committed(info, shard.chunks)
        finally:
            if hold.held and not handed:  # a tail still reads it: it releases it, or the
                if shard is not None:  # next save that asks for it (Hold.offer)
                    shard.stream.close()
                hold.release()
            self._release_writes(leased)
        return None

    def _lease(
        self, slots: list[TierSlot], leased: list[TierSlot], handle: SaveHandle
    ) -> list[TierSlot]:
        """``slots`` less the shared ones whose write lease (added to ``leased``) failed."""
        out = []
        for slot in slots:
            if _shared(slot) and slot not in leased:
                assert slot.tier is not None
                try:
                    self.leases.acquire_write(slot.tier)
                except TiercheckError as exc:
                    handle._set_tier(slot.name, "failed", f"{type(exc).__name__}: {exc}")
                    continue
                leased.append(slot)
            out.append(slot)
        return out

    def _release_writes(self, leased: list[TierSlot]) -> None:
        for slot in leased:
            assert slot.tier is not None
            self.leases.release_write(slot.tier)

    def _encode(self, job: _Job) -> Shard:
        """Stage, hash and describe this rank's shard (steps 1 and 2), placing its blobs
        in this rank's own synchronous tiers as they are hashed (:class:`ShardStream`)."""
        handle, layout = job.handle, job.layout
        assert layout is not None
        base_chunks = self._resolve_base(job) if job.role == "diff" else None  # decides the role
        proposal = job.proposal
        if job.staging is None:  # not staged ahead: a log version, or the staging thread's
            try:
                if proposal is not None:
                    assert self.logs is not None
                    # the state now, before the guard lets the trainer step again
                    job.replay = with_fingerprints(job.replay, self.logs)
                event = self.staging.stage(
                    job.leaves, layout, ready=job.ready, shm=proposal is None
                )
                if event is not None:
                    event.synchronize()
            finally:
                if proposal is not None and self.logs is not None:
                    self.logs.release(proposal)  # the gradients are staged: the ring reuses them
            job.leaves, job.ready = [], {}  # drop references to the caller's tensors
            handle._time("staged", time.perf_counter() - job.t_call)
            handle._mark_staged()
        view = ShardBytes(self.staging.view(layout.stream_bytes))
        staged = self.staging.staged
        busy = self._busy if self.world_size == 1 else set()  # they skip it (latest wins)
        stream = ShardStream(
            streamable(self.tierset.slots, job.role, self.budgets.unsized(), busy),
            pool=self.pool,
            view=view,
            zstd_level=self.policy.zstd_level,
            protect=lambda ids: job.protected.extend(self.fence.protect(ids)),
            lower=self.priority.lower,
        )
        try:
            chunks = stream.hash(layout, self._hash_threads, self.hashing)
            handle._time("hashed", time.perf_counter() - job.t_call)
            manifest, mbytes, mid = build_manifest(
                version=job.version,
                rank=self.rank,
                world_size=self.world_size,
                layout=layout,
                chunks=chunks,
                tree=job.tree,
                log=job.replay,
            )
        except BaseException:
            stream.close()
            raise
        return Shard(view, chunks, manifest, mbytes, mid, base_chunks, stream, staged)

    def _resolve_base(self, job: _Job) -> tuple[ChunkRef, ...] | None:
        """The chunks of diff ``job``'s base, committed by now (saves run in order) unless
        it failed or gave way: then ``job`` becomes the base, and the later diffs decided
        against that one use it."""
        assert job.base is not None
        base = self._rebased.get(job.base, job.base)
        chunks = self._base_chunks.get(base)
        if chunks is not None:
            job.base = job.handle.base = base
            return chunks
        self._rebased[job.base] = job.version
        job.role, job.base = "base", None
        job.handle.role, job.handle.base = "base", None
        log.warning("version %d is a base: its base failed or gave way", job.version)
        return None

    def _fit_budgets(self, job: _Job, shard: Shard, sync: list[TierSlot]) -> list[TierSlot]:
        """The synchronous tiers that take ``job`` within their memory budgets.

        Sets the default budgets for this version's size, then makes room in each tier with
        a budget the version would overflow (:meth:`Upkeep.make_room`). A tier it still
        does not fit is skipped for this version: its state is ``"missing"`` with the
        reason, and a warning names the tier, the sizes and the fix. If that leaves the
        version no synchronous tier, the fastest other synchronous tier without a budget
        takes it, whatever versions it usually takes (a diff goes to LMDB, which keeps
        bases): the version is committed somewhere rather than not at all.
        """
        assert job.layout is not None
        handle = job.handle
        if job.role != "log":
            # the defaults are sized for a full version: a log version (a third of the
            # state, or less) must not shrink the budget the next base needs
            size = version_bytes(
                job.layout.stream_bytes,
                len(shard.chunks),
                len(shard.manifest_bytes),
                HEADER if shard.staged is not None else BLOB_HEADER_SIZE,
            )
            self.budgets.size_known(size)
        if job.role == "diff" and job.base is not None and self.world_size == 1:
            why = diff_leaves_no_room(
                sync, chunks=shard.chunks, base_chunks=shard.base_chunks or (), base=job.base,
                manifest_bytes=len(shard.manifest_bytes), version=size,
                catalog=self.catalog.snapshot(), tierset=self.tierset,
                writing=self._busy if self._busy_version == job.base else (),
            )  # fmt: skip
            if why is not None:  # a base instead; later diffs of the old base follow it
                log.info("version %d (step %d) is a base: %s", job.version, job.step, why)
                self._rebased = {k: job.version for k in (*self._rebased, job.base)}
                job.role, job.base = job.handle.role, job.handle.base = "base", None
                sync += [
                    s for s in self.tierset.slots
                    if s not in sync and s.tier is not None and not _shared(s)
                    and s.policy is not None and s.policy.mode == "sync" and s.policy.wants("base")
                ]  # fmt: skip
        kept: list[TierSlot] = []
        for slot in sync:
            assert slot.tier is not None
            if budget_of(slot.tier) is None:
                kept.append(slot)
                continue
            try:
                need = bytes_needed(
                    slot.tier,
                    shard.chunks,
                    shard.manifest_id,
                    len(shard.manifest_bytes),
                    HEADER if shard.adopter(slot) is not None else BLOB_HEADER_SIZE,
                )
                short = self.maintenance.make_room(slot, need)
                tail = self._tail
                if short is not None and tail is not None and not tail.done():
                    # what keeps the room may be a version a slower tier is still taking
                    # over (the base a log decided to follow): once there, it may go here
                    self.wait_or_superseded(job, tail)
                    short = self.maintenance.make_room(slot, need)
            except TiercheckError as exc:  # counting failed: the tier still refuses past it
                log.warning("could not make room in tier %s: %s", slot.name, exc)
                short = None
            if short is None:
                kept.append(slot)
                continue
            why = short.message(job.version, job.step)
            job.shortfalls[slot.name] = short
            handle._set_tier(slot.name, "missing", why)
            job.skipped[slot.name] = why
        if kept or not job.skipped:
            return kept
        other = fallback_slot(self.tierset.by_speed(), job.skipped, self.world_size)
        if other is None:
            return kept
        log.warning(
            "version %d (step %d) goes to tier %s instead: no tier that takes it has room",
            job.version,
            job.step,
            other.name,
        )
        return [other]

    def _vote_and_commit(
        self,
        job: _Job,
        futures: Mapping[Future[PlaceResult], TierSlot],
        shard: Shard,
    ) -> tuple[VersionInfo, list[TierSlot], list[TierSlot], Callable[[], None] | None]:
        """Vote once one tier holds the shard, then commit each tier prepared by then.

        A fast tier (shm) is thus committed, and reported, without waiting for a slow one
        (LMDB, a peer). Returns the version, the committed slots, the prepared shared
        slots, whose commit needs every rank's agreement first (step 6), and what commits
        the tiers still preparing as each finishes (None if none is).
        """
        handle = job.handle
        results: list[PlaceResult] = []
        pending = set(futures)
        while pending and not any(r.ok for r in results):
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            results += [f.result() for f in done]
        ok = [r for r in results if r.ok]
        vote = Vote(
            rank=self.rank,
            ok=bool(ok),
            manifest=shard.manifest_id,
            tiers=tuple(r.tier for r in ok),
            # every tier that failed and every tier that skipped it (with its fix)
            reason="; ".join(
                [*(f"{r.tier}: {r.error}" for r in results if not r.ok), *job.skipped.values()]
            )
            or ("no synchronous tier wants this version" if not futures else ""),
        )
        t_vote = time.perf_counter()
        decision = self.coordinator.decide(job.version, vote)
        handle._time("voting", time.perf_counter() - t_vote)
        if not decision.commit:
            results += [f.result() for f in pending]
            for r in results:
                note_placed(handle, r)
                if r.ok:
                    slot = self.tierset.get(r.tier)
                    assert slot.tier is not None
                    try:
                        append_record(slot.tier, AbortRecord(job.version, decision.reason))
                    except TiercheckError as exc:
                        log.warning("could not record abort in %s: %s", slot.name, exc)
            raise CommitAborted(f"version {job.version} aborted: {decision.reason}")
        assert job.layout is not None
        info = VersionInfo(
            id=job.version,
            step=job.step,
            role=job.role,
            base=job.base,
            world_size=self.world_size,
            shards=decision.shards,
            time=time.time(),
            logical_bytes=job.logical or job.layout.stream_bytes,
            metadata=job.metadata,
        )
        committed: list[TierSlot] = []
        shared_ready: list[TierSlot] = []

        def settle(r: PlaceResult) -> None:
            note_placed(handle, r)
            if not r.ok:
                if isinstance(r.exception, OverBudget):  # a write the tier refused: a skip
                    job.shortfalls[r.tier] = Shortfall.refused(r.tier, r.exception)
                return
            slot = self.tierset.get(r.tier)
            if _shared(slot) and self.world_size > 1:
                shared_ready.append(slot)
                return
            if self._commit(slot, info, handle, job.t_call):
                committed.append(slot)

        for r in results:
            settle(r)

        def rest() -> None:  # the slower tiers, as each is prepared
            for f in as_completed(pending):
                settle(f.result())

        return info, committed, shared_ready, rest if pending else None

    def _commit(self, slot: TierSlot, info: VersionInfo, handle: SaveHandle, t0: float) -> bool:
        """Append the commit record of ``info`` to ``slot``; report it on ``handle``."""
        assert slot.tier is not None
        if self.halt.is_set():  # close() gave up waiting: no commit record after it
            error: str | None = f"not committed: {self.halt.why}"
        elif _shared(slot) and not self.leases.write_valid(slot.tier):
            error = "the write lease lapsed while preparing; not committed here"
        else:
            error = commit_on(slot, info)
        if error is not None:
            handle._set_tier(slot.name, "failed", error)
            return False
        self.catalog.committed(slot.name, info)
        handle._set_tier(slot.name, "committed")
        handle._time(f"committed:{slot.name}", time.perf_counter() - t0)
        return True

    def _after_commit(
        self,
        job: _Job,
        info: VersionInfo,
        shard: Shard,
        committed: list[TierSlot],
        shared_ready: list[TierSlot],
        owned: frozenset[str] | None,
        exchanged: frozenset[str],
    ) -> None:
        """Steps 6 and 7: confirm across ranks, judge the guarantees, deliver the outcome,
        queue the migrations and request maintenance."""
        handle = job.handle
        targets, later = self.migrations.targets(info)
        done = {s.name for s in committed}  # a fallback committed it there already
        targets = [s for s in targets if s.name not in done]
        for name in later.keys() - done:  # their cadence is not due: the faster tiers keep it
            handle._set_tier(name, "missing", later[name])
        reservation = self.migrations.reserve(info, targets, [*exchanged, *info.shards])
        try:
            # every tier by name (the same names on every rank, whichever opened): the
            # version is committed in a shared tier where every rank prepared it
            ready = {s.name for s in shared_ready}
            confirmation = self.coordinator.confirm(
                job.version, {s.name: s.name in ready for s in self.tierset.slots}
            )
            for slot in shared_ready:
                if slot.name not in confirmation.shared_tiers:
                    why = confirmation.reason or "not every rank prepared in this tier"
                    handle._set_tier(slot.name, "failed", why)
                elif self.rank == 0:  # one rank records the commit in a tier all share
                    if self._commit(slot, info, handle, job.t_call):
                        committed.append(slot)
                else:
                    self.catalog.committed(slot.name, info)
                    handle._set_tier(slot.name, "committed")
                    committed.append(slot)
            error = self._judge(job, info, confirmation.ok, confirmation.reason, bool(committed))
            if not committed:
                raise CheckpointError(
                    f"version {job.version} could not be committed in any tier: "
                    f"{handle.result_now().errors}"
                )
        except BaseException:
            self.migrations.release(reservation)
            raise
        if confirmation.ok:
            with self._lock:
                self._confirmed = max(info.id, self._confirmed or -1)
        if info.role in ("base", "diff"):
            self._committed_full.add(info.id)
        elif info.role == "log" and job.proposal is not None and self.logs is not None:
            self.logs.stored(job.proposal)
        if info.role == "base" and all(k <= info.id for k in self._base_chunks):
            # a diff decided against an older base has run by now (saves run in order; a
            # tail may end after a newer base's save has set its own)
            self._base_chunks = {info.id: shard.chunks}
        seconds = time.perf_counter() - job.t_call
        handle._time("committed", seconds)
        went = [s.name for s in committed]
        for short in job.shortfalls.values():  # one warning each, saying where it went
            short.warn(info.id, info.step, went)
        log.info(
            "saved step %d as version %d (%s) in %s in %.3f s",
            info.step,
            info.id,
            info.role,
            ", ".join(went),
            seconds,
        )
        if self.acknowledged is not None:  # the ack ledger (tiercheck.restore.losses)
            self.acknowledged(info, [s.name for s in committed])
        unmigrated = self.migrations.unopened_shortfall(info, handle, targets)
        handle._finish(error, [s.name for s in targets], unmigrated)
        self.migrations.submit(info, handle, targets, owned=owned, reservation=reservation)
        self.maintenance.note_chunks(shard.manifest_id, shard.manifest.chunks)
        self.maintenance.request(s.name for s in committed)
        if info.role == "base":  # a disk tier drops its oldest base before it takes the next
            disk = [s.name for s in committed if keeps_bases_on_disk(s)]
            self.maintenance.flush(5.0, tiers=disk)  # at most 5 s: a lane held up is passed

    def _judge(
        self, job: _Job, info: VersionInfo, confirmed: bool, reason: str, anywhere: bool
    ) -> DurabilityError | None:
        """What ``wait()`` raises for this committed version: the guarantees, judged by each
        rank for its own tiers and settled across ranks, so that every rank raises when any
        rank falls short. ``anywhere``: this rank committed it in some tier."""
        states = job.handle.result_now()
        multi = self.world_size > 1
        rank = self.rank if multi else None
        mine = guarantees.judge("wait", info, states, self.tierset.slots, self.policy, rank)
        if not multi:
            return mine
        problem = str(mine) if mine is not None else ""
        if not anywhere:
            problem = (
                f"version {info.id} (step {info.step}) is committed in no tier of rank "
                f"{self.rank}: no rank can restore it"
            )
        errors = [problem] if problem else []
        if not confirmed:  # the coordinator is broken: nothing more can be settled
            errors.append(
                f"version {info.id} (step {info.step}) is committed on rank {self.rank}, but "
                f"the ranks could not confirm it everywhere ({reason})"
            )
        else:
            settled = self.coordinator.settle(info.id, problem)
            if settled and settled != f"rank {self.rank}: {problem}":
                errors.append(settled)
        if errors == [problem] and mine is not None:
            return mine
        if not errors:
            return None
        return DurabilityError(
            "; ".join(errors),
            version=info.id,
            step=info.step,
            committed=states.committed_tiers,
            failed=dict(mine.failed) if mine is not None else {},
        )


def _shared(slot: TierSlot) -> bool:
    return slot.tier is not None and slot.tier.capabilities.shared
