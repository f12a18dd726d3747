"""Browsing and managing history: lazy versions, diffs, verification, GC and migration.

:func:`build_history` turns the merged manifest logs into :class:`Version` objects without
reading a blob: everything a version row shows (step, role, base, time, metadata, sizes,
the state of each tier) comes from the log records. Opening a version's content is lazy:

- ``v.entries`` reads the shard manifest (one small blob) and nothing else;
- ``v["model/layers.0.weight"]`` reads only the chunks that entry covers, each from the
  fastest tier holding an intact copy (verified, with fallback, as in a restore);
- ``v.to_state_dict()`` reads every chunk once and returns a flat ``key -> value`` dict.

Every version reads as the state it stands for. A log version stores the optimizer inputs
since its base, not the state (SPEC.md section 12): its ``entries`` are those of the state
(the replayed leaves described by its base's manifest, then its own leaves), and the first
read of a replayed leaf replays the log once through an offline optimizer
(:func:`tiercheck.logversions.planner.replay_offline_leaves`, as ``tiercheck export`` does) and
keeps the result on the :class:`Version`. Where that cannot be done here, reads of
replayed leaves raise :class:`~tiercheck.errors.ReplayRequired`. The shard as stored (the
logged gradients under ``/log/S/I`` included) stays visible as ``v.stored_entries``.

:func:`diff` compares two versions entry by entry. An entry whose chunks have the same
ids in both versions (at the same position inside the chunk) is unchanged by
construction: its data is not read. Only entries whose chunks differ are read, in
bounded batches, to tell a real change (with its max abs difference and relative L2
change) from a chunk that changed because of a neighbour.

:func:`verify` re-hashes every blob of every version each tier keeps and optionally
repairs bad or missing copies from another tier; :func:`collect` runs GC with an explicit
grace period; :func:`migrate` copies a version (and the bases it needs) to a tier.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from tiercheck.backends.registry import open_tier
from tiercheck.core.chunking import chunks_of
from tiercheck.engine.catalog import Catalog, TierLog, append_record, read_tier_log
from tiercheck.engine.config import TierSpec
from tiercheck.engine.copying import migrate_shard
from tiercheck.engine.fetch import ChunkFetcher, FetchStats, repair_codec
from tiercheck.engine.retention import GCReport
from tiercheck.engine.tierset import TierSlot
from tiercheck.errors import (
    BlobCorrupt,
    CheckpointError,
    ConfigError,
    FormatVersionError,
    NoRestorableVersion,
    NotFound,
    ReplayRequired,
    TierError,
    TierUnavailable,
)
from tiercheck.formats.codecs import decode_blob, encode_blob
from tiercheck.formats.manifest import (
    CommitRecord,
    Entry,
    EntryKind,
    Role,
    ShardManifest,
    VersionInfo,
)

# torch (and tiercheck.core.entries, which imports it) is imported only where an entry's value
# is made or compared, so that browsing a store (`tiercheck ls`, `show`) need not import it.
if TYPE_CHECKING:
    import torch

    from tiercheck.checkpointer import Checkpointer

__all__ = [
    "BlobProblem",
    "Diff",
    "EntryChange",
    "EntryInfo",
    "MigrateReport",
    "TierVerify",
    "VerifyReport",
    "Version",
    "VersionSummary",
    "build_history",
    "collect",
    "diff",
    "migrate",
    "open_version",
    "parse_version_spec",
    "resolve_version",
    "verify",
]

TierState = Literal["committed", "migrating", "missing", "dropped", "unreachable"]
Progress = Callable[[int, int], None]
"""Called as ``progress(done, total)`` while a long operation runs."""

# Entries read together while diffing are bounded by this many bytes per side.
_DIFF_BATCH_BYTES = 64 << 20


# --- entries ----------------------------------------------------------------------------


@dataclass(frozen=True)
class EntryInfo:
    """One entry of a version, as its shard manifest describes it (no data read).

    ``size`` is the entry's byte length; ``chunks`` the ids of the chunks it covers.
    ``replayed`` is set on a log version's leaf that its replay reproduces: the name the
    log gives it (``param/3``, ``state/3/exp_avg``, SPEC.md 12.2). Such an entry is
    described by the base's manifest, has no chunks of its own (``chunks`` is empty,
    ``offset`` -1), and its value is the replay's.
    """

    key: str
    kind: EntryKind
    dtype: str
    shape: tuple[int, ...]
    size: int
    offset: int
    chunks: tuple[str, ...]
    replayed: str | None = None

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape)) if self.kind in ("tensor", "ndarray") else 1

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "size": self.size,
            "chunks": len(self.chunks),
            "replayed": self.replayed,
        }


def _entry_info(entry: Entry, manifest: ShardManifest) -> EntryInfo:
    ids = tuple(manifest.chunks[i].id for i in chunks_of(entry, manifest.chunks))
    return EntryInfo(
        entry.key, entry.kind, entry.dtype, entry.shape, entry.nbytes, entry.offset, ids
    )


def _byte_view(t: torch.Tensor) -> memoryview:
    import torch

    if t.numel() == 0:
        return memoryview(bytearray())
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def _alloc(entry: Entry) -> tuple[Any, memoryview]:
    """A fresh destination for ``entry`` and a writable byte view of it."""
    if entry.kind == "tensor":
        import torch

        from tiercheck.core.entries import torch_dtype

        t = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
        return t, _byte_view(t)
    if entry.kind == "ndarray":
        arr = np.empty(entry.shape, dtype=np.dtype(entry.dtype))
        return arr, arr.reshape(-1).view(np.uint8).data.cast("B")
    buf = bytearray(entry.nbytes)
    return buf, memoryview(buf)


# --- versions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Version:
    """One committed version: its log facts at once, its content on demand.

    The fields are those of a history row (they come from the logs alone). ``tiers`` maps
    every configured tier to ``committed``, ``migrating``, ``missing``, ``dropped`` or
    ``unreachable``; ``survives`` is the widest failure domain a tier holding it survives
    (``"none"``, ``"process"``, ``"node"``, ``"cluster"``; None if no open tier holds it).
    The rest is lazy: :attr:`entries` reads the shard manifest,
    ``v[key]`` the chunks of one entry, :meth:`to_state_dict` all of them. Reads go
    through the :class:`~tiercheck.Checkpointer` the version came from, which must stay
    open while they run.

    A log version (``role == "log"``) reads as the state it stands for, never as the log
    it stores: see :attr:`entries` and :meth:`read`.
    """

    id: int
    step: int
    role: Role
    base: int | None
    time: float
    metadata: Mapping[str, Any]
    logical_bytes: int
    stored_bytes: int
    tiers: Mapping[str, str]
    restorable: bool
    info: VersionInfo = field(repr=False, compare=False)
    survives: str | None = None
    rank: int = field(default=0, repr=False, compare=False)
    _store: Checkpointer | None = field(default=None, repr=False, compare=False)

    # --- log facts ----------------------------------------------------------------------

    @property
    def holders(self) -> tuple[str, ...]:
        """Names of the tiers that hold this version, in the store's tier order."""
        return tuple(n for n, s in self.tiers.items() if s == "committed")

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def base_version(self) -> Version | None:
        """The full version this one was encoded against (a diff) or replays from (a log);
        None for a base version. A new :class:`Version` object at each call."""
        if self.base is None:
            return None
        return open_version(self._require_store(), self.base, rank=self.rank)

    # --- lazy content -------------------------------------------------------------------

    def _require_store(self) -> Checkpointer:
        store = self._store
        if store is None:
            raise CheckpointError(f"version {self.id} is detached from its store")
        if store.closed:
            raise CheckpointError(
                f"the Checkpointer of version {self.id} is closed; open the store again"
            )
        return store

    @cached_property
    def _reader(self) -> _Reader:
        return _Reader(self._require_store(), self)

    @property
    def manifest(self) -> ShardManifest:
        """This rank's shard manifest (read once, then cached)."""
        return self._reader.manifest

    @cached_property
    def stored_entries(self) -> Mapping[str, EntryInfo]:
        """Every entry this rank's shard stores, by key, in stored order (reads the
        manifest). Those of a full version are its :attr:`entries`; those of a log version
        are the logged gradients (keys ``/log/S/I``, internal) and then its own leaves."""
        m = self.manifest
        return {e.key: _entry_info(e, m) for e in m.entries}

    @cached_property
    def entries(self) -> Mapping[str, EntryInfo]:
        """Every entry of the state this version stands for, by key, in the state's order.

        Reads this rank's shard manifest and, for a log version, its base's (no data).
        A log version's entries are its own leaves and the leaves its replay reproduces
        (``replayed`` set, described by the base's manifest); its logged gradients are
        not entries (see :attr:`stored_entries`).
        """
        m = self.manifest
        if m.log is None:
            return self.stored_entries
        return _logical_entries(self, m)

    def keys(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def __getitem__(self, key: str) -> Any:
        """Read one entry (a tensor, an ndarray or a scalar), fetching only its chunks
        (for a replayed leaf of a log version: replaying the log, see :meth:`read`)."""
        if key not in self.entries:
            raise KeyError(f"version {self.id} has no entry {key!r}")
        return self.read([key])[key]

    def read(self, keys: Iterable[str]) -> dict[str, Any]:
        """Read several entries at once; each chunk they cover is fetched once.

        Every value returned is the caller's own (a fresh tensor, array or scalar). A
        replayed leaf of a log version is the value the logged steps reproduce: the first
        such read replays the log through an offline ``torch.optim`` optimizer built over
        copies of the base's tensors and verifies the result against the fingerprints
        recorded at save; the replayed tensors are then kept on this object, so later
        reads copy them. Raises :class:`~tiercheck.errors.ReplayRequired` where the
        replay cannot be done or does not verify here (the message says how to get the
        state: restore the version into the guarded optimizer of the training script).
        """
        wanted = list(keys)
        entries = self.entries
        missing = [k for k in wanted if k not in entries]
        if missing:
            raise KeyError(f"version {self.id} has no entry {missing[0]!r}")
        replayed = [k for k in wanted if entries[k].replayed is not None]
        if not replayed:
            return self._reader.read(wanted)
        values = self._replayed
        out = self._reader.read([k for k in wanted if entries[k].replayed is None])
        for k in replayed:
            out[k] = _own_copy(values[k])
        return {k: out[k] for k in wanted}

    def read_stored(self, keys: Iterable[str]) -> dict[str, Any]:
        """Read entries of :attr:`stored_entries` as stored (a log version's gradients
        included), without any replay."""
        wanted = list(keys)
        missing = [k for k in wanted if k not in self.stored_entries]
        if missing:
            raise KeyError(f"version {self.id} stores no entry {missing[0]!r}")
        return self._reader.read(wanted)

    def to_state_dict(self, prefix: str = "") -> dict[str, Any]:
        """Every entry (or those whose key starts with ``prefix``) as a flat dict, read as
        :meth:`read` does."""
        return self.read([k for k in self.entries if k.startswith(prefix)])

    @cached_property
    def _replayed(self) -> Mapping[str, Any]:
        # once per Version object: a replay reads the base's replayed tensors in full
        from tiercheck.logversions.planner import replay_offline_leaves

        return replay_offline_leaves(self)

    @property
    def read_stats(self) -> FetchStats:
        """Per-tier reads made so far through this version (chunks, bytes, repairs)."""
        return self._reader.fetcher.stats

    def to_json(self) -> dict[str, Any]:
        """The log facts as plain JSON-able data (what ``tiercheck ls --json`` prints)."""
        return {
            "id": self.id,
            "step": self.step,
            "role": self.role,
            "base": self.base,
            "time": self.time,
            "time_iso": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.time)),
            "metadata": dict(self.metadata),
            "logical_bytes": self.logical_bytes,
            "stored_bytes": self.stored_bytes,
            "tiers": dict(self.tiers),
            "restorable": self.restorable,
            "survives": self.survives,
            "world_size": self.info.world_size,
        }


VersionSummary = Version
"""The former name of a history row; kept so existing code keeps working."""


def _state_leaves(tree: Any) -> Iterator[tuple[str, str, Any]]:
    """``(key, tag, value)`` of every leaf node of a state tree (SPEC.md sections 8 and
    12.3: ``e``, ``s`` and ``r`` nodes), in the state's order."""
    stack: list[tuple[str, Any]] = [("", tree)]
    while stack:
        key, node = stack.pop()
        ((tag, sub),) = node.items()
        if tag in ("e", "s", "r"):
            yield key, tag, sub
        elif tag == "o":
            stack.append((key, sub))
        else:
            items = sub if tag == "d" else list(enumerate(sub))
            stack.extend((f"{key}/{k}" if key else str(k), child) for k, child in reversed(items))


def _logical_entries(v: Version, m: ShardManifest) -> dict[str, EntryInfo]:
    """The entries of the state log version ``v`` (shard manifest ``m``) stands for."""
    base = v.base_version
    if base is None:  # unpack_manifest refuses a log record without a base
        raise NoRestorableVersion(f"version {v.id} is a log version without a base")
    base_entries = base.entries
    out: dict[str, EntryInfo] = {}
    for key, tag, sub in _state_leaves(m.tree):
        if tag != "r":
            e = m.entries[sub]
            out[e.key] = _entry_info(e, m)
            continue
        described = base_entries.get(key)
        if described is None:
            raise ReplayRequired(
                f"version {v.id} is a log version whose leaf {key!r} is replayed from "
                f"version {base.id}, which has no entry {key!r}: the state cannot be "
                f"described without the training script. Restore version {v.id} into its "
                "guarded optimizer (ckpt.guard(optimizer); ckpt.restore(state))",
                version=v.id,
                base=base.id,
            )
        out[key] = replace(described, offset=-1, chunks=(), replayed=sub)
    return out


def _own_copy(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    return value


class _Reader:
    """Fetches entries of one version through its store's tiers, fastest holder first."""

    def __init__(self, store: Checkpointer, v: Version) -> None:
        if v.rank >= len(v.info.shards):
            raise NoRestorableVersion(
                f"version {v.id} has {len(v.info.shards)} shard(s); there is no rank {v.rank}"
            )
        self.store = store
        slots = store.tierset
        holders = [slots.get(n) for n in v.holders]
        self.order = sorted([s for s in holders if s.tier is not None], key=lambda s: s.speed_rank)
        self.order += [s for s in slots.by_speed() if s not in self.order]
        if not self.order:
            raise NoRestorableVersion(f"version {v.id}: no tier of this store can be read")
        self.expect = list(v.holders)
        self.fetcher = ChunkFetcher(
            self.order,
            repair=not store.read_only,
            zstd_level=store.policy.zstd_level,
        )
        self.manifest_id = v.info.shards[v.rank]
        self.info = v.info
        self.allow_pickle = store.allow_pickle

    @cached_property
    def manifest(self) -> ShardManifest:
        return self.fetcher.manifest(self.manifest_id, order=self.order)

    def read(self, keys: Sequence[str]) -> dict[str, Any]:
        m = self.manifest
        whole = {m.entries[i].key: i for i in m.sharded}
        if not any(k in whole for k in keys):
            return self._read_plain(keys)
        # pieces of distributed tensors are read whole, from every rank's shard
        out = self._read_whole([k for k in keys if k in whole], whole)
        out.update(self._read_plain([k for k in keys if k not in whole]))
        return {k: out[k] for k in keys}

    def _read_plain(self, keys: Sequence[str]) -> dict[str, Any]:
        from tiercheck.core.entries import decode_scalar

        m = self.manifest
        by_key = {e.key: e for e in m.entries}
        entries = [by_key[k] for k in keys]
        values: list[Any] = []
        dests: list[memoryview] = []
        need: dict[int, list[int]] = defaultdict(list)
        for j, e in enumerate(entries):
            value, dest = _alloc(e)
            values.append(value)
            dests.append(dest)
            for ci in chunks_of(e, m.chunks):
                need[ci].append(j)

        def one(ci: int) -> None:
            ref = m.chunks[ci]
            lo, hi = ref.offset, ref.offset + ref.length
            users = need[ci]
            if len(users) == 1:
                e = entries[users[0]]
                if e.offset <= lo and e.offset + e.nbytes >= hi:
                    dst = dests[users[0]][lo - e.offset : hi - e.offset]
                    self.fetcher.fetch(ref.id, dst, order=self.order, expect=self.expect)
                    return
            raw, _ = self.fetcher.fetch(ref.id, order=self.order, expect=self.expect)
            for j in users:
                e = entries[j]
                a, z = max(lo, e.offset), min(hi, e.offset + e.nbytes)
                dests[j][a - e.offset : z - e.offset] = raw[a - lo : z - lo]

        indices = sorted(need)
        if len(indices) == 1:
            one(indices[0])
        elif indices:
            list(self.store.executor.map(one, indices))
        out: dict[str, Any] = {}
        for e, value in zip(entries, values):
            if e.kind in ("tensor", "ndarray"):
                out[e.key] = value
            else:
                out[e.key] = decode_scalar(e.kind, bytes(value), e.key, self.allow_pickle)
        return out

    def _read_whole(self, keys: Sequence[str], index: Mapping[str, int]) -> dict[str, Any]:
        """The global tensors of which ``keys`` are this rank's pieces."""
        import torch

        from tiercheck.core.entries import torch_dtype
        from tiercheck.core.sharded import Piece, gather

        m = self.manifest
        out: dict[str, Any] = {}
        pieces = []
        for k in keys:
            e, placement = m.entries[index[k]], m.sharded[index[k]]
            dest = torch.empty(placement.global_shape, dtype=torch_dtype(e.dtype))
            pieces.append(Piece(k, e.dtype, placement.global_shape, dest, (0,) * len(e.shape)))
            out[k] = dest
        gather(
            pieces, self.info, self.fetcher, self.order, self.store.executor, expect=self.expect
        ).apply()
        return out


# --- building the history ---------------------------------------------------------------


def build_history(
    store: Checkpointer,
    catalog: Catalog,
    *,
    pending: Iterable[tuple[int, str]] = (),
    pinned: Iterable[int] = (),
) -> list[Version]:
    """Every committed version of ``catalog``, oldest first, as :class:`Version` objects.

    Reads no blob. A tier shows ``migrating`` for a version when this process has its
    migration queued (``pending``, ``pinned``), or, seen from another process, when the
    tier receives such versions asynchronously and holds nothing newer yet (migrations
    run in commit order).
    """
    pending_set = set(pending)
    pinned_set = set(pinned)
    infer = store.read_only  # the writer is another process: its queue is not visible
    versions = catalog.versions
    held_by: dict[str, set[int]] = {}
    newest: dict[str, int] = {}
    for name, tl in catalog.logs.items():
        held = set(tl.held())
        held_by[name] = held
        newest[name] = max(tl.committed, default=-1)
    restorable = catalog.restorable_ids
    slots = store.tierset.slots
    out: list[Version] = []
    for vid, info in versions.items():
        tiers: dict[str, str] = {}
        stored = 0
        for slot in slots:
            slot_log: TierLog | None = catalog.logs.get(slot.name)
            if slot_log is None:
                tiers[slot.name] = "unreachable"
            elif vid in held_by[slot.name]:
                tiers[slot.name] = "committed"
                stored += slot_log.bytes_written(vid)
            elif vid in slot_log.dropped:
                tiers[slot.name] = "dropped"
            elif (vid, slot.name) in pending_set or (
                slot.policy is not None
                and slot.policy.mode == "async"
                and slot.policy.wants(info.role)
                and (vid in pinned_set or (infer and vid > newest[slot.name]))
            ):
                tiers[slot.name] = "migrating"
            else:
                tiers[slot.name] = "missing"
        domains = [
            s.tier.capabilities.survives
            for s in slots
            if s.tier is not None and tiers[s.name] == "committed"
        ]
        best = max(domains, key=lambda d: d.order).value if domains else None
        out.append(
            Version(
                id=vid,
                step=info.step,
                role=info.role,
                base=info.base,
                time=info.time,
                metadata=dict(info.metadata),
                logical_bytes=info.logical_bytes,
                stored_bytes=stored,
                tiers=tiers,
                restorable=vid in restorable,
                info=info,
                survives=best,
                rank=store.rank,
                _store=store,
            )
        )
    return out


def parse_version_spec(spec: int | str) -> tuple[str, int | None]:
    """``17`` / ``"17"`` -> ``("id", 17)``; ``"step:N"`` -> ``("step", N)``;
    ``"latest"`` -> ``("latest", None)``. Raises ``ValueError`` otherwise."""
    if isinstance(spec, bool):
        raise ValueError(f"not a version: {spec!r}")
    if isinstance(spec, int):
        return "id", spec
    text = spec.strip().lower()
    if text == "latest":
        return "latest", None
    if text.startswith("step:"):
        num = text[5:]
        if num.isdigit():
            return "step", int(num)
    elif text.isdigit():
        return "id", int(text)
    raise ValueError(f"not a version: {spec!r} (expected an id, 'latest' or 'step:N')")


def resolve_version(
    versions: Sequence[Version], spec: int | str | None = None, *, step: int | None = None
) -> Version:
    """Pick the version ``spec`` names (an id, ``"latest"``, ``"step:N"``) or of ``step``.

    ``latest`` is the newest restorable version (the newest committed one if none is).
    Raises :class:`NoRestorableVersion` when there is no such version.
    """
    if spec is None and step is None:
        spec = "latest"
    kind, num = ("step", step) if spec is None else parse_version_spec(spec)
    if not versions:
        raise NoRestorableVersion("the store has no committed version")
    if kind == "latest":
        restorable = [v for v in versions if v.restorable]
        return (restorable or list(versions))[-1]
    if kind == "step":
        matches = [v for v in versions if v.step == num]
        if not matches:
            raise NoRestorableVersion(f"no committed version has step {num}")
        return matches[-1]
    for v in versions:
        if v.id == num:
            return v
    ids = [v.id for v in versions]
    raise NoRestorableVersion(
        f"version {num} is not a committed version of this store "
        f"(committed: {len(ids)} version(s), ids {ids[0]}..{ids[-1]})"
    )


def open_version(
    store: Checkpointer,
    spec: int | str | Version | None = None,
    *,
    step: int | None = None,
    rank: int | None = None,
) -> Version:
    """The :class:`Version` ``spec`` names (see :func:`resolve_version`), for ``rank``."""
    if isinstance(spec, Version) and (rank is None or rank == spec.rank):
        return spec
    if isinstance(spec, Version):
        spec = spec.id
    v = resolve_version(store.history(), spec, step=step)
    if rank is not None and rank != v.rank:
        if not 0 <= rank < v.info.world_size:
            raise NoRestorableVersion(
                f"version {v.id} has {v.info.world_size} shard(s); there is no rank {rank}"
            )
        v = Version(**{**_fields(v), "rank": rank})
    return v


def _fields(v: Version) -> dict[str, Any]:
    return {name: getattr(v, name) for name in Version.__dataclass_fields__}


# --- diff -------------------------------------------------------------------------------


@dataclass(frozen=True)
class EntryChange:
    """An entry present in both versions whose value differs.

    ``reason`` is ``data`` (same kind, dtype and shape, other values), ``dtype``,
    ``shape`` or ``kind``. For numeric data, ``max_abs_diff`` is max |b - a| and
    ``rel_l2`` is ||b - a|| / ||a|| (``inf`` when a is all zeros); otherwise None.
    """

    key: str
    reason: Literal["data", "dtype", "shape", "kind"]
    a: EntryInfo
    b: EntryInfo
    max_abs_diff: float | None = None
    rel_l2: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "reason": self.reason,
            "a": self.a.to_json(),
            "b": self.b.to_json(),
            "max_abs_diff": _json_float(self.max_abs_diff),
            "rel_l2": _json_float(self.rel_l2),
        }


def _json_float(x: float | None) -> float | str | None:
    if x is None or math.isfinite(x):
        return x
    return str(x)


@dataclass(frozen=True)
class Diff:
    """What changed from version ``a`` to version ``b``.

    Both sides are the states the versions stand for: a log version's replayed leaves
    are compared as replayed (so ``diff(base, log)`` lists what the logged optimizer steps
    changed). ``unchanged_by_id`` counts the unchanged entries decided from chunk ids
    alone (no data read); ``entries_read`` counts entries whose data had to be read (on
    each side). ``a_role`` and ``b_role`` are the versions' roles.
    """

    a: int
    b: int
    added: tuple[EntryInfo, ...]
    removed: tuple[EntryInfo, ...]
    changed: tuple[EntryChange, ...]
    unchanged: tuple[str, ...]
    unchanged_by_id: int
    entries_read: int
    a_role: Role = "base"
    b_role: Role = "base"

    @property
    def identical(self) -> bool:
        return not (self.added or self.removed or self.changed)

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "a_role": self.a_role,
            "b_role": self.b_role,
            "added": [e.to_json() for e in self.added],
            "removed": [e.to_json() for e in self.removed],
            "changed": [c.to_json() for c in self.changed],
            "unchanged": list(self.unchanged),
            "unchanged_by_id": self.unchanged_by_id,
            "entries_read": self.entries_read,
        }


def _same_by_id(ea: EntryInfo, eb: EntryInfo, csa: int, csb: int) -> bool:
    """True when equal chunk ids prove the two entries' bytes equal (never for a replayed
    leaf: it has no chunks, its value is the replay's)."""
    return (
        ea.replayed is None
        and eb.replayed is None
        and csa == csb
        and ea.size == eb.size
        and ea.offset % csa == eb.offset % csb
        and ea.chunks == eb.chunks
    )


def _as_float(value: Any) -> torch.Tensor:
    import torch

    t = torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) else value
    assert isinstance(t, torch.Tensor)
    if t.is_complex():
        return t.to(torch.complex128)
    return t.to(torch.float64)


def _numeric_change(a: Any, b: Any) -> tuple[float, float]:
    import torch

    ta, tb = _as_float(a), _as_float(b)
    if ta.numel() == 0:
        return 0.0, 0.0
    d = tb - ta
    max_abs = float(d.abs().max().item())
    norm_d = float(torch.linalg.vector_norm(d).item())
    norm_a = float(torch.linalg.vector_norm(ta).item())
    if norm_a == 0.0:
        return max_abs, 0.0 if norm_d == 0.0 else math.inf
    return max_abs, norm_d / norm_a


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _compare_values(ea: EntryInfo, eb: EntryInfo, va: Any, vb: Any) -> EntryChange | None:
    import torch

    if ea.kind in ("tensor", "ndarray"):
        if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
            same = va.numel() == 0 or bool(
                torch.equal(va.reshape(-1).view(torch.uint8), vb.reshape(-1).view(torch.uint8))
            )
        else:
            same = bytes(np.ascontiguousarray(va).data) == bytes(np.ascontiguousarray(vb).data)
        if same:
            return None
        try:
            max_abs, rel = _numeric_change(va, vb)
        except (RuntimeError, TypeError):
            return EntryChange(ea.key, "data", ea, eb)
        return EntryChange(ea.key, "data", ea, eb, max_abs, rel)
    if va == vb and type(va) is type(vb):
        return None
    if _is_number(va) and _is_number(vb):
        delta = abs(float(vb) - float(va))
        rel = delta / abs(float(va)) if va else (0.0 if delta == 0 else math.inf)
        return EntryChange(ea.key, "data", ea, eb, delta, rel)
    return EntryChange(ea.key, "data", ea, eb)


def diff(va: Version, vb: Version) -> Diff:
    """Compare the states of ``va`` and ``vb`` (same rank); see :class:`Diff`. Raises
    :class:`~tiercheck.errors.ReplayRequired` where a log version's replay is needed and
    cannot be done here."""
    ea_all, eb_all = va.entries, vb.entries
    csa, csb = va.manifest.chunk_size, vb.manifest.chunk_size
    added = tuple(e for k, e in eb_all.items() if k not in ea_all)
    removed = tuple(e for k, e in ea_all.items() if k not in eb_all)
    changed: dict[str, EntryChange] = {}
    unchanged: list[str] = []
    by_id = 0
    to_read: list[str] = []
    for key, ea in ea_all.items():
        eb = eb_all.get(key)
        if eb is None:
            continue
        if ea.kind != eb.kind:
            changed[key] = EntryChange(key, "kind", ea, eb)
        elif ea.dtype != eb.dtype:
            changed[key] = EntryChange(key, "dtype", ea, eb)
        elif ea.shape != eb.shape:
            changed[key] = EntryChange(key, "shape", ea, eb)
        elif _same_by_id(ea, eb, csa, csb):
            unchanged.append(key)
            by_id += 1
        else:
            to_read.append(key)
    for batch in _batches(to_read, ea_all):
        da, db = va.read(batch), vb.read(batch)
        for key in batch:
            change = _compare_values(ea_all[key], eb_all[key], da[key], db[key])
            if change is None:
                unchanged.append(key)
            else:
                changed[key] = change
        del da, db
    order = {k: i for i, k in enumerate(ea_all)}
    unchanged.sort(key=order.__getitem__)
    return Diff(
        a=va.id,
        b=vb.id,
        added=added,
        removed=removed,
        changed=tuple(changed[k] for k in ea_all if k in changed),
        unchanged=tuple(unchanged),
        unchanged_by_id=by_id,
        entries_read=len(to_read),
        a_role=va.role,
        b_role=vb.role,
    )


def _batches(keys: Sequence[str], entries: Mapping[str, EntryInfo]) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for key in keys:
        n = entries[key].size
        if batch and size + n > _DIFF_BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(key)
        size += n
    if batch:
        yield batch


# --- verify -----------------------------------------------------------------------------


ProblemKind = Literal["corrupt", "missing", "unreadable", "newer-format"]


@dataclass
class BlobProblem:
    """A blob a tier should hold that is ``corrupt``, ``missing``, could not be read
    (``unreadable``; also used for a whole tier that cannot be reached, with ``id=""``), or
    was written by a newer major format than this tiercheck reads (``newer-format``: not
    known to be damaged, but not checkable here either; upgrade tiercheck to check it).

    ``--repair`` rewrites ``corrupt`` and ``missing`` copies only: it never replaces a newer
    writer's copy with one in this reader's older format.
    """

    tier: str
    id: str
    kind: ProblemKind
    detail: str
    versions: tuple[int, ...] = ()
    repaired: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "id": self.id,
            "kind": self.kind,
            "detail": self.detail,
            "versions": list(self.versions),
            "repaired": self.repaired,
        }


@dataclass
class TierVerify:
    """What verify checked in one tier."""

    tier: str
    versions: int = 0
    blobs: int = 0
    bytes: int = 0
    reachable: bool = True

    def to_json(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "versions": self.versions,
            "blobs": self.blobs,
            "bytes": self.bytes,
            "reachable": self.reachable,
        }


@dataclass
class VerifyReport:
    """Every tier checked and every problem found (``ok``: none left unrepaired)."""

    tiers: list[TierVerify] = field(default_factory=list)
    problems: list[BlobProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(p.repaired for p in self.problems)

    @property
    def repaired(self) -> int:
        return sum(p.repaired for p in self.problems)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "tiers": [t.to_json() for t in self.tiers],
            "problems": [p.to_json() for p in self.problems],
            "repaired": self.repaired,
            "unrepaired": sum(not p.repaired for p in self.problems),
        }


def _check_blob(
    slot: TierSlot, blob_id: str, base_lookup: Callable[[str], bytes]
) -> tuple[int, BlobProblem | None]:
    """Read and re-hash one blob in ``slot``: ``(stored bytes, problem or None)``."""
    assert slot.tier is not None
    try:
        blob = slot.tier.get(blob_id)
        decode_blob(blob, blob_id, base_lookup=base_lookup)
    except FormatVersionError as exc:  # this blob's header, or that of a delta base it needs
        return 0, BlobProblem(slot.name, blob_id, "newer-format", str(exc))
    except BlobCorrupt as exc:
        return 0, BlobProblem(slot.name, blob_id, "corrupt", str(exc))
    except NotFound:
        return 0, BlobProblem(slot.name, blob_id, "missing", "the tier does not have it")
    except (TierError, OSError) as exc:
        return 0, BlobProblem(slot.name, blob_id, "unreadable", str(exc))
    return len(blob), None


def verify(
    store: Checkpointer,
    *,
    tiers: Sequence[str] | None = None,
    repair: bool = False,
    progress: Progress | None = None,
) -> VerifyReport:
    """Re-hash every blob of every version each tier (or each of ``tiers``) keeps.

    Checks each version's shard manifests, every chunk they name and the delta bases those
    chunks need. Every problem is reported per blob copy and the pass goes on, including
    for a blob or manifest written by a newer major format (``newer-format``: the chunks
    of such a manifest cannot be listed, those of the other versions are still checked).
    With ``repair`` (the store must be open for writing), a corrupt or missing copy is
    rewritten from an intact copy in another tier and checked again.
    """
    if repair and store.read_only:
        raise CheckpointError("verify --repair needs the store open for writing")
    catalog = store.refresh()
    names = [s.name for s in store.tierset.slots]
    if tiers is not None:
        unknown = [t for t in tiers if t not in names]
        if unknown:
            raise ConfigError(f"unknown tier {unknown[0]!r}; this store's tiers: {names}")
    chosen = [s for s in store.tierset.slots if tiers is None or s.name in tiers]
    everywhere = ChunkFetcher(store.tierset.by_speed(), repair=False)

    def base_lookup(blob_id: str) -> bytes:
        return bytes(everywhere.fetch(blob_id)[0])

    report = VerifyReport()
    work: list[tuple[TierSlot, str]] = []
    refs: dict[tuple[str, str], set[int]] = defaultdict(set)
    # manifests of a newer schema (or whose every copy is of a newer blob format)
    unlisted: dict[tuple[str, str], BlobProblem] = {}
    for slot in chosen:
        tl = catalog.logs.get(slot.name)
        tv = TierVerify(slot.name)
        report.tiers.append(tv)
        if slot.tier is None or tl is None:
            tv.reachable = False
            why = slot.error or catalog.unreachable.get(slot.name, "cannot be reached")
            report.problems.append(BlobProblem(slot.name, "", "unreadable", why))
            continue
        ids: dict[str, None] = {}
        held = tl.held()
        tv.versions = len(held)
        for vid in held:
            for mid in tl.committed[vid].shards:
                ids.setdefault(mid)
                refs[(slot.name, mid)].add(vid)
                try:
                    manifest = everywhere.manifest(mid)
                except FormatVersionError as exc:
                    # its chunks cannot be listed; the other versions are still checked
                    unlisted[(slot.name, mid)] = BlobProblem(
                        slot.name, mid, "newer-format", f"chunks not checked: {exc}"
                    )
                    continue
                except (TierError, OSError) as exc:
                    report.problems.append(
                        BlobProblem(
                            slot.name, mid, "unreadable", f"no readable manifest: {exc}", (vid,)
                        )
                    )
                    continue
                for ref in manifest.chunks:
                    ids.setdefault(ref.id)
                    refs[(slot.name, ref.id)].add(vid)
        frontier = [c for c in ids if c in tl.deltas]
        while frontier:
            base = tl.deltas[frontier.pop()]
            if base not in ids:
                ids.setdefault(base)
                if base in tl.deltas:
                    frontier.append(base)
        work.extend((slot, blob_id) for blob_id in ids)
    total = len(work)
    if progress is not None:
        progress(0, total)
    by_name = {tv.tier: tv for tv in report.tiers}

    def check(item: tuple[TierSlot, str]) -> tuple[TierSlot, str, int, BlobProblem | None]:
        slot, blob_id = item
        n, problem = _check_blob(slot, blob_id, base_lookup)
        return slot, blob_id, n, problem

    found: list[BlobProblem] = []
    for done, (slot, blob_id, n, problem) in enumerate(store.executor.map(check, work), 1):
        tv = by_name[slot.name]
        tv.blobs += 1
        tv.bytes += n
        if problem is None or problem.kind == "newer-format":
            # one report per copy of a newer manifest, saying its chunks went unchecked
            problem = unlisted.pop((slot.name, blob_id), None) or problem
        if problem is not None:
            found.append(problem)
        if progress is not None and (done == total or done % 64 == 0):
            progress(done, total)
    found.extend(unlisted.values())  # a newer manifest whose copy here is also damaged
    for problem in found:
        problem.versions = tuple(sorted(refs.get((problem.tier, problem.id), ())))
    if repair:
        for problem in found:
            _repair(store, problem, base_lookup)
    report.problems.extend(found)
    return report


def _repair(store: Checkpointer, problem: BlobProblem, base_lookup: Callable[[str], bytes]) -> None:
    slot = store.tierset.get(problem.tier)
    if problem.kind == "newer-format":
        problem.detail += "; not repaired: a newer writer's copy is left as it is"
        return
    if slot.tier is None or problem.kind == "unreadable" or not problem.id:
        return
    others = [s for s in store.tierset.by_speed() if s.name != slot.name]
    try:
        raw, source = ChunkFetcher(others, repair=False).fetch(problem.id)
        blob = encode_blob(raw, repair_codec(slot), level=store.policy.zstd_level)
        slot.tier.put(problem.id, blob, overwrite=True)
    except (TierError, OSError) as exc:
        problem.detail += f"; repair failed: {exc}"
        return
    _, again = _check_blob(slot, problem.id, base_lookup)
    if again is None:
        problem.repaired = True
        problem.detail += f"; repaired from {source}"
    else:
        problem.detail += f"; still bad after repair: {again.detail}"


# --- gc ---------------------------------------------------------------------------------


def collect(
    store: Checkpointer, *, dry_run: bool = False, grace: float | None = None
) -> list[GCReport]:
    """Sweep each tier's unreferenced blobs (see :mod:`tiercheck.engine.retention`).

    With ``grace=None`` this is :meth:`Checkpointer.gc` (the policy's grace period, on this
    process's grace clock). An explicit ``grace`` uses a fresh clock: a blob counts as first
    seen now, so only ``grace=0`` deletes anything at once. Either way blobs of saves and
    migrations in flight are safe (:mod:`tiercheck.engine.leases`).
    """
    return store.gc(dry_run=dry_run, grace=grace)


# --- migrate ----------------------------------------------------------------------------


@dataclass
class MigrateReport:
    """What :func:`migrate` copied: ``versions`` the ids committed to the target (the
    version and any base it needs), ``already`` those it held before."""

    tier: str
    url: str
    versions: list[int] = field(default_factory=list)
    already: list[int] = field(default_factory=list)
    chunks_written: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    configured: bool = True

    def to_json(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "url": self.url,
            "versions": self.versions,
            "already": self.already,
            "chunks_written": self.chunks_written,
            "bytes_written": self.bytes_written,
            "seconds": self.seconds,
            "configured": self.configured,
        }


def _target_slot(store: Checkpointer, to: str) -> tuple[TierSlot, bool]:
    """The slot ``to`` names (a configured tier's name or URL), or a new one for a URL."""
    for slot in store.tierset.slots:
        if to in (slot.name, slot.spec.url):
            if slot.tier is None:
                raise TierUnavailable(f"tier {slot.name} cannot be opened: {slot.error}")
            if slot.tier.read_only:
                raise CheckpointError(
                    f"tier {slot.name} is open read-only; open the store for writing"
                )
            return slot, True
    tier = open_tier(to)
    policy = store.policy.for_tier("target", tier.capabilities)
    return TierSlot(TierSpec("target", to), tier, policy), False


def migrate(
    store: Checkpointer,
    version: Version,
    to: str,
    *,
    progress: Progress | None = None,
) -> MigrateReport:
    """Copy ``version`` (every rank's shard, and first the bases it needs) to tier ``to``.

    ``to`` is a tier name or URL of the store (the store must be open for writing), or the
    URL of another location, which then holds a self-contained copy that a store
    configured with that URL can restore. Chunks come from the fastest intact copy; the
    target gets blobs, then manifests, then ``prepare`` and ``commit`` records.
    """
    t0 = time.perf_counter()
    slot, configured = _target_slot(store, to)
    assert slot.tier is not None
    report = MigrateReport(slot.name, slot.spec.url, configured=configured)
    try:
        catalog = store.refresh()
        target_log = read_tier_log(slot.name, slot.tier)
        chain: list[VersionInfo] = []
        cur: int | None = version.id
        while cur is not None:
            info = catalog.versions.get(cur)
            if info is None:
                raise NoRestorableVersion(f"version {cur} (a base of {version.id}) is unknown")
            chain.append(info)
            cur = info.base if info.role in ("diff", "log") else None
        chain.reverse()
        todo = [i for i in chain if not target_log.holds(i.id)]
        report.already = [i.id for i in chain if target_log.holds(i.id)]
        steps = sum(len(i.shards) for i in todo)
        if progress is not None:
            progress(0, steps)
        done = 0
        for info in todo:
            holders = [store.tierset.get(n) for n in catalog.holders(info.id)]
            sources = sorted(
                [s for s in holders if s.tier is not None and s.name != slot.name],
                key=lambda s: s.speed_rank,
            )
            sources += [
                s for s in store.tierset.by_speed() if s not in sources and s.name != slot.name
            ]
            fetcher = ChunkFetcher(
                sources, repair=not store.read_only, zstd_level=store.policy.zstd_level
            )
            base = catalog.versions.get(info.base) if info.base is not None else None
            for rank in range(len(info.shards)):
                result = migrate_shard(
                    info,
                    rank,
                    slot,
                    sources,
                    fetcher,
                    store.executor,
                    zstd_level=store.policy.zstd_level,
                    base_manifest_id=base.shards[rank] if base is not None else None,
                    commit=False,
                )
                report.chunks_written += result.chunks_written
                report.bytes_written += result.bytes_written
                done += 1
                if progress is not None:
                    progress(done, steps)
            append_record(slot.tier, CommitRecord(info))
            report.versions.append(info.id)
    finally:
        if not configured:
            slot.tier.close()
    report.seconds = time.perf_counter() - t0
    return report
