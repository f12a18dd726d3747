"""tiercheck against torch.save, DCP, DCP async_save and safetensors, side by side.

    python benchmarks/run.py            # full run (~10 min on 2 cores), writes
                                        #   benchmarks/results/latest.json,
                                        #   docs/benchmarks.md, docs/benchmarks/*.png
    python benchmarks/run.py --quick    # smoke run: tiny state, one repeat (< 1 min)
    python benchmarks/run.py --quick --out /tmp/bench.json   # what CI runs

Everything runs in this one process, on the same state, one system after the other; each
number is the median of ``--repeats`` runs (5; 1 with ``--quick``). The JSON's field names
are stable and documented in ``docs/benchmarks.md`` (generated from ``FIELDS`` below);
the run exits non-zero if the result misses a documented field.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil
import torch
from bench_lib import (
    GIB,
    MIB,
    SHM,
    BenchState,
    copy_fresh,
    copy_warm,
    dcp_async,
    dcp_save_load,
    default_store_warmup,
    disk_dir,
    disk_floor,
    make_state,
    median,
    one_tier,
    private_disk_dir,
    safetensors_save_load,
    store,
    tc_restores,
    tc_saves,
    torch_load,
    torch_save,
)

import tiercheck
from tiercheck.store.lifecycle import shm_root_left_as_found

REPO = Path(__file__).resolve().parent.parent
SCHEMA = 1

# Field documentation: the JSON contract. docs/benchmarks.md prints this table, and
# validate() fails the run when a field is missing.
FIELDS: dict[str, str] = {
    "schema": "format version of this file (1)",
    "created": "UTC time of the run (ISO 8601)",
    "quick": "true for a --quick smoke run (tiny state, 1 repeat; numbers not meaningful)",
    "repeats": "runs per measurement; every number is the median of these",
    "machine": "cpus, memory_gib, python, torch, tiercheck, platform, loadavg_start/_end",
    "state": "the main benchmark state: params, bytes, tensors, description",
    "metrics": "name -> {median, runs, unit}: every main measurement on the state (below)",
    "comparisons": "list of {name, tiercheck, peer, ratio, target, met}: ratio = "
    "tiercheck/peer of two metrics' medians; target is the goal of issue 3 or 16 (null: none)",
    "bytes_per_version": "scenario -> bytes written per version (dense, frozen, lora, "
    "data_parallel_4)",
    "sweep": "list, one per state size: {state_bytes, metric -> median seconds or bytes}",
    "training": "steps, seconds per mode (none, tiercheck, dcp_async), slowdown vs none",
    "profile": "default_store: phase -> median seconds from the save() call over the "
    "default store's steady-state saves (staged, hashed, prepared:/committed: per tier, "
    "committed, migrated)",
}

METRICS: dict[str, str] = {
    "copy_warm_s": "dst.copy_(src) of every tensor into tensors allocated and touched before",
    "copy_fresh_s": "src.clone() of every tensor (fresh memory, first-touch page faults)",
    "torch_save_shm_s": "torch.save to a file in /dev/shm",
    "torch_save_disk_fsync_s": "torch.save to a file on disk, then fsync",
    "torch_load_shm_s": "torch.load (weights_only) of that file from /dev/shm",
    "safetensors_save_shm_s": "safetensors save_file to /dev/shm",
    "safetensors_load_shm_s": "safetensors load_file from /dev/shm",
    "disk_write_fsync_s": "the disk's floor: the state's bytes as they lie in memory, written by "
    "2 threads to one file each and fsynced (no serialization, no metadata)",
    "dcp_save_disk_s": "dcp.save, FileSystemWriter (2 threads, fsync) on disk",
    "dcp_save_shm_s": "dcp.save, FileSystemWriter (2 threads) to /dev/shm",
    "dcp_load_shm_s": "dcp.load from /dev/shm into the state's tensors (in place)",
    "dcp_load_disk_s": "dcp.load from disk into the state's tensors (in place; the files were "
    "just written, so they are in the page cache, as the file tier's are)",
    "dcp_async_blocked_first_s": "dcp.async_save + DefaultStager: first call's return",
    "dcp_async_blocked_s": "dcp.async_save returning (later calls)",
    "dcp_async_blocked_max_s": "slowest dcp.async_save return of all calls incl. the first",
    "dcp_async_staged_s": "async_save call to staging_completion",
    "dcp_async_committed_disk_s": "async_save call to upload_completion (disk, fsync)",
    "dcp_async_cpu_s_per_gib": "process CPU seconds per GiB from async_save to upload done",
    "dcp_async_peak_extra_rss_bytes": "peak RSS above the start of the save (stager copy)",
    "torch_save_peak_extra_rss_bytes": "peak RSS above the start of torch.save to /dev/shm",
    "dcp_save_peak_extra_rss_bytes": "peak RSS above the start of dcp.save to disk",
    "tc_blocked_first_s": "tiercheck: first save() return in a fresh Checkpointer after "
    "prepare(state)",
    "tc_blocked_s": "tiercheck: save() returning (shm store)",
    "tc_blocked_max_s": "tiercheck: slowest save() return over every store and call",
    "tc_staged_s": "tiercheck: save() call to staged (state copied; may be mutated)",
    "tc_committed_shm_s": "save() call to committed, store with the shm tier alone",
    "tc_committed_lmdb_s": "save() call to committed, store with the LMDB tier alone",
    "tc_committed_file_s": "save() call to committed, store with a file:// tier alone (its "
    "default codec, raw)",
    "tc_committed_s3_s": "save() call to committed, s3:// tier alone (moto on loopback; "
    "measured on the smaller s3 state, see s3_state_bytes)",
    "tc_committed_default_s": "default store (shm+LMDB sync): save() call to committed, in "
    "steady state (each save reuses the LMDB pages of the base it drops)",
    "tc_committed_default_first_s": "default store: the first save of a new store, save() "
    "call to committed (creates the shm segments, grows the LMDB file)",
    "tc_committed_default_growing_s": "default store: the saves of a new store before its "
    "steady state (each grows the LMDB file: new disk blocks, faults on fresh map pages)",
    "tc_migrated_remote_s": "default store: save() call to migrated to the remote file tier",
    "tc_migrate_file_s": "default store: the migration alone, from the commit at shm+LMDB to "
    "the commit record in the file:// remote tier (raw blobs, each fsynced)",
    "tc_restore_shm_s": "restore(tiers=['shm']) into the state's tensors, verified",
    "tc_restore_lmdb_s": "restore(tiers=['lmdb'])",
    "tc_restore_file_s": "restore(tiers=['file'])",
    "tc_restore_s3_s": "restore(tiers=['s3']) (smaller s3 state)",
    "tc_cpu_s_per_gib": "process CPU seconds per GiB from save() to committed at shm",
    "tc_peak_extra_rss_bytes": "peak RSS during shm saves above the RSS before the "
    "Checkpointer's prepare() (the staging buffer counts)",
    "s3_state_bytes": "size of the state used for the s3 rows (moto is slow)",
}

TARGETS = [
    # name, tiercheck metric, peer metric, target ratio (<=), what it means
    ("blocked vs DCP async (later calls)", "tc_blocked_s", "dcp_async_blocked_s", 1.0),
    ("blocked vs DCP async (first call)", "tc_blocked_first_s", "dcp_async_blocked_first_s", 1.0),
    ("blocked vs DCP async (worst call)", "tc_blocked_max_s", "dcp_async_blocked_max_s", 1.0),
    ("staged vs plain copy into a warm buffer", "tc_staged_s", "copy_warm_s", 1.3),
    ("staged vs DCP async staged", "tc_staged_s", "dcp_async_staged_s", None),
    ("committed at shm vs torch.save to /dev/shm", "tc_committed_shm_s", "torch_save_shm_s", 1.0),
    (
        "committed at LMDB vs torch.save to disk+fsync",
        "tc_committed_lmdb_s",
        "torch_save_disk_fsync_s",
        None,
    ),
    ("committed at LMDB vs dcp.save to disk", "tc_committed_lmdb_s", "dcp_save_disk_s", None),
    (
        "committed at LMDB vs DCP async committed",
        "tc_committed_lmdb_s",
        "dcp_async_committed_disk_s",
        None,
    ),
    (
        "committed, default store (shm + LMDB) vs dcp.save to disk",
        "tc_committed_default_s",
        "dcp_save_disk_s",
        1.0,
    ),
    (
        "committed, default store (shm + LMDB) vs the disk's floor",
        "tc_committed_default_s",
        "disk_write_fsync_s",
        None,
    ),
    (
        "committed, default store, first save vs dcp.save to disk",
        "tc_committed_default_first_s",
        "dcp_save_disk_s",
        None,
    ),
    (
        "committed, default store, growing saves vs dcp.save to disk",
        "tc_committed_default_growing_s",
        "dcp_save_disk_s",
        None,
    ),
    ("migration to remote file vs dcp.save to disk", "tc_migrate_file_s", "dcp_save_disk_s", 1.0),
    (
        "migration to remote file vs the disk's floor",
        "tc_migrate_file_s",
        "disk_write_fsync_s",
        None,
    ),
    (
        "save() to migrated at remote file vs dcp.save to disk",
        "tc_migrated_remote_s",
        "dcp_save_disk_s",
        None,
    ),
    ("restore from shm vs torch.load from /dev/shm", "tc_restore_shm_s", "torch_load_shm_s", 1.0),
    ("restore from shm vs dcp.load from /dev/shm", "tc_restore_shm_s", "dcp_load_shm_s", None),
    (
        "restore from LMDB vs torch.load from /dev/shm",
        "tc_restore_lmdb_s",
        "torch_load_shm_s",
        None,
    ),
    ("restore from file vs dcp.load from disk", "tc_restore_file_s", "dcp_load_disk_s", 1.0),
    ("restore from file vs dcp.load from /dev/shm", "tc_restore_file_s", "dcp_load_shm_s", None),
    ("background CPU per GiB vs DCP async", "tc_cpu_s_per_gib", "dcp_async_cpu_s_per_gib", None),
    ("peak extra RSS vs state size", "tc_peak_extra_rss_bytes", "state_bytes", 1.5),
    (
        "peak extra RSS vs DCP async",
        "tc_peak_extra_rss_bytes",
        "dcp_async_peak_extra_rss_bytes",
        None,
    ),
]

SWEEP_METRICS = [
    "copy_warm_s",
    "torch_save_shm_s",
    "torch_load_shm_s",
    "dcp_async_blocked_s",
    "dcp_async_staged_s",
    "dcp_async_committed_disk_s",
    "tc_blocked_s",
    "tc_staged_s",
    "tc_committed_shm_s",
    "tc_restore_shm_s",
    "tc_peak_extra_rss_bytes",
    "dcp_async_peak_extra_rss_bytes",
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Results:
    def __init__(self) -> None:
        self.metrics: dict[str, dict[str, Any]] = {}
        self.profile: dict[str, dict[str, float]] = {}  # where the time of a save goes

    def put(self, key: str, runs: list[float] | float, unit: str = "s") -> None:
        xs = [float(x) for x in (runs if isinstance(runs, list) else [runs])]
        self.metrics[key] = {"median": median(xs), "runs": [round(x, 6) for x in xs], "unit": unit}

    def get(self, key: str) -> float:
        return float(self.metrics[key]["median"])


def _shm_urls() -> dict[str, tuple[str, tiercheck.TierPolicy, dict[str, Any]]]:
    sync = dict(versions="all", mode="sync", keep_bases=1)
    return {
        "shm": ("shm://tc-bench-{uid}", tiercheck.TierPolicy(codec="raw", **sync), {}),  # type: ignore[arg-type]
        "lmdb": ("lmdb://{root}/lmdb", tiercheck.TierPolicy(codec="raw", **sync), {}),  # type: ignore[arg-type]
        "file": (
            "file://{root}/remote",
            tiercheck.TierPolicy(codec="raw", **sync),  # type: ignore[arg-type]
            {"survives": "cluster", "shared": True},
        ),
    }


def measure_tiercheck(
    res: Results, bs: BenchState, repeats: int, s3_options: dict[str, Any] | None, s3_bytes: int
) -> list[float]:
    """Single-tier stores (shm, LMDB, file, s3) and the default store; returns every
    blocked time seen (for the worst-call comparison)."""
    blocked_all: list[float] = []
    for name, (url, tp, opts) in _shm_urls().items():
        tiers, policy = one_tier(name, url, tp, **opts)
        log(f"tiercheck: {name} tier alone, {repeats} saves + restores")
        with store(tiers, policy) as ckpt:
            r = tc_saves(ckpt, bs, repeats)
            blocked_all += r["blocked_all"]
            if name == "shm":
                res.put("tc_blocked_first_s", r["blocked_all"][0])
                res.put("tc_blocked_s", r["blocked"][1:] or r["blocked"])
                res.put("tc_staged_s", r["staged"])
                res.put("tc_cpu_s_per_gib", [c / (bs.nbytes / GIB) for c in r["cpu"]], "s/GiB")
                res.put("tc_peak_extra_rss_bytes", [float(x) for x in r["rss"]], "bytes")
            res.put(f"tc_committed_{name}_s", r["committed"])
            rr = tc_restores(ckpt, bs, repeats, name)
            res.put(f"tc_restore_{name}_s", rr["runs"])
    log(f"tiercheck: default store (shm + LMDB + remote file), {repeats} base saves, migrated")
    with store(None, tiercheck.Policy(base_every=1, gc_grace_seconds=0)) as ckpt:
        # a new store's first saves are reported apart: they create the shm segments and
        # grow the LMDB file, whose pages every later save of a training run reuses
        r = tc_saves(ckpt, bs, repeats, migrated=True, warm=default_store_warmup())
        blocked_all += r["blocked_all"]
        res.put("tc_committed_default_first_s", r["committed_first"])
        res.put("tc_committed_default_growing_s", r["committed_warm"])
        phases = {k for t in r["timings"] for k in t} - {"blocked", "voting"}
        res.profile["default_store"] = {
            k: median([t[k] for t in r["timings"] if k in t]) for k in sorted(phases)
        } | {"migrated": median(r["migrated"])}
        res.put("tc_committed_default_s", r["committed"])
        res.put("tc_migrated_remote_s", r["migrated"])
        res.put("tc_migrate_file_s", r["migration"])
    if s3_options is not None:
        import boto3

        small = make_state(s3_bytes, seed=3)
        res.put("s3_state_bytes", float(small.nbytes), "bytes")
        bucket = f"bench-{uuid.uuid4().hex[:12]}"
        boto3.client(
            "s3",
            endpoint_url=s3_options["endpoint_url"],
            region_name="us-east-1",
            aws_access_key_id=s3_options["key"],
            aws_secret_access_key=s3_options["secret"],
        ).create_bucket(Bucket=bucket)
        tp = tiercheck.TierPolicy(versions="all", mode="sync", codec="zstd", keep_bases=1)
        tiers, policy = one_tier(
            "s3", f"s3://{bucket}/tc", tp, storage_options=s3_options, survives="cluster"
        )
        log(f"tiercheck: s3 tier alone (moto), {small.nbytes / MIB:.0f} MiB state")
        with store(tiers, policy) as ckpt:
            r = tc_saves(ckpt, small, repeats)
            res.put("tc_committed_s3_s", r["committed"])
            res.put("tc_restore_s3_s", tc_restores(ckpt, small, repeats, "s3")["runs"])
        del small
    else:
        res.put("s3_state_bytes", float("nan"), "bytes")
        res.put("tc_committed_s3_s", float("nan"))
        res.put("tc_restore_s3_s", float("nan"))
    return blocked_all


def measure_main(
    bs: BenchState, repeats: int, s3_options: dict[str, Any] | None, s3_bytes: int
) -> Results:
    res = Results()
    disk = disk_dir()
    log(f"plain copies of {bs.nbytes / MIB:.0f} MiB")
    res.put("copy_warm_s", copy_warm(bs, repeats))
    res.put("copy_fresh_s", copy_fresh(bs, repeats))
    log("torch.save / torch.load")
    r = torch_save(bs, SHM, repeats, fsync=False)
    res.put("torch_save_shm_s", r["runs"])
    res.put("torch_save_peak_extra_rss_bytes", [float(x) for x in r["rss"]], "bytes")
    res.put("torch_save_disk_fsync_s", torch_save(bs, disk, repeats, fsync=True)["runs"])
    res.put("torch_load_shm_s", torch_load(bs, SHM, repeats))
    log("safetensors")
    r = safetensors_save_load(bs, SHM, repeats)
    res.put("safetensors_save_shm_s", r["save"])
    res.put("safetensors_load_shm_s", r["load"])
    log("the disk's floor (write + fsync of the raw bytes)")
    res.put("disk_write_fsync_s", disk_floor(bs, disk, repeats))
    log("dcp.save / dcp.load")
    r = dcp_save_load(bs, disk, repeats, load=True)
    res.put("dcp_save_disk_s", r["save"])
    res.put("dcp_load_disk_s", r["load"])
    res.put("dcp_save_peak_extra_rss_bytes", [float(x) for x in r["rss"]], "bytes")
    r = dcp_save_load(bs, SHM, repeats, load=True)
    res.put("dcp_save_shm_s", r["save"])
    res.put("dcp_load_shm_s", r["load"])
    log("dcp.async_save + DefaultStager")
    r = dcp_async(bs, disk, repeats)
    res.put("dcp_async_blocked_first_s", r["blocked_first"])
    res.put("dcp_async_blocked_s", r["blocked"])
    res.put("dcp_async_blocked_max_s", max([r["blocked_first"], *r["blocked"]]))
    res.put("dcp_async_staged_s", r["staged"])
    res.put("dcp_async_committed_disk_s", r["committed"])
    res.put("dcp_async_cpu_s_per_gib", [c / (bs.nbytes / GIB) for c in r["cpu"]], "s/GiB")
    res.put("dcp_async_peak_extra_rss_bytes", [float(x) for x in r["rss"]], "bytes")
    blocked_all = measure_tiercheck(res, bs, repeats, s3_options, s3_bytes)
    res.put("tc_blocked_max_s", max(blocked_all))
    res.put("state_bytes", float(bs.nbytes), "bytes")
    return res


def measure_sweep_point(bs: BenchState, repeats: int) -> dict[str, float]:
    res = Results()
    res.put("copy_warm_s", copy_warm(bs, repeats))
    res.put("torch_save_shm_s", torch_save(bs, SHM, repeats, fsync=False)["runs"])
    res.put("torch_load_shm_s", torch_load(bs, SHM, repeats))
    r = dcp_async(bs, disk_dir(), repeats)
    res.put("dcp_async_blocked_s", r["blocked"])
    res.put("dcp_async_staged_s", r["staged"])
    res.put("dcp_async_committed_disk_s", r["committed"])
    res.put("dcp_async_peak_extra_rss_bytes", [float(x) for x in r["rss"]], "bytes")
    url, tp, opts = _shm_urls()["shm"]
    tiers, policy = one_tier("shm", url, tp, **opts)
    with store(tiers, policy) as ckpt:
        r = tc_saves(ckpt, bs, repeats)
        res.put("tc_blocked_s", r["blocked"])
        res.put("tc_staged_s", r["staged"])
        res.put("tc_committed_shm_s", r["committed"])
        res.put("tc_peak_extra_rss_bytes", [float(x) for x in r["rss"]], "bytes")
        res.put("tc_restore_shm_s", tc_restores(ckpt, bs, repeats, "shm")["runs"])
    return {k: res.get(k) for k in SWEEP_METRICS}


def comparisons(metrics: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for name, tc, peer, target in TARGETS:
        a, b = metrics[tc]["median"], metrics[peer]["median"]
        ratio = a / b if b and not (math.isnan(a) or math.isnan(b)) else float("nan")
        out.append(
            {
                "name": name,
                "tiercheck": tc,
                "peer": peer,
                "tiercheck_value": a,
                "peer_value": b,
                "ratio": ratio,
                "target": target,
                "met": None if target is None or math.isnan(ratio) else bool(ratio <= target),
            }
        )
    return out


def data_parallel(quick: bool) -> dict[str, Any]:
    """4 data-parallel ranks under torchrun (cluster_bench's dedup phase): bytes the shared
    tier takes per version with cross-rank dedup, against every rank writing its own copy."""
    from cluster_bench import bench_dedup

    ranks, mib = 4, (8 if quick else 32)
    d = bench_dedup(ranks, mib, saves=2)
    per_version = d["logical_bytes"] / d["versions"]  # all ranks' shards: what DCP writes
    return {
        "kind": "data_parallel",
        "ranks": ranks,
        "replica_bytes": mib * MIB,
        "own_bytes": MIB,
        "versions": d["versions"],
        "all_shards_bytes": per_version,
        "shared_bytes": d["shared_bytes_written"] / d["versions"],
        "per_rank_bytes": d["per_rank_bytes_written"] / d["versions"],
        "ratio_vs_no_dedup": d["ratio"],
        "note": "benchmarks/cluster_bench.py dedup phase: raw, sync, every version to a "
        "shared file:// tier; each rank's node-local tiers still hold its whole shard",
    }


def validate(result: dict[str, Any]) -> list[str]:
    problems = [f"missing top-level field {k!r}" for k in FIELDS if k not in result]
    for k in METRICS:
        if k not in result.get("metrics", {}):
            problems.append(f"missing metric {k!r}")
    for m in result.get("metrics", {}).values():
        if not {"median", "runs", "unit"} <= set(m):
            problems.append(f"metric lacks median/runs/unit: {m}")
    for scen in ("dense", "frozen", "lora", "data_parallel_4"):
        if scen not in result.get("bytes_per_version", {}):
            problems.append(f"missing bytes_per_version scenario {scen!r}")
    for k in (
        "steps",
        "none_s",
        "tiercheck_s",
        "dcp_async_s",
        "tiercheck_slowdown",
        "dcp_async_slowdown",
    ):
        if k not in result.get("training", {}):
            problems.append(f"missing training field {k!r}")
    for row in result.get("sweep", []):
        for k in ("state_bytes", *SWEEP_METRICS):
            if k not in row:
                problems.append(f"sweep row lacks {k!r}")
    try:
        json.dumps(result, allow_nan=True)
    except (TypeError, ValueError) as exc:
        problems.append(f"not serializable: {exc}")
    return problems


def _clean(obj: Any) -> Any:
    """NaN -> null so the file is strict JSON."""
    if isinstance(obj, float):
        return None if math.isnan(obj) or math.isinf(obj) else round(obj, 6)
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: tiny state, 1 repeat")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "latest.json")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--state-mib", type=float, default=None, help="main state size (MiB)")
    p.add_argument("--sizes-mib", default=None, help="sweep sizes, comma separated (MiB)")
    p.add_argument("--train-steps", type=int, default=None)
    p.add_argument("--no-s3", action="store_true", help="skip the s3 (moto) rows")
    p.add_argument(
        "--docs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write docs/benchmarks.md and PNGs (default: on for full runs)",
    )
    p.add_argument("--render", type=Path, default=None, help="only redraw docs from this JSON")
    args = p.parse_args()
    if args.render is not None:
        from bench_report import write_docs as render

        render(json.loads(args.render.read_text()), REPO / "docs", FIELDS, METRICS)
        return 0
    with private_disk_dir(), shm_root_left_as_found():
        return run(args)


def run(args: argparse.Namespace) -> int:
    quick = args.quick
    repeats = args.repeats or (1 if quick else 5)
    state_bytes = int((args.state_mib or (8 if quick else 1056)) * MIB)
    sizes = [
        int(float(s) * MIB)
        for s in (args.sizes_mib or ("2,6" if quick else "64,256,1056,2048")).split(",")
    ]
    train_steps = args.train_steps or (2 if quick else 12)
    s3_bytes = int((2 if quick else 64) * MIB)
    write_docs = (not quick) if args.docs is None else args.docs
    torch.manual_seed(0)
    t_start = time.perf_counter()

    result: dict[str, Any] = {
        "schema": SCHEMA,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "quick": quick,
        "repeats": repeats,
        "machine": {
            "cpus": os.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / GIB, 1),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "tiercheck": tiercheck.__version__,
            "platform": platform.platform(),
            "torch_threads": torch.get_num_threads(),
            "loadavg_start": list(os.getloadavg()),
        },
    }
    with ExitStack() as stack:
        s3_options = None
        if not args.no_s3:
            from tiers_remote import moto_server

            s3_options = stack.enter_context(moto_server())
        bs = make_state(state_bytes)
        result["state"] = {
            "params": bs.params,
            "bytes": bs.nbytes,
            "tensors": len(bs.tensors),
            "description": "GPT-like weights + AdamW exp_avg/exp_avg_sq/step, fp32",
        }
        log(
            f"main state: {bs.params / 1e6:.1f} M params, {bs.nbytes / MIB:.0f} MiB, "
            f"{repeats} repeats"
        )
        res = measure_main(bs, repeats, s3_options, s3_bytes)
        del bs
    result["metrics"] = res.metrics
    result["comparisons"] = comparisons(res.metrics)
    result["profile"] = res.profile

    from bench_train import bytes_per_version, training_run

    versions = 2 if quick else 11
    bpv: dict[str, Any] = {}
    for scen in ("dense", "frozen", "lora"):
        log(f"bytes per version: {scen}, {versions} versions")
        bpv[scen] = bytes_per_version(scen, versions)
    log("bytes per version: data_parallel_4 (torchrun, 4 ranks)")
    bpv["data_parallel_4"] = data_parallel(quick)
    result["bytes_per_version"] = bpv

    sweep = []
    for size in sizes:
        if not quick and abs(size - state_bytes) < MIB:
            m = {k: res.get(k) for k in SWEEP_METRICS}
            sweep.append({"state_bytes": float(state_bytes), **m})
            continue
        bs = make_state(size, seed=1)
        log(f"sweep: {bs.nbytes / MIB:.0f} MiB")
        sweep.append({"state_bytes": float(bs.nbytes), **measure_sweep_point(bs, repeats)})
        del bs
    result["sweep"] = sweep

    log(f"training overhead: {train_steps} steps x {repeats} per mode")
    times: dict[str, list[float]] = {"none": [], "tiercheck": [], "dcp_async": []}
    for _ in range(repeats):
        for mode in times:
            times[mode].append(training_run(mode, train_steps))
    none = median(times["none"])
    result["training"] = {
        "steps": train_steps,
        "model": "tiercheck.cli.demo GPT (3.2 M params, 37 MiB of state with AdamW)",
        **{f"{m}_s": median(v) for m, v in times.items()},
        "runs": times,
        "tiercheck_slowdown": median(times["tiercheck"]) / none,
        "dcp_async_slowdown": median(times["dcp_async"]) / none,
    }
    if quick:  # CI's smoke run of benchmarks/trainer_overhead.py too (issue 31), JSON beside
        import trainer_overhead

        log("trainer overhead (--quick)")
        trainer_overhead.main(["--quick", "--out", str(args.out.with_suffix(".trainer.json"))])
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    result["seconds"] = time.perf_counter() - t_start

    problems = validate(result)
    clean = _clean(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(clean, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, args.out)
    log(f"wrote {args.out} ({result['seconds']:.0f} s)")
    from bench_report import print_table
    from bench_report import write_docs as write_docs_fn

    print_table(clean)
    if write_docs:
        write_docs_fn(clean, REPO / "docs", FIELDS, METRICS)
        log("wrote docs/benchmarks.md and docs/benchmarks/*.png")
    if problems:
        for prob in problems:
            print(f"SCHEMA ERROR: {prob}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
