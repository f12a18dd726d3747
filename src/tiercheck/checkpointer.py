"""The public entry point: :class:`Checkpointer`, a store of checkpoint versions.

A ``Checkpointer`` is a thin front over services that each own one piece of state:

- :class:`~tiercheck.engine.saving.SaveService`: the save pipeline (version ids and roles, the
  saves in flight, the pipeline thread);
- :class:`~tiercheck.engine.migration.MigrationService`: migrations to asynchronous tiers, with
  retries (its own thread);
- :class:`~tiercheck.engine.maintenance.Maintenance`: retention and GC per tier (its own thread);
- :class:`~tiercheck.engine.catalog.LiveCatalog`: the merged view of every tier's log;
- :mod:`tiercheck.engine.leases`: the store lock, the GC fence and the leases in shared tiers;
- :class:`~tiercheck.engine.handles.Failures`: failures nobody has seen yet, for ``close()``.

Data flows one way: a save commits, then queues migrations and requests maintenance; a
migration requests maintenance. What each call promises is written in
:mod:`tiercheck.engine.guarantees` and in ``docs/concepts.md`` ("Guarantees").
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiercheck.core.chunking import plan_layout
from tiercheck.core.entries import flatten, is_stateful
from tiercheck.engine.background import Halt
from tiercheck.engine.catalog import Catalog, LiveCatalog, read_catalog
from tiercheck.engine.config import (
    CONFIG_NAME,
    StoreConfig,
    TierSpec,
    coerce_tiers,
    default_config,
    load_config,
    save_config,
)
from tiercheck.engine.coordinator import Coordinator, DistCoordinator, LocalCoordinator
from tiercheck.engine.fetch import ChunkFetcher
from tiercheck.engine.handles import Failures, SaveHandle, SaveResult
from tiercheck.engine.leases import GCFence, StoreLock, TierLeases
from tiercheck.engine.maintenance import Maintenance
from tiercheck.engine.migration import MigrationService
from tiercheck.engine.placement import Policy
from tiercheck.engine.retention import GCReport
from tiercheck.engine.saving import SaveService
from tiercheck.engine.staging import StagingBuffer, cuda_devices
from tiercheck.engine.tierset import TierSet, TierSlot
from tiercheck.errors import (
    BlobCorrupt,
    CheckpointError,
    ConfigError,
    NoRestorableVersion,
    NotFound,
    ReplayError,
    StateError,
    TiercheckError,
    TierUnavailable,
    UnfinishedWork,
)
from tiercheck.formats.manifest import Role, ShardManifest, VersionInfo
from tiercheck.history.diff import Diff
from tiercheck.history.diff import diff as diff_versions
from tiercheck.history.versions import Version, VersionSummary, build_history, open_version
from tiercheck.logversions.planner import (
    LogSource,
    replay_version,
    replay_version_resharded,
)
from tiercheck.restore.reshard import Gathered, gather
from tiercheck.restore.service import (
    Binding,
    RestoreInfo,
    Undo,
    bind,
    choose_version,
    fetch_stream,
    load_stream,
    materialize,
)

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


class Checkpointer:
    """A checkpoint store rooted at ``root``.

    ``Checkpointer(root)`` opens the store described by ``root/tiercheck.toml``, creating the
    embedded default (shm, LMDB and a ``file://`` "remote" tier under the root) if there is
    none. ``tiers`` and ``policy`` set them explicitly (and are written to the config);
    ``config`` reads another TOML file. Tiers that differ from those an existing store's
    file names raise :class:`~tiercheck.errors.ConfigError` (its versions are in the tiers it
    names) unless ``rewrite_config`` says to replace them. ``read_only`` opens for
    inspection without taking the writer lock (and writes no config). ``allow_pickle`` lets
    unsupported leaves be stored (and loaded) with pickle; leave it off for checkpoints you
    do not trust.
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
        rewrite_config: bool = False,
    ) -> None:
        self.root = Path(root).expanduser().resolve()
        self.read_only = read_only
        self.allow_pickle = allow_pickle
        self.coordinator: Coordinator = coordinator or _default_coordinator()
        self.rank = self.coordinator.rank
        self.world_size = self.coordinator.world_size
        self._closed = False
        self._lock: StoreLock | None = None
        self.config, write_config = self._resolve_config(tiers, policy, config)
        self.policy = self.config.policy
        if self.world_size > 1 and self.policy.on_busy == "skip":
            raise ConfigError("on_busy='skip' needs one process; with several ranks use 'wait'")
        self._halt = Halt()
        self._closer: threading.Thread | None = None
        self._migrations: MigrationService | None = None
        self._saves: SaveService | None = None
        if not read_only:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock = StoreLock(self.root, self.rank if self.world_size > 1 else None)
        try:
            # under the lock: never under a writer that has the store open; by rank 0 only:
            # the ranks share the file, and each may pass tiers of its own (a peer per rank)
            if write_config and self.rank == 0:
                self._write_config(rewrite_config)
            self._open(allow_pickle, threads)
        except BaseException:
            self._abort_open()
            raise

    def _open(self, allow_pickle: bool, threads: int | None) -> None:
        """Open the tiers, read their logs, start the services (the lock is taken)."""
        read_only = self.read_only
        specs = [_for_rank(spec, self.coordinator) for spec in self.config.tiers]
        self.tierset = TierSet(specs, self.policy, read_only=read_only, owner=self.root)
        cores = os.cpu_count() or 2
        self._pool = ThreadPoolExecutor(
            max_workers=threads or max(4, 2 * cores), thread_name_prefix="tiercheck-io"
        )
        self._staging = StagingBuffer()
        self._failures = Failures()
        self._catalog = LiveCatalog(read_catalog(self.tierset.tiers()))
        self._fence = GCFence()
        self._leases = TierLeases()
        next_id = self.coordinator.agree_max(self._catalog.snapshot().max_version_id()) + 1
        takes_diffs = self.coordinator.all_true(
            any(
                s.policy is not None and s.policy.mode == "sync" and s.policy.versions == "all"
                for s in self.tierset.open()
            )
        )
        self._maintenance = Maintenance(
            tierset=self.tierset,
            policy=self.policy,
            catalog=self._catalog,
            fence=self._fence,
            leases=self._leases,
            pinned=self._pinned,
            failures=self._failures,
            rank=self.rank,
            halt=self._halt,
        )
        if not read_only:
            self._migrations = MigrationService(
                tierset=self.tierset,
                policy=self.policy,
                catalog=self._catalog,
                fence=self._fence,
                leases=self._leases,
                pool=self._pool,
                maintenance=self._maintenance,
                failures=self._failures,
                rank=self.rank,
                world_size=self.world_size,
                broken=lambda: getattr(self.coordinator, "broken", None),
                halt=self._halt,
            )
            self._saves = SaveService(
                tierset=self.tierset,
                policy=self.policy,
                coordinator=self.coordinator,
                catalog=self._catalog,
                fence=self._fence,
                leases=self._leases,
                staging=self._staging,
                pool=self._pool,
                migrations=self._migrations,
                maintenance=self._maintenance,
                failures=self._failures,
                allow_pickle=allow_pickle,
                next_id=next_id,
                takes_diffs=takes_diffs,
                halt=self._halt,
                confirmed=self.coordinator.agree_restorable(
                    self._catalog.snapshot().restorable_versions()
                ),
            )
            # sweep once after opening: what a crashed writer left behind
            self._maintenance.request(s.name for s in self.tierset.slots)

    def _abort_open(self) -> None:
        """Opening failed: stop every thread it started, close every tier it opened and
        release the store lock, so that the caller may open the store again."""
        self._closed = True
        self._halt.set("opening the store failed")
        steps: list[Callable[[], object]] = []
        if self._saves is not None:
            steps.append(self._saves.close)
        if self._migrations is not None:
            steps += [functools.partial(self._migrations.stop, abandon=True), self._migrations.join]
        maintenance: Maintenance | None = getattr(self, "_maintenance", None)
        if maintenance is not None:
            steps.append(maintenance.close)
        pool: ThreadPoolExecutor | None = getattr(self, "_pool", None)
        if pool is not None:
            steps.append(functools.partial(pool.shutdown, wait=True, cancel_futures=True))
        tierset: TierSet | None = getattr(self, "tierset", None)
        if tierset is not None:
            steps.append(tierset.close)
        for step in steps:
            try:
                step()
            except Exception:  # the caller hears of what made the open fail, not of this
                log.exception("releasing what a failed open of %s took", self.root)
        self._release_lock()

    # --- configuration and locking ------------------------------------------------------

    def _resolve_config(
        self,
        tiers: Sequence[str | TierSpec | tuple[str, str]] | None,
        policy: Policy | None,
        config: str | os.PathLike[str] | None,
    ) -> tuple[StoreConfig, bool]:
        """The store's configuration, and whether it is to be written to its file (once
        the lock is taken: :meth:`_write_config`)."""
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
                return cfg, False
        else:
            cfg = StoreConfig(coerce_tiers(tiers), Policy())
        if policy is not None:
            cfg = StoreConfig(cfg.tiers, policy)
        return cfg, not self.read_only

    def _write_config(self, rewrite: bool) -> None:
        """Write the configuration given to the store's file; unless ``rewrite``, refuse
        other tiers than the file names (:func:`_check_same_tiers`)."""
        path = self.root / CONFIG_NAME
        if not rewrite and path.exists():
            _check_same_tiers(path, load_config(path), self.config)
        save_config(path, self.config)

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (versions read from the store need it open)."""
        return self._closed

    @property
    def failures(self) -> Failures:
        """Failures nobody has seen yet, which :meth:`close` raises. An integration that
        runs work of its own on a thread records its failures here too
        (:func:`tiercheck.engine.background.reporting`)."""
        return self._failures

    @property
    def executor(self) -> Executor:
        """The store's I/O thread pool (for reads that history and verify run in parallel)."""
        return self._pool

    def _pinned(self) -> set[int]:
        out: set[int] = set()
        if self._saves is not None:
            out |= self._saves.pinned()
        if self._migrations is not None:
            out |= self._migrations.pinned()
        return out

    def _writer(self) -> SaveService:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")
        if self._saves is None:
            raise CheckpointError(f"{self.root} was opened read-only")
        return self._saves

    # --- saving ---------------------------------------------------------------------------

    def prepare(self, state: Mapping[str, Any]) -> None:
        """Allocate the staging buffer for ``state`` now, so the first save pays nothing;
        the default memory budgets (:mod:`tiercheck.engine.budgets`) are set for its size too."""
        tree, leaves = flatten(dict(state), allow_pickle=self.allow_pickle)
        if self._saves is not None:
            self._saves.note_state(tree, leaves)
        layout = plan_layout(leaves, self.policy.chunk_size)
        devices = cuda_devices(leaves)  # pinned under the state's own device
        self._staging.acquire()  # not while a save is using it
        try:
            self._staging.ensure(
                layout.stream_bytes + (1 << 20),
                pinned=bool(devices),
                device=devices[0] if devices else None,
            )
        finally:
            self._staging.release()

    def guard(
        self,
        optimizer: torch.optim.Optimizer,
        scaler: Any = None,
        *,
        log: bool = True,
        mirrors: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> Callable[[], None]:
        """Make ``optimizer.step()`` wait until the last save has been staged, and log
        what each step consumes so that saves can be log versions.

        With ``log`` (the default, on a writable store), an update log is attached
        (:mod:`tiercheck.logversions.update_log`): each step's gradients are copied into a
        reused host buffer, and a save may store the steps since the last full version instead of
        the state (a *log version*, ``docs/concepts.md``). Pass
        the ``torch.amp.GradScaler`` that steps this optimizer as ``scaler`` (a step it
        skips is logged as skipped); ``mirrors`` are ``(master, copy)`` pairs the trainer
        keeps equal (bf16 copies of fp32 master weights). Restoring a log version replays
        into the guarded optimizer, which must be part of the state restored: guard it
        before ``restore()``. One optimizer is logged per store: guarding another one
        moves the log to it (the next save is then a full version). With several ranks,
        guard on every rank or on none.

        Returns a function that removes the hook and the log. The hook only waits: a
        save's failure is raised by its own handle, never by the optimizer.
        """

        def hook(*_: Any) -> None:
            self.wait_staged()

        # registered before the log's own hook: the log captures a step only once the
        # save before it has been staged (and the version planned)
        handle = optimizer.register_step_pre_hook(hook)
        source: LogSource | None = None
        saves = self._saves
        if log and saves is not None:
            previous = saves.logs
            if previous is not None:
                saves.flush()  # the saves planned with the previous log first
                saves.logs = None
                previous.detach()
            source = LogSource(optimizer, scaler, mirrors)
            saves.logs = source

        def remove() -> None:
            handle.remove()
            if source is not None and saves is not None and saves.logs is source:
                if not self._closed:
                    saves.flush()
                saves.logs = None
                source.detach()

        return remove

    def wait_staged(self) -> None:
        """Block until every save so far has been staged (or has failed)."""
        if self._saves is not None:
            self._saves.wait_staged()

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
        ``role`` forces a base or diff version; left to the store, a save may also be a
        log version when the optimizer is guarded (:meth:`guard`). The save's outcome,
        failure included, is delivered on the returned handle only (``docs/concepts.md``,
        "Guarantees").
        """
        return self._writer().submit(step, state, metadata=metadata, role=role)

    # --- migration ------------------------------------------------------------------------

    def retry_migrations(self) -> int:
        """Retry now the migrations waiting out a backoff (a tier was unreachable); returns
        how many there were. Migrations are retried automatically; this skips the wait."""
        return self._migrations.retry_now() if self._migrations is not None else 0

    def wait_migrations(self, timeout: float | None = None) -> bool:
        """Block until every migration queued so far has settled (committed, or given up),
        or ``timeout`` passed; True if none is pending. A tier that stays unreachable keeps
        its migrations pending (they are retried) until the timeout."""
        if self._migrations is None or self._closed:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        self.flush()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self._migrations.wait(left)

    def pending_migrations(self) -> list[tuple[int, str, str]]:
        """``(version, tier, last error)`` of every migration not settled yet."""
        return self._migrations.pending() if self._migrations is not None else []

    # --- retention and GC -----------------------------------------------------------------

    def gc(self, *, dry_run: bool = False, grace: float | None = None) -> list[GCReport]:
        """Sweep unreferenced blobs from every tier (past the grace period: the policy's,
        or ``grace`` seconds on a fresh clock). Blobs of saves and migrations in flight are
        never swept, in this process or in others sharing a tier; a shared tier another
        process is writing to is skipped (the report's ``fenced`` says so)."""
        if not dry_run:
            self._writer()
        elif self._closed:
            raise CheckpointError("this Checkpointer is closed")
        if grace is not None and grace < 0:
            raise ConfigError(f"grace must be >= 0 seconds, got {grace}")
        self.flush()
        self.refresh()
        return self._maintenance.collect(dry_run=dry_run, grace=grace)

    # --- reading --------------------------------------------------------------------------

    def refresh(self) -> Catalog:
        """Re-read every tier's log (e.g. after another process wrote or a tier was lost)."""
        mark = self._catalog.begin_read()
        try:
            fresh = read_catalog(self.tierset.tiers())
        except BaseException:
            self._catalog.end_read(mark)
            raise
        catalog = self._catalog.install(fresh, mark)
        if self._saves is not None:
            self._saves.note_version_ids(catalog.max_version_id())
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

        All or nothing: every chunk is read and verified into a staging buffer first; only
        then are the caller's tensors written (where dtype and shape match) and modules and
        optimizers given ``load_state_dict``. If no version can be read, ``state`` is left
        as it was; if loading fails (a ``load_state_dict`` raises, say an optimizer with
        other param groups, after the model was loaded), everything written is put back
        first, so ``state`` is again bit for bit as it was, and the error says what failed.
        A ``None`` value is a placeholder for what was saved under its key
        (``info.state[key]``). A DTensor (FSDP2) target is filled in place from its saved
        piece; on another mesh or world size it is assembled from the pieces every rank
        saved, and a plain tensor target gets the whole tensor. Each chunk comes from the
        fastest tier that holds an intact copy; damaged copies are repaired when ``repair``.
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
        source = self._saves.logs if self._saves is not None else None
        # a log version replays into the guarded optimizer: only if the state holds it
        replayer = source if source is not None and _holds(state, source.optimizer) else None
        if explicit:
            try:
                chosen = choose_version(catalog, version=version, step=step)
                candidates = [chosen.id]
                if chosen.role == "log" and replayer is None:
                    candidates = []
                    last_error = NoRestorableVersion(
                        f"version {chosen.id} is a log version: restoring it replays "
                        "optimizer steps into the state's optimizer; call "
                        "guard(optimizer) before restore(state, ...), or restore its base, "
                        f"version {chosen.base}"
                    )
            except NoRestorableVersion as exc:
                candidates, last_error = [], exc
        else:
            candidates = sorted(catalog.restorable_versions(), reverse=True)
        fallback: str | None = None
        if replayer is None and not explicit:
            skipped = [c for c in candidates if catalog.versions[c].role == "log"]
            candidates = [c for c in candidates if catalog.versions[c].role != "log"]
            if skipped and candidates and skipped[0] > candidates[0]:
                fallback = (
                    f"log version(s) {', '.join(map(str, skipped[:5]))} skipped: restoring "
                    "one replays optimizer steps into the guarded optimizer; call "
                    "guard(optimizer) before restore(state), with the optimizer in the state"
                )
                log.warning("%s", fallback)
        self._staging.acquire()
        try:
            # Every rank takes part in each round, so that all agree on one version: the
            # newest every rank can read; if any rank then fails to read it, all try older.
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
                staged: _Staged | None = None
                fatal: TiercheckError | None = None
                # what loading would overwrite, copied while the version is fetched
                undo = Undo()
                try:
                    staged = self._read_version(
                        catalog, catalog.versions[vid], state, strict, repair, undo
                    )
                except (NotFound, TierUnavailable, BlobCorrupt) as exc:
                    last_error = exc
                except TiercheckError as exc:
                    last_error = fatal = exc
                finally:
                    if staged is None:
                        undo.discard()
                if self.coordinator.all_true(staged is not None):
                    assert staged is not None
                    if staged.log is not None:
                        assert replayer is not None
                        return self._load_log(staged, state, t0, replayer, fallback, undo)
                    info = self._load(staged, state, t0, undo)
                    if source is not None:
                        source.invalidate("the state was restored")
                    return dataclasses.replace(info, fallback=fallback)
                undo.discard()
                if fatal is not None:
                    raise fatal
                if explicit:
                    raise NoRestorableVersion(f"version {vid} could not be restored: {last_error}")
                log.warning(
                    "version %d could not be restored (%s); trying an older one", vid, last_error
                )
                fallback = f"version {vid} could not be restored: {last_error}"
                candidates = [c for c in candidates if c < vid]
        finally:
            self._staging.release()

    def _read_version(
        self,
        catalog: Catalog,
        info: VersionInfo,
        state: dict[str, Any] | None,
        strict: bool,
        repair: bool,
        undo: Undo,
    ) -> _Staged:
        """Read and verify this rank's shard of ``info`` into the staging buffer; nothing
        of ``state`` is written (what loading it will overwrite is noted in ``undo`` and
        copied meanwhile). Pieces of distributed tensors this rank's new layout needs
        from other ranks' shards are read and verified too (:mod:`tiercheck.restore.reshard`). A log
        version: its base into the staging buffer, its own shard into a buffer of its own."""
        if info.role == "log":
            assert info.base is not None
            base_info = catalog.versions[info.base]
            base = self._read_version(catalog, base_info, state, strict, repair, undo)
            own = self._read_shard(catalog, info, state, strict, repair, undo, staging=False)
            return dataclasses.replace(own, log=base)
        return self._read_shard(catalog, info, state, strict, repair, undo, staging=True)

    def _read_shard(
        self,
        catalog: Catalog,
        info: VersionInfo,
        state: dict[str, Any] | None,
        strict: bool,
        repair: bool,
        undo: Undo,
        *,
        staging: bool,
    ) -> _Staged:
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
        # a rank the version had no shard for (it was saved by fewer ranks) takes rank 0's
        # tree and plain leaves, and assembles its distributed tensors from every rank
        shard_rank = self.rank if self.rank < len(info.shards) else 0
        manifest = fetcher.manifest(info.shards[shard_rank], order=order)
        # (a log version's distributed tensors are replayed: its base's shard places them)
        if shard_rank != self.rank and not manifest.sharded and manifest.log is None:
            raise NoRestorableVersion(
                f"version {info.id} has {len(info.shards)} shard(s); this is rank {self.rank}"
            )
        target = state if state is not None else {}
        if manifest.log is not None and info.role != "log":
            raise StateError(f"version {info.id} is a {info.role} but its shard holds a log")
        first = _gradient_entries(manifest)
        binding = bind(manifest, target, strict=strict and state is not None, first=first)
        undo.cover(binding)
        undo.keep(self._pool)
        if staging:
            self._staging.ensure(manifest.stream_bytes)
            stream = self._staging.view(manifest.stream_bytes)
        else:  # a log version's shard, beside its base in the staging buffer
            stream = memoryview(bytearray(manifest.stream_bytes))
        fetch_stream(manifest, stream, fetcher, order, self._pool, expect=holders)
        pieces = gather(
            binding.pieces,
            info,
            fetcher,
            order,
            self._pool,
            expect=holders,
            own=(shard_rank, manifest, stream),
        )
        return _Staged(info, manifest, binding, stream, fetcher, order, pieces)

    def _load(
        self, staged: _Staged, state: dict[str, Any] | None, t0: float, undo: Undo
    ) -> RestoreInfo:
        """Load the staged version into ``state``, all or nothing: what it overwrites is
        kept first (``undo``, covering ``staged``), and put back if anything fails, a
        ``load_state_dict`` that raises included."""
        target = state if state is not None else {}
        with undo.on_failure(f"restoring version {staged.info.id}"):
            restored = self._apply(staged, target, undo)
        return self._info(staged, restored, t0)

    def _apply(
        self,
        staged: _Staged,
        target: Any,
        undo: Undo,
        replayed: Mapping[str, Any] | None = None,
    ) -> Any:
        """Write ``staged``'s verified bytes into the caller's tensors and load its
        objects into ``target`` (each change kept by ``undo`` first); the restored state."""
        load_stream(staged.manifest, staged.binding, staged.stream)
        staged.pieces.apply()
        return materialize(
            staged.manifest,
            staged.binding,
            target,
            allow_pickle=self.allow_pickle,
            replayed=replayed,
            undo=undo,
        )

    def _info(
        self, staged: _Staged, restored: Any, t0: float, other: _Staged | None = None
    ) -> RestoreInfo:
        """The RestoreInfo of ``staged``; ``other``'s reads (a log version's base, or the
        log version read before falling back to its base) count too."""
        chunks_from = Counter(staged.fetcher.stats.chunks_from)
        bytes_read = Counter(staged.fetcher.stats.bytes_read)
        repaired = list(staged.fetcher.stats.repaired)
        corrupt = list(staged.fetcher.stats.corrupt)
        if other is not None and other.fetcher is not staged.fetcher:
            chunks_from.update(other.fetcher.stats.chunks_from)
            bytes_read.update(other.fetcher.stats.bytes_read)
            repaired += other.fetcher.stats.repaired
            corrupt += other.fetcher.stats.corrupt
        order = staged.order
        info = staged.info
        source = (
            chunks_from.most_common(1)[0][0] if chunks_from else (order[0].name if order else "")
        )
        return RestoreInfo(
            version=info.id,
            step=info.step,
            role=info.role,
            metadata=dict(info.metadata),
            source=source,
            chunks_from=dict(chunks_from),
            bytes_read=dict(bytes_read),
            repaired=tuple(repaired),
            corrupt=tuple(corrupt),
            seconds=time.perf_counter() - t0,
            state=restored,
        )

    def _load_log(
        self,
        staged: _Staged,
        state: dict[str, Any] | None,
        t0: float,
        source: LogSource,
        fallback: str | None,
        undo: Undo,
    ) -> RestoreInfo:
        """Load a log version's base, replay the steps, load its own leaves. If the replay
        is refused or does not verify on any rank, load the base again (it is staged and
        verified): the state is then the base version's, and ``fallback`` says why.

        All or nothing like :meth:`_load`: what the base, the replay (the guarded
        optimizer, its parameters' gradients, the GradScaler, the mirrors) and the log
        version's own leaves overwrite is kept first; if any of it raises (a replayed
        ``optimizer.step()``, a ``load_state_dict``), the state is put back as it was and
        a typed error says what failed. A refused or unverified replay is no failure:
        the base is restored instead, as above."""
        base = staged.log
        assert base is not None and state is not None
        target = state
        what = f"restoring log version {staged.info.id}"
        optimizer = source.optimizer
        undo.object("the guarded optimizer", optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for p in params:
            undo.tensor(p)
        undo.grads(params)
        for _, copy in source.mirrors:
            undo.tensor(copy)
        if source.scaler is not None and is_stateful(source.scaler):
            undo.object("the guarded GradScaler", source.scaler)
        with undo.on_failure(what):
            self._apply(base, target, undo)
            error: Exception | None = None
            crash: Exception | None = None
            undo.touched(optimizer)
            if source.scaler is not None and is_stateful(source.scaler):
                undo.touched(source.scaler)
            try:
                writers = len(staged.info.shards)
                if writers != self.world_size:  # logged on another layout: replay there
                    logs = [self.version(staged.info.id, rank=r) for r in range(writers)]
                    report, replayed = replay_version_resharded(source, logs)
                else:
                    report, replayed = replay_version(source, staged.manifest, staged.stream)
            except ReplayError as exc:
                error = exc
            except Exception as exc:  # not a refusal: the replay itself broke
                error = crash = exc
            if not self.coordinator.all_true(error is None):
                # every rank agrees first whether any replay broke (then all undo), else
                # all fall back to the base
                if not self.coordinator.all_true(crash is None):
                    why = (
                        f"{type(crash).__name__}: {crash}"
                        if crash is not None
                        else "it failed on another rank"
                    )
                    raise StateError(
                        f"replaying the optimizer steps of log version {staged.info.id} "
                        f"failed ({why})"
                    ) from crash
                why = str(error) if error is not None else "another rank could not replay it"
                self._apply(base, target, undo)
                source.invalidate("the state was restored")
                note = (
                    f"log version {staged.info.id} could not be replayed exactly ({why}); "
                    f"restored its base, version {base.info.id}"
                )
                log.warning("%s", note)
                info = self._info(base, target, t0, staged)
                return dataclasses.replace(info, fallback=note)
            restored = self._apply(staged, target, undo, replayed)
        source.invalidate("the state was restored")
        info = self._info(staged, restored, t0, base)
        log.info(
            "restored log version %d: base %d and %d step(s) replayed and verified",
            staged.info.id,
            base.info.id,
            report.steps,
        )
        return dataclasses.replace(info, replayed_steps=report.steps, fallback=fallback)

    def history(self) -> list[Version]:
        """Every committed version, oldest first, with where it is held.

        Reads the logs only; each :class:`~tiercheck.history.versions.Version` opens its content
        lazily (``v.entries``, ``v[key]``, ``v.to_state_dict()``).
        """
        self.flush()
        catalog = self.refresh() if not self._closed else self._catalog.snapshot()
        pending = {(v, t) for v, t, _ in self.pending_migrations()}
        return build_history(self, catalog, pending=pending)

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
        """What changed from ``a`` to ``b`` (see :func:`tiercheck.history.diff.diff`)."""
        return diff_versions(self.version(a), self.version(b))

    # --- lifecycle ------------------------------------------------------------------------

    def flush(self) -> None:
        """Block until every save submitted so far has finished, and the retention and GC
        they triggered have run (not migrations: see :meth:`wait_migrations`)."""
        if self._closed:
            return
        if self._saves is not None:
            self._saves.flush()
        self._maintenance.flush()

    def close(
        self,
        *,
        wait_migrations: bool = True,
        timeout: float | None = None,
        abandon: bool = False,
    ) -> None:
        """Finish pending saves and migrations, close the tiers, release the store.

        Saves and then migrations still pending are waited for (migrations retried) for up
        to ``timeout`` seconds together (no limit by default). Then every background thread
        is halted: work not started is cancelled, and none starts a new tier call. The
        tiers are closed and the store lock released once the threads have ended; one still
        inside a tier call at the deadline is not waited for: ``close`` returns, and the
        tiers and the lock are released when it ends (:meth:`wait_closed`). If any
        migration or save is left unfinished, or any save failed without its handle having
        raised the error, or an engine thread failed,
        :class:`~tiercheck.errors.UnfinishedWork` lists them.
        ``abandon=True`` does not wait for migrations and logs what was left instead of
        raising (``wait_migrations=False`` is the older spelling of it). Versions committed
        in the synchronous tiers stay committed either way.
        """
        if self._closed:
            return
        abandon = abandon or not wait_migrations
        deadline = None if timeout is None else time.monotonic() + timeout
        unfinished: list[tuple[int, str, str]] = []
        try:
            if self._saves is not None:
                self._saves.drain(_left(deadline))  # one still running is named below
            if self._migrations is not None:
                unfinished = self._migrations.stop(timeout=_left(deadline), abandon=abandon)
        finally:
            self._closed = True
            running = self._shut_down(deadline)
        migration = self._migrations.running() if running and self._migrations else None
        if migration is not None:
            unfinished.append((*migration, "still running at close"))
        saves, background = self._failures.unseen()
        if not (unfinished or saves or background or running):
            return
        parts = []
        if unfinished:
            parts.append(
                "migrations left unfinished: "
                + "; ".join(f"version {v} to {t} ({why})" for v, t, why in unfinished)
            )
        if saves:
            parts.append(
                "saves that failed unseen: "
                + "; ".join(f"step {s} (version {v}): {e}" for s, v, e in saves)
            )
        if background:
            parts.append("background failures: " + "; ".join(background))
        if running:
            parts.append(
                f"still running at close, in a tier call: {'; '.join(running)} (halted: it "
                "starts no further tier call; the tiers are closed and the store lock "
                "released when it ends, see wait_closed())"
            )
        message = f"{self.root} closed with " + "; ".join(parts)
        if abandon:
            log.warning("%s (abandoned)", message)
            return
        raise UnfinishedWork(
            message,
            migrations=tuple(unfinished),
            saves=tuple(saves),
            background=tuple(background),
            running=tuple(running),
        )

    def _shut_down(self, deadline: float | None) -> list[str]:
        """Halt every background thread (no new tier call from now on; the work queued is
        cancelled), then wait for them until ``deadline``. The tiers are closed and the
        lock released after the last one ends: here, or by a closing thread left to it
        when one is still in a tier call at the deadline. Returns what still runs then."""
        self._halt.set("the store is closing")
        if self._saves is not None:
            self._saves.stop()
        self._maintenance.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        closer = threading.Thread(target=self._release_all, name="tiercheck-close", daemon=True)
        self._closer = closer
        closer.start()
        closer.join(_left(deadline))
        if not closer.is_alive():
            return []
        running: list[str] = []
        migration = self._migrations.running() if self._migrations is not None else None
        if migration is not None:
            running.append(f"the migration of version {migration[0]} to {migration[1]}")
        if self._saves is not None:
            running += self._saves.running()
        active = self._maintenance.active()
        if active is not None:
            running.append(active)
        return running or ["the store's I/O threads"]

    def _release_all(self) -> None:
        """Once every background thread has ended: close the tiers, release the lock."""
        try:
            if self._migrations is not None:
                self._migrations.join()
            if self._saves is not None:
                self._saves.join()
            self._maintenance.join()
            self._pool.shutdown(wait=True)
        finally:
            self.tierset.close()
            self._release_lock()

    def wait_closed(self, timeout: float | None = None) -> bool:
        """Block until :meth:`close` has closed the tiers and released the store lock, or
        ``timeout`` passed; True once it has. A close that reached its timeout while a
        background thread was still in a tier call leaves that to when the thread ends."""
        closer = self._closer
        if closer is None:
            return self._closed
        closer.join(timeout)
        return not closer.is_alive()

    def destroy(self) -> None:
        """Close, then delete this store: its root, shm segments and LMDB environments
        (see :func:`tiercheck.engine.lifecycle.destroy_store`; remote tiers are kept)."""
        from tiercheck.engine.lifecycle import destroy_store

        self.close()
        destroy_store(self.root)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # while an exception propagates, report unfinished work in the log, not over it
        self.close(abandon=exc_type is not None)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self._release_lock()
            except Exception:
                pass


@dataclass(frozen=True)
class _Staged:
    """A version read and verified into the staging buffer, not loaded yet."""

    info: VersionInfo
    manifest: ShardManifest
    binding: Binding
    stream: memoryview
    fetcher: ChunkFetcher
    order: list[TierSlot]
    pieces: Gathered
    log: _Staged | None = None  # a log version's base, staged (then this is its own shard)


def _holds(state: Any, obj: object, depth: int = 0) -> bool:
    """Whether ``obj`` is ``state`` or one of its values (through dicts, lists, tuples)."""
    if state is obj:
        return True
    if depth > 64:
        return False
    if isinstance(state, dict):
        return any(_holds(v, obj, depth + 1) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(_holds(v, obj, depth + 1) for v in state)
    return False


def _gradient_entries(manifest: ShardManifest) -> int:
    """How many of a shard's first entries are a log version's gradients (SPEC.md 12.3)."""
    if manifest.log is None:
        return 0
    used = [g for s in manifest.log.steps for g in s.grads if g is not None]
    return max(used) + 1 if used else 0


def _left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (``time.monotonic()``), at least 0; None for no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _check_same_tiers(path: Path, stored: StoreConfig, wanted: StoreConfig) -> None:
    """Raise ConfigError if ``wanted`` names other tiers than the store's file at ``path``:
    rewriting it would leave the store's versions behind in tiers it no longer opens.
    Tiers are compared by name and URL: options (a budget, credentials the file never
    holds) may change from one open to the next."""
    if [(t.name, t.url) for t in stored.tiers] == [(t.name, t.url) for t in wanted.tiers]:
        return

    def names(cfg: StoreConfig) -> str:
        return ", ".join(f"{t.name} = {t.url}" for t in cfg.tiers)

    raise ConfigError(
        f"{path} configures the tiers [{names(stored)}], not [{names(wanted)}]: the store's "
        "versions are in the configured tiers. Open it without tiers= to use them, with "
        "read_only=True to read other tiers without changing the file, or pass "
        "rewrite_config=True to replace its tiers"
    )


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
