"""Log versions through the store: bytes per version of dense AdamW training, before/after.

Trains the fp32 GPT-like model of ``benchmarks/update_log.py`` (AdamW, a schedule,
gradient clipping; random tokens, real backward passes) and saves after every step, side
by side in one run:

- ``diffs``: ``ckpt.guard(opt, log=False)``: what the store did before log versions
  (every version a base or a chunk-dedup diff);
- ``logs``: ``ckpt.guard(opt)``, the default: saves may be log versions.

Two stores for each: the default store (``Checkpointer(root)``, no configuration: shm,
LMDB, a ``file://`` remote), and shm + a peer tier (a real ``tiercheck.peer.daemon``
daemon on loopback, default placement: every version, delta codec). Per version it
records the role and the bytes each tier's write stored (``SaveResult.bytes_written``),
and then the time to restore the newest version from shm (a log version: its base, the
replay and the verification).

Then the same model sharded by FSDP2 (``fully_shard`` of the embedding, every encoder
layer and the head) over 2 ranks (torchrun, gloo, CPU; each rank trains on its own batches), in two
precisions, each with ``log=False`` and by default, one shm tier per rank:

- ``fp32``: fp32 parameters and AdamW state, gradients clipped;
- ``mixed``: bf16 parameters (sharded, reduced and clipped in bf16), fp32 master copies of
  the shards stepped by AdamW with fp32 state; the bf16 parameters are the guard's mirrors.

Per rank and version it records the role and what the rank's shm tier stored.

    python benchmarks/log_versions.py [--scale 1.0] [--saves 12] [--only fsdp2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_lib import disk_dir, store
from cluster_bench import start_daemon
from update_log import _gpt, make_setup

import tiercheck
from tiercheck import TierSpec
from tiercheck.store.lifecycle import destroy_store


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


# --- FSDP2 over 2 ranks -----------------------------------------------------------------


def fsdp2_rank(root: Path, name: str, precision: str, mode: str, scale: float, saves: int) -> None:
    """One rank of the FSDP2 run (under torchrun): train, save after every step, write
    ``ROOT/RANK.json``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same full model on every rank, then sharded
    vocab, d = int(8192 * scale), int(256 * scale) // 4 * 4
    model = _gpt(vocab, d, 4)
    if precision == "mixed":
        model.to(torch.bfloat16)
    for part in (model["emb"], *model["body"].layers, model["head"]):
        fully_shard(part)  # the ModuleDict itself has no forward to shard
    params = list(model.parameters())
    masters = [p.detach().float().requires_grad_(True) for p in params]
    mirrors = list(zip(masters, params)) if precision == "mixed" else []
    opt = torch.optim.AdamW(masters if mirrors else params, lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.01 * s))
    data = torch.Generator().manual_seed(1 + rank)
    loader = {"position": 0}

    def step() -> None:
        loader["position"] += 4
        tokens = torch.randint(0, vocab, (4, 65), generator=data)
        logits = model["head"](model["body"](model["emb"](tokens[:, :-1])))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()  # type: ignore[no-untyped-call]
        nn.utils.clip_grad_norm_(params, 1.0)
        for master, p in mirrors:
            master.grad = p.grad.float()  # type: ignore[union-attr]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for master, p in mirrors:
                p.copy_(master)

    def state() -> dict[str, Any]:
        out = {"model": model, "optim": opt, "sched": sched, "loader": loader}
        return {**out, "master": masters} if mirrors else out

    # a budget for every version kept: shm is the only tier, and with log=False each
    # version of the dense state is as large as a base
    tiers = [TierSpec("shm", f"shm://{name}-{{rank}}", {"budget": "4GiB"})]
    policy = tiercheck.Policy()  # the default placement and budgets, as the rows above
    rows = []
    with tiercheck.Checkpointer(root, tiers=tiers, policy=policy) as ckpt:
        ckpt.guard(opt, log=mode == "logs", mirrors=mirrors)
        for i in range(saves):
            step()
            t0 = time.perf_counter()
            handle = ckpt.save(i + 1, state())
            result = handle.result()
            rows.append(
                {
                    "step": i + 1,
                    "role": handle.role,
                    "logical": result.logical_bytes,
                    "shm": result.bytes_written.get("shm", 0),
                    "save_s": time.perf_counter() - t0,
                }
            )
    (root / f"{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def run_fsdp2(precision: str, mode: str, scale: float, saves: int) -> dict[str, Any]:
    """The FSDP2 run of ``precision`` and ``mode`` on 2 ranks; bytes per rank."""
    root = Path(tempfile.mkdtemp(prefix="tc-bench-fsdp2-", dir=disk_dir()))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(29500 + os.getpid() % 1000),
        __file__,
        "--rank-worker",
        str(root),
        f"bench-fsdp2-{uuid.uuid4().hex[:8]}",
        precision,
        mode,
        "--scale",
        str(scale),
        "--saves",
        str(saves),
    ]
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"the FSDP2 run failed:\n{proc.stderr[-4000:]}")
        ranks = [json.loads((root / f"{r}.json").read_text()) for r in (0, 1)]
    finally:
        if (root / "tiercheck.toml").exists():
            destroy_store(root)  # the root and every rank's shm segments
        shutil.rmtree(root, ignore_errors=True)
    per_rank = []
    for rows in ranks:
        logical = rows[0]["logical"]
        nonbase = [r["shm"] for r in rows if r["role"] != "base"]
        per_rank.append(
            {
                "state_bytes": logical,
                "roles": [r["role"] for r in rows],
                "mean_per_version_x": sum(r["shm"] for r in rows) / len(rows) / logical,
                "mean_per_non_base_version_x": sum(nonbase) / len(nonbase) / logical
                if nonbase
                else None,
                "rows": rows,
            }
        )
    return {"precision": precision, "mode": mode, "ranks": per_rank}


def main() -> None:
    if sys.argv[1:2] == ["--rank-worker"]:
        ap = argparse.ArgumentParser()
        for name in ("root", "name", "precision", "mode"):
            ap.add_argument(name)
        ap.add_argument("--scale", type=float)
        ap.add_argument("--saves", type=int)
        w = ap.parse_args(sys.argv[2:])
        fsdp2_rank(Path(w.root), w.name, w.precision, w.mode, w.scale, w.saves)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="model width multiplier")
    ap.add_argument("--saves", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--only",
        choices=["fsdp2"],
        help="run only the FSDP2 rows and keep the others of --out as they are",
    )
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "log_versions.json"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    disk_dir().mkdir(parents=True, exist_ok=True)  # bench_lib.store() makes its root there
    fsdp2 = []
    for precision in ("fp32", "mixed"):
        for mode in ("diffs", "logs"):
            r = run_fsdp2(precision, mode, args.scale, args.saves)
            fsdp2.append(r)
            shown = "; ".join(
                f"rank {i}: {x['mean_per_version_x']:.3f}x per version"
                + (
                    f" ({x['mean_per_non_base_version_x']:.3f}x per non-base)"
                    if x["mean_per_non_base_version_x"] is not None
                    else ""
                )
                for i, x in enumerate(r["ranks"])
            )
            roles = "".join(x[0] for x in r["ranks"][0]["roles"])
            print(f"fsdp2 {precision} {mode}: roles {roles}; {shown}", file=sys.stderr, flush=True)
    if args.only == "fsdp2":
        doc = json.loads(args.out.read_text())
        doc["fsdp2"] = {"scale": args.scale, "saves": args.saves, "results": fsdp2}
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
        return
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
        "fsdp2": {"scale": args.scale, "saves": args.saves, "results": fsdp2},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
