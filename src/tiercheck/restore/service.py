"""The restore service: the orchestration of a restore, symmetric to the save service.

:class:`RestoreService` runs the steps of :mod:`tiercheck.restore` in order: it picks
the candidates (the newest restorable version, or the one asked for, skipping log versions
when no guarded optimizer is in the state), agrees with every rank on one of them, reads and
verifies it (into the staging buffer, or where a memory tier pins its chunks:
:meth:`RestoreService._read_version`), and only then
binds it into the caller's state, all or nothing (:class:`~tiercheck.restore.undo.Undo`).
A version that cannot be read makes every rank try an older one; a log version is its base
plus its own shard, the steps replayed into the guarded optimizer
(:meth:`RestoreService._load_log`). :class:`tiercheck.Checkpointer` only delegates here.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiercheck.core.entries import is_stateful
from tiercheck.engine.coordinator import Coordinator
from tiercheck.engine.staging import StagingBuffer
from tiercheck.errors import (
    BlobCorrupt,
    CheckpointError,
    ConfigError,
    NoRestorableVersion,
    NotFound,
    ReplayError,
    StateError,
    TiercheckError,
    TierError,
    TierUnavailable,
)
from tiercheck.formats.manifest import ShardManifest, VersionInfo
from tiercheck.logversions.planner import LogSource
from tiercheck.logversions.replay import (
    StoredVersion,
    replay_version,
    replay_version_resharded,
)
from tiercheck.restore import losses
from tiercheck.restore.binding import Binding, bind
from tiercheck.restore.choose import choose_version, nothing_restorable
from tiercheck.restore.info import RestoreInfo
from tiercheck.restore.loading import (
    PinnedTiers,
    VerifiedStream,
    copied_on_load,
    fetch_stream,
    load_stream,
    materialize,
    plan_in_place,
    reload,
)
from tiercheck.restore.reshard import Gathered, gather
from tiercheck.restore.undo import Undo
from tiercheck.runtime.gcpause import gc_paused
from tiercheck.store.catalog import Catalog
from tiercheck.store.fetch import ChunkFetcher
from tiercheck.store.policy import Policy
from tiercheck.store.tierset import TierSet, TierSlot

__all__ = ["RestoreService"]

log = logging.getLogger(__name__)


class RestoreService:
    """Restores versions of one store into callers' states.

    It owns no thread and no state of its own between restores: it reads through the
    store's tiers (``tierset``), its I/O pool and its staging buffer (taken for the whole
    restore, so that no save stages meanwhile), and agrees with the other ranks through
    ``coordinator``. ``flush`` and ``refresh`` finish the saves in flight and re-read every
    tier's log before a version is chosen; ``logs`` is the guarded optimizer's update log, if
    any (a log version replays into it); ``version(id, rank)`` opens a version as rank
    ``rank`` stored it (a log version saved on another number of ranks replays per saver).
    """

    def __init__(
        self,
        *,
        tierset: TierSet,
        policy: Policy,
        coordinator: Coordinator,
        staging: StagingBuffer,
        pool: Executor,
        flush: Callable[[], None],
        refresh: Callable[[], Catalog],
        logs: Callable[[], LogSource | None],
        version: Callable[[int, int], StoredVersion],
        read_only: bool,
        allow_pickle: bool,
        root: Path | None = None,
    ) -> None:
        self.tierset = tierset
        self.policy = policy
        self.coordinator = coordinator
        self.rank = coordinator.rank
        self.world_size = coordinator.world_size
        self._staging = staging
        self._pool = pool
        self._flush = flush
        self._refresh = refresh
        self._logs = logs
        self._version = version
        self.read_only = read_only
        self.allow_pickle = allow_pickle
        self.root = root  # where the ack ledger is (tiercheck.restore.losses)

    @gc_paused()
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
        """Restore the newest restorable version (or ``version``/``step``) into ``state``;
        see :meth:`tiercheck.Checkpointer.restore` (None: an empty store and
        ``missing_ok``, :func:`~tiercheck.restore.choose.nothing_restorable`). Python's
        automatic garbage collection is paused meanwhile (:func:`gc_paused`): the objects a
        restore makes die with it, and the passes they would set off walk the whole
        process's objects."""
        t0 = time.perf_counter()
        for name, value in (("version", version), ("step", step)):
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 0
            ):
                raise ValueError(
                    f"{name} must be an int from 0 or None, got {value!r} (None: the newest "
                    "restorable version; ckpt.version('step:N').id names others)"
                )
        if tiers is not None and (isinstance(tiers, str) or not tiers):
            raise ConfigError(
                f"tiers must be a non-empty list of tier names, got {tiers!r} "
                "(e.g. tiers=['shm']; None reads every tier)"
            )
        self._flush()
        catalog = self._refresh()
        full = catalog
        if tiers is not None:
            unknown = set(tiers) - {s.name for s in self.tierset.slots}
            if unknown:
                raise ConfigError(f"unknown tier names {sorted(unknown)}")
            catalog = Catalog({n: tl for n, tl in catalog.logs.items() if n in tiers}, {})
        explicit = version is not None or step is not None
        last_error: Exception | None = None
        source = self._logs()
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
                candidates, last_error = [], self._explained(exc, full, version, step)
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
        pinned = PinnedTiers()  # chunks verified in place stay as they are until the end
        staged: _Staged | None = None
        try:
            # Every rank takes part in each round, so that all agree on one version: the
            # newest every rank can read; if any rank then fails to read it, all try older.
            while True:
                vid = self.coordinator.agree_restorable(candidates)
                if vid is None:
                    lost = (
                        None
                        if explicit
                        else losses.nothing_reachable(
                            self.root, self.rank, self.tierset, full, tiers
                        )
                    )
                    if not self.coordinator.all_true(lost is None):
                        raise lost or NoRestorableVersion(
                            "no version can be restored: another rank lost acknowledged "
                            "versions or cannot read a tier (its error says which)"
                        )
                    nothing_restorable(
                        empty=self.coordinator.all_true(not catalog.versions),
                        missing_ok=missing_ok,
                        last_error=last_error,
                        world_size=self.world_size,
                        tiers=tiers,
                    )
                    return None
                staged = None
                fatal: TiercheckError | None = None
                # what loading would overwrite, copied while the version is fetched
                undo = Undo(keep_all=catalog.versions[vid].role == "log")
                try:
                    staged = self._read_version(
                        catalog, catalog.versions[vid], state, strict, repair, undo, pinned
                    )
                except (NotFound, TierUnavailable, BlobCorrupt, NoRestorableVersion) as exc:
                    last_error = exc  # this version cannot be read here: an older one may
                except TiercheckError as exc:
                    last_error = fatal = exc
                finally:
                    if staged is None:
                        undo.discard()
                if self.coordinator.all_true(staged is not None):
                    assert staged is not None
                    if staged.log is not None:
                        assert replayer is not None
                        restored = self._load_log(staged, state, t0, replayer, fallback, undo)
                        return self._report_losses(restored, full, explicit)
                    info = self._load(staged, state, t0, undo)
                    if source is not None:
                        source.invalidate("the state was restored")
                    info = dataclasses.replace(info, fallback=fallback)
                    return self._report_losses(info, full, explicit)
                undo.discard()
                # every rank stops, or none does: one left behind would wait in the next round
                if not self.coordinator.all_true(fatal is None):
                    raise fatal or CheckpointError(
                        f"version {vid} could not be restored on another rank (its error "
                        f"says why); nothing of the state was written on rank {self.rank}"
                    )
                why = last_error if staged is None else "another rank could not read it"
                if explicit:
                    raise NoRestorableVersion(f"version {vid} could not be restored: {why}")
                log.warning("version %d could not be restored (%s); trying an older one", vid, why)
                fallback = f"version {vid} could not be restored: {why}"
                candidates = [c for c in candidates if c < vid]
        finally:
            # the verified views of pinned blobs go first, so that the pins' unmapping
            # can run on the I/O pool, not in the caller's time
            staged = None
            pinned.close(self._pool.submit)
            self._staging.release()

    def _report_losses(self, info: RestoreInfo, catalog: Catalog, explicit: bool) -> RestoreInfo:
        """``info`` with the acknowledged versions newer than it that were lost (one
        warning says which steps and with which tier); with several ranks, a rank that lost
        none reports the lowest rank's (they all resumed from the same step)."""
        if explicit:
            return info
        loss = losses.find_losses(
            self.root,
            self.rank,
            self.tierset.store_id,
            catalog,
            restored=info.step,
            unreached=losses.unreached_tiers(self.tierset, catalog),
        )
        if self.world_size > 1:  # every rank resumed from this step: each says what went
            first = self.coordinator.first_text(
                "the versions lost", "" if loss is None else loss.shared()
            )
            if loss is None and first is not None:
                loss = losses.Loss.from_shared(first[1], rank=first[0])
        if loss is None:
            return info
        log.warning("%s", loss)
        return dataclasses.replace(info, lost=loss)

    def _explained(
        self, exc: NoRestorableVersion, catalog: Catalog, version: int | None, step: int | None
    ) -> NoRestorableVersion:
        """``exc`` saying why the version asked for is gone, where the store knows."""
        if self.root is None or not str(exc).endswith("is not a committed version of this store"):
            return exc
        acked = losses.read_ledger(losses.ledger_path(self.root, self.rank), self.tierset.store_id)
        why = losses.gone_reason(acked, catalog, version=version, step=step)
        if why is None:
            return exc
        label = f"version {version}" if version is not None else f"step {step}"
        return NoRestorableVersion(f"{label} was committed, then {why}: it cannot be restored")

    def _read_version(
        self,
        catalog: Catalog,
        info: VersionInfo,
        state: dict[str, Any] | None,
        strict: bool,
        repair: bool,
        undo: Undo,
        pinned: PinnedTiers,
    ) -> _Staged:
        """Read and verify this rank's shard of ``info`` into the staging buffer; nothing
        of ``state`` is written (what loading it will overwrite is noted in ``undo`` and
        copied meanwhile). Pieces of distributed tensors this rank's new layout needs
        from other ranks' shards are read and verified too (:mod:`tiercheck.restore.reshard`). A log
        version: its base into the staging buffer, its own shard into a buffer of its own."""
        if info.role == "log":
            assert info.base is not None
            base_info = catalog.versions[info.base]
            base = self._read_version(catalog, base_info, state, strict, repair, undo, pinned)
            own = self._read_shard(catalog, info, state, strict, repair, undo, None)
            return dataclasses.replace(own, log=base)
        return self._read_shard(catalog, info, state, strict, repair, undo, pinned)

    def _read_shard(
        self,
        catalog: Catalog,
        info: VersionInfo,
        state: dict[str, Any] | None,
        strict: bool,
        repair: bool,
        undo: Undo,
        pinned: PinnedTiers | None,
    ) -> _Staged:
        """One shard of ``info``: into the staging buffer, chunks verified in place where
        ``pinned`` (a full version), else into a buffer of its own (a log version's shard:
        its replay reads the stream)."""
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
        # a full version's chunks bound for host tensors: verified where a memory tier
        # holds them, then copied once, into their tensors (loading.py)
        in_place = plan_in_place(manifest, binding, order, pinned)
        if in_place is not None and in_place.every:
            stream = memoryview(b"")  # no staging: no fresh pages in a restarted process
        elif pinned is not None:
            # page-locked where bytes go on to a GPU: asynchronous host-to-device copies
            gpus = [t.device.index for t in binding.device.values() if t.device.type == "cuda"]
            self._staging.ensure(
                manifest.stream_bytes, pinned=bool(gpus), device=gpus[0] if gpus else None
            )
            stream = self._staging.view(manifest.stream_bytes)
        else:  # a log version's shard, beside its base in the staging buffer
            stream = memoryview(bytearray(manifest.stream_bytes))
        source = fetch_stream(
            manifest,
            stream,
            fetcher,
            order,
            self._pool,
            expect=holders,
            binding=binding,
            in_place=in_place,
        )
        pieces = gather(
            binding.pieces,
            info,
            fetcher,
            order,
            self._pool,
            expect=holders,
            own=(shard_rank, manifest, stream),
        )
        return _Staged(info, manifest, binding, source, fetcher, order, pieces)

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
        binding = staged.binding
        load_stream(staged.manifest, binding, staged.source)
        staged.pieces.apply()
        loaded: dict[int, Any] = {}
        restored = materialize(
            staged.manifest,
            binding,
            target,
            allow_pickle=self.allow_pickle,
            replayed=replayed,
            undo=undo,
            loaded=loaded,
        )
        # an object that was to load by reference but kept copies: its bytes kept and
        # written now, then loaded again (binding.loads_by_reference)
        late = copied_on_load(binding)
        if late:
            entries = set().union(*(binding.by_reference[n] for n in late))
            undo.late(binding.targets[i] for i in entries)
            binding.loose -= entries
            load_stream(staged.manifest, binding, staged.source, only=entries)
            for n in late:
                key, obj = binding.objects[n]
                reload(obj, loaded[n], key)
        # last, when nothing can fail any more: the entries no undo copy covers (undo.py)
        load_stream(staged.manifest, binding, staged.source, loose=True)
        return restored

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
                    logs = [self._version(staged.info.id, r) for r in range(writers)]
                    report, replayed = replay_version_resharded(source, logs)
                else:
                    report, replayed = replay_version(source, staged.manifest, staged.stream)
            except (ReplayError, TierError) as exc:
                # a refusal, or another rank's log that cannot be read here (in its own
                # node's memory): the log version is not restorable here, its base is
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


@dataclass(frozen=True)
class _Staged:
    """A version read and verified into the staging buffer, not loaded yet."""

    info: VersionInfo
    manifest: ShardManifest
    binding: Binding
    source: VerifiedStream  # its stream, where chunks were not verified in place
    fetcher: ChunkFetcher
    order: list[TierSlot]
    pieces: Gathered
    log: _Staged | None = None  # a log version's base, staged (then this is its own shard)

    @property
    def stream(self) -> memoryview:
        return self.source.stream


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
