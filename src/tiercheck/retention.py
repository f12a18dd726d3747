"""Retention (which versions a tier keeps) and garbage collection (which blobs it keeps).

Retention drops versions from a tier by appending ``drop`` records, never deleting data
directly: the newest ``keep_bases`` bases are kept, diffs are kept only while their base
is, the newest ``keep_diffs`` of those; pinned versions (a migration still reading them)
are never dropped, and neither is a base that a kept diff needs.

GC is mark-and-sweep per tier: the mark set is every chunk and manifest of every version
the tier holds, every delta base those chunks need, and every id a save or migration in
flight references. A blob outside it is deleted only once it has been seen unreferenced
for ``grace`` seconds, which protects blobs another process is writing right now.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tiercheck.formats.manifest import DropRecord, ShardManifest
from tiercheck.manifest_log import TierLog, append_record
from tiercheck.placement import TierPolicy
from tiercheck.tierset import TierSlot

__all__ = ["GCReport", "GCState", "collect_garbage", "drop_versions", "plan_drops"]

log = logging.getLogger("tiercheck")


def plan_drops(tl: TierLog, policy: TierPolicy, pinned: Iterable[int] = ()) -> list[int]:
    """Versions ``policy`` says to drop from the tier whose log is ``tl``."""
    pinned = set(pinned)
    held = tl.held()
    info = {v: tl.committed[v] for v in held}
    bases = [v for v in held if info[v].role == "base"]
    keep_bases = set(bases if policy.keep_bases is None else bases[-policy.keep_bases :])
    diffs = [v for v in held if info[v].role == "diff" and info[v].base in keep_bases]
    if policy.keep_diffs is not None:
        diffs = diffs[-policy.keep_diffs :] if policy.keep_diffs else []
    keep = keep_bases | set(diffs) | (pinned & set(held))
    # a kept diff (pinned ones included) keeps its base
    for v in list(keep):
        base = info[v].base
        if info[v].role == "diff" and base is not None and base in info:
            keep.add(base)
    return [v for v in held if v not in keep]


def drop_versions(slot: TierSlot, versions: Iterable[int], tl: TierLog | None = None) -> None:
    """Append a drop record for each version (and note it in ``tl``)."""
    assert slot.tier is not None
    for v in versions:
        append_record(slot.tier, DropRecord(v, time.time()))
        if tl is not None:
            tl.dropped.add(v)


@dataclass
class GCState:
    """Per-tier memory of when each unreferenced blob was first seen (the grace clock)."""

    first_seen: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class GCReport:
    tier: str
    kept: int = 0
    unreferenced: int = 0
    deleted: int = 0
    waiting: int = 0
    deleted_ids: list[str] = field(default_factory=list)


def mark(
    tl: TierLog,
    manifest: Callable[[str], ShardManifest],
    extra: Iterable[str] = (),
    *,
    rank: int | None = None,
) -> set[str]:
    """Every blob id the tier must keep. ``rank``: the tier holds only that rank's shard of
    each version (a per-rank tier of a multi-rank job); ``None``: every shard (shared)."""
    live: set[str] = set(extra)
    for v in tl.held():
        shards = tl.committed[v].shards
        for mid in shards if rank is None else shards[rank : rank + 1]:
            live.add(mid)
            live.update(c.id for c in manifest(mid).chunks)
    # delta bases, transitively
    frontier = [c for c in live if c in tl.deltas]
    while frontier:
        base = tl.deltas[frontier.pop()]
        if base not in live:
            live.add(base)
            if base in tl.deltas:
                frontier.append(base)
    return live


def collect_garbage(
    slot: TierSlot,
    tl: TierLog,
    manifest: Callable[[str], ShardManifest],
    *,
    in_flight: Iterable[str] = (),
    state: GCState,
    grace: float,
    dry_run: bool = False,
    now: float | None = None,
    rank: int | None = None,
) -> GCReport:
    """Sweep ``slot``'s unreferenced blobs that are past the grace period (``rank``: see
    :func:`mark`)."""
    assert slot.tier is not None
    now = time.time() if now is None else now
    live = mark(tl, manifest, in_flight, rank=rank)
    report = GCReport(slot.name)
    seen = state.first_seen.setdefault(slot.name, {})
    unreferenced = []
    for blob_id in slot.tier.list():
        if blob_id in live:
            report.kept += 1
        else:
            unreferenced.append(blob_id)
    report.unreferenced = len(unreferenced)
    current = set(unreferenced)
    for blob_id in list(seen):
        if blob_id not in current:
            del seen[blob_id]
    ripe = []
    for blob_id in unreferenced:
        first = seen.setdefault(blob_id, now)
        if now - first >= grace:
            ripe.append(blob_id)
    report.waiting = len(unreferenced) - len(ripe)
    if ripe and not dry_run:
        report.deleted = slot.tier.delete(ripe)
        for blob_id in ripe:
            seen.pop(blob_id, None)
    report.deleted_ids = ripe
    if ripe:
        log.info(
            "gc %s: %d blobs %s", slot.name, len(ripe), "unreferenced" if dry_run else "deleted"
        )
    return report
