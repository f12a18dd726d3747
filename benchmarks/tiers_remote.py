"""Put and get throughput of the fsspec tier: file:// under /tmp and s3:// against a moto
server on loopback. 4 MiB random blobs, median of 3 runs.

    python benchmarks/tiers_remote.py [--blobs 256] [--s3-blobs 32] [--runs 3]
        [--out benchmarks/results/tiers_remote.json]

The moto server runs as a separate process (``python -m moto.server``) so that it does not
share this interpreter's GIL; it is an emulator, in-memory and single-host, so its numbers
say what the tier and s3fs cost per request, not what AWS would deliver. Per run, on a
fresh, empty store:

- ``put``: every blob with ``put`` from one thread;
- ``get``: every blob back into one preallocated caller buffer (``get(id, out=...)``);
- ``get_new``: every blob back into a new buffer (``get(id)``);
- ``put_many``: delete everything, then one ``put_many`` call (parallel requests on s3);
- ``get_threads``: every blob fetched by 8 threads (the engine's restore fans out too).

Rates are GB/s (10^9 bytes per second) of blob bytes.
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
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import blake3

from tiercheck.backends.base import Tier
from tiercheck.backends.registry import open_tier

BLOB = 4 << 20
GET_THREADS = 8


@contextmanager
def moto_server() -> Iterator[dict[str, Any]]:
    """A moto S3 server subprocess on 127.0.0.1; yields s3fs storage_options for it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
        NO_PROXY="127.0.0.1",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # werkzeug announces the socket once it listens
            if f"127.0.0.1:{port}" in line:
                break
        else:
            raise RuntimeError("moto server exited before listening")
        # Keep draining its request log so the pipe never fills up and blocks it.
        drain = ThreadPoolExecutor(1)
        drain.submit(lambda: [None for _ in proc.stderr])  # type: ignore[union-attr]
        yield {
            "endpoint_url": f"http://127.0.0.1:{port}",
            "key": "bench",
            "secret": "bench",
            "client_kwargs": {"region_name": "us-east-1"},
        }
    finally:
        proc.terminate()
        proc.wait()


def _timed(fn: Callable[[], None], nbytes: int) -> float:
    start = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - start) / 1e9


def bench(
    name: str,
    make: Callable[[], tuple[Tier, Callable[[], None]]],
    blobs: list[tuple[str, bytes]],
    runs: int,
) -> dict[str, Any]:
    total = sum(len(d) for _, d in blobs)
    out = memoryview(bytearray(BLOB))
    rates: dict[str, list[float]] = {
        op: [] for op in ("put", "get", "get_new", "put_many", "get_threads")
    }
    for _ in range(runs):
        tier, cleanup = make()
        try:

            def put_all(tier: Tier = tier) -> None:
                for bid, data in blobs:
                    tier.put(bid, data)

            def get_all(tier: Tier = tier) -> None:
                for bid, _ in blobs:
                    tier.get(bid, out=out)

            def get_new(tier: Tier = tier) -> None:
                for bid, _ in blobs:
                    tier.get(bid)

            def put_many(tier: Tier = tier) -> None:
                assert tier.put_many(blobs) == len(blobs)

            def get_threads(tier: Tier = tier) -> None:
                with ThreadPoolExecutor(GET_THREADS) as pool:
                    for _ in pool.map(tier.get, [bid for bid, _ in blobs]):
                        pass

            rates["put"].append(_timed(put_all, total))
            rates["get"].append(_timed(get_all, total))
            rates["get_new"].append(_timed(get_new, total))
            tier.delete(bid for bid, _ in blobs)
            rates["put_many"].append(_timed(put_many, total))
            rates["get_threads"].append(_timed(get_threads, total))
            for bid, data in blobs[:: max(1, len(blobs) // 8)]:
                assert bytes(tier.get(bid)) == data, f"{name}: {bid} read back wrong"
            caps = tier.capabilities
        finally:
            tier.close()
            cleanup()
    return {
        "tier": name,
        "blobs": len(blobs),
        "capabilities": {"survives": caps.survives.value, "speed_rank": caps.speed_rank},
        **{f"{op}_gbps": round(statistics.median(v), 3) for op, v in rates.items()},
        "runs": {op: [round(x, 3) for x in v] for op, v in rates.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blobs", type=int, default=256, help="blobs for file://")
    parser.add_argument("--s3-blobs", type=int, default=32, help="blobs for s3:// (moto)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/tiers_remote.json")
    args = parser.parse_args()

    load_before = [round(x, 2) for x in os.getloadavg()]
    blobs = []
    for _ in range(max(args.blobs, args.s3_blobs)):
        data = os.urandom(BLOB)
        blobs.append((blake3.blake3(data).hexdigest(), data))
    base = Path(tempfile.gettempdir()) / "tiercheck-bench-remote"

    def make_file() -> tuple[Tier, Callable[[], None]]:
        root = base / f"file-{uuid.uuid4().hex[:8]}"
        return open_tier(f"file://{root}"), lambda: shutil.rmtree(root, ignore_errors=True)

    results = []
    print(f"4 MiB blobs, median of {args.runs} runs, GB/s")
    header = f"{'tier':22} {'blobs':>5} {'put':>6} {'get':>6} {'get_new':>7} "
    print(header + f"{'put_many':>8} {'get_thr':>7}")

    def show(r: dict[str, Any]) -> None:
        print(
            f"{r['tier']:22} {r['blobs']:5d} {r['put_gbps']:6.2f} {r['get_gbps']:6.2f} "
            f"{r['get_new_gbps']:7.2f} {r['put_many_gbps']:8.2f} {r['get_threads_gbps']:7.2f}"
        )

    results.append(bench("file:// (/tmp)", make_file, blobs[: args.blobs], args.runs))
    show(results[-1])
    with moto_server() as options:
        import boto3

        s3 = boto3.client(
            "s3",
            endpoint_url=options["endpoint_url"],
            region_name="us-east-1",
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
        )

        def make_s3() -> tuple[Tier, Callable[[], None]]:
            bucket = f"bench-{uuid.uuid4().hex[:12]}"
            s3.create_bucket(Bucket=bucket)
            # one object per blob: the per-request cost (packs: benchmarks/packs.py)
            tier = open_tier(f"s3://{bucket}/tier", storage_options=options, pack_size=0)
            return tier, lambda: None

        results.append(bench("s3:// (moto, loopback)", make_s3, blobs[: args.s3_blobs], args.runs))
        show(results[-1])

    import fsspec
    import s3fs

    report = {
        "benchmark": "tiers_remote",
        "blob_bytes": BLOB,
        "runs": args.runs,
        "get_threads": GET_THREADS,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            # Other work on the machine skews the numbers; this says how busy it was.
            "loadavg_before": load_before,
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "fsspec": fsspec.__version__,
            "s3fs": s3fs.__version__,
        },
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
