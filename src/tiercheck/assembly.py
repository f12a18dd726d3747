"""The engine of one open store: its services, the state they share, its threads.

:class:`Engine` opens what a :class:`~tiercheck.Checkpointer` runs on and closes it again:

- the tiers (:class:`~tiercheck.store.tierset.TierSet`) and the merged view of their logs
  (:class:`~tiercheck.store.catalog.LiveCatalog`);
- the executors (:class:`~tiercheck.runtime.executors.Executors`): the thread pools every
  service reads, hashes and writes on, shut down when the store closes;
- the staging buffer, reused by every save and restore;
- the GC fence and the leases in shared tiers (:mod:`tiercheck.store.leases`);
- the services: :class:`~tiercheck.engine.saving.SaveService` (its pipeline thread),
  :class:`~tiercheck.upkeep.migration.MigrationService` (its own thread, with retries) and
  :class:`~tiercheck.upkeep.maintenance.Maintenance` (retention and GC, a thread per tier);
- :class:`~tiercheck.runtime.handles.Failures`: failures nobody has seen yet, for ``close()``.

A save commits, then queues migrations and requests maintenance; a migration requests
maintenance; maintenance asks the saves and migrations which versions they still need
(:meth:`Engine.pinned`), so that retention never drops them. The store's configuration is
resolved here too (:func:`resolve_config`), before the engine opens.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiercheck.backends.base import FailureDomain
from tiercheck.core.chunking import choose_chunk_size, plan_layout
from tiercheck.core.entries import as_dict, flatten
from tiercheck.engine.coordinator import Coordinator, DistCoordinator, LocalCoordinator
from tiercheck.engine.saving import SaveService
from tiercheck.engine.shm_staging import ShmStaging
from tiercheck.engine.staging import StagingBuffer, cuda_devices
from tiercheck.errors import CheckpointError, ConfigError, UnfinishedWork
from tiercheck.logversions.planner import LogSource
from tiercheck.restore.losses import AckLedger, newest_acked
from tiercheck.runtime.background import Halt
from tiercheck.runtime.executors import Executors, Priority
from tiercheck.runtime.handles import Failures
from tiercheck.store.catalog import Catalog, LiveCatalog, read_catalog
from tiercheck.store.config import (
    CONFIG_NAME,
    StoreConfig,
    TierSpec,
    coerce_tiers,
    default_config,
    expand_root,
    load_config,
    save_config,
    without_userinfo,
)
from tiercheck.store.leases import GCFence, StoreLock, TierLeases
from tiercheck.store.policy import Policy
from tiercheck.store.tierset import TierSet
from tiercheck.upkeep.maintenance import Maintenance
from tiercheck.upkeep.migration import MigrationService
from tiercheck.upkeep.retention import GCReport

if TYPE_CHECKING:
    import torch

__all__ = ["Engine", "default_coordinator", "open_engine", "resolve_config", "write_config"]

log = logging.getLogger(__name__)


class Engine:
    """The services of the store rooted at ``root``, opened with ``config``.

    Opening takes the tiers, reads their logs and starts the threads; ``lock`` (the
    store's writer lock, None when read-only) is the engine's from then on: it is released
    once every thread has ended, by :meth:`close`, or at once if opening fails (then
    everything opened so far is closed, and the store file ``made`` by this open removed,
    before the error propagates).
    """

    def __init__(
        self,
        root: Path,
        config: StoreConfig,
        coordinator: Coordinator,
        *,
        read_only: bool,
        allow_pickle: bool,
        threads: int | None,
        priority: Priority,
        lock: StoreLock | None,
        made: Path | None = None,
    ) -> None:
        self.root = root
        self._made = made  # the store file this open created, removed if it fails
        self.policy = config.policy
        self.coordinator = coordinator
        self.rank = coordinator.rank
        self.world_size = coordinator.world_size
        self.read_only = read_only
        self.allow_pickle = allow_pickle
        self.closed = False
        self._lock = lock
        self._halt = Halt()
        self._closer: threading.Thread | None = None
        self.migrations: MigrationService | None = None
        self.saves: SaveService | None = None
        # a read-only store's guarded optimizer: no saves to log for, restores replay into it
        self._replay_into: LogSource | None = None
        try:
            self._open(config, threads, priority)
        except BaseException:
            self._abort_open()
            raise

    def _open(self, config: StoreConfig, threads: int | None, priority: Priority) -> None:
        """Open the tiers, read their logs, start the services (the lock is taken)."""
        read_only = self.read_only
        specs = [_for_rank(spec, self.coordinator) for spec in config.tiers]
        self.tierset = TierSet(
            specs, self.policy, read_only=read_only, owner=self.root, created=self._made is not None
        )
        # rank 0 made the store file: every rank's tiers are as new (none can hold a version
        # of an id drawn now), whichever of them could not be read
        self.tierset.created = not self.coordinator.all_true(not self.tierset.created)
        self.executors = Executors.start(threads, priority)
        self.pool = self.executors.io
        self.staging = StagingBuffer()
        self.shm_staging: ShmStaging | None = None
        self.failures = Failures()
        self.catalog = LiveCatalog(read_catalog(self.tierset.tiers(), pool=self.executors.logs))
        fence = GCFence()
        leases = TierLeases()
        newest = max(
            self.catalog.snapshot().max_version_id(),
            newest_acked(self.root, self.rank, self.tierset.store_id),
        )
        next_id = self.coordinator.agree_max(newest) + 1
        takes_diffs = self.coordinator.all_true(
            any(
                s.policy is not None and s.policy.mode == "sync" and s.policy.versions == "all"
                for s in self.tierset.open()
            )
        )
        self.maintenance = Maintenance(
            tierset=self.tierset,
            policy=self.policy,
            catalog=self.catalog,
            fence=fence,
            leases=leases,
            pinned=self.pinned,
            failures=self.failures,
            rank=self.rank,
            halt=self._halt,
        )
        if read_only:
            return
        self.migrations = MigrationService(
            tierset=self.tierset,
            policy=self.policy,
            catalog=self.catalog,
            fence=fence,
            leases=leases,
            pool=self.executors.migrating,
            writes=self.executors.writes,
            maintenance=self.maintenance,
            failures=self.failures,
            rank=self.rank,
            world_size=self.world_size,
            broken=lambda: getattr(self.coordinator, "broken", None),
            halt=self._halt,
        )
        self.saves = SaveService(
            tierset=self.tierset,
            policy=self.policy,
            coordinator=self.coordinator,
            catalog=self.catalog,
            fence=fence,
            leases=leases,
            staging=self.staging,
            pool=self.pool,
            hashing=self.executors.hashing,
            migrations=self.migrations,
            maintenance=self.maintenance,
            failures=self.failures,
            allow_pickle=self.allow_pickle,
            next_id=next_id,
            takes_diffs=takes_diffs,
            halt=self._halt,
            priority=priority,
            confirmed=self.coordinator.agree_restorable(
                self.catalog.snapshot().restorable_versions()
            ),
        )
        self.saves.acknowledged = AckLedger(self.root, self.tierset, self.rank).note
        self.shm_staging = ShmStaging(
            self.tierset, self.policy, self.world_size, self.maintenance.make_room
        )
        self.staging.area_for = self.shm_staging.area_for
        self.staging.before_arm = self.shm_staging.before_arm
        # sweep once after opening: what a crashed writer left behind
        self.maintenance.request(s.name for s in self.tierset.slots)

    def _abort_open(self) -> None:
        """Opening failed: stop every thread it started, close every tier it opened and
        release the store lock, so that the caller may open the store again."""
        self.closed = True
        self._halt.set("opening the store failed")
        steps: list[Callable[[], object]] = []
        if self.saves is not None:
            steps.append(self.saves.close)
        if self.migrations is not None:
            steps += [functools.partial(self.migrations.stop, abandon=True), self.migrations.join]
        maintenance: Maintenance | None = getattr(self, "maintenance", None)
        if maintenance is not None:
            steps.append(maintenance.close)
        executors: Executors | None = getattr(self, "executors", None)
        if executors is not None:
            steps.append(functools.partial(executors.shutdown, wait=True, cancel_futures=True))
        tierset: TierSet | None = getattr(self, "tierset", None)
        if tierset is not None:
            steps.append(functools.partial(tierset.close, unmake=self._made is not None))
        for step in steps:
            try:
                step()
            except Exception:  # the caller hears of what made the open fail, not of this
                log.exception("releasing what a failed open of %s took", self.root)
        if self._made is not None:  # under the lock: no other open has read it
            self._made.unlink(missing_ok=True)
        self.release_lock()

    def release_lock(self) -> None:
        """Release the store's writer lock (once; a read-only engine holds none)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # --- what the services ask each other -------------------------------------------------

    #: versions held by :meth:`hold`: a protocol above the store still needs them
    held: frozenset[int] = frozenset()

    def hold(self, versions: Iterable[int]) -> None:
        """Keep ``versions`` (and what they need) from retention until the next call
        replaces them; the versions held before go at the next retention."""
        self.held = frozenset(versions)

    def pinned(self) -> set[int]:
        """The versions saves and migrations in flight still need, and those held
        (:meth:`hold`), with the bases each needs: retention keeps them. The bases are
        named here, not left to each tier's retention: a tier keeps the base of a version it
        holds, but a held diff in shm alone needs its base kept in LMDB too."""
        out: set[int] = set(self.held)
        if self.saves is not None:
            out |= self.saves.pinned()
        if self.migrations is not None:
            out |= self.migrations.pinned()
        versions = self.catalog.snapshot().versions
        todo = list(out)
        while todo:
            info = versions.get(todo.pop())
            if info is not None and info.base is not None and info.base not in out:
                out.add(info.base)
                todo.append(info.base)
        return out

    def check_open(self) -> None:
        """Raise CheckpointError once :meth:`close` has run."""
        if self.closed:
            raise CheckpointError("this Checkpointer is closed")

    def writer(self) -> SaveService:
        """The save service; raises CheckpointError if closed or opened read-only."""
        self.check_open()
        if self.saves is None:
            raise CheckpointError(f"{self.root} was opened read-only")
        return self.saves

    def refresh(self) -> Catalog:
        """Re-read every tier's log and install it as the catalog."""
        mark = self.catalog.begin_read()
        try:
            fresh = read_catalog(self.tierset.tiers(), pool=self.executors.logs)
        except BaseException:
            self.catalog.end_read(mark)
            raise
        catalog = self.catalog.install(fresh, mark)
        if self.saves is not None:
            self.saves.note_version_ids(catalog.max_version_id())
        return catalog

    def flush(self) -> None:
        """Block until the saves submitted so far and the maintenance they asked for ran."""
        if self.closed:
            return
        if self.saves is not None:
            self.saves.flush()
        self.maintenance.flush()

    # --- saving ---------------------------------------------------------------------------

    def prepare(self, state: Mapping[str, Any]) -> None:
        """Allocate the staging buffer for ``state`` (or the shm staging area its saves
        will use); note its size for the budgets."""
        self.check_open()
        tree, leaves = flatten(as_dict(state), allow_pickle=self.allow_pickle)
        layout = plan_layout(leaves, choose_chunk_size(leaves, self.policy.chunk_size))
        devices = cuda_devices(leaves)  # pinned under the state's own device
        self.staging.acquire()  # not while a save is using it
        try:
            area = None
            if self.shm_staging is not None and not devices:
                area = self.shm_staging.area_for(layout)
            if self.saves is not None:
                self.saves.note_state(tree, layout, staged=area)
            if area is None:
                self.staging.ensure(
                    layout.stream_bytes + (1 << 20),
                    pinned=bool(devices),
                    device=devices[0] if devices else None,
                )
        finally:
            self.staging.release()

    def guard(
        self,
        optimizer: torch.optim.Optimizer,
        scaler: Any,
        *,
        log: bool,
        mirrors: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> Callable[[], None]:
        """Hook ``optimizer.step()`` to wait for staging and attach the update log; see
        :meth:`tiercheck.Checkpointer.guard`. Returns what removes both."""
        self.check_open()
        import torch

        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "guard takes the torch.optim.Optimizer whose step() waits for the saves, got "
                f"{type(optimizer).__qualname__} (a model is saved and restored in the state)"
            )
        saves = self.saves

        def hook(*_: Any) -> None:
            if saves is not None:
                saves.give_way()  # latest wins: never wait for an earlier save's tiers

        # registered before the log's own hook: the log captures a step only once the
        # save before it has been staged (and the version planned)
        handle = optimizer.register_step_pre_hook(hook)
        if saves is not None:
            saves.guarded += 1
        source: LogSource | None = None
        if log and saves is not None:
            previous = saves.logs
            if previous is not None:
                saves.flush()  # the saves planned with the previous log first
                saves.logs = None
                previous.detach()
            source = LogSource(optimizer, scaler, mirrors)
            saves.logs = source
        elif log:
            # read-only: the log stays unusable (no full version is ever saved here), so
            # its hooks capture nothing; a restore replays log versions into the optimizer
            if self._replay_into is not None:
                self._replay_into.detach()
            source = self._replay_into = LogSource(optimizer, scaler, mirrors, prepare=False)

        removed = False

        def remove() -> None:
            nonlocal removed
            if removed:
                return
            removed = True
            handle.remove()
            if saves is not None:
                saves.guarded -= 1
            if source is not None and saves is not None and saves.logs is source:
                if not self.closed:
                    saves.flush()
                saves.logs = None
                source.detach()
            elif source is not None and self._replay_into is source:
                self._replay_into = None
                source.detach()

        return remove

    def logs(self) -> LogSource | None:
        """The guarded optimizer's update log, if one is attached."""
        return self.saves.logs if self.saves is not None else self._replay_into

    # --- migrations and GC ----------------------------------------------------------------

    def wait_migrations(self, timeout: float | None) -> bool:
        """Block until the migrations queued so far settled and the maintenance they asked
        for ran (retention, the deletion of what a failed one wrote), or ``timeout`` passed."""
        if self.migrations is None or self.closed:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        self.flush()
        if not self.migrations.wait(_left(deadline)):
            return False
        return self.maintenance.flush(_left(deadline))

    def collect(self, *, dry_run: bool, grace: float | None) -> list[GCReport]:
        """Sweep unreferenced blobs from every tier; see :meth:`tiercheck.Checkpointer.gc`."""
        if not dry_run:
            self.writer()
        else:
            self.check_open()
        if grace is not None and grace < 0:
            raise ConfigError(f"grace must be >= 0 seconds, got {grace}")
        if not dry_run:  # retention first: what it drops is swept with the rest
            self.maintenance.request(s.name for s in self.tierset.slots)
        self.flush()
        self.refresh()
        return self.maintenance.collect(dry_run=dry_run, grace=grace)

    # --- closing --------------------------------------------------------------------------

    def close(self, *, timeout: float | None, abandon: bool) -> None:
        """Finish, halt and release everything; see :meth:`tiercheck.Checkpointer.close`."""
        if self.closed:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        unfinished: list[tuple[int, str, str]] = []
        try:
            if self.saves is not None:
                self.saves.drain(_left(deadline))  # one still running is named below
            if self.migrations is not None:
                unfinished = self.migrations.stop(timeout=_left(deadline), abandon=abandon)
            if not abandon:  # the retention the last saves asked for in the tiers of this
                # machine (quick, and what it drops is memory and disk freed); a remote's is
                # left to the next open, as a slow or unreachable remote must not hold close
                local = [
                    s.name
                    for s in self.tierset.slots
                    if s.tier is not None
                    and s.tier.capabilities.survives.order <= FailureDomain.PROCESS.order
                ]
                self.maintenance.flush(_left(deadline), tiers=local)
        finally:
            self.closed = True
            running = self._shut_down(deadline)
        migration = self.migrations.running() if running and self.migrations else None
        if migration is not None:
            unfinished.append((*migration, "still running at close"))
        saves, background = self.failures.unseen()
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
        if self.saves is not None:
            self.saves.stop()
        self.maintenance.stop()
        self.executors.shutdown(wait=False, cancel_futures=True)
        closer = threading.Thread(target=self._release_all, name="tiercheck-close", daemon=True)
        self._closer = closer
        closer.start()
        closer.join(_left(deadline))
        if not closer.is_alive():
            return []
        running: list[str] = []
        migration = self.migrations.running() if self.migrations is not None else None
        if migration is not None:
            running.append(f"the migration of version {migration[0]} to {migration[1]}")
        if self.saves is not None:
            running += self.saves.running()
        active = self.maintenance.active()
        if active is not None:
            running.append(active)
        return running or ["the store's I/O threads"]

    def _release_all(self) -> None:
        """Once every background thread has ended: close the tiers, release the lock."""
        try:
            if self.migrations is not None:
                self.migrations.join()
            if self.saves is not None:
                self.saves.join()
            self.maintenance.join()
            self.executors.shutdown(wait=True)
        finally:
            if self.shm_staging is not None:
                self.staging.close_area()
                self.shm_staging.close()
            self.tierset.close()
            self.release_lock()

    def dropped(self) -> None:
        """Its Checkpointer was dropped without ``close()``: close as ``close(abandon=True)``
        would (saves in flight finished, then the threads, tiers and lock released), with
        a ``ResourceWarning``; on one of the store's own threads (which the close waits
        for) by a thread of its own. Not while the interpreter finalizes: the exit hook
        closed a writable store before its threads ended (``at_interpreter_exit``), and
        a read-only one holds nothing past the process (waiting for threads that are
        gone would hang the exit)."""
        if self.closed or sys.is_finalizing():
            return
        warnings.warn(
            f"tiercheck.Checkpointer({str(self.root)!r}) was not closed; closing it now "
            "(use `with Checkpointer(...)` or call close())",
            ResourceWarning,
            stacklevel=3,
        )
        if threading.current_thread().name.startswith("tiercheck"):
            threading.Thread(target=self._close_dropped, name="tiercheck-close").start()
        else:
            self._close_dropped()

    def _close_dropped(self) -> None:
        try:
            self.close(timeout=None, abandon=True)
        except Exception as exc:  # nobody to raise to: the store was dropped
            log.warning("closing a dropped store %s: %s", self.root, exc)

    def wait_closed(self, timeout: float | None) -> bool:
        """Block until the tiers are closed and the lock released, or ``timeout`` passed."""
        closer = self._closer
        if closer is None:
            return self.closed
        closer.join(timeout)
        return not closer.is_alive()


def _left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (``time.monotonic()``), at least 0; None for no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


# --- opening: the configuration and the coordinator -------------------------------------


def resolve_config(
    root: Path,
    tiers: Sequence[str | TierSpec | tuple[str, str]] | None,
    policy: Policy | None,
    config: str | os.PathLike[str] | None,
    *,
    read_only: bool,
    multi_rank: bool,
) -> tuple[StoreConfig, bool]:
    """The configuration of the store at ``root``, and whether it is to be written to its
    file (once the lock is taken: :func:`write_config`). Several ranks cannot skip saves
    (``on_busy="skip"``): one rank's skip would leave the others waiting in the commit."""
    path = root / CONFIG_NAME
    write = not read_only
    if config is not None:
        cfg = load_config(Path(config))
    elif tiers is None and path.exists():
        cfg = load_config(path)
    elif tiers is None:
        if read_only:
            raise ConfigError(f"{root} is not a tiercheck store (no {CONFIG_NAME})")
        cfg = default_config(root, multi_rank=multi_rank)
        if policy is None:
            # ranks opening one new root race to create it: the first config written wins
            root.mkdir(parents=True, exist_ok=True)
            if not save_config(path, cfg, exclusive=True):
                cfg = load_config(path)
            write = False
    else:
        cfg = StoreConfig(coerce_tiers(tiers), Policy())
    if policy is not None:
        cfg = StoreConfig(cfg.tiers, policy)
    if multi_rank and cfg.policy.on_busy == "skip":
        raise ConfigError("on_busy='skip' needs one process; with several ranks use 'wait'")
    return cfg, write


def open_engine(
    root: Path,
    config: StoreConfig,
    coordinator: Coordinator,
    *,
    write: bool,
    fresh: bool,
    rewrite: bool,
    read_only: bool,
    allow_pickle: bool,
    threads: int | None,
    priority: Priority,
) -> Engine:
    """Take the store's writer lock (unless ``read_only``), write its file if ``write``
    (:func:`write_config`, rank 0 only: the ranks share it, and each may pass tiers of its
    own, a peer per rank), and open the :class:`Engine`, which holds the lock from then on.

    ``fresh``: there was no store file before this open. If opening then fails (a tier
    another store owns, say), the file this open wrote is removed before the lock is
    released: no store was made, and the next open of the root starts a new one instead
    of finding tiers it never held configured there."""
    lock: StoreLock | None = None
    if not read_only:
        root.mkdir(parents=True, exist_ok=True)
        lock = StoreLock(root, coordinator.rank if coordinator.world_size > 1 else None)
    made = root / CONFIG_NAME if fresh and coordinator.rank == 0 and not read_only else None
    try:
        # under the lock: never under a writer that has the store open
        if write and coordinator.rank == 0:
            write_config(root, config, rewrite=rewrite)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return Engine(
        root,
        config,
        coordinator,
        read_only=read_only,
        allow_pickle=allow_pickle,
        threads=threads,
        priority=priority,
        lock=lock,
        made=made,
    )


def write_config(root: Path, config: StoreConfig, *, rewrite: bool) -> None:
    """Write ``config`` to the store's file; unless ``rewrite``, refuse other tiers than
    the file names (:func:`_check_same_tiers`)."""
    path = root / CONFIG_NAME
    if not rewrite and path.exists():
        _check_same_tiers(path, load_config(path), config)
    save_config(path, config)


def _check_same_tiers(path: Path, stored: StoreConfig, wanted: StoreConfig) -> None:
    """Raise ConfigError if ``wanted`` names other tiers than the store's file at ``path``:
    rewriting it would leave the store's versions behind in tiers it no longer opens.
    Tiers are compared by name and URL without its user and password: options (a budget,
    credentials the file never holds, in the URL or not) may change from one open to the
    next."""
    root = path.parent.resolve()

    def tiers(cfg: StoreConfig) -> list[tuple[str, str]]:
        return [(t.name, without_userinfo(expand_root(t, root).url)) for t in cfg.tiers]

    if tiers(stored) == tiers(wanted):
        return

    def names(cfg: StoreConfig) -> str:
        return ", ".join(f"{t.name} = {without_userinfo(t.url)}" for t in cfg.tiers)

    raise ConfigError(
        f"{path} configures the tiers [{names(stored)}], not [{names(wanted)}]: the store's "
        "versions are in the configured tiers. Open it without tiers= to use them, with "
        "read_only=True to read other tiers without changing the file, or pass "
        "rewrite_config=True to replace its tiers"
    )


def default_coordinator() -> Coordinator:
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
