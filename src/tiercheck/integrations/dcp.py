"""tiercheck under ``torch.distributed.checkpoint``: :class:`TierWriter` and :class:`TierReader`.

``dcp.save(sd, storage_writer=TierWriter(root))``, ``dcp.async_save(...)`` and
``dcp.load(sd, storage_reader=TierReader(root))`` (with resharding) run on tiercheck: every
DCP checkpoint is a tiercheck version, cut into chunks, placed on the store's tiers and
recorded in their manifest logs, so it shows in :meth:`Checkpointer.history` like any other
version, diff versions and chunk dedup included.

**checkpoint_id.** DCP passes ``checkpoint_id`` to ``reset`` (only when it is not ``None``).
It names a version of the coordinator's store (see below):

- writing: ``N`` / ``"N"`` / ``"step:N"`` save the checkpoint as step ``N``; ``None`` saves
  it as the step after the newest one in the store (``0`` in an empty store). An id applies
  to the next save only. ``"version:N"`` is refused: version ids are assigned by the store.
- reading: ``N`` / ``"N"`` / ``"step:N"`` load the newest DCP version of step ``N``;
  ``"version:N"`` loads version ``N``; ``None`` loads the newest restorable DCP version.

**Stores and ranks.** ``TierWriter(root)`` opens (creating if needed) one store per rank at
``root/rank{r}``; ``TierWriter(checkpointer)`` uses the caller's store for this rank (it must
be a one-rank store: ``coordinator=LocalCoordinator()`` under torch.distributed). Each
rank saves the items DCP assigns it as one version of its own store (a one-rank shard); the
coordinator (DCP's rank 0) saves its items *together with* the global DCP metadata, after
every rank has reported its writes (``finish``). That coordinator version is the DCP
checkpoint: it exists iff every rank's shard was committed first, and it names each rank's
version and store. A rank that dies mid-write leaves no coordinator version, so the previous
checkpoint stays the newest one. DCP's own protocol (every rank's ``write_data``, then
``finish`` on the coordinator with all their results) is thus the two-phase commit: the
per-rank versions are the prepared shards and the coordinator version is the decision. The
engine's multi-rank coordinator (:mod:`tiercheck.engine.coordinator`) is not used under DCP, so DCP
saves get no cross-rank dedup on a shared tier: each rank writes its own store.

``TierReader(root)`` reads the metadata from ``root/rank0`` and each rank's items from
``root/rank{r}``; ``TierReader(checkpointer)`` reads the metadata from that store and the other
ranks' items from the store roots recorded at save time. Other stores are opened read-only.
Reads fetch only the chunks holding the entries this rank needs (``Checkpointer.version``).

**Metadata without pickle.** DCP's :class:`~torch.distributed.checkpoint.metadata.Metadata`
is encoded field by field into plain msgpack (:func:`encode_metadata`) and decoded back the
same way (:func:`decode_metadata`), which refuses anything it does not know. Loading never
unpickles anything from the store on tiercheck's side.

**Byte items without pickle.** Non-tensor values are DCP ``BytesIO`` items: ``torch.save``
payloads, which DCP's default load planner deserializes with ``torch.load(weights_only=
False)``, i.e. full pickle: whoever can write a tier could run code in the loading process.
:class:`TierReader` therefore decodes each one first with ``torch.load(weights_only=True)``
(PyTorch's restricted unpickler: tensors, numbers, strings, containers, and the globals
registered with ``torch.serialization.add_safe_globals``), refuses a payload that needs
anything else with :class:`~tiercheck.errors.UnsupportedValue`, and hands the planner a
fresh ``torch.save`` of the decoded value. ``TierReader(..., allow_pickle=True)`` passes
the stored bytes through as before: only for checkpoints you trust.

**async_save.** The thread executor works with any writer. The process executor pickles the
writer into a daemon process: give it a root path (a :class:`Checkpointer` cannot be sent),
and do not hold that store open for writing in the trainer. The copy there opens the store for
each save and closes it after, so every such version is a base (the engine keeps the diff
base in memory only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from urllib.parse import quote

import msgpack
import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from tiercheck.checkpointer import Checkpointer
from tiercheck.core.entries import torch_dtype
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
from tiercheck.store.config import TierSpec
from tiercheck.store.policy import Policy

__all__ = [
    "CheckpointRef",
    "Location",
    "TierReader",
    "TierWriter",
    "decode_metadata",
    "encode_metadata",
    "load_full_state_dict",
    "parse_checkpoint_id",
    "rank_root",
    "rank_stores",
]

METADATA_FORMAT = "tiercheck-dcp"
METADATA_VERSION = 1
ITEMS = "dcp_items"
"""Top-level key of a DCP shard's items in the saved state (``dcp_items/<item key>``)."""
METADATA = "dcp_metadata"
"""Top-level key of the encoded DCP metadata in the coordinator's version."""

TiersArg = (
    Sequence[str | TierSpec | tuple[str, str]]
    | Callable[[Path], Sequence[str | TierSpec | tuple[str, str]]]
    | None
)


# --- checkpoint ids --------------------------------------------------------------------

_ID = re.compile(r"^(?:(step|version):)?(\d+)$")


@dataclass(frozen=True)
class CheckpointRef:
    """What a DCP ``checkpoint_id`` names: a ``step``, a ``version`` id, or (both None) the
    next step when writing / the newest version when reading."""

    step: int | None = None
    version: int | None = None


def parse_checkpoint_id(checkpoint_id: object) -> CheckpointRef:
    """Parse ``None``, ``N``, ``"N"``, ``"step:N"`` or ``"version:N"``; raise ConfigError."""
    if checkpoint_id is None:
        return CheckpointRef()
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        if checkpoint_id < 0:
            raise ConfigError(f"checkpoint_id must be a non-negative step, got {checkpoint_id}")
        return CheckpointRef(step=checkpoint_id)
    if isinstance(checkpoint_id, str):
        m = _ID.match(checkpoint_id.strip())
        if m is not None:
            n = int(m.group(2))
            return CheckpointRef(version=n) if m.group(1) == "version" else CheckpointRef(step=n)
    raise ConfigError(
        f"checkpoint_id {checkpoint_id!r} is not understood by tiercheck; use a step "
        "(N, 'N' or 'step:N'), 'version:N' (reading only) or None"
    )


def _valid_id(checkpoint_id: object) -> bool:
    try:
        parse_checkpoint_id(checkpoint_id)
    except ConfigError:
        return False
    return True


def rank_root(root: str | os.PathLike[str], rank: int) -> Path:
    """The store root of ``rank`` under a DCP root: ``root/rank{rank}``."""
    return Path(root).expanduser().resolve() / f"rank{rank}"


# --- item keys and locations ------------------------------------------------------------


def item_key(index: MetadataIndex) -> str:
    """A stable entry key for a DCP item: the escaped fqn, ``@``, and its chunk offsets.

    The fqn is percent-escaped so that ``/`` (tiercheck's path separator) cannot occur.
    """
    offsets = "" if index.offset is None else "_".join(str(int(o)) for o in index.offset)
    return f"{quote(index.fqn, safe='')}@{offsets}"


@dataclass(frozen=True)
class Location:
    """Where one DCP item is stored: ``rank``'s store, its ``version`` (None: the version
    holding the metadata), entry ``key`` under :data:`ITEMS`, and its byte length."""

    rank: int
    version: int | None
    key: str
    nbytes: int


# --- metadata encoding ------------------------------------------------------------------

_MEMORY_FORMATS: dict[str, torch.memory_format] = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d,
    "preserve_format": torch.preserve_format,
}
_LAYOUTS: dict[str, torch.layout] = {"strided": torch.strided}


def _bad(what: str) -> StateError:
    return StateError(f"DCP metadata in the store is malformed or unsupported: {what}")


def _name_of(value: Any, table: Mapping[str, Any], what: str) -> str:
    for name, v in table.items():
        if v == value:
            return name
    raise UnsupportedValue(f"cannot encode {what} {value!r} in DCP metadata")


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise _bad(f"{what} must be a list of ints, got {value!r}")
    return [int(v) for v in value]


def _str(value: Any, what: str, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise _bad(f"{what} must be a string, got {type(value).__qualname__}")
    return value


def _int(value: Any, what: str, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(f"{what} must be an int, got {value!r}")
    return value


def _map(
    value: Any, keys: set[str], what: str, *, required: set[str] | None = None
) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad(f"{what} must be a map, got {type(value).__qualname__}")
    extra = set(value) - keys
    if extra:
        raise _bad(f"{what} has unknown fields {sorted(map(str, extra))}")
    missing = (required if required is not None else keys) - set(value)
    if missing:
        raise _bad(f"{what} lacks fields {sorted(missing)}")
    return value


def _encode_storage_md(md: Any, fqn: str) -> dict[str, Any]:
    if isinstance(md, BytesStorageMetadata):
        return {"t": "bytes"}
    if isinstance(md, TensorStorageMetadata):
        p = md.properties
        if type(p) is not TensorProperties:
            raise UnsupportedValue(f"unknown tensor properties {type(p).__qualname__}", key=fqn)
        return {
            "t": "tensor",
            "dtype": str(p.dtype).removeprefix("torch."),
            "layout": _name_of(p.layout, _LAYOUTS, "layout"),
            "requires_grad": bool(p.requires_grad),
            "memory_format": _name_of(p.memory_format, _MEMORY_FORMATS, "memory format"),
            "pin_memory": bool(p.pin_memory),
            "size": [int(s) for s in md.size],
            "chunks": [[[int(o) for o in c.offsets], [int(s) for s in c.sizes]] for c in md.chunks],
        }
    raise UnsupportedValue(
        f"DCP storage metadata of type {type(md).__qualname__} is not supported", key=fqn
    )


def _decode_storage_md(obj: Any, fqn: str) -> TensorStorageMetadata | BytesStorageMetadata:
    if not isinstance(obj, dict) or "t" not in obj:
        raise _bad(f"entry {fqn!r} has no type")
    if obj["t"] == "bytes":
        _map(obj, {"t"}, f"entry {fqn!r}")
        return BytesStorageMetadata()
    if obj["t"] != "tensor":
        raise _bad(f"entry {fqn!r} has unknown type {obj['t']!r}")
    fields = {"t", "dtype", "layout", "requires_grad", "memory_format", "pin_memory", "size"}
    _map(obj, fields | {"chunks"}, f"entry {fqn!r}")
    dtype_name = _str(obj["dtype"], "dtype")
    assert dtype_name is not None
    layout = _LAYOUTS.get(cast(str, _str(obj["layout"], "layout")))
    memory_format = _MEMORY_FORMATS.get(cast(str, _str(obj["memory_format"], "memory format")))
    if layout is None or memory_format is None:
        raise _bad(f"entry {fqn!r} has an unknown layout or memory format")
    if not isinstance(obj["requires_grad"], bool) or not isinstance(obj["pin_memory"], bool):
        raise _bad(f"entry {fqn!r}: requires_grad and pin_memory must be bools")
    chunks_obj = obj["chunks"]
    if not isinstance(chunks_obj, list):
        raise _bad(f"entry {fqn!r}: chunks must be a list")
    chunks = []
    for c in chunks_obj:
        if not isinstance(c, list) or len(c) != 2:
            raise _bad(f"entry {fqn!r}: a chunk must be [offsets, sizes]")
        chunks.append(
            ChunkStorageMetadata(
                offsets=torch.Size(_ints(c[0], "chunk offsets")),
                sizes=torch.Size(_ints(c[1], "chunk sizes")),
            )
        )
    try:
        dtype = torch_dtype(dtype_name)
    except StateError as exc:
        raise _bad(str(exc)) from None
    return TensorStorageMetadata(
        properties=TensorProperties(
            dtype=dtype,
            layout=layout,
            requires_grad=obj["requires_grad"],
            memory_format=memory_format,
            pin_memory=obj["pin_memory"],
        ),
        size=torch.Size(_ints(obj["size"], "size")),
        chunks=chunks,
    )


def _encode_planner_data(data: Any) -> Any:
    # DefaultSavePlanner's planner_data: flattened fqn -> path in the original state dict.
    if data is None:
        return None
    if isinstance(data, dict) and all(
        isinstance(k, str)
        and isinstance(v, (tuple, list))
        and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in v)
        for k, v in data.items()
    ):
        return [[k, list(v)] for k, v in data.items()]
    raise UnsupportedValue(
        "the planner's planner_data is not the default planner's fqn -> path mapping; "
        "tiercheck stores DCP metadata without pickle and cannot encode it"
    )


def _decode_planner_data(obj: Any) -> Any:
    if obj is None:
        return None
    if not isinstance(obj, list):
        raise _bad("planner_data must be a list")
    out: dict[str, tuple[str | int, ...]] = {}
    for pair in obj:
        if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], str):
            raise _bad("planner_data entries must be [fqn, path]")
        path = pair[1]
        if not isinstance(path, list) or not all(
            isinstance(p, (str, int)) and not isinstance(p, bool) for p in path
        ):
            raise _bad(f"planner_data path of {pair[0]!r} must be a list of str/int")
        out[pair[0]] = tuple(path)
    return out


def _encode_storage_meta(sm: StorageMeta | None) -> Any:
    if sm is None:
        return None
    cid = sm.checkpoint_id
    return {
        "checkpoint_id": None if cid is None else os.fspath(cid),
        "save_id": sm.save_id,
        "load_id": sm.load_id,
        "modules": [str(m) for m in sm.modules],
    }


def _decode_storage_meta(obj: Any) -> StorageMeta | None:
    if obj is None:
        return None
    m = _map(obj, {"checkpoint_id", "save_id", "load_id", "modules"}, "storage_meta")
    modules = m["modules"]
    if not isinstance(modules, list) or not all(isinstance(x, str) for x in modules):
        raise _bad("storage_meta.modules must be a list of strings")
    return StorageMeta(
        checkpoint_id=_str(m["checkpoint_id"], "checkpoint_id", optional=True),
        save_id=_str(m["save_id"], "save_id", optional=True),
        load_id=_str(m["load_id"], "load_id", optional=True),
        modules=list(modules),
    )


def encode_metadata(
    metadata: Metadata, *, ranks: Mapping[int, tuple[int | None, str]] | None = None
) -> bytes:
    """Encode DCP ``metadata`` (whose ``storage_data`` maps MetadataIndex -> :class:`Location`)
    as plain msgpack, field by field. ``ranks`` maps each rank to ``(version, store root)``.

    Raises :class:`UnsupportedValue` for anything it does not know how to encode.
    """
    sdm = [[fqn, _encode_storage_md(md, fqn)] for fqn, md in metadata.state_dict_metadata.items()]
    storage: list[list[Any]] = []
    sd = metadata.storage_data
    if not isinstance(sd, dict):
        raise UnsupportedValue("DCP storage_data must map MetadataIndex to tiercheck locations")
    for index, loc in sd.items():
        if not isinstance(index, MetadataIndex) or not isinstance(loc, Location):
            raise UnsupportedValue(
                f"DCP storage_data holds {type(index).__qualname__} -> "
                f"{type(loc).__qualname__}; expected MetadataIndex -> Location"
            )
        offset = None if index.offset is None else [int(o) for o in index.offset]
        storage.append([index.fqn, offset, loc.rank, loc.key, loc.nbytes])
    obj = {
        "format": METADATA_FORMAT,
        "v": METADATA_VERSION,
        "state_dict_metadata": sdm,
        "planner_data": _encode_planner_data(metadata.planner_data),
        "storage_data": storage,
        "storage_meta": _encode_storage_meta(metadata.storage_meta),
        "version": metadata.version,
        "ranks": [
            [r, v, root] for r, (v, root) in sorted((ranks or {}).items(), key=lambda x: x[0])
        ],
    }
    try:
        out: bytes = msgpack.packb(obj, use_bin_type=True, strict_types=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise UnsupportedValue(f"DCP metadata cannot be encoded: {exc}") from None
    return out


@dataclass(frozen=True)
class DecodedMetadata:
    """What :func:`decode_metadata` returns: DCP's metadata and each rank's (version, root)."""

    metadata: Metadata
    ranks: Mapping[int, tuple[int | None, str]]


def decode_metadata(data: bytes | memoryview) -> DecodedMetadata:
    """Decode bytes written by :func:`encode_metadata`; never unpickles.

    Raises :class:`StateError` for anything that is not exactly that encoding (a pickle
    stream, unknown fields or types, a newer format version).
    """
    try:
        obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:
        raise _bad(f"not msgpack ({type(exc).__name__}: {exc})") from None
    keys = {
        "format",
        "v",
        "state_dict_metadata",
        "planner_data",
        "storage_data",
        "storage_meta",
        "version",
        "ranks",
    }
    m = _map(obj, keys, "metadata")
    if m["format"] != METADATA_FORMAT:
        raise _bad(f"format is {m['format']!r}, expected {METADATA_FORMAT!r}")
    if m["v"] != METADATA_VERSION:
        raise _bad(f"encoding version {m['v']!r} is not supported (this reader knows 1)")
    sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    if not isinstance(m["state_dict_metadata"], list):
        raise _bad("state_dict_metadata must be a list")
    for pair in m["state_dict_metadata"]:
        if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], str):
            raise _bad("state_dict_metadata entries must be [fqn, metadata]")
        sdm[pair[0]] = _decode_storage_md(pair[1], pair[0])
    storage: dict[MetadataIndex, Location] = {}
    if not isinstance(m["storage_data"], list):
        raise _bad("storage_data must be a list")
    for row in m["storage_data"]:
        if not isinstance(row, list) or len(row) != 5:
            raise _bad("storage_data rows must be [fqn, offset, rank, key, nbytes]")
        fqn, offset, rank, key, nbytes = row
        index = MetadataIndex(
            cast(str, _str(fqn, "fqn")), None if offset is None else _ints(offset, "offset")
        )
        storage[index] = Location(
            cast(int, _int(rank, "rank")),
            None,
            cast(str, _str(key, "key")),
            cast(int, _int(nbytes, "nbytes")),
        )
    ranks: dict[int, tuple[int | None, str]] = {}
    if not isinstance(m["ranks"], list):
        raise _bad("ranks must be a list")
    for row in m["ranks"]:
        if not isinstance(row, list) or len(row) != 3:
            raise _bad("ranks rows must be [rank, version, root]")
        r = cast(int, _int(row[0], "rank"))
        ranks[r] = (_int(row[1], "version", optional=True), cast(str, _str(row[2], "root")))
    storage = {
        i: dataclasses.replace(loc, version=ranks.get(loc.rank, (None, ""))[0])
        for i, loc in storage.items()
    }
    md = Metadata(
        state_dict_metadata=cast(Any, sdm),
        planner_data=_decode_planner_data(m["planner_data"]),
        storage_data=storage,
        storage_meta=_decode_storage_meta(m["storage_meta"]),
        version=_str(m["version"], "version", optional=True),
    )
    return DecodedMetadata(md, ranks)


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


def _find_version(ckpt: Checkpointer, ref: CheckpointRef) -> VersionInfo:
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
    return match[-1]


# --- the writer -------------------------------------------------------------------------


def _dist_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


@dataclass(frozen=True)
class _PlanInfo:
    """What the writer attaches to each rank's SavePlan (``SavePlan.storage_data``)."""

    rank: int
    root: str
    step: int | None = None


class TierWriter(StorageWriter):
    """A DCP :class:`StorageWriter` that saves each checkpoint as a tiercheck version.

    ``target`` is a root directory (rank ``r`` uses the store ``root/rank{r}``, created with
    ``tiers``/``policy`` if new; ``tiers`` may be a function of that store root) or an open
    :class:`Checkpointer` for this rank. ``checkpoint_id`` is as described in the module
    docstring. Reuse one writer across saves: the store stays open, so unchanged chunks are
    deduplicated and most versions are diffs. ``close()`` closes a store it opened.
    """

    def __init__(
        self,
        target: Checkpointer | str | os.PathLike[str],
        *,
        tiers: TiersArg = None,
        policy: Policy | None = None,
        checkpoint_id: str | int | None = None,
    ) -> None:
        super().__init__()
        self._root: Path | None = None
        self._ckpt: Checkpointer | None = None
        self._owned = False
        self._ephemeral = False
        if isinstance(target, Checkpointer):
            self._ckpt = target
        else:
            self._root = Path(target).expanduser().resolve()
        self._tiers = tiers
        self._policy = policy
        self._ref = parse_checkpoint_id(checkpoint_id)
        self.checkpoint_id: str | int | None = checkpoint_id
        self._lock = threading.Lock()
        self._rank = 0
        self._is_coordinator = True
        self._step: int | None = None
        self._ranks: dict[int, str] = {}
        self._pending: dict[str, Any] | None = None
        # the version id of the last checkpoint this writer committed as DCP's coordinator
        self.last_version: int | None = None

    # pickling (the process executor of dcp.async_save sends the writer to another process)
    def __getstate__(self) -> dict[str, Any]:
        if self._root is None:
            raise CheckpointError(
                "a TierWriter built on a Checkpointer cannot be sent to another process; "
                "build it from the store root to use async_save's process executor"
            )
        if callable(self._tiers):
            raise CheckpointError(
                "a TierWriter with a tiers function cannot be sent to another process; "
                "create the stores first (their tiercheck.toml is then reused)"
            )
        state = dict(self.__dict__)
        state["_ckpt"] = None
        state["_owned"] = False
        state["_ephemeral"] = True
        state["_lock"] = None
        state["_pending"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def checkpointer(self) -> Checkpointer | None:
        """This rank's store, once ``set_up_storage_writer`` opened it."""
        return self._ckpt

    def close(self) -> None:
        """Close this rank's store if the writer opened it (waiting for its saves)."""
        if self._owned and self._ckpt is not None:
            self._ckpt.close()
            self._ckpt = None
            self._owned = False

    def __enter__(self) -> TierWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self, rank: int) -> Checkpointer:
        if self._ckpt is not None:
            return self._ckpt
        assert self._root is not None
        root = rank_root(self._root, rank)
        tiers = self._tiers(root) if callable(self._tiers) else self._tiers
        if tiers is not None and (root / "tiercheck.toml").exists():
            tiers = None  # an existing store keeps its configuration
        root.mkdir(parents=True, exist_ok=True)
        # a one-rank store: DCP's own collectives order the ranks (see the module docstring)
        self._ckpt = Checkpointer(
            root, tiers=tiers, policy=self._policy, coordinator=LocalCoordinator()
        )
        self._owned = True
        return self._ckpt

    def _end(self) -> None:
        self._pending = None
        self._ref = CheckpointRef()
        self.checkpoint_id = None
        self._step = None
        if self._ephemeral:
            self.close()

    # --- StorageWriter ------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if isinstance(checkpoint_id, os.PathLike):
            raise ConfigError(
                f"checkpoint_id {os.fspath(checkpoint_id)!r} is a path; tiercheck names "
                "checkpoints by step ('step:N') - pass the root to TierWriter instead"
            )
        self._ref = parse_checkpoint_id(checkpoint_id)
        if self._ref.version is not None:
            raise ConfigError(
                "a checkpoint cannot be saved as 'version:N': the store assigns version ids; "
                "name it by step ('step:N')"
            )
        self.checkpoint_id = checkpoint_id

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ConfigError(
                "TierWriter needs DCP's collectives (use_collectives=True): the coordinator "
                "records every rank's shard in one checkpoint"
            )
        rank = kwargs.get("rank")
        self._rank = int(rank) if isinstance(rank, int) else _dist_rank()
        self._is_coordinator = is_coordinator
        self._pending = None
        self._open(self._rank)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        ckpt = self._open(self._rank)
        return dataclasses.replace(plan, storage_data=_PlanInfo(self._rank, str(ckpt.root)))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        ckpt = self._open(self._rank)
        if self._ref.step is not None:
            step = self._ref.step
        else:
            steps = [i.step for i in ckpt.refresh().versions.values()]
            step = max(steps) + 1 if steps else 0
        out = []
        self._ranks = {}
        for i, plan in enumerate(plans):
            info = plan.storage_data
            if not isinstance(info, _PlanInfo):
                raise CheckpointError(
                    f"rank {i}'s save plan carries no TierWriter data; every rank must "
                    "save with a TierWriter"
                )
            self._ranks[info.rank] = info.root
            out.append(dataclasses.replace(plan, storage_data=dataclasses.replace(info, step=step)))
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info = plan.storage_data
        if not isinstance(info, _PlanInfo) or info.step is None:
            raise CheckpointError("write_data got a plan that prepare_global_plan did not see")
        ckpt = self._open(self._rank)
        items: dict[str, Any] = {}
        results: list[WriteResult] = []
        for item in sorted(plan.items, key=lambda it: item_key(it.index)):
            key, value, nbytes = self._resolve(item, planner)
            items[key] = value
            results.append(WriteResult(item.index, nbytes, Location(self._rank, None, key, nbytes)))
        if self._is_coordinator:
            # saved in finish(), together with the metadata: that version is the checkpoint
            self._pending = items
            self._step = info.step
            return _done(results)
        try:
            version = None
            if items:
                handle = ckpt.save(info.step, {ITEMS: items}, metadata={"dcp": self._mark(False)})
                version = handle.wait().version
        except BaseException:
            self._end()
            raise
        self._end()
        return _done(
            [
                dataclasses.replace(
                    r, storage_data=dataclasses.replace(r.storage_data, version=version)
                )
                for r in results
            ]
        )

    def _mark(self, coordinator: bool) -> dict[str, Any]:
        return {"format": METADATA_VERSION, "rank": self._rank, "coordinator": coordinator}

    @staticmethod
    def _resolve(item: WriteItem, planner: SavePlanner) -> tuple[str, Any, int]:
        key = item_key(item.index)
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            if not isinstance(data, io.BytesIO):
                raise UnsupportedValue(
                    f"DCP resolved a BYTE_IO item to {type(data).__qualname__}", key=item.index.fqn
                )
            raw = data.getvalue()
            return key, raw, len(raw)
        if not isinstance(data, torch.Tensor):
            raise UnsupportedValue(
                f"DCP resolved a tensor item to {type(data).__qualname__}", key=item.index.fqn
            )
        t = data.detach()
        if type(t) is not torch.Tensor:
            raise UnsupportedValue(
                f"DCP resolved a tensor item to a {type(t).__qualname__}; the planner must "
                "resolve to plain (local) tensors",
                key=item.index.fqn,
            )
        return key, t, t.numel() * t.element_size()

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            ckpt = self._open(self._rank)
            storage: dict[MetadataIndex, Location] = {}
            versions: dict[int, int | None] = {}
            for rank_results in results:
                for wr in rank_results:
                    loc = wr.storage_data
                    if not isinstance(loc, Location):
                        raise CheckpointError(
                            f"a rank reported a write of {wr.index} without a location"
                        )
                    storage[wr.index] = loc
                    if loc.rank != self._rank:
                        versions[loc.rank] = loc.version
            metadata.storage_data = storage
            ranks = {r: (versions.get(r), root) for r, root in self._ranks.items()}
            if self._rank not in ranks:
                ranks[self._rank] = (None, str(ckpt.root))
            encoded = encode_metadata(metadata, ranks=ranks)
            if self._step is None or self._pending is None:
                raise CheckpointError("finish was called before this coordinator's write_data")
            state: dict[str, Any] = {METADATA: encoded}
            if self._pending:
                state[ITEMS] = self._pending
            handle = ckpt.save(self._step, state, metadata={"dcp": self._mark(True)})
            handle.wait()
            self.last_version = handle.version
        finally:
            self._end()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return not isinstance(checkpoint_id, os.PathLike) and _valid_id(checkpoint_id)

    def storage_meta(self) -> StorageMeta | None:
        cid = None if self.checkpoint_id is None else str(self.checkpoint_id)
        return StorageMeta(checkpoint_id=cid, save_id=uuid.uuid4().hex)


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

    def _store(self, rank: int) -> tuple[Checkpointer, bool]:
        """Rank ``rank``'s store and whether this reader opened it (and must close it)."""
        if self._root is not None:
            root = rank_root(self._root, rank)
        else:
            assert self._given is not None
            if rank == self._coordinator_rank:
                return self._given, False
            recorded = self._ranks.get(rank)
            if recorded is None:
                raise NoRestorableVersion(f"the checkpoint records no store for rank {rank}")
            root = Path(recorded[1])
        if not (root / "tiercheck.toml").exists():
            raise NoRestorableVersion(f"no tiercheck store for rank {rank} at {root}")
        return Checkpointer(root, read_only=True, coordinator=LocalCoordinator()), True

    @contextlib.contextmanager
    def _opened(self, rank: int) -> Iterator[Checkpointer]:
        ckpt, owned = self._store(rank)
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
        with self._opened(self._coordinator_rank) as ckpt:
            info = _find_version(ckpt, self._ref)
            v = ckpt.version(info.id)
            entry = v.entries.get(METADATA)
            if entry is None:
                raise _bad(f"version {info.id} of {ckpt.root} has no {METADATA!r} entry")
            if entry.kind != "msgpack":
                # checked before reading: a store opened with allow_pickle would unpickle it
                raise _bad(f"the metadata entry is stored as {entry.kind!r}, not msgpack")
            blob = v[METADATA]
        if not isinstance(blob, bytes):
            raise _bad("the metadata entry does not hold bytes")
        decoded = decode_metadata(blob)
        self._info = info
        self._ranks = decoded.ranks
        md = decoded.metadata
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = uuid.uuid4().hex
        return md

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
            if entry.kind != "msgpack" or not isinstance(value, bytes):
                raise _bad(f"item {entry.key!r} does not hold msgpack bytes")
            payload = value if self.allow_pickle else _without_pickle(value, reqs[0])
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
        raise UnsupportedValue(
            f"DCP byte item needs pickle beyond torch's weights_only loader ({why}); refused. "
            "Load with TierReader(..., allow_pickle=True) only if you trust whoever could "
            "write this store, or register the type with torch.serialization.add_safe_globals",
            key=req.dest_index.fqn,
        ) from None
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# --- a DCP root as a whole ----------------------------------------------------------------


def rank_stores(root: str | os.PathLike[str]) -> list[Path]:
    """The per-rank stores ``root/rank{r}`` of a DCP root, in rank order (empty if ``root``
    is not one). Raises NoRestorableVersion if the ranks are not ``0..n-1``."""
    base = Path(root).expanduser()
    found: dict[int, Path] = {}
    if base.is_dir():
        for child in base.iterdir():
            m = re.fullmatch(r"rank(\d+)", child.name)
            if m and (child / "tiercheck.toml").is_file():
                found[int(m.group(1))] = child
    if found and sorted(found) != list(range(len(found))):
        raise NoRestorableVersion(
            f"{base} holds stores for ranks {sorted(found)}; a DCP root has rank0..rank(n-1)"
        )
    return [found[r] for r in sorted(found)]


def load_full_state_dict(
    source: str | os.PathLike[str] | TierReader, *, checkpoint_id: str | int | None = None
) -> dict[str, Any]:
    """The whole DCP checkpoint under ``source`` (a root, or a :class:`TierReader`, whose
    ``version`` then tells which one was read) as one plain state dict, in this process.

    Every tensor is assembled from the shards of every rank (as ``dcp.load`` with an empty
    state would build it); keys are the ones given to ``dcp.save``, nested as they were, so
    ``model.load_state_dict(sd["model"])`` works. Non-tensor values come back as DCP saved
    them. Needs the memory of the whole state.
    """
    # what torch's own dcp_to_torch_save does: the public load() only fills keys the
    # caller's dict already has, and an empty dict has none
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict as dcp_load

    reader = (
        source
        if isinstance(source, TierReader)
        else TierReader(source, checkpoint_id=checkpoint_id)
    )
    sd: dict[str, Any] = {}
    dcp_load(
        sd,
        storage_reader=reader,
        planner=_EmptyStateDictLoadPlanner(),  # type: ignore[no-untyped-call]
        no_dist=True,
    )
    return sd
