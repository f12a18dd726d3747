"""The commit protocol's coordinator: exchange, prepare, vote, decide, confirm.

A version is committed by presumed-abort two-phase commit. Every rank runs the same three
steps per version, in the same order, whatever happened to it locally:

1. **exchange**: each rank sends its chunk ids and sizes (never data), or the failure that
   stopped it before it could (staging, hashing, a state it could not flatten). Every rank
   learns every id in flight (GC protects them) and which chunks it writes to shared tiers
   (cross-rank dedup). A failure on any rank aborts the version on every rank here.
2. **decide**: each rank prepares its shard in its tiers (blobs, manifest, ``prepare``
   record), then votes; the decision is commit iff every rank voted yes, and each rank
   records it (``commit`` or ``abort``) in the tiers where it prepared. Without a decision
   record a prepared version counts as aborted.
3. **confirm**: each rank reports the tiers it committed in and the shared tiers it
   prepared in; the version is committed in a shared tier iff every rank prepared there,
   and the store's guarantees are judged for every rank alike.

Fencing: every message names its version and step. A collective that fails (a rank died:
its peers see the closed connection at once; a hung rank: the group's timeout) or that
pairs different versions or steps marks the coordinator **broken**: the version aborts on
this rank, and every later save aborts at once, naming the cause, instead of waiting on a
group that can no longer agree. Restart the job to go on.

:class:`LocalCoordinator` is the single-process case. :class:`DistCoordinator` runs on a
dedicated gloo group.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack

from tiercheck.errors import CheckpointError

__all__ = [
    "Confirmation",
    "Coordinator",
    "Decision",
    "DistCoordinator",
    "Exchange",
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
    """The outcome of the vote."""

    version: int
    commit: bool
    shards: tuple[str, ...]
    reason: str = ""


@dataclass(frozen=True)
class Exchange:
    """The outcome of the exchange. ``owned``: the chunk ids this rank writes to shared
    tiers (None: every one); ``ids``: every chunk id of every rank for this version."""

    version: int
    ok: bool
    owned: frozenset[str] | None = None
    ids: frozenset[str] = frozenset()
    reason: str = ""


@dataclass(frozen=True)
class Confirmation:
    """The outcome of the confirmation. ``shared_tiers``: the shared tiers where every rank
    prepared (the version is committed there); ``committed``: per rank, the tiers it
    committed the version in (its own tiers plus ``shared_tiers``); ``skipped``: per rank,
    the tiers it skipped for their memory budget (not failures; :mod:`tiercheck.engine.budgets`)."""

    version: int
    ok: bool
    shared_tiers: frozenset[str] = frozenset()
    committed: tuple[tuple[str, ...], ...] = field(default_factory=tuple)
    reason: str = ""
    skipped: tuple[tuple[str, ...], ...] = field(default_factory=tuple)


class Coordinator(Protocol):
    rank: int
    world_size: int
    local_rank: int
    node: int

    def agree_max(self, value: int) -> int:
        """The maximum of ``value`` over every rank."""
        ...

    def agree_restorable(self, versions: Sequence[int]) -> int | None:
        """The newest version in every rank's ``versions``."""
        ...

    def all_true(self, flag: bool) -> bool:
        """True iff ``flag`` is true on every rank."""
        ...

    def next_version_id(self, local_max: int) -> int:
        """Agree on the id of the next version across ranks."""
        ...

    def exchange(
        self, version: int, chunks: Sequence[tuple[str, int]] | None, failure: str = ""
    ) -> Exchange:
        """Step 1: send this rank's chunk ids and sizes, or ``failure`` (chunks None)."""
        ...

    def decide(self, version: int, vote: Vote) -> Decision:
        """Step 2: cast ``vote`` and return the global decision for ``version``."""
        ...

    def confirm(
        self,
        version: int,
        committed: Sequence[str],
        shared_ready: Sequence[str],
        skipped: Sequence[str] = (),
    ) -> Confirmation:
        """Step 3: report the tiers this rank committed in, the shared tiers it prepared
        in, and the tiers it skipped for their memory budget."""
        ...


class LocalCoordinator:
    """One process, one rank: every outcome is this rank's own."""

    rank = 0
    world_size = 1
    local_rank = 0
    node = 0

    def agree_max(self, value: int) -> int:
        return value

    def agree_restorable(self, versions: Sequence[int]) -> int | None:
        return max(versions) if versions else None

    def all_true(self, flag: bool) -> bool:
        return flag

    def next_version_id(self, local_max: int) -> int:
        return local_max + 1

    def exchange(
        self, version: int, chunks: Sequence[tuple[str, int]] | None, failure: str = ""
    ) -> Exchange:
        if chunks is None:
            return Exchange(version, False, reason=failure or "the only rank failed")
        return Exchange(version, True, None, frozenset(c for c, _ in chunks))

    def decide(self, version: int, vote: Vote) -> Decision:
        if vote.ok:
            return Decision(version, True, (vote.manifest,))
        return Decision(version, False, (), vote.reason or "the only rank failed to prepare")

    def confirm(
        self,
        version: int,
        committed: Sequence[str],
        shared_ready: Sequence[str],
        skipped: Sequence[str] = (),
    ) -> Confirmation:
        shared = frozenset(shared_ready)
        per_rank = (tuple(committed) + tuple(sorted(shared)),)
        return Confirmation(version, True, shared, per_rank, skipped=(tuple(skipped),))


# --- several ranks ------------------------------------------------------------------


def _pack(obj: Any) -> bytes:
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    return out


class _Broken(Exception):
    """A collective of the commit protocol failed or paired different steps."""


class DistCoordinator:
    """The commit protocol across the ranks of a ``torch.distributed`` job.

    Runs on a dedicated gloo process group that tiercheck creates (never the trainer's
    group), so its collectives can run on tiercheck's background thread while the trainer
    uses its own group, and NCCL jobs need no CPU collectives of their own. Every
    message is msgpack in a uint8 tensor: nothing is pickled.

    All ranks must construct their ``Checkpointer`` together and call ``save`` the same
    number of times (the collectives of save ``k`` pair up across ranks by order; a save
    that fails on one rank still takes part, carrying its failure). A rank that dies or
    fails mid-save aborts the version on every rank at the next step (see the module
    docstring); ``timeout`` bounds a wait on a rank that hangs.
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
        self.broken: str | None = None  # why the protocol cannot go on, once it cannot

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

    def _step(self, step: str, version: int, payload: dict[str, Any]) -> list[dict[str, Any]]:
        """One fenced collective: every rank's payload for ``step`` of ``version``."""
        if self.broken is not None:
            raise _Broken(self.broken)
        try:
            everyone: list[dict[str, Any]] = self.all_gather_obj(
                {"step": step, "version": version, **payload}
            )
        except Exception as exc:  # a dead or hung rank: the group is unusable from now on
            self.broken = f"the {step} step of version {version} failed: {exc}"
            raise _Broken(self.broken) from exc
        odd = [
            (r, p.get("step"), p.get("version"))
            for r, p in enumerate(everyone)
            if (p.get("step"), p.get("version")) != (step, version)
        ]
        if odd:
            self.broken = (
                f"ranks out of step at the {step} step of version {version}: "
                + ", ".join(f"rank {r} at the {s} step of version {v}" for r, s, v in odd)
            )
            raise _Broken(self.broken)
        return everyone

    def _gather(self, what: str, obj: Any) -> list[Any]:
        """An all-gather outside the save protocol (start-up, restore), as typed errors."""
        if self.broken is not None:
            raise CheckpointError(f"the ranks can no longer agree ({self.broken}); restart the job")
        try:
            return self.all_gather_obj(obj)
        except Exception as exc:
            self.broken = f"agreeing on {what} failed: {exc}"
            raise CheckpointError(f"the ranks could not agree on {what}: {exc}") from exc

    # -- protocol -----------------------------------------------------------------------

    def agree_max(self, value: int) -> int:
        """The maximum of ``value`` over all ranks."""
        return max(int(v) for v in self._gather("the newest version id", value))

    def next_version_id(self, local_max: int) -> int:
        # ids are agreed once at start-up (agree_max) and then advance in lock step
        return local_max + 1

    def exchange(
        self, version: int, chunks: Sequence[tuple[str, int]] | None, failure: str = ""
    ) -> Exchange:
        """Every rank's chunk ids (ids and sizes only, never data); each unique chunk gets
        exactly one writer for shared tiers among the ranks that hold it, the one with the
        fewest bytes assigned so far. A rank's failure aborts the version everywhere."""
        mine = {
            "ok": chunks is not None,
            "reason": failure,
            "chunks": [[c, n] for c, n in chunks or ()],
        }
        try:
            everyone = self._step("exchange", version, mine)
        except _Broken as exc:
            return Exchange(version, False, reason=str(exc))
        bad = [f"rank {r}: {p['reason']}" for r, p in enumerate(everyone) if not p["ok"]]
        if bad:
            return Exchange(version, False, reason="; ".join(bad))
        per_rank = [p["chunks"] for p in everyone]
        ids = frozenset(c for chunks_r in per_rank for c, _ in chunks_r)
        return Exchange(version, True, frozenset(owned_chunks(per_rank, self.rank)), ids)

    def decide(self, version: int, vote: Vote) -> Decision:
        """Gather every rank's vote; commit iff all said yes. A failed collective aborts."""
        mine = {"ok": vote.ok, "manifest": vote.manifest, "reason": vote.reason}
        try:
            everyone = self._step("vote", version, mine)
        except _Broken as exc:
            return Decision(version, False, (), str(exc))
        bad = [f"rank {r}: {p['reason']}" for r, p in enumerate(everyone) if not p["ok"]]
        if bad:
            return Decision(version, False, (), "; ".join(bad))
        return Decision(version, True, tuple(p["manifest"] for p in everyone))

    def confirm(
        self,
        version: int,
        committed: Sequence[str],
        shared_ready: Sequence[str],
        skipped: Sequence[str] = (),
    ) -> Confirmation:
        mine = {
            "committed": list(committed),
            "shared": list(shared_ready),
            "skipped": list(skipped),
        }
        try:
            everyone = self._step("confirm", version, mine)
        except _Broken as exc:
            return Confirmation(version, False, reason=str(exc))
        shared = frozenset(set.intersection(*(set(p["shared"]) for p in everyone)))
        per_rank = tuple(tuple(p["committed"]) + tuple(sorted(shared)) for p in everyone)
        skips = tuple(tuple(p.get("skipped", ())) for p in everyone)
        return Confirmation(version, True, shared, per_rank, skipped=skips)

    def agree_restorable(self, versions: Sequence[int]) -> int | None:
        """The newest version every rank can restore (None if there is none)."""
        sets = [set(v) for v in self._gather("a version to restore", list(versions))]
        common = set.intersection(*sets) if sets else set()
        return max(common) if common else None

    def all_true(self, flag: bool) -> bool:
        return all(self._gather("an outcome", bool(flag)))


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
