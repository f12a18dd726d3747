"""Handing the staging buffer back before every tier has written a save (issue 31).

The trainer waits for the staging copy of its next save, and that copy waits for the
buffer. The buffer may go as soon as the fastest tier of this rank holds the whole shard,
and goes when the next save (or a restore) asks for it: from then on the slower
synchronous tiers read what they have not yet written from that tier's copy, verified on
the way as a migration reads (:class:`ShardBytes.switch
<tiercheck.engine.staging.ShardBytes.switch>`), and the next save stages into the buffer.
Until it is asked for, they read the buffer: a slower tier that finishes between two saves
(LMDB between saves a few seconds apart) reads and hashes no byte a second time.

A slower tier that cannot keep up never holds back the next save: while it still writes
an earlier version, the saves that reach it skip it (:func:`skip_busy`), and it takes the
newest version that reaches it once it is free ("latest wins").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future

from tiercheck.engine.placing import PlaceResult
from tiercheck.engine.staging import Hold, ShardBytes
from tiercheck.formats.manifest import ChunkRef
from tiercheck.store.fetch import ChunkFetcher
from tiercheck.store.tierset import TierSlot

__all__ = ["hand_over", "skip_busy"]

log = logging.getLogger(__name__)


def hand_over(
    futures: Mapping[Future[PlaceResult], TierSlot],
    view: ShardBytes,
    chunks: Sequence[ChunkRef],
    hold: Hold,
) -> threading.Event | None:
    """Once the fastest tier of this rank among ``futures`` (the placements of one shard)
    holds it, offer ``hold`` (:meth:`Hold.offer`): when the next save (or a restore) wants
    the buffer, ``view`` is pointed at that tier's copy and the buffer released. Until
    then the slower tiers keep reading the buffer: when they finish before the next save,
    nothing is read twice. Returns an event set once that is decided (offered, or not: the
    tier failed); None where there is nothing to hand over to (only shared tiers).

    A lone tier hands the buffer back too: its commit (a record appended after the vote,
    which may wait for the tier's maintenance) no longer holds back the next save's
    staging."""
    mine = sorted(
        (
            (slot.speed_rank, f, slot)
            for f, slot in futures.items()
            if slot.tier is not None and not slot.tier.capabilities.shared
        ),
        key=lambda t: t[0],
    )
    if not mine:
        return None
    _, first, slot = mine[0]
    over = threading.Event()
    offsets = {ref.offset: ref.id for ref in chunks}
    fetcher = ChunkFetcher([slot], repair=False)

    def read(offset: int, length: int) -> memoryview:
        raw, _ = fetcher.fetch(offsets[offset])
        return raw if len(raw) == length else raw[:length]

    def done(f: Future[PlaceResult]) -> None:
        try:
            if f.cancelled() or f.exception() is not None or not f.result().ok:
                return
            hold.offer(lambda: view.switch(read))
        finally:
            over.set()

    first.add_done_callback(done)
    return over


def skip_busy(
    sync: list[TierSlot], busy: set[str], version: int, step: int
) -> tuple[list[TierSlot], dict[str, str]]:
    """The synchronous tiers of a save, less each slower one still writing an earlier
    version (named in ``busy``), and why each was skipped. A skipped tier is ``missing``
    for this version, with the reason, as a tier over its memory budget is (never
    ``failed``); the fastest tier is never skipped."""
    if not busy or len(sync) < 2:
        return sync, {}
    fastest = min(sync, key=lambda s: s.speed_rank)
    kept: list[TierSlot] = []
    skipped: dict[str, str] = {}
    for slot in sync:
        if slot is fastest or slot.name not in busy:
            kept.append(slot)
            continue
        skipped[slot.name] = (
            f"tier {slot.name} skipped version {version} (step {step}): it was still "
            "writing an earlier version; it takes the newest version once free (latest wins)"
        )
        log.info("%s", skipped[slot.name])
    return kept, skipped
