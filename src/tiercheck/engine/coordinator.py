"""The commit protocol's coordinator: exchange, prepare, vote, decide, confirm.

A version is committed by presumed-abort two-phase commit. Every rank runs the same steps
per version, in the same order, whatever happened to it locally:

1. **exchange**: each rank reports whether it has a shard (or the failure that stopped it
   before it could: staging, hashing, a state it could not flatten), then sends each of its
   chunk ids (and sizes, never data) to the rank that owns the id's hash range; the owner
   names one writer per id among its holders and answers each holder
   (:mod:`tiercheck.engine.partition`). A rank learns only its own ids' writers. A failure
   on any rank aborts the version on every rank here.
2. **decide**: each rank prepares its shard in its tiers (blobs, manifest, ``prepare``
   record), then votes; the decision is commit iff every rank voted yes, and each rank
   records it (``commit`` or ``abort``) in the tiers where it prepared. Without a decision
   record a prepared version counts as aborted.
3. **confirm**: each rank reports the shared tiers it prepared in; the version is committed
   in a shared tier iff every rank prepared there.
4. **settle**: each rank judges the store's guarantees for its own tiers and reports what
   is short, so that every rank's ``wait()`` raises when any rank's falls short.

Each step opens with one all-reduce of a fixed header (version, step, a failure flag and
the lowest failing rank): a vote is that flag. Only when some rank failed does the lowest
failing rank broadcast its reason. A save costs a rank a constant number of collectives
and bytes that follow its own chunks (plus four bytes per rank of the all-to-all's counts
and 32 per rank of the manifest ids that every commit record names).

Fencing: every header names its version and step. A collective that fails (a rank died:
its peers see the closed connection at once; a hung rank: the group's timeout) or headers
that pair different versions or steps mark the coordinator **broken**: the version aborts
on this rank, and every later save aborts at once, naming the cause, instead of waiting on
a group that can no longer agree. Restart the job to go on.

:class:`LocalCoordinator` is the single-process case. :class:`DistCoordinator` runs on a
dedicated gloo group.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import numpy as np

from tiercheck.engine.collectives import Collectives
from tiercheck.engine.partition import assign_writers, owners, pack_chunks
from tiercheck.errors import CheckpointError

__all__ = [
    "Confirmation",
    "Coordinator",
    "Decision",
    "DistCoordinator",
    "Exchange",
    "LocalCoordinator",
    "Vote",
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
    """The outcome of the vote; ``shards``: every rank's manifest id, in rank order."""

    version: int
    commit: bool
    shards: tuple[str, ...]
    reason: str = ""


@dataclass(frozen=True)
class Exchange:
    """The outcome of the exchange. ``owned``: the chunk ids this rank writes to shared
    tiers (None: every one); ``ids``: this rank's chunk ids for this version."""

    version: int
    ok: bool
    owned: frozenset[str] | None = None
    ids: frozenset[str] = frozenset()
    reason: str = ""


@dataclass(frozen=True)
class Confirmation:
    """The outcome of the confirmation. ``shared_tiers``: the shared tiers where every rank
    prepared (the version is committed there)."""

    version: int
    ok: bool
    shared_tiers: frozenset[str] = frozenset()
    reason: str = ""


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

    def confirm(self, version: int, shared: Mapping[str, bool]) -> Confirmation:
        """Step 3: for each tier (the same names on every rank), whether this rank prepared
        the version there as a shared tier."""
        ...

    def settle(self, version: int, problem: str) -> str:
        """Step 4: what falls short of the store's guarantees on this rank ("" if nothing);
        returns the first rank's shortfall, "" if no rank has one."""
        ...

    def first_text(self, what: str, text: str) -> tuple[int, str] | None:
        """The lowest rank whose ``text`` is not empty, and that text (None if every
        rank's is), outside the save protocol: ``what`` names it in errors."""
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

    def confirm(self, version: int, shared: Mapping[str, bool]) -> Confirmation:
        return Confirmation(version, True, frozenset(n for n, ok in shared.items() if ok))

    def settle(self, version: int, problem: str) -> str:
        return problem

    def first_text(self, what: str, text: str) -> tuple[int, str] | None:
        return (0, text) if text else None


# --- several ranks ------------------------------------------------------------------

_STEPS = ("exchange", "vote", "confirm", "settle", "agree")


def _pack(obj: Any) -> bytes:
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    return out


def _digest(names: Sequence[str]) -> int:
    """A 62-bit digest of ``names`` (ranks compare their shared tiers by it)."""
    raw = hashlib.blake2b("\0".join(names).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "big") >> 2


class _Broken(Exception):
    """A collective of the commit protocol failed or paired different steps."""


class DistCoordinator:
    """The commit protocol across the ranks of a ``torch.distributed`` job.

    Runs on a dedicated gloo process group that tiercheck creates (never the trainer's
    group), so its collectives can run on tiercheck's background thread while the trainer
    uses its own group, and NCCL jobs need no CPU collectives of their own. Every
    message is integers or bytes in a CPU tensor: nothing is pickled.

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
        self.net = Collectives(self._group, self.rank, self.world_size)
        self.broken: str | None = None  # why the protocol cannot go on, once it cannot

    @property
    def received(self) -> int:
        """Bytes the protocol's collectives delivered to this rank so far."""
        return self.net.received

    @property
    def calls(self) -> int:
        """The protocol's collective calls on this rank so far."""
        return self.net.calls

    # -- fenced rounds ------------------------------------------------------------------

    def _round(self, step: str, version: int, failure: str, check: int = 0) -> str:
        """Open ``step`` of ``version``: one all-reduce of the header. Returns "" if no rank
        failed, else the lowest failing rank's ``failure`` ("rank R: ..."). ``check`` must be
        equal on every rank (else the ranks are out of step)."""
        if self.broken is not None:
            raise _Broken(self.broken)
        code = _STEPS.index(step)
        failed = 1 if failure else 0
        header = [version, -version, code, -code, check, -check, failed]
        header.append(-self.rank if failed else -self.world_size)
        with self._fenced(step, version):
            h = self.net.max(header)
        if h[:6] != [version, -version, code, -code, check, -check]:
            seen = sorted({_STEPS[c] for c in (h[2], -h[3]) if 0 <= c < len(_STEPS)})
            if h[:4] == [version, -version, code, -code]:
                why = "the ranks' shared tiers differ (same names on every rank)"
            else:
                why = f"versions {-h[1]} to {h[0]}, at the {' and '.join(seen)} steps"
            self.broken = f"ranks out of step at the {step} step of version {version}: {why}"
            raise _Broken(self.broken)
        if not h[6]:
            return ""
        first = -h[7]
        with self._fenced(step, version):
            text = self.net.broadcast_text(failure, first)
            count = self.net.sum([failed])[0]
        more = f" (and {count - 1} other rank(s))" if count > 1 else ""
        return f"rank {first}: {text}{more}"

    @contextlib.contextmanager
    def _fenced(self, step: str, version: int) -> Iterator[None]:
        """Collectives inside a protocol step: any failure marks the coordinator broken."""
        try:
            yield
        except _Broken:
            raise
        except Exception as exc:  # a dead or hung rank: the group is unusable from now on
            self.broken = f"the {step} step of version {version} failed: {exc}"
            raise _Broken(self.broken) from exc

    def _agree(self, what: str, values: Sequence[int]) -> list[int]:
        """An all-reduce (maximum) outside the save protocol (start-up, restore, the role of
        a version), as typed errors."""
        if self.broken is not None:
            raise CheckpointError(f"the ranks can no longer agree ({self.broken}); restart the job")
        try:
            return self.net.max(values)
        except Exception as exc:
            self.broken = f"agreeing on {what} failed: {exc}"
            raise CheckpointError(f"the ranks could not agree on {what}: {exc}") from exc

    # -- protocol -----------------------------------------------------------------------

    def agree_max(self, value: int) -> int:
        """The maximum of ``value`` over all ranks."""
        return self._agree("the newest version id", [value])[0]

    def next_version_id(self, local_max: int) -> int:
        # ids are agreed once at start-up (agree_max) and then advance in lock step
        return local_max + 1

    def exchange(
        self, version: int, chunks: Sequence[tuple[str, int]] | None, failure: str = ""
    ) -> Exchange:
        """Each chunk id goes to the rank that owns its hash range, which names one writer
        among the ranks that hold it and answers each; this rank learns which of its own
        chunks it writes to shared tiers. A rank's failure aborts the version everywhere."""
        records = None
        if chunks is not None:
            try:
                records = pack_chunks(chunks)
            except (ValueError, TypeError) as exc:
                failure = f"bad chunk ids: {exc}"
        if records is None:
            failure = failure or "the rank failed before the exchange"
        try:
            bad = self._round("exchange", version, "" if records is not None else failure)
            if bad:
                return Exchange(version, False, reason=bad)
            assert chunks is not None and records is not None
            dest = owners(records, self.world_size)
            order = np.argsort(dest, kind="stable")
            counts = np.bincount(dest, minlength=self.world_size).astype(np.int64)
            with self._fenced("exchange", version):
                got, got_counts = self.net.all_to_all(records[order], counts)
                holders = np.repeat(np.arange(self.world_size, dtype=np.int64), got_counts)
                answers = assign_writers(got, holders)
                mine = self.net.all_to_all_known(answers, got_counts, counts)
        except _Broken as exc:
            return Exchange(version, False, reason=str(exc))
        owned = frozenset(chunks[i][0] for i in order[mine.astype(bool)].tolist())
        return Exchange(version, True, owned, frozenset(c for c, _ in chunks))

    def decide(self, version: int, vote: Vote) -> Decision:
        """Commit iff every rank voted yes (one all-reduce); then every rank's manifest id
        (32 bytes each), which the version's record names. A failed collective aborts."""
        failure = "" if vote.ok else (vote.reason or "it prepared in no tier")
        raw = b""
        if vote.ok:
            try:
                raw = bytes.fromhex(vote.manifest)
            except ValueError:
                failure = f"bad manifest id {vote.manifest!r}"
            if len(raw) != 32:
                failure = failure or f"bad manifest id {vote.manifest!r}"
        try:
            bad = self._round("vote", version, failure)
            if bad:
                return Decision(version, False, (), bad)
            with self._fenced("vote", version):
                shards = self.net.all_gather_fixed(raw)
        except _Broken as exc:
            return Decision(version, False, (), str(exc))
        return Decision(version, True, tuple(m.hex() for m in shards))

    def confirm(self, version: int, shared: Mapping[str, bool]) -> Confirmation:
        """The shared tiers where every rank prepared (one all-reduce of a flag per tier)."""
        names = sorted(shared)
        try:
            self._round("confirm", version, "", check=_digest(names))
            if not names:
                return Confirmation(version, True)
            with self._fenced("confirm", version):
                missing = self.net.max([0 if shared[n] else 1 for n in names])
        except _Broken as exc:
            return Confirmation(version, False, reason=str(exc))
        return Confirmation(version, True, frozenset(n for n, m in zip(names, missing) if not m))

    def settle(self, version: int, problem: str) -> str:
        try:
            return self._round("settle", version, problem)
        except _Broken as exc:
            return f"the ranks could not settle version {version}: {exc}"

    def agree_restorable(self, versions: Sequence[int]) -> int | None:
        """The newest version every rank can restore (None if there is none)."""
        if self.broken is not None:
            raise CheckpointError(f"the ranks can no longer agree ({self.broken}); restart the job")
        try:
            everyone = self.net.all_gather_bytes(_pack(list(versions)))
        except Exception as exc:
            self.broken = f"agreeing on a version to restore failed: {exc}"
            raise CheckpointError(
                f"the ranks could not agree on a version to restore: {exc}"
            ) from exc
        sets = [set(msgpack.unpackb(b, raw=False)) for b in everyone]
        common = set.intersection(*sets) if sets else set()
        return max(common) if common else None

    def all_true(self, flag: bool) -> bool:
        return self._agree("an outcome", [0 if flag else 1])[0] == 0

    def first_text(self, what: str, text: str) -> tuple[int, str] | None:
        """The lowest rank with a ``text``: a maximum of minus the ranks that have one,
        then that rank's text broadcast."""
        (top,) = self._agree(what, [-self.rank if text else -self.world_size])
        if top == -self.world_size:
            return None
        try:
            return -top, self.net.broadcast_text(text, -top)
        except Exception as exc:
            self.broken = f"sharing {what} failed: {exc}"
            raise CheckpointError(f"the ranks could not share {what}: {exc}") from exc
