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
for speed, never integrity), ``map_size`` (initial map size; bytes or a size string such
as ``"8MiB"``), ``max_size`` (cap on map growth, at least ``map_size``; default none) and
``writemap`` (default True, see below). A bad value is a ``ConfigError`` naming the option.
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
:meth:`LmdbTier.preallocate` (``Checkpointer.prepare``) reserves ahead of the first
saves and reads the reserved range once, so those pages are in the page cache when LMDB
writes into them.

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
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar
from urllib.parse import unquote, urlsplit

import lmdb
import psutil

from tiercheck.backends._lmdb_env import (
    _RESERVE_STEP,
    _acquire_env,
    _Env,
    _in_steps,
    _reach,
    _release_env,
    _reserve,
)
from tiercheck.backends.base import (
    Buffer,
    Capabilities,
    FailureDomain,
    LogScan,
    StoreOwner,
    Tier,
    check_blob_id,
    gather,
    invalid_url,
    scatter,
)
from tiercheck.core.sizes import parse_size
from tiercheck.errors import ConfigError, NotFound, TierError, TierFull
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
_SEQ = struct.Struct(">Q")
_OWNER_KEY = b"tiercheck.owner"
_TIME = struct.Struct("<d")  # "times": when a blob was written, seconds since the epoch
_T = TypeVar("_T")


def _joined(e: _Env, views: builtins.list[memoryview]) -> memoryview:
    """``views`` concatenated in ``e``'s join buffer (valid until the next call; only the
    writer, under ``e.write_lock``, calls it)."""
    n = sum(len(v) for v in views)
    if len(e.join) < n:
        e.join = bytearray(n)
    out = memoryview(e.join)
    return out[: gather(views, out)]


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


def _size_option(url: str, name: str, value: int | str | None) -> int | None:
    """A size option (``map_size``, ``max_size``) in bytes: an int or a size string
    (``"8MiB"``, :mod:`tiercheck.core.sizes`); None: not given. ``ConfigError`` naming
    the option for anything else, and for 0."""
    if value is None:
        return None
    try:
        size = parse_size(value)
    except ValueError as exc:
        raise ConfigError(f"{url}: option {name}: {exc}") from None
    if size <= 0:
        raise ConfigError(f"{url}: option {name} must be positive, got {value!r}")
    return size


def _stamp(txn: lmdb.Transaction, e: _Env, key: bytes) -> None:
    """Record in the writer's transaction when the blob ``key`` was written."""
    txn.put(key, _TIME.pack(time.time()), db=e.times)


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
        map_size: int | str | None = None,
        max_size: int | str | None = None,
        writemap: bool = True,
        **options: Any,
    ) -> None:
        if options:
            raise invalid_url(url, f"unknown options for lmdb://: {sorted(options)}")
        path = _parse_url(url)
        for name, flag in (("sync", sync), ("writemap", writemap)):
            if not isinstance(flag, bool):
                raise ConfigError(f"{url}: option {name} must be true or false, got {flag!r}")
        initial = _size_option(url, "map_size", map_size)
        cap = _size_option(url, "max_size", max_size)
        if initial is not None and cap is not None and cap < initial:
            raise ConfigError(
                f"{url}: option max_size ({max_size!r}) is smaller than map_size "
                f"({map_size!r}): the map could never grow to its initial size"
            )
        if initial is None:  # the default map, within the cap
            initial = DEFAULT_MAP_SIZE if cap is None else min(DEFAULT_MAP_SIZE, cap)
        super().__init__(url, capabilities=self.CAPABILITIES, read_only=read_only)
        self.path = path
        self.max_size = cap
        self._env: _Env | None = _acquire_env(
            url, path, read_only=read_only, sync=sync, map_size=initial, writemap=writemap
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

    def preallocate(self, sizes: Sequence[int]) -> int:
        """Ready the pages the next puts of these sizes will write (writemap only): grow
        the map to hold them past the pages in use, reserve their disk blocks, and read
        that range of data.mdb once, so that its pages are in the page cache when LMDB
        writes values into them through the map. A write fault on a page that is not
        there allocates and zeroes it first: on the VM of docs/benchmarks.md that made a
        fresh 1 GiB base's puts 2.5-3 s against 0.2 s into cached pages. Reading reserved
        (unwritten) blocks reads no disk. Nothing is done without writemap or on a full
        disk (0), and at most a quarter of the node's available memory is read; returns
        the bytes of the file read."""
        self._check_writable("preallocate")
        e = self._e()
        if e.data_fd is None:
            return 0
        psize: int = e.env.stat()["psize"]
        # each value on overflow pages of its own, behind a 16-byte page header
        total = sum(-(-(n + 16) // psize) * psize for n in sizes if n > 0)
        # pages the page cache would drop again before the puts come are not worth reading
        total = min(total, int(psutil.virtual_memory().available) // 4)
        if total <= 0:
            return 0
        with e.write_lock:
            info = e.env.info()
            start = (info["last_pgno"] + 1) * psize
            try:
                if _reach(e, info["last_pgno"], total) > info["map_size"]:
                    self._grow(e, "preallocate", "", total)
                with e.gate.shared():
                    _reserve(e, total)
            except TierFull:
                return 0  # at max_size: the puts will say so
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    return 0  # a full disk: the puts will say so
                raise TierError(f"preallocate failed at {self.path}: {exc}", url=self.url) from exc
            end = min(e.reserved, start + total)
            first = max(start, e.readied)  # a second prepare() reads only what is new
            e.readied = max(e.readied, end)
        if first < end:
            buf = memoryview(bytearray(min(_RESERVE_STEP, end - first)))
            for at in range(first, end, len(buf)):  # outside the lock: puts may go on
                os.preadv(e.data_fd, [buf[: end - at]], at)
        return max(0, end - start)

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
