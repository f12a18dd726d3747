"""Flattening a state into entries, and validating it, before anything is written.

A state is a tree of dicts, lists and tuples whose leaves are torch tensors, NumPy arrays,
objects with ``state_dict()``/``load_state_dict()`` (modules, optimizers, schedulers) and
msgpack-able scalars. :func:`flatten` turns it into a container skeleton (``tree``, stored
in the shard manifest) and a list of :class:`Leaf` objects keyed by their ``/``-joined path.

Rules (SPEC.md section "State trees"):

- Dict keys must be ``str`` or ``int`` (torch optimizers key their state by int); any other
  key type is refused. Two paths that flatten to the same key are refused.
- A container holding no tensor, array or stateful object anywhere inside is stored as one
  ``msgpack`` leaf (e.g. an optimizer's ``param_groups``), so that a list of a thousand ints
  is one entry, not a thousand.
- Tuples, NumPy scalars and ints beyond 64 bits survive the round trip exactly (msgpack
  extension types). Anything else (a lambda, an open file, a custom object) raises
  :class:`~tiercheck.errors.UnsupportedValue` naming its key, unless the caller opted in to
  pickle.
- Sparse, meta, quantized and nested tensors are refused.
- A DTensor (FSDP2's parameters and optimizer state) is stored as this rank's local
  tensor with its placement in the global tensor (:mod:`tiercheck.core.sharded`); its tree node
  is ``{"s": i}``. Only ``Shard`` and ``Replicate`` placements are supported.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from tiercheck.errors import StateError, UnsupportedValue
from tiercheck.formats.manifest import EntryKind, ShardPlacement

if TYPE_CHECKING:
    import torch

__all__ = [
    "Leaf",
    "as_dict",
    "decode_scalar",
    "encode_scalar",
    "flatten",
    "is_stateful",
    "pack_exact",
    "tensor_place",
    "torch_dtype",
]

_EXT_TUPLE = 1
_EXT_NPSCALAR = 2
_EXT_BIGINT = 3

_MAX_DEPTH = 64  # how deep a state may nest


@dataclass(frozen=True)
class Leaf:
    """One entry to store. ``value`` is a tensor, an ndarray, or encoded bytes."""

    key: str
    kind: EntryKind
    value: Any
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    placement: ShardPlacement | None = None  # set for the local piece of a DTensor


def tensor_place(t: torch.Tensor) -> tuple[Any, ...]:
    """Where ``t`` is as a view of memory: device, address, dtype, shape and strides. Equal
    for two tensor objects that are the same view, as the tensors a ``state_dict()`` hands
    out are of the live ones."""
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


def is_stateful(obj: object) -> bool:
    """True for objects saved through ``state_dict()`` and restored by ``load_state_dict``."""
    import torch

    return (
        not isinstance(obj, (torch.Tensor, np.ndarray, dict, list, tuple))
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def torch_dtype(name: str) -> torch.dtype:
    """Map a dtype name from a manifest (``float32``) back to ``torch.float32``."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise StateError(f"unknown torch dtype {name!r} in checkpoint")
    return dtype


# --- msgpack scalars -----------------------------------------------------------------


def _default(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return msgpack.ExtType(_EXT_TUPLE, pack_exact(list(obj)))
    if isinstance(obj, np.generic) and obj.dtype.kind in "biufc":
        return msgpack.ExtType(_EXT_NPSCALAR, pack_exact([obj.dtype.str, obj.tobytes()]))
    if isinstance(obj, int):  # only reached for ints msgpack cannot hold natively
        return msgpack.ExtType(_EXT_BIGINT, str(obj).encode())
    if isinstance(obj, dict):  # dict subclasses (OrderedDict) travel as plain dicts
        return dict(obj)
    if isinstance(obj, list):
        return list(obj)
    raise TypeError(f"cannot store a value of type {type(obj).__qualname__}")


def pack_exact(obj: Any) -> bytes:
    """``obj`` as msgpack that :func:`decode_scalar` reads back as it was (tuples, NumPy
    scalars and ints beyond 64 bits as extension types; no subclass of a type msgpack
    holds); raises ``TypeError`` naming the type of a value it cannot hold."""
    out: bytes = msgpack.packb(obj, use_bin_type=True, strict_types=True, default=_default)
    return out


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_TUPLE:
        return tuple(_unpackb(data))
    if code == _EXT_NPSCALAR:
        dtype, raw = _unpackb(data)
        return np.frombuffer(raw, dtype=np.dtype(dtype))[0]
    if code == _EXT_BIGINT:
        return int(data.decode())
    return msgpack.ExtType(code, data)


def _unpackb(data: bytes | memoryview) -> Any:
    return msgpack.unpackb(
        bytes(data), raw=False, strict_map_key=False, ext_hook=_ext_hook, use_list=True
    )


def encode_scalar(value: Any, key: str, allow_pickle: bool) -> tuple[EntryKind, bytes]:
    """Encode a non-tensor leaf as msgpack (or pickle when allowed)."""
    try:
        return "msgpack", pack_exact(value)
    except (TypeError, ValueError, OverflowError) as exc:
        if allow_pickle:
            try:
                return "pickle", pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as pexc:
                raise UnsupportedValue(f"cannot pickle value: {pexc}", key=key) from None
        raise UnsupportedValue(
            f"{exc}; supported leaves are tensors, NumPy arrays, objects with state_dict(), "
            "and int/float/str/bytes/bool/None/list/tuple/dict of those "
            "(pass allow_pickle=True to store other objects with pickle)",
            key=key,
        ) from None


def decode_scalar(kind: str, data: bytes | memoryview, key: str, allow_pickle: bool) -> Any:
    """Decode a leaf written by :func:`encode_scalar`."""
    if kind == "msgpack":
        try:
            return _unpackb(data)
        except Exception as exc:
            raise StateError(f"stored value is not valid msgpack ({exc})", key=key) from None
    if kind == "pickle":
        if not allow_pickle:
            raise UnsupportedValue(
                "this entry was stored with pickle; pass allow_pickle=True to load it "
                "(only for checkpoints you trust: unpickling runs code)",
                key=key,
            )
        return pickle.loads(bytes(data))
    raise StateError(f"unknown entry kind {kind!r}", key=key)


# --- flattening ----------------------------------------------------------------------


def _check_tensor(t: torch.Tensor, key: str) -> None:
    import torch

    if t.layout != torch.strided:
        raise UnsupportedValue(f"{t.layout} tensors are not supported; convert to dense", key=key)
    if t.is_meta:
        raise UnsupportedValue("meta tensors hold no data and cannot be saved", key=key)
    if t.is_quantized:
        raise UnsupportedValue("quantized tensors are not supported; dequantize first", key=key)
    if getattr(t, "is_nested", False):
        raise UnsupportedValue("nested tensors are not supported", key=key)
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and not isinstance(t, torch.nn.Parameter):
        # other tensor subclasses (ShardedTensor, FakeTensor, ...): DTensor is handled above
        raise UnsupportedValue(
            f"tensor subclass {type(t).__qualname__} is not supported here; "
            "convert it to a plain tensor",
            key=key,
        )


def _holds_arrays(obj: Any, key: str, depth: int = 0) -> bool:
    import torch

    if depth > _MAX_DEPTH:  # as deep as flatten goes; a container that holds itself, too
        raise StateError(
            f"state is nested more than {_MAX_DEPTH} levels deep (or a container holds itself)",
            key=key,
        )
    if isinstance(obj, (torch.Tensor, np.ndarray)) or is_stateful(obj):
        return True
    if isinstance(obj, dict):
        return any(_holds_arrays(v, key, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_arrays(v, key, depth + 1) for v in obj)
    return False


def as_dict(state: Any) -> dict[Any, Any]:
    """``state`` (a mapping) as a dict; ``StateError`` for anything else."""
    if not isinstance(state, Mapping):
        raise StateError(f"a state must be a dict, got {type(state).__qualname__}")
    return dict(state)


def _join(prefix: str, part: str) -> str:
    return f"{prefix}/{part}" if prefix else part


def flatten(state: Any, *, allow_pickle: bool = False) -> tuple[Any, list[Leaf]]:
    """Flatten ``state`` into ``(tree, leaves)``; raise a typed error for bad input.

    Calls ``state_dict()`` on stateful objects. Nothing is copied: tensor leaves reference
    the caller's tensors, so the caller must not mutate them until staging completes.
    """
    import torch

    if not isinstance(state, dict):
        raise StateError(f"a state must be a dict, got {type(state).__qualname__}")
    leaves: list[Leaf] = []
    seen: set[str] = set()

    def add(key: str, leaf: Leaf) -> dict[str, int]:
        if key in seen:
            raise StateError("two entries flatten to this key; rename one of them", key=key)
        seen.add(key)
        leaves.append(leaf)
        return {"e": len(leaves) - 1}

    def walk(obj: Any, key: str, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise StateError(f"state is nested more than {_MAX_DEPTH} levels deep", key=key)
        if isinstance(obj, torch.Tensor) and is_dtensor(obj):
            local, placement = local_piece(obj, key)
            _check_tensor(local, key)
            shape = tuple(int(d) for d in local.shape)
            nbytes = local.numel() * local.element_size()
            dtype = str(local.dtype).removeprefix("torch.")
            node = add(key, Leaf(key, "tensor", local, dtype, shape, nbytes, placement))
            return {"s": node["e"]}
        if isinstance(obj, torch.Tensor):
            _check_tensor(obj, key)
            shape = tuple(int(d) for d in obj.shape)
            nbytes = obj.numel() * obj.element_size()
            dtype = str(obj.dtype).removeprefix("torch.")
            return add(key, Leaf(key, "tensor", obj, dtype, shape, nbytes))
        if isinstance(obj, np.ndarray):
            if type(obj) not in (np.ndarray, np.memmap):  # a mask, matrix semantics...
                raise UnsupportedValue(
                    f"NumPy array subclass {type(obj).__qualname__} is not supported (what "
                    "makes it one would be lost); pass np.asarray(...) and what it adds apart",
                    key=key,
                )
            if obj.dtype.hasobject or obj.dtype.kind not in "biufcV" or obj.dtype.fields:
                raise UnsupportedValue(f"NumPy dtype {obj.dtype} is not supported", key=key)
            return add(key, Leaf(key, "ndarray", obj, obj.dtype.str, obj.shape, obj.nbytes))
        if is_stateful(obj):
            try:
                sub = obj.state_dict()
            except Exception as exc:
                raise StateError(f"state_dict() failed: {exc}", key=key) from exc
            if not isinstance(sub, dict):
                raise StateError("state_dict() did not return a dict", key=key)
            return {"o": walk(sub, key, depth + 1)}
        if isinstance(obj, dict) and _holds_arrays(obj, key, depth):
            items = []
            for k, v in obj.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise StateError(
                        f"dict key {k!r} of type {type(k).__qualname__} is not supported; "
                        "keys must be str or int",
                        key=key,
                    )
                if isinstance(k, str) and (k == "" or "/" in k):
                    raise StateError(
                        f"dict key {k!r} is empty or contains '/', which separates paths",
                        key=key,
                    )
                items.append([k, walk(v, _join(key, str(k)), depth + 1)])
            return {"d": items}
        if isinstance(obj, (list, tuple)) and _holds_arrays(obj, key, depth):
            tag = "t" if isinstance(obj, tuple) else "l"
            return {tag: [walk(v, _join(key, str(i)), depth + 1) for i, v in enumerate(obj)]}
        if isinstance(obj, dict):
            for k in obj:
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise StateError(
                        f"dict key {k!r} of type {type(k).__qualname__} is not supported; "
                        "keys must be str or int",
                        key=key,
                    )
        kind, data = encode_scalar(obj, key or "<root>", allow_pickle)
        return add(key, Leaf(key, kind, data, "", (), len(data)))

    from tiercheck.core.sharded import is_dtensor, local_piece

    tree = walk(state, "", 0)
    return tree, leaves
