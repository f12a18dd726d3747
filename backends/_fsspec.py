"""Any fsspec URL as a tier: ``file:///abs/path``, ``s3://bucket/prefix``, ``gs://...``, and
``fsspec+PROTO://...`` (forces fsspec, e.g. ``fsspec+memory://root`` is fsspec's in-memory
file system, unlike the native ``memory://`` tier).

Layout under the root (the URL's path)::

    tier.json                    marker: {"tier": "tiercheck-fsspec", "layout": 1 or 2,
                                 "owner": the store owning the prefix, {"store_id", "root",
                                 "host"} (formats/SPEC.md "Store identity"), once recorded};
                                 replaced whole, one object per tier
    blobs/<id[:2]>/<id>          one object per blob, written once (repairs overwrite)
    packs/<name>.pack            layout 2: many blobs in one object, its index at its end
    packs/<name>.drop            ids deleted from that pack while its bytes stay
    log/<seq:016d>.rec           one object per log record, seq = 0, 1, 2, ... in append order
    log/<seq:016d>.ckpt          a checkpoint record standing for every record up to seq

Each log object holds one record framed with :mod:`tiercheck.formats.framing`, so a damaged
or torn object is detected (and skipped with a warning) rather than parsed. The marker is
created by the first writable open; an open refuses a root whose marker is not
tiercheck's or names a newer layout. Local temporary files (``.*.tmp``) are never listed.

**Log commit.** ``append`` claims the next sequence number by *create-if-absent*, so two
writers can never both own one number: the loser sees the object exist, re-lists the log
and retries with the next free number (so ``append`` never raises ``AlreadyExists`` in
practice; it does after 1000 lost races in a row). How each store creates if absent:

- local file system (``file://``): the record is written to a temporary file and fsynced,
  then ``os.link``-ed to its final name (``link`` fails if the name exists) and the
  directory fsynced. Where hard links are not supported the record is written with
  ``O_CREAT | O_EXCL``; a crash may then leave a torn object, which framing detects.
- S3 (``s3://``): ``PutObject`` with ``If-None-Match: *`` (AWS since 2024, moto >= 5).
  An endpoint that answers "not implemented" falls back to check-then-put, with a warning.
- fsspec's memory file system: check-then-put under a process-wide lock (the store lives in
  this process, so that is atomic).
- any other protocol: ``pipe_file(mode="create")`` of the fsspec implementation. fsspec's
  default is check-then-put: two writers racing for one number can both succeed, and the
  later object replaces the earlier record. Use such a store from one writer at a time
  (the engine's store lock gives that).

**Log compaction.** ``replace_log_prefix`` writes the checkpoint as ``log/<S>.ckpt``, S
being the sequence number of the last record it replaces, then deletes the ``.rec``
objects up to S and older checkpoints. A reader takes the newest checkpoint and only the
records after it, so between the two steps (or after a crash between them) it reads the
same log, and reading costs one GET per record kept, not per record ever appended. New
sequence numbers continue after checkpoints too.

**Blob puts.** Local: temporary file (header and payload in one vectored write), fsync,
``rename``; the directories new blobs were named in are fsynced once each before the next
log record is written (and at close), so a record never names a blob whose name a power
loss could undo, and a version of many blobs pays one directory fsync per directory, not
per blob. A blob or directory found already there (``has``, a put of an id present, a
blob directory made earlier) may have been named by a writer that crashed before its
directory fsync: its directories, up to the root, are fsynced too before the next record,
once per directory per process. Reads go straight into the caller's buffer. Object
stores: one ``PutObject`` (atomic by the store's semantics; ``If-None-Match: *`` on S3 for
a put without ``overwrite``, which saves the existence check). Other fsspec file systems
write in place: a crash may leave a partial blob, which the codec layer detects by hash.

**Packs** (``pack_size``, SPEC section 16, :mod:`tiercheck.backends._packs`): an object
store gets its blobs in pack objects of about ``pack_size`` bytes (128 MiB by default;
``0``: one object per blob, the only layout of local and memory stores unless asked).
Blobs put are gathered in memory and written as packs before the next log record, at
``flush()`` and at ``close()``; reads are ranged reads. A root with packs says layout 2.

**Capabilities** (each overridable by the options of the same name):

=====================  ===========  ======  ==========  ==========  ========
store                  survives     shared  persistent  speed_rank  compress
=====================  ===========  ======  ==========  ==========  ========
local ``file://``      process      no      yes         40          no
local, ``shared=True`` node         yes     yes         40          no
``fsspec+memory://``   none         no      no          5           no
anything else          cluster      yes     yes         50          yes
=====================  ===========  ======  ==========  ==========  ========

``compress`` decides the default codec of a shared or cluster-surviving tier: a file system
mounted here (``file://``, even one declared ``survives="cluster"``) gets raw blobs, an
object store zstd (see :mod:`tiercheck.store.policy`).

A local path on a shared mount (NFS, Lustre) should be opened with ``shared=True`` (and
``survives="cluster"`` if the file system outlives the cluster).

**Options:** ``storage_options`` (dict passed to fsspec, e.g. ``endpoint_url``, ``key``,
``secret``, ``client_kwargs`` for s3fs), ``read_only``, ``survives``, ``shared``,
``persistent``, ``speed_rank``, ``compress``, ``pack_size``.

**Errors:** a missing bucket raises ``InvalidURL`` at open; connection failures and
timeouts ``TierUnavailable``; no space ``TierFull``; a missing blob ``NotFound``.
"""

from __future__ import annotations

import abc
import asyncio
import builtins
import datetime
import errno
import json
import logging
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, ClassVar, NoReturn, cast
from urllib.parse import urlsplit

from tiercheck.backends._packs import PackedBlobs
from tiercheck.backends._vectored import read_parts
from tiercheck.backends.base import (
    BLOB_ID_RE,
    Buffer,
    Capabilities,
    FailureDomain,
    LogScan,
    PendingPut,
    StoreOwner,
    Tier,
    check_blob_id,
    invalid_url,
    scatter,
)
from tiercheck.core.sizes import parse_size
from tiercheck.errors import (
    AlreadyExists,
    FormatVersionError,
    InvalidURL,
    NotFound,
    TierError,
    TierFull,
    TierUnavailable,
    UnknownScheme,
)
from tiercheck.formats.framing import frame_record, unframe_record

__all__ = ["FsspecTier"]

log = logging.getLogger(__name__)

# Every call that changes the local file system (and the descriptors it writes through)
# goes through this name, so a test can record a save's operations in order and replay
# the states a power cut could leave (tests/test_power_loss.py). In production it is the
# os module itself: no wrapper, no cost.
_os = os

LAYOUT_VERSION = 2  # 2: blobs may be in packs (packs/), besides loose objects
#: the default pack size of an object store (``pack_size`` option; 0: one object per blob)
DEFAULT_PACK_SIZE = 128 * 1024 * 1024
_MARKER = "tier.json"
_MARKER_KIND = "tiercheck-fsspec"
_LOG_NAME_RE = re.compile(r"^(\d{16})\.rec$")
_CKPT_NAME_RE = re.compile(r"^(\d{16})\.ckpt$")
_MAX_APPEND_RACES = 1000
_LOCAL_PROTOCOLS = frozenset({"file", "local"})
# Protocols whose first path component is a bucket (checked at open).
_BUCKET_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss"})
_S3_PROTOCOLS = frozenset({"s3", "s3a"})
# How many requests an async store (s3fs, gcsfs) is given at once for has/read_log, and
# how many threads put_many uses on a remote store.
_ASYNC_BATCH = 64
_REMOTE_THREADS = 16
# part size of a pack's multipart upload to S3 (a pack of two parts or more is multipart)
_PART = 8 * 1024 * 1024
_UNAVAILABLE_ERRNOS = frozenset(
    {
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.EPIPE,
        errno.EBUSY,  # s3fs: SlowDown / ServiceUnavailable
        getattr(errno, "EREMOTEIO", 121),  # s3fs: InternalError (HTTP 500)
    }
)
# iovecs per writev call (Linux's IOV_MAX is 1024)
_IOV_MAX = 1024
_FULL_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG})
# fsspec's memory file system is one process-wide dict: a process-wide lock makes its
# check-then-put atomic.
_MEMORY_CREATE_LOCK = threading.Lock()


def _byte_view(data: Buffer) -> memoryview:
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _is_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the store cannot be reached (retryable), by type, not message."""
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _UNAVAILABLE_ERRNOS:
        return True
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError
    except ImportError:  # pragma: no cover - botocore comes with s3fs
        pass
    else:
        if isinstance(exc, (BotoConnectionError, HTTPClientError)):
            return True
    try:
        from aiohttp import ClientConnectionError
    except ImportError:  # pragma: no cover - aiohttp comes with s3fs / gcsfs
        pass
    else:
        if isinstance(exc, ClientConnectionError):
            return True
    from fsspec.exceptions import FSTimeoutError

    return isinstance(exc, FSTimeoutError)


def _translate(exc: BaseException, url: str, key: str, what: str) -> TierError | None:
    """The typed error for a store exception, or None if it is not one we classify."""
    if isinstance(exc, TierError):
        return exc
    if _is_unavailable(exc):
        return TierUnavailable(f"{what} failed, store unreachable: {exc}", url=url, key=key)
    if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
        return TierFull(f"{what} failed, no space left: {exc}", url=url, key=key)
    if isinstance(exc, PermissionError):
        return TierError(f"{what} failed, permission denied: {exc}", url=url, key=key)
    if isinstance(exc, OSError) and exc.errno is not None:  # EIO, EROFS, ... from the device
        return TierError(f"{what} failed: {exc}", url=url, key=key)
    return None


def _raise_typed(exc: BaseException, url: str, key: str, what: str) -> NoReturn:
    typed = _translate(exc, url, key, what)
    if typed is None or typed is exc:
        raise exc
    raise typed from exc


# --- stores: the few primitives the tier needs, per kind of file system -------------


class _Store(abc.ABC):
    """Byte objects addressed by '/'-separated paths relative to nothing (absolute keys)."""

    #: whether :meth:`create` is atomic against a concurrent writer
    exclusive_create: bool

    @abc.abstractmethod
    def put(self, path: str, parts: Sequence[memoryview], *, if_absent: bool) -> bool:
        """Write the concatenation of ``parts`` to ``path`` atomically; with ``if_absent``,
        return False if it exists.

        ``if_absent`` may race (both writers write): fine for content-addressed blobs.
        """

    def put_object(self, path: str, parts: Sequence[memoryview]) -> None:
        """Write a new, uniquely named object (a pack) atomically; large ones as fast as
        the store allows. Default: :meth:`put`."""
        self.put(path, parts, if_absent=True)

    def open_upload(self, path: str) -> _S3Upload | None:
        """An object streamed while it is written (see ``PackUpload``), or None where
        the store cannot (then a pack is written whole by :meth:`put_object`)."""
        return None

    @abc.abstractmethod
    def create(self, path: str, data: memoryview) -> None:
        """Write ``path`` only if absent; raise ``FileExistsError`` if it exists."""

    def sync(self) -> None:  # noqa: B027 - a PUT to an object store is durable on return
        """Make the names of every ``put`` so far durable (called before a log record)."""

    @abc.abstractmethod
    def read(self, path: str, out: memoryview | None) -> memoryview:
        """The bytes of ``path`` (into ``out`` if given); ``FileNotFoundError`` if absent."""

    def read_parts(self, path: str, parts: Sequence[memoryview]) -> int:
        """Read ``path`` scattered over ``parts`` (see ``Tier.get_parts``); its size."""
        return scatter(self.read(path, None), parts)

    @abc.abstractmethod
    def read_range(self, path: str, start: int, parts: Sequence[memoryview]) -> int:
        """Fill ``parts`` from byte ``start`` of ``path`` (one ranged read); the bytes read
        (fewer if the object ends first). ``FileNotFoundError`` if absent."""

    @abc.abstractmethod
    def sizes(self, directory: str) -> dict[str, int]:
        """Base name -> size of the files directly in ``directory`` ({} if it is missing)."""

    def read_many(self, paths: Sequence[str]) -> list[bytes | None]:
        """The bytes of each path, None for one that vanished."""
        result: list[bytes | None] = []
        for path in paths:
            try:
                result.append(bytes(self.read(path, None)))
            except FileNotFoundError:
                result.append(None)
        return result

    def head(self, path: str, nbytes: int) -> bytes:
        """The first ``nbytes`` bytes of ``path``; ``FileNotFoundError`` if absent."""
        return bytes(self.read(path, None)[:nbytes])

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Size of ``path``; ``FileNotFoundError`` if absent."""

    @abc.abstractmethod
    def mtime(self, path: str) -> float | None:
        """When ``path`` was last written (seconds since the epoch), None where the store
        does not say; ``FileNotFoundError`` if absent."""

    @abc.abstractmethod
    def exists_many(self, paths: Sequence[str]) -> list[bool]:
        """Whether each path exists."""

    @abc.abstractmethod
    def remove_many(self, paths: Sequence[str]) -> None:
        """Remove paths (that were just seen present); absent ones are ignored."""

    @abc.abstractmethod
    def names(self, directory: str) -> list[str]:
        """Base names of the files directly in ``directory`` ([] if it does not exist)."""

    @abc.abstractmethod
    def files_below(self, directory: str) -> Iterator[str]:
        """Paths, relative to ``directory``, of every file below it."""


def _info_mtime(info: Mapping[str, Any]) -> float | None:
    """The modification time in an fsspec ``info()`` entry: ``mtime`` (local, memory,
    sftp), ``LastModified`` (s3fs), ``updated`` / ``last_modified`` (gcsfs, adlfs), as a
    number, a datetime or an ISO 8601 string; None if it has none."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "modified", "created"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, datetime.datetime):
            if value.tzinfo is None:
                value = value.replace(tzinfo=datetime.timezone.utc)
            return value.timestamp()
        if isinstance(value, str):
            try:
                parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
            if parsed.tzinfo is None:
                parsed = parsed.replace(tzinfo=datetime.timezone.utc)
            return parsed.timestamp()
    return None


class _LocalStore(_Store):
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

    def _open_temp(self, directory: str, name: str, parts: Sequence[memoryview]) -> _LocalPut:
        """``parts`` written to a new temporary file beside ``name`` (not yet fsynced)."""
        self._ensure_dir(directory)
        tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
        fd = _os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, parts)
        except BaseException:
            _os.close(fd)
            _unlink_quietly(tmp)
            raise
        return _LocalPut(self, fd, tmp, os.path.join(directory, name))

    def _write_temp(self, directory: str, name: str, parts: Sequence[memoryview]) -> str:
        pending = self._open_temp(directory, name, parts)
        pending.sync()
        return pending.tmp

    def begin_put(self, path: str, parts: Sequence[memoryview]) -> PendingPut:
        """``put(path, parts, if_absent=True)`` in two steps: the write now (into the page
        cache), the fsync and the rename in :meth:`_LocalPut.finish`."""
        if os.path.exists(path):
            self._found((path,))
            return PendingPut(False)
        return self._open_temp(*os.path.split(path), parts)

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
                _fsync_dir(directory)
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
                _unlink_quietly(tmp)
        self._ensure_dir(directory)
        fd = _os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, (data,))
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
            _fsync_dir(d)

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


class _LocalPut(PendingPut):
    """A blob written to a temporary file: :meth:`finish` fsyncs it, then names it (so a
    name is never seen before its content is durable) and leaves the directory's fsync to
    the store's next :meth:`_LocalStore.sync`; :meth:`abort` removes it."""

    def __init__(self, store: _LocalStore, fd: int, tmp: str, path: str) -> None:
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
            _unlink_quietly(self.tmp)
            raise
        self._store._named_in(os.path.dirname(self._path))
        return True

    def abort(self) -> None:
        if self._fd >= 0:
            _os.close(self._fd)
            self._fd = -1
        _unlink_quietly(self.tmp)


def _write_all(fd: int, parts: Sequence[memoryview]) -> None:
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


def _fsync_dir(directory: str) -> None:
    fd = _os.open(directory, os.O_RDONLY)
    try:
        _os.fsync(fd)
    finally:
        _os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        _os.unlink(path)
    except FileNotFoundError:
        pass


class _TypedPut(PendingPut):
    """A store's pending put whose errors are raised as the tier's typed errors."""

    def __init__(self, pending: PendingPut, call: Callable[[Callable[[], Any]], Any]) -> None:
        super().__init__(True)
        self._pending, self._call = pending, call

    def finish(self) -> bool:
        written: bool = self._call(self._pending.finish)
        return written

    def abort(self) -> None:
        self._pending.abort()


class _FsspecStore(_Store):
    """Any fsspec file system; batches go through the event loop of an async one."""

    def __init__(self, fs: Any, protocol: str) -> None:
        from fsspec.implementations.memory import MemoryFileSystem

        self.fs = fs
        self.protocol = protocol
        self._memory = isinstance(fs, MemoryFileSystem)
        self._s3 = protocol in _S3_PROTOCOLS
        # s3fs sends If-None-Match: * for mode="create"; off again if the endpoint refuses.
        self._conditional_put = self._s3
        self.exclusive_create = self._memory or self._s3

    # -- helpers --

    def _gather(self, coros: Sequence[Any]) -> list[Any]:
        """Run coroutines of the async file system, at most ``_ASYNC_BATCH`` at a time."""
        from fsspec.asyn import sync

        async def run() -> list[Any]:
            out: list[Any] = []
            for i in range(0, len(coros), _ASYNC_BATCH):
                out.extend(
                    await asyncio.gather(*coros[i : i + _ASYNC_BATCH], return_exceptions=True)
                )
            return out

        result: list[Any] = sync(self.fs.loop, run)
        return result

    def _pipe(self, path: str, data: bytes, *, create: bool) -> None:
        if not create:
            self.fs.pipe_file(path, data)
            return
        if self._memory:
            with _MEMORY_CREATE_LOCK:
                if self.fs.exists(path):
                    raise FileExistsError(errno.EEXIST, "exists", path)
                self.fs.pipe_file(path, data)
            return
        if self._s3 and not self._conditional_put:
            if self.fs.exists(path):
                raise FileExistsError(errno.EEXIST, "exists", path)
            self.fs.pipe_file(path, data)
            return
        try:
            self.fs.pipe_file(path, data, mode="create")
        except OSError as exc:
            if not (self._s3 and exc.errno == errno.ENOSYS):
                raise
            log.warning(
                "%s: the S3 endpoint does not support conditional writes (If-None-Match); "
                "falling back to check-then-put, so concurrent log writers may race",
                self.fs,
            )
            self._conditional_put = False
            self.exclusive_create = False
            self._pipe(path, data, create=True)

    # -- primitives --

    def put(self, path: str, parts: Sequence[memoryview], *, if_absent: bool) -> bool:
        # one copy, which the store may keep: the caller may reuse the buffers of ``parts``
        payload = b"".join(parts)
        if if_absent and self._conditional_put:
            try:
                self._pipe(path, payload, create=True)
            except FileExistsError:
                return False
            return True
        if if_absent and self.fs.exists(path):
            return False
        self._pipe(path, payload, create=False)
        return True

    def put_object(self, path: str, parts: Sequence[memoryview]) -> None:
        """S3: a multipart upload of ``_PART``-byte parts, ``_REMOTE_THREADS`` at once
        (one request would carry the whole pack on one connection); the object appears
        only when the upload completes. Others: one put."""
        payload = b"".join(parts)
        if self._s3:
            self.fs.pipe_file(path, payload, chunksize=_PART, max_concurrency=_REMOTE_THREADS)
        else:
            self._pipe(path, payload, create=False)

    def open_upload(self, path: str) -> _S3Upload | None:
        return _S3Upload(self.fs, path) if self._s3 else None

    def create(self, path: str, data: memoryview) -> None:
        self._pipe(path, bytes(data), create=True)

    def read(self, path: str, out: memoryview | None) -> memoryview:
        data = self.fs.cat_file(path)
        if out is None:
            return memoryview(data)
        if len(out) < len(data):
            raise ValueError(f"buffer of {len(out)} bytes too small for blob of {len(data)} bytes")
        out[: len(data)] = data
        return out[: len(data)]

    def head(self, path: str, nbytes: int) -> bytes:
        if nbytes == 0:  # a ranged read of nothing is not portable: check existence only
            if not self.fs.exists(path):
                raise FileNotFoundError(errno.ENOENT, "not found", path)
            return b""
        try:
            return bytes(self.fs.cat_file(path, start=0, end=nbytes))  # one ranged request
        except OSError as exc:
            # S3 answers a range over an empty object with 416 (s3fs: EINVAL)
            if exc.errno == errno.EINVAL and self.fs.size(path) == 0:
                return b""
            raise

    def read_range(self, path: str, start: int, parts: Sequence[memoryview]) -> int:
        want = sum(len(p) for p in parts)
        if not want:
            return 0
        data = self.fs.cat_file(path, start=start, end=start + want)  # one ranged request
        return min(scatter(data, parts), want)

    def sizes(self, directory: str) -> dict[str, int]:
        self.fs.invalidate_cache(directory)
        try:
            entries = self.fs.ls(directory, detail=True)
        except FileNotFoundError:
            return {}
        return {
            str(e["name"]).rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
            for e in entries
            if e["type"] == "file"
        }

    def read_many(self, paths: Sequence[str]) -> list[bytes | None]:
        if not self.fs.async_impl or len(paths) < 2:
            return super().read_many(paths)
        results = self._gather([self.fs._cat_file(p) for p in paths])
        out: list[bytes | None] = []
        for r in results:
            if isinstance(r, FileNotFoundError):
                out.append(None)
            elif isinstance(r, BaseException):
                raise r
            else:
                out.append(bytes(r))
        return out

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def mtime(self, path: str) -> float | None:
        return _info_mtime(self.fs.info(path))

    def exists_many(self, paths: Sequence[str]) -> list[bool]:
        if not self.fs.async_impl or len(paths) < 2:
            return [bool(self.fs.exists(p)) for p in paths]
        probe = self._s3_head if self._s3 else self.fs._exists
        results = self._gather([probe(p) for p in paths])
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return [bool(r) for r in results]

    async def _s3_head(self, path: str) -> bool:
        # s3fs's exists() follows a missing key with a listing (is it a "directory"?):
        # a blob is never a directory, so one HEAD answers.
        bucket, key, _ = self.fs.split_path(path)
        try:
            await self.fs._call_s3("head_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return False
        return True

    def remove_many(self, paths: Sequence[str]) -> None:
        try:
            self.fs.rm(list(paths))  # one bulk request on object stores
        except FileNotFoundError:
            for path in paths:
                try:
                    self.fs.rm_file(path)
                except FileNotFoundError:
                    continue

    def names(self, directory: str) -> list[str]:
        self.fs.invalidate_cache(directory)
        try:
            entries = self.fs.ls(directory, detail=True)
        except FileNotFoundError:
            return []
        return [
            str(e["name"]).rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "file"
        ]

    def files_below(self, directory: str) -> Iterator[str]:
        self.fs.invalidate_cache(directory)
        try:
            found = self.fs.find(directory)
        except FileNotFoundError:
            return
        prefix = self.fs._strip_protocol(directory).rstrip("/") + "/"
        for path in found:
            path = str(path)
            if path.startswith(prefix):
                yield path[len(prefix) :]


class _S3Upload:
    """A pack streamed to S3 as a multipart upload: each ``_PART`` bytes added go out as a
    part (up to ``_REMOTE_THREADS`` at once) while the pack is still being filled; the
    object exists only once :meth:`finish` completes the upload. A pack that stays under
    one part is one ``PutObject``. An upload never completed is invisible (an S3
    lifecycle rule aborting incomplete multipart uploads frees its parts)."""

    def __init__(self, fs: Any, path: str) -> None:
        self._fs, self._path = fs, path
        self._bucket, self._key, _ = fs.split_path(path)
        # what is added but not sent yet: views of the callers' bytes (immutable), joined
        # once per part, so a byte is copied once on its way to a part
        self._buf: list[memoryview] = []
        self._buffered = 0
        self._id: str | None = None
        self._parts: list[Any] = []  # concurrent futures of upload_part, in order

    def _s3(self, method: str, **kwargs: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(
            self._fs._call_s3(method, Bucket=self._bucket, Key=self._key, **kwargs),
            self._fs.loop,
        )

    def _send(self, body: bytes) -> None:
        if self._id is None:
            self._id = self._s3("create_multipart_upload").result()["UploadId"]
        busy = [f for f in self._parts if not f.done()]
        if len(busy) >= _REMOTE_THREADS:
            busy[0].result()
        for f in self._parts:
            if f.done():
                f.result()  # a failed part fails the pack now
        n = len(self._parts) + 1
        self._parts.append(self._s3("upload_part", UploadId=self._id, PartNumber=n, Body=body))

    def add(self, data: bytes) -> None:
        view = memoryview(data).cast("B")
        while view:
            take = min(len(view), _PART - self._buffered)
            self._buf.append(view[:take])
            self._buffered += take
            view = view[take:]
            if self._buffered == _PART:
                self._send(self._take())

    def _take(self) -> bytes:
        body = b"".join(self._buf)
        self._buf, self._buffered = [], 0
        return body

    def finish(self, tail: bytes) -> None:
        self._buf.append(memoryview(tail).cast("B"))
        if self._id is None:
            self._fs.pipe_file(self._path, self._take())
            return
        self._send(self._take())  # the last part may be short
        parts = [
            {"PartNumber": i, "ETag": f.result()["ETag"]} for i, f in enumerate(self._parts, 1)
        ]
        self._s3(
            "complete_multipart_upload", UploadId=self._id, MultipartUpload={"Parts": parts}
        ).result()
        self._fs.invalidate_cache(self._path)

    def abort(self) -> None:
        self._buf, self._buffered = [], 0
        if self._id is not None:
            for f in self._parts:
                f.cancel()
            self._s3("abort_multipart_upload", UploadId=self._id).result()
            self._id = None


# --- the tier ------------------------------------------------------------------------


def _parse_pack_size(value: int | str | None, url: str, *, default: int) -> int:
    """The ``pack_size`` option in bytes (0: no packs, one object per blob)."""
    if value is None:
        return default
    try:
        size = parse_size(value)
    except ValueError as exc:
        raise invalid_url(url, f"pack_size: {exc}") from None
    if size < 0:
        raise invalid_url(url, f"pack_size must be 0 (no packs) or positive, got {value!r}")
    return size


def _parse_bool(value: Any, name: str, url: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise invalid_url(url, f"option {name} must be a bool, got {value!r}")


class FsspecTier(Tier):
    """Blobs and log as objects under a root of any fsspec file system (see module doc)."""

    scheme: ClassVar[str] = "fsspec"

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        read_only: bool = False,
        survives: FailureDomain | str | None = None,
        shared: bool | None = None,
        persistent: bool | None = None,
        speed_rank: int | None = None,
        compress: bool | None = None,
        pack_size: int | str | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise invalid_url(url, f"unknown options for the fsspec tier: {sorted(unknown)}")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise invalid_url(url, "storage_options must be a dict")
        protocol, self._root, self._store = _open_store(url, dict(storage_options or {}))
        self.protocol = protocol
        local = isinstance(self._store, _LocalStore)
        memory = isinstance(self._store, _FsspecStore) and self._store._memory
        caps = _default_capabilities(
            local=local, memory=memory, shared=_parse_bool(shared, "shared", url)
        )
        try:
            caps = Capabilities(
                survives=FailureDomain(survives) if survives is not None else caps.survives,
                shared=caps.shared,
                persistent=(
                    caps.persistent
                    if _parse_bool(persistent, "persistent", url) is None
                    else bool(persistent)
                ),
                speed_rank=caps.speed_rank if speed_rank is None else int(speed_rank),
                compress=(
                    caps.compress
                    if _parse_bool(compress, "compress", url) is None
                    else bool(compress)
                ),
                blob_times=True,
            )
        except ValueError as exc:
            raise invalid_url(url, f"bad capability option: {exc}") from None
        super().__init__(url, capabilities=caps, read_only=bool(read_only))
        self._lock = threading.Lock()
        self._next_seq: int | None = None
        self._sep = os.sep if local else "/"
        self._blob_dir = self._join(self._root, "blobs")
        self._log_dir = self._join(self._root, "log")
        self._packs: PackedBlobs | None = None
        size = _parse_pack_size(pack_size, url, default=0 if local or memory else DEFAULT_PACK_SIZE)
        self._check_marker(packed=bool(size))
        if size:
            self._packs = PackedBlobs(
                self._store,
                url=url,
                root=self._root,
                pack_size=size,
                call=self._call,
                join=self._join,
                loose_path=self._blob_path,
                remote=not (local or memory),
            )

    def flush(self) -> None:
        """Write the blobs waiting for a pack (a packed tier); make their names durable."""
        if self.read_only:
            return
        if self._packs is not None:
            self._packs.flush()
        self._call("sync", "", self._store.sync)

    def close(self) -> None:
        """Write the blobs still waiting for a pack, and make the names of blobs put since
        the last log record durable (a failure is logged: no record names those blobs
        yet, so nothing committed depends on them)."""
        if self.read_only:
            return
        try:
            if self._packs is not None:
                self._packs.flush()  # blobs waiting for a pack are written at close too
            self._store.sync()
        except (OSError, TierError) as exc:
            log.warning("%s: could not store the last blobs at close: %s", self.url, exc)

    # --- paths ---------------------------------------------------------------------

    def _join(self, *parts: str) -> str:
        return self._sep.join(p.rstrip(self._sep) if i == 0 else p for i, p in enumerate(parts))

    def _blob_path(self, blob_id: str) -> str:
        check_blob_id(blob_id, self.url)  # also keeps a crafted id from leaving the root
        return self._join(self._blob_dir, blob_id[:2], blob_id)

    def _log_path(self, seq: int) -> str:
        return self._join(self._log_dir, f"{seq:016d}.rec")

    def _ckpt_path(self, seq: int) -> str:
        return self._join(self._log_dir, f"{seq:016d}.ckpt")

    # --- error mapping -------------------------------------------------------------

    def _call(self, what: str, key: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (TierError, ValueError, FileExistsError):
            raise
        except FileNotFoundError as exc:
            raise NotFound(f"{what}: not found", url=self.url, key=key) from exc
        except Exception as exc:
            _raise_typed(exc, self.url, key, what)

    # --- marker --------------------------------------------------------------------

    def _check_marker(self, *, packed: bool) -> None:
        """Check the root's marker (create it on a writable open). A tier that writes
        packs says layout 2, so that a tiercheck that cannot read packs refuses the root
        instead of finding it empty; one that does not keeps layout 1."""
        path = self._join(self._root, _MARKER)
        want = LAYOUT_VERSION if packed else 1
        body = json.dumps({"tier": _MARKER_KIND, "layout": want}).encode()
        try:
            raw = bytes(self._call("open", _MARKER, lambda: self._store.read(path, None)))
        except NotFound:
            if self.read_only:
                return
            try:
                self._call(
                    "create marker", _MARKER, lambda: self._store.create(path, memoryview(body))
                )
            except FileExistsError:
                pass  # another writer created it first
            else:
                return
            raw = bytes(self._call("open", _MARKER, lambda: self._store.read(path, None)))
        marker = self._parse_marker(raw)
        layout = int(marker["layout"])
        if layout > LAYOUT_VERSION:
            raise FormatVersionError(
                f"tier {self.url} has layout {layout}; this tiercheck reads up to "
                f"{LAYOUT_VERSION}: upgrade tiercheck"
            )
        if layout < want and not self.read_only:
            self._put_marker({**marker, "layout": want}, "upgrade marker")

    def _parse_marker(self, raw: bytes) -> dict[str, Any]:
        try:
            marker = json.loads(raw)
            kind = marker["tier"]
            int(marker["layout"])
        except (ValueError, KeyError, TypeError):
            raise invalid_url(
                self.url, f"{_MARKER} under the root is not a tiercheck marker; pick another root"
            ) from None
        if kind != _MARKER_KIND:
            raise invalid_url(self.url, f"the root holds a {kind!r} store, not {_MARKER_KIND!r}")
        return cast(dict[str, Any], marker)

    def _read_marker(self, what: str) -> dict[str, Any] | None:
        path = self._join(self._root, _MARKER)
        try:
            raw = bytes(self._call(what, _MARKER, lambda: self._store.read(path, None)))
        except NotFound:
            return None
        return self._parse_marker(raw)

    def _put_marker(self, marker: dict[str, Any], what: str) -> None:
        """Replace the marker whole (a temporary file and a rename, or one PUT)."""
        path = self._join(self._root, _MARKER)
        body = memoryview(json.dumps(marker).encode())
        self._call(what, _MARKER, lambda: self._store.put(path, (body,), if_absent=False))

    # --- owner ---------------------------------------------------------------------

    def read_owner(self) -> StoreOwner | None:
        """The ``owner`` the marker records (None: no marker, no owner, or not a record).
        One object per tier holds both, so a prefix costs one object besides its data."""
        marker = self._read_marker("read the owner")
        if marker is None or "owner" not in marker:
            return None
        try:
            return StoreOwner.from_json(marker["owner"])
        except (ValueError, TypeError):
            return None

    def write_owner(self, owner: StoreOwner) -> None:
        """Record ``owner`` in the marker, which is replaced whole."""
        self._check_writable("record the owner")
        marker = self._read_marker("record the owner")
        if marker is None:  # a writable open creates it; gone since: made again
            marker = {"tier": _MARKER_KIND, "layout": LAYOUT_VERSION if self._packs else 1}
        self._put_marker({**marker, "owner": owner.to_json()}, "record the owner")

    # --- blobs ---------------------------------------------------------------------

    def put(self, blob_id: str, data: Buffer, *, overwrite: bool = False) -> bool:
        return self.put_parts(blob_id, (data,), overwrite=overwrite)

    def put_parts(self, blob_id: str, parts: Sequence[Buffer], *, overwrite: bool = False) -> bool:
        """As :meth:`put`; a local file system takes the parts in one vectored write, an
        object store gets them joined once."""
        path = self._blob_path(blob_id)
        self._check_writable("put")
        views = [_byte_view(p) for p in parts]
        if self._packs is not None:
            return self._packs.put(blob_id, views, overwrite=overwrite)
        written: bool = self._call(
            "put", blob_id, lambda: self._store.put(path, views, if_absent=not overwrite)
        )
        return written

    def begin_put(self, blob_id: str, parts: Sequence[Buffer]) -> PendingPut:
        """A local file system writes the temporary file now and fsyncs and names it in
        :meth:`PendingPut.finish`; any other store puts at once."""
        store = self._store
        if not isinstance(store, _LocalStore) or self._packs is not None:
            return super().begin_put(blob_id, parts)  # a pack copies the parts at once
        path = self._blob_path(blob_id)
        self._check_writable("put")
        views = [_byte_view(p) for p in parts]
        pending: PendingPut = self._call("put", blob_id, lambda: store.begin_put(path, views))
        return _TypedPut(pending, partial(self._call, "put", blob_id))

    def put_many(self, items: Iterable[tuple[str, Buffer]]) -> int:
        batch = [(self._blob_path(bid), _byte_view(data), bid) for bid, data in items]
        self._check_writable("put")
        if self._packs is not None:
            packs = self._packs
            return sum(1 for _, view, bid in batch if packs.put(bid, (view,), overwrite=False))
        store = self._store
        if isinstance(store, _LocalStore) or len(batch) < 2:
            count = 0
            for path, view, bid in batch:
                if self._call("put", bid, partial(store.put, path, (view,), if_absent=True)):
                    count += 1
            return count

        # A remote store is latency bound: overlap the requests (s3fs and gcsfs are safe to
        # call from several threads; each call runs on the file system's event loop).
        def one(item: tuple[str, memoryview, str]) -> bool:
            path, view, bid = item
            written: bool = self._call("put", bid, lambda: store.put(path, (view,), if_absent=True))
            return written

        with ThreadPoolExecutor(max_workers=min(_REMOTE_THREADS, len(batch))) as pool:
            return sum(1 for written in pool.map(one, batch) if written)

    def get(self, blob_id: str, out: memoryview | None = None) -> memoryview:
        if self._packs is not None:
            return self._packs.get(blob_id, out, partial(self._get_loose, blob_id, out))
        return self._get_loose(blob_id, out)

    def _get_loose(self, blob_id: str, out: memoryview | None) -> memoryview:
        path = self._blob_path(blob_id)
        try:
            view: memoryview = self._call("get", blob_id, lambda: self._store.read(path, out))
        except NotFound:
            raise NotFound("blob not found", url=self.url, key=blob_id) from None
        except ValueError as exc:
            raise ValueError(f"{exc} ({self.url} {blob_id})") from None
        return view

    def get_parts(self, blob_id: str, parts: Sequence[memoryview]) -> int:
        """As ``Tier.get_parts``; a local file is read with ``preadv`` straight into
        ``parts``; a packed blob by one ranged read."""
        if self._packs is not None:
            return self._packs.get_parts(
                blob_id, parts, partial(self._get_parts_loose, blob_id, parts)
            )
        return self._get_parts_loose(blob_id, parts)

    def _get_parts_loose(self, blob_id: str, parts: Sequence[memoryview]) -> int:
        path = self._blob_path(blob_id)
        try:
            size: int = self._call("get", blob_id, lambda: self._store.read_parts(path, parts))
        except NotFound:
            raise NotFound("blob not found", url=self.url, key=blob_id) from None
        return size

    def head(self, blob_id: str, nbytes: int = 64) -> bytes:
        """The first ``nbytes`` bytes, by a ranged read (local files: a short read)."""
        path = self._blob_path(blob_id)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if self._packs is not None:
            return self._packs.head(
                blob_id, nbytes, partial(self._head_loose, path, blob_id, nbytes)
            )
        return self._head_loose(path, blob_id, nbytes)

    def _head_loose(self, path: str, blob_id: str, nbytes: int) -> bytes:
        try:
            data: bytes = self._call("head", blob_id, lambda: self._store.head(path, nbytes))
        except NotFound:
            raise NotFound("blob not found", url=self.url, key=blob_id) from None
        return data

    def size(self, blob_id: str) -> int:
        path = self._blob_path(blob_id)
        if self._packs is not None:
            return self._packs.size(blob_id, partial(self._size_loose, path, blob_id))
        return self._size_loose(path, blob_id)

    def _size_loose(self, path: str, blob_id: str) -> int:
        try:
            n: int = self._call("size", blob_id, lambda: self._store.size(path))
        except NotFound:
            raise NotFound("blob not found", url=self.url, key=blob_id) from None
        return n

    def has(self, blob_ids: Iterable[str]) -> set[str]:
        ids = list(blob_ids)
        if self._packs is not None:
            return self._packs.has(ids)
        paths = [self._blob_path(b) for b in ids]
        if not ids:
            return set()
        found: builtins.list[bool] = self._call("has", "", lambda: self._store.exists_many(paths))
        return {b for b, there in zip(ids, found) if there}

    def delete(self, blob_ids: Iterable[str]) -> int:
        ids = list(dict.fromkeys(blob_ids))
        paths = [self._blob_path(b) for b in ids]
        self._check_writable("delete")
        if self._packs is not None:
            return self._packs.delete(ids)
        if not ids:
            return 0
        present = [
            p
            for p, there in zip(
                paths, self._call("delete", "", lambda: self._store.exists_many(paths))
            )
            if there
        ]
        if present:
            self._call("delete", "", lambda: self._store.remove_many(present))
        return len(present)

    def written_at(self, blob_ids: Sequence[str]) -> dict[str, float]:
        """Each blob object's modification time (one stat or HEAD each); a packed blob's is
        its pack's."""
        if self._packs is not None:
            return self._packs.written_at(blob_ids, self._loose_written_at)
        out: dict[str, float] = {}
        for blob_id in blob_ids:
            try:
                t = self._loose_written_at(blob_id)
            except NotFound:
                continue
            if t is not None:
                out[blob_id] = t
        return out

    def _loose_written_at(self, blob_id: str) -> float | None:
        path = self._blob_path(blob_id)
        t: float | None = self._call("written_at", blob_id, partial(self._store.mtime, path))
        return t

    def list(self) -> Iterator[str]:
        if self._packs is not None:
            return iter(self._packs.list())
        rels: builtins.list[str] = self._call(
            "list", "", lambda: list(self._store.files_below(self._blob_dir))
        )
        ids = []
        for rel in rels:
            prefix, _, name = rel.replace(os.sep, "/").partition("/")
            if BLOB_ID_RE.match(name) and prefix == name[:2]:
                ids.append(name)
        return iter(ids)

    # --- log -----------------------------------------------------------------------

    def _log_names(self) -> tuple[builtins.list[int], builtins.list[int]]:
        """Sequence numbers of the record objects and of the checkpoint objects, sorted."""
        names: builtins.list[str] = self._call(
            "read log", "", lambda: self._store.names(self._log_dir)
        )
        recs = sorted(int(m.group(1)) for m in map(_LOG_NAME_RE.match, names) if m)
        ckpts = sorted(int(m.group(1)) for m in map(_CKPT_NAME_RE.match, names) if m)
        return recs, ckpts

    def _log_seqs(self) -> builtins.list[int]:
        """Every sequence number in use (records and checkpoints): appends go after them."""
        recs, ckpts = self._log_names()
        return sorted(recs + ckpts)

    def _log_view(self) -> tuple[int | None, builtins.list[int]]:
        """The newest checkpoint's seq (or None) and the record seqs after it."""
        recs, ckpts = self._log_names()
        ckpt = ckpts[-1] if ckpts else None
        return ckpt, [r for r in recs if ckpt is None or r > ckpt]

    def append(self, record: bytes, *, blobs: Iterable[tuple[str, Buffer]] = ()) -> None:
        self._check_writable("append")
        framed = memoryview(frame_record(bytes(record)))
        items = list(blobs)
        for bid, _ in items:
            check_blob_id(bid, self.url)
        if items:
            self.put_many(items)
        if self._packs is not None:
            self._packs.flush()  # every blob put so far is in a pack before the record
        self._call("sync", "", self._store.sync)  # every blob named so far is durable
        with self._lock:
            seq = self._next_seq
        if seq is None:
            seqs = self._log_seqs()
            seq = seqs[-1] + 1 if seqs else 0
        for _ in range(_MAX_APPEND_RACES):
            path = self._log_path(seq)
            try:
                self._call("append", f"log/{seq:016d}", partial(self._store.create, path, framed))
            except FileExistsError:
                # Another writer (or thread) claimed seq: continue after the newest record.
                seqs = self._log_seqs()
                seq = max(seq + 1, seqs[-1] + 1 if seqs else 0)
                continue
            with self._lock:
                if self._next_seq is None or self._next_seq <= seq:
                    self._next_seq = seq + 1
            return
        raise AlreadyExists(
            f"append lost {_MAX_APPEND_RACES} races for a log sequence number in a row",
            url=self.url,
        )

    def _read_view(
        self, damaged: builtins.list[str] | None = None
    ) -> builtins.list[tuple[int, bytes]]:
        """``(seq, payload)`` of the newest checkpoint and every intact record after it;
        the names of damaged record objects are added to ``damaged``."""
        ckpt, seqs = self._log_view()
        paths = ([self._ckpt_path(ckpt)] if ckpt is not None else []) + [
            self._log_path(s) for s in seqs
        ]
        names = ([f"{ckpt:016d}.ckpt"] if ckpt is not None else []) + [
            f"{s:016d}.rec" for s in seqs
        ]
        order = ([ckpt] if ckpt is not None else []) + seqs
        raws: builtins.list[bytes | None] = self._call(
            "read log", "", lambda: self._store.read_many(paths)
        )
        if ckpt is not None and raws[0] is None:
            # A newer compaction replaced this checkpoint between listing and reading.
            return self._read_view(damaged)
        records: builtins.list[tuple[int, bytes]] = []
        for seq, name, raw in zip(order, names, raws):
            if raw is None:
                continue
            payload = unframe_record(raw)
            if payload is None:
                log.warning(
                    "%s: log object %s is torn or damaged (%d bytes); skipped",
                    self.url,
                    name,
                    len(raw),
                )
                if damaged is not None:
                    damaged.append(f"log object {name} ({len(raw)} bytes)")
                continue
            records.append((seq, payload))
        with self._lock:
            nxt = order[-1] + 1 if order else 0
            if self._next_seq is None or self._next_seq < nxt:
                self._next_seq = nxt
        return records

    def read_log(self) -> builtins.list[bytes]:
        """The newest checkpoint (if any) and the records after it: one GET each."""
        return [payload for _, payload in self._read_view()]

    def scan_log(self) -> LogScan:
        """As :meth:`read_log`, naming each record object that is damaged (objects are
        written whole, so a damaged one is never a write in flight)."""
        damaged: builtins.list[str] = []
        records = [payload for _, payload in self._read_view(damaged)]
        return LogScan(tuple(records), tuple(damaged))

    def replace_log_prefix(self, count: int, record: bytes) -> None:
        """Write the checkpoint object, then delete what it replaces (see module doc)."""
        self._check_writable("compact the log")
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        view = self._read_view()
        if count > len(view):
            raise ValueError(f"count {count} is outside the log of {len(view)} records")
        last = view[count - 1][0]
        framed = memoryview(frame_record(bytes(record)))
        path = self._ckpt_path(last)
        self._call(
            "compact log",
            f"log/{last:016d}.ckpt",
            partial(self._store.put, path, (framed,), if_absent=False),
        )
        recs, ckpts = self._log_names()
        stale = [self._log_path(r) for r in recs if r <= last]
        stale += [self._ckpt_path(c) for c in ckpts if c < last]
        if stale:
            self._call("compact log", "", lambda: self._store.remove_many(stale))


def _default_capabilities(*, local: bool, memory: bool, shared: bool | None) -> Capabilities:
    # a file system of this node (or process memory) takes bytes faster than zstd makes them
    if memory:
        return Capabilities(
            survives=FailureDomain.NONE,
            shared=bool(shared),
            persistent=False,
            speed_rank=5,
            compress=False,
        )
    if local:
        return Capabilities(
            survives=FailureDomain.NODE if shared else FailureDomain.PROCESS,
            shared=bool(shared),
            persistent=True,
            speed_rank=40,
            compress=False,
        )
    return Capabilities(
        survives=FailureDomain.CLUSTER,
        shared=True if shared is None else shared,
        persistent=True,
        speed_rank=50,
    )


def _open_store(url: str, storage_options: dict[str, Any]) -> tuple[str, str, _Store]:
    """Parse ``url``; return (protocol, root path in the store, store)."""
    if any(c in url for c in "?#") or any(not c.isprintable() for c in url):
        raise invalid_url(url, "no query, fragment or control characters in a tier URL")
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep:
        raise invalid_url(url, "expected PROTOCOL://PATH")
    protocol = scheme[len("fsspec+") :] if scheme.startswith("fsspec+") else scheme
    if not protocol:
        raise invalid_url(url, "fsspec+ needs a protocol, e.g. fsspec+memory://root")
    if protocol in _LOCAL_PROTOCOLS:
        if storage_options:
            raise invalid_url(url, f"storage_options are not used by {protocol}://")
        parts = urlsplit(f"file://{rest}")
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise invalid_url(url, "expected an absolute path: file:///abs/path")
        root = os.path.normpath(parts.path)
        if root in ("/", "//"):
            raise invalid_url(url, "refusing to use / as a tier root")
        return protocol, root, _LocalStore(root)

    import fsspec

    if not rest.strip("/"):
        raise invalid_url(url, f"expected {protocol}://ROOT, e.g. s3://bucket/prefix")
    if protocol not in ("memory",):
        # Listings must be fresh: another writer may have added log records.
        storage_options.setdefault("use_listings_cache", False)
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise UnknownScheme(f"fsspec knows no protocol {protocol!r}", url=url) from None
    except ImportError as exc:
        raise invalid_url(
            url, f"protocol {protocol!r} needs a package that is missing: {exc}"
        ) from None
    try:
        fs = cls(**storage_options)
    except TypeError as exc:
        raise invalid_url(url, f"bad storage_options for {protocol}://: {exc}") from None
    root = str(cls._strip_protocol(f"{protocol}://{rest}")).rstrip("/")
    if not root or root == "/":
        raise invalid_url(url, "refusing to use the store's top level as a tier root")
    store = _FsspecStore(fs, protocol)
    if protocol in _BUCKET_PROTOCOLS:
        _check_bucket(url, store, root.split("/", 1)[0])
    return protocol, root, store


def _check_bucket(url: str, store: _FsspecStore, bucket: str) -> None:
    try:
        store.fs.invalidate_cache(bucket)
        store.fs.info(bucket)
    except FileNotFoundError:
        raise InvalidURL(
            f"bucket {bucket!r} does not exist; create it or fix the URL", url=url
        ) from None
    except PermissionError:
        raise InvalidURL(
            f"access to bucket {bucket!r} denied; check the credentials in storage_options "
            "or the environment",
            url=url,
        ) from None
    except Exception as exc:
        if _is_unavailable(exc):
            raise TierUnavailable(
                f"cannot reach the store to open bucket {bucket!r}: {exc}", url=url
            ) from exc
        raise
