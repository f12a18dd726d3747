"""A store left running: the footprint of a default store after many guarded saves (issue 25).

A user follows the README: a model (``--model-mib`` of fp32 weights, 12 MiB by default) with
AdamW, ``ckpt.guard(optimizer)``, one ``ckpt.save`` per training step, in ``--processes``
processes of ``--steps`` steps each (4 x 50 = 200 saves), every process restoring where the
previous one stopped, the store's defaults throughout (``Checkpointer(root)``: shm, LMDB and
the ``file://`` remote under the root). Then ``tiercheck gc ROOT --grace 0``: the grace is
set to 0 explicitly because the measurement is of what the store *keeps*, not of what
crashed writers may have left behind (there were none: every process closed its store);
without it, blobs dropped by the last process are still "in grace" when the CLI looks.

Reported per tier, as bytes and as a multiple of the state (model + AdamW moments, the
bytes of one full version):

- ``disk``: the allocated blocks of the tier's files (what ``du`` counts; LMDB's
  ``data.mdb`` never shrinks: pages freed by retention are reused, not returned, and its
  blocks are reserved ahead of its pages), ``apparent``: the files' sizes (``data.mdb`` is
  as large as LMDB's map, which grows with what it holds), and ``held``: what
  ``Tier.usage()`` says the tier's blobs take;
- the versions the tier keeps, by role, and for the remote tier the objects it holds (and
  their names) and the objects per base it keeps (its marker, one per tier and holding
  the owner record, not counted).

    python benchmarks/retention.py [--model-mib 12] [--processes 4] [--steps 50]
        [--out benchmarks/results/retention.json]

The store is deleted at the end (``tiercheck rm``): /dev/shm and the work directory are
left as found.
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
from pathlib import Path
from typing import Any

import torch

from tiercheck.core.sizes import tree_bytes
from tiercheck.store.lifecycle import shm_root_left_as_found

MIB = 1 << 20


def tree_files(path: Path) -> list[str]:
    """Every file under ``path``, relative to it, sorted."""
    return sorted(
        os.path.relpath(os.path.join(d, f), path) for d, _, files in os.walk(path) for f in files
    )


# one per tier, not per version: the tier's marker, which holds its owner record (SPEC 15)
PER_TIER = ("tier.json",)


def model_of(model_mib: float) -> torch.nn.Module:
    """An MLP of about ``model_mib`` MiB of fp32 weights (square layers of width 1024)."""
    width = 1024
    layers = max(1, round(model_mib * MIB / 4 / (width * width + width)))
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))


def train(root: Path, model_mib: float, steps: int, seed: int) -> None:
    """One process of the run: open the default store, restore, train ``steps`` steps with
    a guarded save after each, close."""
    import tiercheck

    torch.manual_seed(0)
    model = model_of(model_mib)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.Generator().manual_seed(seed)
    with tiercheck.Checkpointer(root) as ckpt:
        ckpt.guard(optimizer)
        start = 0
        if ckpt.history():
            info = ckpt.restore({"model": model, "optim": optimizer})
            start = info.step
        for step in range(start + 1, start + steps + 1):
            x = torch.randn(16, 1024, generator=data)
            loss = model(x).square().mean()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            ckpt.save(step, {"model": model, "optim": optimizer})


def tiercheck_cli(*args: str) -> Any:
    done = subprocess.run(
        [sys.executable, "-m", "tiercheck", *args], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout) if "--json" in args else done.stdout


def footprint(root: Path) -> dict[str, Any]:
    """Per tier: disk bytes, held bytes, versions kept by role (read-only open)."""
    import tiercheck

    out: dict[str, Any] = {}
    with tiercheck.Checkpointer(root, read_only=True) as ckpt:
        history = ckpt.history()
        for slot in ckpt.tierset.slots:
            tier = slot.tier
            assert tier is not None
            path = getattr(tier, "path", None)
            if slot.name == "remote":
                path = root / "remote"
            elif slot.name == "lmdb":
                path = root / "lmdb"
            roles: dict[str, int] = {}
            for v in history:
                if v.tiers.get(slot.name) == "committed":
                    roles[v.role] = roles.get(v.role, 0) + 1
            entry: dict[str, Any] = {
                "disk_bytes": tree_bytes(Path(path)) if path is not None else None,
                # LMDB's data.mdb is as large as its map, a sparse file
                "apparent_bytes": (
                    tree_bytes(Path(path), apparent=True) if path is not None else None
                ),
                "held_bytes": tier.usage(),
                "versions": roles,
            }
            if slot.name == "remote" and path is not None:
                files = tree_files(Path(path))
                per_version = [f for f in files if f not in PER_TIER]
                entry["objects"] = len(files)
                entry["files"] = files
                entry["objects_per_base"] = len(per_version) / max(1, roles.get("base", 0))
            out[slot.name] = entry
        out["_steps"] = [v.step for v in history]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="tc-retention-", dir=args.dir))
    root = work / "store"
    try:
        t0 = time.perf_counter()
        for p in range(args.processes):
            subprocess.run(
                [sys.executable, __file__, "--child", str(root), "--model-mib",
                 str(args.model_mib), "--steps", str(args.steps), "--seed", str(p)],
                check=True,
            )  # fmt: skip
        seconds = time.perf_counter() - t0
        model = model_of(args.model_mib)
        params = sum(p.numel() for p in model.parameters())
        state = 3 * 4 * params  # fp32 weights + AdamW's two moments
        before = footprint(root)
        gc = tiercheck_cli("gc", str(root), "--grace", "0", "--json")
        after = footprint(root)
        steps = after.pop("_steps")
        before.pop("_steps")

        def ratios(fp: dict[str, Any]) -> dict[str, Any]:
            out = {}
            for name, e in fp.items():
                out[name] = {
                    **e,
                    "disk_x": None if e["disk_bytes"] is None else e["disk_bytes"] / state,
                    "held_x": None if e["held_bytes"] is None else e["held_bytes"] / state,
                }
            return out

        on_disk = sum(e["disk_bytes"] or 0 for n, e in after.items() if n != "shm")
        apparent = sum(e["apparent_bytes"] or 0 for n, e in after.items() if n != "shm")
        return {
            "benchmark": "retention",
            "machine": platform.node(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "model_mib": args.model_mib,
            "state_bytes": state,
            "saves": args.processes * args.steps,
            "processes": args.processes,
            "steps_per_process": args.steps,
            "train_seconds": seconds,
            "gc": "tiercheck gc ROOT --grace 0 --json",
            "gc_report": gc,
            "versions_listed": len(steps),
            "before_gc": ratios(before),
            "after_gc": ratios(after),
            "on_disk_bytes": on_disk,
            "on_disk_x": on_disk / state,
            "apparent_bytes": apparent,
            "apparent_x": apparent / state,
        }
    finally:
        if root.exists():
            subprocess.run([sys.executable, "-m", "tiercheck", "rm", str(root)],
                           capture_output=True, check=True)  # fmt: skip
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-mib", type=float, default=12.0)
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--dir", default=None, help="work directory (default: the system's tmp)")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        train(Path(args.child), args.model_mib, args.steps, args.seed)
        return
    with shm_root_left_as_found():  # the stores' shm root, if this run made it
        result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    a = result["after_gc"]
    print(
        f"\n{result['saves']} guarded saves of a {result['state_bytes'] / MIB:.0f} MiB state, "
        f"after gc --grace 0: {result['on_disk_x']:.1f}x the state on disk "
        f"({result['apparent_x']:.1f}x by apparent size) "
        + ", ".join(f"{n} {e['disk_x']:.1f}x" for n, e in a.items() if e["disk_x"] is not None)
        + (
            f"; remote {a['remote']['objects']} objects, "
            f"{a['remote']['objects_per_base']:.0f} per base"
            if "remote" in a
            else ""
        ),
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
