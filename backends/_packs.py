"""Blobs kept in pack objects: the blob half of a packed fsspec tier (SPEC section 16).

The engine keeps calling ``put`` per blob; :class:`PackedBlobs` gathers the blobs in
memory and writes them as one pack object (``packs/<name>.pack``, the index at its end,
:mod:`tiercheck.formats.packs`) once ``pack_size`` bytes are waiting, and whatever waits
when the tier is flushed: before every log record (``append``) and at ``close``. A pack
object is written whole and atomically (one ``PutObject``, or a multipart upload
completed at once; locally a temporary file, fsync, rename), so a pack is visible exactly
when its index is durable, and a record never names a blob that is only in memory.

On S3 the pack is streamed while it fills (:class:`PackUpload`, a multipart upload
completed when the pack is sealed), so its upload overlaps the work that produces it.

Reads are ranged reads of a pack at the offset its index gives; on an object store a
read fetches the run of neighbouring blobs around the one asked for (:data:`SPAN`) and
the next reads of that run are served from memory. The index of every pack
is loaded once (one ranged read of its tail) and kept; a listing of ``packs/`` finds new
and vanished packs (on every ``has``, ``list`` and ``delete``, and on a miss).

Blobs written with ``overwrite`` (repairs, leases) are loose objects
(``blobs/<id[:2]>/<id>``, as in an unpacked tier), and a loose copy is read before a
packed one. Deleting blobs of a pack: a pack with no live blob left is deleted; one whose
live blobs hold less than :data:`REPACK_BELOW` of its blob bytes is repacked (its live
blobs are written into a new pack, then the old one is deleted); otherwise the deleted
ids are listed in ``packs/<name>.drop`` and no longer read from that pack.
"""

from __future__ import annotations

import builtins
import logging
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from tiercheck.backends.base import BLOB_ID_RE, Buffer, check_blob_id, fresh_buffer, joined, scatter
from tiercheck.errors import NotFound
from tiercheck.formats.framing import frame_record, unframe_record
from tiercheck.formats.packs import (
    PACK_HEADER,
    PACK_MAGIC,
    PACK_TRAILER,
    TAIL_GUESS,
    PackEntry,
    PackError,
    encode_pack_tail,
    index_span,
    parse_index,
)

__all__ = ["REPACK_BELOW", "SPAN", "PackStore", "PackedBlobs"]

log = logging.getLogger(__name__)

#: a pack whose live blobs hold less than this share of its blob bytes is repacked
REPACK_BELOW = 0.5
#: a remote read fetches the run of neighbouring blobs around the one asked for, up to this
#: many bytes, and keeps it for the reads of the others (restic's restorer reads packs so)
SPAN = 32 * 1024 * 1024
#: runs kept per tier once fetched (each at most SPAN bytes), oldest dropped first
_SPANS_KEPT = 4
#: packs being written at once per tier (bounds memory: each holds up to ``pack_size``)
_SEALING_MAX = 2
_PACK_NAME_RE = re.compile(r"^([0-9a-f]{32})\.(pack|drop)$")
_READ_THREADS = 16


class PackStore(Protocol):
    """The store primitives packs need (implemented by the fsspec tier's stores)."""

    def put(self, path: str, parts: Sequence[memoryview], *, if_absent: bool) -> bool: ...

    def put_object(self, path: str, parts: Sequence[memoryview]) -> None: ...

    def open_upload(self, path: str) -> PackUpload | None: ...

    def read(self, path: str, out: memoryview | None) -> memoryview: ...

    def read_range(self, path: str, start: int, parts: Sequence[memoryview]) -> int: ...

    def sizes(self, directory: str) -> dict[str, int]: ...

    def files_below(self, directory: str) -> Iterator[str]: ...

    def remove_many(self, paths: Sequence[str]) -> None: ...

    def exists_many(self, paths: Sequence[str]) -> list[bool]: ...

    def size(self, path: str) -> int: ...

    def mtime(self, path: str) -> float | None: ...

    def sync(self) -> None: ...


class PackUpload(Protocol):
    """A pack object streamed to the store while it is filled (an S3 multipart upload):
    nothing is visible until :meth:`finish` returns; :meth:`abort` drops it."""

    def add(self, data: Buffer) -> None: ...

    def finish(self, tail: bytes) -> None: ...

    def abort(self) -> None: ...


@dataclass
class _Stream:
    """The pack being streamed: its name, upload, the offset of its next blob, and
    where each blob added went (blobs deleted before the pack is finished stay as bytes
    the index does not name)."""

    name: str
    upload: PackUpload
    offset: int
    entries: dict[str, PackEntry] = field(default_factory=dict)


@dataclass
class _Pack:
    size: int
    entries: dict[str, PackEntry]
    dropped: set[str] = field(default_factory=set)
    drop_size: int = 0  # size of the .drop object the dropped set was read from

    def live(self, blob_id: str) -> PackEntry | None:
        entry = self.entries.get(blob_id)
        return None if entry is None or blob_id in self.dropped else entry

    def span(self, blob_id: str) -> tuple[int, int]:
        """The byte range of the run of neighbouring blobs (at most :data:`SPAN` bytes,
        or the blob alone if larger) that a remote read of ``blob_id`` fetches."""
        if self.spans is None:
            self.spans = {}
            run: list[PackEntry] = []
            for e in sorted(self.entries.values(), key=lambda e: e.offset):
                if run and e.offset + e.length - run[0].offset > SPAN:
                    self._close(run)
                    run = []
                run.append(e)
            if run:
                self._close(run)
        return self.spans[blob_id]

    def run_ids(self, start: int) -> set[str]:
        """The ids of the run that starts at ``start`` (see :meth:`span`)."""
        self.span(next(iter(self.entries)))
        assert self.spans is not None
        return {b for b, (s, _) in self.spans.items() if s == start}

    def _close(self, run: list[PackEntry]) -> None:
        assert self.spans is not None
        rng = (run[0].offset, run[-1].offset + run[-1].length)
        for e in run:
            self.spans[e.blob_id] = rng

    spans: dict[str, tuple[int, int]] | None = None


Call = Callable[[str, str, Callable[[], Any]], Any]


class PackedBlobs:
    """Blob operations of a tier whose blobs live in packs (see module doc).

    ``call(what, key, fn)`` runs a store operation and raises the tier's typed errors;
    ``join`` joins path components of the store; ``loose_path`` names a loose blob.
    """

    def __init__(
        self,
        store: PackStore,
        *,
        url: str,
        root: str,
        pack_size: int,
        call: Call,
        join: Callable[..., str],
        loose_path: Callable[[str], str],
        remote: bool,
    ) -> None:
        self._store = store
        self._url = url
        self._pack_size = pack_size
        self._call = call
        self._join = join
        self._loose_path = loose_path
        self._pack_dir = join(root, "packs")
        self._blob_dir = join(root, "blobs")
        self._threads = _READ_THREADS if remote else 1
        self._remote = remote
        # runs of neighbouring blobs fetched by a remote read: (pack, start) -> the bytes
        # (a future while in flight) and the ids in it not read yet
        self._spans: OrderedDict[tuple[str, int], Future[memoryview]] = OrderedDict()
        self._unread: dict[tuple[str, int], set[str]] = {}
        self._span_lock = threading.Lock()
        # the pack being streamed (stores that can: S3), and the lock that keeps its bytes
        # in the order of the pending blobs
        self._stream: _Stream | None = None
        self._write_lock = threading.Lock()
        self._cond = threading.Condition()
        self._pending: dict[str, Buffer] = {}
        self._pending_bytes = 0
        self._sealing: dict[str, Buffer] = {}
        self._sealing_count = 0
        self._packs: dict[str, _Pack] = {}
        self._bad: dict[str, int] = {}  # pack name -> size at which it failed to parse
        self._loose: set[str] = set()
        self._where: dict[str, set[str]] = {}  # blob id -> packs whose index names it
        self._loaded = False
        # refresh and delete exclusive: a listing taken before a delete never brings
        # back what the delete removed
        self._refresh_lock = threading.Lock()

    # --- paths ---------------------------------------------------------------------

    def _pack_path(self, name: str) -> str:
        return str(self._join(self._pack_dir, f"{name}.pack"))

    def _drop_path(self, name: str) -> str:
        return str(self._join(self._pack_dir, f"{name}.drop"))

    # --- catalog -------------------------------------------------------------------

    def _add_pack(self, name: str, pack: _Pack) -> None:
        self._packs[name] = pack
        for bid in pack.entries:
            self._where.setdefault(bid, set()).add(name)

    def _forget_pack(self, name: str) -> None:
        pack = self._packs.pop(name, None)
        if pack is None:
            return
        for bid in pack.entries:
            names = self._where.get(bid)
            if names is not None:
                names.discard(name)
                if not names:
                    del self._where[bid]

    def _packed(self, blob_id: str) -> tuple[str, PackEntry] | None:
        for name in sorted(self._where.get(blob_id, ())):
            entry = self._packs[name].live(blob_id)
            if entry is not None:
                return name, entry
        return None

    def _present(self, blob_id: str) -> bool:
        return (
            blob_id in self._pending
            or blob_id in self._sealing
            or blob_id in self._loose
            or self._packed(blob_id) is not None
        )

    def refresh(self) -> None:
        """List packs, drop lists and loose blobs; load the index of every new pack."""
        with self._refresh_lock:
            self._refresh_locked()

    def _refresh_locked(self) -> None:
        with self._cond:
            known_packs = set(self._packs)
            known_loose = set(self._loose)
        listing: dict[str, int] = self._call(
            "list packs", "", lambda: self._store.sizes(self._pack_dir)
        )
        rels: list[str] = self._call(
            "list", "", lambda: list(self._store.files_below(self._blob_dir))
        )
        loose = set()
        for rel in rels:
            prefix, _, name = rel.replace("\\", "/").partition("/")
            if BLOB_ID_RE.match(name) and prefix == name[:2]:
                loose.add(name)
        packs: dict[str, int] = {}
        drops: dict[str, int] = {}
        for fname, size in listing.items():
            m = _PACK_NAME_RE.match(fname)
            if m:
                (packs if m.group(2) == "pack" else drops)[m.group(1)] = size
        new = [(n, s) for n, s in packs.items() if n not in known_packs and self._bad.get(n) != s]
        loaded = dict(self._map(lambda item: (item[0], self._load_pack(*item)), new))
        with self._cond:
            stale_drops = [
                (n, s)
                for n, s in drops.items()
                if (n in self._packs and self._packs[n].drop_size != s) or loaded.get(n) is not None
            ]
        read = self._map(lambda item: (*item, self._load_drop(item[0])), stale_drops)
        for name, size, dropped in read:  # a new pack is known with its drop list
            pack = loaded.get(name)
            if pack is not None and dropped is not None:
                pack.dropped, pack.drop_size = dropped, size
        with self._cond:
            for name in known_packs - set(packs):
                self._forget_pack(name)
            for name, pack in loaded.items():
                if pack is not None and name not in self._packs:
                    self._add_pack(name, pack)
            for name, size, dropped in read:
                if name in self._packs and dropped is not None:
                    self._packs[name].dropped |= dropped
                    self._packs[name].drop_size = size
            # loose blobs written (overwrite) while the listing ran stay known
            self._loose = loose | (self._loose - known_loose)
            self._loaded = True

    def _ensure_loaded(self) -> None:
        if not self._loaded:
            self.refresh()

    def _map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        todo = list(items)
        if len(todo) < 2 or self._threads == 1:
            return [fn(i) for i in todo]
        with ThreadPoolExecutor(min(self._threads, len(todo))) as pool:
            return list(pool.map(fn, todo))

    def _load_pack(self, name: str, size: int) -> _Pack | None:
        """The pack's index, read from its tail and validated; None if it is unusable."""
        path = self._pack_path(name)
        try:
            if size < PACK_HEADER + PACK_TRAILER:
                raise PackError(f"a pack of {size} bytes is too short for a header and a trailer")
            n = min(size, TAIL_GUESS)
            tail = memoryview(bytearray(n))
            got = self._call("read pack index", name, lambda: self._read_at(path, size - n, tail))
            if got != n:
                raise PackError(f"read {got} of the {n} bytes at the pack's end")
            start, _ = index_span(tail[n - PACK_TRAILER :], size)
            if size - start > n:  # a longer index: read it whole (bounded by index_span)
                n = size - start
                tail = memoryview(bytearray(n))
                got = self._call("read pack index", name, lambda: self._read_at(path, start, tail))
                if got != n:
                    raise PackError(f"read {got} of the {n} bytes of the pack's index")
            entries = parse_index(tail, size)
        except NotFound:
            return None  # deleted since it was listed
        except PackError as exc:
            log.warning("%s: pack %s is not used: %s", self._url, name, exc)
            with self._cond:
                self._bad[name] = size
            return None
        return _Pack(size, {e.blob_id: e for e in entries})

    def _read_at(self, path: str, start: int, out: memoryview) -> int:
        return self._store.read_range(path, start, (out,))

    def _load_drop(self, name: str) -> set[str] | None:
        try:
            raw = bytes(
                self._call(
                    "read drop list", name, lambda: self._store.read(self._drop_path(name), None)
                )
            )
        except NotFound:
            return None
        payload = unframe_record(raw)
        if payload is None or len(payload) % 32:
            log.warning("%s: drop list of pack %s is damaged; ignored", self._url, name)
            return None
        return {payload[i : i + 32].hex() for i in range(0, len(payload), 32)}

    # --- writing -------------------------------------------------------------------

    def put(self, blob_id: str, parts: Sequence[Buffer], *, overwrite: bool) -> bool:
        check_blob_id(blob_id, self._url)
        if overwrite:  # a repair or a lease: a loose object, read before any packed copy
            views = [
                memoryview(p).cast("B") if not isinstance(p, bytes) else memoryview(p)
                for p in parts
            ]
            path = self._loose_path(blob_id)
            self._call("put", blob_id, lambda: self._store.put(path, views, if_absent=False))
            with self._cond:
                self._loose.add(blob_id)
                old = self._pending.pop(blob_id, None)
                if old is not None:
                    self._pending_bytes -= len(old)
            return True
        self._ensure_loaded()
        data = joined(parts)  # a copy: the caller may reuse its buffers at once
        stream = None
        with self._write_lock:
            with self._cond:
                if self._present(blob_id):
                    return False
                while (
                    self._pending_bytes >= self._pack_size and self._sealing_count >= _SEALING_MAX
                ):
                    self._cond.wait()
                if self._present(blob_id):
                    return False
                self._pending[blob_id] = data
                self._pending_bytes += len(data)
            self._stream_add(blob_id, data)
            with self._cond:
                batch = self._take() if self._pending_bytes >= self._pack_size else None
            if batch is not None:
                stream, self._stream = self._stream, None
        if batch is not None:
            self._seal(batch, stream)
        return True

    def _stream_add(self, blob_id: str, data: Buffer) -> None:
        """Send ``data`` on with the pack being streamed (caller holds the write lock).
        A store that cannot stream keeps it in memory only; a stream that fails is
        dropped, and its blobs are written whole when their pack is sealed."""
        stream = self._stream
        try:
            if stream is None:
                name = uuid.uuid4().hex
                path = self._pack_path(name)
                upload = self._call("write pack", name, lambda: self._store.open_upload(path))
                if upload is None:
                    return
                stream = self._stream = _Stream(name, upload, PACK_HEADER)
                self._call("write pack", name, lambda: upload.add(PACK_MAGIC))
            s = stream
            self._call("write pack", s.name, lambda: s.upload.add(data))
            s.entries[blob_id] = PackEntry(blob_id, s.offset, len(data))
            s.offset += len(data)
        except Exception as exc:
            log.debug("%s: streaming a pack failed (%s); it is written whole", self._url, exc)
            self._stream = None
            if stream is not None:
                _abort_quietly(stream.upload)

    def _take(self) -> dict[str, Buffer]:
        """Move every pending blob to the sealing set (caller holds the condition)."""
        batch, self._pending, self._pending_bytes = self._pending, {}, 0
        self._sealing.update(batch)
        self._sealing_count += 1
        return batch

    def _seal(self, batch: dict[str, Buffer], stream: _Stream | None = None) -> None:
        """Write ``batch`` as a pack (finishing ``stream`` if it holds every blob of it);
        on failure its blobs wait again for the next flush."""
        try:
            if stream is not None and batch.keys() <= stream.entries.keys():
                name, pack = self._finish_stream(stream, batch)
            else:
                if stream is not None:
                    _abort_quietly(stream.upload)
                name, pack = self._write_pack(batch)
        except BaseException:
            if stream is not None:
                _abort_quietly(stream.upload)
            with self._cond:
                for bid, data in batch.items():
                    self._sealing.pop(bid, None)
                    if bid not in self._pending:
                        self._pending[bid] = data
                        self._pending_bytes += len(data)
                self._sealing_count -= 1
                self._cond.notify_all()
            raise
        with self._cond:
            self._add_pack(name, pack)
            for bid in batch:
                self._sealing.pop(bid, None)
            self._sealing_count -= 1
            self._cond.notify_all()

    def _write_pack(self, blobs: dict[str, Buffer]) -> tuple[str, _Pack]:
        """One pack object holding ``blobs``, written atomically; its name and index."""
        name = uuid.uuid4().hex
        parts = [memoryview(PACK_MAGIC)]
        entries = []
        offset = PACK_HEADER
        for bid, data in blobs.items():
            entries.append(PackEntry(bid, offset, len(data)))
            parts.append(memoryview(data))
            offset += len(data)
        parts.append(memoryview(encode_pack_tail(entries)))
        path = self._pack_path(name)
        self._call("write pack", name, lambda: self._store.put_object(path, parts))
        return name, _Pack(offset + len(parts[-1]), {e.blob_id: e for e in entries})

    def _finish_stream(self, stream: _Stream, batch: dict[str, Buffer]) -> tuple[str, _Pack]:
        entries = [stream.entries[bid] for bid in batch]
        tail = encode_pack_tail(entries)
        self._call("write pack", stream.name, lambda: stream.upload.finish(tail))
        return stream.name, _Pack(stream.offset + len(tail), {e.blob_id: e for e in entries})

    def flush(self) -> None:
        """Write every blob put so far into packs; return once they are all stored."""
        while True:
            with self._cond:
                while not self._pending and self._sealing_count:
                    self._cond.wait()
                if not self._pending:
                    return
            with self._write_lock:
                with self._cond:
                    if not self._pending:
                        continue
                    batch = self._take()
                stream, self._stream = self._stream, None
            self._seal(batch, stream)

    # --- reading -------------------------------------------------------------------

    def _locate(self, blob_id: str) -> tuple[str, Any]:
        """Where ``blob_id`` is: ("mem", bytes), ("loose", None) or ("pack", (name, entry))."""
        check_blob_id(blob_id, self._url)
        self._ensure_loaded()
        for attempt in (0, 1):
            with self._cond:
                data = self._pending.get(blob_id)
                if data is None:
                    data = self._sealing.get(blob_id)
                if data is not None:
                    return "mem", data
                if blob_id in self._loose:
                    return "loose", None
                packed = self._packed(blob_id)
                if packed is not None:
                    return "pack", packed
            if attempt == 0:
                self.refresh()  # another writer may have added it
        raise NotFound("blob not found", url=self._url, key=blob_id)

    def _read(self, blob_id: str, fn: Callable[[str, Any], Any]) -> Any:
        """``fn(kind, where)`` on the blob's location; a copy that vanished under us (a
        pack repacked by another process) is looked up again once."""
        for attempt in (0, 1):
            kind, where = self._locate(blob_id)
            try:
                return fn(kind, where)
            except NotFound:
                if attempt or kind == "mem":
                    raise
                self.refresh()
        raise AssertionError("unreachable")

    def _read_blob(self, name: str, entry: PackEntry, parts: Sequence[memoryview]) -> None:
        """Fill ``parts`` from the start of the packed blob ``entry``: one ranged read, or
        on a remote store a share of the run of neighbours fetched once (see :data:`SPAN`)."""
        with self._cond:
            pack = self._packs.get(name)
            start, end = pack.span(entry.blob_id) if pack else (entry.offset, entry.offset)
        if not self._remote or end - start <= entry.length:
            self._range(name, entry, 0, parts)
            return
        key = (name, start)
        with self._span_lock:
            fut = self._spans.get(key)
            owner = fut is None
            if fut is None:
                fut = self._spans[key] = Future()
                assert pack is not None
                self._unread[key] = pack.run_ids(start) - pack.dropped
            else:
                self._spans.move_to_end(key)
        if owner:
            run = PackEntry(entry.blob_id, start, end - start)  # the run as one range
            buf = fresh_buffer(end - start)
            try:
                self._range(name, run, 0, (buf,))
            except BaseException as exc:
                with self._span_lock:
                    self._spans.pop(key, None)
                    self._unread.pop(key, None)
                fut.set_exception(exc)
                raise
            fut.set_result(buf.toreadonly())  # read-only from here: no copy
            self._trim_spans()
        data = fut.result()
        scatter(memoryview(data)[entry.offset - start : entry.offset - start + entry.length], parts)
        with self._span_lock:
            unread = self._unread.get(key)
            if unread is not None:
                unread.discard(entry.blob_id)
                if not unread:  # every blob of the run was read once: done with it
                    self._spans.pop(key, None)
                    del self._unread[key]

    def _trim_spans(self) -> None:
        with self._span_lock:
            done = [k for k, f in self._spans.items() if f.done()]
            for key in done[: max(0, len(done) - _SPANS_KEPT)]:
                del self._spans[key]
                self._unread.pop(key, None)

    def _range(self, name: str, entry: PackEntry, start: int, parts: Sequence[memoryview]) -> int:
        """Read ``parts`` from the blob ``entry`` of pack ``name`` at ``start`` in the blob."""
        want = sum(len(p) for p in parts)
        if start + want > entry.length:
            raise ValueError("read past the end of a packed blob")
        if not want:
            return 0
        path = self._pack_path(name)
        got: int = self._call(
            "get",
            entry.blob_id,
            lambda: self._store.read_range(path, entry.offset + start, parts),
        )
        if got != want:  # the object is shorter than its index said: it changed under us
            raise NotFound(f"pack {name} ended early", url=self._url, key=entry.blob_id)
        return got

    def get(
        self, blob_id: str, out: memoryview | None, loose_get: Callable[[], memoryview]
    ) -> memoryview:
        def read(kind: str, where: Any) -> memoryview:
            if kind == "loose":
                return loose_get()
            if kind == "mem":
                return _copy_out(where, out, self._url, blob_id)
            name, entry = where
            if out is not None and len(out) < entry.length:
                raise ValueError(
                    f"buffer of {len(out)} bytes too small for blob of {entry.length} bytes "
                    f"({self._url} {blob_id})"
                )
            target = memoryview(bytearray(entry.length)) if out is None else out[: entry.length]
            self._read_blob(name, entry, (target,))
            return target

        view: memoryview = self._read(blob_id, read)
        return view

    def get_parts(
        self, blob_id: str, parts: Sequence[memoryview], loose_get_parts: Callable[[], int]
    ) -> int:
        def read(kind: str, where: Any) -> int:
            if kind == "loose":
                return loose_get_parts()
            if kind == "mem":
                return scatter(where, parts)
            name, entry = where
            fit: list[memoryview] = []
            left = entry.length
            for p in parts:
                if left <= 0:
                    break
                view = p if p.format == "B" and p.ndim == 1 else p.cast("B")
                fit.append(view[:left])
                left -= len(fit[-1])
            self._read_blob(name, entry, fit)
            return int(entry.length)

        n: int = self._read(blob_id, read)
        return n

    def head(self, blob_id: str, nbytes: int, loose_head: Callable[[], bytes]) -> bytes:
        def read(kind: str, where: Any) -> bytes:
            if kind == "loose":
                return loose_head()
            if kind == "mem":
                return bytes(where[:nbytes])
            name, entry = where
            buf = memoryview(bytearray(min(nbytes, entry.length)))
            self._range(name, entry, 0, (buf,))
            return bytes(buf)

        data: bytes = self._read(blob_id, read)
        return data

    def size(self, blob_id: str, loose_size: Callable[[], int]) -> int:
        def read(kind: str, where: Any) -> int:
            if kind == "loose":
                return loose_size()
            if kind == "mem":
                return len(where)
            return int(where[1].length)

        n: int = self._read(blob_id, read)
        return n

    def written_at(
        self, blob_ids: Sequence[str], loose_time: Callable[[str], float | None]
    ) -> dict[str, float]:
        """When each blob was written: a packed blob's pack object's time (a repack writes
        it again, which only postpones its sweep), a loose blob's own, now for one still in
        memory. Absent blobs, and times the store does not give, are left out."""
        out: dict[str, float] = {}
        pack_times: dict[str, float | None] = {}
        for bid in blob_ids:
            try:
                kind, where = self._locate(bid)
            except NotFound:
                continue
            t: float | None
            if kind == "mem":
                t = time.time()
            elif kind == "loose":
                try:
                    t = loose_time(bid)
                except NotFound:
                    continue
            else:
                name = where[0]
                if name not in pack_times:
                    path = self._pack_path(name)
                    try:
                        pack_times[name] = self._call(
                            "written_at", bid, partial(self._store.mtime, path)
                        )
                    except NotFound:  # repacked meanwhile: its blobs are young again
                        pack_times[name] = time.time()
                t = pack_times[name]
            if t is not None:
                out[bid] = t
        return out

    def has(self, blob_ids: Sequence[str]) -> set[str]:
        for bid in blob_ids:
            check_blob_id(bid, self._url)
        if not blob_ids:
            return set()
        self.refresh()
        with self._cond:
            return {bid for bid in blob_ids if self._present(bid)}

    def list(self) -> list[str]:
        self.refresh()
        with self._cond:
            ids = set(self._pending) | set(self._sealing) | self._loose
            for _name, pack in self._packs.items():
                ids.update(bid for bid in pack.entries if bid not in pack.dropped)
        return sorted(ids)

    # --- deleting ------------------------------------------------------------------

    def delete(self, blob_ids: Sequence[str]) -> int:
        """Delete blobs wherever they are (see module doc for what happens to packs)."""
        for bid in blob_ids:
            check_blob_id(bid, self._url)
        ids = set(blob_ids)
        if not ids:
            return 0
        with self._refresh_lock:
            self._refresh_locked()
            removed: set[str] = set()
            affected: dict[str, set[str]] = {}
            with self._cond:
                for bid in ids:
                    data = self._pending.pop(bid, None)
                    if data is not None:
                        self._pending_bytes -= len(data)
                        removed.add(bid)
                loose = sorted(ids & self._loose)
                for bid in ids:
                    for name in self._where.get(bid, ()):
                        if self._packs[name].live(bid) is not None:
                            affected.setdefault(name, set()).add(bid)
                            removed.add(bid)
            if loose:
                paths = [self._loose_path(b) for b in loose]
                self._call("delete", "", lambda: self._store.remove_many(paths))
                with self._cond:
                    self._loose -= set(loose)
                removed.update(loose)
            self._drop_from_packs(affected)
        return len(removed)

    def _drop_from_packs(self, affected: dict[str, set[str]]) -> None:
        gone: list[str] = []  # packs to delete (whole, or once repacked)
        repack: dict[str, list[PackEntry]] = {}
        for name, ids in sorted(affected.items()):
            with self._cond:
                pack = self._packs[name]
                dropped = pack.dropped | ids
            live = [e for bid, e in pack.entries.items() if bid not in dropped]
            total = sum(e.length for e in pack.entries.values())
            if not live:
                gone.append(name)
            elif sum(e.length for e in live) < REPACK_BELOW * total:
                repack[name] = live
            else:
                self._write_drop(name, dropped)
        if repack:
            self._repack(repack)
            gone.extend(repack)
        if gone:
            paths = [self._pack_path(n) for n in gone] + [self._drop_path(n) for n in gone]
            self._call("delete packs", "", lambda: self._store.remove_many(paths))
            with self._cond:
                for name in gone:
                    self._forget_pack(name)

    def _write_drop(self, name: str, dropped: set[str]) -> None:
        body = frame_record(b"".join(bytes.fromhex(b) for b in sorted(dropped)))
        path = self._drop_path(name)
        self._call(
            "write drop list",
            name,
            lambda: self._store.put(path, (memoryview(body),), if_absent=False),
        )
        with self._cond:
            pack = self._packs[name]
            pack.dropped = set(dropped)
            pack.drop_size = len(body)

    def _repack(self, live: dict[str, builtins.list[PackEntry]]) -> None:
        """Write the live blobs of the given packs into new packs, durable before the old
        ones are deleted (a crash in between leaves both copies: harmless)."""
        batch: dict[str, Buffer] = {}
        size = 0
        written: list[tuple[str, _Pack]] = []
        for name, entries in live.items():
            for entry in entries:
                buf = fresh_buffer(entry.length)
                self._range(name, entry, 0, (buf,))
                batch[entry.blob_id] = buf
                size += entry.length
                if size >= self._pack_size:
                    written.append(self._write_pack(batch))
                    batch, size = {}, 0
        if batch:
            written.append(self._write_pack(batch))
        self._call("sync", "", self._store.sync)
        with self._cond:
            for name, pack in written:
                self._add_pack(name, pack)


def _abort_quietly(upload: PackUpload) -> None:
    try:
        upload.abort()
    except Exception as exc:  # an upload left behind is invisible (never completed)
        log.debug("aborting a pack upload failed: %s", exc)


def _copy_out(data: Buffer, out: memoryview | None, url: str, blob_id: str) -> memoryview:
    if out is None:
        return memoryview(data)
    if len(out) < len(data):
        raise ValueError(
            f"buffer of {len(out)} bytes too small for blob of {len(data)} bytes ({url} {blob_id})"
        )
    out[: len(data)] = data
    return out[: len(data)]
