"""What the peer daemon checks in a request before acting on it, and how it refuses one.

A request that breaks the protocol (a malformed id, a missing payload, a field of the
wrong type) is refused with ``close=True``: the client is broken or hostile, so its
connection ends. A request that is well formed but cannot be served (an empty blob, a
full namespace) is refused and the connection stays open. Limits on what one request may
name are here too.
"""

from __future__ import annotations

from typing import Any

from tiercheck.backends.base import BLOB_ID_RE

__all__ = [
    "MAX_IDS",
    "MAX_LIST_PAGE",
    "MAX_NAMESPACE",
    "Refused",
    "blob_id_arg",
    "blob_ids_arg",
    "int_arg",
    "not_empty",
    "require_data",
]

#: characters of a namespace's name (a hello naming a longer one is refused)
MAX_NAMESPACE = 255
#: ids in one ``list`` reply, at most
MAX_LIST_PAGE = 100_000
#: ids one request may name
MAX_IDS = 100_000


class Refused(Exception):
    """A request the daemon answers with an error frame. ``close`` ends the connection."""

    def __init__(self, code: str, message: str, *, close: bool = False, **extra: Any) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.close = close
        self.extra = extra


def blob_id_arg(value: object) -> str:
    if not isinstance(value, str) or not BLOB_ID_RE.match(value):
        raise Refused("BadRequest", f"invalid blob id {value!r}", close=True)
    return value


def blob_ids_arg(value: object) -> list[str]:
    if not isinstance(value, list) or len(value) > MAX_IDS:
        raise Refused("BadRequest", f"'ids' must be a list of at most {MAX_IDS}", close=True)
    return [blob_id_arg(v) for v in value]


def require_data(data: memoryview | None, op: str) -> memoryview:
    if data is None:
        raise Refused("BadRequest", f"{op} needs 'data'", close=True)
    return data


def not_empty(nbytes: int, what: str) -> None:
    if not nbytes:
        raise Refused(
            "BadRequest",
            f"{what} of 0 bytes is refused: it would hold only overhead (the peer tier "
            "stores none; a client must not send one)",
        )


def int_arg(fields: dict[str, Any], name: str, default: int) -> int:
    value = fields.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise Refused("BadRequest", f"{name!r} must be a non-negative integer", close=True)
    return value
