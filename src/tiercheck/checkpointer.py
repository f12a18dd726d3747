"""The public entry point: :class:`Checkpointer`, its save handles and restore results.

One ``Checkpointer`` owns a store root. ``save`` flattens and validates the state on the
caller's thread (bad input fails here, before anything is written), then hands the rest to
one background pipeline thread: stage (copy into the reused staging buffer), hash, place
on every synchronous tier in parallel, decide, record, apply retention and GC, and queue
asynchronous migrations. Failures there are raised by the handle and by the next ``save``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, as_completed, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tiercheck.chunking import Layout, choose_chunk_size, plan_layout
from tiercheck.cluster import Coordinator, DistCoordinator, LocalCoordinator, Vote
from tiercheck.config import (
    CONFIG_NAME,
    StoreConfig,
    TierSpec,
    coerce_tiers,
    default_config,
    load_config,
    save_config,
)
from tiercheck.entries import Leaf, encode_scalar, flatten
from tiercheck.errors import (
    BlobCorrupt,
    CheckpointError,
    CommitAborted,
    ConfigError,
    NoRestorableVersion,
    NotFound,
    StoreLocked,
    TiercheckError,
    TierUnavailable,
)
from tiercheck.fetch import ChunkFetcher, FetchStats
from tiercheck.formats.manifest import AbortRecord, ChunkRef, CommitRecord, Role, VersionInfo
from tiercheck.history import Diff, Version, VersionSummary, build_history, open_version
from tiercheck.history import diff as diff_versions
from tiercheck.manifest_log import (
    Catalog,
    TierLog,
    append_record,
    read_catalog,
    read_tier_log,
)
from tiercheck.migration import migrate_shard
from tiercheck.pipeline import PlaceResult, build_manifest, commit_on, hash_stream, place_shard
from tiercheck.placement import Policy
from tiercheck.restore import bind, choose_version, fetch_into, materialize
from tiercheck.retention import GCReport, GCState, collect_garbage, drop_versions, plan_drops
from tiercheck.staging import StagingBuffer, cuda_devices, ready_events
from tiercheck.tierset import TierSet, TierSlot

if TYPE_CHECKING:
    import torch

__all__ = [
    "Checkpointer",
    "RestoreInfo",
    "SaveHandle",
    "SaveResult",
    "Version",
    "VersionSummary",
]

log = logging.getLogger("tiercheck")

# the least grace a tier shared by several ranks is swept with (see _collect)
SHARED_GC_GRACE_FLOOR = 60.0

TierState = Literal["committed", "pending", "migrating", "failed", "skipped"]


@dataclass(frozen=True)
class SaveResult:
    """What a save did. ``tiers`` maps each tier to its state for this version."""

    version: int | None
    step: int
    role: Role | None
    base: int | None
    logical_bytes: int
    bytes_written: Mapping[str, int]
    chunks_written: Mapping[str, int]
    tiers: Mapping[str, TierState]
    errors: Mapping[str, str]
    timings: Mapping[str, float]
    skipped: bool = False

    @property
    def committed_tiers(self) -> tuple[str, ...]:
        return tuple(n for n, s in self.tiers.items() if s == "committed")


class SaveHandle:
    """Tracks one save. ``wait_staged`` -> state may change; ``wait`` -> committed at every
    synchronous tier that could take it; ``wait_migrated`` -> asynchronous tiers too."""

    def __init__(self, step: int, version: int | None, role: Role | None, base: int | None):
        self.step = step
        self.version = version
        self.role = role
        self.base = base
        self.skipped = False
        self._staged = threading.Event()
        self._done = threading.Event()
        self._migrated = threading.Event()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._tiers: dict[str, TierState] = {}
        self._errors: dict[str, str] = {}
        self._bytes: dict[str, int] = {}
        self._chunks: dict[str, int] = {}
        self._timings: dict[str, float] = {}
        self._logical = 0
        self._pending_migrations = 0

    # --- called by the engine ---------------------------------------------------------

    def _set_tier(self, name: str, state: TierState, error: str | None = None) -> None:
        with self._lock:
            self._tiers[name] = state
            if error:
                self._errors[name] = error

    def _time(self, what: str, seconds: float) -> None:
        with self._lock:
            self._timings[what] = seconds

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._staged.set()
        self._done.set()
        self._migrated.set()

    # --- public -------------------------------------------------------------------------

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the state has been copied; the caller may then mutate it."""
        if not self._staged.wait(timeout):
            raise TimeoutError(f"staging of step {self.step} did not finish in {timeout}s")
        if self._error is not None and not self._done.is_set():
            raise self._wrap()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Block until committed at the synchronous tiers; raise if the save failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"save of step {self.step} did not finish in {timeout}s")
        if self._error is not None:
            raise self._wrap()
        return self.result_now()

    result = wait

    def wait_migrated(self, timeout: float | None = None) -> SaveResult:
        """Block until asynchronous tiers have the version too (or gave up)."""
        self.wait(timeout)
        if not self._migrated.wait(timeout):
            raise TimeoutError(f"migration of step {self.step} did not finish in {timeout}s")
        return self.result_now()

    def done(self) -> bool:
        return self._done.is_set()

    def _wrap(self) -> CheckpointError:
        err = self._error
        if isinstance(err, CheckpointError):
            return err
        out = CheckpointError(f"save of step {self.step} (version {self.version}) failed: {err}")
        out.__cause__ = err
        return out

    def result_now(self) -> SaveResult:
        """A snapshot of the save's state, whether finished or not."""
        with self._lock:
            return SaveResult(
                version=self.version,
                step=self.step,
                role=self.role,
                base=self.base,
                logical_bytes=self._logical,
                bytes_written=dict(self._bytes),
                chunks_written=dict(self._chunks),
                tiers=dict(self._tiers),
                errors=dict(self._errors),
                timings=dict(self._timings),
                skipped=self.skipped,
            )


@dataclass(frozen=True)
class RestoreInfo:
    """What a restore did. ``state`` is the (same, updated) state object."""

    version: int
    step: int
    role: Role
    metadata: Mapping[str, Any]
    source: str
    chunks_from: Mapping[str, int]
    bytes_read: Mapping[str, int]
    repaired: tuple[tuple[str, str], ...]
    corrupt: tuple[tuple[str, str], ...]
    seconds: float
    state: Any = field(repr=False, default=None)


@dataclass
class _Job:
    handle: SaveHandle
    info_step: int
    version: int
    role: Role
    base: int | None
    leaves: list[Leaf]
    layout: Layout
    tree: Any
    metadata: dict[str, Any]
    t_call: float
    protected: list[str] = field(default_factory=list)
    ready: dict[int, Any] = field(default_factory=dict)  # CUDA device -> torch.cuda.Event


class Checkpointer:
    """A checkpoint store rooted at ``root``.

    ``Checkpointer(root)`` opens the store described by ``root/tiercheck.toml``, creating the
    embedded default (shm, LMDB and a ``file://`` remote tier under the root) if there is
    none. ``tiers`` and ``policy`` set them explicitly (and are written to the config);
    ``config`` reads another TOML file. ``read_only`` opens for inspection without taking
    the writer lock. ``allow_pickle`` lets unsupported leaves be stored (and loaded) with
    pickle; leave it off for checkpoints you do not trust.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        tiers: Sequence[str | TierSpec | tuple[str, str]] | None = None,
        policy: Policy | None = None,
        config: str | os.PathLike[str] | None = None,
        read_only: bool = False,
        allow_pickle: bool = False,
        coordinator: Coordinator | None = None,
        threads: int | None = None,
    ) -> None:
        self.root = Path(root).expanduser().resolve()
        self.read_only = read_only
        self.allow_pickle = allow_pickle
        self.coordinator: Coordinator = coordinator or _default_coordinator()
        self.rank = self.coordinator.rank
        self.world_size = self.coordinator.world_size
        self._lock_fd: int | None = None
        self._closed = False
        self.config = self._resolve_config(tiers, policy, config)
        self.policy = self.config.policy
        if not read_only:
            self._take_lock()
        try:
            specs = [_for_rank(spec, self.coordinator) for spec in self.config.tiers]
            self.tierset = TierSet(specs, self.policy, read_only=read_only, owner=self.root)
        except BaseException:
            self._release_lock()
            raise
        cores = os.cpu_count() or 2
        n = threads or max(4, 2 * cores)
        self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="tiercheck-io")
        self._tier_pool = ThreadPoolExecutor(
            max_workers=max(2, len(self.tierset.slots)), thread_name_prefix="tiercheck-tier"
        )
        self._pipeline = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiercheck-save")
        self._hash_threads = self.policy.hash_threads or None
        self._staging = StagingBuffer()
        self._meta = threading.RLock()
        self._outstanding = threading.Semaphore(2)
        self._inflight: list[_Job] = []
        self._pending_error: BaseException | None = None
        self._gc = GCState()
        # blob ids a save or migration relies on before its records are in the catalog
        self._gc_lock = threading.Lock()
        self._protected: Counter[str] = Counter()
        self._catalog = read_catalog(self.tierset.tiers())
        if self.world_size > 1 and self.policy.on_busy == "skip":
            raise ConfigError("on_busy='skip' needs one process; with several ranks use 'wait'")
        self._next_id = self.coordinator.agree_max(self._catalog.max_version_id()) + 1
        # roles are decided when save() is called, not when a save commits: a base still
        # being written already counts, so two saves in a row never both become bases
        self._plan_base: tuple[int, tuple[Any, ...]] | None = None  # version, layout signature
        self._plan_since = 0  # diffs decided since that base
        self._base_chunks: dict[int, tuple[ChunkRef, ...]] = {}  # committed bases' chunks
        self._rebased: dict[int, int] = {}  # failed base -> the diff that became the base
        self._takes_diffs = self.coordinator.all_true(
            any(
                s.policy is not None and s.policy.mode == "sync" and s.policy.versions == "all"
                for s in self.tierset.open()
            )
        )
        self._migrations: queue.Queue[tuple[VersionInfo, str, SaveHandle | None] | None] = (
            queue.Queue()
        )
        self._pending_migrations: list[tuple[VersionInfo, str, SaveHandle | None]] = []
        self._pinned: dict[int, int] = {}
        self._owned: dict[int, set[str] | None] = {}
        self._info: VersionInfo | None = None
        self._gc_due: set[str] = {slot.name for slot in self.tierset.slots}
        self._grace_warned: set[str] = set()
        self.coordinator_timeout = 300.0
        self._migrator: threading.Thread | None = None
        if not read_only:
            self._migrator = threading.Thread(
                target=self._migration_loop, name="tiercheck-migrate", daemon=True
            )
            self._migrator.start()

    # --- configuration and locking ------------------------------------------------------

    def _resolve_config(
        self,
        tiers: Sequence[str | TierSpec | tuple[str, str]] | None,
        policy: Policy | None,
        config: str | os.PathLike[str] | None,
    ) -> StoreConfig:
        path = self.root / CONFIG_NAME
        if config is not None:
            cfg = load_config(Path(config))
        elif tiers is None and path.exists():
            cfg = load_config(path)
        elif tiers is None:
            if self.read_only:
                raise ConfigError(f"{self.root} is not a tiercheck store (no {CONFIG_NAME})")
            cfg = default_config(self.root, multi_rank=self.world_size > 1)
            if policy is None:
                # ranks opening one new root race to create it: the first config written wins
                self.root.mkdir(parents=True, exist_ok=True)
                if not save_config(path, cfg, exclusive=True):
                    cfg = load_config(path)
                return cfg
        else:
            cfg = StoreConfig(coerce_tiers(tiers), Policy())
        if policy is not None:
            cfg = StoreConfig(cfg.tiers, policy)
        if not self.read_only:
            self.root.mkdir(parents=True, exist_ok=True)
            save_config(path, cfg)
        return cfg

    def _take_lock(self) -> None:
        path = self.root / (".lock" if self.world_size == 1 else f".lock.rank{self.rank}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreLocked(
                f"{self.root} is open for writing by another process; open it with "
                "read_only=True to inspect it, or stop the other writer"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    # --- saving ---------------------------------------------------------------------------

    def prepare(self, state: Mapping[str, Any]) -> None:
        """Allocate the staging buffer for ``state`` now, so the first save pays nothing."""
        _, leaves = flatten(dict(state), allow_pickle=self.allow_pickle)
        layout = plan_layout(leaves, self.policy.chunk_size)
        devices = cuda_devices(leaves)  # pinned under the state's own device
        with self._meta:
            self._staging.ensure(
                layout.stream_bytes + (1 << 20),
                pinned=bool(devices),
                device=devices[0] if devices else None,
            )

    def guard(self, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        """Make ``optimizer.step()`` wait until the last save has been staged.

        Returns a function that removes the hook.
        """

        def hook(*_: Any) -> None:
            self.wait_staged()

        handle = optimizer.register_step_pre_hook(hook)
        return handle.remove

    def wait_staged(self) -> None:
        """Block until every save so far has been staged."""
        with self._meta:
            jobs = list(self._inflight)
        for job in jobs:
            job.handle.wait_staged()

    def _check_writable(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")
        if self.read_only:
            raise CheckpointError(f"{self.root} was opened read-only")

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metadata: Mapping[str, Any] | None = None,
        role: Role | None = None,
    ) -> SaveHandle:
        """Start saving ``state`` as the checkpoint of ``step``; return at once.

        The state is flattened and validated here (bad input raises a typed error before
        anything is written); copying and everything after it happen in the background.
        Do not mutate the state before ``handle.wait_staged()`` (or use :meth:`guard`).
        ``role`` forces a base or diff version. Raises the previous save's background
        failure, if it has not been raised yet.
        """
        t_call = time.perf_counter()
        self._check_writable()
        with self._meta:
            err, self._pending_error = self._pending_error, None
        if err is not None:
            raise CheckpointError(f"a previous save failed: {err}") from err
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if role not in (None, "base", "diff"):
            raise ValueError(f"role must be 'base', 'diff' or None, got {role!r}")
        meta = dict(metadata or {})
        encode_scalar(meta, "<metadata>", allow_pickle=False)
        tree, leaves = flatten(dict(state), allow_pickle=self.allow_pickle)
        layout = plan_layout(leaves, choose_chunk_size(leaves, self.policy.chunk_size))
        if self.policy.on_busy == "skip":
            if not self._outstanding.acquire(blocking=False):
                handle = SaveHandle(step, None, None, None)
                handle.skipped = True
                handle._staged.set()
                handle._done.set()
                handle._migrated.set()
                log.info("save of step %d skipped: the previous save is still running", step)
                return handle
        else:
            self._outstanding.acquire()
        with self._meta:
            version = self.coordinator.next_version_id(self._next_id - 1)
            self._next_id = version + 1
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
                self._plan_base, self._plan_since = (version, sig), 0
            else:
                self._plan_since += 1
            handle = SaveHandle(step, version, role, base)
            job = _Job(handle, step, version, role, base, leaves, layout, tree, meta, t_call)
            job.ready = ready_events(leaves)  # what the copies wait for on each GPU
            self._inflight.append(job)
        handle._logical = layout.stream_bytes
        handle._time("blocked", time.perf_counter() - t_call)
        self._pipeline.submit(self._run_job, job)
        return handle

    def _run_job(self, job: _Job) -> None:
        handle = job.handle
        try:
            self._save_job(job)
        except BaseException as exc:
            log.error("save of step %d failed: %s", job.info_step, exc)
            with self._meta:
                self._pending_error = exc
            handle._fail(exc)
        finally:
            self._unprotect(job.protected)
            with self._meta:
                if job in self._inflight:
                    self._inflight.remove(job)
            self._outstanding.release()

    def _save_job(self, job: _Job) -> None:
        handle = job.handle
        t0 = job.t_call
        if not self._staging.acquire():
            raise CheckpointError("staging buffer unavailable")
        try:
            event = self._staging.stage(job.leaves, job.layout, ready=job.ready)
            if event is not None:
                event.synchronize()
            job.leaves, job.ready = [], {}  # drop references to the caller's tensors
            handle._time("staged", time.perf_counter() - t0)
            handle._staged.set()
            view = self._staging.view(job.layout.stream_bytes)
            chunks = hash_stream(view, job.layout, self._hash_threads)
            handle._time("hashed", time.perf_counter() - t0)
            manifest, mbytes, mid = build_manifest(
                version=job.version,
                rank=self.rank,
                world_size=self.world_size,
                layout=job.layout,
                chunks=chunks,
                tree=job.tree,
            )
            base_chunks = self._resolve_base(job) if job.role == "diff" else None
            sync = [
                s
                for s in self.tierset.open()
                if s.policy is not None and s.policy.mode == "sync" and s.policy.wants(job.role)
            ]
            for s in self.tierset.slots:
                handle._set_tier(s.name, "pending")
            job.protected = self._protect(
                [mid, *(c.id for c in chunks), *(c.id for c in base_chunks or ())]
            )
            fetcher = ChunkFetcher(self.tierset.by_speed(), repair=False)
            owned: set[str] | None = None
            if self.world_size > 1:
                # cross-rank dedup: ids only; each unique chunk gets one writer for shared tiers
                sizes: dict[str, int] = {}
                for ref in chunks:
                    sizes.setdefault(ref.id, ref.length)
                owned = self.coordinator.assign_chunks(list(sizes.items()))
            with self._meta:
                self._owned[job.version] = owned

            def base_lookup(cid: str) -> bytes:
                return bytes(fetcher.fetch(cid)[0])

            futures = {
                self._tier_pool.submit(
                    place_shard,
                    slot,
                    pool=self._pool,
                    view=view,
                    layout=job.layout,
                    manifest=manifest,
                    manifest_bytes=mbytes,
                    manifest_id=mid,
                    step=job.info_step,
                    role=job.role,
                    base=job.base,
                    base_chunks=base_chunks,
                    base_lookup=base_lookup,
                    zstd_level=self.policy.zstd_level,
                    only=owned if slot.tier is not None and slot.tier.capabilities.shared else None,
                ): slot
                for slot in sync
            }
            try:
                committed, shared_ready = self._vote_and_commit(job, handle, futures, mid, t0)
            finally:
                for f in futures:  # tier writes read the buffer: let them all end first
                    f.exception()
        finally:
            self._staging.release()
        info = self._info
        assert info is not None
        if self.world_size > 1 and any(
            s.tier is not None and s.tier.capabilities.shared for s in sync
        ):
            agreed = self.coordinator.agree_tiers([s.name for s in shared_ready])
            for slot in shared_ready:
                if slot.name not in agreed:
                    handle._set_tier(slot.name, "failed", "not every rank prepared in this tier")
                    continue
                error = commit_on(slot, info) if self.rank == 0 else None
                if error is None:
                    committed.append(slot)
                    handle._set_tier(slot.name, "committed")
                    handle._time(f"committed:{slot.name}", time.perf_counter() - t0)
                else:
                    handle._set_tier(slot.name, "failed", error)
        if not committed:
            raise CheckpointError(
                f"version {job.version} could not be committed in any tier: {handle._errors}"
            )
        with self._meta:
            for slot in committed:
                tl = self._catalog.logs.setdefault(slot.name, TierLog(slot.name))
                tl.committed[info.id] = info
            if job.role == "base":
                # a diff decided against an older base has run by now (saves run in order)
                self._base_chunks = {job.version: chunks}
        handle._time("committed", time.perf_counter() - t0)
        handle._done.set()
        self._queue_migrations(info, handle, committed)
        self._apply_retention()

    def _resolve_base(self, job: _Job) -> tuple[ChunkRef, ...] | None:
        """The chunks of diff ``job``'s base; if that base failed, make ``job`` a base.

        A diff decided while its base was still being written finds the base committed by
        now (saves run in order) unless the base failed. Then the first such diff becomes
        the base instead, and the later diffs decided against the failed base use it.
        """
        assert job.base is not None
        with self._meta:
            base = self._rebased.get(job.base, job.base)
            chunks = self._base_chunks.get(base)
            if chunks is not None:
                job.base = job.handle.base = base
                return chunks
            self._rebased[job.base] = job.version
            job.role, job.base = "base", None
            job.handle.role, job.handle.base = "base", None
        log.warning("version %d is a base: the base it was to follow failed", job.version)
        return None

    def _vote_and_commit(
        self,
        job: _Job,
        handle: SaveHandle,
        futures: Mapping[Future[PlaceResult], TierSlot],
        manifest_id: str,
        t0: float,
    ) -> tuple[list[TierSlot], list[TierSlot]]:
        """Vote once one tier holds the shard, then commit each tier as it is prepared.

        A fast tier (shm) is thus committed, and reported, without waiting for a slow one
        (LMDB, a peer). Returns the committed slots and the prepared shared slots, whose
        commit needs every rank's agreement first.
        """
        results: list[PlaceResult] = []
        pending = set(futures)
        while pending and not any(r.ok for r in results):
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            results += [f.result() for f in done]
        ok = [r for r in results if r.ok]
        vote = Vote(
            rank=self.rank,
            ok=bool(ok),
            manifest=manifest_id,
            tiers=tuple(r.tier for r in ok),
            reason="; ".join(f"{r.tier}: {r.error}" for r in results if not r.ok)
            or ("no synchronous tier wants this version" if not futures else ""),
        )
        t_vote = time.perf_counter()
        decision = self.coordinator.decide(job.version, vote)
        handle._time("voting", time.perf_counter() - t_vote)
        if not decision.commit:
            results += [f.result() for f in pending]
            for r in results:
                self._note_placed(handle, r)
                if r.ok:
                    slot = self.tierset.get(r.tier)
                    assert slot.tier is not None
                    try:
                        append_record(slot.tier, AbortRecord(job.version, decision.reason))
                    except TiercheckError as exc:
                        log.warning("could not record abort in %s: %s", slot.name, exc)
            raise CommitAborted(f"version {job.version} aborted: {decision.reason}")
        info = VersionInfo(
            id=job.version,
            step=job.info_step,
            role=job.role,
            base=job.base,
            world_size=self.world_size,
            shards=decision.shards,
            time=time.time(),
            logical_bytes=job.layout.stream_bytes,
            metadata=job.metadata,
        )
        self._info = info
        committed: list[TierSlot] = []
        shared_ready: list[TierSlot] = []

        def settle(r: PlaceResult) -> None:
            self._note_placed(handle, r)
            if not r.ok:
                return
            slot = self.tierset.get(r.tier)
            assert slot.tier is not None
            if slot.tier.capabilities.shared and self.world_size > 1:
                shared_ready.append(slot)
                return
            error = commit_on(slot, info)
            if error is None:
                committed.append(slot)
                with self._meta:
                    self._catalog.logs.setdefault(slot.name, TierLog(slot.name)).committed[
                        info.id
                    ] = info
                handle._set_tier(slot.name, "committed")
                handle._time(f"committed:{slot.name}", time.perf_counter() - t0)
            else:
                handle._set_tier(slot.name, "failed", error)

        for r in results:
            settle(r)
        for f in as_completed(pending):
            settle(f.result())
        return committed, shared_ready

    @staticmethod
    def _note_placed(handle: SaveHandle, r: PlaceResult) -> None:
        handle._bytes[r.tier] = r.bytes_written
        handle._chunks[r.tier] = r.chunks_written
        handle._time(f"prepared:{r.tier}", r.seconds)
        if not r.ok:
            handle._set_tier(r.tier, "failed", r.error)

    # --- migration ------------------------------------------------------------------------

    def _queue_migrations(
        self, info: VersionInfo, handle: SaveHandle | None, committed: Sequence[TierSlot]
    ) -> None:
        targets = [
            s
            for s in self.tierset.open()
            if s.policy is not None
            and s.policy.mode == "async"
            and s.policy.wants(info.role)
            and s not in committed
        ]
        if handle is not None:
            handle._pending_migrations = len(targets)
            for s in targets:
                handle._set_tier(s.name, "migrating")
            for s in self.tierset.slots:
                if handle._tiers.get(s.name) == "pending":
                    handle._set_tier(s.name, "skipped")
            if not targets:
                handle._migrated.set()
        with self._meta:
            for s in targets:
                self._pinned[info.id] = self._pinned.get(info.id, 0) + 1
                self._migrations.put((info, s.name, handle))

    def _migration_loop(self) -> None:
        while True:
            job = self._migrations.get()
            if job is None:
                return
            info, name, handle = job
            slot = self.tierset.get(name)
            try:
                self._migrate(info, slot)
            except TierUnavailable as exc:
                log.warning("migration of version %d to %s postponed: %s", info.id, name, exc)
                with self._meta:
                    self._pending_migrations.append(job)
                if handle is not None:
                    handle._set_tier(name, "migrating", str(exc))
                self._migrations.task_done()
                continue
            except Exception as exc:
                log.error("migration of version %d to %s failed: %s", info.id, name, exc)
                with self._meta:
                    self._pending_error = CheckpointError(
                        f"migration of version {info.id} to tier {name} failed: {exc}"
                    )
                    self._unpin(info.id)
                if handle is not None:
                    handle._set_tier(name, "failed", str(exc))
                    self._migration_done(handle)
                self._migrations.task_done()
                continue
            with self._meta:
                tl = self._catalog.logs.setdefault(name, TierLog(name))
                tl.committed[info.id] = info
                self._unpin(info.id)
            if handle is not None:
                handle._set_tier(name, "committed")
                self._migration_done(handle)
            self._migrations.task_done()
            self._apply_retention()

    def _unpin(self, version: int) -> None:
        left = self._pinned.get(version, 0) - 1
        if left > 0:
            self._pinned[version] = left
        else:
            self._pinned.pop(version, None)

    @staticmethod
    def _migration_done(handle: SaveHandle) -> None:
        with handle._lock:
            handle._pending_migrations -= 1
            done = handle._pending_migrations <= 0
        if done:
            handle._migrated.set()

    def _migrate(self, info: VersionInfo, slot: TierSlot) -> None:
        with self._meta:
            holders = [
                self.tierset.get(n)
                for n, tl in self._catalog.logs.items()
                if tl.holds(info.id) and n != slot.name
            ]
            base_info = self._catalog.versions.get(info.base) if info.base is not None else None
        sources = sorted([s for s in holders if s.tier is not None], key=lambda s: s.speed_rank)
        sources += [s for s in self.tierset.by_speed() if s not in sources and s is not slot]
        fetcher = ChunkFetcher(sources, repair=True, zstd_level=self.policy.zstd_level)
        base_mid = base_info.shards[self.rank] if base_info is not None else None
        assert slot.tier is not None
        shared = slot.tier.capabilities.shared and self.world_size > 1
        with self._meta:
            owned = self._owned.get(info.id) if shared else None
        mid = info.shards[self.rank]
        ids = [mid, *(c.id for c in fetcher.manifest(mid, order=sources).chunks)]
        if base_mid is not None:
            ids += [base_mid, *(c.id for c in fetcher.manifest(base_mid, order=sources).chunks)]
        protected = self._protect(ids)
        try:
            migrate_shard(
                info,
                self.rank,
                slot,
                sources,
                fetcher,
                self._pool,
                zstd_level=self.policy.zstd_level,
                base_manifest_id=base_mid,
                commit=not shared,
                only=owned,
            )
            if shared and self.rank == 0:
                self._commit_shared(info, slot)
            with self._meta:  # in the catalog before GC may see the blobs unprotected
                self._catalog.logs.setdefault(slot.name, TierLog(slot.name)).committed[info.id] = (
                    info
                )
        finally:
            self._unprotect(protected)

    def _commit_shared(self, info: VersionInfo, slot: TierSlot) -> None:
        """Record the commit of ``info`` in a shared tier once every rank's prepare record
        is there (each rank migrates its own shard, writing only the chunks it owns)."""
        assert slot.tier is not None
        deadline = time.monotonic() + self.coordinator_timeout
        delay = 0.01
        while True:
            tl = read_tier_log(slot.name, slot.tier)
            ranks = set(tl.prepared.get(info.id, {}))
            if ranks >= set(range(self.world_size)):
                break
            if time.monotonic() > deadline:
                raise TierUnavailable(
                    f"ranks {sorted(set(range(self.world_size)) - ranks)} did not migrate their "
                    f"shard of version {info.id} in time",
                    url=slot.tier.url,
                )
            time.sleep(delay)  # polling a remote log: back off, bounded by the deadline
            delay = min(delay * 2, 1.0)
        append_record(slot.tier, CommitRecord(info))

    def retry_migrations(self) -> int:
        """Queue again the migrations postponed because their tier was unreachable."""
        with self._meta:
            jobs, self._pending_migrations = self._pending_migrations, []
        for job in jobs:
            self._migrations.put(job)
        return len(jobs)

    def wait_migrations(self, timeout: float | None = None) -> bool:
        """Block until queued migrations finished (or were postponed); True if none pending."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.flush()
        while self._migrations.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            with self._migrations.all_tasks_done:
                self._migrations.all_tasks_done.wait(0.05)
        with self._meta:
            return not self._pending_migrations

    # --- retention and GC -----------------------------------------------------------------

    def _in_flight_ids(self) -> set[str]:
        return set(self._protected)

    def _protect(self, ids: Iterable[str]) -> list[str]:
        """Keep ``ids`` from GC until :meth:`_unprotect`. Taken between GC passes, so a pass
        either sees them or has finished deleting before the caller asks a tier what it has."""
        out = list(ids)
        with self._gc_lock, self._meta:
            self._protected.update(out)
        return out

    def _unprotect(self, ids: Sequence[str]) -> None:
        with self._meta:
            self._protected.subtract(ids)
            for i in ids:
                if self._protected[i] <= 0:
                    del self._protected[i]

    def _apply_retention(self) -> None:
        with self._meta:
            pinned = set(self._pinned)
            logs = {n: tl for n, tl in self._catalog.logs.items()}
        for slot in self.tierset.open():
            tl = logs.get(slot.name)
            if tl is None or slot.policy is None:
                continue
            if slot.tier is not None and slot.tier.capabilities.shared and self.rank != 0:
                continue  # one rank manages a tier all ranks share
            try:
                drops = plan_drops(tl, slot.policy, pinned)
                if drops:
                    with self._meta:
                        drop_versions(slot, drops, tl)
                    log.debug("retention dropped %s from %s", drops, slot.name)
                # Listing a tier is not free (a remote one especially): sweep only after a
                # drop, while swept candidates wait out their grace, and once after opening
                # (for what a crashed writer left behind).
                if drops or slot.name in self._gc_due:
                    report = self._collect(slot, tl, dry_run=False)
                    with self._meta:
                        if report.waiting:
                            self._gc_due.add(slot.name)
                        else:
                            self._gc_due.discard(slot.name)
            except TiercheckError as exc:
                log.warning("retention/gc on tier %s failed: %s", slot.name, exc)

    def _collect(self, slot: TierSlot, tl: TierLog, *, dry_run: bool) -> GCReport:
        fetcher = ChunkFetcher(self.tierset.by_speed(), repair=False)
        shared = slot.tier is not None and slot.tier.capabilities.shared
        grace = self.policy.gc_grace_seconds
        if shared and self.world_size > 1 and grace < SHARED_GC_GRACE_FLOOR:
            # the blobs other ranks are writing into a shared tier (a save or migration in
            # flight) are invisible to this rank: only the grace period keeps them
            if slot.name not in self._grace_warned:
                self._grace_warned.add(slot.name)
                log.warning(
                    "gc_grace_seconds=%s is too short for shared tier %s with %d ranks; "
                    "sweeping it with %s s",
                    grace,
                    slot.name,
                    self.world_size,
                    SHARED_GC_GRACE_FLOOR,
                )
            grace = SHARED_GC_GRACE_FLOOR
        with self._gc_lock:  # protected ids are read before the mark, and none added until done
            with self._meta:
                in_flight = self._in_flight_ids()
            return collect_garbage(
                slot,
                tl,
                fetcher.manifest,
                in_flight=in_flight,
                state=self._gc,
                grace=grace,
                dry_run=dry_run,
                # a per-rank tier holds this rank's shards only: other manifests are elsewhere
                rank=None if slot.tier is None or shared else self.rank,
            )

    def gc(self, *, dry_run: bool = False) -> list[GCReport]:
        """Sweep unreferenced blobs past the grace period from every tier."""
        self.flush()
        self._check_writable() if not dry_run else None
        catalog = self.refresh()
        reports = []
        for slot in self.tierset.open():
            tl = catalog.logs.get(slot.name)
            if tl is not None:
                reports.append(self._collect(slot, tl, dry_run=dry_run))
        return reports

    # --- reading --------------------------------------------------------------------------

    def refresh(self) -> Catalog:
        """Re-read every tier's log (e.g. after another process wrote or a tier was lost)."""
        catalog = read_catalog(self.tierset.tiers())
        with self._meta:
            self._catalog = catalog
            self._next_id = max(self._next_id, catalog.max_version_id() + 1)
        return catalog

    def restore(
        self,
        state: dict[str, Any] | None = None,
        *,
        version: int | None = None,
        step: int | None = None,
        strict: bool = True,
        repair: bool = True,
        tiers: Sequence[str] | None = None,
    ) -> RestoreInfo:
        """Restore the newest restorable version (or ``version``/``step``) into ``state``.

        Tensors are written into the caller's tensors where dtype and shape match; modules
        and optimizers get ``load_state_dict``; a ``None`` value is a placeholder for what
        was saved under its key (``info.state[key]``). Each chunk comes from the fastest
        tier that holds an intact copy; damaged copies are repaired when ``repair``.
        ``tiers`` restricts the tiers read. Raises :class:`NoRestorableVersion` or
        :class:`StateError`.
        """
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")
        t0 = time.perf_counter()
        self.flush()
        catalog = self.refresh()
        if tiers is not None:
            unknown = set(tiers) - {s.name for s in self.tierset.slots}
            if unknown:
                raise ConfigError(f"unknown tier names {sorted(unknown)}")
            catalog = Catalog({n: tl for n, tl in catalog.logs.items() if n in tiers}, {})
        explicit = version is not None or step is not None
        last_error: Exception | None = None
        if explicit:
            try:
                candidates = [choose_version(catalog, version=version, step=step).id]
            except NoRestorableVersion as exc:
                candidates, last_error = [], exc
        else:
            candidates = sorted(catalog.restorable_versions(), reverse=True)
        # Every rank takes part in each round, so that all agree on one version: the newest
        # that every rank can restore; if any rank then fails to read it, all try older.
        while True:
            vid = self.coordinator.agree_restorable(candidates)
            if vid is None:
                if isinstance(last_error, NoRestorableVersion) and self.world_size == 1:
                    raise last_error
                raise NoRestorableVersion(
                    "no version can be restored"
                    + (" by every rank" if self.world_size > 1 else "")
                    + (f" (last error: {last_error})" if last_error else "")
                )
            result: RestoreInfo | None = None
            fatal: TiercheckError | None = None
            try:
                result = self._restore_version(
                    catalog, catalog.versions[vid], state, strict, repair, t0
                )
            except (NotFound, TierUnavailable, BlobCorrupt) as exc:
                last_error = exc
            except TiercheckError as exc:
                last_error = fatal = exc
            if self.coordinator.all_true(result is not None):
                assert result is not None
                return result
            if fatal is not None:
                raise fatal
            if explicit:
                raise NoRestorableVersion(f"version {vid} could not be restored: {last_error}")
            log.warning(
                "version %d could not be restored (%s); trying an older one", vid, last_error
            )
            candidates = [c for c in candidates if c < vid]

    def _restore_version(
        self,
        catalog: Catalog,
        info: VersionInfo,
        state: dict[str, Any] | None,
        strict: bool,
        repair: bool,
        t0: float,
    ) -> RestoreInfo:
        if self.rank >= len(info.shards):
            raise NoRestorableVersion(
                f"version {info.id} has {len(info.shards)} shard(s); this is rank {self.rank}"
            )
        holders = catalog.holders(info.id)
        allowed = set(catalog.logs)
        order = sorted(
            [self.tierset.get(n) for n in holders if self.tierset.get(n).tier is not None],
            key=lambda s: s.speed_rank,
        )
        order += [s for s in self.tierset.by_speed() if s not in order and s.name in allowed]
        fetcher = ChunkFetcher(
            order, repair=repair and not self.read_only, zstd_level=self.policy.zstd_level
        )
        manifest = fetcher.manifest(info.shards[self.rank], order=order)
        target = state if state is not None else {}
        binding = bind(manifest, target, strict=strict and state is not None)
        fetch_into(manifest, binding, fetcher, order, self._pool, expect=holders)
        restored = materialize(manifest, binding, target, allow_pickle=self.allow_pickle)
        stats: FetchStats = fetcher.stats
        source = (
            stats.chunks_from.most_common(1)[0][0]
            if stats.chunks_from
            else (order[0].name if order else "")
        )
        return RestoreInfo(
            version=info.id,
            step=info.step,
            role=info.role,
            metadata=dict(info.metadata),
            source=source,
            chunks_from=dict(stats.chunks_from),
            bytes_read=dict(stats.bytes_read),
            repaired=tuple(stats.repaired),
            corrupt=tuple(stats.corrupt),
            seconds=time.perf_counter() - t0,
            state=restored,
        )

    def history(self) -> list[Version]:
        """Every committed version, oldest first, with where it is held.

        Reads the logs only; each :class:`~tiercheck.history.Version` opens its content
        lazily (``v.entries``, ``v[key]``, ``v.to_state_dict()``).
        """
        self.flush()
        catalog = self.refresh() if self.read_only or self._closed is False else self._catalog
        with self._meta:
            pending = {(info.id, name) for info, name, _ in self._pending_migrations}
            pinned = set(self._pinned)
        return build_history(self, catalog, pending=pending, pinned=pinned)

    def version(
        self,
        version: int | str | Version | None = None,
        *,
        step: int | None = None,
        rank: int | None = None,
    ) -> Version:
        """Open one version lazily: an id, ``"latest"``, ``"step:N"``, or ``step=N``.

        Raises :class:`NoRestorableVersion` if the store has no such committed version.
        """
        return open_version(self, version, step=step, rank=rank)

    def diff(self, a: int | str | Version, b: int | str | Version) -> Diff:
        """What changed from version ``a`` to ``b`` (see :func:`tiercheck.history.diff`)."""
        return diff_versions(self.version(a), self.version(b))

    # --- lifecycle ------------------------------------------------------------------------

    def flush(self) -> None:
        """Block until every save submitted so far has finished (not migrations)."""
        if self._closed:
            return
        barrier: Future[None] = self._pipeline.submit(lambda: None)
        barrier.result()

    def close(self, *, wait_migrations: bool = True, timeout: float | None = None) -> None:
        """Finish pending saves (and migrations, unless told not to), close tiers, unlock."""
        if self._closed:
            return
        try:
            self.flush()
            if wait_migrations and self._migrator is not None:
                self.wait_migrations(timeout)
        finally:
            self._closed = True
            if self._migrator is not None:
                self._migrations.put(None)
                self._migrator.join(timeout=timeout)
            self._pipeline.shutdown(wait=True)
            self._tier_pool.shutdown(wait=True)
            self._pool.shutdown(wait=True)
            self.tierset.close()
            self._release_lock()
        with self._meta:
            err, self._pending_error = self._pending_error, None
        if err is not None and not isinstance(err, CheckpointError):
            log.error("a background save failed before close: %s", err)

    def destroy(self) -> None:
        """Close, then delete this store: its root, shm segments and LMDB environments
        (see :func:`tiercheck.lifecycle.destroy_store`; remote tiers are kept)."""
        from tiercheck.lifecycle import destroy_store

        self.close()
        destroy_store(self.root)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self._release_lock()
            except Exception:
                pass


def _default_coordinator() -> Coordinator:
    """A :class:`DistCoordinator` under an initialized multi-rank torch.distributed job."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch builds without distributed
        return LocalCoordinator()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return DistCoordinator()
    return LocalCoordinator()


def _for_rank(spec: TierSpec, coord: Coordinator) -> TierSpec:
    """Fill ``{rank}``, ``{local_rank}`` and ``{node}`` in a tier's URL and string options."""
    values = {"{rank}": coord.rank, "{local_rank}": coord.local_rank, "{node}": coord.node}

    def fill(text: str) -> str:
        for key, value in values.items():
            text = text.replace(key, str(value))
        return text

    options = {k: fill(v) if isinstance(v, str) else v for k, v in spec.options.items()}
    return TierSpec(spec.name, fill(spec.url), options)
