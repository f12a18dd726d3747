"""The peer daemon under hostile clients: unauthenticated connections capped apart (and per
address) from authenticated ones, the memory limit charging per-object overhead and
frames in flight, empty objects refused, per-namespace quotas and stats; and a small run
of the load test (benchmarks/peer_abuse.py) against a real ``tiercheck.peer.daemon``
process on loopback: slow-loris hellos, trickled frames, zero-byte blobs and big partial
frames are all cut or refused while a good client keeps working, and the daemon's RSS
stays within its memory limit plus the documented overhead."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tiercheck.backends._peer import PeerTier
from tiercheck.backends._peer_protocol import _encode_parts, read_frame
from tiercheck.errors import NotSupported, TierFull
from tiercheck.peer.memory import OBJECT_OVERHEAD
from tiercheck.peer.server import PeerServer, namespace_token

TOKEN = b"hostile-test-token"
REPO = Path(__file__).resolve().parents[1]


def _frame(fields: dict[str, Any], data: bytes | None = None) -> bytes:
    return b"".join(bytes(p) for p in _encode_parts(fields, data))


@contextlib.contextmanager
def _server(**options: Any) -> Iterator[PeerServer]:
    options.setdefault("memory_limit", 1 << 26)
    with PeerServer("127.0.0.1:0", token=TOKEN, **options) as server:
        yield server


def _tier(server: PeerServer, ns: str = "", token: bytes = TOKEN) -> PeerTier:
    ns = ns or uuid.uuid4().hex
    return PeerTier(f"peer://127.0.0.1:{server.port}/{ns}", token=token, timeout=20.0)


def _raw(server: PeerServer, source: str = "127.0.0.2") -> socket.socket:
    """A connection from ``source`` that will never say hello; its first frame read."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.settimeout(20.0)
    sock.connect(("127.0.0.1", server.port))
    return sock


def test_unauthenticated_clients_never_take_an_authenticated_slot() -> None:
    """One authenticated slot, and more connections than that sitting in their handshake:
    the good client still connects (they are counted apart)."""
    with _server(max_connections=1, max_unauthenticated=4) as server:
        idle = [_raw(server) for _ in range(3)]
        try:
            for sock in idle:  # each is being served: it got its challenge
                assert read_frame(sock, 1 << 16)[0]["op"] == "challenge"
            tier = _tier(server)
            try:
                tier.put("ab" * 32, b"good")
                assert bytes(tier.get("ab" * 32)) == b"good"
                assert server.stats()["unauthenticated"] == 3
            finally:
                tier.close()
        finally:
            for sock in idle:
                sock.close()


def test_unauthenticated_connections_are_capped_per_address() -> None:
    with _server(max_unauthenticated_per_address=2, max_unauthenticated=10) as server:
        first = [_raw(server) for _ in range(2)]
        third = _raw(server)
        try:
            for sock in first:
                assert read_frame(sock, 1 << 16)[0]["op"] == "challenge"
            refused = read_frame(third, 1 << 16)[0]
            assert refused["ok"] is False and refused["error"] == "Busy"
            assert third.recv(1) == b""  # and closed
            # another address is not held back by that one
            other = _raw(server, source="127.0.0.3")
            try:
                assert read_frame(other, 1 << 16)[0]["op"] == "challenge"
            finally:
                other.close()
            assert server.stats()["refused_unauthenticated"] == 1
        finally:
            for sock in [*first, third]:
                sock.close()


def test_empty_blobs_and_records_are_refused() -> None:
    with _server() as server:
        tier = _tier(server)
        try:
            with pytest.raises(NotSupported):
                tier.put("cd" * 32, b"")
            with pytest.raises(NotSupported):
                tier.append(b"")
            # the daemon refuses them too, from a client that does not check
            conn = tier._connect()
            try:
                for fields, data in (
                    ({"op": "put", "id": "cd" * 32}, b""),
                    ({"op": "put_many", "ids": ["cd" * 32], "sizes": [0]}, b""),
                    ({"op": "append"}, b""),
                ):
                    conn.sock.sendall(_frame(fields, data))
                    reply = read_frame(conn.sock, 1 << 16)[0]
                    assert reply["ok"] is False and reply["error"] == "BadRequest", reply
            finally:
                conn.close()
            stats = server.stats()
            assert stats["blobs"] == 0 and stats["memory_used"] == 0
        finally:
            tier.close()


def test_the_memory_limit_charges_each_objects_overhead() -> None:
    """Blobs of one byte fill the limit by their overhead, not by their one byte."""
    limit = 64 * 1024
    with _server(memory_limit=limit) as server:
        tier = _tier(server)
        stored = 0
        try:
            with pytest.raises(TierFull):
                for i in range(limit):
                    tier.put(f"{i:064x}", b"x")
                    stored += 1
            assert stored <= limit // OBJECT_OVERHEAD
            stats = server.stats()
            assert stats["memory_used"] <= limit
            assert stats["namespaces"][tier.namespace]["charged"] == stats["memory_used"]
        finally:
            tier.close()


def test_namespace_quota_and_a_namespace_tokens_stats() -> None:
    with _server(namespace_quota=256 * 1024) as server:
        admin, mine = _tier(server, "other"), None
        try:
            admin.put("ee" * 32, b"y" * 100_000)
            mine = _tier(server, "mine", token=namespace_token(TOKEN, "mine"))
            mine.put("ef" * 32, b"z" * 100_000)
            with pytest.raises(TierFull, match="namespace quota"):
                for i in range(3):
                    mine.put(f"{i:064x}", b"z" * 100_000)
            admin.put("ff" * 32, b"y" * 100_000)  # another namespace has its own quota
            view = mine.stats()
            assert set(view["namespaces"]) == {"mine"}
            assert view["bytes"] == view["namespaces"]["mine"]["bytes"] < 300_000
            assert view["memory_used"] == view["namespaces"]["mine"]["charged"]
            assert "connections" not in view and "recycled_buffer_bytes" not in view
        finally:
            admin.close()
            if mine is not None:
                mine.close()


@pytest.mark.slow
def test_load_on_loopback(tmp_path: Path) -> None:
    """A small run of benchmarks/peer_abuse.py: 12 hostile connections of each kind."""
    out = tmp_path / "abuse.json"
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "peer_abuse.py"),
        "--connections",
        "12",
        "--memory-limit",
        "16MiB",
        "--deadline",
        "1",
        "--limit",
        "120",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.exists(), proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["rss_within_bound"], result
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, phase in result["phases"].items():
        assert phase["good_client"]["errors"] == 0, (name, phase)
        assert phase["good_client"]["rounds"] > 0, (name, phase)
        if name != "zero_byte_blobs":  # those sit idle, within every limit
            assert phase["cut_by_daemon"] + phase["refused_at_once"] == 12, (name, phase)
