"""The fsspec tier's store on any fsspec file system (object stores, fsspec's memory file
system, ...): batches of requests go through the event loop of an async one (s3fs,
gcsfs), creates are conditional where the store can make them so, and packs go to S3 as
multipart uploads (:mod:`.s3_multipart`)."""

from __future__ import annotations

import asyncio
import datetime
import errno
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tiercheck.backends._fsspec.s3_multipart import PART, REMOTE_THREADS, S3Upload
from tiercheck.backends._fsspec.store import Store
from tiercheck.backends.base import scatter

__all__ = ["FsspecStore"]

log = logging.getLogger(__name__)

_S3_PROTOCOLS = frozenset({"s3", "s3a"})
# How many requests an async store (s3fs, gcsfs) is given at once for has/read_log.
_ASYNC_BATCH = 64
# fsspec's memory file system is one process-wide dict: a process-wide lock makes its
# check-then-put atomic.
_MEMORY_CREATE_LOCK = threading.Lock()


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


class FsspecStore(Store):
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
        """S3: a multipart upload of ``PART``-byte parts, ``REMOTE_THREADS`` at once
        (one request would carry the whole pack on one connection); the object appears
        only when the upload completes. Others: one put."""
        payload = b"".join(parts)
        if self._s3:
            self.fs.pipe_file(path, payload, chunksize=PART, max_concurrency=REMOTE_THREADS)
        else:
            self._pipe(path, payload, create=False)

    def open_upload(self, path: str) -> S3Upload | None:
        return S3Upload(self.fs, path) if self._s3 else None

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
