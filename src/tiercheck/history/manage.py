"""Managing a store's history: :func:`collect` runs GC with an explicit grace period;
:func:`migrate` copies a version (and the bases it needs) to a tier.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tiercheck.backends.registry import open_tier
from tiercheck.backends.resilience import wrapping
from tiercheck.errors import (
    CheckpointError,
    NoRestorableVersion,
    TierUnavailable,
)
from tiercheck.formats.manifest import (
    CommitRecord,
    VersionInfo,
)
from tiercheck.history.versions import Progress, Version
from tiercheck.history.view import StoreView
from tiercheck.store.catalog import append_record, read_tier_log
from tiercheck.store.config import TierSpec, without_userinfo
from tiercheck.store.fetch import ChunkFetcher
from tiercheck.store.tierset import TierSlot
from tiercheck.upkeep.copying import migrate_shard
from tiercheck.upkeep.retention import GCReport

__all__ = ["MigrateReport", "collect", "migrate"]


def collect(
    store: StoreView[Version], *, dry_run: bool = False, grace: float | None = None
) -> list[GCReport]:
    """Sweep each tier's unreferenced blobs (see :mod:`tiercheck.upkeep.retention`).

    With ``grace=None`` this is :meth:`Checkpointer.gc` (the policy's grace period, on this
    process's grace clock). An explicit ``grace`` uses a fresh clock. Either way a blob's age
    counts from when it was written where its tier says (``Tier.written_at``), else from
    when the clock first saw it; blobs of saves and migrations in flight are safe
    (:mod:`tiercheck.store.leases`).
    """
    return store.gc(dry_run=dry_run, grace=grace)


@dataclass
class MigrateReport:
    """What :func:`migrate` copied: ``versions`` the ids committed to the target (the
    version and any base it needs), ``already`` those it held before. ``url`` is the
    target's URL as it may be shown: without the credentials it may hold."""

    tier: str
    url: str
    versions: list[int] = field(default_factory=list)
    already: list[int] = field(default_factory=list)
    chunks_written: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    configured: bool = True

    def to_json(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "url": self.url,
            "versions": self.versions,
            "already": self.already,
            "chunks_written": self.chunks_written,
            "bytes_written": self.bytes_written,
            "seconds": self.seconds,
            "configured": self.configured,
        }


def _target_slot(store: StoreView[Version], to: str) -> tuple[TierSlot, bool]:
    """The slot ``to`` names (a configured tier's name or URL), or a new one for a URL."""
    for slot in store.tierset.slots:
        if to in (slot.name, slot.spec.url):
            if slot.tier is None:
                raise TierUnavailable(f"tier {slot.name} cannot be opened: {slot.error}")
            if slot.tier.read_only:
                raise CheckpointError(
                    f"tier {slot.name} is open read-only; open the store for writing"
                )
            return slot, True
    tier = wrapping(to, {})(open_tier(to))  # the default retry and limit of its URL
    policy = store.policy.for_tier("target", tier.capabilities)
    return TierSlot(TierSpec("target", to), tier, policy), False


def migrate(
    store: StoreView[Version],
    version: Version,
    to: str,
    *,
    progress: Progress | None = None,
) -> MigrateReport:
    """Copy ``version`` (every rank's shard, and first the bases it needs) to tier ``to``.

    ``to`` is a tier name or URL of the store (the store must be open for writing), or the
    URL of another location, which then holds a self-contained copy that a store
    configured with that URL can restore. Chunks come from the fastest intact copy; the
    target gets blobs, then manifests, then ``prepare`` and ``commit`` records.
    """
    t0 = time.perf_counter()
    slot, configured = _target_slot(store, to)
    assert slot.tier is not None
    report = MigrateReport(slot.name, without_userinfo(slot.spec.url), configured=configured)
    try:
        catalog = store.refresh()
        target_log = read_tier_log(slot.name, slot.tier)
        chain: list[VersionInfo] = []
        cur: int | None = version.id
        while cur is not None:
            info = catalog.versions.get(cur)
            if info is None:
                raise NoRestorableVersion(f"version {cur} (a base of {version.id}) is unknown")
            chain.append(info)
            cur = info.base if info.role in ("diff", "log") else None
        chain.reverse()
        todo = [i for i in chain if not target_log.holds(i.id)]
        report.already = [i.id for i in chain if target_log.holds(i.id)]
        steps = sum(len(i.shards) for i in todo)
        if progress is not None:
            progress(0, steps)
        done = 0
        for info in todo:
            holders = [store.tierset.get(n) for n in catalog.holders(info.id)]
            sources = sorted(
                [s for s in holders if s.tier is not None and s.name != slot.name],
                key=lambda s: s.speed_rank,
            )
            sources += [
                s for s in store.tierset.by_speed() if s not in sources and s.name != slot.name
            ]
            fetcher = ChunkFetcher(
                sources, repair=not store.read_only, zstd_level=store.policy.zstd_level
            )
            base = catalog.versions.get(info.base) if info.base is not None else None
            for rank in range(len(info.shards)):
                result = migrate_shard(
                    info,
                    rank,
                    slot,
                    sources,
                    fetcher,
                    store.executors.io,
                    writes=store.executors.writes,
                    zstd_level=store.policy.zstd_level,
                    base_manifest_id=base.shards[rank] if base is not None else None,
                    commit=False,
                )
                report.chunks_written += result.chunks_written
                report.bytes_written += result.bytes_written
                done += 1
                if progress is not None:
                    progress(done, steps)
            append_record(slot.tier, CommitRecord(info))
            report.versions.append(info.id)
    finally:
        if not configured:
            slot.tier.close()
    report.seconds = time.perf_counter() - t0
    return report
