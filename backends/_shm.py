"""``shm://NAME``: blobs and log in host shared memory (tmpfs), surviving a crashed process.

On-disk layout (``ROOT`` is ``/dev/shm/tiercheck-UID``, one directory per user, unless
the option ``root=`` says otherwise)::

    ROOT/NAME/
      owner.json       who owns the segment: store id and root, host, creating pid, time
      blobs/<id>       one file per blob; only complete files ever get this name
      pool/<token>     free segments: files of deleted blobs, pages still allocated
      tmp/<pid>.<n>    puts in flight, staging slots (StageArea); a dead writer's are
                       recycled at open (unlinked where they are blobs too)
      log              append-only log: framed records (tiercheck.formats.framing)
      log.compact      a compacted log being written (renamed over ``log``, or removed)

Ownership: the first writable open writes ``owner.json`` (kind, store id, root and node,
creator); ``write_owner``, ``claim_owner`` (only if no other store got there first) and
``bind_store`` record the owning store in it (formats/SPEC.md, "Store identity"), each
under an exclusive ``flock`` of the segment directory; ``tiercheck gc --orphans`` reads
it to find segments whose store is gone (:mod:`tiercheck.store.lifecycle`).

Privacy: the default root is per user, made mode 0700 and refused if another user owns
it; a segment's directories are 0700 and its files 0600.

Budget: the option ``budget`` (bytes or a size such as ``"8GiB"``) bounds the bytes of
blobs held plus the pool; pooled segments are freed first to make room, and a put that
still does not fit raises ``OverBudget``, as does a put needing fresh pages /dev/shm does
not have free (a full tmpfs answers a write with ENOSPC, ``TierFull``, but faults a
mapped page with SIGBUS: no write is attempted past the free space).

Why a pool: tmpfs allocates (and zeroes) a page at its first write, ten times the cost
of a write into a page already there, and a store deletes old blobs and writes new ones
of the same size at every save: ``delete`` moves a blob's file into ``pool/``, a later
``put`` claims one (best fit), writes into its pages, truncates it and links it into
``blobs/``. ``pool_limit`` (bytes) bounds it (deletes past it free the memory;
``trim_pool`` on demand); ``preallocate`` fills it ahead (``Checkpointer.prepare``: the
pages of the first two versions, written, as a fallocate'd page is zeroed at first write).

Kept mappings: a put into a segment written before copies through a writable mapping of
the file kept since then, not with ``pwrite`` (:mod:`tiercheck.backends._shm_segments`
says why and what bounds them); a restore in this process reads through them too. Under
the power-loss recorder (``_os`` not the os module) every write is a ``pwrite`` through it.

Atomicity: a put writes ``tmp/<pid>.<n>`` and then links (create-if-absent) or renames
(overwrite) it to ``blobs/<id>``, so a reader never sees a prefix. A log append is one
framed record written at the end of ``log`` under an exclusive ``flock``; a crash can
leave a torn frame at the tail, which readers skip (a frame carries its length and
checksum) and which a writable open truncates away before appending again. A damaged
frame is stepped over, never truncated, and reported by :meth:`ShmTier.scan_log`: the
records after it are kept (``scan_frames``, SPEC section 6.1); at the tail, only the start
of a frame cut short is torn (``torn_tail``), a whole frame that fails its check is damage.
Compaction writes the new log to ``log.compact`` and renames it over ``log`` under the
same lock (an appender holding the old file reopens). Nothing is fsync'ed: tmpfs has no
disk behind it, and a write that returned is visible to every later process.

One writer per NAME at a time (``Capabilities.shared`` is False); any number of
``read_only=True`` readers. A deleted blob's file can be reused at once by a later put, so
a reader must not read a blob concurrently with its deletion (the engine deletes only
what no kept record references; the codec layer verifies every id). :meth:`ShmTier.pin`
maps blobs in place for a restore and holds the ``pool/`` directory's exclusive lock
meanwhile; a put recycles a pooled segment (and a save stages into a freed slot of a
:class:`StageArea`) only under its shared lock, so a pinned blob's bytes never change.
:meth:`ShmTier.staging_area`: saves stage straight into the store's own files, which
become the blobs (:mod:`tiercheck.backends._shm_segments`, "Staging").
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import itertools
import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

import psutil

from tiercheck.backends._shm_segments import (
    _OWNER_KIND,
    _ZEROS,
    DEFAULT_ROOT,
    KEEP_FRESH_BYTES,
    OWNER_FILE,
    KeptMaps,
    Pool,
    ShmPins,
    StageArea,
    hold_pool,
    made_dir,
    owner_lock,
    read_owner,
    remove_unclaimed,
    room_for,
    shm_free_bytes,
    stageable,
)
from tiercheck.backends._vectored import read_parts
from tiercheck.backends.base import (
    BLOB_ID_RE,
    Buffer,
    Capabilities,
    FailureDomain,
    LogScan,
    Pins,
    StagingArea,
    StoreOwner,
    Tier,
    check_blob_id,
    check_budget,
    fresh_buffer,
    invalid_url,
    parse_budget,
)
from tiercheck.errors import NotFound, OverBudget, TierError, TierFull, TierLost
from tiercheck.formats.framing import frame_record, scan_frames, torn_tail

__all__ = ["ShmTier"]

DEFAULT_POOL_LIMIT = 4 << 30
# Every call that changes the store's files goes through this name, so a test can record
# an operation trace and replay the states a crash could leave (tests/test_power_loss.py).
# In production it is the os module itself: no wrapper, no cost.
_os = os
_PREFIX = "shm://"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# pwrite/readv move at most ~2 GiB per call on Linux; stay well below.
_IO_STEP = 1 << 30


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (a short write is continued, not an error)."""
    pos = 0
    while pos < len(data):
        pos += _os.pwrite(fd, data[pos : pos + _IO_STEP], offset + pos)


def _read_exact(fd: int, into: memoryview) -> int:
    """Fill ``into`` from the start of ``fd``; returns bytes read (less only at EOF)."""
    pos = 0
    while pos < len(into):
        n = os.preadv(fd, [into[pos : pos + _IO_STEP]], pos)
        if n == 0:
            break
        pos += n
    return pos


_COMPACT_NAME = "log.compact"


def _write_json_atomic(path: str, obj: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = _os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _write_all(fd, memoryview(json.dumps(obj).encode()), 0)
    finally:
        _os.close(fd)
    _os.replace(tmp, path)


def _private_root(root: str) -> None:
    """Make the shm root ``root`` (mode 0700) if it is not there; refuse one another user
    owns (it could read every segment), and close the default root to other users."""
    try:
        _os.makedirs(root, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass  # a file or a dangling link: the stat below says so
    st = os.stat(root)
    if st.st_uid != os.getuid():
        raise OSError(
            errno.EPERM,
            f"the shm root {root} belongs to uid {st.st_uid}, not to this user "
            f"({os.getuid()}); use your own (the option root=)",
        )
    if root == DEFAULT_ROOT and st.st_mode & 0o077:
        os.chmod(root, 0o700)


class ShmTier(Tier):
    """Tier in host shared memory. See the module docstring for layout and guarantees.

    Options: ``root`` (directory holding the stores, default ``/dev/shm/tiercheck-UID``),
    ``read_only``, ``pool_limit`` (bytes of free segments kept for reuse, default 4 GiB),
    ``budget`` (most bytes of blobs plus pool held; default none: only the free memory of
    /dev/shm bounds it).
    """

    scheme: ClassVar[str] = "shm"
    CAPABILITIES: ClassVar[Capabilities] = Capabilities(
        survives=FailureDomain.PROCESS,
        shared=False,
        persistent=False,
        speed_rank=10,
        blob_times=True,
        host_memory=True,
    )

    def __init__(
        self,
        url: str,
        *,
        root: str | os.PathLike[str] = DEFAULT_ROOT,
        read_only: bool = False,
        pool_limit: int | str = DEFAULT_POOL_LIMIT,
        budget: int | str | None = None,
        **options: Any,
    ) -> None:
        if options:
            raise invalid_url(url, f"unknown options for shm://: {sorted(options)}")
        if not isinstance(url, str) or not url.startswith(_PREFIX):
            raise invalid_url(str(url), "expected shm://NAME")
        name = url[len(_PREFIX) :].rstrip("/")
        if not _NAME_RE.match(name) or name in {".", ".."}:
            raise invalid_url(url, "NAME must be 1-128 characters of A-Z a-z 0-9 . _ - (no slash)")
        pool_limit = parse_budget(pool_limit, url, "pool_limit") or 0  # "64MiB" too
        super().__init__(url, capabilities=self.CAPABILITIES, read_only=read_only)
        self.name = name
        self.root = os.fspath(root)
        self.path = os.path.join(self.root, name)
        self._pool_limit = self.pool_limit = pool_limit
        self.budget: int | None = None
        self.set_budget(budget)
        self._blobs = os.path.join(self.path, "blobs")
        self._pool_dir = os.path.join(self.path, "pool")
        self._tmp = os.path.join(self.path, "tmp")
        self._log_path = os.path.join(self.path, "log")
        self._pool = Pool()
        self._counter = itertools.count()
        self._tag = f"{os.getpid()}.{id(self):x}"
        self._log_lock = threading.Lock()
        self._log_fd = -1
        # Bytes of blobs held (counted at a writable open, kept by put/delete), and the
        # lock that makes a budget check and its reservation one step.
        self._held = 0
        self._held_lock = threading.Lock()
        #: Segments taken from the pool / created fresh by this instance's puts.
        self.segments_reused = 0
        self.segments_created = 0
        self._kept = KeptMaps()
        self.made = False
        if read_only:
            if not os.path.isdir(self._blobs):
                # lost with the node's memory (a reboot) or never made on this node
                raise TierLost(f"no shm store at {self.path} to open read-only", url=url)
            return
        try:
            _private_root(self.root)
            self.made = made_dir(self.path, _os.mkdir)  # this open made it (:meth:`unmake`)
            for d in (self._blobs, self._pool_dir, self._tmp):
                _os.makedirs(d, mode=0o700, exist_ok=True)
            with self._owner_lock():  # a claim racing this open keeps its record
                if read_owner(self.path) is None:
                    self._write_owner(None)
            self._log_fd = _os.open(self._log_path, os.O_RDWR | os.O_CREAT, 0o600)
            self._recover()
        except OSError as exc:
            self.close()
            raise self._os_error(exc, "open") from exc

    # --- opening -------------------------------------------------------------------

    def _owner_lock(self) -> contextlib.AbstractContextManager[None]:
        return owner_lock(self.path)

    def _write_owner(
        self, store: str | None, store_host: str | None = None, *, store_id: str | None = None
    ) -> None:
        """Write ``owner.json`` (the caller holds :meth:`_owner_lock`)."""
        previous = read_owner(self.path) or {}
        if store_id is None and previous.get("store") == store:
            store_id = previous.get("store_id")
        _write_json_atomic(
            os.path.join(self.path, OWNER_FILE),
            {
                "kind": _OWNER_KIND,
                "store_id": store_id,
                "store": store,
                "store_host": store_host,
                "host": previous.get("host", socket.gethostname()),
                "pid": previous.get("pid", os.getpid()),
                "created": previous.get("created", time.time()),
                "url": self.url,
            },
        )

    def read_owner(self) -> StoreOwner | None:
        """The store id, root and node ``owner.json`` names (None: no store recorded)."""
        owner = read_owner(self.path) or {}
        fields = {"store_id": "store_id", "root": "store", "host": "store_host"}
        return StoreOwner.from_json({k: owner.get(v) for k, v in fields.items()})

    def write_owner(self, owner: StoreOwner) -> None:
        """Record ``owner`` in ``owner.json`` (written to a temporary name, then renamed)."""
        self._check_writable("record the owner")
        try:
            with self._owner_lock():
                self._write_owner(owner.root, owner.host, store_id=owner.store_id)
        except OSError as exc:
            raise self._os_error(exc, "record the owner") from exc

    def claim_owner(self, owner: StoreOwner, *, replacing: StoreOwner | None = None) -> StoreOwner:
        """Record ``owner`` if ``owner.json`` still records ``replacing`` (None: no store),
        reading, comparing and writing under the segment's owner lock; the record that
        holds afterwards (:meth:`Tier.claim_owner`)."""
        self._check_writable("record the owner")
        try:
            with self._owner_lock():
                current = self.read_owner()
                if current != replacing:
                    return current if current is not None else owner
                self._write_owner(owner.root, owner.host, store_id=owner.store_id)
                return owner
        except OSError as exc:
            raise self._os_error(exc, "record the owner") from exc

    def bind_store(self, root: str, *, host: str | None = None) -> None:
        """Record ``root`` on ``host`` (default: this one) as the store owning this segment
        (in ``owner.json``). A segment kept for a store on another node (the collective
        tier's partner) names that node, and this node's orphan scan leaves it alone."""
        if self.read_only:
            return
        host = host or socket.gethostname()
        try:
            with self._owner_lock():
                owner = read_owner(self.path)
                if owner is not None and (owner.get("store"), owner.get("store_host")) == (
                    root,
                    host,
                ):
                    return
                self._write_owner(root, host)
        except OSError as exc:
            raise self._os_error(exc, "record the owner") from exc

    def _recover(self) -> None:
        """Undo what a crashed writer left: a torn log tail, files in tmp/, an unfinished
        compaction; index the pool and count the blobs held."""
        with self._log_lock:
            self._lock_log()
            try:
                data = self._read_log_bytes()
                good = scan_frames(data).intact_end
                if good < len(data) and torn_tail(data, good):
                    _os.ftruncate(self._log_fd, good)
                try:
                    _os.unlink(os.path.join(self.path, _COMPACT_NAME))
                except FileNotFoundError:
                    pass
            finally:
                fcntl.flock(self._log_fd, fcntl.LOCK_UN)
        self._held = self._count_blob_bytes()
        for entry in os.scandir(self._pool_dir):
            self._pool.add(entry.name, entry.stat(follow_symlinks=False).st_size)
        for entry in os.scandir(self._tmp):
            pid_s = entry.name.split(".", 1)[0]
            if pid_s.isdigit() and (int(pid_s) == os.getpid() or psutil.pid_exists(int(pid_s))):
                continue  # a live writer's put in flight
            st = entry.stat(follow_symlinks=False)
            if st.st_nlink > 1:
                # Crashed between linking into blobs/ and unlinking the temp name: the
                # inode is a published blob and must never be reused.
                _os.unlink(entry.path)
            else:
                self._to_pool(entry.path, st.st_size)

    def close(self) -> None:
        """Release the log file descriptor and the kept mappings. Idempotent."""
        self._kept.close()
        with self._log_lock:
            if self._log_fd >= 0:
                _os.close(self._log_fd)
                self._log_fd = -1

    def unmake(self, store_id: str | None = None) -> None:
        if self.made and not self.read_only:
            remove_unclaimed(self.path, store_id)

    # --- helpers -------------------------------------------------------------------

    def _blob_path(self, blob_id: str) -> str:
        return os.path.join(self._blobs, blob_id)

    def _new_token(self) -> str:
        return f"{self._tag}.{next(self._counter)}"

    def _os_error(self, exc: OSError, what: str, blob_id: str = "") -> TierError:
        if exc.errno in _NO_SPACE:
            return TierFull(
                f"no space left in shared memory during {what} ({exc.strerror}); "
                "free memory in /dev/shm or delete old versions",
                url=self.url,
                key=blob_id,
            )
        return TierError(f"{what} failed at {self.path}: {exc}", url=self.url, key=blob_id)

    def _count_blob_bytes(self) -> int:
        total = 0
        for entry in os.scandir(self._blobs):
            try:
                total += entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
        return total

    def _reserve(self, blob_id: str, size: int, replaced: int) -> None:
        """Count ``size`` bytes as held before writing them (``replaced``: bytes of the
        copy an overwrite replaces); ``OverBudget`` if they do not fit."""
        with self._held_lock:
            held = self._held - replaced
            check_budget(self.url, blob_id, held=held, needed=size, budget=self.budget)
            self._held += size

    def _fit_pool(self) -> None:
        """Free pooled segments until blobs plus pool fit the budget (called after a put
        has taken its segment from the pool, so the segment it reuses is not freed)."""
        if self.budget is None:
            return
        with self._held_lock:
            room = self.budget - self._held
        if self._pool.total > room:
            self.trim_pool(max(0, room))

    def _release(self, size: int) -> None:
        with self._held_lock:
            self._held -= size

    def _check_free(self, blob_id: str, need: int) -> None:
        """``OverBudget`` if /dev/shm has fewer than ``need`` bytes free for new pages."""
        if need <= 0:
            return
        try:
            free = shm_free_bytes(self.path)
        except OSError:
            return  # no statvfs: the write itself reports ENOSPC
        with self._held_lock:
            held = self._held
        check_budget(self.url, blob_id, held=held, needed=need, budget=None, free=free)

    def _to_pool(self, path: str, size: int) -> bool:
        """Move the file at ``path`` into the pool, or unlink it when the pool is full."""
        if self._pool.total + size > self.pool_limit:
            self._kept.drop(path)
            _os.unlink(path)
            return False
        token = self._new_token()
        _os.rename(path, os.path.join(self._pool_dir, token))
        self._pool.add(token, size)
        return True

    def _claim_segment(self, size: int, recycle: bool) -> tuple[str, int, int]:
        """Return ``(tmp path, fd, current size)`` of a writable segment for ``size`` bytes:
        a pooled one where ``recycle`` (the caller holds the pool's shared lock), else new."""
        tmp = os.path.join(self._tmp, self._new_token())
        while recycle and (found := self._pool.take(size)) is not None:
            token, seg_size = found
            try:
                _os.rename(os.path.join(self._pool_dir, token), tmp)
            except FileNotFoundError:
                continue  # another instance on this store took it first
            self.segments_reused += 1
            return tmp, _os.open(tmp, os.O_RDWR), seg_size
        self.segments_created += 1
        return tmp, _os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), 0

    # --- blobs ---------------------------------------------------------------------

    def put(self, blob_id: str, data: Buffer, *, overwrite: bool = False) -> bool:
        return self.put_parts(blob_id, (data,), overwrite=overwrite)

    def put_parts(self, blob_id: str, parts: Sequence[Buffer], *, overwrite: bool = False) -> bool:
        """As :meth:`put`, writing each part at its offset: no joined copy."""
        check_blob_id(blob_id, self.url)
        self._check_writable("put")
        final = self._blob_path(blob_id)
        if not overwrite and os.path.exists(final):
            return False
        views = [memoryview(part).cast("B") for part in parts]
        size = sum(len(v) for v in views)
        replaced = 0
        if overwrite:
            try:
                replaced = os.stat(final).st_size
            except FileNotFoundError:
                pass
        self._reserve(blob_id, size, replaced)
        tmp = ""
        fd = -1
        kept = False  # whether the reserved bytes ended up held
        # no pooled segment is rewritten while a reader pins blobs (ShmPins)
        held_pool = hold_pool(self._pool_dir) if self._pool.total else -1
        try:
            tmp, fd, seg_size = self._claim_segment(size, held_pool >= 0)
            self._fit_pool()
            try:
                self._check_free(blob_id, size - seg_size)
            except OverBudget:
                _os.close(fd)
                fd = -1
                self._to_pool(tmp, seg_size)  # unused: back to the pool (or freed)
                tmp = ""
                raise
            if seg_size > size:
                _os.ftruncate(fd, size)  # frees only the pages past the new end
            # through the file's kept mapping where its pages cover the blob, else pwrite
            if not (seg_size >= size and _os is os and self._kept.write(fd, views, size)):
                offset = 0
                for view in views:
                    _write_all(fd, view, offset)
                    offset += len(view)
                if _os is os and (seg_size or size >= KEEP_FRESH_BYTES):
                    # a chunk's segment is reused by a later save, and a restore in this
                    # process reads it through the mapping (ShmPins); a small one-off
                    # (a manifest) is mapped only once it is reused
                    self._kept.keep(fd, size)
            _os.close(fd)
            fd = -1
            if overwrite:
                self._kept.drop(final)  # the copy it replaces goes
                _os.replace(tmp, final)
                kept = True
                self._release(replaced)
                return True
            try:
                _os.link(tmp, final)
            except FileExistsError:
                self._to_pool(tmp, size)  # lost a race with an equal put: recycle
                return False
            _os.unlink(tmp)
            kept = True
            return True
        except OSError as exc:
            if fd >= 0:
                _os.close(fd)
            if tmp:
                self._kept.drop(tmp)
                try:
                    _os.unlink(tmp)
                except FileNotFoundError:
                    pass
            raise self._os_error(exc, "put", blob_id) from exc
        finally:
            if held_pool >= 0:
                os.close(held_pool)
            if not kept:
                self._release(size)

    def _open_blob(self, blob_id: str, op: str) -> int:
        """A read-only descriptor of ``blob_id``'s file (NotFound if there is none)."""
        check_blob_id(blob_id, self.url)
        try:
            return os.open(self._blob_path(blob_id), os.O_RDONLY)
        except FileNotFoundError:
            raise NotFound("blob not found", url=self.url, key=blob_id) from None
        except OSError as exc:
            raise self._os_error(exc, op, blob_id) from exc

    def staging_area(self, windows: Sequence[tuple[int, int]], n: int) -> StagingArea | None:
        """Ranges of this store's own files (:class:`StageArea`), if possible (not recorded)."""
        ok = not self.read_only and _os is os and stageable(windows, n)
        return StageArea(self, windows, n) if ok and room_for(self.path, windows) else None

    def pin(self) -> Pins | None:
        """Blobs mapped in place while no put may recycle a segment (None while a put is
        recycling one or another reader pins): see :class:`ShmPins`."""
        return ShmPins.take(self.path, self.url, None if self.read_only else self._kept)

    def get(self, blob_id: str, out: memoryview | None = None) -> memoryview:
        """Read ``blob_id`` into ``out`` (or a new buffer) with ``preadv``, no mmap:
        a view into a mapped file would change under the caller if the file were
        deleted and its segment reused (:meth:`pin` maps them, holding that off)."""
        fd = self._open_blob(blob_id, "get")
        try:
            size = os.fstat(fd).st_size
            if out is None:
                target = fresh_buffer(size)
            elif len(out) < size:
                raise ValueError(
                    f"buffer of {len(out)} bytes too small for blob of {size} bytes "
                    f"({self.url} {blob_id})"
                )
            else:
                target = out[:size]
            n = _read_exact(fd, target)
        except OSError as exc:
            raise self._os_error(exc, "get", blob_id) from exc
        finally:
            os.close(fd)
        if n != size:
            raise TierError(
                f"blob shrank while being read ({n} of {size} bytes)", url=self.url, key=blob_id
            )
        return target

    def get_parts(self, blob_id: str, parts: Sequence[memoryview]) -> int:
        """Read ``blob_id`` over ``parts`` with ``preadv``: no intermediate buffer."""
        fd = self._open_blob(blob_id, "get")
        try:
            size = os.fstat(fd).st_size
            want = min(size, sum(len(p) for p in parts))
            n = read_parts(fd, parts, want)
        except OSError as exc:
            raise self._os_error(exc, "get", blob_id) from exc
        finally:
            os.close(fd)
        if n != want:
            raise TierError(
                f"blob shrank while being read ({n} of {size} bytes)", url=self.url, key=blob_id
            )
        return size

    def head(self, blob_id: str, nbytes: int = 64) -> bytes:
        """The first ``nbytes`` bytes: one ``pread`` of the prefix, not the whole blob."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        fd = self._open_blob(blob_id, "head")
        try:
            target = memoryview(bytearray(min(nbytes, os.fstat(fd).st_size)))
            n = _read_exact(fd, target)
        except OSError as exc:
            raise self._os_error(exc, "head", blob_id) from exc
        finally:
            os.close(fd)
        return bytes(target[:n])

    def has(self, blob_ids: Iterable[str]) -> set[str]:
        ids = builtins.list(blob_ids)
        for blob_id in ids:
            check_blob_id(blob_id, self.url)
        return {b for b in ids if os.path.exists(self._blob_path(b))}

    def delete(self, blob_ids: Iterable[str]) -> int:
        ids = builtins.list(blob_ids)
        for blob_id in ids:
            check_blob_id(blob_id, self.url)
        self._check_writable("delete")
        removed = 0
        for blob_id in ids:
            path = self._blob_path(blob_id)
            try:
                st = os.stat(path)
                size = st.st_size
                if st.st_nlink > 1:  # also a staging slot (StageArea): never pooled
                    _os.unlink(path)
                else:
                    self._to_pool(path, size)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise self._os_error(exc, "delete", blob_id) from exc
            self._release(size)
            removed += 1
        if removed:
            self._sweep_kept()
        return removed

    def list(self) -> Iterator[str]:
        try:
            names = [e.name for e in os.scandir(self._blobs)]
        except OSError as exc:
            raise self._os_error(exc, "list") from exc
        return iter([n for n in names if BLOB_ID_RE.match(n)])

    def size(self, blob_id: str) -> int:
        check_blob_id(blob_id, self.url)
        try:
            return os.stat(self._blob_path(blob_id)).st_size
        except FileNotFoundError:
            raise NotFound("blob not found", url=self.url, key=blob_id) from None

    def written_at(self, blob_ids: Sequence[str]) -> dict[str, float]:
        """Each blob file's mtime (a pooled segment reused for a blob is written anew)."""
        out: dict[str, float] = {}
        for blob_id in blob_ids:
            check_blob_id(blob_id, self.url)
            try:
                out[blob_id] = os.stat(self._blob_path(blob_id)).st_mtime
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise self._os_error(exc, "written_at", blob_id) from exc
        return out

    def trim_pool(self, keep_bytes: int = 0) -> int:
        """Free pooled segments until at most ``keep_bytes`` remain; returns bytes freed."""
        freed = 0
        while self._pool.total > keep_bytes and (found := self._pool.take(0)) is not None:
            token, size = found
            path = os.path.join(self._pool_dir, token)
            self._kept.drop(path)
            try:
                _os.unlink(path)
            except FileNotFoundError:
                continue
            freed += size
        if freed:
            self._sweep_kept()
        return freed

    def _sweep_kept(self) -> None:
        """Drop the kept mappings of files that are gone (see :class:`KeptMaps`)."""
        self._kept.sweep((self._blobs, self._pool_dir, self._tmp))

    def preallocate(self, sizes: Sequence[int]) -> int:
        """Add a pooled segment of each size, its pages allocated (and zeroed by tmpfs)
        now: the puts that take them later write into pages that are already there ("Why
        a pool" in the module docstring), ten times faster than into fresh ones. Stops at
        the first size that would take blobs plus pool past the budget, the pool past
        ``pool_limit``, or /dev/shm below half of what it had free when the call began
        (other processes of the node, other ranks among them, take memory too). Returns
        the bytes added to the pool."""
        self._check_writable("preallocate")
        try:
            free = shm_free_bytes(self.path)
        except OSError:
            return 0  # no statvfs: nothing to bound it by
        keep_free = free - free // 2  # of what other processes of the node may need
        added = 0
        for size in sizes:
            if size <= 0:
                continue
            with self._held_lock:
                held = self._held
            room = self.pool_limit - self._pool.total
            if self.budget is not None:
                room = min(room, self.budget - held - self._pool.total)
            try:
                room = min(room, shm_free_bytes(self.path) - keep_free)
            except OSError:
                break
            if size > room:
                break
            tmp = os.path.join(self._tmp, self._new_token())
            try:
                fd = _os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    # written, not fallocate'd: tmpfs zeroes a fallocate'd page only at
                    # its first write, and that first touch is the cost to move here
                    for at in range(0, size, len(_ZEROS)):
                        _write_all(fd, _ZEROS[: size - at], at)
                    if _os is os:  # the first save writes through it
                        self._kept.keep(fd, size)
                finally:
                    _os.close(fd)
            except OSError as exc:
                self._kept.drop(tmp)
                with contextlib.suppress(FileNotFoundError):
                    _os.unlink(tmp)
                if exc.errno in _NO_SPACE:
                    break  # someone else took the memory first: fewer segments ready
                raise self._os_error(exc, "preallocate") from exc
            self._to_pool(tmp, size)
            added += size
        return added

    @property
    def pool_bytes(self) -> int:
        """Bytes of free segments this instance holds for reuse."""
        return self._pool.total

    def set_budget(self, nbytes: int | str | None) -> None:
        """Set the budget (blobs plus pool); the pool is trimmed at the next put."""
        self.budget = parse_budget(nbytes, self.url)
        self.pool_limit = (
            self._pool_limit if self.budget is None else min(self._pool_limit, self.budget)
        )

    def free_memory(self) -> int:
        """Bytes an unprivileged writer can still allocate in this tier's /dev/shm."""
        return shm_free_bytes(self.path)

    def usage(self) -> int:
        """Bytes of blobs held (a read-only instance counts them now; a writer keeps count)."""
        if self.read_only:
            try:
                return self._count_blob_bytes()
            except OSError as exc:
                raise self._os_error(exc, "usage") from exc
        with self._held_lock:
            return self._held

    # --- log -----------------------------------------------------------------------

    def append(self, record: bytes, *, blobs: Iterable[tuple[str, Buffer]] = ()) -> None:
        self._check_writable("append")
        for blob_id, data in blobs:
            self.put(blob_id, data)
        frame = memoryview(frame_record(bytes(record)))
        with self._log_lock:
            if self._log_fd < 0:
                raise TierError("append on a closed tier", url=self.url)
            try:
                self._lock_log()
            except OSError as exc:
                raise self._os_error(exc, "log append") from exc
            try:
                end = os.fstat(self._log_fd).st_size
                try:
                    _write_all(self._log_fd, frame, end)
                except BaseException:
                    # Never leave a torn frame in front of the next record.
                    _os.ftruncate(self._log_fd, end)
                    raise
            except OSError as exc:
                raise self._os_error(exc, "log append") from exc
            finally:
                fcntl.flock(self._log_fd, fcntl.LOCK_UN)

    def _read_log_bytes(self) -> bytes:
        try:
            with open(self._log_path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return b""

    def _lock_log(self) -> None:
        """Take the exclusive lock on the file now named ``log`` (under ``_log_lock``).

        A compaction renames a new file over ``log``: a descriptor of the replaced file
        is swapped for one of the new file, so nothing is ever appended to a dead log.
        """
        while True:
            fcntl.flock(self._log_fd, fcntl.LOCK_EX)
            held = os.fstat(self._log_fd)
            try:
                named = os.stat(self._log_path)
            except FileNotFoundError:
                named = None
            if named is not None and (named.st_ino, named.st_dev) == (held.st_ino, held.st_dev):
                return
            fcntl.flock(self._log_fd, fcntl.LOCK_UN)
            _os.close(self._log_fd)
            self._log_fd = -1
            self._log_fd = _os.open(self._log_path, os.O_RDWR | os.O_CREAT, 0o600)

    def read_log(self) -> builtins.list[bytes]:
        """Every intact record; a damaged frame in the middle is skipped, not the rest."""
        return builtins.list(self.scan_log().records)

    def scan_log(self) -> LogScan:
        """As :meth:`read_log`, naming the byte range of each damaged stretch of the log."""
        try:
            data = self._read_log_bytes()
        except OSError as exc:
            raise self._os_error(exc, "read_log") from exc
        scan = scan_frames(data)
        damaged = []
        end = 0
        for start, stop in scan.spans:
            if start > end:
                damaged.append(f"bytes {end}-{start} of {self._log_path}")
            end = stop
        if end < len(data) and not torn_tail(data, end):
            # a whole frame that fails its check: damage, not an append cut short
            damaged.append(f"bytes {end}-{len(data)} of {self._log_path}")
        return LogScan(scan.payloads, tuple(damaged))

    def replace_log_prefix(self, count: int, record: bytes) -> None:
        """Write ``record`` plus the log after its first ``count`` records to
        ``log.compact``, then rename it over ``log`` (under the log lock)."""
        self._check_writable("compact the log")
        frame = frame_record(bytes(record))
        tmp = os.path.join(self.path, _COMPACT_NAME)
        with self._log_lock:
            if self._log_fd < 0:
                raise TierError("compaction on a closed tier", url=self.url)
            try:
                self._lock_log()
            except OSError as exc:
                raise self._os_error(exc, "log compaction") from exc
            try:
                data = self._read_log_bytes()
                scan = scan_frames(data)
                if not 1 <= count <= len(scan.spans):
                    raise ValueError(f"count {count} is outside the log of {len(scan.spans)}")
                cut = scan.spans[count - 1][1]
                fd = _os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    _write_all(fd, memoryview(frame), 0)
                    _write_all(fd, memoryview(data)[cut:], len(frame))
                finally:
                    _os.close(fd)
                _os.replace(tmp, self._log_path)
            except OSError as exc:
                try:
                    _os.unlink(tmp)
                except FileNotFoundError:
                    pass
                raise self._os_error(exc, "log compaction") from exc
            finally:
                fcntl.flock(self._log_fd, fcntl.LOCK_UN)
            _os.close(self._log_fd)
            self._log_fd = _os.open(self._log_path, os.O_RDWR | os.O_CREAT, 0o600)
