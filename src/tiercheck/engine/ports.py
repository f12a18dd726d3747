"""What the save service needs of the work after a commit, as protocols.

The save service queues migrations and asks for maintenance; it does not know how either
is done. :mod:`tiercheck.assembly` hands it the upkeep services
(:class:`tiercheck.upkeep.migration.MigrationService`,
:class:`tiercheck.upkeep.maintenance.Maintenance`), which satisfy these protocols, as
DCP's planner sees only a ``StorageWriter``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from tiercheck.errors import DurabilityError
from tiercheck.formats.manifest import ChunkRef, VersionInfo
from tiercheck.runtime.handles import SaveHandle
from tiercheck.store.budgets import Shortfall
from tiercheck.store.leases import Reservation
from tiercheck.store.tierset import TierSlot

__all__ = ["Migrations", "Upkeep"]


class Migrations(Protocol):
    """Where a committed version goes next, and the queue that takes it there."""

    def targets(self, info: VersionInfo) -> tuple[list[TierSlot], dict[str, str]]:
        """The asynchronous tiers ``info`` is sent to now, and why each other one is not."""
        ...

    def unopened_shortfall(
        self, info: VersionInfo, handle: SaveHandle, targets: Sequence[TierSlot]
    ) -> DurabilityError | None:
        """What ``wait_migrated()`` raises for ``info`` sent to none of ``targets`` while a
        required asynchronous tier could not be opened (None: nothing)."""
        ...

    def reserve(
        self, info: VersionInfo, targets: Sequence[TierSlot], ids: Sequence[str]
    ) -> Reservation:
        """Hold what the migrations of ``info`` will need until they settle."""
        ...

    def release(self, reservation: Reservation) -> None:
        """Give back what :meth:`reserve` held."""
        ...

    def submit(
        self,
        info: VersionInfo,
        handle: SaveHandle | None,
        targets: Sequence[TierSlot],
        *,
        owned: frozenset[str] | None = None,
        reservation: Reservation | None = None,
    ) -> None:
        """Queue the migration of ``info`` to each of ``targets``."""
        ...


class Upkeep(Protocol):
    """Retention, GC and compaction of the tiers, and room for a save in a budgeted one."""

    def request(self, tiers: Iterable[str]) -> None:
        """Ask for maintenance of ``tiers`` after a commit."""
        ...

    def flush(self, timeout: float | None = None, tiers: Iterable[str] | None = None) -> bool:
        """Wait for the maintenance requested so far (of ``tiers``; None: all)."""
        ...

    def make_room(self, slot: TierSlot, needed: int) -> Shortfall | None:
        """Free ``needed`` bytes in ``slot``'s budget, or say what is still short."""
        ...

    def discard(self, tiers: Iterable[str], ids: Iterable[str]) -> None:
        """Delete what a given-up write left in ``tiers``."""
        ...

    def note_chunks(self, manifest_id: str, chunks: Sequence[ChunkRef]) -> None:
        """The chunks of the shard manifest ``manifest_id`` a save just committed (its
        sweeps need not read and decode it)."""
        ...
