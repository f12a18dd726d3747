"""The shm stores under an shm root, as other processes see them: listing each with what
its owner file says, reading an owner record, removing a store, and reading a store's
blobs in place (:class:`ShmPins`).

Nothing here writes into a live store (:mod:`tiercheck.backends._shm` does, through its
``_os`` hook the power-loss recorder replaces); ``remove_segment`` deletes a whole one.
"""

from __future__ import annotations

import builtins
import fcntl
import json
import mmap
import os
import shutil
from dataclasses import dataclass
from functools import partial
from typing import Any

from tiercheck.backends.base import Later, Pins, check_blob_id
from tiercheck.core.sizes import tree_bytes
from tiercheck.errors import NotFound, TierError

__all__ = [
    "DEFAULT_ROOT",
    "OWNER_FILE",
    "Segment",
    "ShmPins",
    "hold_pool",
    "is_segment",
    "list_segments",
    "read_owner",
    "remove_segment",
    "shm_free_bytes",
    "unmap",
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


# A pooled segment is rewritten in place when a put takes it: the one write in a store
# that changes an existing file's bytes. Pins forbid it by the lock of the pool/ directory:
# a put recycling a segment holds it shared (each put its own descriptor, so puts of any
# thread or process never exclude each other), a reader pinning blobs holds it exclusive.


def hold_pool(pool_dir: str) -> int:
    """A descriptor of ``pool_dir`` holding its shared lock, for a put to recycle a pooled
    segment while no reader pins blobs; -1 if one does (the put writes fresh pages then).
    Release it with ``os.close`` once the recycled segment is written."""
    return _lock_pool(pool_dir, fcntl.LOCK_SH)


def _lock_pool(pool_dir: str, how: int) -> int:
    """A descriptor of ``pool_dir`` holding its lock ``how`` (shared or exclusive), or -1
    where another holder's lock excludes it now (never waits)."""
    fd = os.open(pool_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return -1
    except BaseException:
        os.close(fd)
        raise
    return fd


class ShmPins(Pins):
    """Blobs of the shm store at ``path`` read in place (``ShmTier.pin``): each blob's file
    mapped read-only, its pages populated at once, while this holds the exclusive lock of
    the store's ``pool/`` directory, so that no put rewrites a deleted blob's pages until
    :meth:`close`. A blob deleted meanwhile keeps its pages while mapped. Build it with
    :meth:`take`, which returns None while a put is recycling a segment or another reader
    pins."""

    def __init__(self, path: str, url: str, lock_fd: int) -> None:
        self._blobs = os.path.join(path, "blobs")
        self._url = url
        self._lock_fd = lock_fd
        self._maps: builtins.list[tuple[memoryview, mmap.mmap]] = []

    @classmethod
    def take(cls, path: str, url: str) -> ShmPins | None:
        try:
            fd = _lock_pool(os.path.join(path, "pool"), fcntl.LOCK_EX)
        except OSError:
            return None  # no pool/ (lost, or never written): read with get_parts
        return None if fd < 0 else cls(path, url, fd)

    def get(self, blob_id: str) -> memoryview:
        check_blob_id(blob_id, self._url)
        if self._lock_fd < 0:
            raise TierError("pins used after close", url=self._url, key=blob_id)
        try:
            fd = os.open(os.path.join(self._blobs, blob_id), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFound("blob not found", url=self._url, key=blob_id) from None
        except OSError as exc:
            raise TierError(f"pin failed: {exc}", url=self._url, key=blob_id) from exc
        try:
            size = os.fstat(fd).st_size
            if not size:
                return memoryview(b"")
            mapped = mmap.mmap(
                fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ
            )
        except OSError as exc:
            raise TierError(f"pin failed: {exc}", url=self._url, key=blob_id) from exc
        finally:
            os.close(fd)  # the mapping stays; the pool lock is what keeps its bytes
        view = memoryview(mapped)
        self._maps.append((view, mapped))
        return view

    def close(self, later: Later | None = None) -> None:
        """Release the pool's lock, then unmap every blob: on ``later`` where given (a
        restore's caller need not wait for it: ~30 ms per GiB of 4 KiB pages here), else
        here. Once the views are released nothing reads the maps, so a put may recycle a
        deleted blob's pages before they go. A map still viewed elsewhere is unmapped
        when its last view goes."""
        maps, self._maps = self._maps, []
        mapped = []
        for view, m in maps:
            try:
                view.release()
            except BufferError:
                pass  # sliced: the slices keep it mapped until they go
            mapped.append(m)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        if not mapped:
            return
        if later is not None:
            try:
                later(partial(unmap, mapped))
                return
            except RuntimeError:  # a pool shut down: unmap here
                pass
        unmap(mapped)


def unmap(maps: builtins.list[mmap.mmap]) -> int:
    """Close each of ``maps``; how many were still viewed (each unmapped when its last
    view goes, wherever that is)."""
    viewed = 0
    for m in maps:
        try:
            m.close()
        except BufferError:
            viewed += 1
    return viewed
