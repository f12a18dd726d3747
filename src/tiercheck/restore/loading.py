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

from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import numpy as np

from tiercheck.core.entries import decode_scalar, is_stateful
from tiercheck.errors import StateError
from tiercheck.formats.manifest import ShardManifest
from tiercheck.restore.binding import MISSING, Binding
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


def load_stream(
    manifest: ShardManifest, binding: Binding, stream: memoryview, *, loose: bool = False
) -> None:
    """Copy entries' bytes from the verified ``stream`` into their destinations, each byte
    once: into a host destination by a memcpy (several threads for a large one), into a
    tensor on an accelerator by a host-to-device copy (on a side stream, asynchronous
    where ``stream`` is page-locked, awaited before this returns).

    ``loose=False`` writes every entry but the binding's loose ones (which an undo copy
    covers, then :func:`materialize` runs); ``loose=True`` writes the loose ones, last,
    when nothing of the restore can fail any more (:class:`~tiercheck.restore.undo.Undo`).
    """
    import torch

    to_device: list[tuple[Any, memoryview]] = []
    for i, entry in enumerate(manifest.entries):
        if not entry.nbytes or (i in binding.loose) != loose:
            continue
        src = stream[entry.offset : entry.offset + entry.nbytes]
        target = binding.device.get(i)
        if target is not None:
            to_device.append((target, src))
            continue
        dst = binding.dests.get(i)
        if dst is None:  # a log version's gradient, or a piece assembled by reshard.py
            continue
        if entry.nbytes >= _BIG_COPY:
            torch.frombuffer(dst, dtype=torch.uint8).copy_(torch.frombuffer(src, dtype=torch.uint8))
        else:
            dst[:] = src
    if to_device:
        _copy_to_devices(to_device)


def _copy_to_devices(items: Sequence[tuple[Any, memoryview]]) -> None:
    """Copy each host view into its device tensor. On CUDA the copies are queued on a side
    stream of the tensor's device, after the work already queued on its current stream
    (which may still read or write the tensor), and awaited once per device at the end:
    from a page-locked staging buffer they run while the next ones are queued."""
    import torch

    streams: dict[Any, Any] = {}
    with torch.no_grad():
        for target, src in items:
            flat = target.detach().view(-1).view(torch.uint8)
            host = torch.frombuffer(src, dtype=torch.uint8)
            if flat.device.type != "cuda":
                flat.copy_(host)
                continue
            side = streams.get(flat.device)
            if side is None:
                side = streams[flat.device] = torch.cuda.Stream(device=flat.device)  # type: ignore[no-untyped-call]
                side.wait_stream(torch.cuda.current_stream(flat.device))
            with torch.cuda.stream(side):
                flat.copy_(host, non_blocking=True)
        for side in streams.values():
            side.synchronize()


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
