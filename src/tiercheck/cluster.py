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

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack

__all__ = [
    "Coordinator",
    "Decision",
    "DistCoordinator",
    "LocalCoordinator",
    "Vote",
    "owned_chunks",
]


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
    """The outcome. ``shared_tiers``: shared tiers where every rank prepared, so the
    version may be committed there."""

    version: int
    commit: bool
    shards: tuple[str, ...]
    reason: str = ""
    shared_tiers: tuple[str, ...] = ()


class Coordinator(Protocol):
    rank: int
    world_size: int
    local_rank: int
    node: int

    def agree_max(self, value: int) -> int:
        """The maximum of ``value`` over every rank."""
        ...

    def assign_chunks(self, chunks: Sequence[tuple[str, int]]) -> set[str]:
        """The chunk ids this rank writes to shared tiers."""
        ...

    def agree_restorable(self, versions: Sequence[int]) -> int | None:
        """The newest version in every rank's ``versions``."""
        ...

    def all_true(self, flag: bool) -> bool:
        """True iff ``flag`` is true on every rank."""
        ...

    def agree_tiers(self, tiers: Sequence[str]) -> set[str]:
        """The tiers in every rank's ``tiers``."""
        ...

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
    local_rank = 0
    node = 0

    def agree_max(self, value: int) -> int:
        return value

    def assign_chunks(self, chunks: Sequence[tuple[str, int]]) -> set[str]:
        return {c for c, _ in chunks}

    def agree_restorable(self, versions: Sequence[int]) -> int | None:
        return max(versions) if versions else None

    def all_true(self, flag: bool) -> bool:
        return flag

    def agree_tiers(self, tiers: Sequence[str]) -> set[str]:
        return set(tiers)

    def next_version_id(self, local_max: int) -> int:
        return local_max + 1

    def decide(self, version: int, vote: Vote) -> Decision:
        if vote.ok:
            return Decision(version, True, (vote.manifest,), shared_tiers=vote.tiers)
        return Decision(version, False, (), vote.reason or "the only rank failed to prepare")


# --- several ranks ------------------------------------------------------------------


def _pack(obj: Any) -> bytes:
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    return out


class DistCoordinator:
    """The commit protocol across the ranks of a ``torch.distributed`` job.

    Runs on a dedicated gloo process group that tiercheck creates (never the trainer's
    group), so its collectives can run on tiercheck's background thread while the trainer
    uses its own group, and NCCL jobs need no CPU collectives of their own. Every
    message is msgpack in a uint8 tensor: nothing is pickled.

    All ranks must construct their ``Checkpointer`` together and call ``save`` the same
    number of times (the collectives of save ``k`` pair up across ranks by order). A rank
    that dies mid-save makes the other ranks' collective fail (or time out after
    ``timeout``): they decide abort (presumed abort), record it, and go on.
    """

    def __init__(self, *, timeout: float = 120.0, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        self.node = int(os.environ.get("GROUP_RANK", self.rank // max(1, self.local_world_size)))
        self.timeout = timeout
        self._group = group or dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=timeout)
        )
        self._broken: str | None = None

    # -- byte collectives ---------------------------------------------------------------

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, in rank order (gloo; sizes first, then padded data)."""
        import torch
        import torch.distributed as dist

        size = torch.tensor([len(payload)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self._group)
        longest = max(int(s.item()) for s in sizes)
        buf = torch.zeros(max(longest, 1), dtype=torch.uint8)
        if payload:
            buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        bufs = [torch.zeros(max(longest, 1), dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(bufs, buf, group=self._group)
        return [bytes(b[: int(s.item())].numpy()) for b, s in zip(bufs, sizes)]

    def all_gather_obj(self, obj: Any) -> list[Any]:
        return [
            msgpack.unpackb(b, raw=False, strict_map_key=False)
            for b in self.all_gather_bytes(_pack(obj))
        ]

    # -- protocol -----------------------------------------------------------------------

    def agree_max(self, value: int) -> int:
        """The maximum of ``value`` over all ranks."""
        return max(int(v) for v in self.all_gather_obj(value))

    def next_version_id(self, local_max: int) -> int:
        # ids are agreed once at start-up (agree_max) and then advance in lock step
        return local_max + 1

    def decide(self, version: int, vote: Vote) -> Decision:
        """Gather every rank's vote; commit iff all said yes. A failed collective aborts."""
        mine = {
            "rank": vote.rank,
            "ok": vote.ok,
            "manifest": vote.manifest,
            "tiers": list(vote.tiers),
            "reason": vote.reason,
            "version": version,
        }
        try:
            votes = self.all_gather_obj(mine)
        except Exception as exc:  # a dead or hung rank: presumed abort
            return Decision(version, False, (), f"vote collective failed: {exc}")
        by_rank = sorted(votes, key=lambda v: v["rank"])
        bad = [v for v in by_rank if not v["ok"] or v["version"] != version]
        if bad:
            reasons = "; ".join(
                f"rank {v['rank']}: {v['reason'] or 'version mismatch'}" for v in bad
            )
            return Decision(version, False, (), reasons)
        shared = set.intersection(*(set(v["tiers"]) for v in by_rank))
        return Decision(
            version,
            True,
            tuple(v["manifest"] for v in by_rank),
            shared_tiers=tuple(sorted(shared)),
        )

    def assign_chunks(self, chunks: Sequence[tuple[str, int]]) -> set[str]:
        """Cross-rank dedup: exchange chunk ids (ids and sizes only, never data) and return
        the ids this rank writes to shared tiers. Each unique chunk gets exactly one
        writer among the ranks that hold it, the one with the fewest bytes assigned so far."""
        everyone = self.all_gather_obj([[c, n] for c, n in chunks])
        return owned_chunks(everyone, self.rank)

    def agree_restorable(self, versions: Sequence[int]) -> int | None:
        """The newest version every rank can restore (None if there is none)."""
        sets = [set(v) for v in self.all_gather_obj(list(versions))]
        common = set.intersection(*sets) if sets else set()
        return max(common) if common else None

    def all_true(self, flag: bool) -> bool:
        return all(self.all_gather_obj(bool(flag)))

    def agree_tiers(self, tiers: Sequence[str]) -> set[str]:
        sets = [set(t) for t in self.all_gather_obj(list(tiers))]
        return set.intersection(*sets) if sets else set()


def owned_chunks(per_rank: Sequence[Sequence[Sequence[Any]]], rank: int) -> set[str]:
    """Deterministic writer assignment: every rank computes the same answer."""
    holders: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for r, chunks in enumerate(per_rank):
        for cid, n in chunks:
            holders.setdefault(cid, []).append(r)
            sizes[cid] = int(n)
    load = [0] * len(per_rank)
    mine: set[str] = set()
    for cid in sorted(holders, key=lambda c: (-sizes[c], c)):
        owner = min(holders[cid], key=lambda r: (load[r], r))
        load[owner] += sizes[cid]
        if owner == rank:
            mine.add(cid)
    return mine
