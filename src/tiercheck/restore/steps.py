"""Restore's steps: choose a version, read and verify it into staging, then load it in place.

:class:`tiercheck.restore.service.RestoreService` runs them in order for a store (the
candidates, the agreement between ranks, the staging buffer, the fallback to an older
version); this module holds the steps themselves.

All or nothing for the caller's state: nothing of it changes until every chunk of the
version has been read and verified, and if loading it then fails (a ``load_state_dict``
that raises, a leaf that cannot be decoded, a replay that breaks), everything the load
wrote is put back as it was (:class:`Undo`, which says why a snapshot and not a dry run).

1. :func:`choose_version` picks the newest committed version every needed tier can serve
   (a diff only if its base is restorable too), or the one asked for.
2. :func:`bind` walks the caller's state beside the saved tree and finds, for each saved
   tensor, the caller's tensor to write into (same dtype and shape). Structure mismatches
   outside stateful objects raise :class:`~tiercheck.errors.StateError` naming the key;
   stateful objects (modules, optimizers) are checked by their own ``load_state_dict``.
   Nothing is written yet.
3. :func:`fetch_stream` reads every chunk in parallel from the fastest tier holding the
   version, falling back tier by tier and repairing bad copies (:mod:`tiercheck.store.fetch`),
   and decodes it into its place in a staging buffer laid out like the saved stream (the
   store's reused staging buffer: warm pages, and warm for the next save too).
4. :class:`Undo` keeps what the load will overwrite; :func:`load_stream` copies each
   entry from staging into its destination (one memcpy per entry), and
   :func:`materialize` puts the values in place: dict and list members are replaced,
   stateful objects get ``load_state_dict``. If either raises, :meth:`Undo.rollback`.

A log version (issue 11) is read as its base version plus its own shard, both staged and
verified before anything of the caller's changes; then the base is loaded, the log's steps
are replayed into the guarded optimizer and verified (:mod:`tiercheck.logversions.planner`), and
the log version's own leaves are loaded, ``{"r": NAME}`` nodes taking the replayed
tensors. A replay that is refused or does not verify is undone by loading the staged base
again (the restore returns the base); one that breaks (``optimizer.step()`` raises), or a
load after it that fails, fails the restore and is undone by :class:`Undo` like any load.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from tiercheck.core.entries import decode_scalar, is_stateful, torch_dtype
from tiercheck.core.sharded import is_dtensor
from tiercheck.errors import (
    BlobCorrupt,
    EmptyStore,
    NoRestorableVersion,
    StateError,
    TiercheckError,
)
from tiercheck.formats.manifest import Entry, Role, ShardManifest, VersionInfo
from tiercheck.restore.reshard import Piece, piece_for
from tiercheck.runtime.parallel import map_all
from tiercheck.store.catalog import Catalog
from tiercheck.store.fetch import ChunkFetcher
from tiercheck.store.tierset import TierSlot

if TYPE_CHECKING:
    import torch

__all__ = [
    "Binding",
    "RestoreInfo",
    "Undo",
    "bind",
    "check_stream",
    "choose_version",
    "fetch_stream",
    "load_stream",
    "materialize",
    "nothing_restorable",
]


@dataclass(frozen=True)
class RestoreInfo:
    """What a restore did. ``state`` is the (same, updated) state object."""

    version: int
    step: int
    role: Role
    metadata: Mapping[str, Any]
    source: str
    chunks_from: Mapping[str, int]
    bytes_read: Mapping[str, int]
    repaired: tuple[tuple[str, str], ...]
    corrupt: tuple[tuple[str, str], ...]
    seconds: float
    state: Any = field(repr=False, default=None)
    replayed_steps: int = 0
    """Optimizer steps replayed (a log version: its base was loaded, then these)."""
    fallback: str | None = None
    """Why a newer version was not restored (a log version that could not be replayed or
    verified, or log versions skipped for want of a guarded optimizer); None if none was."""


def nothing_restorable(
    *,
    empty: bool,
    missing_ok: bool,
    last_error: Exception | None,
    world_size: int,
    tiers: Sequence[str] | None = None,
) -> None:
    """What a restore that found no version to load does: return None (nothing restored)
    when the store is ``empty`` (no rank sees any committed version) and the caller said
    ``missing_ok``; raise otherwise. An empty store raises :class:`EmptyStore`, which says
    so and how to start from scratch; a store with versions none of which can be restored
    raises :class:`NoRestorableVersion` with the last error."""
    if empty:
        if missing_ok:
            return
        where = f" in tiers {', '.join(tiers)}" if tiers is not None else ""
        raise EmptyStore(
            f"the store is empty: no version was ever committed{where}, so there is nothing "
            "to restore; on a first launch call restore(state, missing_ok=True), which "
            "returns None when there is nothing to resume from"
        )
    if isinstance(last_error, NoRestorableVersion) and world_size == 1:
        raise last_error
    raise NoRestorableVersion(
        "no version can be restored"
        + (" by every rank" if world_size > 1 else "")
        + (f" (last error: {last_error})" if last_error else "")
    )


def choose_version(
    catalog: Catalog, *, version: int | None = None, step: int | None = None
) -> VersionInfo:
    """The version to restore: the one asked for, or the newest restorable one."""
    versions = catalog.versions
    if version is not None or step is not None:
        if version is not None:
            info = versions.get(version)
            label = f"version {version}"
        else:
            matches = [i for i in versions.values() if i.step == step]
            info = matches[-1] if matches else None
            label = f"step {step}"
        if info is None:
            raise NoRestorableVersion(f"{label} is not a committed version of this store")
        if not catalog.restorable(info.id):
            raise NoRestorableVersion(
                f"{label} is committed but cannot be restored from the reachable tiers "
                f"(held by: {catalog.holders(info.id) or 'none'}; "
                f"unreachable: {sorted(catalog.unreachable) or 'none'})"
            )
        return info
    for vid in sorted(versions, reverse=True):
        if catalog.restorable(vid):
            return versions[vid]
    raise NoRestorableVersion(
        "no restorable version: "
        + (
            "the store has no committed version"
            if not versions
            else f"{len(versions)} committed version(s), none held by a reachable tier"
        )
    )


@dataclass
class Binding:
    """Destinations for each entry of a manifest."""

    targets: dict[int, Any] = field(default_factory=dict)  # entry index -> caller tensor/array
    dests: dict[int, memoryview] = field(default_factory=dict)  # entry index -> byte view
    values: dict[int, Any] = field(default_factory=dict)  # entry index -> fresh tensor/array
    stateful: dict[int, dict[str, Any]] = field(default_factory=dict)  # id(tree node) -> sd
    # id(tree node) -> (key, the caller's object whose state_dict() that sd is)
    objects: dict[int, tuple[str, Any]] = field(default_factory=dict)
    # pieces of distributed tensors assembled from the version's saved boxes (reshard.py)
    pieces: list[Piece] = field(default_factory=list)


def _byte_view_of_tensor(t: torch.Tensor) -> memoryview:
    import torch

    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data.cast("B")


def _fits(entry: Entry, target: Any) -> bool:
    import torch

    if entry.kind == "tensor" and isinstance(target, torch.Tensor):
        return bool(
            str(target.dtype).removeprefix("torch.") == entry.dtype
            and tuple(target.shape) == entry.shape
        )
    if entry.kind == "ndarray" and isinstance(target, np.ndarray):
        return bool(target.dtype.str == entry.dtype and target.shape == entry.shape)
    return False


def _mismatch(entry: Entry, target: Any) -> str:
    import torch

    if isinstance(target, torch.Tensor):
        have = f"tensor {str(target.dtype).removeprefix('torch.')} {tuple(target.shape)}"
    elif isinstance(target, np.ndarray):
        have = f"ndarray {target.dtype.str} {target.shape}"
    else:
        have = type(target).__qualname__
    return f"saved {entry.kind} {entry.dtype} {entry.shape} does not match the state's {have}"


_MISSING = object()


def check_stream(manifest: ShardManifest) -> None:
    """Raise ``BlobCorrupt`` unless the manifest's chunks tile its stream, from offset 0 to
    ``stream_bytes`` (SPEC.md 7.2): then the staging a restore allocates for the stream is
    no larger than the chunks it declares. (Decoding already checked that every entry lies
    in the stream and is as large as its dtype and shape say.)"""
    end = 0
    for ref in manifest.chunks:
        if ref.offset != end:
            break
        end += ref.length
    else:
        if end == manifest.stream_bytes:
            return
    raise BlobCorrupt(
        f"malformed shard manifest of version {manifest.version}: its chunks do not cover "
        f"its stream of {manifest.stream_bytes} bytes one after another"
    )


def bind(manifest: ShardManifest, state: Any, *, strict: bool = True, first: int = 0) -> Binding:
    """Match the saved tree against ``state``; allocate destinations for every entry from
    index ``first`` on (a log version's gradients, before it, are read from the stream).

    A ``None`` in ``state`` is a placeholder: the saved value there (a tensor, a dict of
    them, anything) is restored as saved, unchecked, and put in its place.
    """
    import torch

    check_stream(manifest)
    b = Binding()
    entries = manifest.entries
    assembled: set[int] = set()
    # key of an optimizer's per-parameter state -> its parameter, where that is a DTensor:
    # a fresh optimizer has no state to restore into, and its state must be DTensors too
    like: dict[str, Any] = {}

    def sharded(i: int, target: Any, key: str, checked: bool) -> None:
        placement = manifest.sharded.get(i)
        if placement is None:
            raise StateError(
                "malformed tree in manifest: a sharded node without placement", key=key
            )
        entry = entries[i]
        if target is _MISSING or not isinstance(target, torch.Tensor):
            if checked and target is not _MISSING:
                raise StateError(
                    f"saved a tensor, the state has {type(target).__qualname__}", key=key
                )
            param = like.get(key.rpartition("/")[0])
            if param is not None and tuple(param.shape) == placement.global_shape:
                from torch.distributed.tensor import empty

                target = empty(
                    placement.global_shape,
                    dtype=torch_dtype(entry.dtype),
                    device_mesh=param.device_mesh,
                    placements=param.placements,
                )
            else:  # nothing to shard it like: the whole tensor
                target = torch.empty(placement.global_shape, dtype=torch_dtype(entry.dtype))
        piece = piece_for(key, entry, placement, target)
        b.targets[i] = target
        if piece is None:
            b.dests[i] = _byte_view_of_tensor(target._local_tensor)
        else:
            b.pieces.append(piece)
        assembled.add(i)

    def walk(node: Any, target: Any, key: str, checked: bool) -> None:
        if not isinstance(node, dict) or len(node) != 1:
            raise StateError("malformed tree in manifest", key=key)
        if target is None:  # a placeholder: whatever was saved there is restored as it was
            target = _MISSING
        ((tag, sub),) = node.items()
        if tag == "r":  # a log version's replayed tensor: the replay puts it in place
            return
        if tag == "s":
            sharded(sub, target, key, checked)
            return
        if tag == "e":
            entry = entries[sub]
            if target is not _MISSING and _fits(entry, target):
                b.targets[sub] = target
            elif (
                checked
                and target is not _MISSING
                and entry.kind in ("tensor", "ndarray")
                and isinstance(target, (torch.Tensor, np.ndarray))
            ):
                raise StateError(_mismatch(entry, target), key=key)
            return
        if tag == "o":
            if target is not _MISSING and is_stateful(target):
                sd = target.state_dict()
                b.stateful[id(node)] = sd
                b.objects[id(node)] = (key, target)
                if isinstance(target, torch.optim.Optimizer):
                    params = [p for g in target.param_groups for p in g["params"]]
                    for j, p in enumerate(params):
                        if is_dtensor(p):
                            like[f"{key}/state/{j}" if key else f"state/{j}"] = p
                walk(sub, sd, key, False)
            elif checked and target is not _MISSING:
                raise StateError(
                    f"saved an object with state_dict(), the state has {type(target).__qualname__}",
                    key=key,
                )
            else:
                walk(sub, _MISSING, key, False)
            return
        if tag == "d":
            is_dict = isinstance(target, dict)
            if checked and target is not _MISSING and not is_dict:
                raise StateError(
                    f"saved a dict, the state has {type(target).__qualname__}", key=key
                )
            saved_keys = {k for k, _ in sub}
            if checked and strict and is_dict:
                extra = [k for k in target if k not in saved_keys]
                if extra:
                    raise StateError(
                        f"the state has key {extra[0]!r} that the checkpoint does not "
                        "(pass strict=False to leave such keys alone)",
                        key=f"{key}/{extra[0]}" if key else str(extra[0]),
                    )
            for k, child in sub:
                child_key = f"{key}/{k}" if key else str(k)
                child_target = target.get(k, _MISSING) if is_dict else _MISSING
                if checked and strict and is_dict and child_target is _MISSING:
                    raise StateError(
                        "the checkpoint has this key but the state does not "
                        "(pass strict=False to add it)",
                        key=child_key,
                    )
                walk(child, child_target, child_key, checked)
            return
        if tag in ("l", "t"):
            seq = target if isinstance(target, (list, tuple)) else None
            if checked and target is not _MISSING and seq is None:
                raise StateError(
                    f"saved a {'tuple' if tag == 't' else 'list'}, the state has "
                    f"{type(target).__qualname__}",
                    key=key,
                )
            if checked and strict and seq is not None and len(seq) != len(sub):
                raise StateError(f"saved {len(sub)} items, the state has {len(seq)}", key=key)
            for i, child in enumerate(sub):
                t = seq[i] if seq is not None and i < len(seq) else _MISSING
                walk(child, t, f"{key}/{i}" if key else str(i), checked)
            return
        raise StateError(f"unknown tree node {tag!r} in manifest", key=key)

    walk(manifest.tree, state, "", True)

    for i, entry in enumerate(entries):
        if i < first:
            continue
        target = b.targets.get(i)
        if i in assembled:
            continue
        if entry.kind == "tensor":
            dtype = torch_dtype(entry.dtype)
            if (
                isinstance(target, torch.Tensor)
                and target.device.type == "cpu"
                and target.is_contiguous()
            ):
                b.dests[i] = _byte_view_of_tensor(target)
                continue
            fresh = torch.empty(entry.shape, dtype=dtype)
            b.values[i] = fresh
            b.dests[i] = _byte_view_of_tensor(fresh)
        elif entry.kind == "ndarray":
            if (
                isinstance(target, np.ndarray)
                and target.flags.c_contiguous
                and target.flags.writeable
            ):
                b.dests[i] = target.reshape(-1).view(np.uint8).data.cast("B")
                continue
            arr = np.empty(entry.shape, dtype=np.dtype(entry.dtype))
            b.values[i] = arr
            b.dests[i] = arr.reshape(-1).view(np.uint8).data.cast("B")
        else:
            buf = bytearray(entry.nbytes)
            b.values[i] = buf
            b.dests[i] = memoryview(buf)
    return b


def fetch_stream(
    manifest: ShardManifest,
    stream: memoryview,
    fetcher: ChunkFetcher,
    order: Sequence[TierSlot],
    pool: Executor,
    *,
    expect: Sequence[str] = (),
) -> None:
    """Fetch and verify every chunk of ``manifest`` into its place in ``stream`` (at least
    ``manifest.stream_bytes`` long). Raises as :meth:`ChunkFetcher.fetch` does; the
    caller's state is not touched."""

    def one(ref_index: int) -> None:
        ref = manifest.chunks[ref_index]
        fetcher.fetch(
            ref.id, stream[ref.offset : ref.offset + ref.length], order=order, expect=expect
        )

    map_all(pool, one, range(len(manifest.chunks)))


_BIG_COPY = 1 << 20  # torch copies a tensor this large on several threads


def load_stream(manifest: ShardManifest, binding: Binding, stream: memoryview) -> None:
    """Copy each entry's bytes from the staged ``stream`` into its destination."""
    import torch

    for i, entry in enumerate(manifest.entries):
        if not entry.nbytes:
            continue
        dst = binding.dests.get(i)
        if dst is None:  # a log version's gradient, or a piece assembled by reshard.py
            continue
        src = stream[entry.offset : entry.offset + entry.nbytes]
        if entry.nbytes >= _BIG_COPY:
            torch.frombuffer(dst, dtype=torch.uint8).copy_(torch.frombuffer(src, dtype=torch.uint8))
        else:
            dst[:] = src


def materialize(
    manifest: ShardManifest,
    binding: Binding,
    state: Any,
    *,
    allow_pickle: bool = False,
    replayed: Mapping[str, Any] | None = None,
    undo: Undo | None = None,
) -> Any:
    """Put restored values into ``state`` (in place where possible) and return it.
    ``replayed`` holds the tensors of a log version's ``{"r": NAME}`` leaves. ``undo``
    (covering ``binding``) is told of each container before it is changed and of each
    object before its ``load_state_dict`` runs, so that a failure can be undone."""
    import torch

    entries = manifest.entries

    def value_of(i: int, target: Any) -> Any:
        entry = entries[i]
        if entry.kind in ("tensor", "ndarray"):
            if i in binding.values:
                fresh = binding.values[i]
                bound = binding.targets.get(i)
                if isinstance(bound, torch.Tensor):  # a CUDA or strided target
                    with torch.no_grad():
                        bound.copy_(fresh)
                    return bound
                if isinstance(bound, np.ndarray):
                    np.copyto(bound, fresh)
                    return bound
                return fresh
            return binding.targets[i]
        return decode_scalar(entry.kind, binding.dests[i], entry.key, allow_pickle)

    def build(node: Any, target: Any, key: str) -> Any:
        ((tag, sub),) = node.items()
        if tag in ("e", "s"):
            return value_of(sub, target)
        if tag == "r":
            if replayed is None or sub not in replayed:
                raise StateError(f"the replay did not produce {sub!r}", key=key)
            return replayed[sub]
        if tag == "o":
            sd = binding.stateful.get(id(node))
            restored = build(sub, sd if sd is not None else _MISSING, key)
            if target is not _MISSING and is_stateful(target):
                if undo is not None:
                    undo.touched(target)
                try:
                    target.load_state_dict(restored)
                except Exception as exc:
                    raise StateError(f"load_state_dict failed: {exc}", key=key) from exc
                return target
            return restored
        if tag == "d":
            if isinstance(target, dict):
                if undo is not None:
                    undo.container(target)
                for k, child in sub:
                    target[k] = build(child, target.get(k, _MISSING), _child(key, k))
                return target
            return {k: build(child, _MISSING, _child(key, k)) for k, child in sub}
        if tag in ("l", "t"):
            items = [
                build(
                    child,
                    target[i]
                    if isinstance(target, (list, tuple)) and i < len(target)
                    else _MISSING,
                    _child(key, i),
                )
                for i, child in enumerate(sub)
            ]
            if tag == "l" and isinstance(target, list) and len(target) == len(items):
                if undo is not None:
                    undo.container(target)
                target[:] = items
                return target
            return tuple(items) if tag == "t" else items
        raise StateError(f"unknown tree node {tag!r}", key=key)

    return build(manifest.tree, state if state is not None else _MISSING, "")


def _child(key: str, k: object) -> str:
    """The flattened key of member ``k`` of the node at ``key`` (as :func:`bind` names it)."""
    return f"{key}/{k}" if key else str(k)


def _local(t: Any) -> Any:
    """The tensor holding a tensor's bytes here: a DTensor's local piece, else itself."""
    return t._local_tensor if is_dtensor(t) else t


class Undo:
    """What a restore is about to change in the caller's state, kept so that a restore
    that fails can put it all back (issue 21): the restore is all or nothing.

    Why a snapshot and not a dry run into fresh objects: the caller's modules and
    optimizers cannot be copied cheaply or faithfully (an optimizer refers to the model's
    parameters, a module *is* the model), and ``load_state_dict`` is the object's own
    code: it may raise after changing part of the object (``nn.Module`` copies every
    parameter that fits before it raises for one that does not), and some read the values
    when called (an RNG state), so the values cannot be loaded later than the call. So
    what will be written is kept before anything is: the bytes of every caller tensor and
    array the restore writes or an object's ``state_dict()`` holds (once per piece of
    memory, a CUDA tensor's in host memory), every object's ``state_dict()`` as a tree of
    fresh containers whose tensors are those same caller tensors, and each container of
    the state before a member of it is replaced. It costs one copy of the state, made
    before the first byte is written: :meth:`keep` makes it on the I/O pool while the
    version's chunks are still being fetched, and :meth:`on_failure` waits for it before
    letting the load begin. A success throws it away.

    :meth:`rollback`, in reverse: the kept bytes are copied back into the same tensors
    (identities kept), containers get their members back, gradients the replay replaced
    are put back, then each object whose ``load_state_dict`` ran (or the replay stepped)
    is compared with what it was and, if it differs, given ``load_state_dict`` of its kept
    ``state_dict()``, whose tensors are its own again, and compared once more. What still
    differs is reported, never passed over.
    """

    def __init__(self) -> None:
        self._tensors: dict[tuple[Any, ...], Any] = {}  # memory -> the live tensor or array
        self._kept: dict[tuple[Any, ...], Any] = {}  # memory -> its copy
        self._copying: dict[tuple[Any, ...], Future[Any]] = {}
        self._objects: dict[int, tuple[str, Any, Any]] = {}  # id -> (key, object, kept sd)
        self._touched: dict[int, Any] = {}  # id -> object whose load_state_dict may have run
        self._containers: list[tuple[dict[Any, Any] | list[Any], Any]] = []
        self._grads: list[tuple[Any, Any]] = []  # (parameter, its .grad before)

    # --- before anything is written ------------------------------------------------------

    def cover(self, binding: Binding) -> None:
        """Keep everything a load of ``binding`` can write (call before the first byte is)."""
        for node_id, (key, obj) in binding.objects.items():
            self.object(key, obj, binding.stateful.get(node_id))
        for target in binding.targets.values():
            self.tensor(target)
        for piece in binding.pieces:
            self.tensor(piece.dest)

    def object(self, key: str, obj: Any, sd: Mapping[str, Any] | None = None) -> None:
        """Keep ``obj``'s state (``sd``: its ``state_dict()`` taken now, if already taken)."""
        if id(obj) in self._objects:
            return
        current = obj.state_dict() if sd is None else sd
        self._objects[id(obj)] = (key, obj, self._tree(current))

    def tensor(self, t: Any) -> None:
        """Keep the bytes of a caller tensor or array the restore may write (copied by
        :meth:`keep`, or by :meth:`ready` at the latest)."""
        import torch

        if isinstance(t, np.ndarray):
            if t.size and t.flags.writeable:
                where = t.__array_interface__["data"][0]
                k: tuple[Any, ...] = ("ndarray", where, t.shape, t.strides, t.dtype.str)
                self._tensors.setdefault(k, t)
            return
        if not isinstance(t, torch.Tensor):
            return
        t = _local(t)
        if not t.numel() or t.is_meta or t.layout != torch.strided:
            return
        where = t.untyped_storage().data_ptr()
        self._tensors.setdefault(
            (t.device, where, t.storage_offset(), t.shape, t.stride(), t.dtype), t
        )

    def keep(self, pool: Executor) -> None:
        """Start copying, on ``pool``, every tensor noted so far and not copied yet."""
        for k, t in self._tensors.items():
            if k not in self._kept and k not in self._copying:
                self._copying[k] = pool.submit(_copy_of, t)

    def ready(self) -> None:
        """Wait until every noted tensor is copied (copying the rest here). Raises
        :class:`~tiercheck.errors.StateError` if a copy cannot be made (out of memory,
        say): then nothing has been written."""
        try:
            for k, t in self._tensors.items():
                if k in self._kept:
                    continue
                copying = self._copying.pop(k, None)
                self._kept[k] = copying.result() if copying is not None else _copy_of(t)
        except Exception as exc:
            self.discard()
            raise StateError(
                f"could not keep a copy of the state to put back should the restore fail "
                f"({type(exc).__name__}: {exc}); nothing of the state was written"
            ) from exc

    def discard(self) -> None:
        """Drop the copies (the restore did not get to load: nothing to put back)."""
        for copying in self._copying.values():
            copying.cancel()
        self._copying.clear()
        self._kept.clear()

    def grads(self, params: Sequence[Any]) -> None:
        """Keep which ``.grad`` each parameter has (the replay sets and clears them)."""
        self._grads.extend((p, p.grad) for p in params)

    def _tree(self, value: Any) -> Any:
        """A copy of a ``state_dict()``'s containers whose tensors are the same objects,
        their bytes kept (a dict keeps its type and attributes: a module's ``_metadata``)."""
        import torch

        if isinstance(value, (torch.Tensor, np.ndarray)):
            self.tensor(value)
            return value
        if isinstance(value, dict):
            try:
                out = copy.copy(value)
            except Exception:
                out = dict(value)
            for k in list(out):
                out[k] = self._tree(out[k])
            return out
        if isinstance(value, list):
            return [self._tree(v) for v in value]
        if isinstance(value, tuple):
            items = [self._tree(v) for v in value]
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        if isinstance(value, (set, bytearray)):
            return copy.copy(value)
        return value

    # --- while loading ---------------------------------------------------------------------

    def container(self, c: dict[Any, Any] | list[Any]) -> None:
        """``c`` is about to have members replaced."""
        self._containers.append((c, dict(c) if isinstance(c, dict) else list(c)))

    def touched(self, obj: Any) -> None:
        """``obj.load_state_dict`` (or a replayed step) is about to change ``obj``."""
        self._touched[id(obj)] = obj

    # --- on failure --------------------------------------------------------------------------

    def rollback(self) -> list[str]:
        """Put the state back as it was; return what could not be put back (empty: all)."""
        import torch

        problems: list[str] = []
        with torch.no_grad():
            for k, live in self._tensors.items():
                kept = self._kept.get(k)
                try:
                    if kept is None:
                        raise StateError("its bytes were not kept before the restore")
                    if isinstance(live, np.ndarray):
                        np.copyto(live, kept)
                    else:
                        live.detach().copy_(kept)
                except Exception as exc:
                    problems.append(f"a {tuple(live.shape)} tensor: {exc}")
        for c, members in reversed(self._containers):
            if isinstance(c, dict):
                c.clear()
                c.update(members)
            else:
                c[:] = members
        for p, grad in reversed(self._grads):
            p.grad = grad
        for obj_id, obj in reversed(self._touched.items()):
            key, _, kept = self._objects.get(obj_id, (type(obj).__qualname__, obj, None))
            try:
                if kept is None:
                    raise StateError("its state was not kept before the restore")
                if _same(obj.state_dict(), kept):
                    continue
                try:
                    obj.load_state_dict(kept)
                except Exception:
                    if not _same(obj.state_dict(), kept):
                        raise
                if not _same(obj.state_dict(), kept):
                    raise StateError(
                        "load_state_dict of its state before the restore did not give "
                        "that state back"
                    )
            except Exception as exc:
                problems.append(f"{key or 'the state'}: {type(exc).__name__}: {exc}")
        return problems

    @contextmanager
    def on_failure(self, what: str) -> Iterator[None]:
        """Roll back if the block raises; then raise a typed error saying what failed:
        a :class:`~tiercheck.errors.TiercheckError` as it is, anything else as a
        :class:`~tiercheck.errors.StateError`. If something could not be put back, a
        :class:`StateError` names it (the state is then partly restored). Waits for the
        copies first (:meth:`ready`)."""
        self.ready()
        try:
            yield
        except BaseException as exc:
            problems = self.rollback()
            key = exc.key if isinstance(exc, StateError) else ""
            if problems:
                raise StateError(
                    f"{what} failed ({type(exc).__name__}: {exc}), and putting the state "
                    f"back failed too for {'; '.join(problems)}: the state is partly "
                    "restored; restore again (or rebuild it) before training on",
                    key=key,
                ) from exc
            if isinstance(exc, TiercheckError):
                exc.add_note(f"{what} failed; the state was left as it was before restore()")
                raise
            if isinstance(exc, Exception):
                raise StateError(
                    f"{what} failed ({type(exc).__name__}: {exc}); the state was left as "
                    "it was before restore()"
                ) from exc
            raise


def _copy_of(t: Any) -> Any:
    """A copy of a tensor's or array's bytes, a device tensor's in host memory."""
    if isinstance(t, np.ndarray):
        return t.copy()
    return t.detach().clone() if t.device.type == "cpu" else t.detach().to("cpu")


def _same(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` hold the same values, tensors compared bit for bit."""
    import torch

    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        a, b = _local(a), _local(b)
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.device == b.device and (
            a.untyped_storage().data_ptr(),
            a.storage_offset(),
            a.stride(),
        ) == (b.untyped_storage().data_ptr(), b.storage_offset(), b.stride()):
            return True

        def raw(t: torch.Tensor) -> torch.Tensor:
            return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)

        return bool(torch.equal(raw(a), raw(b)))
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return bool(b != b)
    try:
        return bool(a == b)
    except Exception:
        return False
