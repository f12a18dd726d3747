"""The commit protocol's coordinator: prepare, vote, decide, record.

A version is committed by presumed-abort two-phase commit. Each rank prepares its shard in
its tiers (blobs, manifest, ``prepare`` record), then votes. The coordinator decides
commit iff every rank voted yes; the decision is returned to every rank, which records it
(``commit`` or ``abort``) in the tiers where it prepared. Without a decision record, a
prepared version counts as aborted.

:class:`LocalCoordinator` is the single-process case. The multi-rank coordinator on a
dedicated gloo group implements the same :class:`Coordinator` protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["Coordinator", "Decision", "LocalCoordinator", "Vote"]


@dataclass(frozen=True)
class Vote:
    """One rank's vote: ``ok`` if it prepared in at least one tier; ``manifest`` its shard."""

    rank: int
    ok: bool
    manifest: str
    tiers: tuple[str, ...]
    reason: str = ""


@dataclass(frozen=True)
class Decision:
    version: int
    commit: bool
    shards: tuple[str, ...]
    reason: str = ""


class Coordinator(Protocol):
    rank: int
    world_size: int

    def next_version_id(self, local_max: int) -> int:
        """Agree on the id of the next version across ranks."""
        ...

    def decide(self, version: int, vote: Vote) -> Decision:
        """Cast ``vote`` and return the global decision for ``version``."""
        ...


class LocalCoordinator:
    """One process, one rank: the decision is the vote."""

    rank = 0
    world_size = 1

    def next_version_id(self, local_max: int) -> int:
        return local_max + 1

    def decide(self, version: int, vote: Vote) -> Decision:
        if vote.ok:
            return Decision(version, True, (vote.manifest,))
        return Decision(version, False, (), vote.reason or "the only rank failed to prepare")
