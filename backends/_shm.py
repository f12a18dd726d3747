"""``shm://NAME``: blobs and log in host shared memory (tmpfs), surviving a crashed process.

On-disk layout (``ROOT`` is ``/dev/shm/tiercheck`` unless the option ``root=`` says
otherwise)::

    ROOT/NAME/
      blobs/<id>       one file per blob; only complete files ever get this name
      pool/<token>     free segments: files of deleted blobs, pages still allocated
      tmp/<pid>.<n>    puts in flight; a dead writer's leftovers are recycled at open
      log              append-only log: framed records (tiercheck.formats.framing)

Why a pool: tmpfs allocates (and zeroes) a page on the first write to it, which costs
about ten times a write into a page that is already there. A checkpoint store deletes
old blobs and writes new ones of the same size at every save, so ``delete`` moves a
blob's file into ``pool/`` and a later ``put`` claims a pooled file (best fit by size),
writes into its existing pages, truncates it to the new size and links it into
``blobs/``. The pool is bounded by the option ``pool_limit`` (bytes); deletes beyond it
free the memory; :meth:`ShmTier.trim_pool` releases it on demand.

Atomicity: a put writes ``tmp/<pid>.<n>`` and then links (create-if-absent) or renames
(overwrite) it to ``blobs/<id>``, so a reader never sees a prefix. A log append is one
framed record written at the end of ``log`` under an exclusive ``flock``; a crash can
leave a torn frame at the tail, which readers skip (a frame carries its length and
checksum) and which a writable open truncates away before appending again. Nothing is
fsync'ed: tmpfs has no disk behind it, and a write that returned is visible to every
later process.

One writer per NAME at a time (``Capabilities.shared`` is False); any number of
``read_only=True`` readers. A blob file that is deleted can be reused at once by a
later put, so a reader must not read a blob concurrently with its deletion (the engine
only deletes blobs that no kept record references; the codec layer verifies every id).
"""

from __future__ import annotations

import bisect
import builtins
import errno
import fcntl
import itertools
import os
import re
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

from tiercheck.backends._vectored import read_parts
from tiercheck.backends.base import (
    BLOB_ID_RE,
    Buffer,
    Capabilities,
    FailureDomain,
    Tier,
    check_blob_id,
    invalid_url,
)
from tiercheck.errors import NotFound, TierError, TierFull
from tiercheck.formats.framing import FRAME_HEADER, frame_record, iter_frames

__all__ = ["DEFAULT_ROOT", "ShmTier"]

DEFAULT_ROOT = "/dev/shm/tiercheck"
DEFAULT_POOL_LIMIT = 4 << 30
_PREFIX = "shm://"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# pwrite/readv move at most ~2 GiB per call on Linux; stay well below.
_IO_STEP = 1 << 30


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (a short write is continued, not an error)."""
    pos = 0
    while pos < len(data):
        pos += os.pwrite(fd, data[pos : pos + _IO_STEP], offset + pos)


def _read_exact(fd: int, into: memoryview) -> int:
    """Fill ``into`` from the start of ``fd``; returns bytes read (less only at EOF)."""
    pos = 0
    while pos < len(into):
        n = os.preadv(fd, [into[pos : pos + _IO_STEP]], pos)
        if n == 0:
            break
        pos += n
    return pos


def _intact_length(data: bytes) -> int:
    """Length of the prefix of ``data`` made of whole, valid frames."""
    return sum(FRAME_HEADER + len(payload) for payload in iter_frames(data))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Pool:
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


class ShmTier(Tier):
    """Tier in host shared memory. See the module docstring for layout and guarantees.

    Options: ``root`` (directory holding the stores, default ``/dev/shm/tiercheck``),
    ``read_only``, ``pool_limit`` (bytes of free segments kept for reuse, default 4 GiB).
    """

    scheme: ClassVar[str] = "shm"
    CAPABILITIES: ClassVar[Capabilities] = Capabilities(
        survives=FailureDomain.PROCESS, shared=False, persistent=False, speed_rank=10
    )

    def __init__(
        self,
        url: str,
        *,
        root: str | os.PathLike[str] = DEFAULT_ROOT,
        read_only: bool = False,
        pool_limit: int = DEFAULT_POOL_LIMIT,
        **options: Any,
    ) -> None:
        if options:
            raise invalid_url(url, f"unknown options for shm://: {sorted(options)}")
        if not isinstance(url, str) or not url.startswith(_PREFIX):
            raise invalid_url(str(url), "expected shm://NAME")
        name = url[len(_PREFIX) :].rstrip("/")
        if not _NAME_RE.match(name) or name in {".", ".."}:
            raise invalid_url(url, "NAME must be 1-128 characters of A-Z a-z 0-9 . _ - (no slash)")
        if pool_limit < 0:
            raise ValueError(f"pool_limit must be >= 0, got {pool_limit}")
        super().__init__(url, capabilities=self.CAPABILITIES, read_only=read_only)
        self.name = name
        self.path = os.path.join(os.fspath(root), name)
        self.pool_limit = pool_limit
        self._blobs = os.path.join(self.path, "blobs")
        self._pool_dir = os.path.join(self.path, "pool")
        self._tmp = os.path.join(self.path, "tmp")
        self._log_path = os.path.join(self.path, "log")
        self._pool = _Pool()
        self._counter = itertools.count()
        self._tag = f"{os.getpid()}.{id(self):x}"
        self._log_lock = threading.Lock()
        self._log_fd = -1
        #: Segments taken from the pool / created fresh by this instance's puts.
        self.segments_reused = 0
        self.segments_created = 0
        if read_only:
            if not os.path.isdir(self._blobs):
                raise invalid_url(url, f"no shm store at {self.path} to open read-only")
            return
        try:
            for d in (self._blobs, self._pool_dir, self._tmp):
                os.makedirs(d, exist_ok=True)
            self._log_fd = os.open(self._log_path, os.O_RDWR | os.O_CREAT, 0o644)
            self._recover()
        except OSError as exc:
            self.close()
            raise self._os_error(exc, "open") from exc

    # --- opening -------------------------------------------------------------------

    def _recover(self) -> None:
        """Undo what a crashed writer left: a torn log tail, files in tmp/; index the pool."""
        with self._log_lock:
            fcntl.flock(self._log_fd, fcntl.LOCK_EX)
            try:
                data = self._read_log_bytes()
                good = _intact_length(data)
                if good < len(data):
                    os.ftruncate(self._log_fd, good)
            finally:
                fcntl.flock(self._log_fd, fcntl.LOCK_UN)
        for entry in os.scandir(self._pool_dir):
            self._pool.add(entry.name, entry.stat(follow_symlinks=False).st_size)
        for entry in os.scandir(self._tmp):
            pid_s = entry.name.split(".", 1)[0]
            if pid_s.isdigit() and (int(pid_s) == os.getpid() or _pid_alive(int(pid_s))):
                continue  # a live writer's put in flight
            st = entry.stat(follow_symlinks=False)
            if st.st_nlink > 1:
                # Crashed between linking into blobs/ and unlinking the temp name: the
                # inode is a published blob and must never be reused.
                os.unlink(entry.path)
            else:
                self._to_pool(entry.path, st.st_size)

    def close(self) -> None:
        """Release the log file descriptor. Idempotent."""
        with self._log_lock:
            if self._log_fd >= 0:
                os.close(self._log_fd)
                self._log_fd = -1

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

    def _to_pool(self, path: str, size: int) -> bool:
        """Move the file at ``path`` into the pool, or unlink it when the pool is full."""
        if self._pool.total + size > self.pool_limit:
            os.unlink(path)
            return False
        token = self._new_token()
        os.rename(path, os.path.join(self._pool_dir, token))
        self._pool.add(token, size)
        return True

    def _claim_segment(self, size: int) -> tuple[str, int, int]:
        """Return ``(tmp path, fd, current size)`` of a writable segment for ``size`` bytes."""
        tmp = os.path.join(self._tmp, self._new_token())
        while (found := self._pool.take(size)) is not None:
            token, seg_size = found
            try:
                os.rename(os.path.join(self._pool_dir, token), tmp)
            except FileNotFoundError:
                continue  # another instance on this store took it first
            self.segments_reused += 1
            return tmp, os.open(tmp, os.O_RDWR), seg_size
        self.segments_created += 1
        return tmp, os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), 0

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
        tmp = ""
        fd = -1
        try:
            tmp, fd, seg_size = self._claim_segment(size)
            if seg_size > size:
                os.ftruncate(fd, size)  # frees only the pages past the new end
            offset = 0
            for view in views:
                _write_all(fd, view, offset)
                offset += len(view)
            os.close(fd)
            fd = -1
            if overwrite:
                os.replace(tmp, final)
                return True
            try:
                os.link(tmp, final)
            except FileExistsError:
                self._to_pool(tmp, size)  # lost a race with an equal put: recycle
                return False
            os.unlink(tmp)
            return True
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            if tmp:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
            raise self._os_error(exc, "put", blob_id) from exc

    def _open_blob(self, blob_id: str, op: str) -> int:
        """A read-only descriptor of ``blob_id``'s file (NotFound if there is none)."""
        check_blob_id(blob_id, self.url)
        try:
            return os.open(self._blob_path(blob_id), os.O_RDONLY)
        except FileNotFoundError:
            raise NotFound("blob not found", url=self.url, key=blob_id) from None
        except OSError as exc:
            raise self._os_error(exc, op, blob_id) from exc

    def get(self, blob_id: str, out: memoryview | None = None) -> memoryview:
        """Read ``blob_id`` into ``out`` (or a new buffer) with ``preadv``, no mmap:
        a view into a mapped file would change under the caller if the file were
        deleted and its segment reused."""
        fd = self._open_blob(blob_id, "get")
        try:
            size = os.fstat(fd).st_size
            if out is None:
                target = memoryview(bytearray(size))
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
                self._to_pool(path, os.stat(path).st_size)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise self._os_error(exc, "delete", blob_id) from exc
            removed += 1
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

    def trim_pool(self, keep_bytes: int = 0) -> int:
        """Free pooled segments until at most ``keep_bytes`` remain; returns bytes freed."""
        freed = 0
        while self._pool.total > keep_bytes and (found := self._pool.take(0)) is not None:
            token, size = found
            try:
                os.unlink(os.path.join(self._pool_dir, token))
            except FileNotFoundError:
                continue
            freed += size
        return freed

    @property
    def pool_bytes(self) -> int:
        """Bytes of free segments this instance holds for reuse."""
        return self._pool.total

    # --- log -----------------------------------------------------------------------

    def append(self, record: bytes, *, blobs: Iterable[tuple[str, Buffer]] = ()) -> None:
        self._check_writable("append")
        for blob_id, data in blobs:
            self.put(blob_id, data)
        frame = memoryview(frame_record(bytes(record)))
        with self._log_lock:
            if self._log_fd < 0:
                raise TierError("append on a closed tier", url=self.url)
            fcntl.flock(self._log_fd, fcntl.LOCK_EX)
            try:
                end = os.fstat(self._log_fd).st_size
                try:
                    _write_all(self._log_fd, frame, end)
                except BaseException:
                    # Never leave a torn frame in front of the next record.
                    os.ftruncate(self._log_fd, end)
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

    def read_log(self) -> builtins.list[bytes]:
        try:
            return builtins.list(iter_frames(self._read_log_bytes()))
        except OSError as exc:
            raise self._os_error(exc, "read_log") from exc
