"""The fsspec tier's store on a local (or mounted) POSIX file system: every change goes
through ``os`` (as ``_os``) with fsync, so that a name is never durable before its content
and a log record never names a blob whose name a power loss could undo (see the package
doc, "Blob puts")."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

from tiercheck.backends._fsspec.store import Store
from tiercheck.backends._vectored import read_parts
from tiercheck.backends.base import PendingPut, copy_bytes

__all__ = ["LocalPut", "LocalStore", "fsync_dir", "unlink_quietly", "write_all"]

# Every call that changes the local file system (and the descriptors it writes through)
# goes through this name, so a test can record a save's operations in order and replay
# the states a power cut could leave (tests/test_power_loss.py). In production it is the
# os module itself: no wrapper, no cost.
_os = os

# iovecs per writev call (Linux's IOV_MAX is 1024)
_IOV_MAX = 1024

# A pack is written around the page cache (O_DIRECT, see LocalStore.put_object) through an
# aligned buffer of this size; offsets and lengths in multiples of _DIRECT_ALIGN (a page:
# every block size a disk reports divides it).
_DIRECT_BUFFER = 8 << 20
_DIRECT_ALIGN = 4096


class LocalStore(Store):
    """A local (or mounted) POSIX file system through ``os``, with fsync for durability."""

    exclusive_create = True

    def __init__(self, root: str) -> None:
        self._root = root
        self._made: set[str] = set()
        self._made_lock = threading.Lock()
        self._can_link = True
        # directories with a new entry (a blob, a directory) since the last sync(): their
        # fsync waits for the next log record, once per directory instead of once per blob
        self._unsynced: set[str] = set()
        # directories this store has fsynced: every name they held then is durable
        self._durable: set[str] = set()
        # packs go around the page cache until the file system refuses it (tmpfs, FUSE)
        self._direct = hasattr(os, "O_DIRECT")
        # aligned buffers of past pack writes, reused (under _made_lock)
        self._buffers: list[mmap.mmap] = []

    def _named_in(self, directory: str) -> None:
        with self._made_lock:
            self._unsynced.add(directory)

    def _found(self, paths: Iterable[str]) -> None:
        """``paths`` exist, maybe named by a writer that crashed before fsyncing their
        directories: the next :meth:`sync` makes their names and those of the directories
        above them, up to the root, durable, because a record may now rely on them. Once
        per directory per store, not per blob."""
        dirs = {os.path.dirname(p) for p in paths}
        with self._made_lock:
            for d in dirs - self._durable:
                while d == self._root or d.startswith(self._root + os.sep):
                    if d not in self._durable:
                        self._unsynced.add(d)
                    d = os.path.dirname(d)

    def _ensure_dir(self, directory: str) -> None:
        if directory in self._made:
            return
        missing: list[str] = []
        d = directory
        while not os.path.isdir(d):
            missing.append(d)
            d = os.path.dirname(d)
        self._found((d,))
        for d in reversed(missing):
            try:
                _os.mkdir(d)
            except FileExistsError:
                continue
            self._named_in(os.path.dirname(d))
        with self._made_lock:
            self._made.add(directory)

    def _open_temp(
        self,
        directory: str,
        name: str,
        parts: Sequence[memoryview],
        write: Callable[[int, Sequence[memoryview]], None] | None = None,
    ) -> LocalPut:
        """``parts`` written (by ``write``, default :func:`write_all`) to a new temporary
        file beside ``name`` (not yet fsynced)."""
        self._ensure_dir(directory)
        tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
        fd = _os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            (write or write_all)(fd, parts)
        except BaseException:
            _os.close(fd)
            unlink_quietly(tmp)
            raise
        return LocalPut(self, fd, tmp, os.path.join(directory, name))

    def _write_temp(self, directory: str, name: str, parts: Sequence[memoryview]) -> str:
        pending = self._open_temp(directory, name, parts)
        pending.sync()
        return pending.tmp

    def begin_put(self, path: str, parts: Sequence[memoryview]) -> PendingPut:
        """``put(path, parts, if_absent=True)`` in two steps: the write now (into the page
        cache), the fsync and the rename in :meth:`LocalPut.finish`."""
        if os.path.exists(path):
            self._found((path,))
            return PendingPut(False)
        return self._open_temp(*os.path.split(path), parts)

    def put_object(self, path: str, parts: Sequence[memoryview]) -> None:
        """A pack: written as :meth:`put` does (a temporary file, fsync, rename), but around
        the page cache where the file system allows (``O_DIRECT``, through an aligned
        buffer; the last partial block buffered). A pack is read again only to restore
        what the node's faster tiers lost, while a GiB of new page cache costs the node
        0.6-2.5 s of kernel time (new pages from the host on a VM) that the trainer's
        threads would feel; written directly, the kernel only maps the buffer for the
        disk's DMA. Where ``O_DIRECT`` is refused the write goes through the page cache,
        and the store stops trying."""
        write = self._write_direct if self._direct else write_all
        self._open_temp(*os.path.split(path), parts, write).finish()

    @contextmanager
    def _buffer(self) -> Iterator[memoryview]:
        """One of the store's aligned pack buffers, given back to it after the block."""
        with self._made_lock:
            buffer = self._buffers.pop() if self._buffers else None
        buffer = buffer or mmap.mmap(-1, _DIRECT_BUFFER)
        view = memoryview(buffer)
        try:
            yield view
        finally:
            view.release()
            with self._made_lock:
                self._buffers.append(buffer)

    def _write_direct(self, fd: int, parts: Sequence[memoryview]) -> None:
        """``parts`` copied through one of the store's aligned buffers and written with
        ``O_DIRECT`` in whole blocks; the descriptor is buffered again for the last partial
        block, or for everything left once the file system refuses a direct write."""
        with self._buffer() as buffer:
            direct = _set_direct(fd, True)
            fill = 0

            def drain(n: int) -> None:
                nonlocal direct
                view = buffer[:n]
                if direct:
                    try:
                        done = _os.writev(fd, [view])
                    except OSError as exc:
                        if exc.errno != errno.EINVAL:
                            raise
                        done = 0  # opened, but this file system will not write directly
                        self._direct = False
                    if done < n:  # refused, or a short write: the rest through the page cache
                        direct = _set_direct(fd, False)
                        view = view[done:]
                    else:
                        return
                write_all(fd, [view])

            for part in parts:
                pos = 0
                while pos < len(part):
                    n = min(len(part) - pos, len(buffer) - fill)
                    copy_bytes(buffer[fill : fill + n], part[pos : pos + n])
                    fill += n
                    pos += n
                    if fill == len(buffer):
                        drain(fill)
                        fill = 0
            whole = fill - fill % _DIRECT_ALIGN
            if whole:
                drain(whole)
            if fill > whole:
                direct = _set_direct(fd, False)
                write_all(fd, [buffer[whole:fill]])

    def put(self, path: str, parts: Sequence[memoryview], *, if_absent: bool) -> bool:
        if if_absent and os.path.exists(path):
            self._found((path,))
            return False
        directory, name = os.path.split(path)
        self._open_temp(directory, name, parts).finish()
        if not if_absent:  # a repair replaces a damaged copy: durable now
            self.sync()
        return True

    def sync(self) -> None:
        with self._made_lock:
            dirs, self._unsynced = self._unsynced, set()
        try:
            for directory in sorted(dirs):
                fsync_dir(directory)
        except BaseException:
            with self._made_lock:
                self._unsynced |= dirs  # not known durable: the next sync tries again
            raise
        with self._made_lock:
            self._durable |= dirs

    def create(self, path: str, data: memoryview) -> None:
        directory, name = os.path.split(path)
        if os.path.exists(path):
            raise FileExistsError(errno.EEXIST, "exists", path)
        if self._can_link:
            tmp = self._write_temp(directory, name, (data,))
            try:
                _os.link(tmp, path)
            except FileExistsError:
                raise
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                    raise
                self._can_link = False  # e.g. a FUSE or FAT mount without hard links
            else:
                self._named_in(directory)
                self.sync()  # the record, and any directory made on the way
                return
            finally:
                unlink_quietly(tmp)
        self._ensure_dir(directory)
        fd = _os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_all(fd, (data,))
            _os.fsync(fd)
        finally:
            _os.close(fd)
        self._named_in(directory)
        self.sync()

    def read(self, path: str, out: memoryview | None) -> memoryview:
        with open(path, "rb", buffering=0) as f:
            n = os.fstat(f.fileno()).st_size
            if out is None:
                target = memoryview(bytearray(n))
            elif len(out) < n:
                raise ValueError(f"buffer of {len(out)} bytes too small for blob of {n} bytes")
            else:
                target = out[:n]
            pos = 0
            while pos < n:
                got = f.readinto(target[pos:])
                if not got:
                    raise OSError(errno.EIO, f"{path} shrank while being read")
                pos += got
            return target

    def read_parts(self, path: str, parts: Sequence[memoryview]) -> int:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            want = min(size, sum(len(p) for p in parts))
            if read_parts(fd, parts, want) != want:
                raise OSError(errno.EIO, f"{path} shrank while being read")
        finally:
            os.close(fd)
        return size

    def read_range(self, path: str, start: int, parts: Sequence[memoryview]) -> int:
        fd = os.open(path, os.O_RDONLY)
        try:
            return read_parts(fd, parts, sum(len(p) for p in parts), start)
        finally:
            os.close(fd)

    def sizes(self, directory: str) -> dict[str, int]:
        try:
            with os.scandir(directory) as it:
                return {
                    e.name: e.stat(follow_symlinks=False).st_size
                    for e in it
                    if e.is_file(follow_symlinks=False)
                }
        except FileNotFoundError:
            return {}

    def head(self, path: str, nbytes: int) -> bytes:
        with open(path, "rb", buffering=0) as f:
            parts = []
            left = nbytes
            while left > 0:
                got = f.read(left)
                if not got:
                    break
                parts.append(got)
                left -= len(got)
            return b"".join(parts)

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def mtime(self, path: str) -> float | None:
        return os.stat(path).st_mtime

    def exists_many(self, paths: Sequence[str]) -> list[bool]:
        found = [os.path.isfile(p) for p in paths]
        self._found(p for p, there in zip(paths, found) if there)
        return found

    def remove_many(self, paths: Sequence[str]) -> None:
        dirs: set[str] = set()
        for path in paths:
            try:
                _os.unlink(path)
            except FileNotFoundError:
                continue
            dirs.add(os.path.dirname(path))
        for d in dirs:
            fsync_dir(d)

    def names(self, directory: str) -> list[str]:
        try:
            with os.scandir(directory) as it:
                return [e.name for e in it if e.is_file(follow_symlinks=False)]
        except FileNotFoundError:
            return []

    def files_below(self, directory: str) -> Iterator[str]:
        for dirpath, _dirs, files in os.walk(directory):
            rel = os.path.relpath(dirpath, directory)
            for name in files:
                yield name if rel == "." else f"{rel}/{name}"


class LocalPut(PendingPut):
    """A blob written to a temporary file: :meth:`finish` fsyncs it, then names it (so a
    name is never seen before its content is durable) and leaves the directory's fsync to
    the store's next :meth:`LocalStore.sync`; :meth:`abort` removes it."""

    def __init__(self, store: LocalStore, fd: int, tmp: str, path: str) -> None:
        super().__init__(True)
        self._store, self._fd, self.tmp, self._path = store, fd, tmp, path

    def sync(self) -> None:
        """fsync and close the temporary file (removed if that fails)."""
        try:
            _os.fsync(self._fd)
        except BaseException:
            self.abort()
            raise
        _os.close(self._fd)
        self._fd = -1

    def finish(self) -> bool:
        self.sync()
        try:
            _os.replace(self.tmp, self._path)
        except BaseException:
            unlink_quietly(self.tmp)
            raise
        self._store._named_in(os.path.dirname(self._path))
        return True

    def abort(self) -> None:
        if self._fd >= 0:
            _os.close(self._fd)
            self._fd = -1
        unlink_quietly(self.tmp)


def _set_direct(fd: int, on: bool) -> bool:
    """Turn ``O_DIRECT`` on or off for ``fd``; whether it is on (False where refused)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError:
        return False
    return on


def write_all(fd: int, parts: Sequence[memoryview]) -> None:
    """Write every part, in order, with vectored writes (a short write is continued)."""
    views = [v for v in parts if len(v)]
    i = 0
    while i < len(views):
        n = _os.writev(fd, views[i : i + _IOV_MAX])
        while i < len(views) and n >= len(views[i]):
            n -= len(views[i])
            i += 1
        if n:
            views[i] = views[i][n:]


def fsync_dir(directory: str) -> None:
    fd = _os.open(directory, os.O_RDONLY)
    try:
        _os.fsync(fd)
    finally:
        _os.close(fd)


def unlink_quietly(path: str) -> None:
    try:
        _os.unlink(path)
    except FileNotFoundError:
        pass
