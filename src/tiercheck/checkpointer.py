"""The public entry point: :class:`Checkpointer`, a store of checkpoint versions.

A ``Checkpointer`` is the front of the library, and it only delegates:

- saving, migrations, GC and the store's threads to the engine
  (:class:`~tiercheck.assembly.Engine`, which owns the tiers, the catalog, the executors,
  the staging buffer and the services: :class:`~tiercheck.engine.saving.SaveService`,
  :class:`~tiercheck.upkeep.migration.MigrationService`,
  :class:`~tiercheck.upkeep.maintenance.Maintenance`);
- restoring to :class:`~tiercheck.restore.service.RestoreService`;
- browsing history to :mod:`tiercheck.history`.

``docs/architecture.md`` draws the two pipelines. What each call promises is written in
:mod:`tiercheck.store.guarantees` and in ``docs/concepts.md`` ("Guarantees").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from tiercheck.assembly import Engine, default_coordinator, open_engine, resolve_config
from tiercheck.engine.coordinator import Coordinator
from tiercheck.formats.manifest import Role
from tiercheck.history.diff import Diff
from tiercheck.history.diff import diff as diff_versions
from tiercheck.history.versions import Version, VersionSummary, build_history, open_version
from tiercheck.restore.info import RestoreInfo
from tiercheck.restore.service import RestoreService
from tiercheck.runtime.background import at_interpreter_exit
from tiercheck.runtime.executors import Background, Executors, Priority
from tiercheck.runtime.handles import Failures, SaveHandle, SaveResult
from tiercheck.store.catalog import Catalog
from tiercheck.store.config import CONFIG_NAME, TierSpec
from tiercheck.store.policy import Policy
from tiercheck.store.tierset import TierSet
from tiercheck.upkeep.retention import GCReport

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
        background: Background = "low",
        rewrite_config: bool = False,
    ) -> None:
        priority = Priority(background)  # a bad value is refused before anything is made
        self.root = Path(root).expanduser().resolve()
        self.read_only = read_only
        self.allow_pickle = allow_pickle
        self.coordinator: Coordinator = coordinator or default_coordinator()
        self.rank = self.coordinator.rank
        self.world_size = self.coordinator.world_size
        fresh = not (self.root / CONFIG_NAME).exists()
        self.config, write = resolve_config(
            self.root, tiers, policy, config, read_only=read_only, multi_rank=self.world_size > 1
        )
        self.policy = self.config.policy
        self._engine = open_engine(
            self.root,
            self.config,
            self.coordinator,
            write=write,
            fresh=fresh,
            rewrite=rewrite_config,
            read_only=read_only,
            allow_pickle=allow_pickle,
            threads=threads,
            priority=priority,
        )
        self.tierset: TierSet = self._engine.tierset
        if not read_only:  # saves in flight at exit are finished, not failed halfway
            # the engine's: one dropped unclosed is closed by __del__ (Engine.dropped)
            at_interpreter_exit(self._engine, lambda e: e.close(timeout=None, abandon=True))
        self._restores = RestoreService(
            tierset=self.tierset,
            policy=self.policy,
            coordinator=self.coordinator,
            staging=self._engine.staging,
            pool=self._engine.pool,
            flush=self.flush,
            refresh=self.refresh,
            logs=self._engine.logs,
            version=lambda vid, rank: self.version(vid, rank=rank),
            read_only=read_only,
            allow_pickle=allow_pickle,
            root=self.root,
        )

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (versions read from the store need it open)."""
        return self._engine.closed

    @property
    def failures(self) -> Failures:
        """Failures nobody has seen yet, which :meth:`close` raises. An integration that
        runs work of its own on a thread records its failures here too
        (:func:`tiercheck.runtime.background.reporting`)."""
        return self._engine.failures

    @property
    def executors(self) -> Executors:
        """The store's thread pools (I/O, writes, hashing, log reads), which history and
        verify run their parallel reads on; shut down by :meth:`close`."""
        return self._engine.executors

    # --- saving ---------------------------------------------------------------------------

    def prepare(self, state: Mapping[str, Any]) -> None:
        """Allocate the staging buffer for ``state`` now, so the first save pays nothing;
        the default memory budgets (:mod:`tiercheck.store.budgets`) are set for its size
        too, and the tiers ready the pages of their first two versions' blobs
        (``Tier.preallocate``: shm writes them into its pool, LMDB reserves their disk
        blocks and reads them into the page cache), so that no save in the training
        loop writes into fresh pages. Call it before the training loop: it costs about
        one pass over the state's bytes per version and tier prepared."""
        self._engine.prepare(state)

    def guard(
        self,
        optimizer: torch.optim.Optimizer,
        scaler: Any = None,
        *,
        log: bool = True,
        mirrors: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> Callable[[], None]:
        """Make ``optimizer.step()`` wait until the last save has been staged, and log
        what each step consumes so that saves can be log versions. Without the log, a save
        of one process whose copy an earlier save still holds back gives way instead
        (latest wins: its handle ends ``skipped``); with it, every save is waited for.

        With ``log`` (the default, on a writable store), an update log is attached
        (:mod:`tiercheck.logversions.update_log`): each step's gradients are copied into a
        reused host buffer, and a save may store the steps since the last full version
        instead of the state (a *log version*, ``docs/concepts.md``). Pass the
        ``torch.amp.GradScaler`` that steps this optimizer as ``scaler`` (a step it skips
        is logged as skipped); ``mirrors`` are ``(master, copy)`` pairs the trainer keeps
        equal (bf16 copies of fp32 master weights). Restoring a log version replays into
        the guarded optimizer, which must be part of the state restored: guard it before
        ``restore()``, on a read-only store too (which logs nothing). One optimizer is
        logged per store: guarding another one moves the log to it (the next save is then
        a full version). With several ranks, guard on every rank or on none.

        Returns a function that removes the hook and the log. The hook only waits: a
        save's failure is raised by its own handle, never by the optimizer."""
        return self._engine.guard(optimizer, scaler, log=log, mirrors=mirrors)

    def wait_staged(self) -> None:
        """Block until every save so far has been staged (or has failed)."""
        if self._engine.saves is not None:
            self._engine.saves.wait_staged()

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
        "Guarantees")."""
        return self._engine.writer().submit(step, state, metadata=metadata, role=role)

    # --- migration ------------------------------------------------------------------------

    def retry_migrations(self) -> int:
        """Retry now the migrations waiting out a backoff, and open the tiers that could not
        be reached at the open (on this thread); returns how many migrations waited."""
        migrations = self._engine.migrations
        return migrations.retry_now() if migrations is not None else 0

    def wait_migrations(self, timeout: float | None = None) -> bool:
        """Block until every migration queued so far has settled (committed, or given up)
        and the retention and GC they triggered have run, or ``timeout`` passed; True if
        none is pending. A tier that stays unreachable keeps its migrations pending (they
        are retried) until the timeout."""
        return self._engine.wait_migrations(timeout)

    def pending_migrations(self) -> list[tuple[int, str, str]]:
        """``(version, tier, last error)`` of every migration not settled yet."""
        migrations = self._engine.migrations
        return migrations.pending() if migrations is not None else []

    # --- retention and GC -----------------------------------------------------------------

    def hold(self, versions: Iterable[int]) -> None:
        """Keep ``versions`` and what they need from retention, in this process, until the
        next ``hold`` replaces them (``hold(())`` lets go): for a protocol that acknowledges
        a version after the store committed it (DCP's ``finish``)."""
        self._engine.hold(versions)

    def gc(self, *, dry_run: bool = False, grace: float | None = None) -> list[GCReport]:
        """Apply each tier's retention, then sweep unreferenced blobs from every tier
        (past the grace period: the policy's,
        or ``grace`` seconds, counted from when each blob was written where its tier says,
        else from when first seen unreferenced). Blobs of saves and migrations in flight are
        never swept, in this process or in others sharing a tier; a shared tier another
        process is writing to is skipped (the report's ``fenced`` says so)."""
        return self._engine.collect(dry_run=dry_run, grace=grace)

    # --- reading --------------------------------------------------------------------------

    def refresh(self) -> Catalog:
        """Re-read every tier's log (e.g. after another process wrote or a tier was lost)."""
        return self._engine.refresh()

    @overload
    def restore(
        self,
        state: dict[str, Any] | None = None,
        *,
        version: int | None = None,
        step: int | None = None,
        strict: bool = True,
        repair: bool = True,
        tiers: Sequence[str] | None = None,
        missing_ok: Literal[False] = False,
    ) -> RestoreInfo: ...

    @overload
    def restore(
        self,
        state: dict[str, Any] | None = None,
        *,
        version: int | None = None,
        step: int | None = None,
        strict: bool = True,
        repair: bool = True,
        tiers: Sequence[str] | None = None,
        missing_ok: bool,
    ) -> RestoreInfo | None: ...

    def restore(
        self,
        state: dict[str, Any] | None = None,
        *,
        version: int | None = None,
        step: int | None = None,
        strict: bool = True,
        repair: bool = True,
        tiers: Sequence[str] | None = None,
        missing_ok: bool = False,
    ) -> RestoreInfo | None:
        """Restore the newest restorable version (or ``version``/``step``) into ``state``.

        All or nothing: every chunk is read and verified first (into staging, or where
        shm holds it); only then are the caller's tensors written (where dtype and shape
        match) and modules and optimizers given ``load_state_dict``. If no version can be
        read, ``state`` is left as it was; if loading fails (a ``load_state_dict`` raises,
        say an optimizer with other param groups, after the model was loaded), everything
        written is put back first, so ``state`` is again bit for bit as it was, and the
        error says what failed. A ``None`` value is a placeholder for what was saved under
        its key (``info.state[key]``). A DTensor (FSDP2) target is filled in place from its saved
        piece; on another mesh or world size it is assembled from the pieces every rank
        saved, and a plain tensor target gets the whole tensor. Each chunk comes from the
        fastest tier that holds an intact copy; damaged copies are repaired when ``repair``.
        ``tiers`` restricts the tiers read. Raises :class:`NoRestorableVersion` or
        :class:`StateError`; on a store that holds no version, :class:`EmptyStore`, or
        with ``missing_ok`` returns None, ``state`` untouched (a first launch)."""
        self._engine.check_open()
        if version is not None and step is not None:
            raise ValueError(f"pass version or step, not both (got {version!r} and step={step!r})")
        return self._restores.restore(
            state,
            version=version,
            step=step,
            strict=strict,
            repair=repair,
            tiers=tiers,
            missing_ok=missing_ok,
        )

    def history(self) -> list[Version]:
        """The committed versions the tiers still hold, oldest first, and where.

        Reads the logs only; each :class:`~tiercheck.history.versions.Version` opens its content
        lazily (``v.entries``, ``v[key]``, ``v.to_state_dict()``)."""
        self.flush()
        catalog = self.refresh() if not self.closed else self._engine.catalog.snapshot()
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

        Raises :class:`NoRestorableVersion` if the store has no such committed version."""
        if version is not None and step is not None:
            raise ValueError(f"pass version or step, not both (got {version!r} and step={step!r})")
        return open_version(self, version, step=step, rank=rank)

    def diff(self, a: int | str | Version, b: int | str | Version) -> Diff:
        """What changed from ``a`` to ``b`` (see :func:`tiercheck.history.diff.diff`)."""
        return diff_versions(self.version(a), self.version(b))

    # --- lifecycle ------------------------------------------------------------------------

    def flush(self) -> None:
        """Block until every save submitted so far has finished, and the retention and GC
        they triggered have run, as have those of every migration whose handle has settled
        (it does not wait for migrations: see :meth:`wait_migrations`)."""
        self._engine.flush()

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
        in the synchronous tiers stay committed either way."""
        self._engine.close(timeout=timeout, abandon=abandon or not wait_migrations)

    def wait_closed(self, timeout: float | None = None) -> bool:
        """Block until :meth:`close` has closed the tiers and released the store lock, or
        ``timeout`` passed; True once it has. A close that reached its timeout while a
        background thread was still in a tier call leaves that to when the thread ends."""
        return self._engine.wait_closed(timeout)

    def destroy(self) -> None:
        """Close, then delete this store: its root, shm segments and LMDB environments
        (see :func:`tiercheck.store.lifecycle.destroy_store`; remote tiers are kept)."""
        from tiercheck.store.lifecycle import destroy_store

        self.close()
        destroy_store(self.root)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # while an exception propagates, report unfinished work in the log, not over it
        self.close(abandon=exc_type is not None)

    def __del__(self) -> None:
        engine: Engine | None = getattr(self, "_engine", None)
        if engine is not None:  # dropped without close(): see Engine.dropped
            engine.dropped()
