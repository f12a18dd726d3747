"""The shm stores under an shm root, as other processes see them: listing each with what
its owner file says, reading an owner record, removing a store, and reading a store's
blobs in place (:class:`ShmPins`); and, for the one process that writes a store, the
index of its pool of freed segments (:class:`Pool`; :mod:`tiercheck.backends._shm` says
why a pool) and the writable mappings it keeps of them (:class:`KeptMaps`).

Nothing here writes into a live store but :meth:`KeptMaps.write`, for a put of
:mod:`tiercheck.backends._shm` (which writes everything else, through its ``_os`` hook the
power-loss recorder replaces, and uses no kept mapping under the recorder);
``remove_segment`` deletes a whole one.

Kept mappings: a put into a segment that was written before copies through a writable
mapping of that file kept since then, not with ``pwrite``. On a VM, ``pwrite`` of 1 GiB
into existing tmpfs pages took 175 ms of system time, a ``memcpy`` through mappings whose
page tables are already filled 83 ms, through a fresh mapping per put 420 ms (the faults).
A mapping is made (``MAP_POPULATE``) once a file's pages exist: when a chunk's fresh
segment (``KEEP_FRESH_BYTES`` or more; a smaller one, a manifest's, once reused) or any
reused one is written, and by ``preallocate``; a put uses it only inside the pages the file
has (a mapped write past a file's end is ``SIGBUS``, not an error) and within the mapping.
Mapping a fresh 1 GiB costs its save 0.1-0.35 s of CPU (the page tables filled), which the
next save that reuses those segments gets back (a dense 1 GiB diff into them 0.58-0.65 s
of CPU instead of 0.70-0.77 s through ``pwrite``), and a restore right after the first
save reads them through the mapping (1 GiB in one process 221-233 ms, not 271-293 ms).

What bounds them: a mapping pins its file's pages and (Python's ``mmap`` keeps a
duplicate) holds a descriptor. Every unlink of the tier drops the file's mapping first, a
sweep of the segment's directories after deletes drops any whose file is gone, ``close``
drops them all; their number stays under an eighth of the process's descriptor limit
and 1,024 (4 GiB of 4 MiB chunks; the trainer's DataLoader needs descriptors too: past
that, puts use ``pwrite``); a forked child (a DataLoader worker) does not inherit them
(``MADV_DONTFORK``). A kept mapping also keeps its inode: no other file can have that
number meanwhile, so a lookup by the inode of a file just opened finds that file's mapping
or none. The writing process's restore reads through them too (:class:`ShmPins`): the
pin's lock keeps every put from recycling a segment, so nothing writes through a mapping
a restore reads. A blob staged in this process (:class:`StageArea`) is read where its
staging range maps its payload, while the range maps that file (:meth:`KeptMaps.staged`,
by inode: the range's mapping holds it); the restore holds the staging buffer, so no save
arms a range under it. 1 GiB staged by the default store, restored in the saving process
(its migrations done): 200-244 ms in 5 of 6 processes (290-303 in one), against 256-316
ms mapping each blob's file.
"""

from __future__ import annotations

import bisect
import builtins
import contextlib
import ctypes
import fcntl
import json
import mmap
import os
import resource
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from tiercheck.backends.base import (
    STAGED_HEADER,
    Later,
    Pins,
    StagingArea,
    Tier,
    check_blob_id,
    gather,
)
from tiercheck.core.sizes import tree_bytes
from tiercheck.errors import NotFound, TierError
from tiercheck.formats.codecs import raw_header

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_ROOT",
    "HEADER",
    "KEEP_FRESH_BYTES",
    "OWNER_FILE",
    "KeptMaps",
    "Pool",
    "Segment",
    "ShmPins",
    "StageArea",
    "hold_pool",
    "is_segment",
    "list_segments",
    "read_owner",
    "remove_segment",
    "room_for",
    "shm_free_bytes",
    "stageable",
    "unmap",
]

DEFAULT_ROOT = f"/dev/shm/tiercheck-{os.getuid()}"
# A fresh segment at least this long is mapped (kept) at its first put: a chunk's, not a
# manifest's (module docstring, "Kept mappings").
KEEP_FRESH_BYTES = 1 << 20
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


@contextlib.contextmanager
def owner_lock(path: str) -> Iterator[None]:
    """Hold the owner lock of the segment at ``path`` (an exclusive ``flock`` on its
    directory, released when its descriptor closes, a dead holder's too): every
    read-compare-write of ``owner.json`` runs under it, so two claims never both find the
    segment free."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def made_dir(path: str, mkdir: Callable[..., None] = os.mkdir) -> bool:
    """Make the directory ``path`` (mode 0700) by ``mkdir``; False if it was there already.
    Atomic: of opens racing to make it, one made it."""
    try:
        mkdir(path, mode=0o700)
    except FileExistsError:
        return False
    return True


def remove_unclaimed(path: str, store_id: str | None) -> None:
    """Remove the segment at ``path``, which an open that failed made, unless a store
    other than ``store_id`` claimed it since (another store's open racing that one)."""
    try:
        with owner_lock(path):
            owner = read_owner(path) or {}
            claimed = owner.get("store_id"), owner.get("store")
            if claimed == (None, None) or (store_id is not None and claimed[0] == store_id):
                shutil.rmtree(path, ignore_errors=True)
    except OSError:  # gone already
        return


def is_segment(path: str) -> bool:
    """Whether ``path`` is an shm store: its ``blobs/`` directory or its ``log``. Either
    one: an open killed after making ``blobs/`` and before the log leaves a segment too,
    which then shows in :func:`list_segments` (unowned) and ``tiercheck rm shm://NAME``
    deletes."""
    return os.path.isdir(os.path.join(path, "blobs")) or os.path.exists(os.path.join(path, "log"))


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
    mapped read-only (its pages faulted in by whoever reads them first), or, in the
    process that writes the store, read through the mapping it keeps of that file where
    it has one (:meth:`KeptMaps.view`: already mapped, its pages in its page tables; a
    restore of 1 GiB in that process 208-230 ms instead of 242-274; a staged blob's
    payload where its staging range maps it, :meth:`parts`), while this holds
    the exclusive lock of the store's ``pool/`` directory, so that no put rewrites a
    deleted blob's pages until :meth:`close`. A blob deleted meanwhile keeps its pages
    while mapped. Build it with :meth:`take`, which returns None while a put is recycling
    a segment or another reader pins."""

    def __init__(self, path: str, url: str, lock_fd: int, kept: KeptMaps | None = None) -> None:
        self._blobs = os.path.join(path, "blobs")
        self._url = url
        self._lock_fd = lock_fd
        self._kept = kept
        self._maps: builtins.list[tuple[memoryview, mmap.mmap | None]] = []

    @classmethod
    def take(cls, path: str, url: str, kept: KeptMaps | None = None) -> ShmPins | None:
        """Pins of the store at ``path``; ``kept``: the writer's own mappings of its
        segments (the process that writes the store), read through where a blob's file has
        one, with no mapping made and no page faulted."""
        try:
            fd = _lock_pool(os.path.join(path, "pool"), fcntl.LOCK_EX)
        except OSError:
            return None  # no pool/ (lost, or never written): read with get_parts
        return None if fd < 0 else cls(path, url, fd, kept)

    def get(self, blob_id: str) -> memoryview:
        return self._pin(blob_id, None)[1]

    def parts(self, blob_id: str, head: int) -> tuple[memoryview, memoryview, int]:
        """A staged blob of the writing process (:meth:`KeptMaps.staged`) as its header
        page, read, and its payload where the staging range maps it: no mapping made, no
        page faulted; any other blob as :meth:`get` gives it, cut."""
        front, rest = self._pin(blob_id, head)
        return front, rest, len(front) + len(rest)

    def _pin(self, blob_id: str, head: int | None) -> tuple[memoryview, memoryview]:
        """``blob_id``'s bytes in two parts, the first ``head`` long (the whole blob in the
        second where None), or a staged blob's header page and its payload in the range."""
        check_blob_id(blob_id, self._url)
        if self._lock_fd < 0:
            raise TierError("pins used after close", url=self._url, key=blob_id)
        try:
            fd = os.open(os.path.join(self._blobs, blob_id), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFound("blob not found", url=self._url, key=blob_id) from None
        except OSError as exc:
            raise TierError(f"pin failed: {exc}", url=self._url, key=blob_id) from exc
        empty = memoryview(b"")
        try:
            st = os.fstat(fd)
            size = st.st_size
            if not size:
                return empty, empty
            staged = self._kept.staged if self._kept is not None and head is not None else None
            payload = staged(st.st_ino, size) if staged is not None else None
            if payload is not None:
                front = os.pread(fd, HEADER, 0)
                if len(front) == HEADER:
                    self._maps.append((payload, None))
                    return memoryview(front), payload
                payload.release()
            view = self._kept.view(st.st_ino, size) if self._kept is not None else None
            if view is not None:
                self._maps.append((view, None))
            else:
                # not MAP_POPULATE: populating 1 GiB of 4 KiB pages in mmap took 95-108 ms
                # of a restore's CPU, faulting them in as the chunks are hashed (64 KiB per
                # fault) 20-40 ms plus 30-50 ms more hashing; a 1 GiB restore in one process
                # 234 ms against 254 (three alternating runs of benchmarks/restore.py)
                mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                view = memoryview(mapped)
                self._maps.append((view, mapped))
        except OSError as exc:
            raise TierError(f"pin failed: {exc}", url=self._url, key=blob_id) from exc
        finally:
            os.close(fd)  # the mapping stays; the pool lock is what keeps its bytes
        if head is None:
            return empty, view
        return view[:head], view[head:]

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
            if m is not None:  # None: a kept mapping, the writer's own
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


class Pool:
    """Index of free segments by size. Thread-safe; only an index of ``pool/``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_size: dict[int, builtins.list[str]] = {}
        self._sizes: builtins.list[int] = []  # sorted distinct keys of _by_size
        self.total = 0

    def add(self, token: str, size: int) -> None:
        with self._lock:
            tokens = self._by_size.get(size)
            if tokens is None:
                self._by_size[size] = tokens = []
                bisect.insort(self._sizes, size)
            tokens.append(token)
            self.total += size

    def take(self, size: int) -> tuple[str, int] | None:
        """Remove and return the best segment for ``size`` bytes: the smallest that is at
        least as big, else the biggest there is (its pages still save part of the cost)."""
        with self._lock:
            if not self._sizes:
                return None
            i = bisect.bisect_left(self._sizes, size)
            found = self._sizes[i] if i < len(self._sizes) else self._sizes[-1]
            tokens = self._by_size[found]
            token = tokens.pop()
            if not tokens:
                del self._by_size[found]
                self._sizes.remove(found)
            self.total -= found
            return token, found


class KeptMaps:
    """Writable mappings of one store's segment files by inode, kept from one put to the
    next (module docstring, "Kept mappings"). A kept mapping holds its inode, so no other
    file can have that number meanwhile: a lookup by the inode of a file just opened
    finds that file's mapping or none. Thread-safe."""

    def __init__(self) -> None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        #: at most this many (each holds a descriptor: an eighth of the limit at most)
        self.limit = max(0, min(1024, (soft if soft > 0 else 1024) // 8))
        self._maps: dict[int, mmap.mmap] = {}
        # staging slots (StageArea): inode -> (address of its payload's mapping, length)
        self._slots: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self.writes = 0  # puts that copied through a kept mapping
        self.staged_reads = 0  # payloads read where a staging range maps them

    def __len__(self) -> int:
        return len(self._maps)

    def write(self, fd: int, views: Sequence[memoryview], size: int) -> bool:
        """Copy ``views`` (``size`` bytes) to the start of ``fd``'s file through its kept
        mapping; False (nothing written) where it has none that covers them. The caller
        knows the file's pages cover ``size`` bytes."""
        with self._lock:
            mapped = self._maps.get(os.fstat(fd).st_ino)
        if mapped is None or len(mapped) < size:
            return False
        whole = memoryview(mapped)
        try:
            gather(views, whole)
        finally:
            whole.release()
        with self._lock:
            self.writes += 1
        return True

    def view(self, ino: int, size: int) -> memoryview | None:
        """The first ``size`` bytes of inode ``ino``'s file, read-only, through its kept
        mapping; None where it has none that covers them. The caller knows the file has
        ``size`` bytes (a mapping may reach past a file truncated since it was made, and
        a read there would be ``SIGBUS``), and keeps every put from recycling a segment
        while it reads (:class:`ShmPins`). The view keeps the mapping alive: dropped
        meanwhile, it is unmapped once the view goes."""
        with self._lock:
            mapped = self._maps.get(ino)
        if mapped is None or len(mapped) < size:
            return None
        try:
            whole = memoryview(mapped)
        except ValueError:  # closed by a drop since the lookup
            return None
        try:
            return whole[:size].toreadonly()
        finally:
            whole.release()

    def slot(self, ino: int, addr: int, length: int) -> None:
        """Inode ``ino`` is a staging slot, its payload (``length`` bytes from file offset
        :data:`HEADER`) mapped at ``addr`` until :meth:`unslot` (:class:`StageArea`)."""
        with self._lock:
            self._slots[ino] = (addr, length)

    def unslot(self, ino: int) -> None:
        """Inode ``ino``'s payload is no longer mapped where :meth:`slot` said (its slot
        is about to be mapped over, or the range unmapped)."""
        with self._lock:
            self._slots.pop(ino, None)

    def staged(self, ino: int, size: int) -> memoryview | None:
        """The payload of the staged blob of inode ``ino`` (``size`` bytes with its header
        page), read-only, where its staging range maps it; None where no range does. The
        range stays mapped while the caller holds the staging buffer (a restore does: no
        save arms a range meanwhile) and pins the store."""
        with self._lock:
            found = self._slots.get(ino)
            if found is None or found[1] != size - HEADER:
                return None
            self.staged_reads += 1
        addr, length = found
        return memoryview((ctypes.c_char * length).from_address(addr)).cast("B").toreadonly()

    def keep(self, fd: int, size: int) -> None:
        """Map the first ``size`` bytes of ``fd``'s file (pages that exist) for later puts,
        if it has no mapping yet and there is room."""
        if size <= 0:
            return
        ino = os.fstat(fd).st_ino
        with self._lock:
            if ino in self._maps or len(self._maps) >= self.limit:
                return
        try:
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except OSError:
            return  # out of descriptors or mappings: puts go on with pwrite
        try:
            mapped.madvise(mmap.MADV_DONTFORK)
        except OSError:  # a mapping a forked child would hold: none
            mapped.close()
            return
        with self._lock:
            if ino in self._maps or len(self._maps) >= self.limit:
                mapped.close()
                return
            self._maps[ino] = mapped

    def drop(self, path: str) -> None:
        """Drop the mapping of the file at ``path`` (before it is unlinked)."""
        try:
            ino = os.stat(path, follow_symlinks=False).st_ino
        except OSError:
            return
        with self._lock:
            mapped = self._maps.pop(ino, None)
        if mapped is not None:
            unmap([mapped])  # one a put still copies through goes when that put lets go

    def sweep(self, dirs: Sequence[str]) -> int:
        """Drop the mappings whose file is in none of ``dirs`` (gone); how many."""
        if not self._maps:
            return 0
        live: set[int] = set()
        for d in dirs:
            try:
                live.update(e.inode() for e in os.scandir(d))
            except OSError:
                continue
        with self._lock:
            gone = [self._maps.pop(ino) for ino in builtins.list(self._maps) if ino not in live]
        unmap(gone)
        return len(gone)

    def close(self) -> None:
        with self._lock:
            maps, self._maps = builtins.list(self._maps.values()), {}
            self._slots = {}
        unmap(maps)  # the store closing under a put: that put's mapping goes after it


# --- staging in the store's own files ------------------------------------------------------
#
# Staging a state straight into shm's segment files: the staging copy becomes the blobs.
#
# Without it a save holds three copies of a dense state in host memory at its peak: the
# staging buffer, the version shm is writing, and the version before it (kept until the new
# one is committed, and then its pages pooled for the next write). Here the staging buffer
# *is* the next version's segment files: each chunk window of the staged stream is the
# payload of a file of shm's ``tmp/`` directory, mapped into one contiguous range of the
# process's address space at the window's offset, so the staging copy writes into shm's
# pages, and once a window is hashed the file becomes the blob (:meth:`StageArea.adopt`:
# its header written in front of the payload, then linked into ``blobs/``). Two such ranges
# take turns: one holds the newest version's blobs while the next save stages into the
# other, so the host holds two copies of the state, not three.
#
# The payload of a blob starts after its header; a header of a whole page (``header_size``
# 4096, SPEC section 2: the bytes past the first 64 are zero extension bytes, which every
# reader skips) puts it at a page offset of the file, which ``mmap`` needs.
#
# A slot is free to stage into when no blob name refers to its file: its link count is one
# (its ``tmp/`` name). :meth:`StageArea.arm` makes every slot of a range free before a save
# stages into it: a slot whose file is still a live blob (a chunk an older version still
# names) gets a fresh file mapped over it, the old file staying the blob. Deleting a blob
# whose file is also a slot unlinks its ``blobs/`` name and never moves the file into the
# pool (``ShmTier.delete``), so the pool never hands a slot to a put. A freed slot that was a
# blob is staged into only under the pool's shared lock, as a put recycles a pooled
# segment: a reader of another process that pins blobs (``ShmPins``, the exclusive lock)
# may still map that file; while one does, such slots get fresh files instead.
#
# A crashed process leaves its slots in ``tmp/`` under its pid; the next writable open
# unlinks the names of those that are blobs and pools the others (``ShmTier._recover``, as
# for any put in flight). Not under the power-loss recorder (shm is not persistent, and the
# recorder sees only writes made through its hook).

PAGE = mmap.PAGESIZE
HEADER = STAGED_HEADER  # a staged blob's header: a page, its payload at a page offset

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_PROT_NONE = 0
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MAP_POPULATE = 0x8000
# what ShmTier.preallocate and a fresh slot write: pages written now, not faulted later
_ZEROS = memoryview(bytes(4 << 20))


def stageable(windows: Sequence[tuple[int, int]], stream_bytes: int) -> bool:
    """Whether a layout's chunk windows can each be a slot: contiguous from 0 to the end
    of the stream, each starting at a page offset of it."""
    pos = 0
    for offset, length in windows:
        if offset != pos or offset % PAGE or length <= 0:
            return False
        pos = offset + length
    return bool(windows) and pos == stream_bytes and HEADER % PAGE == 0


def _map(addr: int | None, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
    got = _libc.mmap(addr, length, prot, flags, fd, offset)
    if got is None or got == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap: {os.strerror(err)}")
    assert isinstance(got, int)
    return got


class StageArea(StagingArea):
    """Two staging ranges of ``windows``' slots in ``tier``'s ``tmp/`` (module docstring).

    Use: :meth:`take` a range for a save, :meth:`arm` it, copy into :meth:`tensor`,
    :meth:`done_staging`, then :meth:`adopt` each window shm lacks once it is hashed.
    One save stages at a time (the engine's staging buffer lock)."""

    def __init__(self, tier: Tier, windows: Sequence[tuple[int, int]], stream_bytes: int):
        if not stageable(windows, stream_bytes):
            raise ValueError("these chunk windows cannot be staged in shm")
        self.tier = tier
        # the ShmTier's own directories and counters (typed loosely: this module is below
        # backends._shm, which imports it)
        self.shm: Any = tier
        self.windows = tuple(windows)
        self.stream_bytes = stream_bytes
        self._span = -(-stream_bytes // PAGE) * PAGE
        self._bases: list[int] = []
        self._paths: list[list[str]] = []
        self._adopted: list[set[int]] = [set(), set()]  # slots linked as blobs since armed
        self._inodes: dict[int, int] = {}  # address of a slot's payload -> its file's inode
        self._tensors: list[torch.Tensor] = []
        self._next = 0
        self._pool_fd = -1
        self._lock = threading.Lock()
        self.replaced = 0  # slots given a fresh file by arm (a live blob, or a reader pinned)
        try:
            for _ in range(2):
                base = _map(
                    None,
                    self._span,
                    _PROT_NONE,
                    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
                    -1,
                    0,
                )
                self._bases.append(base)
                self._paths.append([])
                for offset, length in self.windows:
                    self._paths[-1].append(self._slot(base + offset, length))
        except BaseException:
            self.close()
            raise
        self.nbytes = 2 * sum(HEADER + n for _, n in self.windows)  # the ranges' shm pages

    def _slot(self, addr: int, length: int, recycle: bool = False) -> str:
        """A slot file for ``length`` bytes of payload, mapped at ``addr`` over whatever was
        mapped there; returns its path. With ``recycle`` (the caller holds the pool's
        shared lock) a pooled segment (a deleted blob's file, its pages there) if there is
        one, else a fresh file, its pages written now (not faulted in by the copy)."""
        size = HEADER + length
        path: str
        path, fd, pos = self.shm._claim_segment(size, recycle)  # pos: its pages (0: fresh)
        gone = self._inodes.pop(addr, None)
        if gone is not None:  # a restore no longer finds that blob's payload here
            self.shm._kept.unslot(gone)
        try:
            if pos > size:
                os.ftruncate(fd, size)
                pos = size
            while pos < size:
                pos += os.pwrite(fd, _ZEROS[: min(len(_ZEROS), size - pos)], pos)
            _map(
                addr,
                length,
                mmap.PROT_READ | mmap.PROT_WRITE,
                mmap.MAP_SHARED | _MAP_FIXED | _MAP_POPULATE,
                fd,
                HEADER,
            )
            self._inodes[addr] = ino = os.fstat(fd).st_ino
            self.shm._kept.slot(ino, addr, length)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return path

    def take(self) -> int:
        """The range the next save stages into (they alternate)."""
        with self._lock:
            r, self._next = self._next, 1 - self._next
        return r

    def busy(self, r: int) -> int:
        """How many slots of range ``r`` are still blobs (a version that keeps them)."""
        return sum(os.stat(path).st_nlink > 1 for path in self._paths[r])

    def arm(self, r: int) -> None:
        """Make every slot of range ``r`` free to stage into (module docstring), holding
        the pool's shared lock until :meth:`done_staging`: a slot still linked as a blob,
        or one freed since it was adopted while a reader pins (no lock), gets a pooled
        segment (a fresh file when the pool has none, or a reader pins)."""
        fd = hold_pool(self.shm._pool_dir)
        self._pool_fd = fd
        for k, path in enumerate(self._paths[r]):
            if os.stat(path).st_nlink > 1 or (fd < 0 and k in self._adopted[r]):
                offset, length = self.windows[k]
                fresh = self._slot(self._bases[r] + offset, length, recycle=fd >= 0)
                os.unlink(path)  # the old file stays the blob (or goes with its last name)
                self._paths[r][k] = fresh
                self.replaced += 1
        self._adopted[r] = set()

    def done_staging(self) -> None:
        """The staging copy into the range armed last is done: release the pool's lock."""
        fd, self._pool_fd = self._pool_fd, -1
        if fd >= 0:
            os.close(fd)

    def tensor(self, r: int) -> torch.Tensor:
        """Range ``r`` as a byte tensor of the stream's length (made once)."""
        import torch

        while len(self._tensors) <= r:
            n = len(self._tensors)
            buf = (ctypes.c_char * self.stream_bytes).from_address(self._bases[n])
            self._tensors.append(torch.frombuffer(buf, dtype=torch.uint8))
        tensor: torch.Tensor = self._tensors[r]
        return tensor

    def adopt(self, r: int, k: int, blob_id: str) -> bool:
        """Window ``k`` of range ``r`` (staged, hashed to ``blob_id``) becomes that blob:
        its header is written in front of the payload and the file linked into ``blobs/``.
        False if the blob is there already (nothing written). Counts the file's bytes as a
        put does (``OverBudget`` past the budget)."""
        tier = self.shm
        length = self.windows[k][1]
        size = HEADER + length
        tier._reserve(blob_id, size, 0)
        linked = False
        try:
            path = self._paths[r][k]
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.pwrite(fd, raw_header(length, HEADER), 0)
            finally:
                os.close(fd)
            try:
                os.link(path, tier._blob_path(blob_id))
            except FileExistsError:
                return False
            linked = True
            self._adopted[r].add(k)
            return True
        except OSError as exc:
            raise tier._os_error(exc, "adopt", blob_id) from exc
        finally:
            if not linked:
                tier._release(size)

    def close(self, *, pool: bool = False) -> None:
        """Unmap both ranges and unlink every slot's name (a slot that is a blob stays the
        blob); with ``pool``, a free slot's file goes to the pool instead, its pages for
        the puts of the saves that stage privately from now on. Idempotent."""
        self.done_staging()
        self._tensors = []
        for ino in self._inodes.values():
            self.shm._kept.unslot(ino)
        self._inodes = {}
        for base in self._bases:
            _libc.munmap(base, self._span)
        self._bases = []
        for paths in self._paths:
            for path in paths:
                try:
                    st = os.stat(path)
                    if pool and st.st_nlink == 1:
                        self.shm._to_pool(path, st.st_size)
                    else:
                        os.unlink(path)
                except FileNotFoundError:
                    pass
        self._paths = []


def room_for(path: str, windows: Sequence[tuple[int, int]]) -> bool:
    """Whether the shm file system at ``path`` has room for the two ranges and as much
    again for the rest."""
    need = 2 * sum(HEADER + n for _, n in windows)
    try:
        return shm_free_bytes(path) >= 2 * need
    except OSError:
        return False
