"""Verifying a store: :func:`verify` re-hashes every blob of every version each tier keeps
and optionally repairs bad or missing copies from another tier.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiercheck.errors import (
    BlobCorrupt,
    CheckpointError,
    ConfigError,
    FormatVersionError,
    NotFound,
    TierError,
)
from tiercheck.formats.codecs import decode_blob, encode_blob
from tiercheck.history.versions import ProblemKind, Progress, Version, vanished_tiers
from tiercheck.history.view import StoreView
from tiercheck.store.catalog import TierLog
from tiercheck.store.fetch import ChunkFetcher, repair_codec
from tiercheck.store.tierset import TierSlot

__all__ = ["BlobProblem", "TierVerify", "VerifyReport", "verify"]


@dataclass
class BlobProblem:
    """A blob a tier should hold that is ``corrupt``, ``missing`` (also used for a whole
        tier whose content vanished, with ``id=""``), could not be read
        (``unreadable``; also used for a whole tier that cannot be reached, with ``id=""``), or
        was written by a newer major format than this tiercheck reads (``newer-format``: not
        known to be damaged, but not checkable here either; upgrade tiercheck to check it).
    A damaged record of a tier's log is ``damaged-log`` (``id=""``, ``detail`` says where it
    was, ``versions`` the versions prepared in that tier without a decision there: their
    commit record may be the one lost).

        ``--repair`` rewrites ``corrupt`` and ``missing`` copies only: it never replaces a newer
        writer's copy with one in this reader's older format.
    """

    tier: str
    id: str
    kind: ProblemKind
    detail: str
    versions: tuple[int, ...] = ()
    repaired: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "id": self.id,
            "kind": self.kind,
            "detail": self.detail,
            "versions": list(self.versions),
            "repaired": self.repaired,
        }


@dataclass
class TierVerify:
    """What verify checked in one tier."""

    tier: str
    versions: int = 0
    blobs: int = 0
    bytes: int = 0
    reachable: bool = True

    def to_json(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "versions": self.versions,
            "blobs": self.blobs,
            "bytes": self.bytes,
            "reachable": self.reachable,
        }


@dataclass
class VerifyReport:
    """Every tier checked and every problem found (``ok``: none left unrepaired)."""

    tiers: list[TierVerify] = field(default_factory=list)
    problems: list[BlobProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(p.repaired for p in self.problems)

    @property
    def repaired(self) -> int:
        return sum(p.repaired for p in self.problems)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "tiers": [t.to_json() for t in self.tiers],
            "problems": [p.to_json() for p in self.problems],
            "repaired": self.repaired,
            "unrepaired": sum(not p.repaired for p in self.problems),
        }


def _check_blob(
    slot: TierSlot, blob_id: str, base_lookup: Callable[[str], bytes]
) -> tuple[int, BlobProblem | None]:
    """Read and re-hash one blob in ``slot``: ``(stored bytes, problem or None)``."""
    assert slot.tier is not None
    try:
        blob = slot.tier.get(blob_id)
        decode_blob(blob, blob_id, base_lookup=base_lookup)
    except FormatVersionError as exc:  # this blob's header, or that of a delta base it needs
        return 0, BlobProblem(slot.name, blob_id, "newer-format", str(exc))
    except BlobCorrupt as exc:
        return 0, BlobProblem(slot.name, blob_id, "corrupt", str(exc))
    except NotFound:
        return 0, BlobProblem(slot.name, blob_id, "missing", "the tier does not have it")
    except (TierError, OSError) as exc:
        return 0, BlobProblem(slot.name, blob_id, "unreadable", str(exc))
    return len(blob), None


def verify(
    store: StoreView[Version],
    *,
    tiers: Sequence[str] | None = None,
    repair: bool = False,
    progress: Progress | None = None,
) -> VerifyReport:
    """Re-hash every blob of every version each tier (or each of ``tiers``) keeps.

    Checks each version's shard manifests, every chunk they name and the delta bases those
    chunks need. Every problem is reported per blob copy and the pass goes on, including
    for a blob or manifest written by a newer major format (``newer-format``: the chunks
    of such a manifest cannot be listed, those of the other versions are still checked).
    With ``repair`` (the store must be open for writing), a corrupt or missing copy is
    rewritten from an intact copy in another tier and checked again. Next to a writer
    (a read-only pass beside a training job), a copy that turns out bad is a problem only
    if its tier still holds one of its versions once the pass is done: a version the
    writer's retention dropped meanwhile is not checked.
    """
    if repair and store.read_only:
        raise CheckpointError("verify --repair needs the store open for writing")
    catalog = store.refresh()
    names = [s.name for s in store.tierset.slots]
    if tiers is not None:
        unknown = [t for t in tiers if t not in names]
        if unknown:
            raise ConfigError(f"unknown tier {unknown[0]!r}; this store's tiers: {names}")
    chosen = [s for s in store.tierset.slots if tiers is None or s.name in tiers]
    vanished = vanished_tiers(store, catalog)
    everywhere = ChunkFetcher(store.tierset.by_speed(), repair=False)

    def base_lookup(blob_id: str) -> bytes:
        return bytes(everywhere.fetch(blob_id)[0])

    report = VerifyReport()
    found: list[BlobProblem] = []
    work: list[tuple[TierSlot, str]] = []
    refs: dict[tuple[str, str], set[int]] = defaultdict(set)
    # manifests of a newer schema (or whose every copy is of a newer blob format)
    unlisted: dict[tuple[str, str], BlobProblem] = {}
    for slot in chosen:
        tl = catalog.logs.get(slot.name)
        tv = TierVerify(slot.name)
        report.tiers.append(tv)
        if slot.tier is None or tl is None:
            tv.reachable = False
            why = slot.error or catalog.unreachable.get(slot.name, "cannot be reached")
            report.problems.append(BlobProblem(slot.name, "", "unreadable", why))
            continue
        if slot.name in vanished:
            report.problems.append(BlobProblem(slot.name, "", "missing", vanished[slot.name]))
            continue
        report.problems.extend(_log_problems(slot.name, tl))
        ids: dict[str, None] = {}
        held = tl.held()
        tv.versions = len(held)
        for vid in held:
            for mid in tl.committed[vid].shards:
                ids.setdefault(mid)
                refs[(slot.name, mid)].add(vid)
                try:
                    manifest = everywhere.manifest(mid)
                except FormatVersionError as exc:
                    # its chunks cannot be listed; the other versions are still checked
                    unlisted[(slot.name, mid)] = BlobProblem(
                        slot.name, mid, "newer-format", f"chunks not checked: {exc}"
                    )
                    continue
                except (TierError, OSError) as exc:
                    found.append(
                        BlobProblem(slot.name, mid, "unreadable", f"no readable manifest: {exc}")
                    )
                    continue
                for ref in manifest.chunks:
                    ids.setdefault(ref.id)
                    refs[(slot.name, ref.id)].add(vid)
        frontier = [c for c in ids if c in tl.deltas]
        while frontier:
            chunk = frontier.pop()
            base = tl.deltas[chunk]
            # a delta base is needed by the versions of the chunks encoded against it
            refs[(slot.name, base)] |= refs[(slot.name, chunk)]
            if base not in ids:
                ids.setdefault(base)
                if base in tl.deltas:
                    frontier.append(base)
        work.extend((slot, blob_id) for blob_id in ids)
    total = len(work)
    if progress is not None:
        progress(0, total)
    by_name = {tv.tier: tv for tv in report.tiers}

    def check(item: tuple[TierSlot, str]) -> tuple[TierSlot, str, int, BlobProblem | None]:
        slot, blob_id = item
        n, problem = _check_blob(slot, blob_id, base_lookup)
        return slot, blob_id, n, problem

    for done, (slot, blob_id, n, problem) in enumerate(store.executors.io.map(check, work), 1):
        tv = by_name[slot.name]
        tv.blobs += 1
        tv.bytes += n
        if problem is None or problem.kind == "newer-format":
            # one report per copy of a newer manifest, saying its chunks went unchecked
            problem = unlisted.pop((slot.name, blob_id), None) or problem
        if problem is not None:
            found.append(problem)
        if progress is not None and (done == total or done % 64 == 0):
            progress(done, total)
    found.extend(unlisted.values())  # a newer manifest whose copy here is also damaged
    for problem in found:
        problem.versions = tuple(sorted(refs.get((problem.tier, problem.id), ())))
    if found:
        found = _still_held(store, found)
    if repair:
        for problem in found:
            _repair(store, problem, base_lookup)
    report.problems.extend(found)
    return report


def _still_held(store: StoreView[Version], found: list[BlobProblem]) -> list[BlobProblem]:
    """``found`` less the problems of versions a writer's retention dropped while they were
    checked: the logs are read again, and a copy is a problem only for the versions its
    tier still holds (a writer saving next to this read-only pass drops versions and
    sweeps their blobs at any moment; what it dropped is no damage)."""
    catalog = store.refresh()
    kept = []
    for problem in found:
        tl = catalog.logs.get(problem.tier)
        if tl is None or not problem.versions:
            kept.append(problem)
            continue
        held = tuple(v for v in problem.versions if tl.holds(v))
        if held:
            problem.versions = held
            kept.append(problem)
    return kept


def _log_problems(tier: str, tl: TierLog) -> list[BlobProblem]:
    """One problem per damaged record of ``tl``."""
    if not tl.damaged:
        return []
    undecided = tuple(
        v for v in sorted(tl.prepared) if v not in tl.committed and v not in tl.aborted
    )
    why = "what it recorded (a commit, a drop) is lost from this tier"
    if undecided:
        why += (
            f"; prepared here without a decision: version(s) {', '.join(map(str, undecided))}"
            " (a commit record lost here leaves them out of the history)"
        )
    return [
        BlobProblem(tier, "", "damaged-log", f"{where}: {why}", undecided) for where in tl.damaged
    ]


def _repair(
    store: StoreView[Version], problem: BlobProblem, base_lookup: Callable[[str], bytes]
) -> None:
    slot = store.tierset.get(problem.tier)
    if problem.kind == "newer-format":
        problem.detail += "; not repaired: a newer writer's copy is left as it is"
        return
    if slot.tier is None or problem.kind == "unreadable" or not problem.id:
        return
    others = [s for s in store.tierset.by_speed() if s.name != slot.name]
    try:
        raw, source = ChunkFetcher(others, repair=False).fetch(problem.id)
        blob = encode_blob(raw, repair_codec(slot), level=store.policy.zstd_level)
        slot.tier.put(problem.id, blob, overwrite=True)
    except (TierError, OSError) as exc:
        problem.detail += f"; repair failed: {exc}"
        return
    _, again = _check_blob(slot, problem.id, base_lookup)
    if again is None:
        problem.repaired = True
        problem.detail += f"; repaired from {source}"
    else:
        problem.detail += f"; still bad after repair: {again.detail}"
