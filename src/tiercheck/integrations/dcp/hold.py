"""Each rank store keeps its shard of the newest finished DCP checkpoint.

A rank commits its shard of a checkpoint in its own store before the coordinator finishes
the checkpoint, and its store's retention runs at that commit: a base there lets go of the
diffs of the base before (the default shm tier keeps the newest base and its diffs), among
them the rank's shard of the newest finished checkpoint. Until the coordinator has
recorded the new checkpoint, that shard is still needed: a job killed in between resumes
from the newest finished checkpoint. So every rank *holds* it
(:meth:`~tiercheck.Checkpointer.hold`), one version (and what it needs) besides what
retention keeps, until a newer checkpoint is finished:

- the coordinator, planning a save, reads the newest checkpoint its store finished and the
  version of each rank it records (:func:`finished_shards`, from the ``shards`` of its
  mark), and sends each rank its own in the plan;
- each rank, before it saves its shard, holds that version and records it in the shard's
  mark (``hold``). A rank whose plan DCP cached (``enable_plan_caching``) hears nothing
  from the coordinator, nor does one whose coordinator's newest checkpoint was saved before
  marks named their shards: it holds its previous shard, which DCP finished if the save
  that wrote it returned (:func:`previous_shard`);
- a rank store opened again (a restarted job) holds from the open on the version its newest
  shard recorded (:func:`recorded_hold`, :class:`HoldingCoordinator`): what the open's
  retention would drop is kept until the first commit after the open (the coordinator's
  word arrives with that save: while it is written, both may be held).

A store opened outside :class:`~tiercheck.integrations.dcp.TierWriter` (``tiercheck gc``
on a rank store) holds nothing: its retention may drop the held shard.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tiercheck.checkpointer import Checkpointer
from tiercheck.engine.coordinator import LocalCoordinator
from tiercheck.errors import TiercheckError
from tiercheck.formats.manifest import VersionInfo
from tiercheck.store.catalog import Catalog
from tiercheck.store.config import CONFIG_NAME

__all__ = ["HoldingCoordinator", "finished_shards", "previous_shard", "recorded_hold"]

log = logging.getLogger(__name__)


def _mark(info: VersionInfo) -> dict[str, Any]:
    mark = info.metadata.get("dcp")
    return mark if isinstance(mark, dict) else {}


def _marked(catalog: Catalog, *, coordinator: bool) -> list[VersionInfo]:
    """The restorable DCP versions of ``catalog`` that a coordinator saved (the finished
    checkpoints) or, not ``coordinator``, that a rank saved as its shard; oldest first."""
    marked = [(vid, info, _mark(info)) for vid, info in sorted(catalog.versions.items())]
    return [
        info
        for vid, info, mark in marked
        if mark and (mark.get("coordinator") is True) == coordinator and catalog.restorable(vid)
    ]


def _ints(value: object) -> list[int] | None:
    """``value`` if it is a list of ints (read from a tier: untrusted), else None."""
    if isinstance(value, list) and all(type(v) is int for v in value):
        return value
    return None


def finished_shards(catalog: Catalog) -> dict[int, int] | None:
    """Rank -> its version in the newest checkpoint the coordinator's store (``catalog``)
    finished; ``{}`` if there is none, None if its mark does not say (saved before marks
    named their shards, or malformed)."""
    done = _marked(catalog, coordinator=True)
    if not done:
        return {}
    rows = _mark(done[-1]).get("shards")
    if not isinstance(rows, list):
        return None
    out: dict[int, int] = {}
    for row in rows:
        pair = _ints(row)
        if pair is None or len(pair) != 2:
            return None
        out[pair[0]] = pair[1]
    return out


def previous_shard(catalog: Catalog) -> tuple[int, ...]:
    """What a rank store (``catalog``) holds while it saves its next shard when the
    coordinator did not say: its newest shard (none if it has none)."""
    mine = _marked(catalog, coordinator=False)
    return (mine[-1].id,) if mine else ()


def recorded_hold(root: Path) -> int | None:
    """The version the newest shard of the rank store at ``root`` recorded as held (None:
    no store, no shard, or none recorded). Reads the store's logs, opened read-only."""
    if not (root / CONFIG_NAME).is_file():
        return None
    try:
        with Checkpointer(root, read_only=True, coordinator=LocalCoordinator()) as ckpt:
            mine = _marked(ckpt.refresh(), coordinator=False)
    except TiercheckError as exc:  # the writable open that follows reports what is wrong
        log.warning("could not read which version %s holds: %s", root, exc)
        return None
    held = _ints(_mark(mine[-1]).get("hold")) if mine else None
    return held[0] if held else None


class HoldingCoordinator(LocalCoordinator):
    """A one-rank store's coordinator under DCP. The version a store keeps from its open on
    as the newest every rank committed (``agree_restorable``; the engine's multi-rank
    stores agree on it at the open) is, under DCP, its shard of the newest checkpoint the
    coordinator finished: ``held``, as the store's newest shard recorded it."""

    def __init__(self, held: int | None) -> None:
        self.held = held

    def agree_restorable(self, versions: Sequence[int]) -> int | None:
        if self.held is not None and self.held in versions:
            return self.held
        return super().agree_restorable(versions)
