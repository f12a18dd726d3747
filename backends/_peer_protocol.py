"""Wire protocol of the peer-memory tier, shared by the client and the daemon.

A frame is ``length (u32 big-endian) | body``, where ``body`` is exactly ``length`` bytes of
one msgpack map with string keys; never pickle. A blob or log record travels as the msgpack
``bin`` value of the key ``"data"``. Senders put that key first and encode it as ``bin 32``
so that the payload can be sent from the caller's buffer (``sendmsg`` of header, payload and
tail, no concatenation) and received straight into its final buffer (``recv_into``); the
frame is still one ordinary msgpack map, and a receiver decodes any other key order too.
The full description, with the handshake and every message, is ``docs/peer-protocol.md``.

This module knows frames and the handshake, nothing about tiers or typed tier errors:
the client (``_peer.py``) and the daemon (``tiercheck.peer.server``) map its exceptions.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import select
import socket
import stat
import struct
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

__all__ = [
    "DEFAULT_MAX_FRAME",
    "HANDSHAKE_MAX_FRAME",
    "NONCE_BYTES",
    "PROTOCOL_VERSION",
    "TOKEN_ENV",
    "Buffer",
    "FrameTooLarge",
    "PeerClosed",
    "PeerConnection",
    "PeerRejected",
    "ProtocolError",
    "auth_mac",
    "decode_body",
    "load_token_file",
    "read_frame",
    "read_frame_into",
    "read_length",
    "recv_exact",
    "send_frame",
    "set_keepalive",
    "token_from_env",
]

Buffer = bytes | bytearray | memoryview

PROTOCOL_VERSION = 1
TOKEN_ENV = "TIERCHECK_PEER_TOKEN"
NONCE_BYTES = 32
DEFAULT_MAX_FRAME = 64 * 1024 * 1024
# Before a client has authenticated it may only send this much: an unauthenticated peer
# must not make the daemon allocate max_frame bytes.
HANDSHAKE_MAX_FRAME = 64 * 1024

_LENGTH = struct.Struct(">I")
_DATA_KEY = b"\xa4data"  # msgpack fixstr "data"
_BIN32 = 0xC6
# fixmap header (1) + "data" key (5) + bin32 marker and length (5)
_DATA_PREFIX = 11
# Linux IOV_MAX is 1024; stay below it in one sendmsg call.
_IOV_BATCH = 512


class ProtocolError(Exception):
    """The byte stream does not follow the protocol (not msgpack, wrong shape, bad length)."""


class FrameTooLarge(ProtocolError):
    """A frame announced more bytes than the receiver accepts; its body was not read."""

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"frame of {length} bytes exceeds the limit of {limit} bytes")
        self.length = length
        self.limit = limit


class PeerClosed(ProtocolError, ConnectionError):
    """The other side closed the connection; ``got`` bytes of a ``want``-byte read arrived.

    ``mid_frame`` is true when part of a frame had arrived (a half-sent frame).
    """

    def __init__(self, got: int, want: int, *, mid_frame: bool) -> None:
        self.mid_frame = mid_frame or got > 0
        super().__init__(
            f"connection closed mid-frame ({got} of {want} bytes)"
            if self.mid_frame
            else "connection closed"
        )
        self.got = got
        self.want = want


class PeerRejected(Exception):
    """The daemon answered a request with an error frame: ``code`` and ``message``."""

    def __init__(self, code: str, message: str, reply: Mapping[str, Any]) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.reply = reply


def auth_mac(token: bytes, nonce: bytes) -> bytes:
    """The handshake answer: HMAC-SHA256 of the daemon's nonce keyed by the shared token."""
    return hmac.new(token, nonce, hashlib.sha256).digest()


# --- encoding ------------------------------------------------------------------------


def _byte_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _encode_parts(
    fields: Mapping[str, Any], data: Buffer | Sequence[Buffer] | None
) -> list[memoryview | bytes]:
    packer = msgpack.Packer(use_bin_type=True)
    count = len(fields) + (data is not None)
    if count > 15:
        raise ValueError("a frame has at most 15 keys")
    parts: list[memoryview | bytes] = []
    head = bytearray(_LENGTH.size)
    head.append(0x80 | count)
    payload: list[memoryview] = []
    if data is not None:
        chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
        payload = [_byte_view(c) for c in chunks]
        head += _DATA_KEY
        head.append(_BIN32)
        head += _LENGTH.pack(sum(p.nbytes for p in payload))
    tail = b"".join(packer.pack(k) + packer.pack(v) for k, v in fields.items())
    length = len(head) - _LENGTH.size + sum(p.nbytes for p in payload) + len(tail)
    if length >= 1 << 32:
        raise ValueError(f"frame of {length} bytes does not fit the u32 length")
    _LENGTH.pack_into(head, 0, length)
    parts.append(bytes(head))
    parts.extend(p for p in payload if p.nbytes)
    if tail:
        parts.append(tail)
    return parts


def send_frame(
    sock: socket.socket,
    fields: Mapping[str, Any],
    data: Buffer | Sequence[Buffer] | None = None,
) -> None:
    """Send one frame; ``data`` (one buffer or several, concatenated) becomes ``"data"``.

    The payload buffers are handed to the kernel as they are (``sendmsg`` gather I/O).
    """
    bufs = [_byte_view(p) for p in _encode_parts(fields, data)]
    i = 0
    while i < len(bufs):
        sent = sock.sendmsg(bufs[i : i + _IOV_BATCH])
        while sent:
            n = bufs[i].nbytes
            if sent >= n:
                sent -= n
                i += 1
            else:
                bufs[i] = bufs[i][sent:]
                sent = 0


# --- decoding ------------------------------------------------------------------------


def _unpack_map(body: Buffer) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"frame is not a msgpack value ({type(exc).__name__}: {exc})") from exc
    if not isinstance(obj, dict):
        raise ProtocolError(f"frame is a msgpack {type(obj).__name__}, expected a map")
    if not all(isinstance(k, str) for k in obj):
        raise ProtocolError("frame map has non-string keys")
    return obj


def decode_body(body: bytearray | memoryview) -> tuple[dict[str, Any], memoryview | None]:
    """Decode a frame body into its fields and its ``"data"`` payload (or None).

    When ``"data"`` is first and ``bin 32`` the payload is a view into ``body`` (no copy).
    """
    view = memoryview(body)
    if (
        len(view) >= _DATA_PREFIX
        and 0x81 <= view[0] <= 0x8F
        and view[1:6] == _DATA_KEY
        and view[6] == _BIN32
    ):
        n = _LENGTH.unpack_from(view, 7)[0]
        end = _DATA_PREFIX + n
        if end > len(view):
            raise ProtocolError(f"data of {n} bytes overruns a frame of {len(view)} bytes")
        rest = bytes([view[0] - 1]) + bytes(view[end:])
        fields = _unpack_map(rest)
        if "data" in fields:
            raise ProtocolError("frame has two 'data' keys")
        return fields, view[_DATA_PREFIX:end]
    fields = _unpack_map(view)
    data = fields.pop("data", None)
    if data is None:
        return fields, None
    if not isinstance(data, bytes):
        raise ProtocolError(f"'data' is a {type(data).__name__}, expected bin")
    return fields, memoryview(data)


def recv_exact(
    sock: socket.socket, view: memoryview, done: int = 0, *, mid_frame: bool = True
) -> None:
    """Fill ``view[done:]`` from ``sock``; ``PeerClosed`` if the connection ends first."""
    while done < len(view):
        n = sock.recv_into(view[done:])
        if n == 0:
            raise PeerClosed(done, len(view), mid_frame=mid_frame)
        done += n


def set_keepalive(sock: socket.socket, idle: float) -> None:
    """TCP keepalive on ``sock``: probes after ``idle`` seconds of silence, every
    ``idle / 6`` seconds (at least 1); 3 unanswered probes drop the connection."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (
        ("TCP_KEEPIDLE", int(idle)),
        ("TCP_KEEPINTVL", max(1, int(idle / 6))),
        ("TCP_KEEPCNT", 3),
    ):
        if hasattr(socket, opt):  # Linux; other systems keep their defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def load_token_file(path: str | os.PathLike[str]) -> bytes:
    """Read a shared-secret token file: its bytes without surrounding whitespace.

    Warns when the file can be read by other users (it should be mode 0600).
    """
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            logging.getLogger(__name__).warning(
                "token file %r is readable by other users; chmod 600 it", os.fspath(path)
            )
        token = f.read().strip()
    if not token:
        raise ValueError(f"token file {os.fspath(path)!r} is empty")
    return token


def token_from_env() -> bytes | None:
    """The token in ``TIERCHECK_PEER_TOKEN`` (UTF-8), or None when unset or empty."""
    value = os.environ.get(TOKEN_ENV, "")
    return value.encode() if value else None


def read_length(sock: socket.socket, max_frame: int) -> int:
    """Read a frame's length; ``FrameTooLarge`` before its body is read if over ``max_frame``."""
    header = bytearray(_LENGTH.size)
    recv_exact(sock, memoryview(header), mid_frame=False)
    length: int = _LENGTH.unpack(header)[0]
    if length > max_frame:
        raise FrameTooLarge(length, max_frame)
    if length == 0:
        raise ProtocolError("empty frame")
    return length


def read_frame(sock: socket.socket, max_frame: int) -> tuple[dict[str, Any], memoryview | None]:
    """Read one frame; the payload is a view into a fresh buffer the caller may keep."""
    length = read_length(sock, max_frame)
    body = bytearray(length)
    recv_exact(sock, memoryview(body))
    return decode_body(body)


def read_frame_into(
    sock: socket.socket, max_frame: int, out: memoryview
) -> tuple[dict[str, Any], memoryview | None, bool]:
    """Like :func:`read_frame`, but a first-key ``"data"`` payload that fits ``out`` is received
    straight into ``out``. Returns ``(fields, data, into_out)``."""
    length = read_length(sock, max_frame)
    prefix = bytearray(min(length, _DATA_PREFIX))
    recv_exact(sock, memoryview(prefix))
    if (
        len(prefix) == _DATA_PREFIX
        and 0x81 <= prefix[0] <= 0x8F
        and prefix[1:6] == _DATA_KEY
        and prefix[6] == _BIN32
    ):
        n = _LENGTH.unpack_from(prefix, 7)[0]
        if n <= len(out) and _DATA_PREFIX + n <= length:
            target = out[:n]
            recv_exact(sock, target)
            rest = bytearray(length - _DATA_PREFIX - n + 1)
            rest[0] = prefix[0] - 1
            recv_exact(sock, memoryview(rest), 1)
            fields = _unpack_map(rest)
            return fields, target, True
    body = bytearray(length)
    body[: len(prefix)] = prefix
    recv_exact(sock, memoryview(body), len(prefix))
    fields, data = decode_body(body)
    return fields, data, False


# --- client connection ---------------------------------------------------------------


class PeerConnection:
    """One authenticated connection to a daemon, bound to a namespace. Not thread-safe.

    Raises ``OSError`` (including ``PeerClosed`` and timeouts), ``ProtocolError``, or
    ``PeerRejected`` (the daemon refused the hello: wrong token, busy, bad namespace; code
    ``"NoToken"`` is raised locally when the daemon asks for a token and none was given).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        namespace: str,
        token: bytes | None,
        timeout: float | None,
        budget: int | None = None,
        keepalive: float | None = 60.0,
    ) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if keepalive is not None:
                set_keepalive(self.sock, keepalive)
            self.max_frame = HANDSHAKE_MAX_FRAME
            self.server_info = self._handshake(namespace, token, budget)
        except BaseException:
            self.sock.close()
            raise
        idle = self.server_info.get("idle_timeout")
        #: The daemon closes a connection idle this long (None: never).
        self.idle_timeout: float | None = float(idle) if isinstance(idle, (int, float)) else None
        self.last_used = time.monotonic()

    def stale(self) -> bool:
        """Whether this idle connection should not be reused: it sat unused for half the
        daemon's idle timeout, or the daemon already closed it (readable at EOF)."""
        if self.idle_timeout is not None and (
            time.monotonic() - self.last_used > self.idle_timeout / 2
        ):
            return True
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)  # between requests the daemon sends nothing but a close

    def _handshake(self, namespace: str, token: bytes | None, budget: int | None) -> dict[str, Any]:
        challenge, _ = read_frame(self.sock, HANDSHAKE_MAX_FRAME)
        if challenge.get("ok") is False:
            raise PeerRejected(
                str(challenge.get("error", "Error")), str(challenge.get("message", "")), challenge
            )
        nonce = challenge.get("nonce")
        if challenge.get("op") != "challenge" or not isinstance(nonce, bytes):
            raise ProtocolError(f"expected a challenge frame, got {sorted(challenge)}")
        hello: dict[str, Any] = {
            "op": "hello",
            "version": PROTOCOL_VERSION,
            "namespace": namespace,
        }
        if challenge.get("auth"):
            if token is None:
                raise PeerRejected(
                    "NoToken",
                    "the daemon requires a token; pass token= or token_file=, "
                    "or set TIERCHECK_PEER_TOKEN",
                    {},
                )
            hello["mac"] = auth_mac(token, nonce)
        if budget is not None:
            hello["budget"] = budget
        send_frame(self.sock, hello)
        reply, _ = read_frame(self.sock, HANDSHAKE_MAX_FRAME)
        if not reply.get("ok"):
            raise PeerRejected(
                str(reply.get("error", "Error")), str(reply.get("message", "")), reply
            )
        max_frame = reply.get("max_frame")
        if not isinstance(max_frame, int) or max_frame <= 0:
            raise ProtocolError("hello reply lacks max_frame")
        self.max_frame = max_frame
        return reply

    def request(
        self,
        fields: Mapping[str, Any],
        data: Buffer | Sequence[Buffer] | None = None,
        out: memoryview | None = None,
    ) -> tuple[dict[str, Any], memoryview | None, bool]:
        """Send one request, read its reply: ``(reply fields, reply data, data_is_in_out)``.

        An error reply is returned as it is (``ok`` false); the caller maps it.
        """
        send_frame(self.sock, fields, data)
        # A reply holds at most one frame's payload plus small fields.
        limit = self.max_frame + HANDSHAKE_MAX_FRAME
        if out is not None:
            result = read_frame_into(self.sock, limit, out)
        else:
            reply, payload = read_frame(self.sock, limit)
            result = reply, payload, False
        self.last_used = time.monotonic()
        return result

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
