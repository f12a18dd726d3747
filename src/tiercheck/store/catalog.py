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
:class:`Catalog`; unreachable tiers are listed, not fatal. Damaged records (frames the tier
stepped over, records that fail to decode) are skipped and listed in ``TierLog.damaged``,
which ``tiercheck verify`` reports (a torn tail is already cut off by the framing); a record
from a newer major format version raises :class:`~tiercheck.errors.FormatVersionError`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field, replace
from functools import cached_property

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
    "LiveCatalog",
    "TierLog",
    "append_record",
    "compact_log",
    "read_catalog",
    "read_tier_log",
    "should_compact",
]

log = logging.getLogger(__name__)


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
    #: Where each damaged record was: frames the tier stepped over (``Tier.scan_log``) and
    #: records that failed to decode. What they said (a commit, a drop) is lost here.
    damaged: tuple[str, ...] = ()
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

    def newest_held(self) -> VersionInfo | None:
        """The newest version the tier holds (committed, not dropped), if any."""
        held = self.held()
        return self.committed[held[-1]] if held else None

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
    """Every reachable tier's log, merged. Tier order is the store's tier order.

    A catalog is a snapshot: once built it is not changed (:class:`LiveCatalog` makes a
    new one for each change), so its derived views are computed once.
    """

    logs: dict[str, TierLog]
    unreachable: dict[str, str]

    @cached_property
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
        return version in self.restorable_ids

    def restorable_versions(self) -> list[int]:
        """The restorable versions, oldest first."""
        good = self.restorable_ids
        return [v for v in self.versions if v in good]

    @cached_property
    def restorable_ids(self) -> frozenset[int]:
        """The restorability rule, the one place it is written: a version is restorable
        iff some reachable tier holds it and, for a diff or a log version, its base is
        restorable (the base's chain is followed to its end, whatever the ids)."""
        versions = self.versions
        held: set[int] = set()
        for tl in self.logs.values():
            held.update(tl.held())
        memo: dict[int, bool] = {}
        for vid in versions:
            chain: list[int] = []
            cur: int | None = vid
            ok = False
            while cur is not None:
                if cur in memo:
                    ok = memo[cur]
                    break
                info = versions.get(cur)
                if info is None or cur not in held or cur in chain:
                    ok = False
                    break
                chain.append(cur)
                # a log version needs its base like a diff (SPEC.md 12.1); whether the
                # restore can replay it (a guarded optimizer) is the restore's question
                if info.role not in ("diff", "log") or info.base is None:
                    ok = True
                    break
                cur = info.base
            for c in chain:
                memo[c] = ok
        return frozenset(v for v, ok in memo.items() if ok and v in versions)


class LiveCatalog:
    """The engine's current catalog: the logs as last read, plus what this process has
    recorded since (the commits and drops it appended). It is the only writer of that view;
    :meth:`snapshot` returns a catalog nobody changes afterwards (each update builds a new
    one, sharing what did not change), so readers need no lock while they use it.

    A tier whose log could not be read is absent from the view (never a partial log: a
    partial log would let retention drop, and GC delete, what the tier still needs); what
    this process records there meanwhile is kept in a journal and merged when its log is
    read again. A read is bracketed by :meth:`begin_read` and :meth:`install`, so that a
    record appended while the read ran is merged whether or not the read saw it.
    """

    def __init__(self, catalog: Catalog) -> None:
        self._lock = threading.Lock()
        self._catalog = catalog
        self._seq = 0
        self._journal: list[tuple[int, str, VersionInfo | None, int | None]] = []
        self._reads: dict[int, int] = {}  # marks of reads in progress -> how many

    def snapshot(self) -> Catalog:
        with self._lock:
            return self._catalog

    def begin_read(self) -> int:
        """Call before reading logs; pass the mark to :meth:`install` (or :meth:`end_read`)."""
        with self._lock:
            self._reads[self._seq] = self._reads.get(self._seq, 0) + 1
            return self._seq

    def end_read(self, mark: int) -> None:
        """A read begun at ``mark`` ended without a result."""
        with self._lock:
            self._end(mark)

    def _end(self, mark: int) -> None:
        left = self._reads.get(mark, 0) - 1
        if left > 0:
            self._reads[mark] = left
        else:
            self._reads.pop(mark, None)
        oldest = min(self._reads, default=self._seq)
        self._journal = [e for e in self._journal if e[0] > oldest]

    def install(self, catalog: Catalog, mark: int, *, partial: bool = False) -> Catalog:
        """Make ``catalog`` (read after ``begin_read`` returned ``mark``) the view, with
        this process's records since ``mark`` merged in. ``partial``: it holds some tiers
        only; the others keep their logs. Returns the new view."""
        with self._lock:
            logs: dict[str, TierLog] = dict(self._catalog.logs) if partial else {}
            unreachable = dict(self._catalog.unreachable) if partial else {}
            for name, tl in catalog.logs.items():
                logs[name] = self._merged(tl, mark)
                unreachable.pop(name, None)
            for name, why in catalog.unreachable.items():
                logs.pop(name, None)
                unreachable[name] = why
            self._catalog = Catalog(logs, unreachable)
            self._end(mark)
            return self._catalog

    def _merged(self, tl: TierLog, mark: int) -> TierLog:
        committed: dict[int, VersionInfo] = {}
        dropped: set[int] = set()
        for seq, tier, info, drop in self._journal:
            if seq > mark and tier == tl.name:
                if info is not None and info.id not in tl.committed:
                    committed[info.id] = info
                if drop is not None and drop not in tl.dropped:
                    dropped.add(drop)
        if not committed and not dropped:
            return tl
        return replace(tl, committed={**tl.committed, **committed}, dropped=tl.dropped | dropped)

    def _record(self, tier: str, info: VersionInfo | None, drops: Iterable[int]) -> None:
        drops = list(drops)
        self._seq += 1
        if info is not None:
            self._journal.append((self._seq, tier, info, None))
        self._journal += [(self._seq, tier, None, d) for d in drops]
        if not self._reads:
            self._journal.clear()
        old = self._catalog.logs.get(tier)
        if old is None:  # not read yet (or unreachable): merged when it is
            return
        tl = replace(
            old,
            committed={**old.committed, info.id: info} if info is not None else old.committed,
            dropped=old.dropped | set(drops) if drops else old.dropped,
        )
        self._catalog = Catalog({**self._catalog.logs, tier: tl}, self._catalog.unreachable)

    def committed(self, tier: str, info: VersionInfo) -> None:
        """This process appended the commit record of ``info`` to ``tier``."""
        with self._lock:
            self._record(tier, info, ())

    def dropped(self, tier: str, versions: Iterable[int]) -> None:
        """This process appended drop records for ``versions`` to ``tier``."""
        with self._lock:
            self._record(tier, None, versions)


def read_tier_log(name: str, tier: Tier) -> TierLog:
    """Read and decode one tier's log."""
    tl = TierLog(name)
    scan = tier.scan_log()
    damaged = list(scan.damaged)
    for where in scan.damaged:
        log.warning("tier %s (%s): a damaged log record was skipped: %s", name, tier.url, where)
    for n, payload in enumerate(scan.records):
        try:
            rec = unpack_record(payload)
        except BlobCorrupt as exc:
            tl.corrupt += 1
            damaged.append(f"intact record {n} does not decode: {exc}")
            log.warning("skipping a damaged log record in tier %s (%s): %s", name, tier.url, exc)
            continue
        tl.apply(rec)
    tl.damaged = tuple(damaged)
    return tl


def read_catalog(tiers: Mapping[str, Tier], *, pool: Executor | None = None) -> Catalog:
    """Read every tier's log, in parallel on ``pool`` (the store's log readers), else one
    after another; a tier that cannot be read is listed unreachable."""
    logs: dict[str, TierLog] = {}
    unreachable: dict[str, str] = {}
    futures: dict[str, Future[TierLog]] = {}
    for name, t in tiers.items():
        if pool is not None:
            futures[name] = pool.submit(read_tier_log, name, t)
        else:
            futures[name] = Future()
            try:
                futures[name].set_result(read_tier_log(name, t))
            except Exception as exc:
                futures[name].set_exception(exc)
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
    lose what it says, and the damage would no longer be reported.
    """
    scan = tier.scan_log()
    payloads = scan.records
    if scan.damaged:
        # compaction would delete them, and with them the only sign of what was lost
        log.warning("not compacting the log of tier %s: it holds damaged records", name)
        return CompactionReport(name, len(payloads), len(payloads), "holds damaged records")
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
