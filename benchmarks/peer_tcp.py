"""peer:// put throughput on loopback against the physical limit of a plain socket.

    python benchmarks/peer_tcp.py [--blobs 64] [--runs 3] [--out benchmarks/results/peer_tcp.json]

One client thread, 64 random 4 MiB blobs, median of 3 runs (each preceded by nothing: the
first run pays the daemon's first-touch allocation too). Rates are GB/s (10^9 bytes per
second) of blob bytes:

- ``peer_put``: ``PeerTier.put`` of every blob to a ``python -m tiercheck.peer.daemon``
  subprocess (token auth on), one request/response per blob; the blobs are deleted
  between runs;
- ``peer_get``: every blob back with ``get(id, out=buffer)`` into one preallocated buffer;
- ``plain_stream``: the same bytes with ``sendall`` to a plain Python receiver subprocess
  that ``recv_into``s one reused 4 MiB buffer and acknowledges once per run: no framing,
  no allocation, no round trips. The physical limit of loopback TCP between two Python
  processes on this machine;
- ``plain_fresh``: as ``plain_stream``, but the receiver allocates a new 4 MiB buffer per
  blob, as a store must: the limit for a receiver that keeps what it receives.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import blake3

from tiercheck.backends._peer import PeerTier
from tiercheck.backends.registry import open_tier

BLOB = 4 << 20
TOKEN = b"benchmark-token"

_RECEIVER = r"""
import socket, sys
fresh = sys.argv[1] == "fresh"
size, count, runs = (int(a) for a in sys.argv[2:5])
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(1)
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
buf = memoryview(bytearray(size))
for _ in range(runs):
    for _ in range(count):
        if fresh:
            buf = memoryview(bytearray(size))
        done = 0
        while done < size:
            n = conn.recv_into(buf[done:])
            if n == 0:
                sys.exit(1)
            done += n
    conn.sendall(b"k")
"""


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def bench_plain(blobs: list[tuple[str, bytes]], runs: int, mode: str) -> list[float]:
    import socket

    proc = subprocess.Popen(
        [sys.executable, "-c", _RECEIVER, mode, str(BLOB), str(len(blobs)), str(runs)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        total = sum(len(d) for _, d in blobs)
        rates = []
        for _ in range(runs):
            start = time.perf_counter()
            for _, data in blobs:
                sock.sendall(data)
            assert sock.recv(1) == b"k"
            rates.append(_rate(total, time.perf_counter() - start))
        sock.close()
        proc.wait(timeout=60)
        return rates
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def bench_peer(blobs: list[tuple[str, bytes]], runs: int) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        token_file = Path(tmp) / "token"
        token_file.write_bytes(TOKEN)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tiercheck.peer.daemon",
                "--listen",
                "127.0.0.1:0",
                "--memory-limit",
                "2GiB",
                "--token-file",
                str(token_file),
                "--log-level",
                "WARNING",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line.startswith("listening on "):
                raise RuntimeError(f"daemon did not start: {line!r}")
            address = line.removeprefix("listening on ").strip()
            tier = open_tier(f"peer://{address}/bench-{uuid.uuid4().hex[:8]}", token=TOKEN)
            assert isinstance(tier, PeerTier)
            tier.ping()  # connect and authenticate outside the timed part
            total = sum(len(d) for _, d in blobs)
            out = memoryview(bytearray(BLOB))
            rates: dict[str, list[float]] = {"peer_put": [], "peer_get": []}
            for _ in range(runs):
                start = time.perf_counter()
                for bid, data in blobs:
                    tier.put(bid, data)
                rates["peer_put"].append(_rate(total, time.perf_counter() - start))
                start = time.perf_counter()
                for bid, _ in blobs:
                    tier.get(bid, out=out)
                rates["peer_get"].append(_rate(total, time.perf_counter() - start))
                bid, data = blobs[-1]
                assert bytes(tier.get(bid)) == data
                assert tier.delete(b for b, _ in blobs) == len(blobs)
            tier.close()
            return rates
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blobs", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/peer_tcp.json")
    args = parser.parse_args()

    blobs = []
    for _ in range(args.blobs):
        data = os.urandom(BLOB)
        blobs.append((blake3.blake3(data).hexdigest(), data))

    runs: dict[str, list[float]] = bench_peer(blobs, args.runs)
    runs["plain_stream"] = bench_plain(blobs, args.runs, "reuse")
    runs["plain_fresh"] = bench_plain(blobs, args.runs, "fresh")
    medians = {name: round(statistics.median(v), 3) for name, v in runs.items()}
    print(f"{args.blobs} x 4 MiB blobs over loopback TCP, median of {args.runs} runs, GB/s")
    for name, value in medians.items():
        print(f"  {name:14} {value:6.2f}   runs {[round(x, 2) for x in runs[name]]}")
    ratio = medians["peer_put"] / medians["plain_stream"]
    print(f"  peer_put / plain_stream = {ratio:.2f}")
    report: dict[str, Any] = {
        "benchmark": "peer_tcp",
        "blob_bytes": BLOB,
        "blobs": args.blobs,
        "runs": args.runs,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        **{f"{name}_gbps": value for name, value in medians.items()},
        "peer_put_vs_plain_stream": round(ratio, 3),
        "peer_put_vs_plain_fresh": round(medians["peer_put"] / medians["plain_fresh"], 3),
        "all_runs_gbps": {name: [round(x, 3) for x in v] for name, v in runs.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
