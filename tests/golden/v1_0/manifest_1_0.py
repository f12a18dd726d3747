# Frozen: formats/manifest.py as released with manifest schema 1.0 (tiercheck before the
# log role), kept verbatim below this comment so that tests/test_golden.py can check what a
# 1.0 reader does with data a newer writer made (SPEC.md section 12.6). Never edit it.
"""Shard-manifest and log-record schemas (format v1), encoded as msgpack.

Every encoded object is a msgpack map carrying ``"v": [major, minor]``. A reader refuses a
newer major version with :class:`~tiercheck.errors.FormatVersionError`; a newer minor
only adds optional fields, which an older reader ignores. Malformed bytes raise
:class:`~tiercheck.errors.BlobCorrupt` (for a manifest blob) or ``LogCorrupt``-style
``BlobCorrupt`` (for a log record); never anything untyped.

Chunk and manifest ids are 64-character lowercase hex strings in memory and 32 raw bytes
on the wire.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack

from tiercheck.errors import BlobCorrupt, FormatVersionError

__all__ = [
    "SCHEMA_MAJOR",
    "SCHEMA_MINOR",
    "AbortRecord",
    "ChunkRef",
    "CommitRecord",
    "DropRecord",
    "Entry",
    "LogRecord",
    "PrepareRecord",
    "ShardManifest",
    "VersionInfo",
    "pack_manifest",
    "pack_record",
    "unpack_manifest",
    "unpack_record",
]

SCHEMA_MAJOR = 1
SCHEMA_MINOR = 0

EntryKind = Literal["tensor", "ndarray", "msgpack", "pickle"]
Role = Literal["base", "diff"]


@dataclass(frozen=True)
class Entry:
    """One leaf of a flattened state: where its bytes lie in the shard's byte stream.

    ``kind`` is ``tensor`` (a torch tensor; ``dtype`` a torch dtype name such as
    ``float32`` or ``bfloat16``), ``ndarray`` (a NumPy array; ``dtype`` a NumPy dtype
    string such as ``<f4``), ``msgpack`` (a scalar or container of scalars) or ``pickle``
    (only when the writer opted in). ``offset`` and ``nbytes`` locate the bytes.
    """

    key: str
    kind: EntryKind
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ChunkRef:
    """A window ``[offset, offset + length)`` of the stream and the id of its content."""

    id: str
    offset: int
    length: int


@dataclass(frozen=True)
class ShardManifest:
    """One rank's part of a version.

    ``tree`` is the container skeleton of the state (msgpack-able, see SPEC.md): dicts,
    lists, tuples and objects with ``state_dict``, whose leaves are indices into
    ``entries``. ``stream_bytes`` is the length of the byte stream the chunks cover.
    """

    version: int
    rank: int
    world_size: int
    chunk_size: int
    stream_bytes: int
    entries: tuple[Entry, ...]
    chunks: tuple[ChunkRef, ...]
    tree: Any
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class VersionInfo:
    """A global checkpoint: what every rank's shard is and how it relates to others."""

    id: int
    step: int
    role: Role
    base: int | None
    world_size: int
    shards: tuple[str, ...]
    time: float
    logical_bytes: int
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PrepareRecord:
    """Phase one in one tier: rank ``rank``'s shard of ``version`` is durable here.

    ``deltas`` maps each chunk id this save stored as a delta blob in this tier to the id
    of the chunk it was XORed against (GC must keep those bases alive).
    """

    version: int
    rank: int
    step: int
    role: Role
    base: int | None
    manifest: str
    chunks_written: int
    bytes_written: int
    time: float
    deltas: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CommitRecord:
    """The decision: ``info.id`` is committed in this tier."""

    info: VersionInfo


@dataclass(frozen=True)
class AbortRecord:
    """The decision: ``version`` is aborted; its prepared shards are garbage."""

    version: int
    reason: str


@dataclass(frozen=True)
class DropRecord:
    """Retention (or a user) removed ``version`` from this tier; it is no longer held here."""

    version: int
    time: float


LogRecord = PrepareRecord | CommitRecord | AbortRecord | DropRecord

# --- encoding helpers ----------------------------------------------------------------


def _id_bytes(hex_id: str) -> bytes:
    return bytes.fromhex(hex_id)


def _id_hex(raw: Any, what: str) -> str:
    if not isinstance(raw, bytes) or len(raw) != 32:
        raise BlobCorrupt(f"malformed {what}: expected a 32-byte id, got {type(raw).__name__}")
    return raw.hex()


def _pack(obj: dict[str, Any]) -> bytes:
    obj["v"] = [SCHEMA_MAJOR, SCHEMA_MINOR]
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    return out


def _unpack(data: bytes | memoryview, what: str) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise BlobCorrupt(f"malformed {what}: not msgpack ({exc})") from None
    if not isinstance(obj, dict):
        raise BlobCorrupt(f"malformed {what}: expected a map, got {type(obj).__name__}")
    version = obj.get("v")
    if (
        not isinstance(version, list)
        or len(version) != 2
        or not all(isinstance(x, int) for x in version)
    ):
        raise BlobCorrupt(f"malformed {what}: missing schema version")
    if version[0] > SCHEMA_MAJOR:
        raise FormatVersionError(
            f"{what} was written by schema v{version[0]}.{version[1]}; this tiercheck reads "
            f"v{SCHEMA_MAJOR}; upgrade tiercheck to read this store"
        )
    if version[0] < 1:
        raise BlobCorrupt(f"malformed {what}: schema version {version}")
    return obj


def _field(obj: Mapping[str, Any], name: str, types: type | tuple[type, ...], what: str) -> Any:
    if name not in obj:
        raise BlobCorrupt(f"malformed {what}: missing field {name!r}")
    value = obj[name]
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        raise BlobCorrupt(f"malformed {what}: field {name!r} has type {type(value).__name__}")
    return value


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _opt_int(obj: Mapping[str, Any], name: str, what: str) -> int | None:
    value = obj.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise BlobCorrupt(f"malformed {what}: field {name!r} must be an int or nil")
    return value


def _role(value: Any, what: str) -> Role:
    if value == "base":
        return "base"
    if value == "diff":
        return "diff"
    raise BlobCorrupt(f"malformed {what}: role {value!r}")


_KINDS: tuple[EntryKind, ...] = ("tensor", "ndarray", "msgpack", "pickle")

# --- manifest ----------------------------------------------------------------------


def pack_manifest(m: ShardManifest) -> bytes:
    """Encode a shard manifest. Entries and chunks are stored column-wise for compactness."""
    return _pack(
        {
            "type": "shard",
            "version": m.version,
            "rank": m.rank,
            "world_size": m.world_size,
            "chunk_size": m.chunk_size,
            "stream_bytes": m.stream_bytes,
            "entries": [
                [e.key, e.kind, e.dtype, list(e.shape), e.offset, e.nbytes] for e in m.entries
            ],
            "chunks": [[_id_bytes(c.id), c.offset, c.length] for c in m.chunks],
            "tree": m.tree,
            "extra": dict(m.extra),
        }
    )


def unpack_manifest(data: bytes | memoryview) -> ShardManifest:
    """Decode a shard manifest; raise ``BlobCorrupt`` or ``FormatVersionError``."""
    what = "shard manifest"
    obj = _unpack(data, what)
    if obj.get("type") != "shard":
        raise BlobCorrupt(f"malformed {what}: type {obj.get('type')!r}")
    entries = []
    for raw in _field(obj, "entries", list, what):
        if not isinstance(raw, list) or len(raw) != 6:
            raise BlobCorrupt(f"malformed {what}: bad entry {raw!r:.80}")
        key, kind, dtype, shape, offset, nbytes = raw
        if (
            not isinstance(key, str)
            or kind not in _KINDS
            or not isinstance(dtype, str)
            or not isinstance(shape, list)
            or not all(isinstance(d, int) and d >= 0 for d in shape)
            or not isinstance(offset, int)
            or not isinstance(nbytes, int)
            or offset < 0
            or nbytes < 0
        ):
            raise BlobCorrupt(f"malformed {what}: bad entry {raw!r:.80}")
        entries.append(Entry(key, kind, dtype, tuple(shape), offset, nbytes))
    chunks = []
    for raw in _field(obj, "chunks", list, what):
        if not isinstance(raw, list) or len(raw) != 3:
            raise BlobCorrupt(f"malformed {what}: bad chunk {raw!r:.80}")
        cid, offset, length = raw
        if not isinstance(offset, int) or not isinstance(length, int) or offset < 0 or length < 0:
            raise BlobCorrupt(f"malformed {what}: bad chunk {raw!r:.80}")
        chunks.append(ChunkRef(_id_hex(cid, what), offset, length))
    extra = obj.get("extra", {})
    if not isinstance(extra, dict):
        raise BlobCorrupt(f"malformed {what}: extra must be a map")
    return ShardManifest(
        version=_field(obj, "version", int, what),
        rank=_field(obj, "rank", int, what),
        world_size=_field(obj, "world_size", int, what),
        chunk_size=_field(obj, "chunk_size", int, what),
        stream_bytes=_field(obj, "stream_bytes", int, what),
        entries=tuple(entries),
        chunks=tuple(chunks),
        tree=obj.get("tree"),
        extra=extra,
    )


# --- log records -------------------------------------------------------------------


def _info_to_obj(info: VersionInfo) -> dict[str, Any]:
    return {
        "id": info.id,
        "step": info.step,
        "role": info.role,
        "base": info.base,
        "world_size": info.world_size,
        "shards": [_id_bytes(s) for s in info.shards],
        "time": info.time,
        "logical_bytes": info.logical_bytes,
        "metadata": dict(info.metadata),
    }


def _info_from_obj(obj: Any, what: str) -> VersionInfo:
    if not isinstance(obj, dict):
        raise BlobCorrupt(f"malformed {what}: version info must be a map")
    shards = _field(obj, "shards", list, what)
    metadata = obj.get("metadata", {})
    if not isinstance(metadata, dict):
        raise BlobCorrupt(f"malformed {what}: metadata must be a map")
    return VersionInfo(
        id=_field(obj, "id", int, what),
        step=_field(obj, "step", int, what),
        role=_role(obj.get("role"), what),
        base=_opt_int(obj, "base", what),
        world_size=_field(obj, "world_size", int, what),
        shards=tuple(_id_hex(s, what) for s in shards),
        time=float(_field(obj, "time", (int, float), what)),
        logical_bytes=_field(obj, "logical_bytes", int, what),
        metadata=metadata,
    )


def pack_record(rec: LogRecord) -> bytes:
    """Encode one log record (the payload a tier's ``append`` stores, before framing)."""
    if isinstance(rec, PrepareRecord):
        return _pack(
            {
                "type": "prepare",
                "version": rec.version,
                "rank": rec.rank,
                "step": rec.step,
                "role": rec.role,
                "base": rec.base,
                "manifest": _id_bytes(rec.manifest),
                "chunks_written": rec.chunks_written,
                "bytes_written": rec.bytes_written,
                "time": rec.time,
                "deltas": {_id_bytes(k): _id_bytes(v) for k, v in rec.deltas.items()},
            }
        )
    if isinstance(rec, CommitRecord):
        return _pack({"type": "commit", "info": _info_to_obj(rec.info)})
    if isinstance(rec, AbortRecord):
        return _pack({"type": "abort", "version": rec.version, "reason": rec.reason})
    if isinstance(rec, DropRecord):
        return _pack({"type": "drop", "version": rec.version, "time": rec.time})
    raise TypeError(f"not a log record: {type(rec).__name__}")


def unpack_record(data: bytes | memoryview) -> LogRecord:
    """Decode one log record; raise ``BlobCorrupt`` or ``FormatVersionError``."""
    what = "log record"
    obj = _unpack(data, what)
    kind = obj.get("type")
    if kind == "prepare":
        deltas = _field(obj, "deltas", dict, what)
        return PrepareRecord(
            version=_field(obj, "version", int, what),
            rank=_field(obj, "rank", int, what),
            step=_field(obj, "step", int, what),
            role=_role(obj.get("role"), what),
            base=_opt_int(obj, "base", what),
            manifest=_id_hex(obj.get("manifest"), what),
            chunks_written=_field(obj, "chunks_written", int, what),
            bytes_written=_field(obj, "bytes_written", int, what),
            time=float(_field(obj, "time", (int, float), what)),
            deltas={_id_hex(k, what): _id_hex(v, what) for k, v in deltas.items()},
        )
    if kind == "commit":
        return CommitRecord(_info_from_obj(obj.get("info"), what))
    if kind == "abort":
        return AbortRecord(
            version=_field(obj, "version", int, what),
            reason=str(obj.get("reason", "")),
        )
    if kind == "drop":
        return DropRecord(
            version=_field(obj, "version", int, what),
            time=float(_field(obj, "time", (int, float), what)),
        )
    raise BlobCorrupt(f"malformed {what}: unknown record type {kind!r}")
