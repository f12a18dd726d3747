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
(:func:`tiercheck.logversions.replay.replay_offline_leaves`, as ``tiercheck export`` does) and
keeps the result on the :class:`Version`. Where that cannot be done here, reads of
replayed leaves raise :class:`~tiercheck.errors.ReplayRequired`. The shard as stored (the
logged gradients under ``/log/S/I`` included) stays visible as ``v.stored_entries``.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from tiercheck.core.chunking import chunks_of
from tiercheck.errors import (
    CheckpointError,
    NoRestorableVersion,
    ReplayRequired,
    TierError,
)
from tiercheck.formats.manifest import (
    Entry,
    EntryKind,
    Role,
    ShardManifest,
    VersionInfo,
)
from tiercheck.history.view import StoreView
from tiercheck.runtime.handles import TierState
from tiercheck.store.catalog import Catalog, TierLog
from tiercheck.store.config import without_userinfo
from tiercheck.store.fetch import ChunkFetcher, FetchStats
from tiercheck.store.tierset import TierSlot

# torch (and tiercheck.core.entries, which imports it) is imported only where an entry's value
# is made or compared, so that browsing a store (`tiercheck ls`, `show`) need not import it.
if TYPE_CHECKING:
    import torch

    from tiercheck.restore.losses import ListedLoss


__all__ = [
    "EntryInfo",
    "Version",
    "VersionSummary",
    "build_history",
    "dropped_summary",
    "open_version",
    "parse_version_spec",
    "resolve_version",
    "vanished_tiers",
]


Progress = Callable[[int, int], None]
"""Called as ``progress(done, total)`` while a long operation runs."""


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
    tiers: Mapping[str, TierState]
    restorable: bool
    info: VersionInfo = field(repr=False, compare=False)
    survives: str | None = None
    rank: int = field(default=0, repr=False, compare=False)
    gone: str | None = None
    """Why this version cannot be restored although its save was acknowledged: ``"lost
    with tier shm"`` (the ack ledger names it, the tier that held it lost it, e.g. in a
    reboot), ``"lost with tier shm of rank 1"`` (another rank lost its shard); None
    otherwise. A row no tier here holds has only its id, step, role and time, and
    reading it raises :class:`~tiercheck.errors.NoRestorableVersion`; one whose shard
    this rank still holds reads as any version that is not restorable."""
    _store: StoreView[Version] | None = field(default=None, repr=False, compare=False)

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

    def _require_store(self) -> StoreView[Version]:
        if not self.holders:
            held = ", ".join(f"{n}: {s}" for n, s in self.tiers.items())
            raise NoRestorableVersion(
                f"version {self.id} (step {self.step}) cannot be read: "
                f"{self.gone or 'no tier holds it'} ({held}); pick a version that "
                "`tiercheck ls` lists as restorable"
            )
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

    def read_pieces(self, keys: Iterable[str]) -> dict[str, Any]:
        """Read entries of :attr:`stored_entries` as this rank stored them: a distributed
        tensor's entry is this rank's piece, not the whole tensor (see its placement in
        ``manifest.sharded``)."""
        wanted = list(keys)
        missing = [k for k in wanted if k not in self.stored_entries]
        if missing:
            raise KeyError(f"version {self.id} stores no entry {missing[0]!r}")
        return self._reader._read_plain(wanted)

    def to_state_dict(self, prefix: str = "") -> dict[str, Any]:
        """Every entry (or those whose key starts with ``prefix``) as a flat dict, read as
        :meth:`read` does."""
        return self.read([k for k in self.entries if k.startswith(prefix)])

    @cached_property
    def _replayed(self) -> Mapping[str, Any]:
        # once per Version object: a replay reads the base's replayed tensors in full
        from tiercheck.logversions.replay import replay_offline_leaves

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
            "gone": self.gone,
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

    def __init__(self, store: StoreView[Version], v: Version) -> None:
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
            list(self.store.executors.io.map(one, indices))
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
        from tiercheck.restore.reshard import Piece, gather

        m = self.manifest
        out: dict[str, Any] = {}
        pieces = []
        for k in keys:
            e, placement = m.entries[index[k]], m.sharded[index[k]]
            dest = torch.empty(placement.global_shape, dtype=torch_dtype(e.dtype))
            pieces.append(Piece(k, e.dtype, placement.global_shape, dest, (0,) * len(e.shape)))
            out[k] = dest
        gather(
            pieces, self.info, self.fetcher, self.order, self.store.executors.io, expect=self.expect
        ).apply()
        return out


def _sent_by_cadence(slot: TierSlot, catalog: Catalog) -> set[int]:
    """The versions after the newest one ``slot`` committed that its migrations would
    send: those it wants, each due by its cadence after the previous one sent (as
    :meth:`MigrationService.targets` decides, from the versions' steps and times)."""
    tl = catalog.logs.get(slot.name)
    if slot.policy is None or slot.policy.mode != "async" or tl is None:
        return set()
    cadence = slot.policy.cadence
    newest = max(tl.committed, default=-1)
    held = tl.newest_held()
    last = (held.step, held.time) if held is not None else None
    out: set[int] = set()
    for vid, info in catalog.versions.items():
        if vid <= newest or not slot.policy.wants(info.role):
            continue
        if cadence is None or last is None or cadence.due(info.step, info.time, *last):
            out.add(vid)
            last = (info.step, info.time)
    return out


def vanished_tiers(store: StoreView[Version], catalog: Catalog) -> dict[str, str]:
    """The persistent tiers of ``store`` that hold nothing of it any more, by name, with
    why: open, yet without an owner record or a log record. Every writable open records
    the store in each tier it reaches, so such a tier lost all the store wrote there (a
    wiped directory, an expired bucket prefix), as a tier that cannot be opened would.
    None for a store without an id (a tier opened by URL, an older store)."""
    if store.tierset.store_id is None:
        return {}
    out: dict[str, str] = {}
    for slot in store.tierset.open():
        tl = catalog.logs.get(slot.name)
        if slot.tier is None or tl is None or tl.records or not slot.tier.capabilities.persistent:
            continue
        try:
            if slot.tier.read_owner() is not None:
                continue
        except TierError:
            continue  # what it holds cannot be told now
        out[slot.name] = (
            f"holds nothing of this store at {without_userinfo(slot.spec.url)} (no owner "
            "record, no log record): what the store wrote there is gone (its directory or "
            "bucket prefix was deleted or expired, or the URL points elsewhere)"
        )
    return out


def _writer_holds(root: Path) -> bool:
    """Whether a process holds the writer lock of the store at ``root`` (``.lock``, or a
    rank's ``.lock.rankN``), as the kernel's table of locks says. Read, never probed:
    taking the lock even for a moment would make a writer opening then fail. The table is
    matched by inode only (an overlay file system shows another device there); where it
    cannot be read, a writer is assumed."""
    inodes: set[str] = set()
    for path in [root / ".lock", *root.glob(".lock.rank*")]:
        try:
            inodes.add(str(path.stat().st_ino))
        except OSError:
            continue
    if not inodes:
        return False
    try:
        table = Path("/proc/locks").read_text()
    except OSError:
        return True
    for line in table.splitlines():
        fields = line.split()  # "1: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE START END"
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5].rpartition(":")[2] in inodes:
            return True
    return False


def build_history(
    store: StoreView[Version],
    catalog: Catalog,
    *,
    pending: Iterable[tuple[int, str]] = (),
    pinned: Iterable[int] = (),
) -> list[Version]:
    """Every committed version of ``catalog``, oldest first, as :class:`Version` objects.

    Reads no blob. A tier shows ``migrating`` for a version when this process has its
    migration queued (``pending``, ``pinned``), or, seen from another process while a
    writer holds the store, when the tier receives such versions asynchronously, holds
    nothing newer yet (migrations run in commit order) and its cadence sends this one
    (:func:`_sent_by_cadence`), unless the tier's content vanished
    (:func:`vanished_tiers`).
    """
    pending_set = set(pending)
    pinned_set = set(pinned)
    versions = catalog.versions
    held_by: dict[str, set[int]] = {}
    for name, tl in catalog.logs.items():
        held_by[name] = set(tl.held())
    restorable = catalog.restorable_ids
    slots = store.tierset.slots
    lost = _losses(store, catalog)
    # the writer is another process, if one holds the store: its queue is not visible, the
    # tier's log and cadence are; a tier whose content vanished gets nothing it lost back
    inferred: dict[str, set[int]] = {}
    if store.read_only and _writer_holds(store.root):
        vanished = vanished_tiers(store, catalog)
        inferred = {s.name: _sent_by_cadence(s, catalog) for s in slots if s.name not in vanished}
    out: list[Version] = []
    for vid, info in versions.items():
        tiers: dict[str, TierState] = {}
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
                and (vid in pinned_set or vid in inferred.get(slot.name, ()))
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
        # another rank lost its shard: this rank's is no use to a restore
        elsewhere = lost[vid].gone if vid in lost and lost[vid].rank != store.rank else None
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
                restorable=vid in restorable and elsewhere is None,
                info=info,
                survives=best,
                rank=store.rank,
                _store=store,
                gone=elsewhere,
            )
        )
    out += [_lost_row(store, a, slots) for vid, a in lost.items() if vid not in versions]
    return sorted(out, key=lambda v: v.id)


def _losses(
    store: StoreView[Version] | None, catalog: Catalog | None = None
) -> dict[int, ListedLoss]:
    """The acknowledged versions history lists as lost, by id
    (:func:`tiercheck.restore.losses.listed_losses`), or, without ``catalog``, all those
    the ack ledgers record as lost (``recorded_losses``); none for a store without a root."""
    from tiercheck.restore.losses import listed_losses, recorded_losses

    root = getattr(store, "root", None)
    if store is None or root is None:
        return {}
    if catalog is None:
        return recorded_losses(root, store.rank, store.tierset.store_id)
    shared = [
        s.name for s in store.tierset.slots if s.tier is not None and s.tier.capabilities.shared
    ]
    return listed_losses(root, store.rank, store.tierset.store_id, catalog, shared)


def _lost_row(store: StoreView[Version], a: ListedLoss, slots: Sequence[TierSlot]) -> Version:
    """The history row of a version lost that no tier here names: its id, step, role and
    time, from the ack ledger."""
    role: Role = a.role if a.role in ("base", "diff", "log") else "base"  # type: ignore[assignment]
    info = VersionInfo(a.id, a.step, role, None, 1, (), a.time, 0)
    tiers: dict[str, TierState] = {s.name: "missing" for s in slots}
    return Version(
        id=a.id,
        step=a.step,
        role=role,
        base=None,
        time=a.time,
        metadata={},
        logical_bytes=0,
        stored_bytes=0,
        tiers=tiers,
        restorable=False,
        info=info,
        rank=store.rank,
        _store=store,
        gone=a.gone,
    )


def dropped_summary(versions: Sequence[Version], catalog: Catalog) -> str | None:
    """One line for the versions ``versions`` does not list (ids below the newest listed
    that no log read here names, aborted ones aside: retention dropped them, or, in a tier
    opened by URL, they were never placed there, or an ack ledger records them lost);
    None if none."""
    if not versions:
        return None
    listed = {v.id for v in versions}
    aborted = set().union(*(tl.aborted for tl in catalog.logs.values()))
    newest = max(listed)
    missing = [i for i in range(newest) if i not in listed and i not in aborted]
    lost = _losses(versions[0]._store) if missing else {}
    gone = [i for i in missing if i in lost]
    missing = [i for i in missing if i not in lost]
    out = []
    if missing:
        out.append(
            f"{len(missing)} older version(s) not listed (ids {_ranges(missing)}): no tier "
            "read here holds them (retention dropped them, or they were never placed there)"
        )
    if gone:  # no longer listed as lost: the store keeps no version as old (losses.py)
        why = "; ".join(dict.fromkeys(lost[i].gone for i in gone))
        out.append(f"{len(gone)} older version(s) not listed (ids {_ranges(gone)}) {why}")
    return "; ".join(out) or None


def _ranges(ids: Sequence[int]) -> str:
    out: list[str] = []
    start = prev = ids[0]
    for i in [*ids[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(out)


def parse_version_spec(spec: int | str) -> tuple[str, int | None]:
    """``17`` / ``"17"`` / ``"version:17"`` (as DCP's ``checkpoint_id`` names one) ->
    ``("id", 17)``; ``"step:N"`` -> ``("step", N)``; ``"latest"`` -> ``("latest", None)``.
    Raises ``ValueError`` otherwise."""
    if isinstance(spec, bool) or not isinstance(spec, (int, str)):
        raise ValueError(f"not a version: {spec!r} (expected an id, 'latest' or 'step:N')")
    if isinstance(spec, int):
        if spec < 0:
            raise ValueError(f"not a version: {spec!r} (ids count from 0)")
        return "id", spec
    text = spec.strip().lower()
    if text == "latest":
        return "latest", None
    if text.startswith("step:"):
        num = text[5:]
        if num.isdigit():
            return "step", int(num)
    elif text.removeprefix("version:").isdigit():
        return "id", int(text.removeprefix("version:"))
    raise ValueError(f"not a version: {spec!r} (expected an id, 'latest' or 'step:N')")


def resolve_version(
    versions: Sequence[Version],
    spec: int | str | None = None,
    *,
    step: int | None = None,
    rank: int | None = None,
) -> Version:
    """Pick the version ``spec`` names (see :func:`_resolve`), for ``rank`` (None: the
    rows' own). Raises :class:`NoRestorableVersion` when there is no such version, or
    when it was lost and no tier here holds it (its row says with which tier)."""
    v = _resolve(versions, spec, step=step)
    if v.gone is not None and not v.holders:
        raise NoRestorableVersion(
            f"version {v.id} (step {v.step}) was acknowledged, then {v.gone}: no tier holds "
            "it; `tiercheck ls` shows the versions that can be restored"
        )
    return _for_rank(v, rank)


def _resolve(
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
        return (restorable or [v for v in versions if v.gone is None] or list(versions))[-1]
    ids = [v.id for v in versions]
    listed = (
        f"the store lists {len(ids)} version(s), ids {ids[0]}..{ids[-1]}; "
        "`tiercheck ls` shows which are restorable"
    )
    if kind == "step":
        assert num is not None
        matches = [v for v in versions if v.step == num]
        if not matches:
            lost = [a for a in _losses(versions[0]._store).values() if a.step == num]
            raise NoRestorableVersion(
                _lost_before(lost[-1], listed) if lost else _no_step(versions, num, listed)
            )
        return matches[-1]
    for v in versions:
        if v.id == num:
            return v
    if 0 <= num < ids[-1]:  # type: ignore[operator]
        for was in _losses(versions[0]._store).values():
            if was.id == num:
                raise NoRestorableVersion(_lost_before(was, listed))
        raise NoRestorableVersion(
            f"version {num} was committed, then dropped by retention: no tier holds it ({listed})"
        )
    raise NoRestorableVersion(
        f"version {num} is not a committed version of this store "
        f"(committed: {len(ids)} version(s), ids {ids[0]}..{ids[-1]})"
    )


def _lost_before(lost: ListedLoss, listed: str) -> str:
    return (
        f"version {lost.id} (step {lost.step}) was acknowledged, then {lost.gone}: no tier "
        f"holds it, and the store keeps no version as old any more ({listed})"
    )


def _no_step(versions: Sequence[Version], step: int, listed: str) -> str:
    """Why no version of ``versions`` has ``step``: where versions not listed were saved
    between the listed steps around it, retention dropped them, and where one id per step
    lies between those two, the dropped version is named as by its id."""
    below = [v for v in versions if v.step < step]
    above = [v for v in versions if v.step > step]
    lo = max(below, key=lambda v: (v.step, v.id), default=None)
    hi = min(above, key=lambda v: (v.step, v.id), default=None)
    lo_id, lo_step = (lo.id, lo.step) if lo is not None else (-1, -1)
    if hi is None or hi.id <= lo_id + 1:
        return f"no committed version has step {step}"
    if lo is not None and hi.step - lo.step == hi.id - lo.id:  # a version at every step
        vid = lo.id + step - lo.step
        return (
            f"version {vid} (step {step}) was committed, then dropped by retention: no tier "
            f"holds it ({listed})"
        )
    since = f"after step {lo_step} (version {lo_id}) " if lo is not None else ""
    return (
        f"no listed version has step {step}: the versions saved {since}before step "
        f"{hi.step} (version {hi.id}), ids {lo_id + 1}..{hi.id - 1}, were committed, then "
        f"dropped by retention: no tier holds them ({listed})"
    )


def open_version(
    store: StoreView[Version],
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
    return resolve_version(store.history(), spec, step=step, rank=rank)


def _for_rank(v: Version, rank: int | None) -> Version:
    if rank is not None and rank != v.rank:
        if not 0 <= rank < v.info.world_size:
            raise NoRestorableVersion(
                f"version {v.id} has {v.info.world_size} shard(s); there is no rank {rank}"
            )
        v = Version(**{**_fields(v), "rank": rank})
    return v


def _fields(v: Version) -> dict[str, Any]:
    return {name: getattr(v, name) for name in Version.__dataclass_fields__}


ProblemKind = Literal["corrupt", "missing", "unreadable", "newer-format", "damaged-log"]
