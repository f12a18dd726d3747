"""Put and get throughput of local tiers: 256 random 4 MiB blobs, median of 3 runs.

    python benchmarks/tiers_local.py [URL ...] [--blobs 256] [--runs 3]
        [--out benchmarks/results/tiers.json]

Each URL may contain ``{run}``, replaced by a fresh token per run so that every run starts
from an empty store (the defaults do: shm, lmdb under /tmp, and file:// when the fsspec
tier is installed). Per run, one thread:

- ``put``: every blob into the empty tier (first-touch allocation included);
- ``get``: every blob back into one preallocated caller buffer (``get(id, out=...)``);
- ``get_new``: every blob back into a new buffer (``get(id)``);
- ``reput``: delete every blob, then put them all again (shm reuses its pooled
  segments, LMDB its freed pages).

Rates are GB/s (10^9 bytes per second) of blob bytes. Store directories are removed after
each run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import blake3

from tiercheck.backends.base import Tier
from tiercheck.backends.registry import open_tier

BLOB = 4 << 20


def default_urls() -> list[str]:
    base = Path(tempfile.gettempdir()) / "tiercheck-bench"
    urls = ["shm://bench-{run}", f"lmdb://{base}/lmdb-{{run}}"]
    if importlib.util.find_spec("tiercheck.backends._fsspec") is not None:
        urls.append(f"file://{base}/file-{{run}}")
    return urls


def _location(tier: Tier) -> str | None:
    """Directory holding ``tier``'s data, if it is local, to remove after a run."""
    path = getattr(tier, "path", None)
    if isinstance(path, str):
        return path
    parts = urlsplit(tier.url)
    return unquote(parts.path) if parts.scheme == "file" else None


def _timed(fn: Callable[[], None], nbytes: int) -> float:
    start = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - start) / 1e9


def bench_url(template: str, blobs: list[tuple[str, bytes]], runs: int) -> dict[str, Any]:
    total = sum(len(d) for _, d in blobs)
    out = memoryview(bytearray(BLOB))
    rates: dict[str, list[float]] = {"put": [], "get": [], "get_new": [], "reput": []}
    url = template
    for _ in range(runs):
        url = template.replace("{run}", uuid.uuid4().hex[:8])
        tier = open_tier(url)
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

            rates["put"].append(_timed(put_all, total))
            rates["get"].append(_timed(get_all, total))
            rates["get_new"].append(_timed(get_new, total))
            tier.delete(bid for bid, _ in blobs)
            rates["reput"].append(_timed(put_all, total))
            for bid, data in blobs[:: max(1, len(blobs) // 8)]:
                assert bytes(tier.get(bid)) == data, f"{url}: {bid} read back wrong"
        finally:
            location = _location(tier)
            tier.close()
            if location:
                shutil.rmtree(location, ignore_errors=True)
    return {
        "url": template,
        "capabilities": {
            "survives": tier.capabilities.survives.value,
            "speed_rank": tier.capabilities.speed_rank,
        },
        **{f"{op}_gbps": round(statistics.median(v), 3) for op, v in rates.items()},
        "runs": {op: [round(x, 3) for x in v] for op, v in rates.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("urls", nargs="*", help="tier URLs; {run} becomes a fresh token")
    parser.add_argument("--blobs", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/tiers.json")
    args = parser.parse_args()
    urls = args.urls or default_urls()

    blobs = []
    for _ in range(args.blobs):
        data = os.urandom(BLOB)
        blobs.append((blake3.blake3(data).hexdigest(), data))

    results = []
    print(f"{args.blobs} x 4 MiB blobs, median of {args.runs} runs, GB/s")
    print(f"{'tier':44} {'put':>7} {'get':>7} {'get_new':>8} {'reput':>7}")
    for template in urls:
        r = bench_url(template, blobs, args.runs)
        results.append(r)
        print(
            f"{template:44} {r['put_gbps']:7.2f} {r['get_gbps']:7.2f} "
            f"{r['get_new_gbps']:8.2f} {r['reput_gbps']:7.2f}"
        )
    report = {
        "benchmark": "tiers_local",
        "blob_bytes": BLOB,
        "blobs": args.blobs,
        "runs": args.runs,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
