"""Restore's fetch and load steps: read and verify a version, then write it in place.

:func:`fetch_stream` reads every chunk in parallel from the fastest tier holding the
version, falling back tier by tier and repairing bad copies (:mod:`tiercheck.store.fetch`),
and decodes it into its place in a staging buffer laid out like the saved stream. Where
the fastest tier holds its blobs in memory it can pin (shm, ``memory://``:
:meth:`~tiercheck.backends.base.Tier.pin`), a chunk whose bytes all go to the caller's
host tensors is instead verified where it lies and never copied to staging
(:class:`VerifiedStream`): each byte is then copied once, from the tier into its tensor.
:func:`load_stream` copies each entry from there into its destination, and
:func:`materialize` puts the values in place: dict and list members are
replaced, stateful objects get ``load_state_dict``, each change told to the
:class:`~tiercheck.restore.undo.Undo` first so that a failure can be put back.

A log version (issue 11) is read as its base version plus its own shard, both staged and
verified before anything of the caller's changes; then the base is loaded, the log's steps
are replayed into the guarded optimizer and verified (:mod:`tiercheck.logversions.replay`),
and the log version's own leaves are loaded, ``{"r": NAME}`` nodes taking the replayed
tensors (:class:`~tiercheck.restore.service.RestoreService` runs that sequence).
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tiercheck.backends.base import Later, Pins, copy_bytes
from tiercheck.core.entries import decode_scalar, is_stateful, tensor_place
from tiercheck.errors import StateError, TiercheckError
from tiercheck.formats.manifest import ChunkRef, ShardManifest
from tiercheck.restore.binding import MISSING, Binding
from tiercheck.restore.devices import DeviceStream, copy_to_devices
from tiercheck.runtime.parallel import map_all
from tiercheck.store.fetch import ChunkFetcher
from tiercheck.store.tierset import TierSlot

if TYPE_CHECKING:
    from tiercheck.restore.undo import Undo

__all__ = [
    "InPlace",
    "PinnedTiers",
    "VerifiedStream",
    "copied_on_load",
    "fetch_stream",
    "load_stream",
    "materialize",
    "plan_in_place",
    "reload",
]


class PinnedTiers:
    """The pins (:meth:`~tiercheck.backends.base.Tier.pin`) a restore holds, one per tier,
    taken when a shard's reads are planned (on the restore's own thread) and released by
    :meth:`close` when the restore is over: until then the chunks verified there cannot
    change."""

    def __init__(self) -> None:
        self._pins: dict[str, Pins | None] = {}

    def of(self, slot: TierSlot) -> Pins | None:
        """``slot``'s pins (None where its tier cannot pin now: read it into staging)."""
        if slot.name not in self._pins:
            try:
                self._pins[slot.name] = slot.tier.pin() if slot.tier is not None else None
            except (TiercheckError, OSError):
                self._pins[slot.name] = None
        return self._pins[slot.name]

    def close(self, later: Later | None = None) -> None:
        """Release every pin, what need not hold up the caller (shm's unmapping) on
        ``later`` where given (:meth:`~tiercheck.backends.base.Pins.close`)."""
        pins, self._pins = list(self._pins.values()), {}
        for p in pins:
            if p is not None:
                p.close(later)


class VerifiedStream:
    """A version's verified stream: ``stream`` (the staging buffer), except the chunks in
    ``in_place`` (chunk index -> its verified bytes where a tier holds them), which were
    not copied to staging. :meth:`pieces` says where each byte range is."""

    def __init__(
        self, stream: memoryview, chunks: Sequence[ChunkRef], in_place: Mapping[int, memoryview]
    ) -> None:
        self.stream = stream
        self._chunks = chunks
        self._in_place = in_place
        self._starts = [ref.offset for ref in chunks] if in_place else []

    def pieces(self, offset: int, nbytes: int) -> list[tuple[int, memoryview]]:
        """The bytes ``[offset, offset + nbytes)`` of the stream as ``(position in the
        range, bytes)`` pieces, one per chunk read in place, else from staging."""
        if not self._in_place:
            return [(0, self.stream[offset : offset + nbytes])]
        out: list[tuple[int, memoryview]] = []
        pos, end = offset, offset + nbytes
        k = bisect.bisect_right(self._starts, offset) - 1
        staged_from = -1  # where the run of staged bytes being gathered began
        while pos < end:
            ref = self._chunks[k]
            stop = min(end, ref.offset + ref.length)
            view = self._in_place.get(k)
            if view is not None:
                if staged_from >= 0:
                    out.append((staged_from - offset, self.stream[staged_from:pos]))
                    staged_from = -1
                out.append((pos - offset, view[pos - ref.offset : stop - ref.offset]))
            elif staged_from < 0:
                staged_from = pos
            pos = stop
            k += 1
        if staged_from >= 0:
            out.append((staged_from - offset, self.stream[staged_from:end]))
        return out


@dataclass(frozen=True)
class InPlace:
    """Where a restore verifies chunks in place: the tier of ``slot``, pinned (``pins``),
    for the chunks ``chunks`` (indexes into the manifest's); ``every``: all of them, so
    the stream needs no staging buffer at all."""

    slot: TierSlot
    pins: Pins
    chunks: frozenset[int]
    every: bool


def plan_in_place(
    manifest: ShardManifest,
    binding: Binding,
    order: Sequence[TierSlot],
    pinned: PinnedTiers | None,
) -> InPlace | None:
    """Which chunks of ``manifest`` :func:`fetch_stream` verifies where the fastest tier of
    ``order`` holds them: those bound only for ``binding``'s host destinations, if that tier
    pins now (else None: every chunk is read into staging). Not with tensors on a GPU:
    their bytes go from staging to the device window by window."""
    first = next((s for s in order if s.tier is not None), None)
    if pinned is None or binding.device or first is None:
        return None
    chunks = _host_only_chunks(manifest, binding)
    pins = pinned.of(first) if chunks else None
    if pins is None:
        return None
    return InPlace(first, pins, frozenset(chunks), len(chunks) == len(manifest.chunks))


def fetch_stream(
    manifest: ShardManifest,
    stream: memoryview,
    fetcher: ChunkFetcher,
    order: Sequence[TierSlot],
    pool: Executor,
    *,
    expect: Sequence[str] = (),
    binding: Binding | None = None,
    in_place: InPlace | None = None,
) -> VerifiedStream:
    """Fetch and verify every chunk of ``manifest`` into its place in ``stream`` (at least
    ``manifest.stream_bytes`` long). Raises as :meth:`ChunkFetcher.fetch` does; the
    caller's state is not touched. Where ``binding`` has tensors on a GPU, each window of
    verified bytes bound for them goes on to a copy of the stream on that device while the
    next chunks are read (:class:`~tiercheck.restore.devices.DeviceStream`).

    The chunks of ``in_place`` are verified where its tier holds them
    (:meth:`ChunkFetcher.fetch_in_place`) and left there; one that cannot be (damaged
    there, say) is fetched as the others are, into a buffer of its own where ``stream`` is
    not staging for every chunk (``in_place.every``). The result says where each chunk is."""
    on_device = None
    if binding is not None and binding.device:
        on_device = binding.on_device = DeviceStream.for_binding(manifest, binding.device, stream)
    refs = manifest.chunks
    verified: dict[int, memoryview] = {}

    def one(ref_index: int) -> None:
        ref = refs[ref_index]
        if in_place is not None and ref_index in in_place.chunks:
            view = fetcher.fetch_in_place(
                ref.id, in_place.slot, in_place.pins, ref.length, ref.check
            )
            if view is None and in_place.every:  # no staging: a buffer of its own
                view = memoryview(bytearray(ref.length))
                fetcher.fetch(ref.id, view, order=order, expect=expect, check=ref.check)
            if view is not None:
                verified[ref_index] = view
                return
        fetcher.fetch(
            ref.id,
            stream[ref.offset : ref.offset + ref.length],
            order=order,
            expect=expect,
            check=ref.check,
        )
        if on_device is not None:
            on_device.verified(ref.offset, ref.length)

    lanes = _lanes(order)
    try:
        if lanes >= len(refs):
            map_all(pool, one, range(len(refs)))
        else:
            # one chunk after another per lane: each is hashed right after its read, still
            # in cache
            _on_lanes(one, len(refs), lanes)
    except BaseException:
        if on_device is not None:  # no copy may go on reading staging that is reused
            on_device.abandon()
        raise
    return VerifiedStream(stream, refs, verified)


def _host_only_chunks(manifest: ShardManifest, binding: Binding) -> set[int]:
    """The chunks whose every entry's bytes :func:`load_stream` copies into a host
    destination (``binding.dests``): no other step reads their bytes from the stream (a
    device copy, a piece of a distributed tensor, a log version's gradients do)."""
    spans = sorted(
        (e.offset, e.offset + e.nbytes, i) for i, e in enumerate(manifest.entries) if e.nbytes
    )
    out: set[int] = set()
    j = 0
    for k, ref in enumerate(manifest.chunks):
        start, end = ref.offset, ref.offset + ref.length
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        m = j
        while m < len(spans) and spans[m][0] < end and spans[m][2] in binding.dests:
            m += 1
        if m == len(spans) or spans[m][0] >= end:
            out.add(k)
    return out


_MEMORY_RANK = 10  # speed_rank of the tiers in this host's memory (memory 0, shm 10)


def _lanes(order: Sequence[TierSlot]) -> int:
    """How many chunks to read at once. From a tier in host memory a read is a memcpy and
    its check a hash, both bound by the CPU: one chunk per core keeps each chunk in cache
    between its read and its hash, where every thread of the pool would hold far more in
    flight than the cache (1 GiB from shm on 2 cores: 0.31-0.37 s against 0.35-0.42 s).
    Any other tier waits on I/O: as many at once as the store's I/O pool runs."""
    slots = [s for s in order if s.tier is not None]
    if slots and slots[0].speed_rank <= _MEMORY_RANK:
        return max(2, os.cpu_count() or 1)
    return 1 << 30


_COPY_PIECE = 4 << 20  # host copies are cut into pieces of this size, spread over threads
_COPY_ALONE = 8 << 20  # below this many bytes in all, copied on the caller's thread


def load_stream(
    manifest: ShardManifest,
    binding: Binding,
    source: VerifiedStream,
    *,
    loose: bool = False,
    only: Collection[int] | None = None,
) -> None:
    """Copy entries' bytes from the verified ``source`` into their destinations, each byte
    once: into a host destination by memcpys (spread over the cores, without the GIL),
    from the tier's own copy where the chunk was verified in place; into a tensor on a GPU
    from the device copy of the stream :func:`fetch_stream` made where it could, else by
    a host-to-device copy (:mod:`tiercheck.restore.devices`; awaited before this returns).

    ``loose=False`` writes every entry but the binding's loose ones (which an undo copy
    covers, then :func:`materialize` runs); ``loose=True`` writes the loose ones, last,
    when nothing of the restore can fail any more (:class:`~tiercheck.restore.undo.Undo`).
    ``only``: exactly these entries, loose or not.
    """
    stream = source.stream
    on_device = binding.on_device
    to_device: list[tuple[Any, memoryview]] = []
    from_device: list[tuple[Any, int, int]] = []
    copies: list[tuple[memoryview, memoryview]] = []
    for i, entry in enumerate(manifest.entries):
        if not entry.nbytes or ((i in binding.loose) != loose if only is None else i not in only):
            continue
        target = binding.device.get(i)
        if target is not None:
            if (
                on_device is not None
                and target.device == on_device.device
                and on_device.holds(entry.offset, entry.nbytes)
            ):
                from_device.append((target, entry.offset, entry.nbytes))
            else:
                to_device.append((target, stream[entry.offset : entry.offset + entry.nbytes]))
            continue
        dst = binding.dests.get(i)
        if dst is None:  # a log version's gradient, or a piece assembled by reshard.py
            continue
        for at, src in source.pieces(entry.offset, entry.nbytes):
            for cut in range(0, len(src), _COPY_PIECE):
                n = min(_COPY_PIECE, len(src) - cut)
                copies.append((dst[at + cut : at + cut + n], src[cut : cut + n]))
    _copy_all(copies)
    if from_device:
        assert on_device is not None
        on_device.load(from_device)
    if to_device:
        copy_to_devices(to_device)


def _copy_all(copies: Sequence[tuple[memoryview, memoryview]]) -> None:
    """Each ``dst[:] = src`` of ``copies``: over one lane per core when there is enough to
    copy (numpy's copy releases the GIL)."""
    lanes = min(len(copies), os.cpu_count() or 1)
    if lanes < 2 or sum(len(d) for d, _ in copies) < _COPY_ALONE:
        for dst, src in copies:
            copy_bytes(dst, src)
        return
    _on_lanes(lambda i: copy_bytes(*copies[i]), len(copies), lanes)


def _on_lanes(do: Callable[[int], None], count: int, lanes: int) -> None:
    """``do(i)`` for every ``i < count`` on ``lanes`` threads of the caller's priority (not
    the store's background pool, which is niced: the caller waits for this as a trainer
    waits for its staging copy), lane ``k`` taking ``k, k + lanes, ...`` in order; the
    first failure stops every lane and is raised."""
    failed = threading.Event()

    def lane(first: int) -> None:
        for i in range(first, count, lanes):
            if failed.is_set():
                return
            try:
                do(i)
            except BaseException:
                failed.set()
                raise

    with ThreadPoolExecutor(lanes, thread_name_prefix="tiercheck-restore") as own:
        map_all(own, lane, range(lanes))


def materialize(
    manifest: ShardManifest,
    binding: Binding,
    state: Any,
    *,
    allow_pickle: bool = False,
    replayed: Mapping[str, Any] | None = None,
    undo: Undo | None = None,
    loaded: dict[int, Any] | None = None,
) -> Any:
    """Put restored values into ``state`` (in place where possible) and return it.
    ``replayed`` holds the tensors of a log version's ``{"r": NAME}`` leaves. ``undo``
    (covering ``binding``) is told of each container before it is changed and of each
    object before its ``load_state_dict`` runs, so that a failure can be undone.
    ``loaded`` gets, for each object that loads by reference, what its
    ``load_state_dict`` was given (id of its tree node -> that state)."""
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
        if tag == "e" and sub in binding.merges:
            return merge(target, value_of(sub, target), key, binding.merges[sub], undo)
        if tag in ("e", "s"):
            return value_of(sub, target)
        if tag == "r":
            if replayed is None or sub not in replayed:
                raise StateError(f"the replay did not produce {sub!r}", key=key)
            return replayed[sub]
        if tag == "o":
            sd = binding.stateful.get(id(node))
            restored = build(sub, sd if sd is not None else MISSING, key)
            if target is not MISSING and is_stateful(target):
                if undo is not None:
                    undo.touched(target)
                reload(target, restored, key)
                if loaded is not None and id(node) in binding.by_reference:
                    loaded[id(node)] = restored
                return target
            return restored
        if tag == "d":
            if isinstance(target, dict):
                if undo is not None:
                    undo.container(target)
                for k, child in sub:
                    target[k] = build(child, target.get(k, MISSING), _child(key, k))
                return target
            return {k: build(child, MISSING, _child(key, k)) for k, child in sub}
        if tag in ("l", "t"):
            items = [
                build(
                    child,
                    target[i] if isinstance(target, (list, tuple)) and i < len(target) else MISSING,
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

    return build(manifest.tree, state if state is not None else MISSING, "")


def merge(target: Any, value: Any, key: str, strict: bool, undo: Undo | None) -> Any:
    """Put a saved Python value into the caller's dict or list ``target`` in place, as a
    dict of tensors is: a dict's keys checked as ``strict`` says (each nested dict in turn)
    and its members replaced, each nested dict or list in place too; a list's items
    replaced (``undo`` told of each container first). A value of another type where the
    state holds a container raises :class:`StateError`."""
    if isinstance(target, list) and isinstance(value, list):
        if undo is not None:
            undo.container(target)
        target[:] = value
        return target
    if not isinstance(target, dict) or not isinstance(value, dict):
        raise StateError(
            f"saved a value of type {type(value).__qualname__}, the state has "
            f"{type(target).__qualname__}",
            key=key,
        )
    if strict:
        extra = [k for k in target if k not in value]
        if extra:
            raise StateError(
                f"the state has key {extra[0]!r} that the checkpoint does not "
                "(pass strict=False to leave such keys alone)",
                key=_child(key, extra[0]),
            )
        missing = [k for k in value if k not in target]
        if missing:
            raise StateError(
                "the checkpoint has this key but the state does not (pass strict=False to add it)",
                key=_child(key, missing[0]),
            )
    if undo is not None:
        undo.container(target)
    for k, v in value.items():
        held = target.get(k)
        if (isinstance(held, dict) and isinstance(v, dict)) or (
            isinstance(held, list) and isinstance(v, list)
        ):
            merge(held, v, _child(key, k), strict, undo)
        else:
            target[k] = v
    return target


def reload(obj: Any, restored: Any, key: str) -> None:
    """``obj.load_state_dict(restored)``, a failure a :class:`StateError` naming ``key``."""
    try:
        obj.load_state_dict(restored)
    except Exception as exc:
        raise StateError(f"load_state_dict failed: {exc}", key=key) from exc


def copied_on_load(binding: Binding) -> set[int]:
    """The objects of ``binding.by_reference`` (ids of their tree nodes) whose
    ``load_state_dict`` did not keep every tensor the restore writes: their state, read
    again, lacks one (an optimizer's state tensor of another dtype than its parameter is
    converted, so copied). Their bytes must be written, and they loaded again."""
    import torch

    def tensors(value: Any) -> Iterator[Any]:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, Mapping):
            for v in value.values():
                yield from tensors(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                yield from tensors(v)

    out: set[int] = set()
    for node_id, entries in binding.by_reference.items():
        written = [binding.targets[i] for i in entries]
        written = [t for t in written if isinstance(t, torch.Tensor) and t.numel()]
        if not written:
            continue
        held = {tensor_place(t) for t in tensors(binding.objects[node_id][1].state_dict())}
        if any(tensor_place(t) not in held for t in written):
            out.add(node_id)
    return out


def _child(key: str, k: object) -> str:
    """The flattened key of member ``k`` of the node at ``key`` (as :func:`bind` names it)."""
    return f"{key}/{k}" if key else str(k)
