"""``lmdb:///abs/path``: blobs and log in an LMDB environment on local disk (NVMe).

On-disk layout: ``PATH`` is an LMDB environment directory::

    PATH/
      data.mdb   three named databases:
                   "blobs"  key: the blob id as 32 raw bytes, value: the blob bytes
                   "log"    key: sequence number as big-endian u64 (0, 1, 2, ...),
                            value: one framed record (tiercheck.formats.framing)
                 and, in the main database, the key "tiercheck.owner": the store owning
                 the environment (JSON, formats/SPEC.md "Store identity")
                   "times"  key: a blob id as in "blobs", value: when the blob was
                            written, an f64 LE of seconds since the epoch (written in
                            the blob's transaction; GC's grace runs from it)
      lock.mdb   LMDB's reader table and writer lock

URL: only the absolute form ``lmdb:///abs/path`` (empty host, percent-encoding allowed) is
accepted. ``lmdb://relative`` would put a path in the host part of the URL, where it is
easy to misread and resolves against whatever the working directory is; it is refused
with ``InvalidURL``.

Options: ``read_only`` (open with ``readonly=True``, safe beside a live writer: the reader
takes a slot in LMDB's reader table in ``lock.mdb``, so the writer never reuses the pages of
a snapshot it is reading; where ``lock.mdb`` cannot be written, e.g. a read-only mount, it
falls back to ``lock=False`` with a warning, which is only safe when no process writes),
``sync`` (default True: every commit is
fsync'ed, content survives power loss; False trades the last transactions on power loss
for speed, never integrity), ``map_size`` (initial map size, default 1 GiB),
``max_size`` (cap on map growth; default none) and ``writemap`` (default True, see below).
The default map is 64 MiB and grows with the data, so ``data.mdb`` (as long as the map
under writemap, a sparse file) stays near the size of what the tier holds.

Transactions: every write is one LMDB write transaction, so a blob or a log record is
either entirely there or not at all, and ``append(record, blobs=...)`` commits blobs and
record together (``atomic_batch``).

Writable map: a writer opens the environment with ``writemap`` (LMDB writes values
straight into the file's pages instead of into heap pages it then writes out: measured
about 40% less time per 256 MiB of blobs in 64 MiB transactions on this project's
machine). A page fault on a hole in the file when the disk is full would be SIGBUS, not
an error, so before each write transaction the tier reserves disk blocks
(``posix_fallocate``) for every page the transaction can touch: the pages in use, the
bytes it writes, and slack for the tree, up to the map size. A full disk is then
``TierFull`` from the reservation, before anything is written (so a write is refused once
less than its size plus 16 MiB is free). Where the file system cannot
reserve blocks the tier opens without ``writemap`` (option ``writemap=False`` does too).

Map growth: LMDB refuses a write that does not fit in the map (``MapFullError``). The
tier then grows the map by half, or to what the write needs if that is more, in steps of
16 MiB (``set_mapsize``, which needs every transaction of this process
on the environment to be finished: a process-wide read/write gate per environment makes
growth wait for readers) and retries, up to ``max_size``; past it the write raises
``TierFull``. A map grown by another process is adopted on ``MapResizedError``.

LMDB forbids opening one environment twice in a process, so environments are shared
through a process-wide cache keyed by real path, with a reference count. Environment
settings (``sync``, ``map_size``) come from the first open in the process.
"""

from __future__ import annotations

import builtins
import errno
import fcntl
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar
from urllib.parse import unquote, urlsplit

import lmdb

from tiercheck.backends.base import (
    Buffer,
    Capabilities,
    FailureDomain,
    LogScan,
    StoreOwner,
    Tier,
    check_blob_id,
    invalid_url,
    scatter,
)
from tiercheck.errors import NotFound, TierError, TierFull, TierLost
from tiercheck.formats.framing import frame_record, unframe_record

__all__ = ["DEFAULT_MAP_SIZE", "LmdbTier"]

log = logging.getLogger(__name__)

# The map starts small and grows with the data: with writemap LMDB makes data.mdb as long
# as the map (sparse), so a large initial map is a large file to every tool that reads
# apparent sizes (ls, du --apparent-size, a quota on apparent bytes).
DEFAULT_MAP_SIZE = 64 << 20
# Bytes of blob data per write transaction in put_many: LMDB (without writemap) holds a
# transaction's dirty pages in heap memory until commit.
_BATCH_BYTES = 256 << 20
# Disk blocks are reserved (writemap) in steps of this many bytes, with this much slack for
# the tree pages and the free list a transaction rewrites beside its values. A step of 16 MiB
# is still one posix_fallocate per transaction or fewer, and what a store of a small state
# holds on disk ahead of its pages stays small (docs/configuration.md, "Footprint").
_RESERVE_STEP = 16 << 20
_RESERVE_SLACK = 16 << 20
_SEQ = struct.Struct(">Q")
_OWNER_KEY = b"tiercheck.owner"
_TIME = struct.Struct("<d")  # "times": when a blob was written, seconds since the epoch
# LMDB's meta pages (pages 0 and 1 of data.mdb, lmdb's MDB_meta after a 16-byte page
# header): magic at 16, page size (mm_dbs[FREE_DBI].md_pad) at 40, the last page in use
# and the transaction id at 136 and 144.
_META_MAGIC = 0xBEEFC0DE
_META_END = 152
_T = TypeVar("_T")


class _Gate:
    """Shared/exclusive gate, exclusive-preferring: transactions enter shared, map growth
    (which needs no transaction alive in this process) enters exclusive."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                if not self._shared:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            while self._exclusive or self._shared:
                self._cond.wait()
            self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


@dataclass
class _Env:
    """One open environment, shared by every tier on its path in this process."""

    path: str
    env: lmdb.Environment
    blobs: Any  # lmdb's database handle (untyped)
    log: Any
    times: Any  # None in an environment made before it (opened read-only)
    readonly: bool
    refs: int = 1
    gate: _Gate = field(default_factory=_Gate)
    # LMDB has one writer at a time anyway; queueing writers here keeps them out of the
    # gate while a map growth waits for it.
    write_lock: threading.Lock = field(default_factory=threading.Lock)
    # the writer's buffer for a blob given in parts (see _joined)
    join: bytearray = field(default_factory=bytearray)
    # writemap: data.mdb opened for posix_fallocate, and the bytes reserved so far
    data_fd: int | None = None
    reserved: int = 0


def _joined(e: _Env, views: builtins.list[memoryview]) -> memoryview:
    """``views`` concatenated in ``e``'s join buffer (valid until the next call; only the
    writer, under ``e.write_lock``, calls it)."""
    n = sum(len(v) for v in views)
    if len(e.join) < n:
        e.join = bytearray(n)
    out = memoryview(e.join)
    pos = 0
    for v in views:
        out[pos : pos + len(v)] = v
        pos += len(v)
    return out[:n]


_envs: dict[str, _Env] = {}
_envs_lock = threading.Lock()


def _parse_url(url: str) -> str:
    """Return the absolute filesystem path named by ``lmdb:///abs/path``."""
    if not isinstance(url, str):
        raise invalid_url(str(url), "expected lmdb:///absolute/path")
    parts = urlsplit(url)
    if parts.scheme.lower() != "lmdb":
        raise invalid_url(url, "expected lmdb:///absolute/path")
    if parts.netloc:
        raise invalid_url(url, "lmdb URLs take an absolute path and no host: lmdb:///absolute/path")
    if parts.query or parts.fragment:
        raise invalid_url(url, "lmdb URLs take no query or fragment")
    path = unquote(parts.path)
    if not path.startswith("/") or path.rstrip("/") == "" or "\x00" in path:
        raise invalid_url(url, "expected lmdb:///absolute/path (a directory, not /)")
    return os.path.normpath(path)


def _open_read_only(path: str) -> lmdb.Environment:
    """Open ``path`` read-only with LMDB's reader locking (safe next to a live writer);
    without it only where ``lock.mdb`` cannot be opened for writing."""
    try:
        return lmdb.open(path, readonly=True, lock=True, max_dbs=3, subdir=True)
    except lmdb.Error as exc:
        if not isinstance(exc, (lmdb.ReadonlyError, lmdb.PanicError)) and not (
            getattr(exc, "errno", None) in (errno.EACCES, errno.EROFS, errno.EPERM)
            or "Permission denied" in str(exc)
            or "Read-only file system" in str(exc)
        ):
            raise
    log.warning(
        "opening LMDB at %s read-only without reader locking (%s cannot be written): "
        "this is only safe while no process writes to it",
        path,
        os.path.join(path, "lock.mdb"),
    )
    return lmdb.open(path, readonly=True, lock=False, max_dbs=3, subdir=True)


def _meta(data: bytes, at: int) -> tuple[int, int, int] | None:
    """``(page size, last page, txn id)`` of the meta page at ``at``, None if it is bad."""
    if len(data) < at + _META_END or struct.unpack_from("<I", data, at + 16)[0] != _META_MAGIC:
        return None
    (psize,) = struct.unpack_from("<I", data, at + 40)
    last, txnid = struct.unpack_from("<QQ", data, at + 136)
    if psize < 512 or psize & (psize - 1) or psize > 1 << 16:
        return None
    return psize, last, txnid


@contextmanager
def _creation_done(path: str) -> Iterator[None]:
    """Wait until no other process is creating the environment at ``path``, and hold that
    off while the caller reads ``data.mdb``: a shared record lock on byte 0 of
    ``lock.mdb``, which LMDB holds exclusively while it writes a new file's meta pages (a
    data.mdb read in that window is empty, not damaged). No ``lock.mdb``: nothing to wait
    for. Only before the environment is open in this process: closing the descriptor drops
    every record lock this process holds on the file, LMDB's own included."""
    try:
        fd = os.open(os.path.join(path, "lock.mdb"), os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_SH, 1, 0, os.SEEK_SET)
        except OSError:
            pass  # a file system without record locks: read as before
        yield
    finally:
        os.close(fd)


def check_data_file(url: str, path: str, *, must_exist: bool) -> None:
    """Raise :class:`TierLost` unless ``path``/data.mdb is an LMDB file whose size covers
    the last page its newest meta page names (``must_exist``: a missing file is lost too).

    LMDB maps the file without checking its size, so a read of a page past the end of a
    truncated file is SIGBUS (read-only), and a writable open extends the file with zeros
    (pages that then read as MDB_CORRUPTED); an empty file is initialised as a new
    environment. Checked before every first open in a process, so a damaged environment
    is reported, never mapped nor re-initialised."""
    data_path = os.path.join(path, "data.mdb")
    try:
        with _creation_done(path), open(data_path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(_META_END)
            first = _meta(head, 0)
            f.seek(first[0] if first is not None else 0)
            second = _meta(f.read(_META_END), 0) if first is not None else None
    except FileNotFoundError:
        if must_exist:
            raise TierLost(f"no LMDB store at {path} (no data.mdb)", url=url) from None
        return
    except IsADirectoryError:
        raise TierLost(f"{data_path} is not a file", url=url) from None
    except OSError:
        return  # not a directory, no permission: opening says what is wrong with the path
    fix = (
        "the tier is unreachable for this open; the store reads from its other tiers. "
        f"Move {path} aside (keep it for recovery) to start this tier afresh"
    )
    if first is None or second is None or first[0] != second[0]:
        raise TierLost(
            f"{data_path} is damaged: its meta pages are unreadable ({size} bytes); {fix}",
            url=url,
        )
    psize, last, _ = max(first, second, key=lambda m: m[2])
    need = (last + 1) * psize
    if size < need:
        raise TierLost(
            f"{data_path} is truncated: {size} bytes, but its last page ends at {need}; {fix}",
            url=url,
        )


def _acquire_env(
    url: str, path: str, *, read_only: bool, sync: bool, map_size: int, writemap: bool = True
) -> _Env:
    key = os.path.realpath(path)
    with _envs_lock:
        cached = _envs.get(key)
        if cached is not None:
            if cached.readonly and not read_only:
                raise TierError(
                    f"the LMDB environment at {key} is open read-only in this process; "
                    "close those tiers before opening it for writing",
                    url=url,
                )
            cached.refs += 1
            return cached
        check_data_file(url, key, must_exist=read_only)
        try:
            if read_only:
                env = _open_read_only(key)
                try:
                    blobs = env.open_db(b"blobs", create=False)
                    log = env.open_db(b"log", create=False)
                except lmdb.NotFoundError:
                    env.close()
                    raise TierLost(f"{key} holds no tiercheck LMDB store", url=url) from None
                try:
                    times = env.open_db(b"times", create=False)
                except lmdb.NotFoundError:
                    times = None
            else:
                os.makedirs(key, exist_ok=True)
                env = _open_writable(key, map_size=map_size, sync=sync, writemap=writemap)
                # LMDB has made data.mdb as long as the map (sparse) by now
                data_fd = _reservable(os.path.join(key, "data.mdb")) if writemap else None
                if writemap and data_fd is None:
                    env.close()
                    env = _open_writable(key, map_size=map_size, sync=sync, writemap=False)
                blobs = env.open_db(b"blobs")
                log = env.open_db(b"log")
                times = env.open_db(b"times")
        except lmdb.DiskError as exc:
            raise TierFull(f"no space left opening LMDB at {key}: {exc}", url=url) from exc
        except (
            lmdb.CorruptedError,
            lmdb.PageNotFoundError,
            lmdb.InvalidError,
            lmdb.VersionMismatchError,
        ) as exc:
            raise TierLost(f"the LMDB environment at {key} is damaged: {exc}", url=url) from exc
        except (lmdb.Error, OSError) as exc:
            raise invalid_url(url, f"cannot open LMDB environment at {key}: {exc}") from exc
        entry = _Env(path=key, env=env, blobs=blobs, log=log, times=times, readonly=read_only)
        if not read_only:
            entry.data_fd = data_fd
        _envs[key] = entry
        return entry


def _open_writable(path: str, *, map_size: int, sync: bool, writemap: bool) -> lmdb.Environment:
    return lmdb.open(
        path,
        map_size=map_size,
        max_dbs=3,
        subdir=True,
        sync=sync,
        metasync=sync,
        readahead=True,
        writemap=writemap,
    )


def _reservable(path: str) -> int | None:
    """``path`` (LMDB's data file) opened for reserving disk blocks, or None where this
    file system cannot reserve them (then no writemap)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, 4096)  # the meta page: written, so reserved already
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise
        log.info("LMDB at %s: no writemap (cannot reserve disk blocks: %s)", path, exc)
        return None
    return fd


def _reach(e: _Env, last_pgno: int, nbytes: int) -> int:
    """How far into data.mdb a write transaction of ``nbytes`` bytes can reach: the pages
    in use (up to ``last_pgno``), the values, and slack for the tree and free-list pages
    it rewrites."""
    psize: int = e.env.stat()["psize"]
    return (last_pgno + 1) * psize + nbytes + nbytes // 16 + _RESERVE_SLACK


def _in_steps(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole number of ``_RESERVE_STEP``."""
    return -(-nbytes // _RESERVE_STEP) * _RESERVE_STEP


def _reserve(e: _Env, nbytes: int) -> None:
    """Reserve disk blocks for every page a write transaction of ``nbytes`` bytes can
    touch (writemap: a write fault on a hole of a full disk would be SIGBUS). Raises
    ``OSError`` (ENOSPC) before anything is written. Only the writer calls it."""
    if e.data_fd is None:
        return
    info = e.env.info()
    need = min(_reach(e, info["last_pgno"], nbytes), info["map_size"])
    if need <= e.reserved:
        return
    step = min(_in_steps(need), info["map_size"])
    try:  # ahead in steps: one call per step, not one per transaction
        os.posix_fallocate(e.data_fd, e.reserved, step - e.reserved)
        e.reserved = step
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or step == need:
            raise
        os.posix_fallocate(e.data_fd, e.reserved, need - e.reserved)  # what it needs
        e.reserved = need


def _stamp(txn: lmdb.Transaction, e: _Env, key: bytes) -> None:
    """Record in the writer's transaction when the blob ``key`` was written."""
    txn.put(key, _TIME.pack(time.time()), db=e.times)


def _release_env(entry: _Env) -> None:
    with _envs_lock:
        entry.refs -= 1
        if entry.refs == 0:
            del _envs[entry.path]
            entry.env.close()
            if entry.data_fd is not None:
                os.close(entry.data_fd)


class LmdbTier(Tier):
    """Tier in an LMDB environment. See the module docstring for layout and guarantees."""

    scheme: ClassVar[str] = "lmdb"
    CAPABILITIES: ClassVar[Capabilities] = Capabilities(
        survives=FailureDomain.PROCESS,
        shared=False,
        persistent=True,
        speed_rank=30,
        atomic_batch=True,
        blob_times=True,
    )

    def __init__(
        self,
        url: str,
        *,
        read_only: bool = False,
        sync: bool = True,
        map_size: int = DEFAULT_MAP_SIZE,
        max_size: int | None = None,
        writemap: bool = True,
        **options: Any,
    ) -> None:
        if options:
            raise invalid_url(url, f"unknown options for lmdb://: {sorted(options)}")
        path = _parse_url(url)
        if map_size <= 0 or (max_size is not None and max_size <= 0):
            raise ValueError(f"map_size and max_size must be positive ({url})")
        if max_size is not None:
            map_size = min(map_size, max_size)
        super().__init__(url, capabilities=self.CAPABILITIES, read_only=read_only)
        self.path = path
        self.max_size = max_size
        self._env: _Env | None = _acquire_env(
            url, path, read_only=read_only, sync=sync, map_size=map_size, writemap=writemap
        )
        self._close_lock = threading.Lock()

    @property
    def map_size(self) -> int:
        """Current size of the LMDB memory map in bytes."""
        size: int = self._e().env.info()["map_size"]
        return size

    def close(self) -> None:
        """Release this tier's reference to the environment. Idempotent."""
        with self._close_lock:
            env, self._env = self._env, None
        if env is not None:
            _release_env(env)

    # --- transactions --------------------------------------------------------------

    def _e(self) -> _Env:
        env = self._env
        if env is None:
            raise TierError("tier is closed", url=self.url)
        return env

    def _lmdb_error(self, exc: lmdb.Error, what: str, blob_id: str) -> TierError:
        if isinstance(exc, lmdb.DiskError):
            return TierFull(
                f"disk full during {what} at {self.path}: {exc}; free disk space",
                url=self.url,
                key=blob_id,
            )
        return TierError(f"LMDB {what} failed at {self.path}: {exc}", url=self.url, key=blob_id)

    def _adopt_map_size(self, e: _Env) -> None:
        # Another process grew the map; size 0 means "the size now in the file".
        with e.gate.exclusive():
            e.env.set_mapsize(0)

    def _grow(self, e: _Env, what: str, blob_id: str, nbytes: int) -> None:
        """Grow the map for a write of ``nbytes`` that did not fit: by half, or to the
        pages in use plus the write and its slack if that is more (16 MiB steps)."""
        with e.gate.exclusive():
            info = e.env.info()
            current: int = info["map_size"]
            if self.max_size is not None and current >= self.max_size:
                raise TierFull(
                    f"LMDB map at {self.path} is at max_size={self.max_size} bytes "
                    f"during {what}; raise max_size or delete old versions",
                    url=self.url,
                    key=blob_id,
                )
            new = _in_steps(max(current + current // 2, _reach(e, info["last_pgno"], nbytes)))
            if self.max_size is not None:
                new = min(new, self.max_size)
            e.env.set_mapsize(new)

    def _read(self, fn: Callable[[lmdb.Transaction, _Env], _T], what: str, blob_id: str) -> _T:
        e = self._e()
        while True:
            try:
                with e.gate.shared(), e.env.begin(buffers=True) as txn:
                    return fn(txn, e)
            except lmdb.MapResizedError:
                self._adopt_map_size(e)
            except lmdb.Error as exc:
                raise self._lmdb_error(exc, what, blob_id) from exc

    def _write(
        self,
        fn: Callable[[lmdb.Transaction, _Env], _T],
        what: str,
        blob_id: str,
        nbytes: int = 0,
    ) -> _T:
        """Run ``fn`` (writing about ``nbytes`` bytes of values) in one write transaction
        and commit, growing the map as needed."""
        self._check_writable(what)
        e = self._e()
        with e.write_lock:
            while True:
                try:
                    with e.gate.shared():
                        _reserve(e, nbytes)
                except OSError as exc:
                    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
                    raise (TierFull if full else TierError)(
                        f"cannot reserve disk space for {what} at {self.path}: {exc}"
                        + ("; free disk space" if full else ""),
                        url=self.url,
                        key=blob_id,
                    ) from exc
                try:
                    with e.gate.shared(), e.env.begin(write=True) as txn:
                        return fn(txn, e)
                except lmdb.MapFullError:
                    self._grow(e, what, blob_id, nbytes)  # the failed txn was aborted
                except lmdb.MapResizedError:
                    self._adopt_map_size(e)
                except lmdb.Error as exc:
                    raise self._lmdb_error(exc, what, blob_id) from exc

    # --- blobs ---------------------------------------------------------------------

    def put(self, blob_id: str, data: Buffer, *, overwrite: bool = False) -> bool:
        check_blob_id(blob_id, self.url)
        self._check_writable("put")
        key = bytes.fromhex(blob_id)
        if not overwrite and self._has_keys([key], blob_id):
            return False  # skip a write transaction (and its fsync) for a no-op
        view = memoryview(data).cast("B")

        def txn_put(txn: lmdb.Transaction, e: _Env) -> bool:
            written: bool = txn.put(key, view, db=e.blobs, overwrite=overwrite)
            if written:
                _stamp(txn, e, key)
            return written

        return self._write(txn_put, "put", blob_id, len(view))

    def put_many(self, items: Iterable[tuple[str, Buffer]]) -> int:
        """Store several blobs in a few transactions (up to 256 MiB each); returns how
        many were written. Each transaction is atomic; the whole call is not."""
        return self.put_many_parts((blob_id, (data,)) for blob_id, data in items)

    def put_many_parts(self, items: Iterable[tuple[str, Sequence[Buffer]]]) -> int:
        """As :meth:`put_many`; a blob in several parts is joined into a buffer this
        environment reuses (LMDB copies a value into its own pages during the put)."""
        self._check_writable("put")
        written = 0
        batch: builtins.list[tuple[bytes, builtins.list[memoryview]]] = []
        nbytes = 0
        for blob_id, parts in items:
            check_blob_id(blob_id, self.url)
            views = [memoryview(p).cast("B") for p in parts]
            batch.append((bytes.fromhex(blob_id), views))
            nbytes += sum(len(v) for v in views)
            if nbytes >= _BATCH_BYTES:
                written += self._put_batch(batch)
                batch, nbytes = [], 0
        if batch:
            written += self._put_batch(batch)
        return written

    def _put_batch(self, batch: builtins.list[tuple[bytes, builtins.list[memoryview]]]) -> int:
        def txn_put(txn: lmdb.Transaction, e: _Env) -> int:
            count = 0
            for key, views in batch:
                value = views[0] if len(views) == 1 else _joined(e, views)
                if txn.put(key, value, db=e.blobs, overwrite=False):
                    _stamp(txn, e, key)
                    count += 1
            return count

        nbytes = sum(len(v) for _, views in batch for v in views)
        return self._write(txn_put, "put_many", batch[0][0].hex(), nbytes)

    def get(self, blob_id: str, out: memoryview | None = None) -> memoryview:
        check_blob_id(blob_id, self.url)
        key = bytes.fromhex(blob_id)

        def txn_get(txn: lmdb.Transaction, e: _Env) -> memoryview:
            buf = txn.get(key, db=e.blobs)
            if buf is None:
                raise NotFound("blob not found", url=self.url, key=blob_id)
            # ``buf`` points into the map and is valid only inside this transaction:
            # copy it out (straight into ``out`` when given) before the txn ends.
            if out is None:
                return memoryview(bytes(buf))
            return self._copy_out(buf, out, self.url, blob_id)

        return self._read(txn_get, "get", blob_id)

    def get_parts(self, blob_id: str, parts: Sequence[memoryview]) -> int:
        """Copy the mapped value straight over ``parts``: one copy, no intermediate."""
        check_blob_id(blob_id, self.url)
        key = bytes.fromhex(blob_id)

        def txn_get(txn: lmdb.Transaction, e: _Env) -> int:
            buf = txn.get(key, db=e.blobs)
            if buf is None:
                raise NotFound("blob not found", url=self.url, key=blob_id)
            return scatter(buf, parts)  # inside the transaction: the map stays valid

        return self._read(txn_get, "get", blob_id)

    def head(self, blob_id: str, nbytes: int = 64) -> bytes:
        """The first ``nbytes`` bytes, sliced from the mapped value: no full copy."""
        check_blob_id(blob_id, self.url)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        key = bytes.fromhex(blob_id)

        def txn_head(txn: lmdb.Transaction, e: _Env) -> bytes:
            buf = txn.get(key, db=e.blobs)
            if buf is None:
                raise NotFound("blob not found", url=self.url, key=blob_id)
            return bytes(buf[:nbytes])  # copied out before the transaction ends

        return self._read(txn_head, "head", blob_id)

    def _has_keys(self, keys: builtins.list[bytes], blob_id: str = "") -> set[bytes]:
        def txn_has(txn: lmdb.Transaction, e: _Env) -> set[bytes]:
            return {k for k in keys if txn.get(k, db=e.blobs) is not None}

        return self._read(txn_has, "has", blob_id)

    def has(self, blob_ids: Iterable[str]) -> set[str]:
        ids = builtins.list(blob_ids)
        for blob_id in ids:
            check_blob_id(blob_id, self.url)
        return {k.hex() for k in self._has_keys([bytes.fromhex(b) for b in ids])}

    def delete(self, blob_ids: Iterable[str]) -> int:
        ids = builtins.list(blob_ids)
        for blob_id in ids:
            check_blob_id(blob_id, self.url)
        self._check_writable("delete")
        if not ids:
            return 0
        keys = [bytes.fromhex(b) for b in ids]

        def txn_delete(txn: lmdb.Transaction, e: _Env) -> int:
            if e.times is not None:
                for k in keys:
                    txn.delete(k, db=e.times)
            return sum(1 for k in keys if txn.delete(k, db=e.blobs))

        return self._write(txn_delete, "delete", ids[0])

    def written_at(self, blob_ids: Sequence[str]) -> dict[str, float]:
        """When each blob was written, from the "times" database (a blob written before
        tiercheck recorded it has no time: left out)."""
        keys = []
        for blob_id in blob_ids:
            check_blob_id(blob_id, self.url)
            keys.append(bytes.fromhex(blob_id))

        def txn_times(txn: lmdb.Transaction, e: _Env) -> dict[str, float]:
            out: dict[str, float] = {}
            if e.times is None:
                return out
            for key in keys:
                value = txn.get(key, db=e.times)
                if value is not None and len(value) == _TIME.size:
                    out[key.hex()] = _TIME.unpack(value)[0]
            return out

        return self._read(txn_times, "written_at", "")

    def list(self) -> Iterator[str]:
        # Collected inside the transaction: a generator paused mid-transaction would
        # block map growth until the caller finished iterating.
        def txn_list(txn: lmdb.Transaction, e: _Env) -> builtins.list[str]:
            cursor = txn.cursor(db=e.blobs)
            return [bytes(k).hex() for k in cursor.iternext(keys=True, values=False)]

        return iter(self._read(txn_list, "list", ""))

    def size(self, blob_id: str) -> int:
        check_blob_id(blob_id, self.url)
        key = bytes.fromhex(blob_id)

        def txn_size(txn: lmdb.Transaction, e: _Env) -> int:
            buf = txn.get(key, db=e.blobs)
            if buf is None:
                raise NotFound("blob not found", url=self.url, key=blob_id)
            return len(buf)

        return self._read(txn_size, "size", blob_id)

    # --- log -----------------------------------------------------------------------

    def append(self, record: bytes, *, blobs: Iterable[tuple[str, Buffer]] = ()) -> None:
        """Append ``record``; blobs and record are committed in one transaction."""
        self._check_writable("append")
        items: builtins.list[tuple[bytes, memoryview]] = []
        for blob_id, data in blobs:
            check_blob_id(blob_id, self.url)
            items.append((bytes.fromhex(blob_id), memoryview(data).cast("B")))
        frame = frame_record(bytes(record))

        def txn_append(txn: lmdb.Transaction, e: _Env) -> None:
            for key, view in items:
                if txn.put(key, view, db=e.blobs, overwrite=False):
                    _stamp(txn, e, key)
            cursor = txn.cursor(db=e.log)
            seq = _SEQ.unpack(cursor.key())[0] + 1 if cursor.last() else 0
            txn.put(_SEQ.pack(seq), frame, db=e.log, append=True)

        try:
            self._write(txn_append, "append", "", len(frame) + sum(len(v) for _, v in items))
        except TierError as exc:
            if not isinstance(exc.__cause__, lmdb.TxnFullError):
                raise
            # Too many blobs for one transaction: blobs first in batches, then the
            # record alone; still "blobs before record", no longer one transaction.
            self.put_many((k.hex(), v) for k, v in items)
            items.clear()
            self._write(txn_append, "append", "", len(frame))

    def read_log(self) -> builtins.list[bytes]:
        """Every record in sequence order. A record whose frame fails its checksum
        (damage, not a torn write: LMDB commits are atomic) is skipped."""
        return builtins.list(self.scan_log().records)

    def scan_log(self) -> LogScan:
        """As :meth:`read_log`, naming the key of each damaged record."""

        def txn_read(txn: lmdb.Transaction, e: _Env) -> LogScan:
            cursor = txn.cursor(db=e.log)
            records = []
            damaged = []
            for key, value in cursor.iternext(keys=True, values=True):
                payload = unframe_record(value)
                if payload is not None:
                    records.append(payload)
                elif len(key) == _SEQ.size:
                    damaged.append(f"record {_SEQ.unpack(key)[0]} ({len(value)} bytes)")
                else:
                    damaged.append(f"record key {bytes(key).hex()} ({len(value)} bytes)")
            return LogScan(tuple(records), tuple(damaged))

        return self._read(txn_read, "read_log", "")

    def replace_log_prefix(self, count: int, record: bytes) -> None:
        """In one write transaction: delete the first ``count`` intact records (and any
        damaged ones among them) and store ``record`` under the last one's key, so it
        sorts before every record appended after them."""
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        frame = frame_record(bytes(record))

        def txn_compact(txn: lmdb.Transaction, e: _Env) -> None:
            cursor = txn.cursor(db=e.log)
            seen = 0
            last_key = b""
            keys: builtins.list[bytes] = []
            for key, value in cursor.iternext(keys=True, values=True):
                keys.append(bytes(key))
                if unframe_record(value) is not None:
                    seen += 1
                    if seen == count:
                        last_key = bytes(key)
                        break
            if seen < count:
                raise ValueError(f"count {count} is outside the log of {seen} records")
            for key in keys:
                txn.delete(key, db=e.log)
            txn.put(last_key, frame, db=e.log)

        self._write(txn_compact, "compact the log", "", len(frame))

    def usage(self) -> int:
        """Bytes of the pages that hold blobs (LMDB counts pages, not values: cheap)."""

        def txn_usage(txn: lmdb.Transaction, e: _Env) -> int:
            st = txn.stat(e.blobs)
            pages: int = st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
            return pages * int(st["psize"])

        return self._read(txn_usage, "usage", "")

    # --- owner ---------------------------------------------------------------------

    def read_owner(self) -> StoreOwner | None:
        """The owner record under the key ``tiercheck.owner`` of the main database."""

        def txn_owner(txn: lmdb.Transaction, e: _Env) -> bytes | None:
            value = txn.get(_OWNER_KEY)
            return None if value is None else bytes(value)

        raw = self._read(txn_owner, "read the owner", "")
        return None if raw is None else StoreOwner.from_bytes(raw)

    def write_owner(self, owner: StoreOwner) -> None:
        """Record ``owner`` under ``tiercheck.owner`` (one write transaction)."""
        body = owner.to_bytes()

        def txn_owner(txn: lmdb.Transaction, e: _Env) -> None:
            txn.put(_OWNER_KEY, body)

        self._write(txn_owner, "record the owner", "", len(body))

    def claim_owner(self, owner: StoreOwner, *, replacing: StoreOwner | None = None) -> StoreOwner:
        """Record ``owner`` if ``tiercheck.owner`` still holds ``replacing`` (None: no
        record): the read, the comparison and the put are one write transaction, which
        LMDB serialises across processes; the record that holds afterwards
        (:meth:`Tier.claim_owner`)."""
        body = owner.to_bytes()

        def txn_claim(txn: lmdb.Transaction, e: _Env) -> StoreOwner:
            value = txn.get(_OWNER_KEY)
            current = None if value is None else StoreOwner.from_bytes(bytes(value))
            if current != replacing:
                return current if current is not None else owner
            txn.put(_OWNER_KEY, body)
            return owner

        return self._write(txn_claim, "record the owner", "", len(body))
