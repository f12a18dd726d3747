"""The shm stores under an shm root, as other processes see them: listing each with what
its owner file says, reading an owner record, and removing a store.

Nothing here writes into a live store (:mod:`tiercheck.backends._shm` does, through its
``_os`` hook the power-loss recorder replaces); ``remove_segment`` deletes a whole one.
"""

from __future__ import annotations

import builtins
import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

from tiercheck.core.sizes import tree_bytes
from tiercheck.errors import TierError

__all__ = [
    "DEFAULT_ROOT",
    "OWNER_FILE",
    "Segment",
    "is_segment",
    "list_segments",
    "read_owner",
    "remove_segment",
    "shm_free_bytes",
]

DEFAULT_ROOT = f"/dev/shm/tiercheck-{os.getuid()}"
OWNER_FILE = "owner.json"
_OWNER_KIND = "tiercheck-shm"


def shm_free_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged writer can still allocate on the file system of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@dataclass(frozen=True)
class Segment:
    """One shm store (a directory under an shm root) and what its owner file says.

    ``store`` is the owning store's root on node ``store_host`` and ``store_id`` its id
    (None: opened without a store, no owner file, or written before stores had ids);
    ``host`` is the node that created it; ``owned`` says whether an owner file was found
    at all. ``nbytes`` is the memory its files take (None when not measured).
    """

    path: str
    name: str
    root: str
    store: str | None
    store_id: str | None
    store_host: str | None
    host: str | None
    pid: int | None
    created: float | None
    owned: bool
    nbytes: int | None


def read_owner(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The owner record of the segment directory ``path``, or None if it has none."""
    try:
        with open(os.path.join(path, OWNER_FILE)) as f:
            obj = json.load(f)
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    return obj if isinstance(obj, dict) and obj.get("kind") == _OWNER_KIND else None


def is_segment(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "blobs")) and os.path.exists(os.path.join(path, "log"))


def list_segments(
    root: str | os.PathLike[str] = DEFAULT_ROOT, *, sizes: bool = True
) -> builtins.list[Segment]:
    """Every shm store under ``root`` (an shm root, default ``/dev/shm/tiercheck-UID``).

    ``sizes=False`` skips measuring each store (a walk of its files): the cheap listing.
    """
    root = os.fspath(root)
    try:
        entries = sorted(e.path for e in os.scandir(root) if e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return []
    out = []
    for path in entries:
        if not is_segment(path):
            continue
        owner = read_owner(path) or {}

        def field(name: str, kind: type, owner: dict[str, Any] = owner) -> Any:
            value = owner.get(name)
            return value if isinstance(value, kind) and not isinstance(value, bool) else None

        created = owner.get("created")
        out.append(
            Segment(
                path=path,
                name=os.path.basename(path),
                root=root,
                store=field("store", str),
                store_id=field("store_id", str),
                store_host=field("store_host", str),
                host=field("host", str),
                pid=field("pid", int),
                created=float(created) if isinstance(created, (int, float)) else None,
                owned=bool(owner),
                nbytes=tree_bytes(path) if sizes else None,
            )
        )
    return out


def remove_segment(path: str | os.PathLike[str]) -> int:
    """Delete the shm store at ``path`` (all its files); returns the bytes freed.

    Refuses a directory that is not an shm store, so a wrong path deletes nothing.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        return 0
    if not is_segment(path):
        raise TierError(f"{path} is not a tiercheck shm store; not deleting it")
    freed = tree_bytes(path)
    shutil.rmtree(path, ignore_errors=True)
    return freed
