"""Restore's binding step: each saved entry to the caller's tensor it goes into.

:func:`bind` walks the caller's state beside the saved tree and finds, for each saved
tensor, the caller's tensor to write into (same dtype and shape). Structure mismatches
outside stateful objects raise :class:`~tiercheck.errors.StateError` naming the key;
stateful objects (modules, optimizers) are checked by their own ``load_state_dict``, but
for a module's tensor of another dtype, which it would cast (so a restore would not be bit
for bit). Nothing is written yet. :func:`check_stream` checks that a manifest's chunks
tile its stream before any staging is sized from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from tiercheck.core.entries import is_stateful, torch_dtype
from tiercheck.core.sharded import is_dtensor
from tiercheck.errors import BlobCorrupt, StateError
from tiercheck.formats.manifest import Entry, ShardManifest
from tiercheck.restore.reshard import Piece, piece_for

if TYPE_CHECKING:
    import torch

    from tiercheck.restore.devices import DeviceStream

__all__ = ["MISSING", "Binding", "bind", "check_stream", "loads_by_reference"]


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
    # entry index -> the caller's contiguous tensor on an accelerator: loaded from staging
    # by host-to-device copies (loading.py), no host tensor of its own
    device: dict[int, Any] = field(default_factory=dict)
    # entries written straight into a caller's tensor outside every stateful object, or in
    # one that loads by reference: nothing after their write can fail, so they are written
    # last and need no undo copy (undo.py)
    loose: set[int] = field(default_factory=set)
    # id(tree node) -> the loose entries of a stateful object that loads by reference
    # (:func:`loads_by_reference`): its load_state_dict runs before their bytes are written
    by_reference: dict[int, set[int]] = field(default_factory=dict)
    # the verified stream's bytes for ``device``, copied to the GPU while it was read
    on_device: DeviceStream | None = None
    # entry index -> whether keys must match: a saved Python value (a dict or list of no
    # tensors, one leaf) whose place in the caller's state holds a dict or a list, which
    # the decoded value updates in place (loading.materialize)
    merges: dict[int, bool] = field(default_factory=dict)


def _byte_view_of_tensor(t: torch.Tensor) -> memoryview:
    import torch

    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data.cast("B")


def _on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` is a dense tensor in an accelerator's memory (not the host's)."""
    import torch

    return t.device.type not in ("cpu", "meta") and t.layout == torch.strided


def _fits(entry: Entry, target: Any) -> bool:
    import torch

    if entry.kind == "tensor" and isinstance(target, torch.Tensor):
        if target.is_conj() or target.is_neg():
            return False  # its bytes are not its values: _mismatch says so
        return bool(
            str(target.dtype).removeprefix("torch.") == entry.dtype
            and tuple(target.shape) == entry.shape
        )
    if entry.kind == "ndarray" and isinstance(target, np.ndarray):
        return bool(target.dtype.str == entry.dtype and target.shape == entry.shape)
    return False


def _mismatch(entry: Entry, target: Any) -> str:
    import torch

    if isinstance(target, torch.Tensor) and (target.is_conj() or target.is_neg()):
        view = "conjugate" if target.is_conj() else "negative"
        return (
            f"the state's tensor is a {view} view (its memory holds other values than it "
            "shows), which cannot be restored into; pass a tensor of its own "
            "(resolve_conj()/resolve_neg())"
        )
    saved = f"{entry.kind} {entry.dtype} {entry.shape}"
    if isinstance(target, torch.Tensor):
        have = f"tensor {str(target.dtype).removeprefix('torch.')} {tuple(target.shape)}"
    elif isinstance(target, np.ndarray):
        have = f"ndarray {target.dtype.str} {target.shape}"
    else:  # something of another kind: a module, a container, a Python value
        return f"saved a {saved}, the state has {type(target).__qualname__}"
    return f"saved {saved} does not match the state's {have}"


MISSING = object()

# torch's own overrides of Module._load_from_state_dict that only rename or add keys (a
# missing num_batches_tracked, old versions' running stats) and then load as Module does
_KEY_ONLY_LOADERS = {
    "torch.nn.modules.batchnorm._NormBase._load_from_state_dict",
    "torch.nn.modules.instancenorm._InstanceNorm._load_from_state_dict",
}


def loads_by_reference(obj: Any) -> bool:
    """Whether ``obj.load_state_dict(sd)``, given its own ``state_dict()``'s tensors, keeps
    those very tensors, reading none of their values: then a restore may write their bytes
    after the call, when nothing can fail any more, and needs no copy of them to put back
    (undo.py). True for an ``nn.Module`` each of whose modules loads as ``Module`` does
    (``copy_`` into its parameters and buffers; torch's norm layers, which only fix keys,
    included) with no load hooks, unless torch swaps tensors on load; and for a
    ``torch.optim.Optimizer`` whose ``load_state_dict`` is the base class's, with no load
    hooks (it keeps each state tensor whose dtype and device match its parameter's). The
    restore checks afterwards that the tensors were kept (a dtype that did not match gives
    a copy): :func:`tiercheck.restore.loading.copied_on_load`."""
    import torch

    if isinstance(obj, torch.nn.Module):
        if torch.__future__.get_swap_module_params_on_conversion():
            return False
        for m in obj.modules():
            cls = type(m)
            if cls.load_state_dict is not torch.nn.Module.load_state_dict:
                return False
            loader = cls._load_from_state_dict
            if loader is not torch.nn.Module._load_from_state_dict and (
                f"{loader.__module__}.{loader.__qualname__}" not in _KEY_ONLY_LOADERS
            ):
                return False
            if m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks:
                return False
        return True
    if isinstance(obj, torch.optim.Optimizer):
        if type(obj).load_state_dict is not torch.optim.Optimizer.load_state_dict:
            return False
        return not (
            getattr(obj, "_optimizer_load_state_dict_pre_hooks", None)
            or getattr(obj, "_optimizer_load_state_dict_post_hooks", None)
        )
    return False


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
        if target is MISSING or not isinstance(target, torch.Tensor):
            if checked and target is not MISSING:
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
            local = target._local_tensor
            if _on_device(local):
                b.device[i] = local
            else:
                b.dests[i] = _byte_view_of_tensor(local)
        else:
            b.pieces.append(piece)
        assembled.add(i)

    # entries bound to a caller's tensor or array outside every stateful object but those
    # that load by reference
    plain: set[int] = set()
    inside = [0]  # how many stateful objects the walk is in that do not load by reference
    owners: list[int] = []  # the objects that do, innermost last (id of their tree node)
    # whether the innermost stateful object the walk is in is an nn.Module, whose
    # load_state_dict copy_()s each tensor into the module's: it would cast another dtype
    # (another shape it refuses itself)
    modules = [False]

    def walk(node: Any, target: Any, key: str, checked: bool) -> None:
        if not isinstance(node, dict) or len(node) != 1:
            raise StateError("malformed tree in manifest", key=key)
        if target is None:  # a placeholder: whatever was saved there is restored as it was
            target = MISSING
        ((tag, sub),) = node.items()
        if tag == "r":  # a log version's replayed tensor: the replay puts it in place
            return
        if tag == "s":
            sharded(sub, target, key, checked)
            return
        if tag == "e":
            entry = entries[sub]
            if target is not MISSING and _fits(entry, target):
                b.targets[sub] = target
                if not inside[0]:
                    plain.add(sub)
                    if owners:
                        b.by_reference[owners[-1]].add(sub)
            elif checked and target is not MISSING:
                arrays = (torch.Tensor, np.ndarray)
                if entry.kind in ("tensor", "ndarray"):
                    raise StateError(_mismatch(entry, target), key=key)
                if isinstance(target, arrays) or is_stateful(target):
                    raise StateError(
                        f"saved a Python value ({entry.kind}), the state has "
                        f"{type(target).__qualname__}",
                        key=key,
                    )
                if isinstance(target, (dict, list)):
                    b.merges[sub] = strict
            elif (
                modules[-1]
                and isinstance(target, torch.Tensor)
                and entry.kind == "tensor"
                and not key.endswith("_extra_state")  # set_extra_state takes it as saved
                and str(target.dtype).removeprefix("torch.") != entry.dtype
            ):
                raise StateError(_mismatch(entry, target), key=key)
            return
        if tag == "o":
            if target is not MISSING and is_stateful(target):
                sd = target.state_dict()
                b.stateful[id(node)] = sd
                b.objects[id(node)] = (key, target)
                if isinstance(target, torch.optim.Optimizer):
                    params = [p for g in target.param_groups for p in g["params"]]
                    for j, p in enumerate(params):
                        if is_dtensor(p):
                            like[f"{key}/state/{j}" if key else f"state/{j}"] = p
                by_reference = not inside[0] and loads_by_reference(target)
                if by_reference:
                    b.by_reference[id(node)] = set()
                    owners.append(id(node))
                else:
                    inside[0] += 1
                modules.append(isinstance(target, torch.nn.Module))
                walk(sub, sd, key, False)
                modules.pop()
                if by_reference:
                    owners.pop()
                else:
                    inside[0] -= 1
            elif checked and target is not MISSING:
                raise StateError(
                    f"saved an object with state_dict(), the state has {type(target).__qualname__}",
                    key=key,
                )
            else:
                walk(sub, MISSING, key, False)
            return
        if tag == "d":
            is_dict = isinstance(target, dict)
            if checked and target is not MISSING and not is_dict:
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
                child_target = target.get(k, MISSING) if is_dict else MISSING
                if checked and strict and is_dict and child_target is MISSING:
                    raise StateError(
                        "the checkpoint has this key but the state does not "
                        "(pass strict=False to add it)",
                        key=child_key,
                    )
                walk(child, child_target, child_key, checked)
            return
        if tag in ("l", "t"):
            seq = target if isinstance(target, (list, tuple)) else None
            if checked and target is not MISSING and seq is None:
                raise StateError(
                    f"saved a {'tuple' if tag == 't' else 'list'}, the state has "
                    f"{type(target).__qualname__}",
                    key=key,
                )
            if checked and strict and seq is not None and len(seq) != len(sub):
                raise StateError(f"saved {len(sub)} items, the state has {len(seq)}", key=key)
            for i, child in enumerate(sub):
                t = seq[i] if seq is not None and i < len(seq) else MISSING
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
            if isinstance(target, torch.Tensor) and target.is_contiguous():
                if target.device.type == "cpu":
                    b.dests[i] = _byte_view_of_tensor(target)
                    b.loose.update(plain & {i})
                    continue
                if _on_device(target):
                    b.device[i] = target
                    b.loose.update(plain & {i})
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
                b.loose.update(plain & {i})
                continue
            arr = np.empty(entry.shape, dtype=np.dtype(entry.dtype))
            b.values[i] = arr
            b.dests[i] = arr.reshape(-1).view(np.uint8).data.cast("B")
        else:
            buf = bytearray(entry.nbytes)
            b.values[i] = buf
            b.dests[i] = memoryview(buf)
    for owned in b.by_reference.values():
        owned &= b.loose  # the others are copied in while the tree is put together
    return b
