"""Packs against one object per blob on S3 (moto on loopback): objects per base, requests,
migration time and restore time, side by side (issue 25, item 3).

    python benchmarks/packs.py [--sizes 48,512] [--runs 3] [--out benchmarks/results/packs.json]

For each state size (MiB of random fp32, which zstd cannot shrink: the bytes moved are the
state's) and each layout (``loose``: ``pack_size=0``, one object per blob, the layout
before packs; ``packs``: the default 128 MiB packs), per run, on a fresh bucket:

- a store with a ``memory://`` tier and the S3 tier (bases migrate to it, zstd, as the
  default placement does for an object store) saves the state; ``migrate_s`` is the time
  from the save call to the migration's commit on S3 (``wait_migrated``; the local save
  into memory, the same for both layouts, is a small part of it);
- ``restore_s``: a restore from the S3 tier alone into the caller's tensors;
- ``migrate_cpu_s``, ``restore_cpu_s``: CPU seconds of this process (tiercheck and the S3
  client, every thread) over the same windows: what the layout costs the trainer's host,
  which the emulator's own costs do not blur; ``*_server_cpu_s``: the moto server's CPU
  seconds over those windows (what the emulator spent);
- ``objects``: objects the tier holds for the base (its marker, one per tier, excluded),
  ``requests``: HTTP requests by method that the moto server logged during the migration
  and during the restore (a PUT is a ``PutObject`` or an ``UploadPart``; a ranged read is
  a GET).

Two costs of moto that S3 does not have weigh on packs only: a ranged GET reads the whole
object and copies it before slicing (32 ranged 8 MiB GETs of a 256 MiB object: 6.3 s; 32
GETs of 8 MiB objects: 0.85 s, on this project's machine), and completing a multipart
upload concatenates its parts in the server process (1.0 s per 256 MiB).

The moto server is a separate process (its own GIL). It is an emulator, so its numbers say
what the tier and s3fs cost per request on this machine, not what AWS would deliver; the
ratios are the point. Medians of ``--runs``; the JSON keeps every run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from tiercheck import Checkpointer, Policy
from tiercheck.store.config import TierSpec
from tiercheck.store.policy import TierPolicy

MIB = 1 << 20
# werkzeug colours some lines (a 206 for a ranged GET among them) with ANSI escapes
_REQUEST = re.compile(r'"(?:\x1b\[[0-9;]*m)*(GET|PUT|POST|HEAD|DELETE) ')


class _Moto:
    """A moto server subprocess whose request log is counted by HTTP method."""

    def __init__(self, in_memory: bool = False) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = dict(
            os.environ,
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_DEFAULT_REGION="us-east-1",
            AWS_EC2_METADATA_DISABLED="true",
            NO_PROXY="127.0.0.1",
        )
        if in_memory:  # moto keeps an object over 5 MiB in a temporary file by default
            env["MOTO_S3_DEFAULT_KEY_BUFFER_SIZE"] = str(1 << 30)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        assert self.proc.stderr is not None
        for line in self.proc.stderr:  # werkzeug announces the socket once it listens
            if f"127.0.0.1:{self.port}" in line:
                break
        else:
            raise RuntimeError("moto server exited before listening")
        self._drain = threading.Thread(target=self._count, daemon=True)
        self._drain.start()

    def _count(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            m = _REQUEST.search(line)
            if m:
                with self._lock:
                    self.counts[m.group(1)] += 1

    def take(self) -> dict[str, int]:
        """Requests logged since the last call (the log lags a little: settle first)."""
        time.sleep(0.5)
        with self._lock:
            out, self.counts = dict(self.counts), Counter()
        return out

    def cpu(self) -> float:
        """CPU seconds the moto server process has used so far (Linux ``/proc``)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    @property
    def options(self) -> dict[str, Any]:
        return {
            "endpoint_url": f"http://127.0.0.1:{self.port}",
            "key": "bench",
            "secret": "bench",
            "client_kwargs": {"region_name": "us-east-1"},
        }

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


@contextmanager
def moto(in_memory: bool = False) -> Iterator[_Moto]:
    server = _Moto(in_memory)
    try:
        yield server
    finally:
        server.close()


def _state(mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(mib)
    n = mib * MIB // 4
    return {f"layer{i}": torch.randn(n // 8, generator=g) for i in range(8)}


def _keys(client: Any, bucket: str) -> list[str]:
    return [
        o["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for o in page.get("Contents", [])
    ]


def one_run(server: _Moto, mib: int, pack_size: str | int) -> dict[str, Any]:
    import boto3

    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    client = boto3.client(
        "s3",
        endpoint_url=server.options["endpoint_url"],
        aws_access_key_id="bench",
        aws_secret_access_key="bench",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=bucket)
    tiers = [
        TierSpec("mem", "memory://"),
        TierSpec(
            "s3",
            f"s3://{bucket}/tier",
            {"storage_options": server.options, "survives": "cluster", "pack_size": pack_size},
        ),
    ]
    policy = Policy(
        base_every=1,
        tiers={"s3": TierPolicy(versions="base", mode="async", codec="zstd", keep_bases=None)},
    )
    state = _state(mib)
    with tempfile.TemporaryDirectory(prefix="tiercheck-bench-packs-") as tmp:
        ckpt = Checkpointer(Path(tmp) / "store", tiers=tiers, policy=policy)
        try:
            server.take()  # what opening the tier sent is not counted
            # from the save call: the migration starts at the local commit, long before
            # wait() returns for a small state
            t0, c0, s0 = time.perf_counter(), time.process_time(), server.cpu()
            handle = ckpt.save(0, state)
            result = handle.wait_migrated(timeout=1800)
            migrate_s = time.perf_counter() - t0
            migrate_cpu = time.process_time() - c0
            migrate_server = server.cpu() - s0
            assert result.tiers["s3"] == "committed", result.tiers
            migrate_requests = server.take()
            back = {k: torch.empty_like(v) for k, v in state.items()}
            t0, c0, s0 = time.perf_counter(), time.process_time(), server.cpu()
            info = ckpt.restore(back, tiers=["s3"])
            restore_s = time.perf_counter() - t0
            restore_cpu = time.process_time() - c0
            restore_server = server.cpu() - s0
            restore_requests = server.take()
            assert info.source == "s3" and all(torch.equal(back[k], v) for k, v in state.items())
            # the tier's marker (holding its owner record) is one per tier, not per base
            objects = sum(1 for k in _keys(client, bucket) if not k.endswith("/tier.json"))
        finally:
            ckpt.destroy()
    keys = _keys(client, bucket)
    for i in range(0, len(keys), 1000):
        client.delete_objects(
            Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]]}
        )
    client.delete_bucket(Bucket=bucket)
    return {
        "objects": objects,
        "migrate_s": round(migrate_s, 3),
        "restore_s": round(restore_s, 3),
        "migrate_cpu_s": round(migrate_cpu, 3),
        "restore_cpu_s": round(restore_cpu, 3),
        "migrate_server_cpu_s": round(migrate_server, 3),
        "restore_server_cpu_s": round(restore_server, 3),
        "migrate_requests": migrate_requests,
        "restore_requests": restore_requests,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="48,512", help="state sizes in MiB, comma-separated")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--moto-in-memory",
        action="store_true",
        help="keep every object in moto's memory (by default one over 5 MiB is a temporary "
        "file, read whole by every GET, ranged or not)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/packs.json"))
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    layouts = {"loose": 0, "packs": "128MiB"}
    results: dict[str, Any] = {
        "benchmark": "packs",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "loadavg_start": list(os.getloadavg()),
        },
        "runs": args.runs,
        "moto_in_memory": args.moto_in_memory,
        "sizes": {},
    }
    with moto(args.moto_in_memory) as server:
        for mib in sizes:
            row: dict[str, Any] = {}
            for layout, pack_size in layouts.items():
                runs = []
                for _ in range(args.runs):  # interleaving would mix moto's memory states
                    runs.append(one_run(server, mib, pack_size))
                objects = runs[0]["objects"]
                puts = [r["migrate_requests"].get("PUT", 0) for r in runs]
                row[layout] = {
                    "pack_size": pack_size,
                    "objects_per_base": objects,
                    "migrate_puts": int(statistics.median(puts)),
                    "migrate_s": statistics.median(r["migrate_s"] for r in runs),
                    "restore_s": statistics.median(r["restore_s"] for r in runs),
                    "migrate_cpu_s": statistics.median(r["migrate_cpu_s"] for r in runs),
                    "restore_cpu_s": statistics.median(r["restore_cpu_s"] for r in runs),
                    "migrate_server_cpu_s": statistics.median(
                        r["migrate_server_cpu_s"] for r in runs
                    ),
                    "restore_server_cpu_s": statistics.median(
                        r["restore_server_cpu_s"] for r in runs
                    ),
                    "restore_gets": int(
                        statistics.median(r["restore_requests"].get("GET", 0) for r in runs)
                    ),
                    "migrate_gbps": round(
                        mib * MIB / statistics.median(r["migrate_s"] for r in runs) / 1e9, 3
                    ),
                    "restore_gbps": round(
                        mib * MIB / statistics.median(r["restore_s"] for r in runs) / 1e9, 3
                    ),
                    "all_runs": runs,
                }
                print(
                    f"{mib:>5} MiB {layout:>5}: {objects} objects, {row[layout]['migrate_puts']} "
                    f"PUTs, migrate {row[layout]['migrate_s']:.2f} s, "
                    f"restore {row[layout]['restore_s']:.2f} s",
                    flush=True,
                )
            loose, packs = row["loose"], row["packs"]
            row["ratios"] = {
                "objects": round(packs["objects_per_base"] / loose["objects_per_base"], 3),
                "puts": round(packs["migrate_puts"] / max(1, loose["migrate_puts"]), 3),
                "migrate_time": round(packs["migrate_s"] / loose["migrate_s"], 3),
                "restore_time": round(packs["restore_s"] / loose["restore_s"], 3),
                "migrate_cpu": round(packs["migrate_cpu_s"] / loose["migrate_cpu_s"], 3),
                "restore_cpu": round(packs["restore_cpu_s"] / loose["restore_cpu_s"], 3),
                "migrate_server_cpu": round(
                    packs["migrate_server_cpu_s"] / loose["migrate_server_cpu_s"], 3
                ),
                "restore_server_cpu": round(
                    packs["restore_server_cpu_s"] / loose["restore_server_cpu_s"], 3
                ),
            }
            results["sizes"][str(mib)] = row
    results["machine"]["loadavg_end"] = list(os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v["ratios"] for k, v in results["sizes"].items()}, indent=2))


if __name__ == "__main__":
    main()
