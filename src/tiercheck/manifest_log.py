"""The manifest log: per-tier record streams, and the catalog merged from all of them.

Each tier's log is an append-only sequence of records (``formats.manifest``):

- ``prepare``: one rank's shard of a version is durable in this tier (blobs first, then
  the manifest blob, then this record);
- ``commit``: the coordinator decided the version is committed; the record carries the
  version's :class:`VersionInfo` (every rank's manifest id);
- ``abort``: the version was aborted (presumed abort: a version with neither record is
  not committed either);
- ``drop``: retention (or a user) removed the version from this tier;
- ``checkpoint``: a summary standing for every record before it (log compaction,
  :func:`compact_log`): the versions the tier held, their prepare records and those of
  undecided versions, and the greatest version id seen. Reading a log applies it by
  replacing what was read so far, so a log costs O(versions kept) to read.

A version is **committed** iff some log holds its commit record. A tier **holds** a version
iff its log has the commit and no drop. Reading merges every reachable tier's log into a
:class:`Catalog`; unreachable tiers are listed, not fatal. Records that fail to decode are
counted and skipped (a torn tail is already cut off by the framing); a record from a newer
major format version raises :class:`~tiercheck.errors.FormatVersionError`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tiercheck.backends.base import Tier
from tiercheck.errors import (
    BlobCorrupt,
    FormatVersionError,
    NotSupported,
    TierError,
    TierUnavailable,
)
from tiercheck.formats.manifest import (
    SCHEMA_MAJOR,
    SCHEMA_MINOR,
    AbortRecord,
    CheckpointRecord,
    CommitRecord,
    DropRecord,
    LogRecord,
    PrepareRecord,
    VersionInfo,
    pack_record,
    record_schema,
    unpack_record,
)

__all__ = [
    "Catalog",
    "CompactionReport",
    "TierLog",
    "append_record",
    "compact_log",
    "read_catalog",
    "read_tier_log",
    "should_compact",
]

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
    #: From checkpoints: the greatest version id the replaced records named, whether
    #: they named delta blobs, and how many records the checkpoints stand for.
    max_checkpointed: int = -1
    delta_blobs: bool = False
    compacted: int = 0

    @property
    def may_hold_deltas(self) -> bool:
        """Whether any record (or a checkpoint's replaced records) named a delta blob."""
        return bool(self.deltas) or self.delta_blobs

    def apply(self, rec: LogRecord) -> None:
        self.records += 1
        if isinstance(rec, CheckpointRecord):
            # It stands for everything read before it: replace, do not merge.
            self.prepared = {}
            for p in rec.prepared:
                self.prepared.setdefault(p.version, {})[p.rank] = p
            self.committed = {info.id: info for info in rec.committed}
            self.aborted = set()
            self.dropped = set()
            self.deltas = {c: b for p in rec.prepared for c, b in p.deltas.items()}
            self.max_checkpointed = max(self.max_checkpointed, rec.max_version)
            self.delta_blobs = rec.delta_blobs
            self.compacted = rec.records
        elif isinstance(rec, PrepareRecord):
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

    def max_version_id(self) -> int:
        """The greatest version id this log names (-1 if none)."""
        return max([self.max_checkpointed, *self.prepared, *self.committed, *self.aborted])

    def checkpoint(self) -> CheckpointRecord:
        """The checkpoint record that stands for everything this log says.

        Kept: every version the tier holds (its info and its prepare records), and the
        prepare records of versions with no decision yet that are newer than every
        decided one (a save in flight). Dropped and aborted versions, and undecided ones
        older than a decision (presumed aborted), are left out: nothing reads them.
        """
        held = self.held()
        decided = [*self.committed, *self.aborted]
        newest_decided = max(decided, default=-1)
        keep = set(held) | {
            v
            for v in self.prepared
            if v not in self.committed and v not in self.aborted and v > newest_decided
        }
        prepared = tuple(
            rec for v in sorted(keep) for _, rec in sorted(self.prepared.get(v, {}).items())
        )
        return CheckpointRecord(
            committed=tuple(self.committed[v] for v in held),
            prepared=prepared,
            max_version=self.max_version_id(),
            delta_blobs=self.may_hold_deltas,
            records=self.records - 1 + self.compacted if self.compacted else self.records,
            time=time.time(),
        )


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
        return max([-1, *(tl.max_version_id() for tl in self.logs.values())])

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


#: Compact a log once it holds this many records more than a checkpoint would.
COMPACT_SLACK = 64


def should_compact(tl: TierLog, slack: int = COMPACT_SLACK) -> bool:
    """Whether compacting the log ``tl`` was read from would pay: it has ``slack`` more
    records than its checkpoint would stand in for (about one per held version)."""
    held = len(tl.held())
    return tl.records > 1 + 2 * held + slack


@dataclass(frozen=True)
class CompactionReport:
    """What :func:`compact_log` did: ``before`` records replaced by one checkpoint (``after``
    records remain, counting records appended meanwhile), or why it did nothing (``skipped``).
    ``log`` is the tier's log as read after compacting: a caller keeping a catalog puts it
    in place of the old one (same state, fewer records)."""

    tier: str
    before: int
    after: int
    skipped: str | None = None
    log: TierLog | None = None


def compact_log(name: str, tier: Tier) -> CompactionReport:
    """Replace every record of ``tier``'s log with one checkpoint record of what they say.

    Reads the log afresh (positions must be the tier's, not a cached catalog's), builds
    :meth:`TierLog.checkpoint` and hands it to ``tier.replace_log_prefix``, which is atomic:
    a crash leaves the old log or the new one, with the same committed state. Records
    appended meanwhile stay after the checkpoint. Skipped (reported, nothing written) on a
    tier without compaction (``NotSupported``), and on a log holding a record this
    tiercheck cannot read in full (damaged, or of a newer schema): summarising it would
    lose what it says.
    """
    payloads = tier.read_log()
    if len(payloads) <= 1:
        return CompactionReport(name, len(payloads), len(payloads), "nothing to compact")
    tl = TierLog(name)
    for payload in payloads:
        schema = record_schema(payload)
        if schema is None or schema[0] != SCHEMA_MAJOR or schema[1] > SCHEMA_MINOR:
            why = "a damaged record" if schema is None else f"a v{schema[0]}.{schema[1]} record"
            log.warning("not compacting the log of tier %s: it holds %s", name, why)
            return CompactionReport(name, len(payloads), len(payloads), f"holds {why}")
        try:
            tl.apply(unpack_record(payload))
        except (BlobCorrupt, FormatVersionError) as exc:
            log.warning("not compacting the log of tier %s: %s", name, exc)
            return CompactionReport(name, len(payloads), len(payloads), str(exc))
    try:
        tier.replace_log_prefix(len(payloads), pack_record(tl.checkpoint()))
    except NotSupported as exc:
        log.debug("tier %s keeps its whole log: %s", name, exc)
        return CompactionReport(name, len(payloads), len(payloads), "not supported")
    fresh = read_tier_log(name, tier)
    log.debug("compacted the log of tier %s: %d records -> %d", name, len(payloads), fresh.records)
    return CompactionReport(name, len(payloads), fresh.records, log=fresh)
