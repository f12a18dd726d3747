"""What the retry and limit wrappers cost when nothing fails (tiercheck.backends.resilience).

    python benchmarks/resilience.py [--calls 5000] [--state-mib 16] [--runs 3]
        [--out benchmarks/results/resilience.json]

Side by side, bare tier against ``RetryTier(LimitTier(tier))`` (the default of a network
store):

- the cost per call on a ``memory://`` tier (4 KiB put, get, has), where the wrappers are
  all there is to measure;
- a save (to a synchronous ``s3://`` tier) and a restore (from it alone) of a
  ``--state-mib`` state against moto's S3 server on loopback (a subprocess), the store
  opened with the default wrappers and with ``retry = false, max_in_flight = 0``.

Prints a table and writes JSON (medians of ``--runs``, and the ratios wrapped / bare).
Everything it creates is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import torch
from tiers_remote import moto_server

from tiercheck import Checkpointer, Policy, TierPolicy, TierSpec
from tiercheck.backends.base import Tier
from tiercheck.backends.registry import open_tier
from tiercheck.backends.resilience import DEFAULT_LIMIT, DEFAULT_RETRY, LimitTier, RetryTier


def _median_of(runs: int, fn: Callable[[], float]) -> float:
    return statistics.median(fn() for _ in range(runs))


def per_call(calls: int, runs: int) -> dict[str, Any]:
    blobs = [
        (blake3.blake3(i.to_bytes(8, "little")).hexdigest(), bytes(4096)) for i in range(calls)
    ]

    def once(wrapped: bool) -> dict[str, float]:
        tier: Tier = open_tier(f"memory://bench-{uuid.uuid4().hex}")
        if wrapped:
            tier = RetryTier(LimitTier(tier, DEFAULT_LIMIT), DEFAULT_RETRY)
        out = {}
        t0 = time.perf_counter()
        for bid, data in blobs:
            tier.put(bid, data)
        out["put_us"] = (time.perf_counter() - t0) / calls * 1e6
        t0 = time.perf_counter()
        for bid, _ in blobs:
            tier.get(bid)
        out["get_us"] = (time.perf_counter() - t0) / calls * 1e6
        t0 = time.perf_counter()
        for bid, _ in blobs:
            tier.has([bid])
        out["has_us"] = (time.perf_counter() - t0) / calls * 1e6
        tier.close()
        return out

    result: dict[str, Any] = {}
    for op in ("put_us", "get_us", "has_us"):
        bare = _median_of(runs, lambda op=op: once(False)[op])
        wrapped = _median_of(runs, lambda op=op: once(True)[op])
        result[op] = {"bare": bare, "wrapped": wrapped, "ratio": wrapped / bare}
    return result


def s3_save_restore(state_mib: int, runs: int, work: Path) -> dict[str, Any]:
    state = {"w": torch.randn(state_mib << 18)}
    result: dict[str, Any] = {}
    with moto_server() as storage:
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=storage["endpoint_url"],
            region_name="us-east-1",
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
        )

        def once(wrapped: bool) -> tuple[float, float]:
            bucket = f"bench-{uuid.uuid4().hex[:20]}"
            client.create_bucket(Bucket=bucket)
            opts: dict[str, Any] = {"storage_options": storage}
            if not wrapped:
                opts.update(retry=False, max_in_flight=0)
            policy = Policy(tiers={"s3": TierPolicy(versions="all", mode="sync")})
            root = work / uuid.uuid4().hex
            ckpt = Checkpointer(
                root, tiers=[TierSpec("s3", f"s3://{bucket}/t", opts)], policy=policy
            )
            try:
                assert isinstance(ckpt.tierset.get("s3").tier, RetryTier) == wrapped
                t0 = time.perf_counter()
                ckpt.save(1, state).wait()
                save_s = time.perf_counter() - t0
                out = {"w": torch.empty_like(state["w"])}
                t0 = time.perf_counter()
                ckpt.restore(out)
                restore_s = time.perf_counter() - t0
                assert torch.equal(out["w"], state["w"])
            finally:
                ckpt.destroy()
            return save_s, restore_s

        for name, index in (("save_s", 0), ("restore_s", 1)):
            bare = _median_of(runs, lambda i=index: once(False)[i])
            wrapped = _median_of(runs, lambda i=index: once(True)[i])
            result[name] = {"bare": bare, "wrapped": wrapped, "ratio": wrapped / bare}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--state-mib", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/resilience.json")
    args = parser.parse_args()
    report: dict[str, Any] = {"calls": args.calls, "state_mib": args.state_mib, "runs": args.runs}
    report["memory_per_call"] = per_call(args.calls, args.runs)
    with tempfile.TemporaryDirectory(prefix="tc-resilience-") as tmp:
        report["s3_moto"] = s3_save_restore(args.state_mib, args.runs, Path(tmp))
    for section in ("memory_per_call", "s3_moto"):
        for key, r in report[section].items():
            print(
                f"{section:16s} {key:10s} bare {r['bare']:10.4f}  wrapped {r['wrapped']:10.4f}"
                f"  ratio {r['ratio']:.3f}"
            )
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
