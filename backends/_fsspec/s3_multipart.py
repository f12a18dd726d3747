"""A pack streamed to S3 as a multipart upload while it is filled, on s3fs internals
(``_call_s3`` run on the file system's event loop): the object appears only when the
upload completes, so an upload cut short is never read as a pack."""

from __future__ import annotations

import asyncio
from typing import Any

from tiercheck.backends.base import Buffer

__all__ = ["PART", "REMOTE_THREADS", "S3Upload"]

# How many requests a remote store is given at once: the parts of an upload, the threads
# of ``put_many``.
REMOTE_THREADS = 16
# part size of a pack's multipart upload to S3 (a pack of two parts or more is multipart)
PART = 8 * 1024 * 1024


class S3Upload:
    """A pack streamed to S3 as a multipart upload: each ``PART`` bytes added go out as a
    part (up to ``REMOTE_THREADS`` at once) while the pack is still being filled; the
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
        if len(busy) >= REMOTE_THREADS:
            busy[0].result()
        for f in self._parts:
            if f.done():
                f.result()  # a failed part fails the pack now
        n = len(self._parts) + 1
        self._parts.append(self._s3("upload_part", UploadId=self._id, PartNumber=n, Body=body))

    def add(self, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        while view:
            take = min(len(view), PART - self._buffered)
            self._buf.append(view[:take])
            self._buffered += take
            view = view[take:]
            if self._buffered == PART:
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
