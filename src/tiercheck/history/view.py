"""What history needs from a store: :class:`StoreView`.

The modules of :mod:`tiercheck.history` (versions, diff, verify, manage) read and manage a
store through this protocol, never through the concrete :class:`~tiercheck.Checkpointer`
(which satisfies it): history sits below the facade, and a test can hand it any object
with these members.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, TypeVar

from tiercheck.runtime.executors import Executors
from tiercheck.store.catalog import Catalog
from tiercheck.store.policy import Policy
from tiercheck.store.tierset import TierSet
from tiercheck.upkeep.retention import GCReport

__all__ = ["StoreView"]

V_co = TypeVar("V_co", covariant=True)


class StoreView(Protocol[V_co]):
    """An open store as history sees it. ``V_co`` is the type :meth:`history` returns
    (:class:`tiercheck.history.versions.Version`; a parameter, so that this module
    imports nothing of history)."""

    @property
    def root(self) -> Path:
        """The store's root (where ``tiercheck.toml`` and the ack ledger are)."""
        ...

    @property
    def tierset(self) -> TierSet:
        """The store's tiers, open for this process (read-only or writable)."""
        ...

    @property
    def policy(self) -> Policy:
        """The placement policy (codecs and their level, per-tier roles)."""
        ...

    @property
    def read_only(self) -> bool:
        """Whether the store was opened without the writer lock (no repair, no writes)."""
        ...

    @property
    def allow_pickle(self) -> bool:
        """Whether pickled leaves may be loaded."""
        ...

    @property
    def rank(self) -> int:
        """This process's rank: the shard a version is read from by default."""
        ...

    @property
    def closed(self) -> bool:
        """Whether the store was closed (then nothing can be read through it)."""
        ...

    @property
    def executors(self) -> Executors:
        """The store's thread pools: reads run in parallel on ``io``, writes on ``writes``."""
        ...

    def refresh(self) -> Catalog:
        """Re-read every tier's log; the merged catalog."""
        ...

    def history(self) -> Sequence[V_co]:
        """Every committed version, oldest first."""
        ...

    def gc(self, *, dry_run: bool = False, grace: float | None = None) -> list[GCReport]:
        """Sweep unreferenced blobs past the grace period."""
        ...
