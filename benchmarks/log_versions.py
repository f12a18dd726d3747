"""Log versions through the store: bytes per version of dense AdamW training, before/after.

Trains the fp32 GPT-like model of ``benchmarks/update_log.py`` (AdamW, a schedule,
gradient clipping; random tokens, real backward passes) and saves after every step, side
by side in one run:

- ``diffs``: ``ckpt.guard(opt, log=False)``: what the store did before log versions
  (every version a base or a chunk-dedup diff);
- ``logs``: ``ckpt.guard(opt)``, the default: saves may be log versions.

Two stores for each: the default store (``Checkpointer(root)``, no configuration: shm,
LMDB, a ``file://`` remote), and shm + a peer tier (a real ``tiercheck.peer.server``
daemon on loopback, default placement: every version, delta codec). Per version it
records the role and the bytes each tier's write stored (``SaveResult.bytes_written``),
and then the time to restore the newest version from shm (a log version: its base, the
replay and the verification).

    python benchmarks/log_versions.py [--scale 1.0] [--saves 12]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib import disk_dir, store
from cluster_bench import start_daemon
from update_log import make_setup

import tiercheck
from tiercheck import TierSpec


def run(mode: str, tiers: list[TierSpec] | None, scale: float, saves: int) -> dict[str, Any]:
    setup = make_setup("fp32", scale)
    rows = []
    with store(tiers, tiercheck.Policy()) as ckpt:
        ckpt.guard(setup.opt, log=mode == "logs")
        for i in range(saves):
            setup.step()
            t0 = time.perf_counter()
            handle = ckpt.save(i + 1, setup.state())
            result = handle.result()
            rows.append(
                {
                    "step": i + 1,
                    "role": handle.role,
                    "logical": result.logical_bytes,
                    "bytes_written": dict(result.bytes_written),
                    "save_s": time.perf_counter() - t0,
                }
            )
        ckpt.flush()
        fresh = make_setup("fp32", scale, seed=5)
        ckpt.guard(fresh.opt)
        t0 = time.perf_counter()
        info = ckpt.restore(fresh.state(), tiers=["shm"])
        restore_s = time.perf_counter() - t0
    logical = rows[0]["logical"]
    names = sorted({t for r in rows for t in r["bytes_written"]})
    per_tier = {}
    for name in names:
        written = [r["bytes_written"].get(name, 0) for r in rows]
        nonbase = [r["bytes_written"].get(name, 0) for r in rows if r["role"] != "base"]
        per_tier[name] = {
            "mean_per_version_x": sum(written) / len(rows) / logical,
            "mean_per_non_base_version_x": sum(nonbase) / len(nonbase) / logical
            if nonbase
            else None,
            "total_x": sum(written) / logical,
        }
    return {
        "mode": mode,
        "tiers": [t.name for t in tiers] if tiers else "default",
        "state_bytes": logical,
        "roles": [r["role"] for r in rows],
        "per_tier": per_tier,
        "rows": rows,
        "restore_newest_from_shm": {
            "version_role": info.role,
            "replayed_steps": info.replayed_steps,
            "seconds": restore_s,
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="model width multiplier")
    ap.add_argument("--saves", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "log_versions.json"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    disk_dir().mkdir(parents=True, exist_ok=True)  # bench_lib.store() makes its root there
    token = uuid.uuid4().hex
    os.environ["TIERCHECK_PEER_TOKEN"] = token
    daemon, port = start_daemon(token, "4GiB")
    results = []
    try:
        for mode in ("diffs", "logs"):
            peer = [
                TierSpec("shm", "shm://bench-{uid}"),
                TierSpec("peer", f"peer://127.0.0.1:{port}/bench-{{uid}}", {"timeout": 30.0}),
            ]
            for tiers in (None, peer):
                r = run(mode, tiers, args.scale, args.saves)
                results.append(r)
                shown = ", ".join(
                    f"{n} {v['mean_per_version_x']:.3f}x per version"
                    + (
                        f" ({v['mean_per_non_base_version_x']:.3f}x per non-base)"
                        if v["mean_per_non_base_version_x"] is not None
                        else ""
                    )
                    for n, v in r["per_tier"].items()
                )
                rs = r["restore_newest_from_shm"]
                print(
                    f"{mode:5} {r['tiers']}: roles {''.join(x[0] for x in r['roles'])}; "
                    f"{shown}; restore newest ({rs['version_role']}, "
                    f"{rs['replayed_steps']} replayed) {rs['seconds']:.3f} s",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        daemon.kill()
        daemon.wait()
    doc = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "load_avg_1m": os.getloadavg()[0],
        },
        "setup": {
            "scale": args.scale,
            "saves": args.saves,
            "threads": args.threads,
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        },
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
