"""Multi-rank saves under torchrun (gloo, CPU): peer-tier commit time for both transports
against plain loopback TCP, commit-protocol overhead, and shared-tier bytes with and
without cross-rank dedup.

    python benchmarks/cluster_bench.py [--configs 2:256,4:128] [--saves 3]
                                       [--out benchmarks/results/cluster.json]

``--configs`` lists ``RANKS:MIB`` (MiB of float32 per rank). For each configuration:

- ``peer``: every rank saves a warm-up version and then ``--saves`` timed versions to one
  synchronous peer tier (``TierPolicy(versions="all", mode="sync", codec="raw")``, every
  version a base, every byte changed between saves, 4 MiB chunks), so each save moves the
  whole shard. ``tcp``: a ``python -m tiercheck.peer.daemon`` daemon per rank (token auth
  on); rank ``r`` replicates to daemon ``r+1``. ``collective``: ``collective://`` with
  ``ranks_per_node=1``, so rank ``r``'s partner is rank ``r+1``. Per save, across ranks:
  ``committed`` is the handle timing ``committed:peer`` (seconds from the ``save()`` call
  to the peer tier's commit record) of the last rank to commit; ``prepared`` the slowest
  rank's ``prepared:peer`` (writing the chunks, the manifest and the prepare record);
  ``voting`` the handle timing ``voting`` (min over ranks: the vote of the last rank to
  arrive, the protocol's own cost; max: including the wait for the slowest rank);
  ``overhead`` is ``committed - hashed - prepared`` on each rank (the chunk-id exchange,
  the manifest, the vote and the commit record), min and max over ranks. Medians over
  the timed saves.
- ``plain``: the physical limit. As many sender/receiver process pairs as ranks, each
  pair moving the shard's bytes with ``sendall`` / ``recv_into`` (one preallocated
  buffer) over 127.0.0.1, all pairs at once; the time until the last receiver
  acknowledged. A warm-up round, then the median of ``--saves`` rounds.
- ``dedup``: a data-parallel replica (the same MIB on every rank) plus 1 MiB of each
  rank's own, ``--dedup-saves`` versions written synchronously (raw, every version) to a
  remote ``file://`` tier, once shared (``{"survives": "cluster", "shared": True}``: each
  unique chunk written by one rank) and once with a prefix per rank (no dedup). Bytes are
  the handles' ``bytes_written`` summed over ranks and versions, and the bytes on disk.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKER = HERE / "dist_scripts" / "cluster_bench_worker.py"
MIB = 1 << 20

_RECEIVER = r"""
import socket, sys
size, rounds = int(sys.argv[1]), int(sys.argv[2])
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(1)
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
buf = memoryview(bytearray(size))
for _ in range(rounds):
    done = 0
    while done < size:
        n = conn.recv_into(buf[done:])
        if n == 0:
            sys.exit(1)
        done += n
    conn.sendall(b"k")
"""

_SENDER = r"""
import os, socket, sys, time
port, size, rounds = (int(a) for a in sys.argv[1:4])
data = os.urandom(size)
sock = socket.create_connection(("127.0.0.1", port))
sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
print("ready", flush=True)
for _ in range(rounds):
    sys.stdin.readline()
    start = time.perf_counter()
    sock.sendall(data)
    assert sock.recv(1) == b"k"
    print(time.perf_counter() - start, flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def bench_plain(pairs: int, nbytes: int, rounds: int) -> list[float]:
    """Seconds per round for ``pairs`` concurrent transfers of ``nbytes`` each."""
    procs: list[subprocess.Popen[str]] = []
    try:
        senders = []
        for _ in range(pairs):
            recv = subprocess.Popen(
                [sys.executable, "-c", _RECEIVER, str(nbytes), str(rounds)],
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(recv)
            assert recv.stdout is not None
            port = int(recv.stdout.readline())
            send = subprocess.Popen(
                [sys.executable, "-c", _SENDER, str(port), str(nbytes), str(rounds)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(send)
            senders.append(send)
        for s in senders:
            assert s.stdout is not None and s.stdout.readline().strip() == "ready"
        out = []
        for _ in range(rounds):
            for s in senders:
                assert s.stdin is not None
                s.stdin.write("go\n")
                s.stdin.flush()
            times = []
            for s in senders:
                assert s.stdout is not None
                times.append(float(s.stdout.readline()))
            out.append(max(times))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def start_daemon(token: str, limit: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tiercheck.peer.daemon",
            "--listen",
            "127.0.0.1:0",
            "--memory-limit",
            limit,
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TIERCHECK_PEER_TOKEN": token},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("listening on"):
        proc.kill()
        raise RuntimeError(f"peer daemon did not start: {line!r}")
    return proc, int(line.rsplit(":", 1)[1])


def torchrun(ranks: int, root: Path, *args: str, env: dict[str, str] | None = None) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(ranks),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(WORKER),
        *args,
        "--root",
        str(root),
    ]
    # torchrun's agent leaves a torchelastic_* log directory in TMPDIR: put it (and any
    # worker's temporary files) under ``root``, which the caller removes
    tmp = root / "tmp"
    tmp.mkdir(exist_ok=True)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp), **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise RuntimeError(f"torchrun {' '.join(args)} failed with {proc.returncode}")


def results(root: Path, phase: str, ranks: int) -> list[Any]:
    return [json.loads((root / f"result-{phase}-{r}.json").read_text()) for r in range(ranks)]


def bench_peer(ranks: int, mib: int, saves: int, transport: str) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="tiercheck-cluster-bench-"))
    shm = Path(f"/dev/shm/tiercheck-bench-{uuid.uuid4().hex[:8]}")
    token = uuid.uuid4().hex
    daemons: list[tuple[subprocess.Popen[str], int]] = []
    try:
        args = ["peer", "--transport", transport, "--mib", str(mib), "--saves", str(saves)]
        args += ["--shm-root", str(shm)]
        if transport == "tcp":
            # one rank's versions: the newest, and the previous one until retention drops it
            # after the newest commits (gc_grace_seconds=0), plus room to spare
            daemons = [start_daemon(token, f"{3 * mib + 64}MiB") for _ in range(ranks)]
            args += ["--ports", ",".join(str(p) for _, p in daemons)]
        torchrun(ranks, root, *args, env={"TIERCHECK_PEER_TOKEN": token})
        per_rank = results(root, "peer", ranks)
    finally:
        for proc, _ in daemons:
            proc.kill()
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    timed = range(1, saves + 1)  # save 0 is the warm-up
    for saves_of_rank in per_rank:
        for s in saves_of_rank:
            assert s["tiers"]["peer"] == "committed", s
    rows = [[per_rank[r][i] for r in range(ranks)] for i in timed]

    def t(s: dict[str, Any], key: str) -> float:
        return float(s["timings"][key])

    def overhead(s: dict[str, Any]) -> float:
        return t(s, "committed:peer") - t(s, "hashed") - t(s, "prepared:peer")

    return {
        "committed_s": median([max(t(s, "committed:peer") for s in row) for row in rows]),
        "prepared_s": median([max(t(s, "prepared:peer") for s in row) for row in rows]),
        "hashed_s": median([max(t(s, "hashed") for s in row) for row in rows]),
        "voting_min_s": median([min(t(s, "voting") for s in row) for row in rows]),
        "voting_max_s": median([max(t(s, "voting") for s in row) for row in rows]),
        "overhead_min_s": median([min(overhead(s) for s in row) for row in rows]),
        "overhead_max_s": median([max(overhead(s) for s in row) for row in rows]),
        "bytes_per_rank": per_rank[0][-1]["bytes"]["peer"],
        "committed_runs_s": [round(max(t(s, "committed:peer") for s in row), 4) for row in rows],
    }


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def bench_dedup(ranks: int, mib: int, saves: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="tiercheck-cluster-bench-"))
    try:
        torchrun(ranks, root, "dedup", "--mib", str(mib), "--saves", str(saves))
        per_rank = results(root, "dedup", ranks)
        on_disk = {
            "shared": disk_bytes(root / "remote"),
            "per_rank": sum(disk_bytes(root / f"remote-{r}") for r in range(ranks)),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out: dict[str, Any] = {
        "versions": saves,
        "logical_bytes": sum(s["logical"] for r in per_rank for s in r["shared"]),
    }
    for mode in ("shared", "per_rank"):
        out[f"{mode}_bytes_written"] = sum(s["bytes"]["remote"] for r in per_rank for s in r[mode])
        out[f"{mode}_bytes_on_disk"] = on_disk[mode]
    out["ratio"] = round(out["per_rank_bytes_written"] / out["shared_bytes_written"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="2:256,4:128")
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--dedup-saves", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/cluster.json")
    args = parser.parse_args()
    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]

    report: dict[str, Any] = {
        "benchmark": "cluster",
        "saves": args.saves,
        "peer_policy": 'TierPolicy(versions="all", mode="sync", codec="raw"), base_every=1',
        "chunk_bytes": 4 * MIB,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "configs": [],
    }
    for ranks, mib in configs:
        started = time.perf_counter()
        plain = bench_plain(ranks, mib * MIB, args.saves + 1)[1:]
        entry: dict[str, Any] = {
            "ranks": ranks,
            "mib_per_rank": mib,
            "plain": {"seconds": median(plain), "runs_s": [round(x, 4) for x in plain]},
        }
        for transport in ("tcp", "collective"):
            entry[transport] = bench_peer(ranks, mib, args.saves, transport)
        entry["dedup"] = bench_dedup(ranks, mib, args.dedup_saves)
        entry["wall_s"] = round(time.perf_counter() - started, 1)
        report["configs"].append(entry)
        print_config(entry)

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


def print_config(e: dict[str, Any]) -> None:
    ranks, mib = e["ranks"], e["mib_per_rank"]
    total = ranks * mib * MIB
    print(f"\n{ranks} ranks x {mib} MiB (median of timed saves; seconds; GB/s of all ranks)")
    print(f"  {'':22}{'committed':>10}{'prepared':>10}{'voting':>14}{'overhead':>14}{'GB/s':>7}")
    p = e["plain"]["seconds"]
    print(f"  {'plain TCP (limit)':22}{p:10.3f}{'':10}{'':14}{'':14}{total / p / 1e9:7.2f}")
    for transport in ("tcp", "collective"):
        r = e[transport]
        name = "peer:// daemon" if transport == "tcp" else "collective://"
        voting = f"{r['voting_min_s']:.3f}-{r['voting_max_s']:.3f}"
        over = f"{r['overhead_min_s']:.3f}-{r['overhead_max_s']:.3f}"
        rate = total / r["committed_s"] / 1e9
        print(
            f"  {name:22}{r['committed_s']:10.3f}{r['prepared_s']:10.3f}"
            f"{voting:>14}{over:>14}{rate:7.2f}"
        )
    d = e["dedup"]
    print(
        f"  shared tier, {d['versions']} versions: dedup {d['shared_bytes_written'] / MIB:.1f} MiB"
        f", per-rank prefixes {d['per_rank_bytes_written'] / MIB:.1f} MiB ({d['ratio']}x)"
    )


if __name__ == "__main__":
    main()
