"""What a restore did: :class:`RestoreInfo`, returned by :meth:`tiercheck.Checkpointer.restore`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tiercheck.formats.manifest import Role
from tiercheck.restore.losses import Loss

__all__ = ["RestoreInfo"]


@dataclass(frozen=True)
class RestoreInfo:
    """What a restore did. ``state`` is the (same, updated) state object."""

    version: int
    step: int
    role: Role
    metadata: Mapping[str, Any]
    source: str
    chunks_from: Mapping[str, int]
    """Blobs read from each tier by name: the version's chunks and its shard manifests."""
    bytes_read: Mapping[str, int]
    repaired: tuple[tuple[str, str], ...]
    """``(tier, id)`` of each copy rewritten after a read found it damaged or missing."""
    corrupt: tuple[tuple[str, str], ...]
    """``(tier, id)`` of each damaged copy found. Both are this version's reads: what a
    newer version that could not be restored met is in :attr:`fallback`."""
    seconds: float
    state: Any = field(repr=False, default=None)
    replayed_steps: int = 0
    """Optimizer steps replayed (a log version: its base was loaded, then these)."""
    fallback: str | None = None
    """Why a newer version was not restored (a log version that could not be replayed or
    verified, or log versions skipped for want of a guarded optimizer); None if none was."""
    lost: Loss | None = None
    """Acknowledged versions newer than the one restored that no tier holds any more (lost
    with a memory tier, e.g. shm after a reboot): which steps and with which tier; None if
    the newest acknowledged version was reachable."""
