"""Memory budgets: how much node memory a memory tier may hold, and whether a version fits.

A *memory tier* holds node memory that nothing else bounds: its capabilities say it is not
persistent and survives at most the loss of a node (``shm://``, ``peer://``,
``collective://``, ``memory://``). Left alone, such a tier grows with the versions its
retention keeps (the newest base and all its diffs: with dense training, up to
``base_every`` full copies of the state), and the memory it takes is the memory the trainer
needs.

**The default budget.** Once the engine knows the size of a version (the first save, or
``Checkpointer.prepare``), every memory tier the user gave no ``budget`` option gets

    budget = min(2 x V + 1 MiB, free / 2)

where ``V`` is the bytes one full copy of a version takes in a tier (the state's bytes
plus each chunk's blob header and the manifest: :func:`version_bytes`) and ``free`` the
memory free behind the tier when the default is set (/dev/shm's free space for shm, the
daemon's unused ``--memory-limit`` for a peer, the node's available memory for
``memory://``; unknown for a remote collective partner, which then gets ``2 x V + 1 MiB``).
Two copies are what a save needs at its peak: the version being written next to the newest
one kept; the mebibyte (:data:`SLACK`) is room for what is not a version's (log records,
where a tier counts them, and a manifest grown by a few bytes). The default follows the
state: it is set again when a version grows, or shrinks by more than an eighth. A tier
whose budget would fall below what it holds plus one version of the new size keeps that
much, and comes down to the default as the larger versions go (it must keep its newest
restorable version, of the old size, until one of the new size is committed beside it).

**Making room.** Before a version is placed on a tier with a budget, the engine estimates
what the tier must take (:func:`bytes_needed`: the chunks it lacks, each with its blob
header, and the manifest) and, if ``usage() + needed`` exceeds the budget, the maintenance
service drops versions by a tightened retention and sweeps the tier at once
(:meth:`tiercheck.upkeep.maintenance.Maintenance.make_room`), never the tier's newest restorable
version or what it needs (:func:`tiercheck.upkeep.retention.protection`: nothing acknowledged is
lost); a base that LMDB also holds may go, so that dense diffs fit two copies of the state.
A version that still does not fit is *skipped* on that tier (see ``docs/concepts.md``,
"Guarantees"): the tier takes no memory for it, the save goes on with the other tiers.

**A diff that would leave no room.** The rule of two copies holds for bases. A diff needs
its base, so a tier that keeps a diff keeps its base with it, unless a tier at least as
durable holds that base (LMDB, in the default store; or is still writing it behind the
hand-over, and will hold it by the next version as a rule): with dense training (every chunk
changes) base and diff are two copies, and the next version, a third, could never fit
without dropping the newest restorable version, which nothing may do. A store whose
only synchronous tier is shm (or whose LMDB is lost) would then stop saving. So a diff
whose own chunks (those its base lacks) would leave such a tier less than a full version
of room once committed is saved as a *base* instead (:func:`diff_leaves_no_room`): in a
raw memory tier it takes the same memory (chunks are written once, whatever the role),
and once committed it lets the versions before it go.

**A log version that would leave no room.** A log version follows a full version and
keeps it (and that one's base), and every log version of the same full version adds its
steps' gradients to what the tier must keep: a save every step under ``guard`` grows that
chain by a step's gradients a save. A log version after which the chain the tier keeps
alone (its chunks, each once: :func:`chain_bytes`), the log's own bytes and a full next
version would exceed the budget is saved as a full version instead
(:func:`log_leaves_no_room`), whose chain is at most a base and a diff; the rule above
then makes that a base if a diff would not leave room either.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tiercheck.backends.base import Capabilities, FailureDomain, Tier
from tiercheck.core.sizes import format_size
from tiercheck.errors import NotSupported, OverBudget, TierError
from tiercheck.formats.codecs import BLOB_HEADER_SIZE
from tiercheck.formats.manifest import ChunkRef, VersionInfo
from tiercheck.store.catalog import Catalog
from tiercheck.store.tierset import TierSet, TierSlot

__all__ = [
    "SLACK",
    "Budgets",
    "Chains",
    "Shortfall",
    "at_least_as_durable",
    "budget_of",
    "bytes_needed",
    "chain_bytes",
    "default_budget",
    "diff_leaves_no_room",
    "free_memory",
    "is_memory_tier",
    "log_leaves_no_room",
    "version_bytes",
]

#: What the default budget allows beyond two versions (log records, manifest growth).
SLACK = 1 << 20

log = logging.getLogger(__name__)


def is_memory_tier(tier: Tier) -> bool:
    """Whether ``tier`` holds node memory that a budget should bound (module docstring)."""
    caps = tier.capabilities
    return not caps.persistent and caps.survives.order <= FailureDomain.NODE.order


def free_memory(tier: Tier) -> int | None:
    """Bytes free in the memory behind ``tier`` now (``Tier.free_memory``; through any
    wrapper), or None where it is not known here or cannot be read."""
    try:
        return tier.free_memory()
    except (OSError, TierError) as exc:
        log.debug("free memory behind %s unknown: %s", tier.url, exc)
    return None


def version_bytes(
    stream_bytes: int, chunks: int, manifest_bytes: int, header: int = BLOB_HEADER_SIZE
) -> int:
    """Bytes one full raw copy of a version takes in a tier: the state, a blob header per
    chunk (``header`` bytes: a page where saves stage in shm's own files), and the
    manifest blob (at most its encoded size plus a header)."""
    return stream_bytes + chunks * header + manifest_bytes + BLOB_HEADER_SIZE


def default_budget(version: int, free: int | None) -> int:
    """``min(2 x version + SLACK, free / 2)`` (no second term when ``free`` is unknown)."""
    two = 2 * version + SLACK
    return two if free is None else min(two, free // 2)


def bytes_needed(
    tier: Tier,
    chunks: Iterable[ChunkRef],
    manifest_id: str,
    manifest_bytes: int,
    header: int = BLOB_HEADER_SIZE,
) -> int:
    """What placing a version with ``chunks`` on ``tier`` adds at most: each chunk the tier
    lacks with a blob header (``header`` bytes), and the manifest blob unless present.
    (Encoded with zstd or as a delta a blob is usually smaller; a put past the budget is
    refused by the tier anyway, and the engine then skips the tier for the version.)"""
    sizes: dict[str, int] = {}
    for ref in chunks:
        sizes.setdefault(ref.id, ref.length)
    present = tier.has([*sizes, manifest_id])
    need = sum(n + header for cid, n in sizes.items() if cid not in present)
    if manifest_id not in present:
        need += manifest_bytes + BLOB_HEADER_SIZE
    return need


@dataclass(frozen=True)
class Shortfall:
    """A version that does not fit a tier's budget, even after making room, or a write the
    tier refused (:meth:`refused`; ``budget`` None: the node's free memory was the limit)."""

    tier: str
    needed: int
    held: int
    budget: int | None

    @classmethod
    def refused(cls, tier: str, exc: OverBudget) -> Shortfall:
        """The shortfall an ``OverBudget`` from a write to ``tier`` reports."""
        return cls(tier, exc.needed, exc.held, exc.budget)

    def message(self, version: int, step: int, went: Sequence[str] | None = None) -> str:
        """The one phrasing of a budget skip (its warning, the tier's error in the save's
        result, a ``CommitAborted``): the tier, the sizes, where the version went (``went``:
        the tiers it is committed on; None: not known yet) and the fix."""
        t = self.tier
        if self.budget is None:
            sizes = "and the node does not have that much memory free"
            fix = (
                "free memory on the node (tiercheck gc --orphans, old stores), or give tier "
                f"{t} a smaller budget (tier option budget = ...) so that it keeps fewer versions"
            )
        else:
            sizes = (
                f"{format_size(self.held)} of its budget of {format_size(self.budget)} is held "
                "by versions it must keep"
            )
            fix = (
                f"give tier {t} a larger budget (tier option budget = ...), keep fewer versions "
                "there (keep_bases/keep_diffs), or free memory on the node"
            )
        where = ""
        if went is not None:
            where = (
                f"; the version is committed on {', '.join(went)} instead"
                if went
                else "; no other tier took it"
            )
        return (
            f"tier {t} skipped version {version} (step {step}): it needs "
            f"{format_size(self.needed)} more, {sizes}{where}; to fix: {fix}"
        )

    def warn(self, version: int, step: int, went: Sequence[str]) -> str:
        """Log the skip as one warning and return its message. Every budget skip is logged
        here, under this module's logger, so that
        ``logging.getLogger("tiercheck.store.budgets")`` quiets them all."""
        text = self.message(version, step, went)
        log.warning("%s", text)
        return text


class Budgets:
    """The default budgets of one store's memory tiers (module docstring).

    A tier opened with a ``budget`` option keeps it: the user decided. The others get the
    default each time the size of a version changes (:meth:`size_known`).
    """

    def __init__(self, tierset: TierSet) -> None:
        self.tierset = tierset
        self._defaulted = {
            slot.name
            for slot in tierset.open()
            if slot.tier is not None
            and not slot.tier.read_only
            and is_memory_tier(slot.tier)
            and getattr(slot.tier, "budget", None) is None
        }
        self._sized_for: int | None = None
        self._held_up: set[str] = set()  # tiers whose budget is above the default

    @property
    def version_size(self) -> int | None:
        """The bytes of a full version the defaults were last set for (None: not yet)."""
        return self._sized_for

    def unsized(self) -> frozenset[str]:
        """The tiers that will get a default budget but have none yet (no version size
        known): until then they must not be written ahead of making room in them."""
        return frozenset(self._defaulted) if self._sized_for is None else frozenset()

    def size_known(self, version: int) -> None:
        """A version takes ``version`` bytes (:func:`version_bytes`): set the defaults."""
        sized = self._sized_for
        if sized is not None and sized - sized // 8 <= version <= sized:
            # a few bytes less (a shorter scalar): the default still holds two; a tier
            # held above it comes down as what it keeps of a larger state goes
            for name in tuple(self._held_up):
                self._set_default(name, sized)
            return
        self._sized_for = version
        for name in tuple(self._defaulted):
            self._set_default(name, version)

    def _set_default(self, name: str, version: int) -> None:
        """Give tier ``name`` the default budget for versions of ``version`` bytes, but
        not less than it holds now plus one such version while it holds more than the
        default allows (a state that shrank: the tier must keep its newest restorable
        version, of the old size, until a version of the new size is committed beside
        it, and a budget of two small versions would refuse that one for ever)."""
        slot = self.tierset.get(name)
        if slot.tier is None:
            return
        budget = default = default_budget(version, free_memory(slot.tier))
        now = budget_of(slot.tier)
        if now is not None and default < now:
            try:
                used = slot.tier.usage()
            except TierError as exc:
                log.debug("usage of tier %s unknown: %s", name, exc)
                used = None
            if used is not None:
                budget = max(default, min(now, used + version + SLACK))
        if budget > default:
            self._held_up.add(name)
        else:
            self._held_up.discard(name)
        if budget == now:
            return
        try:
            slot.tier.set_budget(budget)
        except NotSupported:
            self._defaulted.discard(name)
            self._held_up.discard(name)
            return
        except TierError as exc:  # a budget helps; it must not stop a save
            log.warning("could not set the default budget of tier %s: %s", name, exc)
            return
        log.info(
            "tier %s: default budget %s (a version takes %s%s)",
            name,
            format_size(budget),
            format_size(version),
            "" if budget == default else ", until what it keeps of a larger one goes",
        )


def at_least_as_durable(a: Capabilities, b: Capabilities) -> bool:
    """Whether what ``a`` holds survives every failure that what ``b`` holds survives."""
    return a.survives.order >= b.survives.order and (a.persistent or not b.persistent)


def _held_elsewhere(
    name: str,
    version: int,
    caps: Mapping[str, Capabilities],
    catalog: Catalog,
    writing: Iterable[str] = (),
) -> bool:
    """Whether a tier other than ``name``, at least as durable, holds ``version`` (or is
    writing it: ``writing`` names those tiers)."""
    writing = set(writing)
    return any(
        other != name
        and at_least_as_durable(c, caps[name])
        and (other in writing or (other in catalog.logs and catalog.logs[other].holds(version)))
        for other, c in caps.items()
    )


def diff_leaves_no_room(
    slots: Sequence[TierSlot],
    *,
    chunks: Sequence[ChunkRef],
    base_chunks: Sequence[ChunkRef],
    base: int,
    manifest_bytes: int,
    version: int,
    catalog: Catalog,
    tierset: TierSet,
    writing: Iterable[str] = (),
) -> str | None:
    """Why a diff of ``base`` with ``chunks`` must be saved as a base instead (the module
    docstring), or None. ``slots``: the synchronous tiers that would take the diff;
    ``version``: the bytes of one full version (:func:`version_bytes`); ``writing``: the
    tiers still writing ``base`` (a slower tier behind the hand-over), counted as holding
    it, as :func:`log_leaves_no_room` counts them: the next version finds it there as a
    rule, and one that does not waits for it or gives way (never drops what it needs).

    A tier with a budget that must keep ``base`` itself (no other reachable tier at least as
    durable holds it) would keep the base (about ``version``) and the diff's own chunks;
    if that and a full next version exceed the budget, the diff would be the last version
    the tier could take."""
    base_ids = {c.id for c in base_chunks}
    own: dict[str, int] = {}
    for ref in chunks:
        if ref.id not in base_ids:
            own.setdefault(ref.id, ref.length)
    keeps = sum(n + BLOB_HEADER_SIZE for n in own.values()) + manifest_bytes + BLOB_HEADER_SIZE
    caps = {s.name: s.tier.capabilities for s in tierset.slots if s.tier is not None}
    for slot in slots:
        budget = budget_of(slot.tier)
        if budget is None or slot.name not in caps:
            continue
        if _held_elsewhere(slot.name, base, caps, catalog, writing):
            continue
        if version + keeps + version <= budget:
            continue
        return (
            f"tier {slot.name} keeps its base alone, and the base ({format_size(version)}), "
            f"this diff's own chunks ({format_size(keeps)}) and a next version would not fit "
            f"its budget of {format_size(budget)}"
        )
    return None


def chain_bytes(chain: Mapping[int, Sequence[ChunkRef]], keep: Iterable[int]) -> int:
    """The bytes a tier takes for the versions ``keep`` of ``chain`` (version -> its
    chunks): each chunk once, with its blob header (manifests are left out: a few KiB)."""
    sizes: dict[str, int] = {}
    for v in keep:
        for ref in chain.get(v, ()):
            sizes.setdefault(ref.id, ref.length)
    return sum(n + BLOB_HEADER_SIZE for n in sizes.values())


class Chains:
    """The chunks of each version committed since the newest committed base (as the
    save service committed them), from which :meth:`of_log` gives a log version's chain."""

    def __init__(self) -> None:
        self._versions: dict[int, tuple[str, int | None, tuple[ChunkRef, ...]]] = {}

    def committed(self, info: VersionInfo, chunks: tuple[ChunkRef, ...]) -> None:
        """``info`` is committed with ``chunks``."""
        if any(role == "base" and v > info.id for v, (role, _, _) in self._versions.items()):
            return  # older than the newest base: no log will follow it
        if info.role == "base":
            self._versions = {}
        self._versions[info.id] = (info.role, info.base, chunks)

    def of_log(self, full: int) -> dict[int, tuple[ChunkRef, ...]] | None:
        """What a log version of full version ``full`` keeps: ``full``, its base if it is
        a diff, the log versions of it so far (version -> chunks); None if ``full`` was
        not committed here."""
        entry = self._versions.get(full)
        if entry is None:
            return None
        keep = {full, *(v for v, (_, base, _) in self._versions.items() if base == full)}
        if entry[0] == "diff" and entry[1] is not None:
            keep.add(entry[1])
        return {v: self._versions[v][2] for v in keep if v in self._versions}


def log_leaves_no_room(
    tierset: TierSet,
    *,
    chain: Mapping[int, Sequence[ChunkRef]],
    adds: int,
    version: int,
    catalog: Catalog,
    writing: Mapping[int, Iterable[str]] | None = None,
) -> str | None:
    """Why a log version must be saved as a full version instead (the module docstring),
    or None. ``chain``: the chunks of each committed version the log would need kept
    (:meth:`Chains.of_log`); ``adds``: the bytes the log would add (its new steps and what
    it stores whole); ``version``: the bytes of one full version; ``writing``: the tiers
    still writing a version of the chain (a slower tier behind the hand-over), counted as
    holding it, since a next version finds it there as a rule. Judged for each
    synchronous tier with a budget that takes log versions."""
    writing = writing or {}
    caps = {s.name: s.tier.capabilities for s in tierset.slots if s.tier is not None}
    for slot in tierset.slots:
        budget = budget_of(slot.tier)
        tp = slot.policy
        if budget is None or slot.name not in caps or tp is None:
            continue
        if tp.mode != "sync" or not tp.wants("log"):
            continue
        alone = [
            v for v in chain if not _held_elsewhere(slot.name, v, caps, catalog, writing.get(v, ()))
        ]
        keeps = chain_bytes(chain, alone) + adds
        if keeps + version <= budget:
            continue
        return (
            f"tier {slot.name} would keep {format_size(keeps)} for the log and the versions "
            f"it follows, and with a next version ({format_size(version)}) that would not fit "
            f"its budget of {format_size(budget)}"
        )
    return None


def budget_of(tier: Tier | None) -> int | None:
    """The budget ``tier`` enforces now (None: none)."""
    value = getattr(tier, "budget", None) if tier is not None else None
    return value if isinstance(value, int) else None
