"""Retention (which versions a tier keeps) and garbage collection (which blobs it keeps).

Retention drops versions from a tier by appending ``drop`` records, never deleting data
directly: the newest ``keep_bases`` bases are kept, and the milestones (the oldest base of
each ``milestones`` window), diffs are kept only while their base is, the newest
``keep_diffs`` of those; pinned versions (a migration still reading them)
are never dropped, and neither is a base that a kept diff needs.

GC is mark-and-sweep per tier: the mark set is every chunk and manifest of every version
the tier holds, every delta base those chunks need, and every id a save or migration in
flight references. Saves and migrations in flight are fenced off by construction, not by
a timer (:mod:`tiercheck.store.leases`): in this process their ids are protected before a tier is
asked what it has, and a sweep deletes only what was unprotected when it claimed it; in a
tier shared by several processes a sweep runs only while no other process holds a write
lease there. A blob outside the mark is deleted once it has been seen unreferenced for
``grace`` seconds: the grace only delays deleting what a crashed writer left behind. A blob's
age runs from when it was written where the tier says (``Tier.written_at``: a file's mtime,
an object's last-modified time, LMDB's ``times``), so what a process that died left behind is
collected by the next one; elsewhere from when this process first saw it unreferenced.

Delta bases come from two places. The log: a prepare record's ``deltas`` names the base of
every delta blob that save wrote. And the blobs themselves: a save that crashed after
writing a delta blob but before its prepare record leaves a delta no record describes, and
a later save of the same chunk finds it present and reuses it without writing anything, so
no record will ever name its base. On a tier that may hold deltas (its codec is ``delta``,
or its log names any), the mark therefore reads the header (``Tier.head``, 64 bytes) of
every live blob and keeps the base a delta header names as well as any base the log names,
transitively. (Even a blob the log describes: if its chunk was swept and a crashed save
then wrote it again as a delta of another base, the record names the old base.) Headers
are immutable while a blob exists (a repair rewrites a copy as raw or zstd, never as a
delta), so :class:`GCState` remembers each answer for the life of the
process: a blob's header is read once, and the steady-state cost is one small read per
chunk newly written. A blob that is absent, or whose header is damaged or
from a newer format, is skipped; a read that fails otherwise (tier unreachable) leaves the
mark incomplete, and that tier is not swept in that round.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tiercheck.backends.base import Capabilities, Tier
from tiercheck.errors import BlobCorrupt, FormatVersionError, NotFound, TierError
from tiercheck.formats.codecs import BLOB_HEADER_SIZE, BLOB_MAGIC, read_header
from tiercheck.formats.manifest import ChunkRef, DropRecord, VersionInfo
from tiercheck.store.budgets import at_least_as_durable
from tiercheck.store.catalog import Catalog, TierLog, append_record
from tiercheck.store.leases import GCFence, TierLeases, is_lease_id
from tiercheck.store.policy import TierPolicy
from tiercheck.store.tierset import TierSlot

__all__ = [
    "ChunkList",
    "GCReport",
    "GCState",
    "HasChunks",
    "Protection",
    "at_least_as_durable",
    "collect_garbage",
    "drop_versions",
    "milestones",
    "plan_drops",
    "protection",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Protection:
    """What one tier must keep now, whatever its retention or its budget says: the rule
    *nothing acknowledged is lost* (docs/concepts.md, "Guarantees"; SPEC.md section 9),
    computed in one place (:func:`protection`).

    ``keep``: the tier's newest restorable version (unless a newer version is restorable
    from tiers at least as durable), and every version such a newest version of any tier
    needs (its base, its log chain) of which this tier is the most durable holder.
    ``elsewhere``: versions this tier holds that a more durable tier holds too (a newest
    version's base that LMDB keeps, a base a migration to the remote still reads, which it
    then reads from LMDB); only making room under a budget may drop them here (the last
    resort of :meth:`tiercheck.upkeep.maintenance.Maintenance.make_room`).
    """

    keep: frozenset[int] = frozenset()
    elsewhere: frozenset[int] = frozenset()


def protection(catalog: Catalog, tier: str, caps: Mapping[str, Capabilities]) -> Protection:
    """What ``tier`` must keep now (:class:`Protection`). ``caps`` gives the capabilities
    of the store's tiers, in the store's tier order (the tie-break between tiers that are
    equally durable: the first keeps)."""
    logs = {name: catalog.logs[name] for name in caps if name in catalog.logs}
    if tier not in logs:
        return Protection()
    versions = catalog.versions
    restorable = sorted(catalog.restorable_ids)
    order = list(logs)

    def chain(v: int) -> list[int]:
        out: list[int] = []
        cur: int | None = v
        while cur is not None and cur in versions and cur not in out:
            out.append(cur)
            info = versions[cur]
            cur = info.base if info.role in ("diff", "log") else None
        return out

    def rank(name: str) -> tuple[int, bool, int]:
        c = caps[name]
        return (c.survives.order, c.persistent, -order.index(name))

    def newest(t: str) -> int | None:
        held = [v for v in logs[t].held() if v in catalog.restorable_ids]
        if not held:
            return None
        others = [u for u in order if u != t and at_least_as_durable(caps[u], caps[t])]
        for w in restorable:
            if w > held[-1] and all(any(logs[u].holds(c) for u in others) for c in chain(w)):
                return None  # superseded where it is at least as safe: the tier may let go
        return held[-1]

    tops = {t: newest(t) for t in order}
    needed = {c for v in tops.values() if v is not None for c in chain(v)}
    mine = {c for c in needed if logs[tier].holds(c)}
    keep = {c for c in mine if max((u for u in order if logs[u].holds(c)), key=rank) == tier}
    top = tops[tier]
    if top is not None:
        keep.add(top)
    # every version held here that a more durable tier holds too (this covers ``mine -
    # keep``: a needed version's most durable holder, when not this tier, ranks above it)
    durable = [u for u in order if rank(u) > rank(tier)]
    also = {c for c in logs[tier].held() if any(logs[u].holds(c) for u in durable)}
    return Protection(frozenset(keep), frozenset(also - keep))


def plan_drops(
    tl: TierLog,
    policy: TierPolicy,
    pinned: Iterable[int] = (),
    protect: Protection = Protection(),
    *,
    last_resort: bool = False,
) -> list[int]:
    """Versions ``policy`` says to drop from the tier whose log is ``tl``; never one of
    ``protect.keep``. With ``last_resort`` (making room when the tightest policy did not
    free enough), the policy is set aside: everything goes but ``protect.keep``, pinned
    versions and what those need here; a version in ``protect.elsewhere`` goes even if
    pinned or needed as a base here, since a more durable tier keeps it."""
    pinned = set(pinned)
    held = tl.held()
    info = {v: tl.committed[v] for v in held}
    bases = [v for v in held if info[v].role == "base"]
    keep_bases = set(bases if policy.keep_bases is None else bases[-policy.keep_bases :])
    keep_bases |= milestones(policy, [info[v] for v in bases])
    diffs = [v for v in held if info[v].role == "diff" and info[v].base in keep_bases]
    if not policy.wants("diff"):
        # a tier that keeps bases took a diff or log version only when no other tier could
        # (a memory tier over its budget): it keeps that one while it is the newest
        # (protect.keep), not for as long as its base
        diffs = []
    if policy.keep_diffs is not None:
        diffs = diffs[-policy.keep_diffs :] if policy.keep_diffs else []
    # a log version follows a full version (a base or a diff): kept while that one is,
    # counted with the diffs by keep_diffs
    full = keep_bases | set(diffs)
    logs = [v for v in held if info[v].role == "log" and info[v].base in full]
    if not policy.wants("log"):
        logs = []
    if policy.keep_diffs is not None:
        logs = logs[-policy.keep_diffs :] if policy.keep_diffs else []
    if last_resort:  # making room: only what must stay (and what a version in flight needs)
        full, logs = set(), []
    keep = full | set(logs) | (pinned & set(held)) | (protect.keep & set(held))
    movable = protect.elsewhere - protect.keep if last_resort else frozenset()
    keep -= movable
    # a kept diff or log version (pinned ones included) keeps its base, and so on down
    todo = list(keep)
    while todo:
        v = todo.pop()
        base = info[v].base
        if (
            info[v].role in ("diff", "log")
            and base in info
            and base not in keep
            and base not in movable
        ):
            keep.add(base)
            todo.append(base)
    return [v for v in held if v not in keep]


def milestones(policy: TierPolicy, bases: Sequence[VersionInfo]) -> set[int]:
    """The milestone versions among ``bases`` (oldest first) under ``policy.milestones``:
    the oldest base of each window (every N steps, or every so long by the versions'
    clock). A milestone stays one as newer bases come: its window's oldest never changes."""
    cadence = policy.milestone_cadence
    if cadence is None:
        return set()
    windows: set[int] = set()
    out: set[int] = set()
    for v in bases:
        w = cadence.window(v.step, v.time)
        if w not in windows:
            windows.add(w)
            out.add(v.id)
    return out


def drop_versions(slot: TierSlot, versions: Iterable[int]) -> list[int]:
    """Append a drop record for each version; return those recorded."""
    assert slot.tier is not None
    done = []
    for v in versions:
        append_record(slot.tier, DropRecord(v, time.time()))
        done.append(v)
    return done


@dataclass
class GCState:
    """Per-tier memory of GC: since when each unreferenced blob counts as unreferenced (the
    grace clock: when it was written where the tier says, else when first seen),
    and what each blob header read so far said (``delta_bases``: blob id -> the base chunk
    id of a delta blob, None for any other blob)."""

    first_seen: dict[str, dict[str, float]] = field(default_factory=dict)
    # the grace clock starts at the earlier of first seen and written (Tier.written_at)
    delta_bases: dict[str, dict[str, str | None]] = field(default_factory=dict)


_MAX_HEADER = 4096  # SPEC section 3: header_size is at most 4096


class _HeaderReader:
    """Finds the base a delta blob's header names (None for other blobs),
    remembering every answer in ``cache``. ``incomplete`` is set when a header could not be
    read for a reason other than absence or damage: the mark may then miss a base."""

    def __init__(self, tier: Tier, name: str, cache: dict[str, str | None]) -> None:
        self.tier = tier
        self.name = name
        self.cache = cache
        self.reads = 0
        self.incomplete: BaseException | None = None

    def __call__(self, blob_id: str) -> str | None:
        if blob_id in self.cache:
            return self.cache[blob_id]
        try:
            self.reads += 1
            data = self.tier.head(blob_id, BLOB_HEADER_SIZE)
            if len(data) >= 10 and data[:4] == BLOB_MAGIC:
                size = int.from_bytes(data[8:10], "little")
                if BLOB_HEADER_SIZE < size <= _MAX_HEADER:  # a header with extension bytes
                    data = self.tier.head(blob_id, size)
        except NotFound:
            log.debug("gc %s: blob %s is absent, no header to read", self.name, blob_id)
            return None
        except (TierError, OSError) as exc:
            log.debug("gc %s: cannot read the header of %s: %s", self.name, blob_id, exc)
            if self.incomplete is None:
                self.incomplete = exc
            return None
        try:
            header = read_header(data, expected_id=blob_id)
        except (BlobCorrupt, FormatVersionError) as exc:
            log.debug("gc %s: unreadable header of %s, skipped: %s", self.name, blob_id, exc)
            return None
        self.cache[blob_id] = header.base_id
        return header.base_id


@dataclass
class GCReport:
    tier: str
    kept: int = 0
    unreferenced: int = 0
    deleted: int = 0
    waiting: int = 0
    deleted_ids: list[str] = field(default_factory=list)
    headers_read: int = 0  # blob headers the mark read (the delta bases blobs name)
    fenced: str | None = None  # why the sweep did not run (another process writes or sweeps)


class HasChunks(Protocol):
    """What :func:`mark` reads of a shard manifest: its chunks (a
    :class:`~tiercheck.formats.manifest.ShardManifest`, or just its chunks kept from an
    earlier sweep: :class:`ChunkList`)."""

    @property
    def chunks(self) -> Sequence[ChunkRef]: ...


@dataclass(frozen=True)
class ChunkList:
    """A shard manifest's chunks alone (manifests never change: what their id names is
    fixed), kept between sweeps so that a sweep does not decode every held manifest again:
    a manifest of thousands of entries decodes into tens of thousands of objects, whose
    allocations set off the garbage collector's passes (module docstring of
    :mod:`tiercheck.runtime.gcpause`) on the maintenance threads, under the GIL."""

    chunks: tuple[ChunkRef, ...]


def mark(
    tl: TierLog,
    manifest: Callable[[str], HasChunks],
    extra: Iterable[str] = (),
    *,
    rank: int | None = None,
    delta_base: Callable[[str], str | None] | None = None,
) -> set[str]:
    """Every blob id the tier must keep. ``rank``: the tier holds only that rank's shard of
    each version (a per-rank tier of a multi-rank job); ``None``: every shard (shared).

    Delta bases are followed transitively: through the log's ``deltas`` and, when it is
    given, through ``delta_base(blob_id)`` (the base a blob's header names, None if it is
    no delta; see the module docstring); a blob keeps both if they differ."""
    live: set[str] = set(extra)
    manifests: set[str] = set()
    for v in tl.held():
        shards = tl.committed[v].shards
        for mid in shards if rank is None else shards[rank : rank + 1]:
            live.add(mid)
            manifests.add(mid)
            live.update(c.id for c in manifest(mid).chunks)
    # delta bases, transitively
    frontier = list(live)
    while frontier:
        blob_id = frontier.pop()
        bases = {tl.deltas.get(blob_id)}
        if delta_base is not None and blob_id not in manifests:  # manifests are never deltas
            # the header too, even where the log names a base: a crashed save may have
            # rewritten a swept chunk as a delta of another base, which no record names
            bases.add(delta_base(blob_id))
        for base in bases:
            if base is not None and base not in live:
                live.add(base)
                frontier.append(base)
    return live


def _may_hold_deltas(slot: TierSlot, tl: TierLog) -> bool:
    return tl.may_hold_deltas or (slot.policy is not None and slot.policy.codec == "delta")


def collect_garbage(
    slot: TierSlot,
    tl: TierLog | Callable[[], TierLog],
    manifest: Callable[[str], HasChunks],
    *,
    in_flight: Iterable[str] = (),
    state: GCState,
    grace: float,
    dry_run: bool = False,
    now: float | None = None,
    rank: int | None = None,
    fence: GCFence | None = None,
    leases: TierLeases | None = None,
    only: Collection[str] | None = None,
) -> GCReport:
    """Sweep ``slot``'s unreferenced blobs that are past the grace period (``rank``: see
    :func:`mark`; ``only``: sweep only those of these ids, e.g. what a save that was given
    up wrote).

    ``tl`` is the tier's log, or a function that reads it: with a ``fence`` (this
    process's protected ids, :class:`~tiercheck.store.leases.GCFence`) it is called after the
    sweep has begun, so that a version committed meanwhile is either in it or still
    protected. ``leases`` (a tier shared by several processes) takes the tier's sweep lease
    first and skips the sweep while another process holds a write lease there; the report's
    ``fenced`` says why a sweep did not run.
    """
    assert slot.tier is not None
    tier = slot.tier
    report = GCReport(slot.name)
    sweeping = leases is not None and not dry_run
    if sweeping:
        assert leases is not None
        report.fenced = leases.put_sweep(tier)
        if report.fenced is not None:
            log.info("gc %s: not sweeping: %s", slot.name, report.fenced)
            return report
    if fence is not None:
        fence.begin()
    try:
        listed = list(tier.list())
        if sweeping:
            assert leases is not None
            report.fenced = leases.begin_sweep(tier, [b for b in listed if is_lease_id(b)])
            if report.fenced is not None:
                log.info("gc %s: not sweeping: %s", slot.name, report.fenced)
                return report
        _sweep(
            slot,
            tl() if callable(tl) else tl,
            manifest,
            listed,
            report,
            in_flight,
            state,
            grace,
            dry_run,
            now,
            rank,
            fence,
            only,
        )
    finally:
        if fence is not None:
            fence.done(slot.name)
        if sweeping:
            assert leases is not None
            leases.end_sweep(tier)
    return report


def _sweep(
    slot: TierSlot,
    tl: TierLog,
    manifest: Callable[[str], HasChunks],
    listed: list[str],
    report: GCReport,
    in_flight: Iterable[str],
    state: GCState,
    grace: float,
    dry_run: bool,
    now: float | None,
    rank: int | None,
    fence: GCFence | None,
    only: Collection[str] | None = None,
) -> None:
    assert slot.tier is not None
    now = time.time() if now is None else now
    headers = None
    if _may_hold_deltas(slot, tl):
        cache = state.delta_bases.setdefault(slot.name, {})
        headers = _HeaderReader(slot.tier, slot.name, cache)
    protected = set(in_flight) | (fence.protected(slot.name) if fence is not None else set())
    live = mark(tl, manifest, protected, rank=rank, delta_base=headers)
    seen = state.first_seen.setdefault(slot.name, {})
    unreferenced = []
    for blob_id in listed:
        if blob_id in live:
            report.kept += 1
        elif not is_lease_id(blob_id):  # leases are the sweep's own business (collect_garbage)
            unreferenced.append(blob_id)
    report.unreferenced = len(unreferenced)
    current = set(unreferenced)
    for blob_id in list(seen):
        if blob_id not in current:
            del seen[blob_id]
    if headers is not None:
        # a blob gone from the tier (deleted by anyone) may come back with another header
        present = set(listed)
        for blob_id in [b for b in headers.cache if b not in present]:
            del headers.cache[blob_id]
    candidates = unreferenced if only is None else [b for b in unreferenced if b in only]
    new = [b for b in candidates if b not in seen]
    for blob_id in new:
        seen[blob_id] = now
    if new and grace > 0:
        # the blob's own age: a blob a dead process wrote an hour ago is an hour old
        try:
            written = slot.tier.written_at(new)
        except (TierError, OSError) as exc:  # the grace runs from now for these, as before
            log.debug("gc %s: no blob times: %s", slot.name, exc)
            written = {}
        for blob_id, t in written.items():
            if blob_id in seen:
                seen[blob_id] = min(seen[blob_id], t)
    ripe = [b for b in candidates if now - seen[b] >= grace]
    if ripe and headers is not None and headers.incomplete is not None:
        log.warning(
            "gc %s: not sweeping %d blobs this round: a blob header could not be read "
            "(%s), so a delta base may be unmarked",
            slot.name,
            len(ripe),
            headers.incomplete,
        )
        ripe = []
    if fence is not None and not dry_run:
        ripe = fence.claim(slot.name, ripe)  # what a save protected since the mark stays
    report.waiting = len(candidates) - len(ripe)
    if ripe and not dry_run:
        report.deleted = slot.tier.delete(ripe)
        for blob_id in ripe:
            seen.pop(blob_id, None)
            if headers is not None:
                headers.cache.pop(blob_id, None)
    report.deleted_ids = ripe
    report.headers_read = headers.reads if headers is not None else 0
    if ripe:
        log.info(
            "gc %s: %d blobs %s", slot.name, len(ripe), "unreferenced" if dry_run else "deleted"
        )
