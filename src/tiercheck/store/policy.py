"""Placement: which tiers get which versions, with which codec, when, and for how long.

The policy decides; tiers only move bytes. A :class:`Policy` holds store-wide settings and a
:class:`TierPolicy` per tier name. A tier without an explicit entry gets a default derived
from its declared capabilities (:func:`default_tier_policy`, docs/configuration.md):

| tier kind                                   | versions | mode  | codec | keeps                   |
|---------------------------------------------|----------|-------|-------|-------------------------|
| in-process or host memory (``memory``, shm) | all      | sync  | raw   | newest base + its diffs |
| peer memory (survives a node)               | all      | sync  | delta | newest base + its diffs |
| persistent node-local (LMDB, local file)    | base     | sync  | raw   | 2 newest bases          |
| shared / survives the cluster (remote)      | base     | async | zstd  | 2 newest bases          |

The remote tier receives a base at most every ``Policy.remote_every`` (30 minutes unless
the configuration says otherwise, as ``tiercheck plan``'s recommendation does): the
versions between live in the faster tiers (cadence by durability, DESIGN.md).

A shared or cluster-surviving tier that declares ``compress=False`` (a file system mounted
on this node: a local disk, NFS, Lustre) gets ``raw`` instead of ``zstd``.

``codec="delta"`` stores a diff version's changed chunks as deltas against the base's chunk
where that pays (and zstd otherwise); base versions are always stored with zstd there.

What a save promises is decided here too (:mod:`tiercheck.store.guarantees` enforces it): each
tier is ``required`` or ``best_effort`` for the versions it wants (by default a synchronous
tier is required, an asynchronous one best effort), and the store may ask for a failure
domain (``Policy.durability`` for ``wait()``, ``Policy.migrated_durability`` for
``wait_migrated()``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from tiercheck.backends.base import Capabilities, FailureDomain
from tiercheck.core.chunking import DEFAULT_CHUNK_SIZE
from tiercheck.errors import ConfigError
from tiercheck.store.cadence import Cadence, CadenceValue, parse_cadence

__all__ = ["Durability", "Guarantee", "Policy", "TierPolicy", "default_tier_policy"]

Versions = Literal["all", "base"]
Mode = Literal["sync", "async"]
CodecName = Literal["raw", "zstd", "delta"]
Guarantee = Literal["required", "best_effort"]
Durability = Literal["process", "node", "cluster"]
_DURABILITY = ("process", "node", "cluster")


def _is_int(value: object) -> bool:
    """An int, not a bool (TOML's ``true`` is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class TierPolicy:
    """Placement of versions on one tier.

    - ``versions``: ``"all"`` (every version) or ``"base"`` (base versions only).
    - ``mode``: ``"sync"`` (part of the commit; ``wait()`` waits for it) or ``"async"``
      (migrated in the background after the commit).
    - ``codec``: ``"raw"``, ``"zstd"`` or ``"delta"``.
    - ``keep_bases``: newest base versions kept (``None``: all).
    - ``keep_diffs``: newest diff versions kept, and as many log versions (``None``: all
      whose base is kept).
    - ``guarantee``: ``"required"`` (a save this tier wants is not acknowledged unless the
      tier took it: ``wait()`` raises for a synchronous tier, ``wait_migrated()`` for an
      asynchronous one) or ``"best_effort"`` (a failure lowers the commit level and is
      reported in the result, nothing more). ``None``: required if ``mode="sync"``,
      best effort if ``mode="async"``.
    - ``every``: a cadence (:mod:`tiercheck.store.cadence`: ``500`` steps, ``"30min"``)
      for an asynchronous tier: a version is migrated to it only once this much has passed
      since the newest version it holds or was sent; ``None`` (or ``0``): every version it
      wants. The default placement of a remote tier sets it to ``Policy.remote_every``.
    - ``milestones``: a cadence; retention also keeps the oldest base of each such window
      (every 1,000 steps, every ``"6h"``), besides the newest ``keep_bases``. ``None``: none.
    """

    versions: Versions = "all"
    mode: Mode = "sync"
    codec: CodecName = "raw"
    keep_bases: int | None = 1
    keep_diffs: int | None = None
    guarantee: Guarantee | None = None
    every: CadenceValue = None
    milestones: CadenceValue = None

    def __post_init__(self) -> None:
        if self.versions not in ("all", "base"):
            raise ConfigError(f"versions must be 'all' or 'base', got {self.versions!r}")
        if self.mode not in ("sync", "async"):
            raise ConfigError(f"mode must be 'sync' or 'async', got {self.mode!r}")
        if self.codec not in ("raw", "zstd", "delta"):
            raise ConfigError(f"codec must be 'raw', 'zstd' or 'delta', got {self.codec!r}")
        for name in ("keep_bases", "keep_diffs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ConfigError(f"{name} must be a non-negative int or None, got {value!r}")
        if self.keep_bases == 0:
            raise ConfigError("keep_bases must be at least 1 (or None for all)")
        if self.guarantee not in (None, "required", "best_effort"):
            raise ConfigError(
                f"guarantee must be 'required' or 'best_effort', got {self.guarantee!r}"
            )
        if parse_cadence(self.every, "every") is not None and self.mode != "async":
            raise ConfigError(
                f"every={self.every!r} applies to an asynchronous tier (mode='async'): a "
                "synchronous tier takes every version it wants as part of the commit"
            )
        parse_cadence(self.milestones, "milestones")

    @property
    def cadence(self) -> Cadence | None:
        """The parsed ``every`` (None: every version the tier wants)."""
        return parse_cadence(self.every, "every")

    @property
    def milestone_cadence(self) -> Cadence | None:
        """The parsed ``milestones`` (None: no milestones)."""
        return parse_cadence(self.milestones, "milestones")

    def wants(self, role: str) -> bool:
        return self.versions == "all" or role == "base"

    @property
    def required(self) -> bool:
        """Whether a version this tier wants must reach it (see ``guarantee``)."""
        if self.guarantee is None:
            return self.mode == "sync"
        return self.guarantee == "required"


@dataclass(frozen=True)
class Policy:
    """Store-wide placement settings.

    - ``base_every``: every N-th version is a base (a full encoding); the rest are diffs.
    - ``chunk_size``: chunk window in bytes (a multiple of 64).
    - ``on_busy``: what ``save`` does when the previous save is still being written:
      ``"wait"`` for it, or ``"skip"`` this one (the handle reports it).
    - ``zstd_level``: compression level for zstd and delta codecs.
    - ``gc_grace_seconds``: an unreferenced blob is deleted only once it is this old:
      written this long ago where its tier says when (``Tier.written_at``: shm, LMDB,
      fsspec), else first seen unreferenced this long ago by this process. Blobs of saves
      and migrations in flight are protected without it (in this process, and through
      leases in shared tiers); the grace only delays deleting what a crashed writer left
      behind. Maintenance sweeps a tier only this
      process writes to (not shared) at once after retention: no other writer is there.
    - ``hash_threads``: threads that hash a save's chunks (``0``: one per core); encoding
      runs on the store's I/O pool (``threads``).
    - ``durability``: the failure domain ``wait()`` promises: it raises
      :class:`~tiercheck.errors.DurabilityError` unless a tier that committed the version
      survives ``"process"``, ``"node"`` or ``"cluster"`` loss (``None``: no such promise).
    - ``migrated_durability``: the same for ``wait_migrated()``, counting the tiers the
      version was migrated to.
    - ``max_replay_seconds``: the longest a restore may spend replaying a log version's
      optimizer steps (estimated from the steps as timed at capture, plus verification);
      a save that would exceed it is a full version. Only applies where an optimizer is
      guarded with its update log (``Checkpointer.guard``).
    - ``remote_every``: the cadence (``"30min"``, ``"2h"``, ``500`` steps; ``0``: every
      base) at which a remote tier with the default placement receives a base
      (``TierPolicy.every``); ``tiercheck plan`` writes its recommendation here.
    - ``stage_in_shm``: where a save's staging copy goes when the fastest synchronous tier
      is shm (raw, one rank, host tensors, chunk windows at page offsets): ``"auto"``
      straight into shm's segment files, which then become the version's blobs, for a
      state of 64 MiB or more in a store with another synchronous tier (the default
      store: the host then holds two copies of a dense state, not three; see
      :mod:`tiercheck.engine.shm_staging`); ``"on"`` whatever its size and store;
      ``"off"`` into a private buffer, as for every other store.
    - ``tiers``: a :class:`TierPolicy` per tier name; absent names get defaults.
    """

    base_every: int = 10
    chunk_size: int = DEFAULT_CHUNK_SIZE
    on_busy: Literal["wait", "skip"] = "wait"
    zstd_level: int = 1
    gc_grace_seconds: float = 300.0
    hash_threads: int = 0
    durability: Durability | None = None
    migrated_durability: Durability | None = None
    max_replay_seconds: float = 30.0
    remote_every: str | int = "30min"
    stage_in_shm: Literal["auto", "on", "off"] = "auto"
    tiers: Mapping[str, TierPolicy] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not _is_int(self.base_every) or self.base_every < 1:
            raise ConfigError(f"base_every must be an int >= 1, got {self.base_every!r}")
        if not isinstance(self.chunk_size, int) or self.chunk_size < 4096 or self.chunk_size % 64:
            raise ConfigError(
                f"chunk_size must be a multiple of 64 and at least 4096, got {self.chunk_size!r}"
            )
        if self.stage_in_shm not in ("auto", "on", "off"):
            raise ConfigError(
                f"stage_in_shm must be 'auto', 'on' or 'off', got {self.stage_in_shm!r}"
            )
        if self.on_busy not in ("wait", "skip"):
            raise ConfigError(f"on_busy must be 'wait' or 'skip', got {self.on_busy!r}")
        if not _is_int(self.zstd_level) or not 1 <= self.zstd_level <= 22:
            raise ConfigError(f"zstd_level must be an int 1..22, got {self.zstd_level!r}")
        if not _is_number(self.gc_grace_seconds) or not self.gc_grace_seconds >= 0:
            raise ConfigError(
                f"gc_grace_seconds must be a number >= 0, got {self.gc_grace_seconds!r}"
            )
        if not _is_int(self.hash_threads) or self.hash_threads < 0:
            raise ConfigError(
                f"hash_threads must be an int >= 0 (0: one per core), got {self.hash_threads!r}"
            )
        if not _is_number(self.max_replay_seconds) or not self.max_replay_seconds >= 0:
            raise ConfigError(
                f"max_replay_seconds must be a number >= 0, got {self.max_replay_seconds!r}"
            )
        for name in ("durability", "migrated_durability"):
            value = getattr(self, name)
            if value is not None and value not in _DURABILITY:
                raise ConfigError(
                    f"{name} must be 'process', 'node', 'cluster' or None, got {value!r}"
                )
        if self.remote_every is None:  # TOML has no null: 0 is written and read back
            raise ConfigError("remote_every must be a cadence; 0 sends every base")
        parse_cadence(self.remote_every, "remote_every")
        for name, tp in self.tiers.items():
            if not isinstance(tp, TierPolicy):
                raise ConfigError(f"policy for tier {name!r} must be a TierPolicy")

    def for_tier(self, name: str, caps: Capabilities) -> TierPolicy:
        """The placement of tier ``name``: explicit, or the default for its capabilities."""
        explicit = self.tiers.get(name)
        if explicit is not None:
            return explicit
        return default_tier_policy(caps, self.base_every, self.remote_every)


def default_tier_policy(
    caps: Capabilities, base_every: int = 10, remote_every: CadenceValue = "30min"
) -> TierPolicy:
    """The default placement for a tier with capabilities ``caps`` (the table above)."""
    if caps.shared or caps.survives == FailureDomain.CLUSTER:
        codec: CodecName = "zstd" if caps.compress else "raw"
        return TierPolicy(
            versions="base", mode="async", codec=codec, keep_bases=2, every=remote_every
        )
    if caps.survives == FailureDomain.NODE:
        return TierPolicy(versions="all", mode="sync", codec="delta", keep_bases=1)
    if caps.persistent:
        return TierPolicy(versions="base", mode="sync", codec="raw", keep_bases=2)
    return TierPolicy(versions="all", mode="sync", codec="raw", keep_bases=1)
