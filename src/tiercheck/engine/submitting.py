"""The caller's side of the save service: ``save()`` validates, flattens, plans and queues.

:class:`SaveQueue` is the half of :class:`~tiercheck.engine.saving.SaveService` that runs on
the caller's thread (and the planning the pipeline thread does in order for log versions):
a bad input fails here, before anything is written; the version's id and role are decided
here (a base still being written already counts); the job is queued for the pipeline
(:mod:`tiercheck.engine.saving`), which runs every save in order. A full version is
staged ahead of the pipeline, on the staging thread, as soon as the staging buffer is
free (the save before it hands the buffer back once its fastest tier holds it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgpack

from tiercheck.backends.base import STAGED_HEADER as HEADER
from tiercheck.backends.base import StagingArea
from tiercheck.core.chunking import Layout, choose_chunk_size, plan_layout
from tiercheck.core.entries import Leaf, as_dict, flatten, pack_exact
from tiercheck.engine.coordinator import Coordinator
from tiercheck.engine.placing import build_manifest
from tiercheck.engine.staging import Hold, StagingBuffer, copy_buffers, ready_events
from tiercheck.errors import TiercheckError, UnsupportedValue
from tiercheck.formats.codecs import BLOB_HEADER_SIZE
from tiercheck.formats.manifest import MAX_INT, ChunkRef, Role
from tiercheck.logversions.planner import LogProposal, LogSource, build
from tiercheck.runtime.background import Halt, reporting
from tiercheck.runtime.handles import Failures, SaveHandle
from tiercheck.store.budgets import Budgets, Chains, Shortfall, log_leaves_no_room, version_bytes
from tiercheck.store.catalog import LiveCatalog
from tiercheck.store.policy import Policy
from tiercheck.store.tierset import TierSet

__all__ = ["Job", "SaveQueue", "Superseded"]

log = logging.getLogger("tiercheck.engine.saving")


class Superseded(Exception):
    """A save given up, before any tier committed it, for a newer one (latest wins)."""


def _metadata(metadata: Any) -> dict[str, Any]:
    """``metadata`` as the dict a version's commit record holds, as plain msgpack: what
    that cannot hold is refused here, saying what it can."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(
            "metadata must be a mapping of str keys to plain values (e.g. "
            f"{{'epoch': 3, 'loss': loss.item()}}), got {type(metadata).__qualname__}"
        )
    meta = dict(metadata)
    try:  # each value as it is (no subclass read back as its base), in plain msgpack
        pack_exact(meta)
        msgpack.packb(meta, use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as exc:
        import torch

        tensors = [k for k, v in meta.items() if isinstance(v, torch.Tensor)]
        hint = (
            f"; metadata[{tensors[0]!r}] is a tensor: store its value (t.item() of a 0-d "
            "tensor such as a loss, t.tolist() of others)"
            if tensors
            else ""
        )
        raise UnsupportedValue(
            "metadata must be plain msgpack: str keys, and values that are None, "
            f"bool, float, str, bytes, lists, maps and ints of 64 bits at most ({exc}){hint}"
        ) from None
    return meta


@dataclass(eq=False)
class Job:
    """One save, from ``save()`` to its outcome (planned here, run by the pipeline)."""

    handle: SaveHandle
    step: int
    version: int
    role: Role
    base: int | None
    leaves: list[Leaf]
    layout: Layout | None
    tree: Any
    metadata: dict[str, Any]
    t_call: float
    failure: BaseException | None = None  # failed on the caller's thread; still takes part
    protected: list[str] = field(default_factory=list)
    held: list[tuple[str | None, str]] = field(default_factory=list)  # tiers kept from sweeps
    ready: dict[int, Any] = field(default_factory=dict)  # CUDA device -> torch.cuda.Event
    deferred: bool = False  # planned on the pipeline thread (an update log is attached)
    forced: Role | None = None  # the role save() was asked for
    logical: int = 0  # bytes of the state (a log version's stream is smaller)
    proposal: LogProposal | None = None  # a log version's steps
    replay: Any = None  # a log version's ReplayLog, fingerprints filled in at staging
    skipped: dict[str, str] = field(default_factory=dict)  # tier -> why (its memory budget)
    shortfalls: dict[str, Shortfall] = field(default_factory=dict)  # warned of once committed
    future: Future[None] | None = None  # its run on the pipeline thread
    staging: Future[None] | None = None  # staged ahead on the staging thread (SaveService)
    hold: Hold | None = None  # its use of the staging buffer, once it has it
    finished: bool = False  # ran or cancelled (under SaveQueue._lock)
    outstanding: bool = True  # counts in SaveQueue._outstanding (its tail does not)
    superseded: str | None = None  # gave way before it was staged (latest wins): why
    # the staging buffer was still an earlier save's when this one was asked for: under
    # guard it gives way unless its copy is done when the trainer goes on (give_way)
    late: bool = False
    copied: bool = False  # its staging copy is complete (under SaveQueue._lock)


class SaveQueue:
    """The caller's side of the save service (module docstring); the pipeline's side is
    :class:`~tiercheck.engine.saving.SaveService`, which sets every attribute below."""

    policy: Policy
    coordinator: Coordinator
    rank: int
    world_size: int
    failures: Failures
    allow_pickle: bool
    budgets: Budgets
    logs: LogSource | None
    #: optimizers guarded (``guard``): while any is, module buffers are copied at ``save``
    guarded: int = 0
    _lock: threading.Lock
    _queued: threading.Condition  # on _lock: a save was queued (or a wait may end)
    _inflight: list[Job]
    _next_id: int
    _takes_diffs: bool
    _plan_base: tuple[int, tuple[Any, ...]] | None
    _plan_since: int
    _outstanding: threading.Semaphore
    _pipeline: ThreadPoolExecutor
    _confirmed: int | None
    _committed_full: set[int]
    _chain: Chains
    _rebased: dict[int, int]
    _busy: set[str]
    _busy_version: int | None
    tierset: TierSet
    catalog: LiveCatalog
    staging: StagingBuffer
    halt: Halt
    _stager: ThreadPoolExecutor  # the staging thread (tiercheck-stage)

    def _run(self, job: Job) -> None:
        raise NotImplementedError

    def _log_leaves_no_room(self, job: Job, proposal: LogProposal) -> str | None:
        """Why ``job`` must be a full version rather than the log version ``proposal``
        (:func:`tiercheck.store.budgets.log_leaves_no_room`). Pipeline thread."""
        logs, size = self.logs, self.budgets.version_size
        if logs is None or logs.base is None or size is None or job.layout is None:
            return None
        chain = self._chain.of_log(logs.base)
        if chain is None:  # committed before this process knew it: nothing to count with
            return None
        whole = max(0, job.layout.stream_bytes - proposal.replayed_bytes)
        return log_leaves_no_room(
            self.tierset,
            chain=chain,
            adds=proposal.new_bytes + whole,
            version=size,
            catalog=self.catalog.snapshot(),
            writing={self._busy_version: set(busy)}
            if (busy := self._busy) and self._busy_version is not None
            else None,
        )

    def submit(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metadata: Mapping[str, Any] | None = None,
        role: Role | None = None,
    ) -> SaveHandle:
        """Validate and flatten ``state`` here, queue the rest; see ``Checkpointer.save``."""
        t_call = time.perf_counter()
        try:
            if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_INT:
                raise ValueError(
                    f"step must be an int from 0 to 2**63 - 1 (the format's range), got {step!r}"
                )
            if role not in (None, "base", "diff"):
                raise ValueError(f"role must be 'base', 'diff' or None, got {role!r}")
            meta = _metadata(metadata)
            tree, leaves = flatten(as_dict(state), allow_pickle=self.allow_pickle)
            if self.guarded:  # the step waits for staging; forward changes buffers before it
                leaves = copy_buffers(state, leaves)
            layout = plan_layout(leaves, choose_chunk_size(leaves, self.policy.chunk_size))
        except (TiercheckError, ValueError, TypeError) as exc:
            if self.world_size > 1:
                # the other ranks' saves of this version wait for this one: take part,
                # carrying the failure, so that they abort it at once
                self._enqueue(
                    step if isinstance(step, int) and 0 <= step <= MAX_INT else -1,
                    [],
                    None,
                    None,
                    {},
                    t_call,
                    None,
                    exc,
                )
            raise
        if self.policy.on_busy == "skip" and not self._outstanding.acquire(blocking=False):
            handle = SaveHandle(step, None, None, None)
            handle._supersede(
                f"the save of step {step} was skipped: the previous save is still running"
            )
            log.info("%s", handle.why_skipped)
            return handle
        if self.policy.on_busy != "skip":
            self._outstanding.acquire()
        return self._enqueue(step, leaves, layout, tree, meta, t_call, role, None, acquired=True)

    def _enqueue(
        self,
        step: int,
        leaves: list[Leaf],
        layout: Layout | None,
        tree: Any,
        meta: dict[str, Any],
        t_call: float,
        role: Role | None,
        failure: BaseException | None,
        *,
        acquired: bool = False,
    ) -> SaveHandle:
        if not acquired:
            self._outstanding.acquire()
        with self._lock:
            version = self.coordinator.next_version_id(self._next_id - 1)
            self._next_id = version + 1
            forced, deferred = role, self.logs is not None
            if deferred:
                role, base = "base", None  # provisional: _decide plans it, in order
            else:
                role, base = self._plan(layout, role)
            # a save that failed on the caller's thread has raised there: nobody waits on
            # its handle, so its failure is not kept for close() to report
            handle = SaveHandle(
                step,
                version,
                None if deferred else role,  # known once _decide has run
                base,
                failures=None if failure else self.failures,
            )
            job = Job(
                handle, step, version, role, base, leaves, layout, tree, meta, t_call, failure
            )
            job.deferred, job.forced = deferred, forced
            job.logical = layout.stream_bytes if layout is not None else 0
            job.late = any(self._keeps_buffer(j) for j in self._inflight)
            self._inflight.append(job)
            self._queued.notify_all()  # a save waiting for room may give way to this one
        job.ready = ready_events(leaves)  # what the copies wait for on each GPU
        if layout is not None:
            handle._logical = layout.stream_bytes
        handle._time("blocked", time.perf_counter() - t_call)
        self._stage_ahead(job)
        run = reporting(self.failures, f"the save of step {step} (version {version})", self._run)
        with self._lock:
            job.future = self._pipeline.submit(run, job)
        return handle

    def _plan(self, layout: Layout | None, role: Role | None) -> tuple[Role, int | None]:
        """The role of the next version and the base it follows (under ``_lock``)."""
        if layout is None:
            return "base", None
        sig = layout.signature()
        plan = self._plan_base
        if not self._takes_diffs:
            role = "base"  # no synchronous tier takes diff versions: every one is a base
        if role is None:
            want_base = (
                plan is None or plan[1] != sig or self._plan_since + 1 >= self.policy.base_every
            )
            role = "base" if want_base else "diff"
        elif role == "diff" and (plan is None or plan[1] != sig):
            role = "base"  # a diff needs a base with the same layout
        base = None if role == "base" or plan is None else plan[0]
        if role == "base":
            self._plan_base, self._plan_since = (self._next_id - 1, sig), 0
        else:
            self._plan_since += 1
        return role, base

    def _decide(self, job: Job) -> None:
        """Plan a deferred job (pipeline thread, in order, the trainer held by the guard):
        a log version when the update log allows it and is the cheaper choice
        (:func:`tiercheck.logversions.planner.choose`), else a full version, which resets the
        log. Every rank makes the same choice (one all-reduce of a flag)."""
        logs = self.logs
        proposal: LogProposal | None = None
        ok = False
        if (
            logs is not None
            and job.failure is None
            and job.layout is not None
            and job.forced is None
            and self._takes_diffs
        ):
            proposal = logs.propose(
                job.leaves, self.policy.max_replay_seconds, self._committed_full
            )
            ok = proposal.reason is None
            if not ok:
                log.debug("version %d is a full version: %s", job.version, proposal.reason)
            else:
                why = self._log_leaves_no_room(job, proposal)
                if why is not None:
                    ok = False
                    log.info("version %d is a full version: %s", job.version, why)
        if self.world_size > 1:
            ok = self.coordinator.all_true(ok)
        with self._lock:
            if ok:
                assert logs is not None and logs.base is not None
                job.role, job.base = "log", logs.base
            else:
                forced = job.forced
                if forced is None and logs is not None and logs.dense:
                    forced = "base"  # a dense diff stores every chunk: a base restores faster
                job.role, job.base = self._plan(job.layout, forced)
        job.handle.role, job.handle.base = job.role, job.base
        if ok:
            assert proposal is not None and proposal.logged is not None and job.layout is not None
            assert proposal.replayed is not None
            try:
                lv = build(
                    job.tree, job.leaves, proposal.logged, proposal.replayed, job.layout.chunk_size
                )
            except BaseException:
                assert logs is not None
                logs.release(proposal)
                logs.invalidate("a log version could not be laid out")
                raise
            job.tree, job.leaves, job.layout = lv.tree, lv.leaves, lv.layout
            job.proposal, job.replay = proposal, lv.replay
            return
        if logs is not None:
            if proposal is not None:
                logs.release(proposal)
            if job.layout is not None and job.failure is None:
                logs.full(job.version, job.layout.stream_bytes)

    def note_state(self, tree: Any, layout: Layout, staged: StagingArea | None = None) -> None:
        """The state to be saved is known (``Checkpointer.prepare``: its tree and the
        layout its saves will have): set the default memory budgets for its size now rather
        than at the first save, and ready the tiers' pages for the first two versions
        (:meth:`TierSet.preallocate`), but the pages of the tier the saves stage into
        (``staged``: its area holds them already)."""
        placeholder = tuple(ChunkRef("0" * 64, o, n) for o, n in layout.windows)
        _, mbytes, _ = build_manifest(
            version=self._next_id,
            rank=self.rank,
            world_size=self.world_size,
            layout=layout,
            chunks=placeholder,
            tree=tree,
        )
        header = BLOB_HEADER_SIZE if staged is None else HEADER
        self.budgets.size_known(
            version_bytes(layout.stream_bytes, len(placeholder), len(mbytes), header)
        )
        # the pages of the first two versions' blobs (what a default budget holds), now:
        # each chunk's, and the manifest's (compressed, so at most this long)
        blobs = [n + BLOB_HEADER_SIZE for _, n in layout.windows]
        self.tierset.preallocate(
            [*blobs, len(mbytes) + BLOB_HEADER_SIZE] * 2,
            skip=() if staged is None else (staged.tier,),
        )

    def note_version_ids(self, max_id: int) -> None:
        """Ids up to ``max_id`` are taken (another process saved; see ``refresh``)."""
        with self._lock:
            self._next_id = max(self._next_id, max_id + 1)

    def wait_or_superseded(self, job: Job, busy: Future[Any]) -> None:
        """Wait for ``busy`` (a slower tier still taking an earlier version over, which
        holds the room ``job`` needs in the fastest tier), or raise :class:`Superseded`
        once a newer save is queued behind ``job``: that one takes the staging buffer and
        ``job`` ends skipped (latest wins), so the trainer never waits for room. One process
        only (ranks agree on every version) and never a log version (the next log version
        of its base would lack its steps)."""
        if self.world_size > 1 or job.role == "log":
            busy.exception()
            return

        def wake(_: Future[Any]) -> None:
            with self._queued:
                self._queued.notify_all()

        busy.add_done_callback(wake)
        with self._queued:
            while not busy.done():
                newer = [j.step for j in self._inflight if j.version > job.version]
                if newer:
                    raise Superseded(
                        f"the save of step {job.step} (version {job.version}) was skipped "
                        f"for the save of step {newer[-1]}: the fastest tier had no room "
                        "while a slower tier still took an earlier version from it "
                        "(latest wins)"
                    )
                self._queued.wait()

    def wait_staged(self) -> None:
        """Block until every save so far has been staged (or failed); never raises."""
        with self._lock:
            handles = [job.handle for job in self._inflight]
        for h in handles:
            h._staged.wait()

    def give_way(self) -> None:
        """:meth:`wait_staged` for a trainer about to change its state (``guard``): a save
        not yet staged because an earlier one still holds the staging buffer (its fastest
        tier does not hold it yet) gives way instead of holding the trainer back, and so
        does one asked for while an earlier save held the buffer (``late``) whose copy is
        not done: its copy stops at the next leaf. It ends
        skipped (latest wins: its handle's ``skipped``, its tiers ``missing``); the next
        save is staged once the buffer is free. One process only (ranks agree on every
        version), and never a version planned on the pipeline thread (a log version: the
        next one of its base would lack its steps), which is waited for."""
        if self.world_size == 1:
            with self._lock:
                holders = [j for j in self._inflight if j.hold is not None and j.hold.needed]
                for job in self._inflight:
                    if not self._may_give_way(job):
                        continue
                    if holders and job not in holders:
                        self._supersede_unstaged(
                            job,
                            f"the staging buffer still held the save of step "
                            f"{holders[0].step} (version {holders[0].version})",
                        )
                    elif job.late:  # it got the buffer only lately: its copy is not done
                        self._supersede_unstaged(
                            job,
                            "the staging buffer was an earlier save's when it was asked "
                            "for, and its copy was not done",
                        )
        self.wait_staged()

    def _keeps_buffer(self, job: Job) -> bool:
        """Under ``_lock``: ``job`` holds the staging buffer, and its fastest tier does
        not hold its shard yet (it is not offered), or it waits for the buffer."""
        if job.finished or job.superseded is not None:
            return False
        if job.hold is not None:
            return job.hold.needed
        return not job.copied

    def _may_give_way(self, job: Job) -> bool:
        """Under ``_lock``: ``job`` may still give way (its copy is not done; one that has
        the buffer already gives way only if it was ``late``: the pipeline waits for its
        copy to stop before it lets the buffer go)."""
        return (
            (job.hold is None or (job.late and not job.copied and job.staging is not None))
            and not job.finished
            and job.superseded is None
            and not job.deferred
            and job.failure is None
            and job.layout is not None
            and not job.handle._staged.is_set()
        )

    def _supersede_unstaged(self, job: Job, why: str) -> None:
        """Under ``_lock``: ``job`` gives way; the pipeline ends it skipped."""
        job.superseded = (
            f"the save of step {job.step} (version {job.version}) was skipped: {why} "
            "when the trainer went on (latest wins)"
        )
        job.leaves, job.ready = [], {}  # the trainer changes them now: never copy them
        if job.outstanding:  # the next save() call does not wait for it
            job.outstanding = False
            self._outstanding.release()
        job.handle._mark_staged()

    def pinned(self) -> set[int]:
        """Bases that in-flight diffs follow, and the newest version every rank committed:
        retention must not drop them yet."""
        rebased = self._rebased  # a diff planned against a base that became a diff's
        with self._lock:
            out = {rebased.get(j.base, j.base) for j in self._inflight if j.base is not None}
            if self._confirmed is not None:
                out.add(self._confirmed)
        logs = self.logs
        if logs is not None and logs.base is not None:
            out.add(logs.base)  # the next log version's base
        return out

    # --- the staging thread --------------------------------------------------------------

    def _stage_ahead(self, job: Job) -> None:
        """Stage ``job`` on the staging thread as soon as the buffer is free. A save
        planned on the pipeline thread first (every save while an update log is attached)
        or one that failed on the caller's thread is staged by the pipeline instead."""
        if job.deferred or job.failure is not None or job.layout is None:
            return
        try:
            job.staging = self._stager.submit(self._stage, job)
        except RuntimeError:  # stopped: the pipeline reports the halt
            job.staging = None

    def _stage(self, job: Job) -> None:
        """Step 1 for ``job``, ahead of the pipeline: take the buffer, copy the state."""
        if self.halt.is_set() or not self.staging.acquire():
            return
        hold = Hold(self.staging)
        with self._lock:
            if job.finished or job.superseded is not None:  # cancelled or gave way meanwhile
                hold.release()
                return
            job.hold = hold
        assert job.layout is not None
        event = self.staging.stage(
            job.leaves, job.layout, ready=job.ready, stop=lambda: job.superseded is not None
        )
        if event is not None:
            event.synchronize()
        with self._lock:
            if job.superseded is not None:  # gave way meanwhile: the pipeline ends it
                job.leaves, job.ready = [], {}
                return
            job.copied = True
        job.leaves, job.ready = [], {}  # drop references to the caller's tensors
        job.handle._time("staged", time.perf_counter() - job.t_call)
        job.handle._mark_staged()
