"""The peer:// tier: conformance against an in-process daemon and a real daemon process,
hostile clients, the memory limit, a killed daemon, and the frame codec. Loopback only."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiercheck.backends._peer import PeerTier
from tiercheck.backends._peer_protocol import (
    HANDSHAKE_MAX_FRAME,
    PROTOCOL_VERSION,
    ProtocolError,
    auth_mac,
    decode_body,
    read_frame,
    send_frame,
)
from tiercheck.backends.base import FailureDomain, Tier
from tiercheck.backends.registry import open_tier
from tiercheck.core.sizes import parse_size
from tiercheck.errors import (
    ConfigError,
    InvalidURL,
    NotFound,
    NotSupported,
    OverBudget,
    TierError,
    TierFull,
    TierUnavailable,
)
from tiercheck.peer.daemon import peer_status
from tiercheck.peer.server import PeerServer, parse_address
from tiercheck.testing.conformance import TierConformance, blob

TOKEN = b"test-token-0123456789"
LOOPBACK = "127.0.0.1"
# Every socket in these tests gives up after this long instead of hanging.
TIMEOUT = 20.0


# --- daemons -------------------------------------------------------------------------


@dataclass
class Daemon:
    """A ``python -m tiercheck.peer.daemon`` process on loopback."""

    proc: subprocess.Popen[str]
    port: int
    log_path: Path
    token_file: Path

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def url(self, namespace: str = "") -> str:
        return f"peer://{self.address}/{namespace or uuid.uuid4().hex}"

    def tier(self, namespace: str = "", **options: Any) -> PeerTier:
        options.setdefault("token", TOKEN)
        options.setdefault("timeout", TIMEOUT)
        tier = open_tier(self.url(namespace), **options)
        assert isinstance(tier, PeerTier)
        return tier

    def log(self) -> str:
        return self.log_path.read_text()


@contextlib.contextmanager
def run_daemon(tmp_path: Path, *args: str, memory_limit: str = "512MiB") -> Iterator[Daemon]:
    """Start a daemon subprocess, wait for its ``listening on`` line, SIGTERM it after."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    token_file = tmp_path / "token"
    token_file.write_bytes(TOKEN + b"\n")
    token_file.chmod(0o600)
    log_path = tmp_path / "daemon.log"
    env = {k: v for k, v in os.environ.items() if k != "TIERCHECK_PEER_TOKEN"}
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tiercheck.peer.daemon",
                "--listen",
                f"{LOOPBACK}:0",
                "--memory-limit",
                memory_limit,
                "--token-file",
                str(token_file),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
            env=env,
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # EOF (not a hang) if the daemon fails to start
        assert line.startswith("listening on "), f"daemon said {line!r}: {log_path.read_text()}"
        _, port = parse_address(line.removeprefix("listening on ").strip())
        yield Daemon(proc, port, log_path, token_file)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise
            assert proc.returncode == 0, log_path.read_text()
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with run_daemon(tmp_path_factory.mktemp("peer-daemon"), "--max-frame", "16MiB") as d:
        yield d


@pytest.fixture(scope="module")
def server() -> Iterator[PeerServer]:
    with PeerServer(f"{LOOPBACK}:0", memory_limit=1 << 30, token=TOKEN) as s:
        yield s


# --- conformance ---------------------------------------------------------------------


class TestPeerTierInProcess(TierConformance):
    """Each test gets a fresh namespace in one in-process daemon."""

    @pytest.fixture(autouse=True)
    def _server(self, server: PeerServer) -> None:
        self.server = server

    def make_tier(self, tmp_path: Path) -> Tier:
        return open_tier(
            f"peer://{LOOPBACK}:{self.server.port}/{uuid.uuid4().hex}",
            token=TOKEN,
            timeout=TIMEOUT,
        )

    def reopen(self, tier: Tier) -> Tier:
        tier.close()
        return open_tier(tier.url, token=TOKEN, timeout=TIMEOUT)

    def open_read_only(self, tier: Tier) -> Tier:
        return open_tier(tier.url, token=TOKEN, timeout=TIMEOUT, read_only=True)

    def test_peer_capabilities(self, tier: Tier) -> None:
        caps = tier.capabilities
        assert caps.survives is FailureDomain.NODE
        assert (caps.shared, caps.persistent, caps.speed_rank) == (False, False, 20)


class TestPeerTierDaemon(TierConformance):
    """The same suite against a real daemon process; the token comes from its file."""

    @pytest.fixture(autouse=True)
    def _daemon(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def make_tier(self, tmp_path: Path) -> Tier:
        return self.daemon.tier(token=None, token_file=str(self.daemon.token_file))

    def reopen(self, tier: Tier) -> Tier:
        tier.close()
        return open_tier(tier.url, token_file=str(self.daemon.token_file), timeout=TIMEOUT)

    def open_read_only(self, tier: Tier) -> Tier:
        return open_tier(
            tier.url, token_file=str(self.daemon.token_file), timeout=TIMEOUT, read_only=True
        )


# --- hostile clients against the real daemon -----------------------------------------


def _raw_connect(daemon: Daemon) -> tuple[socket.socket, bytes]:
    sock = socket.create_connection((LOOPBACK, daemon.port), timeout=TIMEOUT)
    challenge, _ = read_frame(sock, HANDSHAKE_MAX_FRAME)
    assert challenge["op"] == "challenge" and challenge["auth"] is True
    nonce = challenge["nonce"]
    assert isinstance(nonce, bytes)
    return sock, nonce


def _raw_authenticated(daemon: Daemon, namespace: str) -> socket.socket:
    sock, nonce = _raw_connect(daemon)
    send_frame(
        sock,
        {
            "op": "hello",
            "version": PROTOCOL_VERSION,
            "namespace": namespace,
            "mac": auth_mac(TOKEN, nonce),
        },
    )
    reply, _ = read_frame(sock, HANDSHAKE_MAX_FRAME)
    assert reply["ok"] is True
    return sock


def _expect_closing_error(sock: socket.socket, code: str) -> dict[str, Any]:
    """Read the daemon's error frame, then the end of the connection."""
    reply, _ = read_frame(sock, 1 << 20)
    assert reply["ok"] is False and reply["error"] == code, reply
    assert reply["close"] is True
    assert sock.recv(1) == b""
    sock.close()
    return reply


def _good_client_works(daemon: Daemon) -> None:
    tier = daemon.tier()
    try:
        bid, data = blob(70_000, seed=5)
        assert tier.put(bid, data) is True
        assert bytes(tier.get(bid)) == data
        tier.append(b"still serving")
        assert tier.read_log() == [b"still serving"]
    finally:
        tier.close()


def test_wrong_token_rejected(daemon: Daemon) -> None:
    tier = daemon.tier(token=b"not the token")
    with pytest.raises(TierError, match="authentication failed") as info:
        tier.ping()
    assert not isinstance(info.value, TierUnavailable)  # retrying cannot help
    assert tier.url in str(info.value)
    tier.close()
    assert "AuthFailed" in daemon.log()
    _good_client_works(daemon)


def test_missing_token_rejected_before_sending(daemon: Daemon) -> None:
    tier = daemon.tier(token=None)  # the daemon process's env var is not ours
    if os.environ.get("TIERCHECK_PEER_TOKEN"):
        pytest.skip("TIERCHECK_PEER_TOKEN is set in this environment")
    with pytest.raises(TierError, match="requires a token"):
        tier.ping()
    tier.close()
    _good_client_works(daemon)


def test_raw_wrong_mac_gets_auth_error_frame(daemon: Daemon) -> None:
    sock, _ = _raw_connect(daemon)
    send_frame(
        sock,
        {"op": "hello", "version": PROTOCOL_VERSION, "namespace": "x", "mac": b"\0" * 32},
    )
    _expect_closing_error(sock, "AuthFailed")
    _good_client_works(daemon)


def test_oversized_frame_rejected_before_body(daemon: Daemon) -> None:
    sock = _raw_authenticated(daemon, "oversize")
    # Announce 1 GiB (the daemon allows 16 MiB) and send none of it.
    sock.sendall((1 << 30).to_bytes(4, "big"))
    reply = _expect_closing_error(sock, "FrameTooLarge")
    assert str(16 << 20) in reply["message"]
    _good_client_works(daemon)


def test_oversized_frame_before_auth_rejected(daemon: Daemon) -> None:
    sock, _ = _raw_connect(daemon)
    # Unauthenticated peers may not make the daemon allocate a max-size frame.
    sock.sendall((HANDSHAKE_MAX_FRAME + 1).to_bytes(4, "big") + b"\0" * 100)
    _expect_closing_error(sock, "FrameTooLarge")
    _good_client_works(daemon)


def test_http_request_is_refused(daemon: Daemon) -> None:
    sock, _ = _raw_connect(daemon)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    _expect_closing_error(sock, "FrameTooLarge")  # "GET " read as a length
    _good_client_works(daemon)


@pytest.mark.parametrize(
    "body",
    [
        b"\xc1" * 10,  # 0xc1 is never valid msgpack
        msgpack.packb([1, 2, 3]),  # msgpack, not a map
        msgpack.packb({1: 2}),  # a map with non-string keys
        msgpack.packb({"op": "put"}) + b"\x00",  # trailing bytes
        b"\x85\xa4data\xc6\xff\xff\xff\xff",  # data longer than the frame
    ],
    ids=["not-msgpack", "array", "int-keys", "extra-data", "data-overrun"],
)
def test_garbage_frame_closes_connection(daemon: Daemon, body: bytes) -> None:
    sock = _raw_authenticated(daemon, "garbage")
    sock.sendall(len(body).to_bytes(4, "big") + body)
    _expect_closing_error(sock, "BadFrame")
    _good_client_works(daemon)


@pytest.mark.parametrize(
    "request_fields",
    [
        {"id": "0" * 64},  # no op
        {"op": "get", "id": 12},
        {"op": "has", "ids": "not a list"},
        {"op": "put", "id": "0" * 64},  # no data
        {"op": "read_log", "start": -1},
    ],
    ids=["no-op", "int-id", "ids-not-list", "put-without-data", "negative-start"],
)
def test_wrong_shape_closes_connection(daemon: Daemon, request_fields: dict[str, Any]) -> None:
    sock = _raw_authenticated(daemon, "shape")
    send_frame(sock, request_fields)
    _expect_closing_error(sock, "BadRequest")
    _good_client_works(daemon)


def test_unknown_op_is_answered_and_connection_kept(daemon: Daemon) -> None:
    sock = _raw_authenticated(daemon, "unknown")
    send_frame(sock, {"op": "frobnicate"})
    reply, _ = read_frame(sock, 1 << 20)
    assert reply["ok"] is False and reply["error"] == "Unsupported"
    send_frame(sock, {"op": "ping"})
    reply, _ = read_frame(sock, 1 << 20)
    assert reply["ok"] is True
    sock.close()


def test_first_frame_must_be_hello(daemon: Daemon) -> None:
    sock, _ = _raw_connect(daemon)
    send_frame(sock, {"op": "get", "id": "0" * 64})
    _expect_closing_error(sock, "BadRequest")
    _good_client_works(daemon)


@pytest.mark.parametrize("op", ["put", "append"])
def test_half_sent_frame_is_not_applied(daemon: Daemon, op: str) -> None:
    namespace = uuid.uuid4().hex
    bid, data = blob(100_000, seed=77)
    sock = _raw_authenticated(daemon, namespace)
    fields = {"op": "put", "id": bid} if op == "put" else {"op": "append"}
    frame = b"".join(
        bytes(p) for p in _frame_bytes(fields, data)
    )  # the whole frame, then only half of it on the wire
    sock.sendall(frame[: len(frame) // 2])
    sock.close()
    tier = daemon.tier(namespace)
    try:
        # Whatever the daemon has noticed yet, an incomplete frame is never applied.
        assert tier.has([bid]) == set()
        assert tier.read_log() == []
        _good_client_works(daemon)
        assert tier.put(bid, data) is True  # the same namespace works normally
    finally:
        tier.close()


def _frame_bytes(fields: dict[str, Any], data: bytes) -> list[bytes]:
    parts: list[bytes] = []

    class _Capture:
        def sendmsg(self, bufs: list[memoryview]) -> int:
            parts.extend(bytes(b) for b in bufs)
            return sum(len(b) for b in bufs)

    send_frame(_Capture(), fields, data)  # type: ignore[arg-type]
    return parts


def test_stalled_handshake_does_not_block_others(daemon: Daemon) -> None:
    idle, _ = _raw_connect(daemon)  # connected, never says hello
    try:
        _good_client_works(daemon)
    finally:
        idle.close()


# --- memory limit, namespaces, status ------------------------------------------------


def test_memory_limit_is_tier_full(tmp_path: Path) -> None:
    with run_daemon(tmp_path, memory_limit="1MiB") as d:
        tier = d.tier("limited")
        a, data_a = blob(600_000, seed=1)
        b, data_b = blob(600_000, seed=2)
        assert tier.put(a, data_a) is True
        with pytest.raises(TierFull) as info:
            tier.put(b, data_b)
        assert b in str(info.value) and tier.url in str(info.value)
        assert tier.has([a, b]) == {a}  # the refused put left nothing behind
        with pytest.raises(TierFull):
            tier.append(b"r" * 500_000)
        assert tier.read_log() == []
        with pytest.raises(TierFull):
            tier.put_many([blob(100_000, seed=s) for s in range(10, 16)])
        assert tier.delete([a]) == 1
        assert tier.put(b, data_b) is True  # space came back
        stats = peer_status(d.address, token_file=str(d.token_file))
        assert stats["memory_limit"] == 1 << 20
        assert stats["memory_used"] <= 1 << 20
        tier.close()


def test_namespaces_are_isolated(daemon: Daemon) -> None:
    one, two = daemon.tier(), daemon.tier()
    try:
        bid = "ab" * 32
        one.put(bid, b"rank 0 copy")
        two.put(bid, b"rank 1 copy, longer")
        one.append(b"r0")
        assert bytes(one.get(bid)) == b"rank 0 copy"
        assert bytes(two.get(bid)) == b"rank 1 copy, longer"
        assert two.read_log() == []
        assert one.delete([bid]) == 1
        assert two.has([bid]) == {bid}
        stats = two.stats()
        mine = stats["namespaces"][two.namespace]
        assert mine == {
            "blobs": 1,
            "bytes": len(b"rank 1 copy, longer"),
            "records": 0,
            "log_bytes": 0,
            "budget": None,
            "quota": None,
            "charged": mine["charged"],
        }
        assert mine["charged"] > mine["bytes"]  # the payload and the blob's overhead
        assert stats["namespaces"][one.namespace]["records"] == 1
    finally:
        one.close()
        two.close()


def test_peer_status(daemon: Daemon) -> None:
    tier = daemon.tier()
    try:
        bid, data = blob(1234, seed=9)
        tier.put(bid, data)
        status = peer_status(daemon.address, token=TOKEN)
        assert status["server"] == "tiercheck-peer"
        assert status["auth"] is True
        assert status["max_frame"] == 16 << 20
        assert status["memory_limit"] == 512 << 20
        assert status["namespaces"][tier.namespace]["bytes"] == 1234
        assert status["blobs"] >= 1
    finally:
        tier.close()


def test_status_command(daemon: Daemon) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tiercheck.peer.daemon",
            "status",
            daemon.address,
            "--token-file",
            str(daemon.token_file),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=True,
    )
    assert '"server": "tiercheck-peer"' in out.stdout


def test_many_clients_append_concurrently(daemon: Daemon) -> None:
    namespace = uuid.uuid4().hex
    clients, rounds = 6, 20
    tiers = [daemon.tier(namespace) for _ in range(clients)]
    errors: list[BaseException] = []
    start = threading.Barrier(clients)

    def work(c: int) -> None:
        try:
            start.wait()
            for r in range(rounds):
                tiers[c].append(f"{c}:{r}:".encode() + bytes([c]) * (r * 1000))
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    log = tiers[0].read_log()
    assert len(log) == clients * rounds
    last = dict.fromkeys(range(clients), -1)
    for record in log:
        c_s, r_s, pad = record.split(b":", 2)
        c, r = int(c_s), int(r_s)
        assert pad == bytes([c]) * (r * 1000)
        assert last[c] == r - 1
        last[c] = r
    for t in tiers:
        t.close()


# --- failures of the daemon ----------------------------------------------------------


def test_killed_daemon_is_unavailable(tmp_path: Path) -> None:
    with run_daemon(tmp_path) as d:
        tier = d.tier(timeout=5.0)
        bid, data = blob(1000, seed=3)
        tier.put(bid, data)
        d.proc.kill()
        d.proc.wait(timeout=TIMEOUT)
        # First the pooled connection fails, then reconnecting is refused: both retryable.
        for _ in range(2):
            with pytest.raises(TierUnavailable) as info:
                tier.get(bid)
            assert tier.url in str(info.value)
        with pytest.raises(TierUnavailable):
            tier.put(*blob(10, seed=4))
        tier.close()


def test_daemon_restart_is_picked_up_lazily(tmp_path: Path) -> None:
    holder = socket.socket()
    holder.bind((LOOPBACK, 0))  # bound, not listening: connections are refused
    port = holder.getsockname()[1]
    tier = open_tier(f"peer://{LOOPBACK}:{port}/ns", token=TOKEN, timeout=TIMEOUT)
    with pytest.raises(TierUnavailable, match=str(port)):
        tier.ping()
    holder.close()
    with PeerServer(f"{LOOPBACK}:{port}", memory_limit=1 << 20, token=TOKEN):
        tier.ping()  # the same tier object reconnects
        assert tier.put(*blob(10, seed=1)) is True
    with pytest.raises(TierUnavailable):
        tier.ping()  # the server stopped: its connections were closed
    tier.close()


def test_silent_server_times_out() -> None:
    listener = socket.socket()
    listener.bind((LOOPBACK, 0))
    listener.listen(1)  # the kernel completes the connect; nobody ever answers
    try:
        port = listener.getsockname()[1]
        tier = open_tier(f"peer://{LOOPBACK}:{port}", token=TOKEN, timeout=0.2)
        with pytest.raises(TierUnavailable, match="timed out"):
            tier.ping()
        tier.close()
    finally:
        listener.close()


def test_daemon_requires_token_or_explicit_insecure(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TIERCHECK_PEER_TOKEN"}
    cmd = [sys.executable, "-m", "tiercheck.peer.daemon", "--listen", f"{LOOPBACK}:0"]
    out = subprocess.run(
        [*cmd, "--memory-limit", "1MiB"], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 2
    assert "--insecure-no-auth" in out.stderr and "TIERCHECK_PEER_TOKEN" in out.stderr


def test_insecure_daemon_and_env_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with PeerServer(f"{LOOPBACK}:0", memory_limit=1 << 20, token=None) as s:
        tier = open_tier(f"peer://{LOOPBACK}:{s.port}", timeout=TIMEOUT)
        assert tier.put(*blob(5, seed=1)) is True
        tier.close()
    monkeypatch.setenv("TIERCHECK_PEER_TOKEN", "from-env")
    with PeerServer(f"{LOOPBACK}:0", memory_limit=1 << 20, token=b"from-env") as s:
        tier = open_tier(f"peer://{LOOPBACK}:{s.port}", timeout=TIMEOUT)
        tier.ping()
        tier.close()


def test_blob_over_frame_limit_is_not_supported() -> None:
    with PeerServer(f"{LOOPBACK}:0", memory_limit=1 << 30, token=TOKEN, max_frame=1 << 20) as s:
        tier = open_tier(f"peer://{LOOPBACK}:{s.port}", token=TOKEN, timeout=TIMEOUT)
        bid, data = blob(2 << 20, seed=1)
        with pytest.raises(NotSupported, match="--max-frame"):
            tier.put(bid, data)
        # Batches and id lists are sized to the daemon's frame limit.
        items = [blob(200_000, seed=s) for s in range(12)]
        assert tier.put_many(items) == 12
        ids = [f"{i:064x}" for i in range(30_000)]
        assert tier.has(ids) == set()
        assert tier.delete(ids) == 0
        tier.close()


def test_list_and_read_log_page(server: PeerServer) -> None:
    tier = open_tier(f"peer://{LOOPBACK}:{server.port}/{uuid.uuid4().hex}", token=TOKEN)
    ids = {f"{i:064x}" for i in range(1500)}
    assert tier.put_many((i, b"x") for i in ids) == 1500
    assert set(tier.list()) == ids
    records = [bytes([i % 256]) * 100_000 for i in range(700)]  # 70 MB: several pages
    for r in records:
        tier.append(r)
    assert tier.read_log() == records
    tier.close()


# --- URLs, options, sizes, frames ----------------------------------------------------


@pytest.mark.parametrize(
    "url",
    ["peer://", "peer://host", "peer://:7000", "peer://h:notaport", "peer://h:7000/ns?x=1"],
)
def test_invalid_urls(url: str) -> None:
    with pytest.raises(InvalidURL):
        open_tier(url, token=TOKEN)


def test_namespace_from_url_or_option() -> None:
    assert PeerTier("peer://127.0.0.1:1/rank3", token=TOKEN).namespace == "rank3"
    assert PeerTier("peer://127.0.0.1:1", token=TOKEN, namespace="r").namespace == "r"
    assert PeerTier("peer://127.0.0.1:1", token=TOKEN).namespace == "default"
    with pytest.raises(InvalidURL):
        PeerTier("peer://127.0.0.1:1/a", token=TOKEN, namespace="b")
    with pytest.raises(ConfigError):
        PeerTier("peer://127.0.0.1:1", token=TOKEN, token_file="/nonexistent")


def test_not_found_names_id(server: PeerServer) -> None:
    tier = open_tier(f"peer://{LOOPBACK}:{server.port}/{uuid.uuid4().hex}", token=TOKEN)
    with pytest.raises(NotFound, match="f" * 64):
        tier.get("f" * 64)
    tier.close()


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("512MiB", 512 << 20),
        ("2GiB", 2 << 30),
        ("1G", 1 << 30),
        ("1g", 1 << 30),
        ("1GB", 10**9),
        ("64KiB", 64 << 10),
        ("1.5M", 3 << 19),
    ],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "MiB", "12 apples", "-1", "1Qi"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_frame_data_in_any_key_order() -> None:
    fields, data = decode_body(bytearray(msgpack.packb({"op": "put", "data": b"abc", "x": 1})))
    assert fields == {"op": "put", "x": 1}
    assert data is not None and bytes(data) == b"abc"
    body = b"".join(_frame_bytes({"op": "put"}, b"xyz"))[4:]
    fields, data = decode_body(bytearray(body))
    assert fields == {"op": "put"} and data is not None and bytes(data) == b"xyz"
    assert msgpack.unpackb(body) == {"op": "put", "data": b"xyz"}  # plain msgpack on the wire


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_decode_garbage_raises_protocol_error_only(body: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        fields, data = decode_body(bytearray(body))
        assert isinstance(fields, dict)
        assert data is None or isinstance(data, memoryview)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=50))
def test_decode_garbage_after_data_prefix(tail: bytes) -> None:
    body = b"\x82\xa4data\xc6" + len(tail).to_bytes(4, "big") + tail
    with contextlib.suppress(ProtocolError):
        decode_body(bytearray(body + tail))


# --- recycled receive buffers --------------------------------------------------------


def test_deleted_blob_buffers_are_recycled(server: PeerServer) -> None:
    tier = open_tier(f"peer://{LOOPBACK}:{server.port}/{uuid.uuid4().hex}", token=TOKEN)
    assert isinstance(tier, PeerTier)
    before = tier.stats()["recycled_buffer_bytes"]
    old = [blob((2 << 20) + 5, seed=s) for s in range(3)]
    for bid, data in old:
        tier.put(bid, data)
    tier.delete(bid for bid, _ in old)
    freed = tier.stats()["recycled_buffer_bytes"]
    assert freed > before  # the three frame buffers went back to the pool
    new = [blob((2 << 20) + 5, seed=s) for s in range(10, 13)]
    for bid, data in new:
        tier.put(bid, data)
    assert tier.stats()["recycled_buffer_bytes"] <= before  # and were taken again
    for bid, data in new:
        assert bytes(tier.get(bid)) == data
    tier.close()


def test_pinned_buffer_is_not_recycled_until_sent() -> None:
    from tiercheck.peer.memory import BufferPool, MemoryStore

    pool = BufferPool(1 << 30)
    store = MemoryStore(1 << 30, pool)
    body = pool.take((1 << 20) + 100)
    body[:3] = b"abc"
    bid = "a" * 64
    assert store.put("ns", bid, memoryview(body)[:3], False, body)
    pinned = store.checkout("ns", bid)  # a get reply is being sent from this buffer
    assert pinned is not None
    assert store.delete("ns", [bid]) == 1
    assert pool.bytes == 0  # not reusable while the reply is in flight
    assert bytes(pinned.data) == b"abc"
    store.checkin(pinned)
    assert pool.bytes == len(body)
    assert pool.take((1 << 20) + 100) is body


# --- dead clients, keepalive, namespace tokens, budgets ------------------------------

SILENT_CLIENT = r"""
import sys
from tiercheck.backends._peer_protocol import PeerConnection

host, port, token = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()
conn = PeerConnection(host, port, namespace="dead", token=token, timeout=20, keepalive=None)
print("connected", flush=True)
sys.stdin.read()  # holds its connection open and silent, like a hung or cut-off node
"""


def _free_slot_within(daemon: Daemon, deadline: float) -> float:
    """Poll (bounded) until a new client gets a connection; the seconds it took."""
    import time

    start = time.monotonic()
    while True:
        tier = daemon.tier()
        try:
            tier.ping()
            return time.monotonic() - start
        except TierUnavailable:
            if time.monotonic() - start > deadline:
                raise
            time.sleep(0.05)
        finally:
            tier.close()


def test_idle_timeout_frees_a_dead_clients_slot(tmp_path: Path) -> None:
    """A client process that holds its connection open and silent (a hung or cut-off node:
    no FIN ever comes) loses it after the idle timeout, and its slot serves another."""
    idle_timeout = 1.0
    with run_daemon(tmp_path, "--max-connections", "1", "--idle-timeout", str(idle_timeout)) as d:
        client = subprocess.Popen(
            [sys.executable, "-c", SILENT_CLIENT, LOOPBACK, str(d.port), TOKEN.decode()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert client.stdout is not None and client.stdout.readline() == "connected\n"
            busy = d.tier()
            with pytest.raises(TierUnavailable, match="busy"):
                busy.ping()  # the one slot is taken by the silent client
            busy.close()
            took = _free_slot_within(d, deadline=idle_timeout + 15)
        finally:
            client.kill()
            client.wait()
            assert client.stdin is not None and client.stdout is not None
            client.stdin.close()
            client.stdout.close()
        assert "idle for 1.0 s; closing the connection" in d.log()
    print(f"slot freed {took:.2f} s after the busy answer (idle timeout {idle_timeout} s)")


def test_sigkilled_client_frees_its_slot(tmp_path: Path) -> None:
    with run_daemon(tmp_path, "--max-connections", "1") as d:
        client = subprocess.Popen(
            [sys.executable, "-c", SILENT_CLIENT, LOOPBACK, str(d.port), TOKEN.decode()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert client.stdout is not None and client.stdout.readline() == "connected\n"
        client.send_signal(signal.SIGKILL)  # the kernel closes its socket
        client.wait()
        assert client.stdin is not None
        client.stdin.close()
        client.stdout.close()
        _free_slot_within(d, deadline=15)


def test_connections_use_tcp_keepalive(server: PeerServer) -> None:
    tier = open_tier(f"peer://{server.address}/ka", token=TOKEN, keepalive=30)
    assert isinstance(tier, PeerTier)
    try:
        tier.ping()
        conn = tier._idle[0]
        assert conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if hasattr(socket, "TCP_KEEPIDLE"):
            assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 30
        with server._lock:
            served = [sock for sock, _ in server._conns.values()]
        assert served and all(
            s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1 for s in served
        )
    finally:
        tier.close()


def test_a_connection_the_daemon_closed_for_idling_is_not_reused() -> None:
    import time

    with PeerServer(f"{LOOPBACK}:0", memory_limit=1 << 20, token=TOKEN, idle_timeout=0.3) as s:
        tier = open_tier(f"peer://{s.address}/idle", token=TOKEN, timeout=TIMEOUT)
        try:
            tier.append(b"one")
            deadline = time.monotonic() + 15
            while s.idle_closed < 1:  # bounded poll: the daemon closes the pooled connection
                assert time.monotonic() < deadline, "the daemon never closed the idle connection"
                time.sleep(0.05)
            tier.append(b"two")  # a fresh connection, not an error
            assert tier.read_log() == [b"one", b"two"]
        finally:
            tier.close()


def test_namespace_tokens_open_their_own_namespace_only(tmp_path: Path) -> None:
    from tiercheck.cli.main import main as cli_main

    with run_daemon(tmp_path) as d:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "tiercheck",
                "peer",
                "token",
                "rank0",
                "--token-file",
                str(d.token_file),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert out and out.encode() != TOKEN
        assert cli_main(["peer", "token", "rank0", "--token-file", str(d.token_file)]) == 0
        own = d.tier("rank0", token=out)
        admin = d.tier("rank1")
        other = d.tier("rank1", token=out)
        try:
            bid, data = blob(1000, seed=3)
            own.put(bid, data)
            own.append(b"mine")
            admin.put(bid, b"rank 1's")
            with pytest.raises(TierError, match="AuthFailed"):
                other.get(bid)  # rank 0's token cannot read rank 1's namespace
            with pytest.raises(TierError, match="AuthFailed"):
                other.delete([bid])
            assert bytes(admin.get(bid)) == b"rank 1's"
            assert sorted(own.stats()["namespaces"]) == ["rank0"]  # sees only its own
            assert {"rank0", "rank1"} <= set(admin.stats()["namespaces"])
        finally:
            for t in (own, admin, other):
                t.close()


def test_namespace_budget_is_over_budget(server: PeerServer) -> None:
    tier = open_tier(f"peer://{server.address}/budgeted", token=TOKEN, budget="1MiB")
    try:
        a, data_a = blob(700_000, seed=1)
        assert tier.put(a, data_a)
        assert tier.usage() == 700_000
        with pytest.raises(OverBudget) as info:
            tier.put(*blob(700_000, seed=2))
        assert info.value.budget == 1 << 20 and info.value.held >= 700_000
        assert tier.usage() == 700_000
        assert tier.stats()["namespaces"]["budgeted"]["budget"] == 1 << 20
    finally:
        tier.close()


def test_daemon_memory_limit_is_over_budget(tmp_path: Path) -> None:
    with PeerServer(f"{LOOPBACK}:0", memory_limit=1 << 20, token=TOKEN) as s:
        tier = open_tier(f"peer://{s.address}/full", token=TOKEN)
        try:
            tier.put(*blob(700_000, seed=1))
            with pytest.raises(OverBudget, match="memory-limit"):
                tier.put(*blob(700_000, seed=2))
        finally:
            tier.close()


def test_set_budget_at_run_time(server: PeerServer) -> None:
    tier = open_tier(f"peer://{server.address}/late-budget", token=TOKEN)
    try:
        tier.put(*blob(700_000, seed=1))
        tier.set_budget("1MiB")
        with pytest.raises(OverBudget):
            tier.put(*blob(700_000, seed=2))
        tier.set_budget(None)
        assert tier.put(*blob(700_000, seed=2))
    finally:
        tier.close()
