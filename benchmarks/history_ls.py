"""How long ``tiercheck ls ROOT --json`` takes on a store with many versions.

Builds (once; reused when ROOT already has the versions) a store of ``--versions`` small
versions (an ``lmdb://`` tier keeping every version, and a ``file://`` remote tier that
receives every 10th, the bases), then times:

- ``history()``: ``Checkpointer(root, read_only=True).history()``, the log read and merge;
- ``ls in-process``: ``tiercheck.cli.main.main(["ls", ROOT, "--json"])``, stdout discarded;
- ``ls subprocess``: ``python -m tiercheck ls ROOT --json``, the whole process;
- ``import tiercheck``: ``python -c "import tiercheck"``, the part of the subprocess that is
  Python and torch starting up, not work on the store.

Median of ``--repeat`` runs each::

    python benchmarks/history_ls.py [--versions 1000] [--root DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tiercheck import Checkpointer, Policy, TierPolicy
from tiercheck.cli.main import main as cli_main


def build(root: Path, versions: int) -> float:
    """Save ``versions`` small versions into a new store at ``root``; returns seconds."""
    policy = Policy(
        base_every=10,
        tiers={
            "lmdb": TierPolicy(versions="all", keep_bases=None),
            "remote": TierPolicy(versions="base", mode="async", codec="zstd", keep_bases=None),
        },
    )
    tiers = [("lmdb", f"lmdb://{root / 'lmdb'}"), ("remote", f"file://{root / 'remote'}")]
    state = {"model": {"w": torch.zeros(256, 64), "b": torch.zeros(64)}, "step": 0}
    t0 = time.perf_counter()
    with Checkpointer(root, tiers=tiers, policy=policy) as ckpt:
        for i in range(versions):
            state["model"]["w"][i % 256, 0] = float(i)
            state["step"] = i
            ckpt.save(i, state, metadata={"loss": 1.0 / (i + 1)}).wait()
        ckpt.wait_migrations()
    return time.perf_counter() - t0


def timed(fn: Callable[[], Any], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", type=int, default=1000)
    ap.add_argument("--root", type=Path, default=None, help="store root (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/history_ls.json"))
    args = ap.parse_args()

    root = args.root or Path(tempfile.mkdtemp(prefix="tiercheck-ls-")) / "store"
    built = None
    have = 0
    if (root / "tiercheck.toml").exists():
        with Checkpointer(root, read_only=True) as ro:
            have = len(ro.history())
    if have != args.versions:
        if have:
            raise SystemExit(f"{root} holds {have} versions, not {args.versions}")
        built = build(root, args.versions)

    def history() -> None:
        with Checkpointer(root, read_only=True) as ro:
            assert len(ro.history()) == args.versions

    def ls_inproc() -> None:
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink):
            assert cli_main(["ls", str(root), "--json"]) == 0
        assert len(json.loads(sink.getvalue())["versions"]) == args.versions

    def ls_subprocess() -> None:
        proc = subprocess.run(
            [sys.executable, "-m", "tiercheck", "ls", str(root), "--json"],
            capture_output=True,
            check=True,
        )
        assert len(json.loads(proc.stdout)["versions"]) == args.versions

    def bare_import() -> None:
        subprocess.run([sys.executable, "-c", "import tiercheck"], check=True)

    ls_inproc()  # warm the page cache and imports
    results = {
        "history()": timed(history, args.repeat),
        "ls in-process": timed(ls_inproc, args.repeat),
        "ls subprocess": timed(ls_subprocess, max(3, args.repeat // 2)),
        "import tiercheck": timed(bare_import, max(3, args.repeat // 2)),
    }
    how = f", built in {built:.1f}s" if built else ""
    print(f"store: {root} ({args.versions} versions{how})")
    print(f"{'what':<18} {'median s':>9} {'min s':>9}")
    for name, runs in results.items():
        print(f"{name:<18} {statistics.median(runs):9.3f} {min(runs):9.3f}")
    doc = {
        "versions": args.versions,
        "build_seconds": built,
        "repeat": args.repeat,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "seconds": {
            name: {"median": statistics.median(runs), "min": min(runs), "runs": runs}
            for name, runs in results.items()
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
