"""Distributed tensors (DTensor, FSDP2): what a save stores of them, their local pieces.

A DTensor leaf is stored as this rank's local shard, an ordinary ``tensor`` entry,
plus a :class:`~tiercheck.formats.manifest.ShardPlacement` saying which box of the global
tensor it holds (SPEC.md section 14). Replicated pieces on several ranks are the same
chunks, stored once in a shared tier.

Restoring onto any mesh (resharding) is :mod:`tiercheck.restore.reshard`'s. An update
log copies, fingerprints and replays a DTensor's local tensor (:func:`local_tensor`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tiercheck.errors import StateError, UnsupportedValue
from tiercheck.formats.manifest import ShardPlacement

if TYPE_CHECKING:
    import torch

__all__ = [
    "box_of",
    "copy_box",
    "is_dtensor",
    "local_piece",
    "local_tensor",
]


def is_dtensor(obj: object) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (without importing it needlessly:
    no DTensor exists before its module has been imported)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(obj, module.DTensor)


def local_tensor(t: Any) -> Any:
    """The tensor holding ``t``'s elements on this rank: a DTensor's local piece, else
    ``t`` itself. What an update log copies, fingerprints and replays into."""
    return t._local_tensor if is_dtensor(t) else t


def _placement_names(t: Any, key: str, error: type[StateError]) -> tuple[str, ...]:
    from torch.distributed.tensor import Replicate, Shard

    names = []
    for p in t.placements:
        if type(p) is Shard:  # not _StridedShard (FSDP2 + TP): its piece is not one box
            names.append(f"S({p.dim})")
        elif isinstance(p, Replicate):
            names.append("R")
        else:
            raise error(
                f"DTensor placement {p} ({type(p).__name__}) is not supported (only Shard and "
                "Replicate); "
                "redistribute the tensor first",
                key=key,
            )
    return tuple(names)


# (global shape, mesh, placements) -> (mesh, placement names, local shape, offsets). Computing a
# layout costs ~0.3 ms of Python in torch; a model has thousands of DTensors of a few
# layouts, and save() computes them on the caller's thread. The mesh is kept in the value,
# so its id is not reused while the entry lives.
_LAYOUTS: dict[tuple[Any, ...], tuple[Any, tuple[str, ...], tuple[int, ...], tuple[int, ...]]] = {}
_LAYOUTS_MAX = 4096


def _layout(
    t: Any, key: str, error: type[StateError]
) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
    """Placement names, local shape and global offsets of this rank's piece of ``t``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, tuple(t.placements)
    cache_key = (tuple(t.shape), id(mesh), placements)
    hit = _LAYOUTS.get(cache_key)
    if hit is not None and hit[0] is mesh:
        return hit[1], hit[2], hit[3]
    names = _placement_names(t, key, error)
    if mesh.get_coordinate() is None:
        raise error("this rank is not in the DTensor's mesh", key=key)
    shape, offsets = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    result = (names, tuple(int(d) for d in shape), tuple(int(o) for o in offsets))
    if len(_LAYOUTS) >= _LAYOUTS_MAX:
        _LAYOUTS.clear()
    _LAYOUTS[cache_key] = (mesh, *result)
    return result


_MESH_SHAPES: dict[int, tuple[Any, tuple[int, ...]]] = {}


def _mesh_shape(mesh: Any) -> tuple[int, ...]:
    hit = _MESH_SHAPES.get(id(mesh))
    if hit is None or hit[0] is not mesh:
        if len(_MESH_SHAPES) >= _LAYOUTS_MAX:
            _MESH_SHAPES.clear()
        hit = _MESH_SHAPES[id(mesh)] = (mesh, tuple(int(d) for d in mesh.shape))
    return hit[1]


def box_of(t: Any, key: str) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The local tensor of DTensor ``t`` and the offsets of its box in the global tensor."""
    _, shape, offsets = _layout(t, key, StateError)
    local = t._local_tensor
    if tuple(local.shape) != shape:
        raise StateError(
            f"the DTensor's local tensor has shape {tuple(local.shape)}, its placements "
            f"give {shape}",
            key=key,
        )
    return local, offsets


def local_piece(t: Any, key: str) -> tuple[torch.Tensor, ShardPlacement]:
    """What a save stores for DTensor ``t``: its local tensor and its placement."""
    names, shape, offsets = _layout(t, key, UnsupportedValue)
    local = t._local_tensor
    if tuple(local.shape) != shape:
        raise UnsupportedValue(
            f"the DTensor's local tensor has shape {tuple(local.shape)}, its placements "
            f"give {shape}",
            key=key,
        )
    placement = ShardPlacement(
        global_shape=tuple(int(d) for d in t.shape),
        global_stride=tuple(int(s) for s in t.stride()),
        mesh_shape=_mesh_shape(t.device_mesh),
        placements=names,
        offsets=offsets,
    )
    return local, placement


def copy_box(
    src: torch.Tensor, src_offsets: Sequence[int], dst: torch.Tensor, dst_offsets: Sequence[int]
) -> int:
    """Copy the elements two boxes of one global tensor share: ``src`` holds the global
    elements from ``src_offsets`` on, ``dst`` those from ``dst_offsets`` on. Returns how
    many elements were copied (0 where the boxes do not overlap)."""
    import torch

    lo = [max(a, b) for a, b in zip(src_offsets, dst_offsets)]
    hi = [min(a + n, b + k) for a, n, b, k in zip(src_offsets, src.shape, dst_offsets, dst.shape)]
    if any(a >= z for a, z in zip(lo, hi)):
        return 0
    s, d = src, dst
    for dim, (a, z) in enumerate(zip(lo, hi)):
        s = s.narrow(dim, a - src_offsets[dim], z - a)
        d = d.narrow(dim, a - dst_offsets[dim], z - a)
    with torch.no_grad():
        d.copy_(s)
    return int(s.numel())
