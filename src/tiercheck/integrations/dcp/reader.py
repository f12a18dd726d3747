"""TierReader: DCP's StorageReader on tiercheck (see the package docstring)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tiercheck.checkpointer import Checkpointer
from tiercheck.engine.coordinator import LocalCoordinator
from tiercheck.errors import (
    CheckpointError,
    ConfigError,
    NoRestorableVersion,
    StateError,
    UnsupportedValue,
)
from tiercheck.formats.manifest import VersionInfo
from tiercheck.history.versions import EntryInfo, Version
from tiercheck.integrations.dcp.ids import (
    ITEMS,
    METADATA,
    CheckpointRef,
    Location,
    _done,
    _valid_id,
    entry_bytes,
    parse_checkpoint_id,
    rank_root,
)
from tiercheck.integrations.dcp.metadata import DecodedMetadata, _bad, decode_metadata
from tiercheck.store.catalog import Catalog

log = logging.getLogger(__name__)

# --- reading entries from a version -----------------------------------------------------


def _dcp_versions(ckpt: Checkpointer, *, coordinator: bool) -> list[VersionInfo]:
    catalog = ckpt.refresh()
    out = []
    for vid, info in catalog.versions.items():
        mark = info.metadata.get("dcp")
        wanted = isinstance(mark, dict) and (not coordinator or mark.get("coordinator") is True)
        if wanted and catalog.restorable(vid):
            out.append(info)
    return out


def _candidates(ckpt: Checkpointer, ref: CheckpointRef) -> list[VersionInfo]:
    """The coordinator versions ``ref`` names, newest first: the one named, or (``ref``
    names none) every restorable DCP checkpoint. Raises NoRestorableVersion if none."""
    found = _dcp_versions(ckpt, coordinator=True)
    if ref.version is not None:
        match = [i for i in found if i.id == ref.version]
        label = f"version {ref.version}"
    elif ref.step is not None:
        match = [i for i in found if i.step == ref.step]
        label = f"step {ref.step}"
    else:
        match = found
        label = "any DCP checkpoint"
    if not match:
        raise NoRestorableVersion(
            f"{ckpt.root} holds no restorable DCP checkpoint for {label} "
            f"(restorable DCP versions: {[i.id for i in found] or 'none'})"
        )
    return match[::-1] if ref.version is None and ref.step is None else match[-1:]


def _why_not_restorable(catalog: Catalog, vid: int) -> str:
    """Why version ``vid`` of a store cannot be restored: the first version of its chain
    (it, then its bases) that no reachable tier holds."""
    cur: int | None = vid
    while cur is not None:
        info = catalog.versions.get(cur)
        what = f"version {cur}" if cur == vid else f"version {cur} (its base)"
        if info is None:
            return f"{what} is not committed there"
        if not catalog.holders(cur):
            states = [
                f"{name}: {'dropped' if cur in tl.dropped else 'missing'}"
                for name, tl in catalog.logs.items()
            ]
            states += [f"{name}: unreachable" for name in catalog.unreachable]
            return f"no tier holds {what} ({', '.join(states)})"
        cur = info.base if info.role in ("diff", "log") else None
    return f"version {vid} is not restorable there"


# --- the reader -------------------------------------------------------------------------


class TierReader(StorageReader):
    """A DCP :class:`StorageReader` that loads a checkpoint written by :class:`TierWriter`.

    ``target`` is the root given to the writer, or the coordinator's :class:`Checkpointer`.
    Each rank fetches only the chunks holding the items its plan needs, from whichever
    rank's store saved them (opened read-only), through the store's lazy
    :meth:`Checkpointer.version` reads. ``read_budget`` bounds the bytes of entries held at
    once. Byte items are decoded without pickle unless ``allow_pickle`` (see the module
    docstring).
    """

    def __init__(
        self,
        target: Checkpointer | str | os.PathLike[str],
        *,
        checkpoint_id: str | int | None = None,
        read_budget: int = 256 * 1024 * 1024,
        allow_pickle: bool = False,
    ) -> None:
        super().__init__()
        self.allow_pickle = allow_pickle
        self._root: Path | None = None
        self._given: Checkpointer | None = None
        if isinstance(target, Checkpointer):
            self._given = target
        else:
            self._root = Path(target).expanduser().resolve()
        self._ref = parse_checkpoint_id(checkpoint_id)
        self.checkpoint_id: str | int | None = checkpoint_id
        self._budget = read_budget
        self._info: VersionInfo | None = None
        self._ranks: Mapping[int, tuple[int | None, str]] = {}
        self._storage: dict[MetadataIndex, Location] = {}
        self._coordinator_rank = 0

    @property
    def version(self) -> VersionInfo | None:
        """The coordinator version being loaded, once ``read_metadata`` found it."""
        return self._info

    def _store(
        self, rank: int, ranks: Mapping[int, tuple[int | None, str]] | None = None
    ) -> tuple[Checkpointer, bool]:
        """Rank ``rank``'s store and whether this reader opened it (and must close it).
        ``ranks``: the stores a checkpoint records (default: the one being loaded)."""
        if self._root is not None:
            root = rank_root(self._root, rank)
        else:
            assert self._given is not None
            if rank == self._coordinator_rank:
                return self._given, False
            recorded = (self._ranks if ranks is None else ranks).get(rank)
            if recorded is None:
                raise NoRestorableVersion(f"the checkpoint records no store for rank {rank}")
            root = Path(recorded[1])
        if not (root / "tiercheck.toml").exists():
            raise NoRestorableVersion(f"no tiercheck store for rank {rank} at {root}")
        return Checkpointer(root, read_only=True, coordinator=LocalCoordinator()), True

    @contextlib.contextmanager
    def _opened(
        self, rank: int, ranks: Mapping[int, tuple[int | None, str]] | None = None
    ) -> Iterator[Checkpointer]:
        ckpt, owned = self._store(rank, ranks)
        try:
            yield ckpt
        finally:
            if owned:
                ckpt.close()

    # --- StorageReader ------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if isinstance(checkpoint_id, os.PathLike):
            raise ConfigError(
                f"checkpoint_id {os.fspath(checkpoint_id)!r} is a path; tiercheck names "
                "checkpoints by step ('step:N') or version ('version:N')"
            )
        self._ref = parse_checkpoint_id(checkpoint_id)
        self.checkpoint_id = checkpoint_id

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise NoRestorableVersion("tiercheck DCP checkpoints have no rank-local metadata")
        newest = self._ref.version is None and self._ref.step is None
        skipped: list[str] = []
        seen: dict[tuple[int, str], tuple[Catalog, Path] | None] = {}
        with self._opened(self._coordinator_rank) as ckpt:
            for info in _candidates(ckpt, self._ref):
                decoded = self._decode(ckpt, info)
                why = self._unrestorable_rank(decoded.ranks, seen)
                if why is None:
                    break
                label = f"DCP checkpoint version {info.id} (step {info.step}) of {ckpt.root}"
                if not newest:
                    raise NoRestorableVersion(
                        f"{label} cannot be loaded: {why}; load an older checkpoint, or pass "
                        "no checkpoint_id to load the newest one every rank can restore"
                    )
                log.warning("%s skipped, an older one is loaded instead: %s", label, why)
                skipped.append(f"version {info.id} (step {info.step}): {why}")
            else:
                raise NoRestorableVersion(
                    f"{ckpt.root} holds no DCP checkpoint that every rank can restore: "
                    + "; ".join(skipped)
                )
        self._info = info
        self._ranks = decoded.ranks
        md = decoded.metadata
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = uuid.uuid4().hex
        return md

    @staticmethod
    def _decode(ckpt: Checkpointer, info: VersionInfo) -> DecodedMetadata:
        v = ckpt.version(info.id)
        entry = v.entries.get(METADATA)
        if entry is None:
            raise _bad(f"version {info.id} of {ckpt.root} has no {METADATA!r} entry")
        if entry.kind not in ("tensor", "msgpack"):
            # checked before reading: a store opened with allow_pickle would unpickle it
            raise _bad(f"the metadata entry is stored as {entry.kind!r}, not as bytes")
        return decode_metadata(entry_bytes(entry.kind, v[METADATA], "the metadata entry"))

    def _unrestorable_rank(
        self,
        ranks: Mapping[int, tuple[int | None, str]],
        seen: dict[tuple[int, str], tuple[Catalog, Path] | None],
    ) -> str | None:
        """Why a rank's shard of the checkpoint whose stores are ``ranks`` cannot be
        restored (None: every rank's can, or cannot be judged here). The coordinator's own
        shard is in its version, which was found restorable. ``seen``: the catalogs of the
        stores read so far; None for one with a tier this process cannot reach (another
        node's memory, a remote that is down): what it holds there is not known here, so it
        is not judged. A tier whose content is gone (``TierSlot.lost``) holds nothing."""
        for rank, (vid, recorded) in sorted(ranks.items()):
            if rank == self._coordinator_rank or vid is None:
                continue  # in the coordinator's version, or the rank wrote no items
            if (rank, recorded) not in seen:
                try:
                    with self._opened(rank, ranks) as ckpt:
                        catalog = ckpt.refresh()
                        # a tier whose content is gone (shm after a reboot) holds nothing:
                        # judged; one that cannot be reached may hold the shard
                        whole = not catalog.unreachable and all(
                            s.tier is not None or s.lost for s in ckpt.tierset.slots
                        )
                        seen[(rank, recorded)] = (catalog, ckpt.root) if whole else None
                except NoRestorableVersion as exc:
                    return f"rank {rank}: {exc}"
            known = seen[(rank, recorded)]
            if known is None:
                continue
            catalog, root = known
            if not catalog.restorable(vid):
                why = _why_not_restorable(catalog, vid)
                return f"rank {rank}'s shard, version {vid} of {root}, is lost: {why}"
        return None

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        sd = metadata.storage_data
        if not isinstance(sd, dict) or not all(isinstance(v, Location) for v in sd.values()):
            raise _bad("storage_data was not produced by TierReader.read_metadata")
        self._storage = cast(dict[MetadataIndex, Location], sd)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._info is None:
            raise CheckpointError("read_data was called before read_metadata")
        by_store: dict[tuple[int, int | None], dict[str, list[ReadItem]]] = {}
        for req in plan.items:
            loc = self._storage.get(req.storage_index)
            if loc is None:
                raise StateError(f"the checkpoint has no storage for {req.storage_index}")
            by_store.setdefault((loc.rank, loc.version), {}).setdefault(loc.key, []).append(req)
        for (rank, version), by_key in sorted(by_store.items(), key=lambda x: x[0][0]):
            with self._opened(rank) as ckpt:
                vid = self._info.id if version is None else version
                self._read_from(ckpt.version(vid), by_key, planner)
        return _done(None)

    def _read_from(
        self, v: Version, by_key: Mapping[str, list[ReadItem]], planner: LoadPlanner
    ) -> None:
        entries = v.entries
        batch: list[EntryInfo] = []
        size = 0
        for key in sorted(by_key, key=lambda k: self._entry(v, entries, k).offset):
            e = self._entry(v, entries, key)
            if batch and size + e.size > self._budget:
                self._apply_batch(v, batch, by_key, planner)
                batch, size = [], 0
            batch.append(e)
            size += e.size
        if batch:
            self._apply_batch(v, batch, by_key, planner)

    @staticmethod
    def _entry(v: Version, entries: Mapping[str, EntryInfo], key: str) -> EntryInfo:
        e = entries.get(f"{ITEMS}/{key}")
        if e is None:
            raise StateError(
                f"version {v.id} has no entry for DCP item {key!r}; "
                "the DCP metadata and the store disagree"
            )
        return e

    def _apply_batch(
        self,
        v: Version,
        batch: Sequence[EntryInfo],
        by_key: Mapping[str, list[ReadItem]],
        planner: LoadPlanner,
    ) -> None:
        for e in batch:
            # checked before reading: a store opened with allow_pickle would unpickle it
            if e.kind not in ("tensor", "msgpack"):
                raise _bad(f"item {e.key!r} is stored as {e.kind!r}")
        values = v.read([e.key for e in batch])
        for e in batch:
            self._apply(e, values[e.key], by_key[e.key.removeprefix(f"{ITEMS}/")], planner)

    def _apply(
        self, entry: EntryInfo, value: Any, reqs: Sequence[ReadItem], planner: LoadPlanner
    ) -> None:
        if reqs[0].type == LoadItemType.BYTE_IO:
            raw = entry_bytes(entry.kind, value, f"item {entry.key!r}")
            payload = raw if self.allow_pickle else _without_pickle(raw, reqs[0])
            for req in reqs:
                planner.load_bytes(req, io.BytesIO(payload))
            return
        if entry.kind != "tensor" or not isinstance(value, torch.Tensor):
            raise _bad(f"item {entry.key!r} is stored as {entry.kind!r}, not a tensor")
        tensor = value
        for req in reqs:
            src = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
            dst = planner.resolve_tensor(req).detach()
            if dst.size() != src.size():
                raise StateError(
                    f"stored chunk {tuple(src.size())} does not match the target "
                    f"{tuple(dst.size())}",
                    key=req.dest_index.fqn,
                )
            dst.copy_(src)
            planner.commit_tensor(req, dst)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return not isinstance(checkpoint_id, os.PathLike) and _valid_id(checkpoint_id)


def _without_pickle(value: bytes, req: ReadItem) -> bytes:
    """A ``torch.save`` payload the planner may ``torch.load`` with full pickle safely: the
    stored payload decoded by the restricted unpickler, saved again. ``UnsupportedValue``
    (nothing run) if it needs more than the restricted unpickler allows."""
    import pickle

    try:
        obj = torch.load(io.BytesIO(value), weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, TypeError, AttributeError) as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "Unsupported global" in ln), type(exc).__name__)
        what = re.search(r"GLOBAL ([\w.]+)", why)
        needs = f"a pickled {what.group(1).removeprefix('_io.')}" if what else "pickle"
        raise UnsupportedValue(
            f"DCP item {req.dest_index.fqn!r} holds {needs}, which torch's weights_only loader "
            f"refuses ({why}); refused, nothing unpickled. To load it, opt in with "
            "TierReader(root, allow_pickle=True), only if you trust whoever could write this "
            "store, or register its type with torch.serialization.add_safe_globals",
            key=req.dest_index.fqn,
        ) from None
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
