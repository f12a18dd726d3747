"""Shard-manifest and log-record schemas (format v1), encoded as msgpack.

Every encoded object is a msgpack map carrying ``"v": [major, minor]``. A reader refuses a
newer major version with :class:`~tiercheck.errors.FormatVersionError`; a newer minor
only adds optional fields, which an older reader ignores. Malformed bytes raise
:class:`~tiercheck.errors.BlobCorrupt` (for a manifest blob) or ``LogCorrupt``-style
``BlobCorrupt`` (for a log record); never anything untyped.

Chunk and manifest ids are 64-character lowercase hex strings in memory and 32 raw bytes
on the wire.

Schema 1.1 adds the ``log`` role: a version stored as the optimizer inputs of the steps since
a full version (:class:`ReplayLog`, carried by the shard manifest's optional ``log`` key),
replayed and verified at restore. SPEC.md section 12 defines it. It also adds sharded
tensors: an entry that is one rank's piece of a distributed tensor (DTensor), placed in the
global tensor by a :class:`ShardPlacement` (the manifest's optional ``sharded`` key, SPEC.md
section 14).

Schema 1.2 adds each chunk's check (:attr:`ChunkRef.check`, the shard manifest's optional
``checks`` key): XXH3-128 of the chunk's bytes, taken by the save before their id.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack
import numpy as np

from tiercheck.errors import BlobCorrupt, FormatVersionError
from tiercheck.formats.ids import CHECK_SIZE

__all__ = [
    "MAX_INT",
    "SCHEMA_MAJOR",
    "SCHEMA_MINOR",
    "TENSOR_ITEMSIZE",
    "AbortRecord",
    "CheckpointRecord",
    "ChunkRef",
    "CommitRecord",
    "DropRecord",
    "Entry",
    "Fingerprint",
    "GroupOptions",
    "LogRecord",
    "LogStep",
    "ParamSpec",
    "PrepareRecord",
    "ReplayLog",
    "ShardManifest",
    "ShardPlacement",
    "SmallTensor",
    "VersionInfo",
    "element_size",
    "pack_manifest",
    "pack_record",
    "record_schema",
    "unpack_manifest",
    "unpack_record",
]

SCHEMA_MAJOR = 1
SCHEMA_MINOR = 2

# The torch dtypes a tensor entry may name (``str(dtype)`` without ``torch.``) and the
# bytes per element of each: a reader checks an entry's ``nbytes`` against its shape with
# this table before it allocates anything (SPEC.md section 7.2).
TENSOR_ITEMSIZE: Mapping[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "bits8": 1,
    "bits16": 2,
    "bits1x8": 1,
    "bits2x4": 1,
    "bits4x2": 1,
}
MAX_INT = (1 << 63) - 1
"""The largest step, version id or size the format holds: msgpack ints that every reader
decodes as a signed 64-bit integer."""
MAX_CHUNK_SIZE = 1 << 32
"""The largest ``chunk_size``, and chunk, a reader accepts: with the chunks tiling the
stream, a manifest's claims bound what a reader allocates by what its chunks declare."""
MAX_NDIM = 64
"""The most dimensions an entry may have (torch and NumPy 2 allow 64)."""
MAX_TREE_DEPTH = 256
"""The deepest state tree a reader walks (a writer refuses states nested over 64 levels)."""

EntryKind = Literal["tensor", "ndarray", "msgpack", "pickle"]
Role = Literal["base", "diff", "log"]


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
    """A window ``[offset, offset + length)`` of the stream and the id of its content.

    ``check`` (schema 1.2): XXH3-128 of the same bytes, which the save took before their id
    (:func:`~tiercheck.formats.ids.chunk_ids_and_checks`); a restore verifies a copy read in place
    from a memory tier of this host against it instead of re-hashing BLAKE3 (SPEC.md
    section 7.2). None where the writer recorded none. Not part of equality: the id names
    the content."""

    id: str
    offset: int
    length: int
    check: bytes | None = field(default=None, compare=False)


@dataclass(frozen=True)
class SmallTensor:
    """A small tensor held inline in a manifest: a tensor-valued hyperparameter (``lr`` as a
    0-d tensor), or ``grad_scale``/``found_inf`` handed to a fused optimizer. ``data`` is its
    elements, row-major, little-endian, as in a tensor entry."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True)
class GroupOptions:
    """The options (hyperparameters) of every param group of an optimizer, as they stood.

    ``packed`` is one msgpack object in the encoding of state-tree leaves (SPEC.md section
    8, so tuples such as ``betas`` stay tuples): an array with one map per param group, of
    every option except ``params``. Options whose value is a tensor are left out of it and
    listed in ``tensors`` as ``(group, name, value)``.
    """

    packed: bytes
    tensors: tuple[tuple[int, str, SmallTensor], ...] = ()


@dataclass(frozen=True)
class ParamSpec:
    """One parameter the optimizer updates: its param group, dtype and shape."""

    group: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Fingerprint:
    """A fingerprint of one tensor (or value) the replay must reproduce.

    ``algo`` names how ``digest`` was computed (SPEC.md section 12.4): ``blake3`` (the
    first 16 bytes of BLAKE3 of the tensor's bytes), ``wsum64`` (two weighted sums over the
    tensor's bytes as 32-bit words, computed where the tensor lives) or ``value`` (a
    non-tensor value: ``digest`` is its msgpack encoding).
    """

    algo: str
    digest: bytes


@dataclass(frozen=True)
class LogStep:
    """One ``optimizer.step()`` of the log (or a step GradScaler skipped).

    ``grads[i]`` is the index, in the shard manifest's ``entries``, of the gradient that
    parameter ``i`` held when the optimizer read it, or ``None`` where it held none.
    ``options`` are the group options the step ran with; ``attrs`` the tensors a GradScaler
    set on the optimizer for the step (``grad_scale``, ``found_inf``). ``counter`` is the
    optimizer's step counter before the step where it was known cheaply; ``scaler`` the
    GradScaler's state as the step saw it, where one was attached. A ``skipped`` step did
    not call ``optimizer.step()``: it has no gradients and no options.
    """

    index: int
    skipped: bool
    grads: tuple[int | None, ...]
    options: GroupOptions | None
    attrs: Mapping[str, SmallTensor] = field(default_factory=dict)
    counter: float | None = None
    scaler: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class ReplayLog:
    """What a log version's shard holds besides its entries: how to replay and verify it.

    The optimizer (``optimizer``, a qualified class name, with ``flags``, its implementation
    options per param group, under torch ``torch`` on device type ``device``) updated
    ``params``; ``mirrors`` are ``(param index, dtype)`` of tensors kept equal to a
    parameter cast to ``dtype`` (bf16 weights of fp32 master weights). Replaying ``steps``
    from the version's base, then setting ``options``, reproduces every tensor named in
    ``fingerprints``: ``param/I``, ``state/I/NAME`` (the optimizer's state of parameter
    ``I``) and ``mirror/J``. ``scaler`` is the GradScaler's state at save, if one was
    attached.
    """

    optimizer: str
    torch: str
    device: str
    flags: tuple[Mapping[str, Any], ...]
    params: tuple[ParamSpec, ...]
    mirrors: tuple[tuple[int, str], ...]
    steps: tuple[LogStep, ...]
    options: GroupOptions
    fingerprints: Mapping[str, Fingerprint]
    scaler: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class ShardPlacement:
    """Where a ``tensor`` entry lies in the distributed tensor it is one rank's piece of.

    The entry holds the elements of the box ``[offsets[d], offsets[d] + entry.shape[d])``
    of the global tensor of shape ``global_shape`` (row-major, as any tensor entry).
    ``global_stride``, ``mesh_shape`` and ``placements`` (``"S(d)"``: sharded along dim
    ``d`` over that mesh dimension; ``"R"``: replicated) record how the writer's mesh laid
    it out; a reader assembles other layouts from the boxes alone.
    """

    global_shape: tuple[int, ...]
    global_stride: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    placements: tuple[str, ...]
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class ShardManifest:
    """One rank's part of a version.

    ``tree`` is the container skeleton of the state (msgpack-able, see SPEC.md): dicts,
    lists, tuples and objects with ``state_dict``, whose leaves are indices into
    ``entries``. ``stream_bytes`` is the length of the byte stream the chunks cover.
    ``log`` is set in the shard of a log version only (schema 1.1). ``sharded`` maps the
    index of each entry that is a piece of a distributed tensor to its placement; the tree
    names such an entry ``{"s": i}``, never ``{"e": i}`` (SPEC.md section 14).
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
    log: ReplayLog | None = None
    sharded: Mapping[int, ShardPlacement] = field(default_factory=dict)


@dataclass(frozen=True)
class VersionInfo:
    """A global checkpoint: what every rank's shard is and how it relates to others.

    ``base`` is the base version of a diff, or the full (base or diff) version a log
    version replays from; ``None`` for a base.
    """

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


@dataclass(frozen=True)
class CheckpointRecord:
    """A summary of a tier's log that stands for every record before it (revision 1.1).

    Log compaction replaces the records it covers with this one record, so reading a log
    costs O(versions kept), not O(records ever appended). It holds what a reader needs
    from those records: the version info of every version the tier held (``committed``),
    their prepare records and those of versions not decided yet (``prepared``), and
    ``max_version``, the greatest version id any covered record named (new ids are
    allocated after it). ``delta_blobs`` says whether any covered record named a delta
    blob (garbage collection then reads blob headers for delta bases). ``records`` is
    how many records it replaced in all, ``time`` when it was written.
    """

    committed: tuple[VersionInfo, ...]
    prepared: tuple[PrepareRecord, ...]
    max_version: int
    delta_blobs: bool
    records: int
    time: float


LogRecord = PrepareRecord | CommitRecord | AbortRecord | DropRecord | CheckpointRecord

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
    if value == "log":
        return "log"
    raise BlobCorrupt(f"malformed {what}: role {value!r}")


def _role_and_base(obj: Mapping[str, Any], what: str) -> tuple[Role, int | None]:
    role = _role(obj.get("role"), what)
    base = _opt_int(obj, "base", what)
    if role == "log" and base is None:
        raise BlobCorrupt(f"malformed {what}: a log version without the version it replays from")
    return role, base


_KINDS: tuple[EntryKind, ...] = ("tensor", "ndarray", "msgpack", "pickle")

# --- manifest ----------------------------------------------------------------------


def pack_manifest(m: ShardManifest) -> bytes:
    """Encode a shard manifest. Entries and chunks are stored column-wise for compactness.

    The ``log`` key is written only for the shard of a log version.
    """
    obj: dict[str, Any] = {
        "type": "shard",
        "version": m.version,
        "rank": m.rank,
        "world_size": m.world_size,
        "chunk_size": m.chunk_size,
        "stream_bytes": m.stream_bytes,
        "entries": [[e.key, e.kind, e.dtype, list(e.shape), e.offset, e.nbytes] for e in m.entries],
        "chunks": [[_id_bytes(c.id), c.offset, c.length] for c in m.chunks],
        "tree": m.tree,
        "extra": dict(m.extra),
    }
    if m.chunks and all(c.check is not None for c in m.chunks):
        obj["checks"] = b"".join(c.check for c in m.chunks if c.check is not None)
    if m.log is not None:
        obj["log"] = _replay_log_to_obj(m.log)
    if m.sharded:
        obj["sharded"] = [
            [
                i,
                list(p.global_shape),
                list(p.global_stride),
                list(p.mesh_shape),
                list(p.placements),
                list(p.offsets),
            ]
            for i, p in sorted(m.sharded.items())
        ]
    return _pack(obj)


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
    chunks = _with_checks(chunks, obj.get("checks"), what)
    extra = obj.get("extra", {})
    if not isinstance(extra, dict):
        raise BlobCorrupt(f"malformed {what}: extra must be a map")
    chunk_size = _field(obj, "chunk_size", int, what)
    stream_bytes = _field(obj, "stream_bytes", int, what)
    _check_sizes(entries, chunks, chunk_size, stream_bytes, what)
    raw_log = obj.get("log")
    replay_log = None if raw_log is None else _replay_log_from_obj(raw_log, entries, what)
    sharded = _sharded_from_obj(obj.get("sharded", []), entries, what)
    gradients = _gradient_count(replay_log)
    tree = obj.get("tree")
    _check_tree(tree, len(entries), gradients, sharded, what)
    version = _field(obj, "version", int, what)
    rank = _field(obj, "rank", int, what)
    world_size = _field(obj, "world_size", int, what)
    if version < 0 or world_size < 1 or not 0 <= rank < world_size:
        raise BlobCorrupt(
            f"malformed {what}: version {version}, rank {rank} of world size {world_size}"
        )
    return ShardManifest(
        version=version,
        rank=rank,
        world_size=world_size,
        chunk_size=chunk_size,
        stream_bytes=stream_bytes,
        entries=tuple(entries),
        chunks=tuple(chunks),
        tree=tree,
        extra=extra,
        log=replay_log,
        sharded=sharded,
    )


def _with_checks(chunks: list[ChunkRef], checks: Any, what: str) -> list[ChunkRef]:
    """``chunks`` with the checks of the manifest's optional ``checks`` key (schema 1.2):
    ``CHECK_SIZE`` bytes per chunk, in chunk order; absent, the chunks have none."""
    if checks is None:
        return chunks
    if not isinstance(checks, bytes) or len(checks) != CHECK_SIZE * len(chunks):
        raise BlobCorrupt(
            f"malformed {what}: checks must be {CHECK_SIZE} bytes for each of {len(chunks)} chunks"
        )
    return [
        ChunkRef(c.id, c.offset, c.length, checks[i * CHECK_SIZE : (i + 1) * CHECK_SIZE])
        for i, c in enumerate(chunks)
    ]


def element_size(kind: str, dtype: str) -> int | None:
    """Bytes per element of an entry of ``kind`` and ``dtype``; None where the two do not
    agree (a tensor with a NumPy dtype string, an object or structured array, a scalar
    entry with a dtype) or the dtype is not one a writer produces; 0 for a scalar entry."""
    if kind == "tensor":
        return TENSOR_ITEMSIZE.get(dtype)
    if kind == "ndarray":
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # NumPy deprecates some spellings
                parsed = np.dtype(dtype)
        except Exception:  # NumPy raises TypeError, ValueError, SyntaxError... for bad strings
            return None
        if (
            parsed.str != dtype  # a writer stores dtype.str, nothing else
            or parsed.hasobject
            or parsed.kind not in "biufcV"
            or parsed.fields
            or parsed.subdtype is not None
        ):
            return None
        return parsed.itemsize
    return 0 if dtype == "" else None


def _check_sizes(
    entries: list[Entry], chunks: list[ChunkRef], chunk_size: int, stream_bytes: int, what: str
) -> None:
    """Every size the manifest claims agrees with the others, so a reader that allocates
    by them allocates no more than the stream its chunks declare (SPEC.md 7.2, 9)."""
    if not 0 < chunk_size <= MAX_CHUNK_SIZE or stream_bytes < 0:
        raise BlobCorrupt(f"malformed {what}: chunk_size {chunk_size}, stream_bytes {stream_bytes}")
    for c in chunks:
        # not checked against chunk_size: readers take boundaries from `chunks` alone,
        # and writers before 1.1 (the golden files) wrote chunks a little longer
        if c.length > MAX_CHUNK_SIZE or c.offset + c.length > stream_bytes:
            raise BlobCorrupt(
                f"malformed {what}: chunk [{c.offset}, +{c.length}) does not fit a stream of "
                f"{stream_bytes} bytes"
            )
    spans = []
    for e in entries:
        size = element_size(e.kind, e.dtype)
        if size is None:
            raise BlobCorrupt(
                f"malformed {what}: entry {e.key!r:.60} is a {e.kind} of {e.dtype!r:.40}"
            )
        if size == 0:  # msgpack, pickle: a byte string, no shape
            if e.shape:
                raise BlobCorrupt(f"malformed {what}: {e.kind} entry {e.key!r:.60} has a shape")
        elif len(e.shape) > MAX_NDIM or math.prod(e.shape) * size != e.nbytes:
            raise BlobCorrupt(
                f"malformed {what}: entry {e.key!r:.60} of shape {e.shape!r:.80} and dtype "
                f"{e.dtype} is not {e.nbytes} bytes"
            )
        if e.offset + e.nbytes > stream_bytes:
            raise BlobCorrupt(
                f"malformed {what}: entry {e.key!r:.60} ends at {e.offset + e.nbytes}, past the "
                f"stream's {stream_bytes} bytes"
            )
        if e.nbytes:
            spans.append((e.offset, e.nbytes))
    spans.sort()
    for (a, n), (b, _) in itertools.pairwise(spans):
        if a + n > b:
            raise BlobCorrupt(f"malformed {what}: entries overlap at stream offset {b}")


def _gradient_count(replay_log: ReplayLog | None) -> int:
    """How many of the first entries are a log version's gradients (SPEC.md 12.3)."""
    if replay_log is None:
        return 0
    used = [g for s in replay_log.steps for g in s.grads if g is not None]
    return max(used) + 1 if used else 0


def _check_tree(
    tree: Any, nentries: int, gradients: int, sharded: Mapping[int, Any], what: str
) -> None:
    """``tree`` is a state tree as SPEC.md section 8 defines it, at most
    ``MAX_TREE_DEPTH`` deep, whose leaves name entries that exist: ``{"e": i}`` a whole
    entry (not a log version's gradient), ``{"s": i}`` one with a placement."""
    if tree is None:
        return
    stack: list[tuple[Any, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_TREE_DEPTH or not isinstance(node, dict) or len(node) != 1:
            raise BlobCorrupt(f"malformed {what}: bad tree node {node!r:.80}")
        ((tag, sub),) = node.items()
        if tag == "e":
            ok = _is_int(sub) and gradients <= sub < nentries and sub not in sharded
        elif tag == "s":
            ok = _is_int(sub) and sub in sharded
        elif tag == "r":
            ok = isinstance(sub, str)
        elif tag == "o":
            ok = True
            stack.append((sub, depth + 1))
        elif tag == "d":
            ok = isinstance(sub, list) and all(
                isinstance(item, list)
                and len(item) == 2
                and (isinstance(item[0], str) or _is_int(item[0]))
                for item in sub
            )
            if ok:
                stack.extend((item[1], depth + 1) for item in sub)
        elif tag in ("l", "t"):
            ok = isinstance(sub, list)
            if ok:
                stack.extend((child, depth + 1) for child in sub)
        else:
            ok = False
        if not ok:
            raise BlobCorrupt(f"malformed {what}: bad tree node {node!r:.80}")


def _sharded_from_obj(raw: Any, entries: list[Entry], what: str) -> dict[int, ShardPlacement]:
    if not isinstance(raw, list):
        raise BlobCorrupt(f"malformed {what}: sharded must be an array")
    out: dict[int, ShardPlacement] = {}
    for item in raw:
        if (
            not isinstance(item, list)
            or len(item) != 6
            or not _is_int(item[0])
            or not 0 <= item[0] < len(entries)
            or item[0] in out
            or not all(_is_shape(x) for x in (item[1], item[2], item[3], item[5]))
            or not isinstance(item[4], list)
            or not all(isinstance(p, str) for p in item[4])
        ):
            raise BlobCorrupt(f"malformed {what}: bad sharded entry {item!r:.80}")
        i, shape, stride, mesh, placements, offsets = item
        entry = entries[i]
        if (
            entry.kind != "tensor"
            or len(stride) != len(shape)
            or len(offsets) != len(shape)
            or len(entry.shape) != len(shape)
            or len(placements) != len(mesh)
            or any(o + n > g for o, n, g in zip(offsets, entry.shape, shape))
        ):
            raise BlobCorrupt(
                f"malformed {what}: the placement of entry {i} does not fit its entry"
            )
        out[i] = ShardPlacement(
            tuple(shape), tuple(stride), tuple(mesh), tuple(placements), tuple(offsets)
        )
    return out


# --- the replay log of a log version (schema 1.1) -----------------------------------


def _small_to_obj(t: SmallTensor) -> list[Any]:
    return [t.dtype, list(t.shape), t.data]


def _small_from_obj(raw: Any, what: str) -> SmallTensor:
    if (
        not isinstance(raw, list)
        or len(raw) != 3
        or not isinstance(raw[0], str)
        or not _is_shape(raw[1])
        or not isinstance(raw[2], bytes)
    ):
        raise BlobCorrupt(f"malformed {what}: bad inline tensor {raw!r:.80}")
    size = TENSOR_ITEMSIZE.get(raw[0])
    if size is None or len(raw[1]) > MAX_NDIM or math.prod(raw[1]) * size != len(raw[2]):
        raise BlobCorrupt(f"malformed {what}: inline tensor {raw!r:.80} is not its dtype and shape")
    return SmallTensor(raw[0], tuple(raw[1]), raw[2])


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_shape(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(d) and d >= 0 for d in value)


def _options_to_obj(o: GroupOptions) -> list[Any]:
    return [o.packed, [[g, name, *_small_to_obj(t)] for g, name, t in o.tensors]]


def _options_from_obj(raw: Any, what: str) -> GroupOptions:
    if not isinstance(raw, list) or len(raw) != 2 or not isinstance(raw[0], bytes):
        raise BlobCorrupt(f"malformed {what}: bad group options {raw!r:.80}")
    if not isinstance(raw[1], list):
        raise BlobCorrupt(f"malformed {what}: bad tensor-valued options {raw[1]!r:.80}")
    tensors = []
    for item in raw[1]:
        if not isinstance(item, list) or len(item) != 5:
            raise BlobCorrupt(f"malformed {what}: bad tensor-valued option {item!r:.80}")
        group, name = item[0], item[1]
        if not _is_int(group) or group < 0 or not isinstance(name, str):
            raise BlobCorrupt(f"malformed {what}: bad tensor-valued option {item!r:.80}")
        tensors.append((group, name, _small_from_obj(item[2:], what)))
    return GroupOptions(raw[0], tuple(tensors))


def _str_map(raw: Any, what: str, name: str) -> dict[str, Any]:
    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        raise BlobCorrupt(f"malformed {what}: {name} must be a map with str keys")
    return raw


def _step_to_obj(step: LogStep) -> dict[str, Any]:
    return {
        "index": step.index,
        "skipped": step.skipped,
        "grads": list(step.grads),
        "options": None if step.options is None else _options_to_obj(step.options),
        "attrs": {k: _small_to_obj(v) for k, v in step.attrs.items()},
        "counter": step.counter,
        "scaler": None if step.scaler is None else dict(step.scaler),
    }


def _step_from_obj(raw: Any, entries: list[Entry], nparams: int, what: str) -> LogStep:
    if not isinstance(raw, dict):
        raise BlobCorrupt(f"malformed {what}: a logged step must be a map")
    index = _field(raw, "index", int, what)
    skipped = _field(raw, "skipped", bool, what)
    grads: list[int | None] = []
    for g in _field(raw, "grads", list, what):
        if g is not None and (not _is_int(g) or not 0 <= g < len(entries)):
            raise BlobCorrupt(f"malformed {what}: step {index} names gradient entry {g!r}")
        if g is not None and entries[g].kind != "tensor":
            raise BlobCorrupt(f"malformed {what}: step {index} gradient entry {g} not a tensor")
        grads.append(g)
    raw_options = raw.get("options")
    if skipped != (raw_options is None) or len(grads) != (0 if skipped else nparams):
        raise BlobCorrupt(
            f"malformed {what}: step {index} must have options and one gradient per "
            "parameter unless it was skipped, and neither if it was"
        )
    attrs = _str_map(raw.get("attrs", {}), what, "attrs")
    counter = raw.get("counter")
    if counter is not None and (not isinstance(counter, (int, float)) or isinstance(counter, bool)):
        raise BlobCorrupt(f"malformed {what}: step {index} counter {counter!r:.40}")
    scaler = raw.get("scaler")
    return LogStep(
        index=index,
        skipped=skipped,
        grads=tuple(grads),
        options=None if raw_options is None else _options_from_obj(raw_options, what),
        attrs={k: _small_from_obj(v, what) for k, v in attrs.items()},
        counter=None if counter is None else float(counter),
        scaler=None if scaler is None else _str_map(scaler, what, "scaler"),
    )


def _replay_log_to_obj(r: ReplayLog) -> dict[str, Any]:
    return {
        "optimizer": r.optimizer,
        "torch": r.torch,
        "device": r.device,
        "flags": [dict(f) for f in r.flags],
        "params": [[p.group, p.dtype, list(p.shape)] for p in r.params],
        "mirrors": [[i, dtype] for i, dtype in r.mirrors],
        "steps": [_step_to_obj(s) for s in r.steps],
        "options": _options_to_obj(r.options),
        "fingerprints": {k: [f.algo, f.digest] for k, f in r.fingerprints.items()},
        "scaler": None if r.scaler is None else dict(r.scaler),
    }


def _replay_log_from_obj(raw: Any, entries: list[Entry], what: str) -> ReplayLog:
    what = f"{what} (replay log)"
    if not isinstance(raw, dict):
        raise BlobCorrupt(f"malformed {what}: must be a map")
    params = []
    for p in _field(raw, "params", list, what):
        if (
            not isinstance(p, list)
            or len(p) != 3
            or not _is_int(p[0])
            or p[0] < 0
            or p[1] not in TENSOR_ITEMSIZE
            or not _is_shape(p[2])
            or len(p[2]) > MAX_NDIM
        ):
            raise BlobCorrupt(f"malformed {what}: bad parameter {p!r:.80}")
        params.append(ParamSpec(p[0], p[1], tuple(p[2])))
    flags = tuple(_str_map(f, what, "flags") for f in _field(raw, "flags", list, what))
    if any(p.group >= len(flags) for p in params):
        raise BlobCorrupt(f"malformed {what}: a parameter names a group with no flags")
    mirrors = []
    for m in _field(raw, "mirrors", list, what):
        if (
            not isinstance(m, list)
            or len(m) != 2
            or not _is_int(m[0])
            or not 0 <= m[0] < len(params)
            or m[1] not in TENSOR_ITEMSIZE
        ):
            raise BlobCorrupt(f"malformed {what}: bad mirror {m!r:.80}")
        mirrors.append((m[0], m[1]))
    fingerprints = {}
    for name, fp in _str_map(_field(raw, "fingerprints", dict, what), what, "fingerprints").items():
        if (
            not isinstance(fp, list)
            or len(fp) != 2
            or not isinstance(fp[0], str)
            or not isinstance(fp[1], bytes)
        ):
            raise BlobCorrupt(f"malformed {what}: bad fingerprint of {name!r:.60}")
        fingerprints[name] = Fingerprint(fp[0], fp[1])
    scaler = raw.get("scaler")
    return ReplayLog(
        optimizer=_field(raw, "optimizer", str, what),
        torch=_field(raw, "torch", str, what),
        device=_field(raw, "device", str, what),
        flags=flags,
        params=tuple(params),
        mirrors=tuple(mirrors),
        steps=tuple(
            _step_from_obj(s, entries, len(params), what) for s in _field(raw, "steps", list, what)
        ),
        options=_options_from_obj(raw.get("options"), what),
        fingerprints=fingerprints,
        scaler=None if scaler is None else _str_map(scaler, what, "scaler"),
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
    role, base = _role_and_base(obj, what)
    return VersionInfo(
        id=_field(obj, "id", int, what),
        step=_field(obj, "step", int, what),
        role=role,
        base=base,
        world_size=_field(obj, "world_size", int, what),
        shards=tuple(_id_hex(s, what) for s in shards),
        time=float(_field(obj, "time", (int, float), what)),
        logical_bytes=_field(obj, "logical_bytes", int, what),
        metadata=metadata,
    )


def _prepare_to_obj(rec: PrepareRecord) -> dict[str, Any]:
    return {
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


def _prepare_from_obj(obj: Any, what: str) -> PrepareRecord:
    if not isinstance(obj, dict):
        raise BlobCorrupt(f"malformed {what}: a prepare record must be a map")
    deltas = _field(obj, "deltas", dict, what)
    role, base = _role_and_base(obj, what)
    return PrepareRecord(
        version=_field(obj, "version", int, what),
        rank=_field(obj, "rank", int, what),
        step=_field(obj, "step", int, what),
        role=role,
        base=base,
        manifest=_id_hex(obj.get("manifest"), what),
        chunks_written=_field(obj, "chunks_written", int, what),
        bytes_written=_field(obj, "bytes_written", int, what),
        time=float(_field(obj, "time", (int, float), what)),
        deltas={_id_hex(k, what): _id_hex(v, what) for k, v in deltas.items()},
    )


def record_schema(data: bytes | memoryview) -> tuple[int, int] | None:
    """The ``[major, minor]`` schema version of an encoded record, or None if unreadable.

    Log compaction refuses to summarise records of a newer minor version: it could not
    carry forward what it does not understand.
    """
    try:
        obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=False)
    except Exception:  # msgpack raises several unrelated types on bad input
        return None
    version = obj.get("v") if isinstance(obj, dict) else None
    if isinstance(version, list) and len(version) == 2 and all(isinstance(x, int) for x in version):
        return version[0], version[1]
    return None


def pack_record(rec: LogRecord) -> bytes:
    """Encode one log record (the payload a tier's ``append`` stores, before framing)."""
    if isinstance(rec, PrepareRecord):
        return _pack(_prepare_to_obj(rec))
    if isinstance(rec, CheckpointRecord):
        return _pack(
            {
                "type": "checkpoint",
                "committed": [_info_to_obj(i) for i in rec.committed],
                "prepared": [_prepare_to_obj(p) for p in rec.prepared],
                "max_version": rec.max_version,
                "delta_blobs": rec.delta_blobs,
                "records": rec.records,
                "time": rec.time,
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
        return _prepare_from_obj(obj, what)
    if kind == "checkpoint":
        return CheckpointRecord(
            committed=tuple(_info_from_obj(i, what) for i in _field(obj, "committed", list, what)),
            prepared=tuple(_prepare_from_obj(p, what) for p in _field(obj, "prepared", list, what)),
            max_version=_field(obj, "max_version", int, what),
            delta_blobs=_field(obj, "delta_blobs", bool, what),
            records=_field(obj, "records", int, what),
            time=float(_field(obj, "time", (int, float), what)),
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
