"""The manifest log: per-tier record streams, and the catalog merged from all of them.

Each tier's log is an append-only sequence of records (``formats.manifest``):

- ``prepare``: one rank's shard of a version is durable in this tier (blobs first, then
  the manifest blob, then this record);
- ``commit``: the coordinator decided the version is committed; the record carries the
  version's :class:`VersionInfo` (every rank's manifest id);
- ``abort``: the version was aborted (presumed abort: a version with neither record is
  not committed either);
- ``drop``: retention (or a user) removed the version from this tier.

A version is **committed** iff some log holds its commit record. A tier **holds** a version
iff its log has the commit and no drop. Reading merges every reachable tier's log into a
:class:`Catalog`; unreachable tiers are listed, not fatal. Records that fail to decode are
counted and skipped (a torn tail is already cut off by the framing); a record from a newer
major format version raises :class:`~tiercheck.errors.FormatVersionError`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tiercheck.backends.base import Tier
from tiercheck.errors import BlobCorrupt, TierError, TierUnavailable
from tiercheck.formats.manifest import (
    AbortRecord,
    CommitRecord,
    DropRecord,
    LogRecord,
    PrepareRecord,
    VersionInfo,
    pack_record,
    unpack_record,
)

__all__ = ["Catalog", "TierLog", "append_record", "read_catalog", "read_tier_log"]

log = logging.getLogger("tiercheck")


@dataclass
class TierLog:
    """What one tier's log says."""

    name: str
    prepared: dict[int, dict[int, PrepareRecord]] = field(default_factory=dict)
    committed: dict[int, VersionInfo] = field(default_factory=dict)
    aborted: set[int] = field(default_factory=set)
    dropped: set[int] = field(default_factory=set)
    deltas: dict[str, str] = field(default_factory=dict)
    records: int = 0
    corrupt: int = 0

    def apply(self, rec: LogRecord) -> None:
        self.records += 1
        if isinstance(rec, PrepareRecord):
            self.prepared.setdefault(rec.version, {})[rec.rank] = rec
            self.deltas.update(rec.deltas)
        elif isinstance(rec, CommitRecord):
            self.committed[rec.info.id] = rec.info
        elif isinstance(rec, AbortRecord):
            self.aborted.add(rec.version)
        elif isinstance(rec, DropRecord):
            self.dropped.add(rec.version)

    def holds(self, version: int) -> bool:
        return version in self.committed and version not in self.dropped

    def held(self) -> list[int]:
        return sorted(v for v in self.committed if v not in self.dropped)

    def bytes_written(self, version: int) -> int:
        return sum(r.bytes_written for r in self.prepared.get(version, {}).values())


@dataclass
class Catalog:
    """Every reachable tier's log, merged. Tier order is the store's tier order."""

    logs: dict[str, TierLog]
    unreachable: dict[str, str]

    @property
    def versions(self) -> dict[int, VersionInfo]:
        """Every committed version (in any tier), by id."""
        out: dict[int, VersionInfo] = {}
        for tl in self.logs.values():
            out.update(tl.committed)
        return dict(sorted(out.items()))

    def max_version_id(self) -> int:
        ids: list[int] = [-1]
        for tl in self.logs.values():
            ids.extend(tl.prepared)
            ids.extend(tl.committed)
            ids.extend(tl.aborted)
        return max(ids)

    def holders(self, version: int) -> list[str]:
        return [name for name, tl in self.logs.items() if tl.holds(version)]

    def restorable(self, version: int) -> bool:
        """Held by a reachable tier, and (for a diff) its base is restorable too."""
        return version in self._restorable_set(self.versions)

    def restorable_versions(self) -> list[int]:
        versions = self.versions
        good = self._restorable_set(versions)
        return [v for v in versions if v in good]

    def _restorable_set(self, versions: Mapping[int, VersionInfo]) -> set[int]:
        held: set[int] = set()
        for tl in self.logs.values():
            held.update(v for v in tl.committed if v not in tl.dropped)
        good: set[int] = set()
        for vid in sorted(versions):  # a base always has a smaller id than its diffs
            info = versions[vid]
            if vid not in held:
                continue
            if info.role == "diff" and info.base is not None and info.base not in good:
                continue
            if info.role == "log":
                # The restore does not replay update logs yet (tiercheck.replay is not wired
                # into it), and a reader that cannot replay must not restore one (SPEC.md
                # section 12.5): the newest full version is restored instead.
                continue
            good.add(vid)
        return good


def read_tier_log(name: str, tier: Tier) -> TierLog:
    """Read and decode one tier's log."""
    tl = TierLog(name)
    for payload in tier.read_log():
        try:
            rec = unpack_record(payload)
        except BlobCorrupt as exc:
            tl.corrupt += 1
            log.warning("skipping a damaged log record in tier %s (%s): %s", name, tier.url, exc)
            continue
        tl.apply(rec)
    return tl


def read_catalog(tiers: Mapping[str, Tier], *, threads: int = 8) -> Catalog:
    """Read every tier's log in parallel; a tier that cannot be read is listed unreachable."""
    logs: dict[str, TierLog] = {}
    unreachable: dict[str, str] = {}
    if not tiers:
        return Catalog(logs, unreachable)
    with ThreadPoolExecutor(max_workers=min(threads, len(tiers))) as pool:
        futures = {name: pool.submit(read_tier_log, name, t) for name, t in tiers.items()}
        for name, fut in futures.items():
            try:
                logs[name] = fut.result()
            except (TierUnavailable, OSError) as exc:
                unreachable[name] = str(exc)
                log.warning("tier %s is unreachable: %s", name, exc)
            except TierError as exc:
                if type(exc).__name__ in ("NotFound",):
                    logs[name] = TierLog(name)
                else:
                    unreachable[name] = str(exc)
                    log.warning("tier %s cannot be read: %s", name, exc)
    ordered = {name: logs[name] for name in tiers if name in logs}
    return Catalog(ordered, unreachable)


def append_record(
    tier: Tier, rec: LogRecord, blobs: Iterable[tuple[str, bytes | memoryview]] = ()
) -> None:
    """Append ``rec`` to ``tier``'s log (after ``blobs``, in one transaction if it can)."""
    tier.append(pack_record(rec), blobs=blobs)
