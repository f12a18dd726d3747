"""Acknowledged versions the store can no longer reach: the ack ledger, and the losses it shows.

A version a save acknowledged (``wait()`` returned) in memory tiers only (shm, a peer's
memory) is gone after a reboot, and with it every record of it: the memory tier's log goes
with the memory. What survives must say it existed, or a restore resumes from an older
version without a word. That record is the **ack ledger**: a small file beside
``tiercheck.toml`` (``tiercheck.acked``, ``tiercheck.acked.RANK`` on ranks other than 0),
one JSON line per version acknowledged in no tier that survives a reboot, appended and
fsynced before the save is acknowledged.

Why a file under the root rather than a record in the durable tiers' logs: it changes no
log format and no tier interface, costs one small append and fsync per save (none at all
for a version a reboot-proof tier holds), and the root is where ``tiercheck.toml`` already
lives on the node whose memory it describes. A version that a reboot-proof tier commits
needs no line: the tier's own log records it.

Reading: :func:`find_losses` compares the ledger with a merged catalog. Every acknowledged
version newer than the newest restorable one is lost *now*, with the tiers that held it
when it was acknowledged. Versions retention dropped are older than one it kept, so they
never show as lost. The first line of the file names the store (its id): the ledger of an
earlier store at the same root is not read as this one's.

A loss stays on record. Once a newer version is committed, nothing in the logs tells a
version lost with its tier from one that tier let go of for a newer one: so the first
writable open after a loss (:class:`AckLedger`, before this process commits anything)
appends the lost versions to the ledger again, marked ``"lost": true``. History
(:func:`reported_losses`) lists a version so marked as lost for as long as no tier holds
it and the store keeps a version older than it: once retention has dropped every older
version, it would have dropped this one by now too. With several ranks every rank's
ledger is in the root when the ranks share it, and each rank's history also lists the
versions another rank recorded as lost that no tier shared by every rank holds.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tiercheck.backends.base import Capabilities, FailureDomain
from tiercheck.errors import NoRestorableVersion, TiercheckError
from tiercheck.formats.manifest import VersionInfo
from tiercheck.store.catalog import Catalog, read_catalog
from tiercheck.store.tierset import TierSet

__all__ = [
    "LEDGER_NAME",
    "AckLedger",
    "Acked",
    "ListedLoss",
    "Loss",
    "find_losses",
    "ledger_path",
    "ledgers",
    "listed_losses",
    "newest_acked",
    "read_ledger",
    "recorded_losses",
    "reported_losses",
    "survives_reboot",
]

log = logging.getLogger(__name__)

LEDGER_NAME = "tiercheck.acked"
#: the newest lost versions a rank tells the others of (one message holds them)
SHARED_STEPS = 100
#: Lines kept when the ledger is rewritten (it is rewritten once it holds twice as many).
KEEP = 2048


def ledger_path(root: str | os.PathLike[str], rank: int = 0) -> Path:
    """Where the ack ledger of rank ``rank`` of the store at ``root`` lives."""
    return Path(root) / (LEDGER_NAME if rank == 0 else f"{LEDGER_NAME}.{rank}")


def ledgers(root: str | os.PathLike[str]) -> dict[int, Path]:
    """Every rank's ack ledger under ``root``, by rank (those the root holds: with
    several ranks, all of them where the ranks share the root)."""
    out: dict[int, Path] = {}
    for path in Path(root).glob(f"{LEDGER_NAME}*"):
        suffix = path.name[len(LEDGER_NAME) :]
        if not suffix:
            out[0] = path
        elif suffix[0] == "." and suffix[1:].isdigit():
            out[int(suffix[1:])] = path
    return dict(sorted(out.items()))


def survives_reboot(caps: Capabilities) -> bool:
    """Whether a tier with ``caps`` keeps its versions through a reboot of this node."""
    return caps.persistent or caps.survives.order >= FailureDomain.NODE.order


@dataclass(frozen=True)
class Acked:
    """One version acknowledged in memory tiers only: its id, step, role and the tiers
    that held it when its save was acknowledged; ``lost``: a writable open found it lost
    (:meth:`AckLedger.record_losses`)."""

    id: int
    step: int
    role: str
    tiers: tuple[str, ...]
    time: float = 0.0
    lost: bool = False

    def to_json(self) -> dict[str, Any]:
        """This row as one line of the ledger holds it."""
        row: dict[str, Any] = {
            "id": self.id,
            "step": self.step,
            "role": self.role,
            "tiers": list(self.tiers),
            "time": self.time,
        }
        if self.lost:
            row["lost"] = True
        return row


@dataclass(frozen=True)
class Loss:
    """Acknowledged versions a restore could not reach: lost with ``tiers``.

    ``versions`` and ``steps`` are theirs, oldest first; ``restored`` is the step the
    restore resumed from (None when nothing could be restored)."""

    versions: tuple[int, ...]
    steps: tuple[int, ...]
    tiers: tuple[str, ...]
    restored: int | None = None
    #: the rank whose acknowledged versions these are, where another rank's restore
    #: reports them (it lost nothing it could read, but resumed from the same older step)
    rank: int | None = None
    #: tiers that could not be reached: a migration may have copied the versions there
    unreached: tuple[str, ...] = ()

    @property
    def newest_step(self) -> int:
        return self.steps[-1]

    def shared(self) -> str:
        """This loss as text for the other ranks (:meth:`from_shared`): the newest
        :data:`SHARED_STEPS` versions of it, so that it fits one message."""
        return json.dumps(
            [
                self.versions[-SHARED_STEPS:],
                self.steps[-SHARED_STEPS:],
                self.tiers,
                self.restored,
                self.unreached,
            ]
        )

    @classmethod
    def from_shared(cls, text: str, rank: int) -> Loss:
        versions, steps, tiers, restored, unreached = json.loads(text)
        return cls(tuple(versions), tuple(steps), tuple(tiers), restored, rank, tuple(unreached))

    def __str__(self) -> str:
        tiers = ", ".join(self.tiers) or "a memory tier"
        if self.rank is not None:
            tiers = f"{tiers} of rank {self.rank}"
        n = len(self.steps)
        what = f"step {self.steps[0]}" if n == 1 else f"{n} versions, steps {_span(self.steps)}"
        resumed = (
            f"resumed from step {self.restored}"
            if self.restored is not None
            else "nothing older can be restored"
        )
        maybe = ""
        if self.unreached:
            down = ", ".join(self.unreached)
            maybe = (
                f"; tier {down} could not be reached and may hold a copy that a migration "
                "made later: restore again once it can be"
            )
        return (
            f"lost with tier {tiers}: {what} (version(s) {_span(self.versions)}) were "
            f"acknowledged in tier {tiers} only, which does not survive a reboot{maybe}; "
            f"{resumed}"
        )


def _span(values: Sequence[int]) -> str:
    if len(values) <= 4:
        return ", ".join(map(str, values))
    return f"{values[0]}, {values[1]}, ..., {values[-1]}"


def read_ledger(path: Path, store_id: str | None) -> list[Acked]:
    """The versions the ledger at ``path`` lists, oldest first (none if it is missing, or
    names another store than ``store_id``). A torn or damaged line is skipped; of lines
    with the same id, the last counts (a version is listed again once found lost)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    lines = text.splitlines()
    if not lines:
        return []
    try:
        header = json.loads(lines[0])
    except ValueError:
        return []
    if not isinstance(header, dict) or (
        store_id is not None and header.get("store") not in (None, store_id)
    ):
        return []
    out: dict[int, Acked] = {}
    for line in lines[1:]:
        try:
            row = json.loads(line)
            acked = Acked(
                int(row["id"]),
                int(row["step"]),
                str(row.get("role", "")),
                tuple(str(t) for t in row["tiers"]),
                float(row.get("time", 0.0)),
                row.get("lost") is True,
            )
        except (ValueError, KeyError, TypeError):
            continue
        out[acked.id] = acked
    return [out[k] for k in sorted(out)]


def newest_acked(root: Path | None, rank: int, store_id: str | None) -> int:
    """The newest version id the ack ledger of ``rank`` names (-1 if none). A version it
    names was acknowledged, though no tier read now may hold it (lost with a reboot, or in
    a tier that cannot be reached now): its id is never drawn again."""
    if root is None:
        return -1
    return max((a.id for a in read_ledger(ledger_path(root, rank), store_id)), default=-1)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AckLedger:
    """The writer of one store's ack ledger (one per open writable store and rank).

    :meth:`note` is called for each committed version, before its save is acknowledged,
    with the tiers it was committed in. Made when the store opens, before any save of this
    process: it records the losses found then (:meth:`record_losses`)."""

    def __init__(self, root: Path, tierset: TierSet, rank: int = 0) -> None:
        self.path = ledger_path(root, rank)
        self.store_id = tierset.store_id
        self.durable = frozenset(
            s.name
            for s in tierset.slots
            if s.tier is not None and survives_reboot(s.tier.capabilities)
        )
        self._lock = threading.Lock()
        self._lines: int | None = None  # lines in the file, once it was checked
        self._durable_id = -1  # the newest version this process committed in a durable tier
        self._warned = False
        self.record_losses(tierset)

    def record_losses(self, tierset: TierSet) -> None:
        """Append, marked lost, the versions of the ledger that no tier of ``tierset``
        holds and that are newer than every version they hold restorable
        (:func:`lost_versions`): lost with their tiers, since, this process having
        committed nothing yet, nothing newer can have superseded them. Once this process
        commits a newer version, only the mark tells them from versions retention let go.

        Costs a read of the logs of the memory tiers the ledger names (the tiers its
        versions were acknowledged in), and of every tier's only when some version of the
        ledger is held by none of its tiers, nor anything newer (then its tier was lost, or
        dropped it for a newer version a more durable tier holds). Never raises: a loss
        that cannot be recorded is warned about."""
        try:
            rows = [a for a in read_ledger(self.path, self.store_id) if not a.lost]
            if not rows:
                return
            tiers = tierset.tiers()
            named = {t: tiers[t] for a in rows for t in a.tiers if t in tiers}
            newest = {n: max(tl.held(), default=-1) for n, tl in read_catalog(named).logs.items()}
            if all(any(newest.get(t, -1) >= a.id for t in a.tiers) for a in rows):
                return
            down = [s.name for s in tierset.slots if s.tier is None]
            if down:  # it may hold a newer version that superseded them: no judging now
                log.warning(
                    "not recording which acknowledged versions were lost while tier(s) %s "
                    "cannot be reached (a newer version there may have superseded them): "
                    "once a newer version is committed, history no longer lists them as lost",
                    ", ".join(down),
                )
                return
            lost = lost_versions(rows, read_catalog(tiers))
            if lost:
                with self._lock:
                    self._append([replace(a, lost=True) for a in lost])
        except (OSError, TiercheckError) as exc:
            log.warning(
                "could not record in %s which acknowledged versions were lost (%s): once a "
                "newer version is committed, history no longer lists them as lost",
                self.path,
                exc,
            )

    def note(self, info: VersionInfo, committed: Sequence[str]) -> None:
        """Record ``info`` if none of ``committed`` survives a reboot. Never raises: a
        ledger that cannot be written is warned about once, and the save goes on."""
        with self._lock:
            if self.durable.intersection(committed):
                self._durable_id = max(self._durable_id, info.id)
                return
            row = Acked(info.id, info.step, info.role, tuple(committed), info.time)
            try:
                self._append([row])
            except OSError as exc:
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "could not record version %d in %s (%s): if this node reboots before "
                        "a tier that survives it holds a newer version, the restore cannot "
                        "say which acknowledged steps were lost",
                        info.id,
                        self.path,
                        exc,
                    )

    def _append(self, rows: Sequence[Acked]) -> None:
        """Append ``rows``, one fsync for all. A ledger rewritten (the first append of a
        process, or once it holds ``2 * KEEP`` lines) keeps its newest ``KEEP`` versions
        of those a newer version this process committed in a durable tier has not
        superseded, and its newest ``KEEP`` of those recorded lost."""
        if self._lines is None or self._lines >= 2 * KEEP:
            held = read_ledger(self.path, self.store_id)
            lost = [a for a in held if a.lost][-KEEP:]  # not pushed out by newer saves
            live = [a for a in held if not a.lost and a.id > self._durable_id][-KEEP:]
            self._rewrite(sorted(lost + live, key=lambda a: a.id))
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(a.to_json()) + "\n" for a in rows))
            f.flush()
            os.fsync(f.fileno())
        assert self._lines is not None
        self._lines += len(rows)

    def _rewrite(self, rows: Sequence[Acked]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps({"store": self.store_id, "format": 1}) + "\n")
            for a in rows:
                f.write(json.dumps(a.to_json()) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        self._lines = 1 + len(rows)


def lost_versions(acked: Sequence[Acked], catalog: Catalog) -> list[Acked]:
    """The acknowledged versions of ``acked`` newer than every restorable version of
    ``catalog`` and held by none of its tiers: lost now (what a restore reports)."""
    newest = max(catalog.restorable_versions(), default=-1)
    return [a for a in acked if a.id > newest and not catalog.holders(a.id)]


def reported_losses(
    acked: Sequence[Acked], catalog: Catalog, *, shared: Collection[str] | None = None
) -> list[Acked]:
    """The versions of ``acked`` that history lists as lost: lost now
    (:func:`lost_versions`), or recorded lost and held by no tier of ``catalog`` while it
    holds a version older than it (once retention has dropped every older version, it
    would have dropped this one by now too).

    ``shared``: ``acked`` is another rank's ledger; of its versions only those recorded
    lost count, and only the tiers named (those shared by every rank, which hold every
    rank's shard of a version they hold) can tell that one is held."""
    oldest = min((v for tl in catalog.logs.values() for v in tl.held()), default=None)
    if shared is None:
        now = {a.id for a in lost_versions(acked, catalog)}
        names: Collection[str] = catalog.logs
    else:
        now, names = set(), shared
    logs = [catalog.logs[n] for n in names if n in catalog.logs]
    return [
        a
        for a in acked
        if a.id in now
        or (
            a.lost
            and oldest is not None
            and oldest < a.id
            and not any(tl.holds(a.id) for tl in logs)
        )
    ]


@dataclass(frozen=True)
class ListedLoss:
    """A version history lists as lost: its id, step, role and time, the rank whose
    ledger reports it, and ``gone``, why (``"lost with tier shm"``, ``"lost with tier shm
    of rank 1"``)."""

    id: int
    step: int
    role: str
    time: float
    rank: int
    gone: str


def listed_losses(
    root: Path, rank: int, store_id: str | None, catalog: Catalog, shared: Collection[str]
) -> dict[int, ListedLoss]:
    """The versions the history of ``rank`` lists as lost (:func:`reported_losses`), by
    id: its own ledger's, and those the ledgers of the other ranks under ``root`` recorded
    lost (a loss of any rank is the job's: no restore can use the version) unless one of
    the ``shared`` tiers of ``catalog`` holds them."""
    return _by_version(
        root,
        rank,
        store_id,
        lambda acked, other: reported_losses(acked, catalog, shared=shared if other else None),
    )


def recorded_losses(root: Path, rank: int, store_id: str | None) -> dict[int, ListedLoss]:
    """Every version the ack ledgers under ``root`` (of every rank) record as lost, by id,
    whether history lists it still or not (it is no longer listed once the store keeps
    no older version): what names a version no tier holds any more, when asked for."""
    return _by_version(root, rank, store_id, lambda acked, other: [a for a in acked if a.lost])


def _by_version(
    root: Path,
    rank: int,
    store_id: str | None,
    pick: Callable[[Sequence[Acked], bool], Sequence[Acked]],
) -> dict[int, ListedLoss]:
    """``pick(rows, other)`` of the ledger of ``rank`` (``other`` false), then of every
    other rank's under ``root``, by version: a version ``rank`` lost is its own loss, else
    that of every other rank that lost it."""
    paths = ledgers(root)
    paths.setdefault(rank, ledger_path(root, rank))
    found: dict[int, dict[int, Acked]] = {}
    for r in sorted(paths, key=lambda r: r != rank):
        for a in pick(read_ledger(paths[r], store_id), r != rank):
            found.setdefault(a.id, {})[r] = a
    out: dict[int, ListedLoss] = {}
    for vid, by_rank in sorted(found.items()):
        mine = by_rank.get(rank)
        if mine is not None:
            by_rank = {rank: mine}
        tiers = ", ".join(dict.fromkeys(t for a in by_rank.values() for t in a.tiers))
        ranks = ", ".join(map(str, by_rank))
        of = "" if mine is not None else f" of rank{'s' if len(by_rank) > 1 else ''} {ranks}"
        first, a = next(iter(by_rank.items()))
        out[vid] = ListedLoss(vid, a.step, a.role, a.time, first, f"lost with tier {tiers}{of}")
    return out


def find_losses(
    root: Path | None,
    rank: int,
    store_id: str | None,
    catalog: Catalog,
    *,
    restored: int | None = None,
    unreached: Collection[str] = (),
) -> Loss | None:
    """What the ledger says was acknowledged and ``catalog`` can no longer restore; None
    when nothing was lost (or the store keeps no ledger). ``unreached``: the tiers that
    could not be reached, which the loss names as ones that may hold a copy."""
    if root is None:
        return None
    lost = lost_versions(read_ledger(ledger_path(root, rank), store_id), catalog)
    if not lost:
        return None
    tiers = tuple(dict.fromkeys(t for a in lost for t in a.tiers))
    return Loss(
        versions=tuple(a.id for a in lost),
        steps=tuple(a.step for a in lost),
        tiers=tiers,
        restored=restored,
        unreached=tuple(sorted(set(unreached) - set(tiers))),
    )


def gone_reason(
    acked: Sequence[Acked],
    catalog: Catalog,
    *,
    version: int | None = None,
    step: int | None = None,
) -> str | None:
    """Why the version ``version`` (or of ``step``) is not in ``catalog``: ``"lost with tier
    T"`` (acknowledged, then lost with a memory tier: lost now, or recorded lost) or
    ``"dropped by retention"`` (an id older than a version the store keeps, that no log
    names as aborted); None if neither."""
    now = {a.id for a in lost_versions(acked, catalog)}
    for a in acked:
        if (
            (a.id in now or a.lost)
            and not catalog.holders(a.id)
            and (a.id == version or (version is None and a.step == step))
        ):
            return f"lost with tier {', '.join(a.tiers)}"
    if version is None:
        ids = [a.id for a in acked if a.step == step and a.id not in catalog.versions]
        if not ids:
            return None
        version = ids[-1]
    if version in catalog.versions or version > max(catalog.versions, default=-1):
        return None
    if any(version in tl.aborted for tl in catalog.logs.values()):
        return None
    return "dropped by retention"


def unreadable_tiers(
    tierset: TierSet, catalog: Catalog, names: Sequence[str] | None = None
) -> dict[str, str]:
    """The tiers (of ``names``, else all) whose versions cannot be known here: unreachable
    (when opened, or when their logs were read), unavailable when opened for another
    reason, or with damaged log records; by name, with why."""
    out: dict[str, str] = {}
    for slot in tierset.slots:
        if names is not None and slot.name not in names:
            continue
        if slot.tier is None:
            out[slot.name] = f"{'unreachable' if slot.unreachable else 'unavailable'}: {slot.error}"
        elif slot.name in catalog.unreachable:
            out[slot.name] = f"unreachable: {catalog.unreachable[slot.name]}"
        elif slot.name in catalog.logs and catalog.logs[slot.name].damaged:
            tl = catalog.logs[slot.name]
            out[slot.name] = f"damaged: {len(tl.damaged)} log record(s) unreadable"
    return out


def unreached_tiers(tierset: TierSet, catalog: Catalog) -> set[str]:
    """The tiers that could not be reached, when opened or when their logs were read: down
    for now, not known to be damaged."""
    return {s.name for s in tierset.slots if s.tier is None and s.unreachable} | set(
        catalog.unreachable
    )


def nothing_reachable(
    root: Path | None,
    rank: int,
    tierset: TierSet,
    catalog: Catalog,
    names: Sequence[str] | None,
) -> NoRestorableVersion | None:
    """The error for a restore that found no version, when that is not an empty store:
    acknowledged versions were lost (the ack ledger), or a tier that may hold versions is
    damaged or unreachable. None when the store is truly empty (then ``EmptyStore``): a
    tier that could not be reached holds no version of a store this very open created
    (``TierSet.created``)."""
    loss = find_losses(root, rank, tierset.store_id, catalog)
    bad = unreadable_tiers(tierset, catalog, names)
    down = unreached_tiers(tierset, catalog)
    if tierset.created:
        bad = {n: w for n, w in bad.items() if n not in down}
    down &= set(bad)
    if loss is None and (catalog.versions or not bad):
        return None
    parts = [str(loss)] if loss is not None else []
    parts += [f"tier {n} is {w}" for n, w in bad.items()]
    todo = []
    if down:
        todo.append(
            f"restore again once tier {', '.join(sorted(down))} can be reached (or name the "
            "other tiers in restore(..., tiers=[...]) to restore from them alone)"
        )
    if set(bad) - down:
        todo.append(
            "repair or move aside the damaged tier (see docs/troubleshooting.md) and restore again"
        )
    if not bad:
        todo.append(f"to start over, delete the store (tiercheck rm {root}) or open another root")
    what = "" if loss is not None else ", but the store is not known to be empty"
    return NoRestorableVersion(
        f"no version can be restored{what}: {'; '.join(parts)}. {'; '.join(todo)}"
    )
