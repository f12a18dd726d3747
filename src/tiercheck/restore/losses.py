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
version newer than the newest restorable one is lost, with the tiers that held it when it
was acknowledged. Versions retention dropped are older than one it kept, so they never show
as lost. The first line of the file names the store (its id): the ledger of an earlier
store at the same root is not read as this one's.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from tiercheck.backends.base import Capabilities, FailureDomain
from tiercheck.errors import NoRestorableVersion
from tiercheck.formats.manifest import VersionInfo
from tiercheck.store.catalog import Catalog
from tiercheck.store.tierset import TierSet

__all__ = [
    "LEDGER_NAME",
    "AckLedger",
    "Acked",
    "Loss",
    "find_losses",
    "ledger_path",
    "newest_acked",
    "read_ledger",
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


def survives_reboot(caps: Capabilities) -> bool:
    """Whether a tier with ``caps`` keeps its versions through a reboot of this node."""
    return caps.persistent or caps.survives.order >= FailureDomain.NODE.order


@dataclass(frozen=True)
class Acked:
    """One version acknowledged in memory tiers only: its id, step, role and the tiers
    that held it when its save was acknowledged."""

    id: int
    step: int
    role: str
    tiers: tuple[str, ...]
    time: float = 0.0


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
    names another store than ``store_id``). A torn or damaged line is skipped."""
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
    with the tiers it was committed in."""

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

    def note(self, info: VersionInfo, committed: Sequence[str]) -> None:
        """Record ``info`` if none of ``committed`` survives a reboot. Never raises: a
        ledger that cannot be written is warned about once, and the save goes on."""
        with self._lock:
            if self.durable.intersection(committed):
                self._durable_id = max(self._durable_id, info.id)
                return
            row = Acked(info.id, info.step, info.role, tuple(committed), info.time)
            try:
                self._append(row)
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

    def _append(self, row: Acked) -> None:
        line = json.dumps(
            {
                "id": row.id,
                "step": row.step,
                "role": row.role,
                "tiers": list(row.tiers),
                "time": row.time,
            }
        )
        if self._lines is None or self._lines >= 2 * KEEP:
            kept = [a for a in read_ledger(self.path, self.store_id) if a.id > self._durable_id][
                -KEEP:
            ]
            self._rewrite(kept)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        assert self._lines is not None
        self._lines += 1

    def _rewrite(self, rows: Sequence[Acked]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps({"store": self.store_id, "format": 1}) + "\n")
            for a in rows:
                f.write(
                    json.dumps(
                        {
                            "id": a.id,
                            "step": a.step,
                            "role": a.role,
                            "tiers": list(a.tiers),
                            "time": a.time,
                        }
                    )
                    + "\n"
                )
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        self._lines = 1 + len(rows)


def lost_versions(acked: Sequence[Acked], catalog: Catalog) -> list[Acked]:
    """The acknowledged versions of ``acked`` newer than every restorable version of
    ``catalog`` and held by none of its tiers."""
    newest = max(catalog.restorable_versions(), default=-1)
    return [a for a in acked if a.id > newest and not catalog.holders(a.id)]


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
    T"`` (acknowledged, then lost with a memory tier) or ``"dropped by retention"`` (an id
    older than a version the store keeps, that no log names as aborted); None if neither."""
    for a in lost_versions(acked, catalog):
        if a.id == version or (version is None and a.step == step):
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
