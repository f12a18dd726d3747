"""The peer daemon under abuse: hostile connections of each kind, on loopback, while a good
client's latency and the daemon's RSS are measured.

    python benchmarks/peer_abuse.py [--connections 1000] [--memory-limit 64MiB]
                                    [--out benchmarks/results/peer_abuse.json]

A real ``python -m tiercheck.peer.daemon`` subprocess on 127.0.0.1 (token auth on, short
deadlines: ``--handshake-timeout 2 --frame-timeout 2 --min-rate 64MiB``, and
``--namespace-quota`` a quarter of the memory limit). Each phase opens ``connections``
hostile connections from 127.0.0.2 (so the per-address cap on unauthenticated connections
meets them, not the good client on 127.0.0.1); the authenticated ones are one tenant's,
with its namespace token. Meanwhile the good client, connected before the phase, puts,
gets and deletes a 256 KiB blob in a loop. Phases:

- ``slowloris_hello``: connect and trickle a hello frame one byte every 0.2 s;
- ``trickled_frame``: authenticate (a namespace token) and trickle a put frame;
- ``zero_byte_blobs``: authenticate and send ``put_many`` of 1,000 empty blobs, then
  1,000 blobs of one byte and 200 log records of one byte, per connection;
- ``big_partial_frames``: authenticate and send the header of a frame of the daemon's
  largest size (64 MiB) and 1 MiB of its body, then stall.

Per phase: hostile connections accepted / refused / cut by the daemon, the good client's
operation latency (p50, p99, max; a put+get+delete) and its errors, the daemon's peak RSS
(``VmHWM``, reset before each phase) and the bound it must stay under:
``baseline + memory_limit * 9/8 + (max_connections + max_unauthenticated) * 128 KiB``
(docs/peer-protocol.md, "Memory"). The test suite runs a small version of it
(tests/test_hostile_peer.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiercheck.backends._peer import PeerTier
from tiercheck.backends._peer_protocol import PeerConnection, _encode_parts
from tiercheck.core.sizes import parse_size
from tiercheck.peer.daemon import peer_status
from tiercheck.peer.server import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_UNAUTHENTICATED,
    namespace_token,
)

TOKEN = b"peer-abuse-benchmark-token"
GOOD = "127.0.0.1"
HOSTILE = "127.0.0.2"
BIG_FRAME = 64 << 20
PER_CONNECTION_OVERHEAD = 128 << 10
# the daemon's counters reported per phase (differences)
_COUNTERS = ("deadline_closed", "refused_unauthenticated", "idle_closed")


def _frame(fields: dict[str, Any], data: bytes | None = None) -> bytes:
    return b"".join(bytes(p) for p in _encode_parts(fields, data))


@dataclass
class Daemon:
    """``python -m tiercheck.peer.daemon`` on 127.0.0.1, token auth on."""

    memory_limit: int
    args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[str] | None = None
    port: int = 0
    counters: dict[str, int] = field(default_factory=dict)

    @contextlib.contextmanager
    def running(self) -> Iterator[Daemon]:
        with tempfile.TemporaryDirectory(prefix="tiercheck-abuse-") as tmp:
            token_file = Path(tmp) / "token"
            token_file.write_bytes(TOKEN)
            token_file.chmod(0o600)
            cmd = [
                sys.executable,
                "-m",
                "tiercheck.peer.daemon",
                "--listen",
                f"{GOOD}:0",
                "--memory-limit",
                str(self.memory_limit),
                "--token-file",
                str(token_file),
                "--log-level",
                "CRITICAL",
                *self.args,
            ]
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            try:
                assert self.proc.stdout is not None
                line = self.proc.stdout.readline()
                if not line.startswith("listening on "):
                    raise RuntimeError(f"the daemon did not start: {line!r}")
                self.port = int(line.rsplit(":", 1)[1])
                yield self
            finally:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
                if self.proc.stdout is not None:
                    self.proc.stdout.close()

    def rss(self) -> tuple[int, int]:
        """(current, peak since the last reset) resident bytes of the daemon."""
        assert self.proc is not None
        fields = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
        return fields["VmRSS"], fields["VmHWM"]

    def reset_peak(self) -> bool:
        """Reset the daemon's peak RSS (``VmHWM``); False where the kernel does not let us."""
        assert self.proc is not None
        try:
            Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")
            return True
        except OSError:
            return False


class GoodClient:
    """Puts, gets and deletes one blob in a loop on its own thread, timing each round."""

    def __init__(self, port: int) -> None:
        self.tier = PeerTier(f"peer://{GOOD}:{port}/good", token=TOKEN, timeout=30.0)
        self.blob = os.urandom(256 << 10)
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.tier.put("aa" * 32, b"warm")  # connected before any hostile phase

    def _loop(self) -> None:
        bid = "bb" * 32
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                self.tier.put(bid, self.blob, overwrite=True)
                assert bytes(self.tier.get(bid)) == self.blob
                self.tier.delete([bid])
            except Exception as exc:  # recorded: a refused good client is the finding
                self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                self._stop.wait(0.05)
                continue
            self.latencies.append(time.perf_counter() - t0)

    def __enter__(self) -> GoodClient:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(60)

    def close(self) -> None:
        self.tier.close()

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)

        def q(p: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1e3, 3) if lat else None

        return {
            "rounds": len(lat),
            "p50_ms": q(0.5),
            "p99_ms": q(0.99),
            "max_ms": round(lat[-1] * 1e3, 3) if lat else None,
            "median_ms": round(statistics.median(lat) * 1e3, 3) if lat else None,
            "errors": len(self.errors),
            "first_error": self.errors[0] if self.errors else None,
        }


def _connect(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((HOSTILE, 0))
    sock.settimeout(10)
    sock.connect((GOOD, port))
    return sock


def _authenticated(port: int) -> socket.socket | None:
    """A connection that passed its hello with the hostile tenant's namespace token (None
    if refused): one tenant, one namespace, as a namespace token allows."""
    ns = "tenant"
    sock = _connect(port)
    try:
        # PeerConnection's own handshake over a socket bound to the hostile address
        conn = PeerConnection.__new__(PeerConnection)
        conn.sock = sock
        conn.max_frame = 64 << 10
        conn.server_info = conn._handshake(ns, namespace_token(TOKEN, ns), None)
        return sock
    except Exception:  # refused (Busy): the caller counts it
        sock.close()
        return None


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the daemon closed ``sock`` (what it sent before, replies, is read away)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        while readable:
            if sock.recv(1 << 16) == b"":
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True
    return False


@dataclass
class Phase:
    """``connections`` hostile sockets opened by ``open_one`` (None: refused at once);
    each is then fed ``trickle`` bytes one at a time every ``interval`` s until the daemon
    closes it or ``limit_s`` passes."""

    name: str
    open_one: Callable[[int], socket.socket | None]
    trickle: Callable[[], bytes] | None = None
    interval: float = 0.2
    hold_s: float | None = None  # stop this long after the last one opened (None: limit_s)


def run_phase(
    daemon: Daemon, good: GoodClient, phase: Phase, connections: int, limit_s: float
) -> dict[str, Any]:
    daemon.reset_peak()
    base_rss, _ = daemon.rss()
    good.latencies.clear()
    good.errors.clear()
    socks: list[socket.socket] = []
    refused = 0
    peak = base_rss
    t0 = time.monotonic()
    with good:
        for _ in range(connections):
            try:
                sock = phase.open_one(daemon.port)
            except OSError:
                sock = None
            if sock is None:
                refused += 1
            else:
                sock.setblocking(False)  # polled below: a timeout would make recv wait
                socks.append(sock)
            peak = max(peak, daemon.rss()[1])
        pending = {s: phase.trickle() for s in socks} if phase.trickle else {}
        live = list(socks)
        cut = 0
        opened = time.monotonic()
        while live and time.monotonic() - t0 < limit_s:
            if phase.hold_s is not None and time.monotonic() - opened > phase.hold_s:
                break
            still = []
            for s in live:
                if _closed_by_peer(s):
                    cut += 1
                    continue
                data = pending.get(s)
                if data:
                    try:
                        s.send(data[:1])
                        pending[s] = data[1:]
                    except OSError:
                        pass
                still.append(s)
            live = still
            peak = max(peak, daemon.rss()[1])
            time.sleep(phase.interval)  # the trickle's own pace: a hostile client, timed
    for s in socks:
        s.close()
    _, hwm = daemon.rss()
    stats = peer_status(f"{GOOD}:{daemon.port}", token=TOKEN)
    counters = {k: stats[k] - daemon.counters.get(k, 0) for k in _COUNTERS}
    daemon.counters = {k: stats[k] for k in _COUNTERS}
    return {
        "daemon": {
            **counters,
            "memory_used": stats["memory_used"],
            "tenant_charged": stats["namespaces"].get("tenant", {}).get("charged", 0),
        },
        "connections": connections,
        "refused_at_once": refused,
        "cut_by_daemon": cut,
        "still_open_at_end": len(live),
        "seconds": round(time.monotonic() - t0, 2),
        "rss_before": base_rss,
        "rss_peak": max(peak, hwm),
        "good_client": good.summary(),
    }


def _hello() -> bytes:
    return _frame({"op": "hello", "version": 1, "namespace": "x", "mac": b"\0" * 32})


def _zero_byte_sender(port: int) -> socket.socket | None:
    sock = _authenticated(port)
    if sock is None:
        return None
    ids = [uuid.uuid4().hex * 2 for _ in range(1000)]
    with contextlib.suppress(OSError):
        sock.settimeout(10)
        sock.sendall(_frame({"op": "put_many", "ids": ids, "sizes": [0] * 1000}, b""))
        sock.sendall(_frame({"op": "put_many", "ids": ids, "sizes": [1] * 1000}, b"x" * 1000))
        for _ in range(200):
            sock.sendall(_frame({"op": "append"}, b"r"))
        sock.sendall(_frame({"op": "append"}, b""))
    return sock


def _big_partial(port: int) -> socket.socket | None:
    sock = _authenticated(port)
    if sock is None:
        return None
    with contextlib.suppress(OSError):
        sock.settimeout(10)
        sock.sendall(BIG_FRAME.to_bytes(4, "big") + os.urandom(1 << 20))
    return sock


def phases() -> list[Phase]:
    def slowloris(port: int) -> socket.socket | None:
        sock = _connect(port)
        return sock

    return [
        Phase("slowloris_hello", slowloris, _hello),
        Phase(
            "trickled_frame",
            _authenticated,
            lambda: _frame({"op": "put", "id": "cd" * 32}, b"\0" * 4096),
        ),
        Phase("zero_byte_blobs", _zero_byte_sender, hold_s=1.0),
        Phase("big_partial_frames", _big_partial),
    ]


def run(
    connections: int = 1000,
    memory_limit: int = 64 << 20,
    *,
    deadline_s: float = 2.0,
    limit_s: float = 30.0,
    only: list[str] | None = None,
) -> dict[str, Any]:
    """Every phase against one daemon; the result as a JSON-able dict."""
    args = [
        "--handshake-timeout",
        str(deadline_s),
        "--frame-timeout",
        str(deadline_s),
        "--min-rate",  # a 64 MiB frame gets deadline_s + 1 s
        "64MiB",
        "--namespace-quota",  # the hostile tenant gets a quarter of the memory
        str(memory_limit // 4),
    ]
    out: dict[str, Any] = {
        "benchmark": "peer_abuse",
        "machine": platform.node(),
        "python": platform.python_version(),
        "connections": connections,
        "memory_limit": memory_limit,
        "deadline_s": deadline_s,
        "phases": {},
    }
    with Daemon(memory_limit, args).running() as daemon:
        out["rss_baseline"] = daemon.rss()[0]
        out["rss_bound"] = (
            out["rss_baseline"]
            + memory_limit * 9 // 8
            + (DEFAULT_MAX_CONNECTIONS + DEFAULT_MAX_UNAUTHENTICATED) * PER_CONNECTION_OVERHEAD
        )
        good = GoodClient(daemon.port)
        try:
            for phase in phases():
                if only and phase.name not in only:
                    continue
                out["phases"][phase.name] = run_phase(daemon, good, phase, connections, limit_s)
        finally:
            good.close()
    out["rss_within_bound"] = all(p["rss_peak"] <= out["rss_bound"] for p in out["phases"].values())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--memory-limit", type=parse_size, default=64 << 20)
    parser.add_argument("--deadline", type=float, default=2.0)
    parser.add_argument("--limit", type=float, default=30.0, help="seconds per phase at most")
    parser.add_argument("--only", action="append")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/peer_abuse.json"))
    args = parser.parse_args(argv)
    result = run(
        args.connections,
        args.memory_limit,
        deadline_s=args.deadline,
        limit_s=args.limit,
        only=args.only,
    )
    text = json.dumps(result, indent=2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    print(text)
    return 0 if result["rss_within_bound"] else 1


if __name__ == "__main__":
    sys.exit(main())
