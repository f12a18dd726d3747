"""DCP checkpoint ids, rank store roots, and how and where each DCP item is stored.

Every DCP item and the encoded metadata are stored as entries of their own, whatever the
state holds: tensors as they are, byte payloads (DCP's ``BytesIO`` items, the metadata) as
one-dimensional ``uint8`` tensors (:func:`bytes_entry`). A container holding no tensor would
be stored as one msgpack entry (``tiercheck.core.entries``), so a shard of byte items alone
would have none of its own (issue 34). Stores written before kept byte payloads as msgpack
``bytes`` entries; :func:`entry_bytes` reads both.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.futures import Future

from tiercheck.errors import ConfigError, StateError

METADATA_FORMAT = "tiercheck-dcp"
METADATA_VERSION = 1
ITEMS = "dcp_items"
"""Top-level key of a DCP shard's items in the saved state (``dcp_items/<item key>``)."""
METADATA = "dcp_metadata"
"""Top-level key of the encoded DCP metadata in the coordinator's version."""

# --- checkpoint ids --------------------------------------------------------------------

_ID = re.compile(r"^(?:(step|version):)?(\d+)$")


@dataclass(frozen=True)
class CheckpointRef:
    """What a DCP ``checkpoint_id`` names: a ``step``, a ``version`` id, or (both None) the
    next step when writing / the newest version when reading."""

    step: int | None = None
    version: int | None = None


def parse_checkpoint_id(checkpoint_id: object) -> CheckpointRef:
    """Parse ``None``, ``N``, ``"N"``, ``"step:N"`` or ``"version:N"``; raise ConfigError."""
    if checkpoint_id is None:
        return CheckpointRef()
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        if checkpoint_id < 0:
            raise ConfigError(f"checkpoint_id must be a non-negative step, got {checkpoint_id}")
        return CheckpointRef(step=checkpoint_id)
    if isinstance(checkpoint_id, str):
        m = _ID.match(checkpoint_id.strip())
        if m is not None:
            n = int(m.group(2))
            return CheckpointRef(version=n) if m.group(1) == "version" else CheckpointRef(step=n)
    raise ConfigError(
        f"checkpoint_id {checkpoint_id!r} is not understood by tiercheck; use a step "
        "(N, 'N' or 'step:N'), 'version:N' (reading only) or None"
    )


def _valid_id(checkpoint_id: object) -> bool:
    try:
        parse_checkpoint_id(checkpoint_id)
    except ConfigError:
        return False
    return True


def rank_root(root: str | os.PathLike[str], rank: int) -> Path:
    """The store root of ``rank`` under a DCP root: ``root/rank{rank}``."""
    return Path(root).expanduser().resolve() / f"rank{rank}"


# --- item keys and locations ------------------------------------------------------------


def item_key(index: MetadataIndex) -> str:
    """A stable entry key for a DCP item: the escaped fqn, ``@``, and its chunk offsets.

    The fqn is percent-escaped so that ``/`` (tiercheck's path separator) cannot occur.
    """
    offsets = "" if index.offset is None else "_".join(str(int(o)) for o in index.offset)
    return f"{quote(index.fqn, safe='')}@{offsets}"


@dataclass(frozen=True)
class Location:
    """Where one DCP item is stored: ``rank``'s store, its ``version`` (None: the version
    holding the metadata), entry ``key`` under :data:`ITEMS`, and its byte length.
    ``root`` is the store's root as the writing rank reports it (the metadata records it
    once per rank, not per item: decoded locations leave it empty)."""

    rank: int
    version: int | None
    key: str
    nbytes: int
    root: str = ""


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


def bytes_entry(raw: bytes) -> torch.Tensor:
    """``raw`` as the one-dimensional ``uint8`` tensor that stores it."""
    return (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if raw
        else torch.empty(0, dtype=torch.uint8)
    )


def entry_bytes(kind: str, value: Any, what: str) -> bytes:
    """The bytes a stored payload entry holds: a 1-D ``uint8`` tensor, or (stores written
    before) msgpack ``bytes``. Raises StateError for anything else."""
    if kind == "tensor" and isinstance(value, torch.Tensor):
        if value.dtype == torch.uint8 and value.dim() == 1:
            return bytes(value.contiguous().numpy().tobytes())
    elif kind == "msgpack" and isinstance(value, bytes):
        return value
    raise StateError(
        f"DCP metadata in the store is malformed or unsupported: {what} does not hold bytes "
        f"(a 1-D uint8 tensor), it is stored as {kind!r}"
    )
