"""What each request of the peer protocol does to the daemon's memory.

A connection's hello establishes a :class:`Session`; each request frame after it is a
:class:`Request`, answered by the handler of its ``op`` (:attr:`Handlers.ops`) with a
:class:`Reply` or a :class:`~tiercheck.peer.validation.Refused`. The server
(:mod:`tiercheck.peer.server`) reads the frames and sends the replies; a handler never
touches a socket. ``docs/peer-protocol.md`` lists the requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tiercheck.peer.memory import MemoryStore
from tiercheck.peer.validation import (
    MAX_LIST_PAGE,
    Refused,
    blob_id_arg,
    blob_ids_arg,
    int_arg,
    not_empty,
    require_data,
)

__all__ = ["Handlers", "Reply", "Request", "Session"]


@dataclass(frozen=True)
class Session:
    """What a connection's hello established."""

    ns: str
    admin: bool  # proved the daemon's token (not a namespace token)


@dataclass(frozen=True)
class Request:
    session: Session
    fields: dict[str, Any]
    data: memoryview | None
    body: bytearray  # the frame buffer, from the pool; ``data`` may point into it

    @property
    def ns(self) -> str:
        return self.session.ns


@dataclass(frozen=True)
class Reply:
    fields: dict[str, Any]
    data: memoryview | None = None
    keeps_body: bool = False  # the store now owns the request's frame buffer
    done: Callable[[], None] | None = None  # called once the reply is sent


class Handlers:
    """The handler of each op, over ``store``: ``ops[op](request) -> Reply``.

    ``max_frame`` bounds a reply (a ``list`` page, a ``read_log`` page); ``stats`` gives
    the daemon's ``stats`` reply (for one namespace, or for all when given None).
    """

    def __init__(
        self,
        store: MemoryStore,
        *,
        max_frame: int,
        stats: Callable[[str | None], dict[str, Any]],
    ) -> None:
        self._store = store
        self.max_frame = max_frame
        self.stats = stats
        self.ops: dict[str, Callable[[Request], Reply]] = {
            "ping": self._op_ping,
            "put": self._op_put,
            "put_many": self._op_put_many,
            "get": self._op_get,
            "size": self._op_size,
            "has": self._op_has,
            "delete": self._op_delete,
            "list": self._op_list,
            "append": self._op_append,
            "read_log": self._op_read_log,
            "replace_log_prefix": self._op_replace_log_prefix,
            "usage": self._op_usage,
            "set_budget": self._op_set_budget,
            "stats": self._op_stats,
        }

    def _op_ping(self, req: Request) -> Reply:
        return Reply({})

    def _op_put(self, req: Request) -> Reply:
        blob_id = blob_id_arg(req.fields.get("id"))
        payload = require_data(req.data, "put")
        not_empty(payload.nbytes, "a blob")
        # Usually the payload points into the frame buffer, which the store then keeps.
        owner = req.body if payload.obj is req.body else None
        overwrite = bool(req.fields.get("overwrite", False))
        written = self._store.put(req.ns, blob_id, payload.toreadonly(), overwrite, owner)
        return Reply({"written": written}, keeps_body=written and owner is not None)

    def _op_put_many(self, req: Request) -> Reply:
        ids = blob_ids_arg(req.fields.get("ids"))
        sizes = req.fields.get("sizes")
        payload = require_data(req.data, "put_many")
        if (
            not isinstance(sizes, list)
            or len(sizes) != len(ids)
            or not all(isinstance(s, int) and s > 0 for s in sizes)
            or sum(sizes) != payload.nbytes
        ):
            raise Refused(
                "BadRequest",
                "put_many 'sizes' do not match 'ids' and data, or name an empty blob "
                "(refused: it would cost only overhead)",
            )
        written = 0
        pos = 0
        for blob_id, size in zip(ids, sizes):
            # Copy each small blob out so that one kept blob does not pin the whole frame.
            piece = memoryview(bytes(payload[pos : pos + size]))
            pos += size
            try:
                written += self._store.put(req.ns, blob_id, piece, False, None)
            except Refused as exc:
                exc.extra["written"] = written
                raise
        return Reply({"written": written})

    def _op_get(self, req: Request) -> Reply:
        blob_id = blob_id_arg(req.fields.get("id"))
        length = req.fields.get("length")
        if length is not None and (not isinstance(length, int) or length < 0):
            raise Refused("BadRequest", "get 'length' must be a non-negative int")
        blob = self._store.checkout(req.ns, blob_id)
        if blob is None:
            raise Refused("NotFound", f"blob {blob_id} not found in namespace {req.ns!r}")
        data = blob.data if length is None else blob.data[:length]  # length: a prefix (head)
        return Reply({}, data, done=lambda: self._store.checkin(blob))

    def _op_size(self, req: Request) -> Reply:
        blob_id = blob_id_arg(req.fields.get("id"))
        size = self._store.size(req.ns, blob_id)
        if size is None:
            raise Refused("NotFound", f"blob {blob_id} not found in namespace {req.ns!r}")
        return Reply({"size": size})

    def _op_has(self, req: Request) -> Reply:
        return Reply({"ids": self._store.has(req.ns, blob_ids_arg(req.fields.get("ids")))})

    def _op_delete(self, req: Request) -> Reply:
        return Reply({"removed": self._store.delete(req.ns, blob_ids_arg(req.fields.get("ids")))})

    def _op_list(self, req: Request) -> Reply:
        after = req.fields.get("after")
        if after is not None and not isinstance(after, str):
            raise Refused("BadRequest", "'after' must be a string", close=True)
        # A page of ids (about 67 bytes each in msgpack) must fit in one reply frame.
        page_max = min(MAX_LIST_PAGE, self.max_frame // 80)
        limit = min(int_arg(req.fields, "limit", page_max), page_max)
        ids, more = self._store.list_page(req.ns, after, max(limit, 1))
        return Reply({"ids": ids, "more": more})

    def _op_append(self, req: Request) -> Reply:
        record = bytes(require_data(req.data, "append"))
        not_empty(len(record), "a log record")
        return Reply({"index": self._store.append(req.ns, record)})

    def _op_read_log(self, req: Request) -> Reply:
        start = int_arg(req.fields, "start", 0)
        records, more = self._store.read_log(req.ns, start, self.max_frame // 2)
        return Reply({"records": records, "next": start + len(records), "more": more})

    def _op_replace_log_prefix(self, req: Request) -> Reply:
        record = bytes(require_data(req.data, "replace_log_prefix"))
        not_empty(len(record), "a log record")
        count = int_arg(req.fields, "count", 0)
        self._store.replace_log_prefix(req.ns, count, record)
        return Reply({})

    def _op_set_budget(self, req: Request) -> Reply:
        budget = req.fields.get("budget")
        if budget is not None and (
            not isinstance(budget, int) or isinstance(budget, bool) or budget < 0
        ):
            raise Refused("BadRequest", "'budget' must be a non-negative integer or nil")
        self._store.set_budget(req.ns, budget)
        return Reply({})

    def _op_usage(self, req: Request) -> Reply:
        return Reply({"bytes": self._store.usage(req.ns)})

    def _op_stats(self, req: Request) -> Reply:
        return Reply({"stats": self.stats(None if req.session.admin else req.ns)})
