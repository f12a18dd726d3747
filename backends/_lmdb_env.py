"""One LMDB environment per path and process, as :mod:`tiercheck.backends._lmdb`'s tiers
share it: checking ``data.mdb`` before the first open, opening it read-only (with reader
locks) or writable (with writemap where disk blocks can be reserved), the process-wide
cache with its reference counts, the read/write gate that lets the map grow, and the
reservation of disk blocks ahead of every write transaction (see that module's
docstring, "Writable map" and "Map growth")."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import lmdb

from tiercheck.backends.base import invalid_url
from tiercheck.errors import TierError, TierFull, TierLost, TierUnavailable

log = logging.getLogger(__name__)

# Disk blocks are reserved (writemap) in steps of this many bytes, with this much slack for
# the tree pages and the free list a transaction rewrites beside its values. A step of 16 MiB
# is still one posix_fallocate per transaction or fewer, and what a store of a small state
# holds on disk ahead of its pages stays small (docs/configuration.md, "Footprint").
_RESERVE_STEP = 16 << 20
_RESERVE_SLACK = 16 << 20


# LMDB's meta pages (pages 0 and 1 of data.mdb, lmdb's MDB_meta after a 16-byte page
# header): magic at 16, page size (mm_dbs[FREE_DBI].md_pad) at 40, the last page in use
# and the transaction id at 136 and 144.
_META_MAGIC = 0xBEEFC0DE
_META_END = 152


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
    # LmdbTier.preallocate: how far into data.mdb the page cache was already read
    readied: int = 0


_envs: dict[str, _Env] = {}
_envs_lock = threading.Lock()

# What opening an environment can meet at a path that is fine as a URL: a file system this
# process may not write there (a read-only mount, permissions, an immutable directory)...
_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
# ... or a disk that fails under it.
_FAILING = (errno.EIO,)


def _errno(exc: BaseException) -> int | None:
    """The errno behind an error opening an environment: an ``OSError``'s own, or the one an
    ``lmdb.Error`` stands for (py-lmdb keeps only LMDB's text, ``"PATH: strerror(errno)"``);
    None if it is none of those this module tells apart."""
    if isinstance(exc, OSError):
        return exc.errno
    if isinstance(exc, lmdb.ReadonlyError):
        return errno.EACCES
    text = str(exc)
    for code in (*_UNWRITABLE, *_FAILING):
        if text.endswith(f": {os.strerror(code)}"):
            return code
    return None


def _open_read_only(path: str) -> lmdb.Environment:
    """Open ``path`` read-only with LMDB's reader locking (safe next to a live writer);
    without it only where ``lock.mdb`` cannot be opened for writing."""
    try:
        return lmdb.open(path, readonly=True, lock=True, max_dbs=3, subdir=True)
    except lmdb.Error as exc:
        if not isinstance(exc, lmdb.PanicError) and _errno(exc) not in _UNWRITABLE:
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
            # the URL is fine: the tier is unavailable, the store opens without it
            code = _errno(exc)
            if code in _UNWRITABLE:
                raise TierUnavailable(
                    f"cannot open the LMDB environment at {key} "
                    f"{'' if read_only else 'for writing '}({exc}): the store goes on "
                    "without this tier until the file system lets it (a read-only mount, "
                    "permissions)",
                    url=url,
                ) from exc
            if code in _FAILING:
                raise TierLost(
                    f"the disk under the LMDB environment at {key} fails ({exc}): the store "
                    "goes on without this tier",
                    url=url,
                ) from exc
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


def _release_env(entry: _Env) -> None:
    with _envs_lock:
        entry.refs -= 1
        if entry.refs == 0:
            del _envs[entry.path]
            entry.env.close()
            if entry.data_fd is not None:
                os.close(entry.data_fd)
