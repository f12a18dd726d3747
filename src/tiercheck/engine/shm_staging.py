"""Which saves stage straight into their fastest tier's own storage, and the area they use.

A save's staging copy goes into the fastest synchronous tier's own pages when that tier
offers a staging area for the layout (:meth:`Tier.staging_area
<tiercheck.backends.base.Tier.staging_area>`: shm, whose files then become the version's
blobs, :mod:`tiercheck.backends._shm_segments`), the tier stores raw blobs of every
version for this process alone, the store has one rank, the state is on the host (CUDA
tensors are staged into page-locked memory), and ``Policy.stage_in_shm`` allows it
(``"auto"``: a state of :data:`AUTO_MIN_BYTES` or more, in a store with another
synchronous tier, such as the default store's LMDB). Otherwise the private staging
buffer takes the copy. The host then holds two copies of a dense state (the ranges, of
which the newest version's blobs are one), not three (staging, the version being written,
the one before).

The area follows the layout: a save of another layout gets a new area (the old one closed
under the staging buffer's lock, once no save reads it). Saves that come faster than shm
lets the version before the last one go (a save every step) would find the range they
stage into still held: ``"auto"`` then stages them privately (:meth:`ShmStaging.before_arm`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from tiercheck.backends.base import StagingArea
from tiercheck.core.chunking import Layout
from tiercheck.core.sizes import format_size
from tiercheck.errors import TiercheckError
from tiercheck.store.policy import Policy
from tiercheck.store.tierset import TierSet, TierSlot

__all__ = ["AUTO_MIN_BYTES", "ShmStaging"]

log = logging.getLogger(__name__)

#: ``stage_in_shm="auto"`` stages states at least this large in the tier's storage
AUTO_MIN_BYTES = 64 << 20


class ShmStaging:
    """The staging area of a store's saves (module docstring), or None where they stage
    into the private buffer."""

    def __init__(
        self,
        tierset: TierSet,
        policy: Policy,
        world_size: int,
        make_room: Callable[[TierSlot, int], object] | None = None,
    ) -> None:
        self._tierset = tierset
        self._policy = policy
        self._world_size = world_size
        self._make_room = make_room  # Maintenance.make_room
        self._area: StagingArea | None = None
        self._refused: tuple[str, tuple[tuple[int, int], ...]] | None = None
        self._private: tuple[str, tuple[tuple[int, int], ...]] | None = None  # see before_arm
        self._lock = threading.Lock()

    def _slot(self) -> TierSlot | None:
        """The tier saves would stage into, if the store's shape allows it."""
        if self._policy.stage_in_shm == "off" or self._world_size != 1:
            return None
        sync = [
            s
            for s in self._tierset.by_speed()
            if s.tier is not None and s.policy is not None and s.policy.mode == "sync"
        ]
        if not sync:
            return None
        slot = sync[0]
        if self._policy.stage_in_shm == "auto" and len(sync) < 2:
            # shm alone: each version needs the one before it there until it commits, and
            # such stores are saved often (measured: a save every step staged in shm ran
            # 1.18x and held 4x at its peak, staged privately 1.04x and 3x)
            return None
        tier, tp = slot.tier, slot.policy
        assert tier is not None and tp is not None
        if tier.read_only or tier.capabilities.shared or tp.codec != "raw":
            return None
        return slot if tp.versions == "all" else None

    def area_for(self, layout: Layout) -> StagingArea | None:
        """The area a save of ``layout`` stages into (made now if needed), or None. Call it
        holding the staging buffer: a new layout closes the old area."""
        with self._lock:
            slot = self._slot()
            big = self._policy.stage_in_shm == "on" or layout.stream_bytes >= AUTO_MIN_BYTES
            if slot is None or not big:
                return None
            if self._private == (slot.name, layout.windows):
                self._close_area(pool=True)  # no save reads it: the buffer is this one's
                return None
            area = self._area
            if area is not None and area.tier is slot.tier and area.windows == layout.windows:
                return area
            if self._refused == (slot.name, layout.windows):
                return None
            self._close_area()
            assert slot.tier is not None
            area = slot.tier.staging_area(layout.windows, layout.stream_bytes)
            if area is not None and area.tier is not slot.tier:  # a wrapper's inner tier:
                area.close()  # its puts would not be the adopting tier's
                area = None
            if area is None:
                self._refused = (slot.name, layout.windows)
                return None
            self._area = area
            log.info(
                "saves stage straight into tier %s: %s in two ranges",
                slot.name,
                format_size(area.nbytes),
            )
            return area

    def before_arm(self, area: StagingArea, r: int) -> None:
        """Before range ``r`` is staged into again: while versions that shm may let go of
        (a dropped one not yet swept, a base LMDB holds) keep its windows as blobs, make
        room for a version in shm now (retention tightened, the tier swept at once), so
        that arming reuses the range's own pages. Nothing is waited for: a version still
        needed keeps its windows, and arming gives those slots pooled or fresh pages. When
        that happens (saves that come faster than shm lets a version go: a save every
        step), ``"auto"`` stages the next saves privately instead, the ranges' free pages
        going to shm's pool for their puts (module docstring)."""
        if self._make_room is None or not area.busy(r):
            return
        slot = self._slot()
        if slot is None or slot.tier is not area.tier:
            return
        try:
            self._make_room(slot, area.nbytes // 2)
        except TiercheckError as exc:  # arming replaces what is still held
            log.debug("making room before staging in %s: %s", slot.name, exc)
        if not area.busy(r):
            return
        if self._policy.stage_in_shm == "auto":
            self._private = (slot.name, area.windows)
            log.info(
                "saves stage privately from now on: they come faster than tier %s lets the "
                'version before the last one go (stage_in_shm = "on" keeps them in shm)',
                slot.name,
            )

    def _close_area(self, pool: bool = False) -> None:
        area, self._area = self._area, None
        if area is not None:
            area.close(pool=pool)

    def close(self) -> None:
        with self._lock:
            self._close_area()
