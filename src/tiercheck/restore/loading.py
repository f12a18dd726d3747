"""Restore's fetch and load steps: read and verify a version, then write it in place.

:func:`fetch_stream` reads every chunk in parallel from the fastest tier holding the
version, falling back tier by tier and repairing bad copies (:mod:`tiercheck.store.fetch`),
and decodes it into its place in a staging buffer laid out like the saved stream.
:func:`load_stream` copies each entry from staging into its destination (one memcpy per
entry), and :func:`materialize` puts the values in place: dict and list members are
replaced, stateful objects get ``load_state_dict``, each change told to the
:class:`~tiercheck.restore.undo.Undo` first so that a failure can be put back.

A log version (issue 11) is read as its base version plus its own shard, both staged and
verified before anything of the caller's changes; then the base is loaded, the log's steps
are replayed into the guarded optimizer and verified (:mod:`tiercheck.logversions.replay`),
and the log version's own leaves are loaded, ``{"r": NAME}`` nodes taking the replayed
tensors (:class:`~tiercheck.restore.service.RestoreService` runs that sequence).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from tiercheck.core.entries import decode_scalar, is_stateful
from tiercheck.errors import StateError
from tiercheck.formats.manifest import ShardManifest
from tiercheck.restore.binding import MISSING, Binding
from tiercheck.restore.devices import DeviceStream, copy_to_devices
from tiercheck.runtime.parallel import map_all
from tiercheck.store.fetch import ChunkFetcher
from tiercheck.store.tierset import TierSlot

if TYPE_CHECKING:
    from tiercheck.restore.undo import Undo

__all__ = ["fetch_stream", "load_stream", "materialize"]


def fetch_stream(
    manifest: ShardManifest,
    stream: memoryview,
    fetcher: ChunkFetcher,
    order: Sequence[TierSlot],
    pool: Executor,
    *,
    expect: Sequence[str] = (),
    binding: Binding | None = None,
) -> None:
    """Fetch and verify every chunk of ``manifest`` into its place in ``stream`` (at least
    ``manifest.stream_bytes`` long). Raises as :meth:`ChunkFetcher.fetch` does; the
    caller's state is not touched. Where ``binding`` has tensors on a GPU, each window of
    verified bytes bound for them goes on to a copy of the stream on that device while the
    next chunks are read (:class:`~tiercheck.restore.devices.DeviceStream`)."""
    on_device = None
    if binding is not None and binding.device:
        on_device = binding.on_device = DeviceStream.for_binding(manifest, binding.device, stream)

    def one(ref_index: int) -> None:
        ref = manifest.chunks[ref_index]
        fetcher.fetch(
            ref.id, stream[ref.offset : ref.offset + ref.length], order=order, expect=expect
        )
        if on_device is not None:
            on_device.verified(ref.offset, ref.length)

    refs = manifest.chunks
    lanes = _lanes(order)
    failed = threading.Event()

    def lane(first: int) -> None:
        # one chunk after another: each is hashed right after its read, still in cache
        for i in range(first, len(refs), lanes):
            if failed.is_set():
                return
            try:
                one(i)
            except BaseException:
                failed.set()
                raise

    try:
        if lanes >= len(refs):
            map_all(pool, one, range(len(refs)))
        else:
            # threads of the caller's priority, not the store's background pool (niced):
            # the caller waits for this as a trainer waits for its staging copy
            with ThreadPoolExecutor(lanes, thread_name_prefix="tiercheck-restore") as own:
                map_all(own, lane, range(lanes))
    except BaseException:
        if on_device is not None:  # no copy may go on reading staging that is reused
            on_device.abandon()
        raise


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


_BIG_COPY = 1 << 20  # torch copies a tensor this large on several threads


def load_stream(
    manifest: ShardManifest, binding: Binding, stream: memoryview, *, loose: bool = False
) -> None:
    """Copy entries' bytes from the verified ``stream`` into their destinations, each byte
    once: into a host destination by a memcpy (several threads for a large one), into a
    tensor on a GPU from the device copy of the stream :func:`fetch_stream` made where it
    could, else by a host-to-device copy (:mod:`tiercheck.restore.devices`; awaited before
    this returns).

    ``loose=False`` writes every entry but the binding's loose ones (which an undo copy
    covers, then :func:`materialize` runs); ``loose=True`` writes the loose ones, last,
    when nothing of the restore can fail any more (:class:`~tiercheck.restore.undo.Undo`).
    """
    import torch

    on_device = binding.on_device
    to_device: list[tuple[Any, memoryview]] = []
    from_device: list[tuple[Any, int, int]] = []
    for i, entry in enumerate(manifest.entries):
        if not entry.nbytes or (i in binding.loose) != loose:
            continue
        src = stream[entry.offset : entry.offset + entry.nbytes]
        target = binding.device.get(i)
        if target is not None:
            if (
                on_device is not None
                and target.device == on_device.device
                and on_device.holds(entry.offset, entry.nbytes)
            ):
                from_device.append((target, entry.offset, entry.nbytes))
            else:
                to_device.append((target, src))
            continue
        dst = binding.dests.get(i)
        if dst is None:  # a log version's gradient, or a piece assembled by reshard.py
            continue
        if entry.nbytes >= _BIG_COPY:
            torch.frombuffer(dst, dtype=torch.uint8).copy_(torch.frombuffer(src, dtype=torch.uint8))
        else:
            dst[:] = src
    if from_device:
        assert on_device is not None
        on_device.load(from_device)
    if to_device:
        copy_to_devices(to_device)


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
            restored = build(sub, sd if sd is not None else MISSING, key)
            if target is not MISSING and is_stateful(target):
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


def _child(key: str, k: object) -> str:
    """The flattened key of member ``k`` of the node at ``key`` (as :func:`bind` names it)."""
    return f"{key}/{k}" if key else str(k)
