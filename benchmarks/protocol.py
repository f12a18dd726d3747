"""The commit protocol's cost per rank per save, measured at 2 to 16 ranks on loopback and
modelled at 16,384 ranks (issue 24).

    python benchmarks/protocol.py [--worlds 2,4,8,16] [--chunks 300] [--saves 10]
                                  [--out benchmarks/results/protocol.json]
                                  [--plot docs/benchmarks/protocol.png]

For each world size and each layout (``sharded``: every rank's chunk ids its own;
``replicated``: the same ids on every rank, data parallel), torchrun starts the ranks of
benchmarks/dist_scripts/protocol_bench_worker.py (gloo on 127.0.0.1, CPU), which drive
:class:`~tiercheck.engine.coordinator.DistCoordinator` through the steps of a save
(exchange, decide, confirm, settle) with ``--chunks`` chunk ids per rank and no data: the
protocol alone. Per save and rank: ``bytes`` the protocol's collectives delivered to the
rank, ``calls`` (collective calls), ``seconds`` (after a barrier). Reported: the mean and
the maximum over ranks of the bytes, the calls, and the median over saves of the mean and
the slowest rank's seconds. ``baseline``: the messages of the protocol before issue 24
(each rank's id list, then its vote and its confirmation, all-gathered to every rank), the
same way, without that protocol's writer assignment (a Python loop over every rank's ids).

**The model** (``model``) predicts a rank's protocol time per save at N ranks from what is
measured here, in the alpha-beta form:

    t(N) = t_cpu + calls * alpha * ceil(log2 N) + bytes(N) / beta

- ``t_cpu``: the rank's own work (packing its ids, an owner's assignment of the ids it
  receives, the answers), timed in this process for ``--chunks`` ids, no collective.
- ``calls``: collective calls per save (counted: the same at every N).
- ``alpha``: what one collective call costs the protocol per hop: at 2 ranks (one hop),
  the slowest rank's time in the best save, less ``t_cpu`` and the transfer, over
  ``calls``. The best save, not the median: on a machine shared with other work (the load
  average is in ``machine``) the median measures when the ranks were scheduled.
  Each call is a tree, recursive doubling or Bruck all-to-all of ``ceil(log2 N)`` hops:
  what MPI and NCCL run for small messages at scale. gloo's own all-to-all posts its
  ``N - 1`` messages at once instead, and its all-gather is a ring of ``N - 1`` steps;
  what one message costs apart from the other ranks' contention for this machine's cores
  cannot be measured here, so the model leaves it out (docs/multi-rank.md says so).
- ``bytes(N)``: a least-squares line through the measured bytes per rank (it grows by the
  32-byte manifest id and the 4-byte all-to-all count of each rank).
- ``beta``: loopback bandwidth, a 1 MiB all-gather at 2 ranks.

The measured seconds at 8 and 16 ranks include the oversubscription of this machine's
cores (16 ranks on 2 cores): the model is fitted on the 2-rank transport figures, and
``model.check`` sets it beside every measured world.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
WORKER = HERE / "dist_scripts" / "protocol_bench_worker.py"
TARGET_RANKS = 16384
GOAL_SECONDS = 0.100
GOAL_BYTES_RATIO = 1.5


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(world: int, chunks: int, mode: str, saves: int) -> list[dict[str, Any]]:
    """Every rank's result for one world size and layout."""
    with tempfile.TemporaryDirectory(prefix="tiercheck-protocol-") as tmp:
        out = f"{tmp}/r"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(world),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(WORKER),
            "--chunks",
            str(chunks),
            "--mode",
            mode,
            "--saves",
            str(saves),
            "--out",
            out,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{world} ranks failed:\n{proc.stderr[-4000:]}")
        return [json.loads(Path(f"{out}-{r}.json").read_text()) for r in range(world)]


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    saves = range(len(ranks[0]["saves"]))
    per_save = [[r["saves"][i] for r in ranks] for i in saves]
    base = [[r["baseline"][i] for r in ranks] for i in saves]
    transport = {
        k: statistics.median(r["transport"][k] for r in ranks) for k in ranks[0]["transport"]
    }
    return {
        "ranks": len(ranks),
        "bytes_mean": statistics.mean(s["bytes"] for save in per_save for s in save),
        "bytes_max": max(s["bytes"] for save in per_save for s in save),
        "calls": max(s["calls"] for save in per_save for s in save),
        "seconds_mean": statistics.median(
            statistics.mean(s["seconds"] for s in v) for v in per_save
        ),
        "seconds_max": statistics.median(max(s["seconds"] for s in v) for v in per_save),
        "seconds_min": min(max(s["seconds"] for s in v) for v in per_save),
        "owned_total": statistics.median(sum(s["owned"] for s in v) for v in per_save),
        "baseline_bytes_mean": statistics.mean(s["bytes"] for v in base for s in v),
        "baseline_seconds_max": statistics.median(max(s["seconds"] for s in v) for v in base),
        "transport": transport,
    }


def cpu_seconds(chunks: int, repeats: int = 50) -> float:
    """A rank's own work per save for ``chunks`` ids (an owner receives about as many)."""
    from tiercheck.engine.partition import assign_writers, owners, pack_chunks
    from tiercheck.formats.ids import chunk_id

    ids = [(chunk_id(f"cpu/{i}".encode()), 4 << 20) for i in range(chunks)]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        records = pack_chunks(ids)
        dest = owners(records, TARGET_RANKS)
        order = np.argsort(dest, kind="stable")
        np.bincount(dest, minlength=TARGET_RANKS)
        got = records[order]
        answers = assign_writers(got, np.arange(len(got), dtype=np.int64) % 4)
        frozenset(ids[i][0] for i in order[answers.astype(bool)].tolist())
        frozenset(c for c, _ in ids)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def model(layout: list[dict[str, Any]], t_cpu: float) -> dict[str, Any]:
    """The alpha-beta model of a rank's protocol time per save (module docstring)."""
    from tiercheck.engine.partition import RECORD

    two = next(w for w in layout if w["ranks"] == 2)
    beta = (1 << 20) / two["transport"]["gather_1mib_s"]  # bytes/s into a rank
    # a call's cost as the protocol itself pays it (one hop at 2 ranks), Python and torch
    # included: its best save at 2 ranks, the one no other process on this machine delayed
    own = (two["seconds_min"] - t_cpu - two["bytes_mean"] / beta) / two["calls"]
    alpha = max(own, 1e-6)
    xs = np.array([w["ranks"] for w in layout], dtype=float)
    ys = np.array([w["bytes_mean"] for w in layout], dtype=float)
    slope, intercept = np.polyfit(xs, ys, 1)
    calls = two["calls"]

    def predict(n: int) -> dict[str, float]:
        hops = max(1, math.ceil(math.log2(n)))
        nbytes = intercept + slope * n
        latency = calls * alpha * hops
        return {
            "ranks": n,
            "bytes": nbytes,
            "seconds": t_cpu + latency + nbytes / beta,
            "latency_s": latency,
            "transfer_s": nbytes / beta,
            "cpu_s": t_cpu,
        }

    return {
        "formula": "t(N) = t_cpu + calls * alpha * ceil(log2 N) + bytes(N) / beta",
        "t_cpu_s": t_cpu,
        "calls": calls,
        "alpha_s": alpha,
        "beta_bytes_per_s": beta,
        "bytes_intercept": intercept,
        "bytes_per_rank": slope,
        "bytes_per_chunk": RECORD.itemsize + 1,  # a chunk's record in, its answer back
        "at_target": predict(TARGET_RANKS),
        "check": [{**predict(w["ranks"]), "measured_mean_s": w["seconds_mean"]} for w in layout],
        "curve": [predict(1 << k) for k in range(1, 15)],
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, marker in (("sharded", "o"), ("replicated", "s")):
        rows = result["layouts"][mode]["worlds"]
        n = [w["ranks"] for w in rows]
        left.plot(n, [w["bytes_mean"] / 1e3 for w in rows], marker=marker, label=f"{mode}")
        left.plot(
            n,
            [w["baseline_bytes_mean"] / 1e3 for w in rows],
            marker=marker,
            linestyle="--",
            label=f"{mode}, all-gather (before)",
        )
        curve = result["layouts"][mode]["model"]["curve"]
        right.plot(
            [c["ranks"] for c in curve],
            [c["seconds"] * 1e3 for c in curve],
            label=f"model, {mode}",
        )
        right.scatter(
            n, [w["seconds_mean"] * 1e3 for w in rows], marker=marker, label=f"measured, {mode}"
        )
    left.set_xscale("log", base=2)
    left.set_xlabel("ranks")
    left.set_ylabel("KB received per rank per save")
    left.set_title(f"bytes ({result['chunks']} chunk ids per rank)")
    left.legend(fontsize=7)
    right.axhline(GOAL_SECONDS * 1e3, color="grey", linestyle=":", label="goal 100 ms")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("ranks")
    right.set_ylabel("ms of protocol per save")
    right.set_title("time: measured on loopback, modelled to 16,384")
    right.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worlds", default="2,4,8,16")
    p.add_argument("--chunks", type=int, default=300)
    p.add_argument("--saves", type=int, default=10)
    p.add_argument("--modes", default="sharded,replicated")
    p.add_argument("--out", default=str(HERE / "results" / "protocol.json"))
    p.add_argument("--plot", default=str(HERE.parent / "docs" / "benchmarks" / "protocol.png"))
    p.add_argument(
        "--remodel", action="store_true", help="refit the model and plot of --out; run nothing"
    )
    args = p.parse_args()
    if args.remodel:
        result = json.loads(Path(args.out).read_text())
        result.setdefault("t_cpu_s", cpu_seconds(result["chunks"]))
        for layout in result["layouts"].values():
            layout["model"] = model(layout["worlds"], result["t_cpu_s"])
        return finish(result, Path(args.out), Path(args.plot))
    worlds = [int(w) for w in args.worlds.split(",")]
    t_cpu = cpu_seconds(args.chunks)
    layouts: dict[str, Any] = {}
    for mode in args.modes.split(","):
        rows = []
        for world in worlds:
            rows.append(summarize(run_world(world, args.chunks, mode, args.saves)))
            print(json.dumps({"mode": mode, **rows[-1]}), flush=True)
        smallest, largest = rows[0], rows[-1]
        layouts[mode] = {
            "worlds": rows,
            "bytes_ratio": largest["bytes_mean"] / smallest["bytes_mean"],
            "bytes_max_ratio": largest["bytes_max"] / smallest["bytes_max"],
            "baseline_bytes_ratio": largest["baseline_bytes_mean"]
            / smallest["baseline_bytes_mean"],
            "model": model(rows, t_cpu) if 2 in worlds and len(rows) > 1 else None,
        }
    result = {
        "benchmark": "protocol",
        "chunks": args.chunks,
        "t_cpu_s": t_cpu,
        "saves": args.saves,
        "target_ranks": TARGET_RANKS,
        "goals": {"bytes_ratio": GOAL_BYTES_RATIO, "seconds_at_target": GOAL_SECONDS},
        "layouts": layouts,
        "machine": {
            "cpus": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0],
            "python": platform.python_version(),
        },
    }
    return finish(result, Path(args.out), Path(args.plot))


def finish(result: dict[str, Any], out: Path, plot_path: Path) -> int:
    """Write ``result`` and its plot; print the ratios and the model at the target."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    layouts = result["layouts"]
    if all(layout["model"] is not None for layout in layouts.values()):
        plot(result, plot_path)
    for mode, layout in layouts.items():
        m = layout["model"]
        worlds = [w["ranks"] for w in layout["worlds"]]
        print(
            f"{mode}: bytes x{layout['bytes_ratio']:.2f} from {worlds[0]} to {worlds[-1]} ranks "
            f"(all-gather x{layout['baseline_bytes_ratio']:.2f})"
            + (
                f"; model at {TARGET_RANKS}: {m['at_target']['seconds'] * 1e3:.1f} ms, "
                f"{m['at_target']['bytes'] / 1e3:.0f} KB"
                if m
                else ""
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
