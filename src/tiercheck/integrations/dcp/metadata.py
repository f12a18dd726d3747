"""DCP's metadata encoded field by field as plain msgpack, and decoded back without pickle."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import msgpack
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from tiercheck.core.entries import torch_dtype
from tiercheck.errors import (
    StateError,
    UnsupportedValue,
)
from tiercheck.integrations.dcp.ids import METADATA_FORMAT, METADATA_VERSION, Location

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
