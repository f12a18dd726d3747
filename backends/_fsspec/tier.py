"""The fsspec tier, :class:`FsspecTier`: blobs (loose or in packs) and log records as
objects under a root, on a store of :mod:`.local` or :mod:`.remote` (see the package
doc for the layout and what each operation promises)."""

from __future__ import annotations

import builtins
import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, ClassVar, cast

from tiercheck.backends._fsspec.errors import raise_typed
from tiercheck.backends._fsspec.local import LocalStore
from tiercheck.backends._fsspec.opening import default_capabilities, open_store, url_credentials
from tiercheck.backends._fsspec.remote import FsspecStore
from tiercheck.backends._fsspec.s3_multipart import REMOTE_THREADS
from tiercheck.backends._packs import PackedBlobs
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
)
from tiercheck.core.sizes import parse_size
from tiercheck.errors import AlreadyExists, FormatVersionError, NotFound, TierError
from tiercheck.formats.framing import frame_record, unframe_record

__all__ = ["DEFAULT_PACK_SIZE", "LAYOUT_VERSION", "FsspecTier"]

log = logging.getLogger(__name__)

LAYOUT_VERSION = 2  # 2: blobs may be in packs (packs/), besides loose objects
#: the default pack size of an object store (``pack_size`` option; 0: one object per blob)
DEFAULT_PACK_SIZE = 128 * 1024 * 1024
_MARKER = "tier.json"
_MARKER_KIND = "tiercheck-fsspec"
_LOG_NAME_RE = re.compile(r"^(\d{16})\.rec$")
_CKPT_NAME_RE = re.compile(r"^(\d{16})\.ckpt$")
_MAX_APPEND_RACES = 1000
_OWNER_DIR = "owner"  # owner/<seq:016d>.json: the owner claims, each created if absent
_OWNER_NAME_RE = re.compile(r"^(\d{16})\.json$")


def _byte_view(data: Buffer) -> memoryview:
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


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
        # s3://KEY:SECRET@bucket/run: the credentials go to the file system, never further
        url, storage_options = url_credentials(url, storage_options)
        if unknown:
            raise invalid_url(url, f"unknown options for the fsspec tier: {sorted(unknown)}")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise invalid_url(url, "storage_options must be a dict")
        protocol, self._root, self._store = open_store(url, dict(storage_options or {}))
        self.protocol = protocol
        local = isinstance(self._store, LocalStore)
        memory = isinstance(self._store, FsspecStore) and self._store._memory
        caps = default_capabilities(
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
            raise_typed(exc, self.url, key, what)

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

    def _marker_owner(self, what: str) -> StoreOwner | None:
        marker = self._read_marker(what)
        if marker is None or "owner" not in marker:
            return None
        try:
            return StoreOwner.from_json(marker["owner"])
        except (ValueError, TypeError):
            return None

    def _newest_claim(self, what: str) -> tuple[int, StoreOwner | None]:
        """The number and record of the newest owner claim (-1 and None: no claim yet)."""
        directory = self._join(self._root, _OWNER_DIR)
        names = self._call(what, _OWNER_DIR, lambda: self._store.names(directory))
        seqs = sorted(int(m.group(1)) for n in names if (m := _OWNER_NAME_RE.match(n)))
        if not seqs:
            return -1, None
        path = self._join(directory, f"{seqs[-1]:016d}.json")
        raw = bytes(self._call(what, _OWNER_DIR, lambda: self._store.read(path, None)))
        try:
            return seqs[-1], StoreOwner.from_json(json.loads(raw).get("owner"))
        except (ValueError, AttributeError):
            return seqs[-1], None

    def read_owner(self) -> StoreOwner | None:
        """The owner the newest claim ``owner/<seq>.json`` records, or, before any claim,
        the ``owner`` of the marker (written by a tiercheck that made no claims); None:
        neither, or not a record."""
        seq, owner = self._newest_claim("read the owner")
        return owner if seq >= 0 else self._marker_owner("read the owner")

    def write_owner(self, owner: StoreOwner) -> None:
        """Record ``owner`` whatever the tier recorded before (a claim that replaces the
        newest, retried while other claims race it)."""
        self._check_writable("record the owner")
        for _ in range(_MAX_APPEND_RACES):
            current = self.read_owner()
            if self.claim_owner(owner, replacing=current) == owner:
                return
        raise AlreadyExists(
            f"recording the owner lost {_MAX_APPEND_RACES} races in a row", url=self.url
        )

    def claim_owner(self, owner: StoreOwner, *, replacing: StoreOwner | None = None) -> StoreOwner:
        """Record ``owner`` if the tier still records ``replacing`` (None: no owner): the
        claim is the object ``owner/<seq>.json`` after the newest, created if absent (as a
        log record is), so of two claims on one number one is created and the other finds
        it and loses. The marker's ``owner`` is then rewritten too, for a tiercheck that
        reads it alone. Returns the record that holds afterwards (:meth:`Tier.claim_owner`)."""
        self._check_writable("record the owner")
        what = "record the owner"
        seq, current = self._newest_claim(what)
        if seq < 0:
            current = self._marker_owner(what)
        if current != replacing:
            return current if current is not None else owner
        path = self._join(self._root, _OWNER_DIR, f"{seq + 1:016d}.json")
        body = memoryview(json.dumps({"owner": owner.to_json()}).encode())
        try:
            self._call(what, _OWNER_DIR, partial(self._store.create, path, body))
        except FileExistsError:
            # another claim took the number first: the newest record holds
            won = self._newest_claim(what)[1]
            return won if won is not None else owner
        marker = self._read_marker(what)
        if marker is None:  # a writable open creates it; gone since: made again
            marker = {"tier": _MARKER_KIND, "layout": LAYOUT_VERSION if self._packs else 1}
        self._put_marker({**marker, "owner": owner.to_json()}, what)
        return owner

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
        if not isinstance(store, LocalStore) or self._packs is not None:
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
        if isinstance(store, LocalStore) or len(batch) < 2:
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

        with ThreadPoolExecutor(max_workers=min(REMOTE_THREADS, len(batch))) as pool:
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
